"""What a user on each kind of device gets (README / CARD.md "What runs where"), checked as far as
a CPU machine can: the `kernels` loader's architecture check on this build's archs, the
dispatcher's choice per compute capability (the native kernels are registered for SM90, the
csrc CSR builder and top-k also for SM100, the gated portable tier for SM100 and every other
capability >= 8.0, each csrc op there behind the check that the build has an image of its code
for the device; docs/design-portable.md), and CARD.md rendered as kernel-builder renders it."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from msa import _backend
from msa_testing import CONTRACT_ALL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_variant  # noqa: E402

# compute capability -> whether get_kernel loads the CUDA variant (kernels' ArchValidator): every
# capability >= 8.0 (the portable tier's compute_80 PTX covers those without their own SASS).
LOADS = {(7, 5): False, (8, 0): True, (8, 6): True, (8, 7): True, (8, 9): True, (9, 0): True,
         (10, 0): True, (10, 3): True, (11, 0): True, (12, 0): True, (12, 1): True}


@pytest.fixture
def gpu_of_capability(monkeypatch):
    """Pretend a CUDA device of a given capability is present (no CUDA call is made)."""
    def set_capability(capability):
        monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(_backend, "_arch_of_index", {})
    return set_capability


@pytest.fixture
def closed_portable_gate(monkeypatch):
    """The portable tier's gate closed (PORTABLE_VALIDATED False, as a rewrite of its kernels
    would set it until they pass on the H200 again): its refusals and MSA_UNVALIDATED_KERNELS=1
    are what these tests check."""
    monkeypatch.setattr(_backend, "PORTABLE_VALIDATED", False)


@pytest.mark.parametrize("capability,loads", sorted(LOADS.items()))
def test_get_kernel_architecture_check(tmp_path, gpu_of_capability, capability, loads):
    kernels_rust = pytest.importorskip("kernels._rust")
    from kernels.validate import ArchValidator

    config = build_variant.load_config(ROOT)
    metadata = build_variant.variant_metadata(config, "_msa_cuda_0000000", "cuda",
                                              config.cuda_capabilities)
    path = tmp_path / "metadata.json"
    path.write_text(json.dumps(metadata))
    parsed = kernels_rust.Metadata.read_from_file(path)
    gpu_of_capability(capability)
    variant = "torch213-cxx11-cu130-x86_64-linux"
    if loads:
        ArchValidator().validate_metadata(metadata=parsed, variant=variant)
    else:
        with pytest.raises(RuntimeError, match="check_arch=False"):
            ArchValidator().validate_metadata(metadata=parsed, variant=variant)


def _sparse_features():
    return dict(q_dtype=torch.bfloat16, k_dtype=torch.bfloat16, v_dtype=torch.bfloat16,
                pv_dtype=torch.bfloat16, paged=False, causal=True, qhead_per_kv=16, topk=16,
                partial_dtype=torch.bfloat16, nvfp4=False)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (12, 0)])
def test_other_gpus_without_the_compiled_ops_run_the_reference_with_a_warning(
        gpu_of_capability, monkeypatch, caplog, capability):
    """A package without the compiled ops (the source tree here) on a portable-tier GPU: the
    reference runs with a WARNING naming the tier, the capability and the missing op;
    MSA_BACKEND=native refuses instead."""
    gpu_of_capability(capability)
    monkeypatch.setattr(_backend, "_logged", set())
    monkeypatch.delenv("MSA_BACKEND", raising=False)
    device = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="msa"):
        assert _backend.choose("sparse_atten", device, **_sparse_features()) == \
            (_backend.REFERENCE, None)
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "PyTorch reference" in text and f"{capability[0]}.{capability[1]}" in text
    assert "portable tier" in text and "sparse_prefill_portable is not built" in text
    monkeypatch.setenv("MSA_BACKEND", "native")
    with pytest.raises(NotImplementedError, match="MSA_BACKEND=native"):
        _backend.choose("sparse_atten", device, **_sparse_features())


# The ops of the portable tier: the csrc kernels (docs/design-portable.md, "Per op").
PORTABLE_OPS = {"sparse_atten", "block_max_scores", "build_k2q_csr", "sparse_topk_select",
                "sparse_decode_atten", "decode_indexer_topk", "decode_indexer_plan_update"}


def test_native_registrations_per_architecture():
    """SM90: every native family; SM100 and every other capability >= 8.0: the portable tier
    (the csrc kernels; the CuTe kernels and the decode warpgroup form target sm_90a). Every
    registration off SM90 asks first whether the build has an image for the device."""
    registered = set(_backend.registered())
    for op in PORTABLE_OPS | {"fmha_dense", "fmha_max_score"}:
        assert (op, "sm90") in registered, op
    for arch in ("sm100", "portable"):
        assert {op for op, family in registered if family == arch} == PORTABLE_OPS, arch
        for op in PORTABLE_OPS:
            impl = _backend._registry[(op, arch)]
            assert impl.device_check is not None, (op, arch)
            # The CSR builder and top-k serve SM100 as Hopper kernels do (ungated).
            assert impl.tier == (None if arch == "sm100" and op in (
                "build_k2q_csr", "sparse_topk_select") else "portable"), (op, arch)
    for op in PORTABLE_OPS:
        assert _backend._registry[(op, "sm90")].device_check is None, op


@pytest.mark.parametrize("capability,family", [((9, 0), "sm90"), ((10, 0), "sm100"),
                                               ((8, 0), "portable"), ((8, 6), "portable"),
                                               ((12, 1), "portable"), ((7, 5), None)])
def test_arch_families(gpu_of_capability, monkeypatch, capability, family):
    gpu_of_capability(capability)
    monkeypatch.delenv("MSA_NATIVE_TIER", raising=False)
    device = torch.device("cuda", 0)
    assert _backend.arch_family(device) == family
    monkeypatch.setenv("MSA_NATIVE_TIER", "portable")   # the proxy switch: any capability >= 8.0
    assert _backend.arch_family(device) == (None if family is None else "portable")
    monkeypatch.setenv("MSA_NATIVE_TIER", "hopper")
    with pytest.raises(ValueError, match="MSA_NATIVE_TIER"):
        _backend.arch_family(device)


@pytest.mark.parametrize("capability", [(9, 0), (8, 9)])
def test_portable_tier_is_gated_and_logged(gpu_of_capability, monkeypatch, caplog, capability,
                                           closed_portable_gate):
    """The portable sparse prefill, forced on SM90 or chosen on another GPU: with the tier's gate
    closed (PORTABLE_VALIDATED False), refused (a WARNING naming the tier and the gate) and served
    with MSA_UNVALIDATED_KERNELS=1 (an INFO line: not validated yet); with the gate open, served
    (an INFO line naming the tier, the capability and the proxy validation)."""
    from msa._native import compiled_ops, sparse_prefill_portable
    gpu_of_capability(capability)
    monkeypatch.setattr(_backend, "_logged", set())
    monkeypatch.setattr(compiled_ops, "missing_reason", lambda *names: None)
    monkeypatch.setattr(compiled_ops, "image_reason", lambda device, *names: None)
    monkeypatch.delenv("MSA_BACKEND", raising=False)
    monkeypatch.delenv("MSA_UNVALIDATED_KERNELS", raising=False)
    monkeypatch.setenv("MSA_NATIVE_TIER", "portable")
    device = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="msa"):
        assert _backend.choose("sparse_atten", device, **_sparse_features()) == \
            (_backend.REFERENCE, None)
        assert _backend.reference_only(device)
        monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
        backend, run = _backend.choose("sparse_atten", device, **_sparse_features())
        assert (backend, run) == ("portable", sparse_prefill_portable.run)
        assert not _backend.reference_only(device)
    warning, info = (" ".join(r.getMessage() for r in caplog.records if r.levelno == level)
                     for level in (logging.WARNING, logging.INFO))
    cc = f"{capability[0]}.{capability[1]}"
    assert f"portable tier on compute capability {cc}" in warning
    assert "MSA_UNVALIDATED_KERNELS=1" in warning
    assert f"portable tier (warp-MMA csrc kernels) on compute capability {cc}" in info
    assert "not validated on hardware yet" in info

    caplog.clear()
    monkeypatch.setattr(_backend, "_logged", set())
    monkeypatch.delenv("MSA_UNVALIDATED_KERNELS")
    monkeypatch.setattr(_backend, "PORTABLE_VALIDATED", True)
    with caplog.at_level(logging.INFO, logger="msa"):
        assert _backend.choose("sparse_atten", device, **_sparse_features()) == \
            ("portable", sparse_prefill_portable.run)
        assert not _backend.reference_only(device)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "not run on hardware of this capability, validated by proxy on the H200" in \
        " ".join(r.getMessage() for r in caplog.records)


# One served call per portable op: (op, supports() features, the run function's module and name).
PORTABLE_CALLS = {
    "build_k2q_csr": (dict(return_schedule=True, total_q=4096), "csr_builder", "run"),
    "sparse_topk_select": (dict(topk=16, num_tiles=64, head_reduce=None), "topk_cuda", "run"),
    "sparse_decode_atten": (dict(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                 qhead_per_kv=16, seqlen_q=4, sparse=True, topk=16),
                            "decode_cuda", "run_portable"),
    "decode_indexer_topk": (dict(q_dtype=torch.float8_e4m3fn, k_format="e4m3", topk=16, rows=4),
                            "decode_indexer_cuda", "run"),
    "decode_indexer_plan_update": ({}, "decode_indexer_cuda", "run_plan_update"),
}


@pytest.mark.parametrize("op", sorted(PORTABLE_CALLS))
@pytest.mark.parametrize("capability", [(8, 6), (9, 0), (12, 0)])
def test_portable_csrc_ops_are_gated_and_logged(gpu_of_capability, monkeypatch, caplog,
                                                capability, op, closed_portable_gate):
    """The CSR builder, top-k, decode and decode indexer on the portable tier (chosen on a GPU
    other than SM90, forced on SM90): refused with a WARNING naming the tier and the gate while
    the tier is not validated, served by the tier's run function with MSA_UNVALIDATED_KERNELS=1
    (an INFO line naming the tier and the capability), then by PORTABLE_VALIDATED alone."""
    import importlib
    from msa._native import compiled_ops
    features, module, run_name = PORTABLE_CALLS[op]
    run = getattr(importlib.import_module(f"msa._native.{module}"), run_name)
    gpu_of_capability(capability)
    monkeypatch.setattr(_backend, "_logged", set())
    monkeypatch.setattr(compiled_ops, "missing_reason", lambda *names: None)
    monkeypatch.setattr(compiled_ops, "image_reason", lambda device, *names: None)
    for name in ("MSA_BACKEND", "MSA_UNVALIDATED_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    if capability == (9, 0):
        monkeypatch.setenv("MSA_NATIVE_TIER", "portable")
    device = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="msa"):
        assert _backend.choose(op, device, **features) == (_backend.REFERENCE, None)
        monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
        assert _backend.choose(op, device, **features) == ("portable", run)
        monkeypatch.delenv("MSA_UNVALIDATED_KERNELS")
        monkeypatch.setattr(_backend, "PORTABLE_VALIDATED", True)
        assert _backend.choose(op, device, **features) == ("portable", run)
    warning, info = (" ".join(r.getMessage() for r in caplog.records if r.levelno == level)
                     for level in (logging.WARNING, logging.INFO))
    cc = f"{capability[0]}.{capability[1]}"
    assert f"msa.{op}: running the PyTorch reference" in warning
    assert f"portable tier on compute capability {cc}" in warning
    assert "not validated on hardware yet (MSA_UNVALIDATED_KERNELS=1 serves it)" in warning
    assert f"portable tier (warp-MMA csrc kernels) on compute capability {cc}" in info
    assert "validated by proxy on the H200" in info


E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
# The portable sparse prefill's e4m3 calls (the Hopper tier's dtype modes), served or refused:
# (q, k/v, pv_dtype, partial dtype) -> None (served) or a phrase of the reason.
PORTABLE_SPARSE_E4M3 = [
    ((BF16, E4M3, BF16, BF16), None),             # bf16 q with an FP8 KV cache
    ((E4M3, E4M3, BF16, torch.float16), None),    # mixed FP8 QKV (P.V in 16 bits)
    ((E4M3, E4M3, E4M3, E4M3), None),             # all e4m3: P rounded to e4m3, e4m3 partials
    ((BF16, BF16, BF16, E4M3), None),             # bf16 with e4m3 partials
    ((E4M3, E4M3, E4M3, torch.float32), "FP8 modes are native with bfloat16, float16 and e4m3"),
    ((BF16, E4M3, E4M3, BF16), "not native in the portable tier"),   # no pv e4m3 with bf16 q
]


@pytest.mark.parametrize("dtypes,refusal", PORTABLE_SPARSE_E4M3,
                         ids=lambda v: "-".join(str(d).replace("torch.", "") for d in v)
                         if isinstance(v, tuple) else str(v))
def test_portable_sparse_prefill_serves_the_e4m3_modes(gpu_of_capability, monkeypatch, dtypes,
                                                       refusal, closed_portable_gate):
    """The portable sparse prefill serves the Hopper tier's FP8 modes (e4m3 widened exactly on
    load) behind the tier's gate, and refuses the rest with the reason; on an SM90 or SM100
    device as on any other capability >= 8.0."""
    from msa._native import compiled_ops, sparse_prefill_portable
    q, kv, pv, partial = dtypes
    monkeypatch.setattr(compiled_ops, "missing_reason", lambda *names: None)
    monkeypatch.setattr(compiled_ops, "image_reason", lambda device, *names: None)
    for name in ("MSA_BACKEND", "MSA_UNVALIDATED_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    features = dict(_sparse_features(), q_dtype=q, k_dtype=kv, v_dtype=kv, pv_dtype=pv,
                    partial_dtype=partial)
    verdict = sparse_prefill_portable.supports(**features)
    if refusal is not None:
        assert refusal in verdict
        return
    assert "MSA_UNVALIDATED_KERNELS=1" in verdict        # the tier's gate, nothing else
    gpu_of_capability((8, 9))
    monkeypatch.setattr(_backend, "_logged", set())
    device = torch.device("cuda", 0)
    assert _backend.choose("sparse_atten", device, **features) == (_backend.REFERENCE, None)
    monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
    assert sparse_prefill_portable.supports(**features) is None
    assert _backend.choose("sparse_atten", device, **features) == \
        ("portable", sparse_prefill_portable.run)
    monkeypatch.delenv("MSA_UNVALIDATED_KERNELS")
    monkeypatch.setattr(_backend, "PORTABLE_VALIDATED", True)     # the gate open: served
    assert _backend.choose("sparse_atten", device, **features) == \
        ("portable", sparse_prefill_portable.run)


@pytest.mark.parametrize("q_dtype,k_dtype,served", [(E4M3, E4M3, True), (BF16, BF16, True),
                                                    (E4M3, BF16, False), (BF16, E4M3, False),
                                                    (torch.float16, torch.float16, False)])
def test_portable_indexer_serves_bf16_and_e4m3(gpu_of_capability, monkeypatch, q_dtype, k_dtype,
                                               served):
    """The portable indexer serves bf16/bf16 and e4m3/e4m3 (widened exactly to f16) behind the
    tier's gate; mixed and other dtypes run the reference, with the reason naming them."""
    from msa._native import block_max_score_portable, compiled_ops
    monkeypatch.setattr(compiled_ops, "missing_reason", lambda *names: None)
    monkeypatch.setattr(compiled_ops, "image_reason", lambda device, *names: None)
    monkeypatch.delenv("MSA_BACKEND", raising=False)
    monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
    gpu_of_capability((12, 0))
    monkeypatch.setattr(_backend, "_logged", set())
    features = dict(q_dtype=q_dtype, k_dtype=k_dtype, paged=True, causal=True, num_heads=4,
                    num_k_heads=1, batch=3)
    verdict = block_max_score_portable.supports(**features)
    chosen = _backend.choose("block_max_scores", torch.device("cuda", 0), **features)
    if served:
        assert verdict is None
        assert chosen == ("portable", block_max_score_portable.run)
    else:
        assert f"q_idx/k_idx dtypes {q_dtype}/{k_dtype}" in verdict
        assert chosen == (_backend.REFERENCE, None)


class _FakeImages:
    """ops.csrc_image as the driver would answer for one device: (binaryVersion, ptxVersion,
    error) per csrc unit; counts the questions."""

    def __init__(self, answers):
        self.answers, self.asked = answers, []

    def csrc_image(self, unit, device):
        self.asked.append((unit, device))
        return self.answers.get(unit, (0, 0, "cudaErrorNoKernelImageForDevice: no kernel "
                                              "image is available for execution on the device"))


@pytest.fixture
def driver_images(monkeypatch):
    """Answer ops.csrc_image from a table (compiled_ops sees every op as built)."""
    from msa._native import compiled_ops

    def install(answers):
        fake = _FakeImages(answers)
        monkeypatch.setattr(compiled_ops, "ops", fake)
        monkeypatch.setattr(compiled_ops, "missing_reason", lambda *names: None)
        monkeypatch.setattr(compiled_ops, "_image", {})
        return fake
    return install


@pytest.mark.parametrize("capability,answer,runs", [
    ((8, 6), (80, 80, ""), True),           # sm_80 SASS runs on 8.6
    ((12, 1), (121, 80, ""), True),         # compute_80 PTX, JIT-compiled by the driver
    ((9, 0), (90, 90, ""), True),           # sm_90a
    ((8, 6), (89, 89, ""), False),          # SASS of a later minor: not runnable (never picked)
    ((10, 0), (90, 90, ""), False),         # another major's SASS
    ((8, 9), None, False),                  # the driver found nothing
])
def test_image_check_reads_the_drivers_answer_once_per_device(gpu_of_capability, driver_images,
                                                              capability, answer, runs):
    from msa._native import compiled_ops
    gpu_of_capability(capability)
    fake = driver_images({} if answer is None else {"decode_attention": answer})
    device = torch.device("cuda", 0)
    for _ in range(3):
        reason = compiled_ops.image_reason(device, "sparse_decode_attention")
        assert (reason is None) == runs, reason
    assert fake.asked == [("decode_attention", 0)]
    if not runs:
        cc = f"{capability[0]}.{capability[1]}"
        assert f"no image of csrc/decode_attention.cu that compute capability {cc} runs" in reason
        assert f"cuda-capabilities must cover {cc}" in reason
        assert ("cudaErrorNoKernelImageForDevice" in reason) == (answer is None)


def test_portable_op_without_an_image_runs_the_reference_with_a_warning(
        gpu_of_capability, driver_images, monkeypatch, caplog):
    """A build whose cuda-capabilities lack the device's arch: the portable tier's csrc ops are
    refused before any launch (the reference runs, a WARNING says why), and with
    MSA_BACKEND=native the call raises; units the build does cover still serve."""
    from msa._native import topk_cuda
    gpu_of_capability((8, 6))
    fake = driver_images({"sparse_topk_select": (80, 80, "")})
    monkeypatch.setattr(_backend, "_logged", set())
    monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
    monkeypatch.delenv("MSA_BACKEND", raising=False)
    device = torch.device("cuda", 0)
    features = PORTABLE_CALLS["build_k2q_csr"][0]
    with caplog.at_level(logging.WARNING, logger="msa"):
        assert _backend.choose("build_k2q_csr", device, **features) == (_backend.REFERENCE, None)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "portable tier on compute capability 8.6: this build has no image of " \
        "csrc/build_k2q_csr.cu" in text
    topk_features = PORTABLE_CALLS["sparse_topk_select"][0]
    assert _backend.choose("sparse_topk_select", device, **topk_features) == \
        ("portable", topk_cuda.run)
    monkeypatch.setenv("MSA_BACKEND", "native")
    with pytest.raises(NotImplementedError, match="no image of csrc/build_k2q_csr.cu"):
        _backend.choose("build_k2q_csr", device, **features)
    assert sorted(fake.asked) == [("build_k2q_csr", 0), ("sparse_topk_select", 0)]


def test_portable_decode_never_launches_the_warpgroup_form(monkeypatch, native_hooks):
    """The decode warpgroup form (wgmma) and its ping-pong form are sm_90a code: the portable
    tier's run passes warpgroup=False and pingpong=False even when the hooks force them; the
    Hopper run honours the hooks."""
    from msa._native import decode_cuda
    launched = []                          # (warpgroup, pingpong) per launch
    monkeypatch.delenv("MSA_UNVALIDATED_KERNELS", raising=False)
    monkeypatch.setattr(decode_cuda, "ops", SimpleNamespace(
        # (..., warpgroup, pingpong, qo_tile_rows, request_pages, persistent_ctas, pv_fp8,
        #  token_warps)
        sparse_decode_attention=lambda *args: launched.append(tuple(args[-7:-5]))))
    schedule = SimpleNamespace(split_kv=False, request_indices=torch.zeros(1),
                               kv_tile_indices=None,
                               qo_tile_indices=None, num_splits=None, merge_indptr=None,
                               kv_chunk_size=1, qo_tile_rows=128, persistent_ctas=0)
    call = SimpleNamespace(q=None, k=None, v=None, q2k_indices=None, page_table=None,
                           seqused_k=None, schedule=schedule, out=None, lse=None, seqlen_q=8,
                           qhead_per_kv=16, pv_quant_dtype=None, softmax_scale=1.0)
    native_hooks.force(decode_warpgroup=True, decode_pingpong=False)
    decode_cuda.run_portable(call)
    decode_cuda.run(call)
    native_hooks.force(decode_warpgroup=True, decode_pingpong=True)
    decode_cuda.run_portable(call)
    decode_cuda.run(call)
    assert launched == [(False, False), (True, False), (False, False), (True, True)]


def test_portable_indexer_serves_one_key_head(monkeypatch, closed_portable_gate):
    """What the portable indexer refuses besides dtypes (the reference serves it); a served
    call reaches the gate."""
    from msa._native import block_max_score_portable, compiled_ops
    monkeypatch.setattr(compiled_ops, "missing_reason", lambda *names: None)
    monkeypatch.delenv("MSA_UNVALIDATED_KERNELS", raising=False)
    features = dict(q_dtype=torch.bfloat16, k_dtype=torch.bfloat16, paged=False, causal=True,
                    num_heads=4, num_k_heads=1, max_k_tiles=8, qo_offset=False, batch=2)
    for change, why in ((dict(num_k_heads=2), "one shared key head"),
                        (dict(num_heads=16), "16 index heads"),
                        (dict(batch=70000), "70000 requests")):
        assert why in block_max_score_portable.supports(**{**features, **change})
    assert "MSA_UNVALIDATED_KERNELS=1" in block_max_score_portable.supports(**features)
    monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
    assert block_max_score_portable.supports(**features) is None


def test_portable_sparse_prefill_refusals(monkeypatch, closed_portable_gate):
    """What the portable sparse prefill refuses besides dtypes (the reference serves it), before
    its gate; every partial dtype of a bf16 call reaches the gate."""
    from msa._native import compiled_ops, sparse_prefill_portable
    monkeypatch.setattr(compiled_ops, "missing_reason", lambda *names: None)
    monkeypatch.delenv("MSA_UNVALIDATED_KERNELS", raising=False)
    features = _sparse_features()
    for change, why in ((dict(qhead_per_kv=3), "qhead_per_kv 3"),
                        (dict(nvfp4=True), "NVFP4"),
                        (dict(q_dtype=torch.float16, k_dtype=torch.float16,
                              v_dtype=torch.float16), "not native in the portable tier")):
        assert why in sparse_prefill_portable.supports(**{**features, **change})
    for partial in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        assert "MSA_UNVALIDATED_KERNELS=1" in sparse_prefill_portable.supports(
            **{**features, "partial_dtype": partial})


def test_card_renders_as_kernel_builder_fills_it():
    """kernel-builder's fill-card renders CARD.md (minijinja, trim_blocks) with the repo id,
    version, license, upstream and the package's __all__; the result is the Hub README."""
    jinja2 = pytest.importorskip("jinja2")
    import tomllib

    config = tomllib.loads((ROOT / "build.toml").read_text())
    general = config["general"]
    template = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    card = template.from_string((ROOT / "CARD.md").read_text()).render(
        repo_id=general["hub"]["repo-id"], version=general["version"], functions=CONTRACT_ALL,
        layers=None, has_benchmark=False, upstream=general["upstream"], source=None,
        license=general["license"].lower())
    assert card.startswith("---\nlibrary_name: kernels\nlicense: mit\n")
    assert 'get_kernel("MiniMaxAI/msa", version=0, trust_remote_code=True)' in card
    for name in CONTRACT_ALL:
        assert f"- `{name}`" in card
    assert "{{" not in card and "{%" not in card
    for device in ("H100 / H200", "B200", "A100", "CPU-only torch"):
        assert device in card
