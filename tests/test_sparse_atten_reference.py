"""The sparse attention reference against an independent float64 dense-mask computation
(contract §0 and §1.2), on the CPU."""

import dataclasses
import math

import pytest
import torch

import msa
from msa import interface
from msa.sparse_index_utils import build_k2q_csr_torch_reference
from msa_testing import cu_seqlens, dense_oracle, random_q2k, to_paged

# (G, topK) pairs cover every G and every topK without the full product.
CASES = [(1, 4), (2, 8), (4, 16), (8, 32), (16, 8), (16, 32)]


def _lengths(gen, batch=3):
    # Never multiples of 128, a short request, and one with more queries than keys' blocks.
    q_lens = [int(x) for x in torch.randint(1, 260, (batch,), generator=gen)]
    k_lens = [q + int(x) for q, x in zip(q_lens, torch.randint(0, 300, (batch,), generator=gen))]
    k_lens = [k + 1 if k % 128 == 0 else k for k in k_lens]
    return q_lens, k_lens


def _call(q, k, v, q2k, q_lens, k_lens, *, causal, temperature=1.0, page_table=None,
          seqused_k=None, **kw):
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    topk = q2k.shape[2]
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=sum(k_lens))
    return interface.check_sparse_atten_args(
        q, k, v, row_ptr, q_idx, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), blk_kv=128, causal=causal,
        softmax_scale=None, lse_temperature_scale=temperature, return_temperature_lse=True,
        partial_dtype=torch.float32, return_softmax_lse=True, page_table=page_table,
        seqused_k=seqused_k, schedule=None, usable_SM_count=-1, qk_dtype=None, pv_dtype=None,
        kv_dtypes=(torch.bfloat16, torch.float8_e4m3fn), kv_last_dim=128)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("g,topk", CASES)
def test_reference_matches_dense_mask_float64(g, topk, causal, paged, seed):
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    q_lens, k_lens = _lengths(gen)
    q = torch.randn(sum(q_lens), hkv * g, 128, generator=gen).bfloat16()
    k = torch.randn(sum(k_lens), hkv, 128, generator=gen).bfloat16()
    v = torch.randn(sum(k_lens), hkv, 128, generator=gen).bfloat16()
    # Block 1 is never selected: queries whose only candidates are masked get empty rows.
    q2k = random_q2k(q_lens, k_lens, hkv, topk, generator=gen, skip_block=1)
    q2k[:, torch.randperm(q2k.shape[1], generator=gen)[:5]] = -1    # rows that select nothing
    page_table = seqused = None
    kk, vv = k, v
    if paged:
        kk, vv, page_table, seqused = to_paged(k, v, k_lens, generator=gen)
    temperature = 2.0
    call = _call(q, kk, vv, q2k, q_lens, k_lens, causal=causal, temperature=temperature,
                 page_table=page_table, seqused_k=seqused)
    call64 = dataclasses.replace(call, partial_dtype=torch.float64)
    out, lse, lse_t = interface.sparse_attention_reference(call64, compute_dtype=torch.float64)
    ref_o, ref_lse, ref_lse_t = dense_oracle(q, kk, vv, q2k, q_lens, k_lens, causal=causal,
                                             scale=128 ** -0.5, temperature=temperature,
                                             page_table=page_table, seqused_k=seqused)
    assert torch.allclose(out, ref_o, atol=1e-10, rtol=0)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-10, rtol=0)
    assert torch.allclose(lse_t[finite], ref_lse_t[finite], atol=1e-10, rtol=0)
    assert (~finite).any() and (out[~finite] == 0).all()      # empty rows: O = 0, LSE = -inf
    # In float32 (the reference's default), agreement is to float32 rounding.
    out32, lse32, _ = interface.sparse_attention_reference(call)
    assert (out32.double() - ref_o).abs().max() < 2e-5
    assert torch.allclose(lse32[finite].double(), ref_lse[finite], atol=2e-5, rtol=0)


def test_public_api_shapes_dtypes_and_lse_aliasing(seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [130, 5, 257], [300, 129, 257]
    q = torch.randn(sum(q_lens), 8, 128, generator=gen).bfloat16()
    k = torch.randn(sum(k_lens), 2, 128, generator=gen).bfloat16()
    v = torch.randn_like(k)
    q2k = random_q2k(q_lens, k_lens, 2, 8, generator=gen)
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=sum(k_lens))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=257, max_seqlen_k=300,
              causal=True)
    o = msa.sparse_atten_func(q, k, v, row_ptr, q_idx, 8, **kw)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape == q.shape
    o2, lse, lse_t = msa.sparse_atten_func(q, k, v, row_ptr, q_idx, 8, return_softmax_lse=True,
                                           return_temperature_lse=True, **kw)
    assert lse_t is lse and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert torch.equal(o, o2)
    _, lse_a, lse_b = msa.sparse_atten_func(q, k, v, row_ptr, q_idx, 8, return_softmax_lse=True,
                                            return_temperature_lse=True,
                                            lse_temperature_scale=0.5, **kw)
    assert lse_b is not lse_a
    fin = torch.isfinite(lse_a)
    # ln sum exp(2 s) lies between 2 max(s) and 2 max(s) + ln(n): check with the plain LSE bound
    assert (lse_b[fin] >= 2 * lse_a[fin] - 2 * math.log(2 * 128 * 8) - 1e-3).all()
    assert not torch.allclose(lse_a[fin], lse_b[fin])


@pytest.mark.parametrize("partial_dtype", [torch.float32, torch.bfloat16, torch.float16,
                                           torch.float8_e4m3fn])
def test_partial_dtype_rounding_is_modelled(partial_dtype, seed):
    """Each block's partial output is rounded to partial_dtype before the combine."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [40, 200], [300, 260]
    q = torch.randn(sum(q_lens), 4, 128, generator=gen).bfloat16()
    k = torch.randn(sum(k_lens), 1, 128, generator=gen).bfloat16()
    v = torch.randn_like(k)
    q2k = random_q2k(q_lens, k_lens, 1, 4, generator=gen)
    call = _call(q, k, v, q2k, q_lens, k_lens, causal=True)
    exact, _, _ = interface.sparse_attention_reference(
        dataclasses.replace(call, partial_dtype=torch.float64), compute_dtype=torch.float64)
    rounded, _, _ = interface.sparse_attention_reference(
        dataclasses.replace(call, partial_dtype=partial_dtype), compute_dtype=torch.float64)
    err = (rounded - exact).abs().max().item()
    eps = torch.finfo(partial_dtype).eps
    assert err <= 4 * eps * exact.abs().max().item() + 1e-12
    if partial_dtype != torch.float32:
        assert err > 0


def test_fp8_pv_quantization_within_contract_tolerance(seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [100, 180], [260, 300]
    q = torch.randn(sum(q_lens), 4, 128, generator=gen)
    k = torch.randn(sum(k_lens), 1, 128, generator=gen)
    v = torch.randn_like(k)
    fp8 = torch.float8_e4m3fn
    q8, k8, v8 = q.to(fp8), k.to(fp8), v.to(fp8)
    q2k = random_q2k(q_lens, k_lens, 1, 8, generator=gen)
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=sum(k_lens))
    o = msa.sparse_atten_func(q8, k8, v8, row_ptr, q_idx, 8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                              max_seqlen_q=180, max_seqlen_k=300, causal=True)
    ref, _, _ = dense_oracle(q8.float(), k8.float(), v8.float(), q2k, q_lens, k_lens,
                             causal=True, scale=128 ** -0.5)
    assert o.dtype == torch.bfloat16
    assert (o.double() - ref).abs().max() <= 0.125
    # bf16 q with e4m3 K/V (an FP8 KV cache) and the mixed mode (e4m3 V, bf16 P.V)
    o_mixed = msa.sparse_atten_func(q.bfloat16(), k8, v8, row_ptr, q_idx, 8, cu_seqlens_q=cu_q,
                                    cu_seqlens_k=cu_k, max_seqlen_q=180, max_seqlen_k=300,
                                    causal=True, pv_dtype=torch.bfloat16)
    ref_mixed, _, _ = dense_oracle(q.bfloat16().float(), k8.float(), v8.float(), q2k, q_lens,
                                   k_lens, causal=True, scale=128 ** -0.5)
    assert (o_mixed.double() - ref_mixed).abs().max() <= 0.03


def test_duplicate_ids_are_double_weighted():
    """Contract: duplicates are undefined but counted twice; the reference must not crash and
    must weigh the duplicated block twice."""
    torch.manual_seed(0)
    q = torch.randn(1, 1, 128).bfloat16()
    k = torch.randn(256, 1, 128).bfloat16()
    v = torch.randn_like(k)
    q2k = torch.tensor([[[0, 0, 1, -1]]], dtype=torch.int32)
    cu_q, cu_k = cu_seqlens([1]), cu_seqlens([256])
    row_ptr, q_idx = build_k2q_csr_torch_reference(q2k, cu_q, cu_k, 128)
    o = msa.sparse_atten_func(q, k, v, row_ptr, q_idx, 4, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                              max_seqlen_q=1, max_seqlen_k=256)
    s = (k[:, 0].double() @ q[0, 0].double()) / math.sqrt(128)
    w = torch.exp(s - s.max())
    w[:128] *= 2
    ref = (w / w.sum()) @ v[:, 0].double()
    assert (o[0, 0].double() - ref).abs().max() < 1e-2


def test_out_of_range_queries_in_csr_are_skipped():
    """A corrupt CSR (query ids past the request) never reads out of bounds."""
    torch.manual_seed(1)
    q = torch.randn(3, 2, 128).bfloat16()
    k = torch.randn(130, 1, 128).bfloat16()
    v = torch.randn_like(k)
    row_ptr = torch.tensor([[0, 3, 3]], dtype=torch.int32)
    q_idx = torch.tensor([[0, 7, -5] + [-1] * 9], dtype=torch.int32)
    o = msa.sparse_atten_func(q, k, v, row_ptr, q_idx, 4, cu_seqlens_q=cu_seqlens([3]),
                              cu_seqlens_k=cu_seqlens([130]), max_seqlen_q=3, max_seqlen_k=130)
    assert torch.isfinite(o.float()).all()
    assert (o[1:] == 0).all() and (o[0] != 0).any()


@pytest.mark.slow
def test_32k_sequence_runs_in_bounded_memory():
    """The reference is tiled: one 32k-token sequence (Hq=8, Hkv=1, topK=16) runs on a CPU."""
    import resource
    n, topk = 32768, 16
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(n, 8, 128, generator=gen).bfloat16()
    k = torch.randn(n, 1, 128, generator=gen).bfloat16()
    v = torch.randn_like(k)
    nblk = n // 128
    own = torch.arange(n) // 128
    rand = torch.randint(0, nblk, (n, topk - 1), generator=gen)
    rand = torch.minimum(rand, own.view(-1, 1))            # causally visible blocks
    q2k = torch.cat([own.view(-1, 1), rand], 1).int().unsqueeze(0)
    q2k = torch.where(torch.cat([torch.zeros(n, 1, dtype=torch.bool),
                                 rand == own.view(-1, 1)], 1).unsqueeze(0), -1, q2k)
    cu = cu_seqlens([n])
    row_ptr, q_idx = msa.build_k2q_csr(q2k.contiguous(), cu, cu, 128, total_k=n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    o = msa.sparse_atten_func(q, k, v, row_ptr, q_idx, topk, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=n, max_seqlen_k=n, causal=True)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert torch.isfinite(o.float()).all()
    assert grown_mb < 2048
