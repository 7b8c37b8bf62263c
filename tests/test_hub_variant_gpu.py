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


@pytest.mark.parametrize("causal", [True, False])
def test_e4m3_fmha_native_with_the_compiled_v_transpose(causal, seed, monkeypatch):
    from msa._native import fmha_sm90

    gen = torch.Generator().manual_seed(seed)
    q_lens, kv_lens, hq, hkv = [300, 1000], [300, 1200], 8, 2
    dev = torch.device("cuda")
    draw = lambda *s: torch.randn(*s, generator=gen).to(E4M3).to(dev)  # noqa: E731
    q, k, v = draw(sum(q_lens), hq, 128), draw(sum(kv_lens), hkv, 128), \
        draw(sum(kv_lens), hkv, 128)
    plan = msa.fmha_plan(torch.tensor(q_lens), torch.tensor(kv_lens), hq, hkv, causal=causal,
                         device=dev)
    (out, _), (ref_out, _), served = _both_backends(
        monkeypatch, lambda: msa.fmha(q, k, v, plan), ["fmha_dense"])
    assert served == {"fmha_dense": "sm90"}
    assert fmha_sm90.last_variant is not None
    assert fmha_sm90.variant_form(fmha_sm90.last_variant) in fmha_sm90.V_TRANSPOSED_FORMS
    assert (out.float() - ref_out.float()).abs().max().item() <= 0.125
