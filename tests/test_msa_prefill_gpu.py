"""The whole MSA prefill (msa.msa_prefill: index scores -> top-k with the own block forced ->
k2q CSR + schedule -> sparse attention) natively on the GPU (issue 4, deliverable 3).

Checks, on fresh random varlen inputs (lengths not multiples of 128):
- every stage ran natively (MSA_BACKEND=native raises instead of falling back);
- the selection equals the brute-force top-k of the native index scores (ties: lower id),
  own block forced, ascending with a -1 tail (as tests/test_indexer.py checks on the CPU);
- bf16: O against a float64 dense masked attention built from that selection, within 2e-2
  (abs + rel, as the CPU test); e4m3 q/k/v: O against the reference backend's sparse attention
  on the same selection (P rounded to e4m3 as the kernel does), within the contract's FP8 bound
  max(0.125, 4 bf16 floor), 0.5 with e4m3 partials;
- the pipeline is capturable: a CUDA graph of msa_prefill replayed on new inputs copied into
  the captured buffers gives the eager result bit for bit (no host synchronization inside).
"""

import pytest
import torch

import msa
from msa import _backend
from test_indexer import cu, dense_attention_from_selection
from test_topk import brute_select

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]
E4M3 = torch.float8_e4m3fn
Q_LENS, K_LENS = (300, 1000, 777), (300, 1200, 777)


def _inputs(dtype, gen, hkv=4, g=16):
    dev = torch.device("cuda")
    tq, tk = sum(Q_LENS), sum(K_LENS)
    draw = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(dev)  # noqa: E731
    return dict(q=draw(tq, hkv * g, 128), k=draw(tk, hkv, 128), v=draw(tk, hkv, 128),
                q_idx=draw(tq, hkv, 128), k_idx=draw(tk, 1, 128),
                cu_seqlens_q=cu(Q_LENS).to(dev), cu_seqlens_k=cu(K_LENS).to(dev))


def _run(args, topk, partial_dtype):
    return msa.msa_prefill(**args, max_seqlen_q=max(Q_LENS), max_seqlen_k=max(K_LENS), topk=topk,
                           partial_dtype=partial_dtype, return_selection=True)


@pytest.mark.parametrize("dtype,partial_dtype", [(torch.bfloat16, torch.bfloat16),
                                                 (E4M3, torch.bfloat16), (E4M3, E4M3)],
                         ids=["bf16", "e4m3", "e4m3-e4m3-partials"])
def test_msa_prefill_native_matches_the_selection_oracle(dtype, partial_dtype, seed,
                                                         monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    topk = 8
    args = _inputs(dtype, gen)
    monkeypatch.setenv("MSA_BACKEND", "native")
    out, q2k = _run(args, topk, partial_dtype)
    torch.cuda.synchronize()
    for op in ("block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten"):
        assert _backend.last_backend(op) == "sm90", f"{op} ran on {_backend.last_backend(op)}"
    scores = msa.block_max_scores(args["q_idx"], args["k_idx"], args["cu_seqlens_q"],
                                  args["cu_seqlens_k"], max_seqlen_q=max(Q_LENS),
                                  max_seqlen_k=max(K_LENS))
    monkeypatch.delenv("MSA_BACKEND")
    assert not torch.isnan(out).any()

    tok = torch.arange(sum(Q_LENS))
    request = torch.searchsorted(cu(Q_LENS)[1:], tok, right=True)
    ql = torch.tensor(Q_LENS)[request]
    kl = torch.tensor(K_LENS)[request]
    own = ((tok - cu(Q_LENS)[request].long() + kl - ql) // 128).to(torch.int32)
    nvp = ((kl + 127) // 128).to(torch.int32)
    want = brute_select(scores.cpu(), topk, nvp, 0, 1, own).permute(1, 0, 2)
    assert torch.equal(q2k.cpu(), want), "selection != brute-force top-k of the native scores"

    o64 = dense_attention_from_selection(args["q"].cpu().float(), args["k"].cpu().float(),
                                         args["v"].cpu().float(), q2k.cpu(), Q_LENS, K_LENS,
                                         128 ** -0.5)
    if dtype == torch.bfloat16:
        err = (out.cpu().double() - o64).abs().max().item()
        print(f"bf16: max|O - O64| = {err:.3e}")
        torch.testing.assert_close(out.cpu().double(), o64, atol=2e-2, rtol=2e-2)
        return
    # e4m3: the reference backend's attention on the native selection (same P rounding).
    g = args["q"].shape[1] // args["k"].shape[1]
    lens = dict(max_seqlen_q=max(Q_LENS), max_seqlen_k=max(K_LENS))
    monkeypatch.setenv("MSA_BACKEND", "reference")
    row_ptr, q_ids = msa.build_k2q_csr(q2k, args["cu_seqlens_q"], args["cu_seqlens_k"], 128,
                                       total_k=sum(K_LENS), qhead_per_kv=g, **lens)
    ref = msa.sparse_atten_func(args["q"], args["k"], args["v"], row_ptr, q_ids, topk,
                                cu_seqlens_q=args["cu_seqlens_q"],
                                cu_seqlens_k=args["cu_seqlens_k"], causal=True,
                                partial_dtype=partial_dtype, **lens)
    monkeypatch.delenv("MSA_BACKEND")
    err = (out.double() - ref.double()).abs().max().item()
    floor = (o64.to(torch.bfloat16).double() - o64).abs().max().item()
    bound = 0.5 if partial_dtype == E4M3 else max(0.125, 4 * floor)
    print(f"e4m3 partials {partial_dtype}: max|O - O_ref| = {err:.3e} (bound {bound:.3e})")
    assert err <= bound


def test_msa_prefill_is_capturable_in_a_cuda_graph(seed, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    args = _inputs(torch.bfloat16, gen, hkv=2, g=8)
    monkeypatch.setenv("MSA_BACKEND", "native")
    _run(args, 16, torch.bfloat16)                 # warm-up: loads the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, q2k = _run(args, 16, torch.bfloat16)
    fresh = _inputs(torch.bfloat16, gen, hkv=2, g=8)
    for name in ("q", "k", "v", "q_idx", "k_idx"):
        args[name].copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_q2k = _run(fresh, 16, torch.bfloat16)
    torch.cuda.synchronize()
    monkeypatch.delenv("MSA_BACKEND")
    assert torch.equal(q2k, eager_q2k)
    assert torch.equal(out, eager_out)
