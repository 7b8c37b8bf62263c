"""The compiled variant as kernel-builder lays it out serves every native op family (issue 25).

Runs against ``MSA_TEST_PACKAGE_DIR`` (tools/gpu_session.sh points it at the variant
tools/build_variant.py just built), whose ``_ops.py`` must be kernel-builder's template verbatim.
Every call runs with ``MSA_BACKEND=native`` (a fallback raises) and the dispatcher's record of
the backend is checked per stage: the whole ``msa_prefill`` (indexer, top-k, k2q CSR, sparse
attention), paged decode (dense and sparse), and the e4m3 dense FMHA (whose V transpose is a
compiled op). Each result is compared with the reference backend on the same inputs, so a
served-but-wrong kernel fails too (the per-kernel accuracy tests live in the other *_gpu.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import msa
from msa import _backend

from test_decode import make_batch, random_q2k

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]
ROOT = Path(__file__).resolve().parents[1]
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def compiled_variant():
    path = os.environ.get("MSA_TEST_PACKAGE_DIR")
    if not path:
        pytest.skip("set MSA_TEST_PACKAGE_DIR to a compiled variant (build/<variant>)")
    sys.path.insert(0, str(ROOT / "tools"))
    import build_variant

    variant = Path(path)
    ops = json.loads((variant / "metadata.json").read_text())["id"]
    assert (variant / "_ops.py").read_text() == build_variant.ops_module_source(ops, True), \
        "the variant's _ops.py is not kernel-builder's template"
    assert Path(msa.__file__).resolve().parent == variant.resolve()
    from msa._native import compiled_ops
    assert compiled_ops.missing_reason(*compiled_ops.CSRC_OPS) is None
    return variant


def _both_backends(monkeypatch, fn, ops):
    """fn() natively (MSA_BACKEND=native), then with the reference; returns both results and
    the backend that served each of `ops` in the native run."""
    monkeypatch.setenv("MSA_BACKEND", "native")
    native = fn()
    torch.cuda.synchronize()
    served = {op: _backend.last_backend(op) for op in ops}
    monkeypatch.setenv("MSA_BACKEND", "reference")
    reference = fn()
    monkeypatch.delenv("MSA_BACKEND")
    return native, reference, served


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3], ids=["bf16", "e4m3"])
def test_msa_prefill_every_stage_native(dtype, seed, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens, hkv, group = (200, 700), (200, 900), 2, 8
    dev = torch.device("cuda")
    draw = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(dev)  # noqa: E731
    tq, tk = sum(q_lens), sum(k_lens)
    args = dict(q=draw(tq, hkv * group, 128), k=draw(tk, hkv, 128), v=draw(tk, hkv, 128),
                q_idx=draw(tq, hkv, 128), k_idx=draw(tk, 1, 128),
                cu_seqlens_q=_cu(q_lens).to(dev), cu_seqlens_k=_cu(k_lens).to(dev),
                max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), topk=8,
                return_selection=True)
    stages = ("block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten")
    (out, q2k), (ref_out, ref_q2k), served = _both_backends(
        monkeypatch, lambda: msa.msa_prefill(**args), stages)
    assert served == dict.fromkeys(stages, "sm90"), served
    assert torch.isfinite(out.float()).all()
    # Near-ties in the index scores may pick other blocks: compare rows whose selection agrees.
    same = (q2k == ref_q2k).all(-1).all(0)
    assert same.float().mean() > 0.9
    err = (out.float() - ref_out.float())[same].abs().max().item()
    assert err <= (0.125 if dtype == E4M3 else 2e-2), err


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3], ids=["bf16", "e4m3"])
def test_paged_decode_native(dtype, sparse, monkeypatch):
    lens, seqlen_q, hkv, group = [129, 1000, 77], 1, 2, 16
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, dtype, dtype,
                                           device="cuda")
    q2k = random_q2k(lens, seqlen_q, hkv, 8).cuda() if sparse else None

    def run():
        wrapper = msa.SparseDecodePagedAttentionWrapper()
        wrapper.plan(page_table=table, seqused_k=seqused_k, seqlen_q=seqlen_q,
                     max_seqlen_k=max(lens), q2k_indices=q2k, num_qo_heads=hkv * group,
                     num_kv_heads=hkv)
        return wrapper.run(q, k, v, return_softmax_lse=True)

    (out, lse), (ref_out, ref_lse), served = _both_backends(monkeypatch, run,
                                                            ["sparse_decode_atten"])
    assert served == {"sparse_decode_atten": "sm90"}
    tol = 0.125 if dtype == E4M3 else 2e-2
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=0)   # -inf rows equal


def _fmha_inputs(dtype, seed, causal=True, hq=8, hkv=2):
    """q, k, v of two requests (300 / 300 and 1000 / 1200 tokens) on the GPU, and their plan."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [300, 1000], [300, 1200]
    draw = lambda *s: torch.randn(*s, generator=gen).to(dtype).cuda()  # noqa: E731
    q, k, v = draw(sum(q_lens), hq, 128), draw(sum(kv_lens), hkv, 128), \
        draw(sum(kv_lens), hkv, 128)
    plan = msa.fmha_plan(torch.tensor(q_lens), torch.tensor(kv_lens), hq, hkv, causal=causal,
                         device=q.device)
    return q, k, v, plan


@pytest.mark.parametrize("causal", [True, False])
def test_e4m3_fmha_native_with_the_compiled_v_transpose(causal, seed, monkeypatch,
                                                        native_hooks):
    from msa._native import fmha_sm90

    q, k, v, plan = _fmha_inputs(E4M3, seed, causal)
    # The planner may split these short requests over the KV (the split-KV form reads V as
    # stored); this test is about the forms that read V transposed by the compiled op.
    native_hooks.force(fmha_split_kv=False)
    (out, _), (ref_out, _), served = _both_backends(
        monkeypatch, lambda: msa.fmha(q, k, v, plan), ["fmha_dense"])
    assert served == {"fmha_dense": "sm90"}
    variant = native_hooks.last_variant("fmha_dense")
    assert variant is not None
    assert variant.rsplit("_", 1)[1] in fmha_sm90.V_TRANSPOSED_FORMS, variant
    assert (out.float() - ref_out.float()).abs().max().item() <= 0.125


# ---------------------------------------------------------------------------------------------
# torch.compile on the native path (the CPU twin is tests/test_torch_compile.py)
# ---------------------------------------------------------------------------------------------

def _compiled_and_eager(monkeypatch, fn, ops, *args):
    """fn compiled with fullgraph=True (Inductor) and eager, both with MSA_BACKEND=native;
    asserts every op in `ops` ran natively in the compiled call. Returns (compiled, eager)."""
    monkeypatch.setenv("MSA_BACKEND", "native")
    torch._dynamo.reset()
    eager = fn(*args)
    for op in ops:
        _backend._last_backend.pop(op, None)
    compiled = torch.compile(fn, fullgraph=True)(*args)
    torch.cuda.synchronize()
    served = {op: _backend.last_backend(op) for op in ops}
    monkeypatch.delenv("MSA_BACKEND")
    assert served == dict.fromkeys(ops, "sm90"), served
    return compiled, eager


def _assert_same(compiled, eager):
    for a, b in zip(compiled if isinstance(compiled, tuple) else (compiled,),
                    eager if isinstance(eager, tuple) else (eager,)):
        if a is None or b is None:
            assert a is None and b is None
            continue
        # The same kernels on the same inputs: selections exactly, values within bf16 rounding.
        tol = 2e-2 if a.is_floating_point() else 0
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, equal_nan=True)


def test_torch_compile_msa_prefill_and_sparse_atten_native(seed, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens, hkv, group = (300, 700), (300, 900), 4, 16
    dev = torch.device("cuda")
    draw = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16).to(dev)  # noqa: E731
    tq, tk = sum(q_lens), sum(k_lens)
    q, k, v = draw(tq, hkv * group, 128), draw(tk, hkv, 128), draw(tk, hkv, 128)
    q_idx, k_idx = draw(tq, hkv, 128), draw(tk, 1, 128)
    cu_q, cu_k = _cu(q_lens).to(dev), _cu(k_lens).to(dev)
    lens = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))

    def prefill(q, k, v, q_idx, k_idx):
        return msa.msa_prefill(q, k, v, q_idx, k_idx, cu_q, cu_k, topk=16,
                               return_selection=True, **lens)

    stages = ("block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten")
    compiled, eager = _compiled_and_eager(monkeypatch, prefill, stages, q, k, v, q_idx, k_idx)
    _assert_same(compiled, eager)
    q2k = eager[1]

    def attention(q, k, v):
        row_ptr, q_ids, schedule = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=tk,
                                                     qhead_per_kv=group, return_schedule=True,
                                                     **lens)
        return msa.sparse_atten_func(q, k, v, row_ptr, q_ids, 16, cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k, causal=True, schedule=schedule,
                                     return_softmax_lse=True, **lens)

    compiled, eager = _compiled_and_eager(monkeypatch, attention,
                                          ("build_k2q_csr", "sparse_atten"), q, k, v)
    _assert_same(compiled, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3], ids=["bf16", "e4m3"])
def test_torch_compile_fmha_native(dtype, seed, monkeypatch):
    q, k, v, plan = _fmha_inputs(dtype, seed, hq=16)
    compiled, eager = _compiled_and_eager(monkeypatch, lambda q, k, v: msa.fmha(q, k, v, plan),
                                          ("fmha_dense",), q, k, v)
    _assert_same(compiled, eager)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_torch_compile_decode_run_native(sparse, monkeypatch):
    lens, hkv, group = [129, 1000, 77], 2, 16
    q, k, v, table, seqused_k = make_batch(lens, 1, hkv, group, device="cuda")
    q2k = random_q2k(lens, 1, hkv, 8).cuda() if sparse else None
    wrapper = msa.SparseDecodePagedAttentionWrapper()
    wrapper.plan(page_table=table, seqused_k=seqused_k, seqlen_q=1, max_seqlen_k=max(lens),
                 q2k_indices=q2k, num_qo_heads=hkv * group, num_kv_heads=hkv)
    compiled, eager = _compiled_and_eager(
        monkeypatch, lambda q, k, v: wrapper.run(q, k, v, return_softmax_lse=True),
        ("sparse_decode_atten",), q, k, v)
    _assert_same(compiled, eager)


def test_opcheck_custom_ops_on_the_native_path(seed, monkeypatch):
    """Each custom op on arguments recorded from native calls (schema, fake vs real, dynamic
    AOT tracing), as tests/test_torch_compile.py does on the CPU."""
    from op_recording import OpCallRecording

    recording = OpCallRecording(msa, monkeypatch)
    monkeypatch.setenv("MSA_BACKEND", "native")
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    draw = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16).to(dev)  # noqa: E731
    q_lens, k_lens = (200, 300), (200, 500)
    tq, tk = sum(q_lens), sum(k_lens)
    cu_q, cu_k = _cu(q_lens).to(dev), _cu(k_lens).to(dev)
    msa.msa_prefill(draw(tq, 32, 128), draw(tk, 2, 128), draw(tk, 2, 128), draw(tq, 2, 128),
                    draw(tk, 1, 128), cu_q, cu_k, max_seqlen_q=300, max_seqlen_k=500, topk=8)
    plan = msa.fmha_plan(torch.tensor(q_lens), torch.tensor(k_lens), 32, 2, causal=True,
                         output_maxscore=True, device=dev)
    msa.fmha(draw(tq, 32, 128), draw(tk, 2, 128), draw(tk, 2, 128), plan)
    q, k, v, table, seqused_k = make_batch([129, 600], 1, 2, 16, device="cuda")
    msa.SparseDecodePagedAttentionWrapper().plan(
        page_table=table, seqused_k=seqused_k, seqlen_q=1, max_seqlen_k=600, num_qo_heads=32,
        num_kv_heads=2, fixed_split_size=1).run(q, k, v, return_softmax_lse=True)
    monkeypatch.delenv("MSA_BACKEND")
    recording.check()
