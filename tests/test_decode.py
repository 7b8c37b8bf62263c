"""Paged decode (contract §1.4, D6 sparse decode, D7 G in {1,2,4,8,16}): the function and the
plan/run wrapper against an independent float64 computation, the split-KV schedule, buffers kept
by reference, preallocated outputs and argument errors."""

import math

from types import SimpleNamespace

import pytest
import torch

import msa
from msa import _backend
from msa.decode import check_decode_args, decode_reference_backend
from msa.schedules.decode import QO_TILE_ROWS, DecodeSchedule, build_decode_schedule

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
P = 128
DTYPES = {"bf16": (BF16, BF16), "bf16q_fp8kv": (BF16, FP8), "fp8": (FP8, FP8)}


# ---------------------------------------------------------------------------------------------
# Inputs and the independent float64 oracle
# ---------------------------------------------------------------------------------------------

def make_batch(lens, seqlen_q, hkv, group, q_dtype=BF16, kv_dtype=BF16, spare_pages=3,
               device="cpu"):
    """Shuffled page table (unused columns -1), random q/k/v, ragged seqused_k."""
    batch = len(lens)
    width = max(max(-(-n // P) for n in lens), 1) + 1
    num_pages = batch * width + spare_pages
    table = torch.randperm(num_pages)[: batch * width].view(batch, width).to(torch.int32)
    for b, n in enumerate(lens):
        table[b, -(-n // P):] = -1
    k = torch.randn(num_pages, hkv, P, 128).to(kv_dtype)
    v = torch.randn(num_pages, hkv, P, 128).to(kv_dtype)
    q = torch.randn(batch * seqlen_q, hkv * group, 128).to(q_dtype)
    seqused_k = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, table, seqused_k)]


def random_q2k(lens, seqlen_q, hkv, topk):
    """Random selections: 1..topK distinct ids per (head, query) at random slots, -1 elsewhere;
    some ids are out of range for the request (the runtime drops them)."""
    q2k = torch.full((hkv, len(lens) * seqlen_q, topk), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        blocks = -(-n // P)
        for i in range(seqlen_q):
            for h in range(hkv):
                ids = torch.randperm(blocks + 1)[: int(torch.randint(1, topk + 1, ()))]
                slots = torch.randperm(topk)[: ids.numel()]
                q2k[h, b * seqlen_q + i, slots] = ids.to(torch.int32)
    return q2k


def oracle(q, k, v, table, seqused_k, seqlen_q, q2k=None, scale=None):
    """Float64: gather every visible key of each (query, KV head), then softmax."""
    q, k, v = q.cpu().double(), k.cpu().double(), v.cpu().double()
    table, lens = table.cpu().long(), seqused_k.cpu().long()
    q2k = None if q2k is None else q2k.cpu()
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    lse = torch.full((total_q, hq), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        pages = table[b, : -(-n // P)]
        keys = k[pages].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
        vals = v[pages].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
        rows = slice(b * seqlen_q, (b + 1) * seqlen_q)
        pos = torch.arange(n).view(1, -1)
        causal = pos <= torch.arange(seqlen_q).view(-1, 1) + n - seqlen_q      # [sq, n]
        for h in range(hkv):
            visible = causal.clone()
            if q2k is not None:
                sel = q2k[h, rows].long()                                      # [sq, topK]
                chosen = ((pos // P).unsqueeze(-1) == sel.unsqueeze(1)) & (sel >= 0).unsqueeze(1)
                visible &= chosen.any(-1)
            heads = slice(h * g, (h + 1) * g)
            s = torch.einsum("qgd,nd->qgn", q[rows, heads], keys[h]) * scale
            s = s.masked_fill(~visible.unsqueeze(1), float("-inf"))
            row_lse = torch.logsumexp(s, -1)                                   # [sq, g]
            seen = visible.any(-1)
            probs = torch.softmax(s[seen], -1)
            lse[rows, heads] = torch.where(seen.unsqueeze(-1), row_lse, float("-inf"))
            o = torch.zeros(seqlen_q, g, d, dtype=torch.float64)
            o[seen] = probs @ vals[h]
            out[rows, heads] = o
    return out, lse


def check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv: bool):
    assert out.dtype == BF16 and lse.dtype == torch.float32
    assert torch.isfinite(out.float()).all()
    err = (out.double().cpu() - ref_out).abs().max().item()
    bf16_floor = (ref_out.to(BF16).double() - ref_out).abs().max().item()
    # Contract §5.1: fp8 max|O - ref| <= max(0.125, 4 * bf16 floor); bf16 within the rounding
    # of the exact result (one ulp either way, since fp32 noise may cross a rounding boundary).
    tol = max(0.125, 4 * bf16_floor) if fp8_pv else 2 * bf16_floor + 1e-4
    assert err <= tol, (err, tol)
    lse = lse.double().cpu()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out.float().cpu()[empty] == 0).all()
    assert torch.allclose(lse[~empty], ref_lse[~empty], atol=2e-3 if fp8_pv else 1e-3, rtol=0)


def fp32_reference(q, k, v, q2k, table, seqused_k, seqlen_q, schedule=None):
    call = check_decode_args(q, k, v, q2k, page_table=table, seqused_k=seqused_k,
                             seqlen_q=seqlen_q, max_seqlen_k=int(seqused_k.max()), blk_kv=128,
                             causal=True, softmax_scale=None)
    call.schedule = schedule
    return decode_reference_backend(call)


# ---------------------------------------------------------------------------------------------
# Function vs the float64 oracle
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("seqlen_q", [1, 4, 8])
def test_dense_decode_matches_float64(seed, seqlen_q, group, dtypes):
    q_dtype, kv_dtype = DTYPES[dtypes]
    hkv = 2 if group < 16 else 1
    lens = [1, 129, int(torch.randint(200, 1001, ()))]
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, q_dtype, kv_dtype)
    out, lse = msa.sparse_decode_atten_func(q, k, v, page_table=table, seqused_k=seqused_k,
                                            seqlen_q=seqlen_q, max_seqlen_k=1000,
                                            return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert _backend.last_backend("sparse_decode_atten") == "reference"
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=q_dtype == FP8)


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("group,topk", [(1, 4), (4, 8), (16, 16)])
@pytest.mark.parametrize("seqlen_q", [1, 8])
def test_sparse_decode_matches_float64(seed, seqlen_q, group, topk, dtypes):
    q_dtype, kv_dtype = DTYPES[dtypes]
    hkv = 2 if group < 16 else 1
    lens = [int(torch.randint(1, 40, ())), 129, int(torch.randint(600, 1001, ()))]
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, q_dtype, kv_dtype)
    q2k = random_q2k(lens, seqlen_q, hkv, topk)
    scale = 0.07
    out, lse = msa.sparse_decode_atten_func(q, k, v, q2k, page_table=table, seqused_k=seqused_k,
                                            seqlen_q=seqlen_q, max_seqlen_k=1024,
                                            softmax_scale=scale, return_softmax_lse=True)
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q, q2k, scale=scale)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=q_dtype == FP8)


def test_fp8_dense_equals_sparse_with_every_block(seed):
    """Both paths model the FP8 P.V per 128-key block, so they agree to fp32 rounding."""
    lens, seqlen_q, hkv, group = [5, 300, 1000], 4, 2, 4
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, FP8, FP8)
    every = torch.arange(8, dtype=torch.int32).flip(0)   # order within a row is irrelevant
    q2k = every.view(1, 1, 8).expand(hkv, q.shape[0], 8).contiguous()
    dense = fp32_reference(q, k, v, None, table, seqused_k, seqlen_q)
    sparse = fp32_reference(q, k, v, q2k, table, seqused_k, seqlen_q)
    finite = torch.isfinite(dense[1])
    assert torch.equal(finite, torch.isfinite(sparse[1]))
    assert torch.allclose(dense[0], sparse[0], atol=1e-5, rtol=0)
    assert torch.allclose(dense[1][finite], sparse[1][finite], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtypes", ["bf16", "fp8"])
def test_dense_decode_equals_paged_sparse_atten_func(seed, dtypes):
    """Cross-check with the prefill entry point (paged, every block selected, fp32 partials):
    same visibility and the same FP8 P.V model, so equal up to rounding."""
    q_dtype, kv_dtype = DTYPES[dtypes]
    lens, seqlen_q, hkv, group, topk = [3, 129, 1000], 4, 2, 8, 8
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, q_dtype, kv_dtype)
    out, lse = msa.sparse_decode_atten_func(q, k, v, page_table=table, seqused_k=seqused_k,
                                            seqlen_q=seqlen_q, max_seqlen_k=1000,
                                            return_softmax_lse=True)
    cu_q = torch.arange(0, 4 * seqlen_q, seqlen_q, dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 132, 1132], dtype=torch.int32)
    q2k = torch.arange(topk, dtype=torch.int32).view(1, 1, -1).expand(hkv, q.shape[0], -1)
    q2k = torch.where(q2k < ((seqused_k.long() + 127) // 128).repeat_interleave(seqlen_q)
                      .view(1, -1, 1), q2k, -1).to(torch.int32).contiguous()
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=1132, max_seqlen_k=1000,
                                       max_seqlen_q=seqlen_q, qhead_per_kv=group)
    out_p, lse_p = msa.sparse_atten_func(q, k, v, row_ptr, q_idx, topk, cu_seqlens_q=cu_q,
                                         cu_seqlens_k=cu_k, max_seqlen_q=seqlen_q,
                                         max_seqlen_k=1000, causal=True,
                                         partial_dtype=torch.float32, return_softmax_lse=True,
                                         page_table=table, seqused_k=seqused_k)
    assert torch.allclose(out.float(), out_p.float(), atol=1e-6, rtol=2 ** -7)
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(lse_p))
    assert torch.allclose(lse[finite], lse_p[finite], atol=1e-5, rtol=0)


def test_default_softmax_scale_and_seqused_shorter_than_seqlen_q(seed):
    """seqused_k < seqlen_q leaves the first queries with no key: O = 0, LSE = -inf."""
    lens, seqlen_q = [2, 3], 4
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, 1, 2)
    out, lse = msa.sparse_decode_atten_func(q, k, v, page_table=table, seqused_k=seqused_k,
                                            seqlen_q=seqlen_q, max_seqlen_k=3,
                                            return_softmax_lse=True)
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q, scale=128 ** -0.5)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=False)
    assert torch.isneginf(lse[0:2]).all() and torch.isfinite(lse[2:4]).all()


# ---------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------

def _covered_units(schedule: DecodeSchedule, request: int, units_now: int):
    covered = []
    for chunk in range(int(schedule.num_splits_host[request])):
        lo, hi = schedule.chunk_range(request, chunk, units_now)
        covered.extend(range(lo, hi))
    return covered


def test_schedule_structure_and_split_flag():
    lens = torch.tensor([1, 129, 5000, 0], dtype=torch.int32)
    # Contract op signature, positionally.
    s = build_decode_schedule(lens, 128, 4, 32, 2, 128, 5000, False, None, None, False)
    assert s.split_kv and s.max_grid_size == 132
    assert s.planned_units == [1, 2, 40, 0]
    assert s.num_work * s.num_kv_heads <= 132          # one wave of CTAs
    ind = s.merge_indptr_host
    assert ind[0] == 0 and torch.equal(ind[1:] - ind[:-1], s.num_splits_host)
    for b, units in enumerate(s.planned_units):
        assert _covered_units(s, b, units) == list(range(units))   # chunks tile the range
        mine = s.request_indices_host == b
        assert sorted(s.kv_tile_indices_host[mine].tolist()) == list(range(s.num_splits_host[b]))
    assert s.workspace_shapes() == ((int(ind[-1]), 4, 32, 128), (int(ind[-1]), 4, 32))
    # Growth after planning lands in the last chunk.
    assert _covered_units(s, 2, 47) == list(range(47))

    off = build_decode_schedule(lens, 128, 4, 32, 2, 128, 5000, disable_split_kv=True)
    assert not off.split_kv and off.num_partials == 0 and off.num_splits_host.tolist() == [1] * 4
    forced = build_decode_schedule(lens, 128, 4, 32, 2, 128, 5000, fixed_split_size=1)
    assert forced.split_kv and forced.kv_chunk_size == 1
    assert forced.num_splits_host.tolist() == [1, 2, 40, 1]
    tiny = build_decode_schedule(torch.tensor([3], dtype=torch.int32), 128, 1, 16, 1, 128, 3,
                                 fixed_split_size=1)
    assert tiny.split_kv                                 # forced even with a single page

    # A batch that already fills the GPU does not split; a small budget caps the split.
    big = torch.full((200,), 4096, dtype=torch.int32)
    assert not build_decode_schedule(big, 128, 1, 16, 1, 128, 4096).split_kv
    capped = build_decode_schedule(lens, 128, 4, 32, 2, 128, 5000, max_grid_size=16)
    assert capped.num_work * 2 <= 16 and capped.kv_chunk_size > s.kv_chunk_size
    # MTP 16 x G 16 needs two 128-row qo tiles.
    mtp = build_decode_schedule(lens, 128, 16, 16, 1, 128, 5000)
    assert mtp.num_qo_tiles == -(-16 * 16 // QO_TILE_ROWS) == 2
    assert sorted(set(mtp.qo_tile_indices_host.tolist())) == [0, 1]
    # Explicit query tiles: 16 rows, one token at G = 16.
    one_token = build_decode_schedule(lens, 128, 8, 16, 1, 128, 5000, qo_tile_rows=16)
    assert one_token.qo_tile_rows == 16 and one_token.num_qo_tiles == 8
    with pytest.raises(ValueError, match="^qo_tile_rows"):
        build_decode_schedule(lens, 128, 8, 16, 1, 128, 5000, qo_tile_rows=129)


def test_sparse_mtp_takes_query_tiles_against_long_contexts():
    """Sparse multi-token decode of e4m3 q and K/V: 128-row tiles (8 tokens x G 16 share the
    union of their selections) while the request holds fewer blocks than half the tile's
    8 x topK selections, one-token tiles of 16 rows from there on; dense calls and tiles of
    <= 16 rows keep 128. The wrapper plans both and each run takes the one of its dtypes."""
    from msa.schedules.decode import few_tiles, query_tile_rows, union_collapses
    assert query_tile_rows(8, 16, 63 * 128, 128, 16) is None
    assert query_tile_rows(8, 16, 63 * 128 + 1, 128, 16) == 16          # 64 blocks
    assert union_collapses(8, 16, 63 * 128, 128, 16)
    assert not union_collapses(8, 16, 63 * 128 + 1, 128, 16)
    assert union_collapses(4, 16, 31 * 128, 128, 16)                     # 4 tokens: 64 selections
    assert not union_collapses(4, 16, 32 * 128, 128, 16)
    assert query_tile_rows(8, 16, 10 ** 6, 128, None) is None            # dense
    assert query_tile_rows(1, 16, 10 ** 6, 128, 16) is None              # 16 rows
    assert query_tile_rows(8, 4, 10 ** 6, 128, 16) == 16                 # 4 tokens x G 4
    assert query_tile_rows(16, 2, 10 ** 6, 128, 16) == 16                # 8 tokens x G 2
    # Where the token-warps form serves 128-row tiles they stay, unless they are fewer than
    # half the SMs (from 2 x topK blocks on), where the query tiles fill the GPU; where the
    # union collapses the 128-row tiles stay (split over the CTAs) ...
    fill = dict(num_kv_heads=4, sms=132)
    assert few_tiles(16, 4, 1, 132) and not few_tiles(17, 4, 1, 132)
    assert query_tile_rows(8, 16, 10 ** 6, 128, 16, batch=32, token_warps=True, **fill) is None
    assert query_tile_rows(8, 16, 4000, 128, 16, batch=32, token_warps=True, **fill) is None
    assert query_tile_rows(8, 16, 10 ** 6, 128, 16, batch=32, **fill) == 16
    assert query_tile_rows(8, 16, 10000, 128, 16, batch=16, token_warps=True, **fill) == 16
    assert query_tile_rows(8, 16, 10000, 128, 16, batch=8, **fill) == 16
    assert query_tile_rows(8, 16, 4000, 128, 16, batch=8, token_warps=True, **fill) is None
    assert query_tile_rows(8, 16, 5000, 128, 16, batch=16, **fill) is None
    # ... unless the query tiles fit one wave of CTAs (B 4 x Hkv 4 x 8 tokens = 128 <= 132).
    assert query_tile_rows(8, 16, 4000, 128, 16, batch=4, token_warps=True, **fill) == 16
    assert query_tile_rows(8, 16, 63 * 128, 128, 16, batch=1, **fill) == 16
    assert query_tile_rows(8, 16, 1000, 128, 16, batch=1, token_warps=True, **fill) is None
    assert query_tile_rows(8, 16, 31 * 128, 128, 16, batch=8, **fill) is None   # < 2 x topK
    assert query_tile_rows(8, 16, 10000, 128, 16, batch=17, token_warps=True, **fill) is None
    # Where the tile's selections make >= 2.5 a block of the planned context the ping-pong
    # union serves its 128-row tiles, not the token-warps form (the decode kernel's launcher).
    from msa.schedules.decode import union_dense
    assert union_dense(8, 16, 51, 16) and not union_dense(8, 16, 52, 16)   # 128 selections
    assert union_dense(4, 16, 25, 16) and not union_dense(4, 16, 26, 16)   # 4 tokens: 64
    assert union_dense(16, 16, 51, 16)                                     # 8 tokens a tile
    assert union_dense(8, 16, 102, 32) and not union_dense(8, 16, 103, 32)
    lens = [20000, 5]
    q, k, v, table, seqused_k = make_batch(lens, 8, 2, 16, FP8, FP8)
    q2k = random_q2k(lens, 8, 2, 16)
    wrapper = msa.SparseDecodePagedAttentionWrapper().plan(
        page_table=table, seqused_k=seqused_k, seqlen_q=8, max_seqlen_k=20001, q2k_indices=q2k,
        num_qo_heads=32, num_kv_heads=2)
    assert wrapper.decode_schedule.qo_tile_rows == 128
    assert wrapper.query_tile_schedule.qo_tile_rows == 16
    assert wrapper.query_tile_schedule.num_qo_tiles == 8
    assert wrapper.plan_for(SimpleNamespace(q=q, k=k))[0] is wrapper.query_tile_schedule
    assert wrapper.plan_for(SimpleNamespace(q=q.to(BF16), k=k))[0] is wrapper.decode_schedule
    fixed = msa.SparseDecodePagedAttentionWrapper().plan(
        page_table=table, seqused_k=seqused_k, seqlen_q=8, max_seqlen_k=20001, q2k_indices=q2k,
        num_qo_heads=32, num_kv_heads=2, qo_tile_rows=128)
    assert fixed.query_tile_schedule is None
    assert fixed.plan_for(SimpleNamespace(q=q, k=k))[0] is fixed.decode_schedule


def test_schedule_cuda_graph_and_sparse_ignore_lengths():
    lens_a = torch.tensor([1, 700], dtype=torch.int32)
    lens_b = torch.tensor([900, 3], dtype=torch.int32)
    a = build_decode_schedule(lens_a, 128, 2, 16, 4, 128, 1024, enable_cuda_graph=True)
    b = build_decode_schedule(lens_b, 128, 2, 16, 4, 128, 1024, enable_cuda_graph=True)
    assert a.planned_units == [8, 8] and a.split_kv
    assert torch.equal(a.merge_indptr_host, b.merge_indptr_host)
    assert a.kv_chunk_size == b.kv_chunk_size
    # Sparse: one-token qo tiles split q2k slots; tiles of several tokens split pages (from
    # max_seqlen_k, so a block the tokens select in different slots streams once).
    one = build_decode_schedule(lens_a, 128, 1, 16, 4, 128, 1024, sparse_topk=16)
    assert one.planned_units == [16, 16] and one.slot_chunks and one.kv_chunk_size_tokens is None
    sp = build_decode_schedule(lens_a, 128, 2, 16, 4, 128, 1024, sparse_topk=16)
    assert sp.planned_units == [8, 8] and sp.sparse and not sp.slot_chunks
    assert torch.equal(sp.merge_indptr_host, build_decode_schedule(
        lens_b, 128, 2, 16, 4, 128, 1024, sparse_topk=16).merge_indptr_host)
    tiles16 = build_decode_schedule(lens_a, 128, 8, 64, 4, 128, 1024, sparse_topk=16,
                                    qo_tile_rows=16)
    assert tiles16.slot_chunks and tiles16.planned_units == [16, 16]
    with pytest.raises(ValueError, match="^fixed_split_size"):
        build_decode_schedule(lens_a, 128, 2, 16, 4, 128, 1024, fixed_split_size=2,
                              disable_split_kv=True)


def test_multi_token_tiles_rule():
    """A qo tile holds rows of several tokens unless it divides G (or there is one token)."""
    from msa.schedules.decode import multi_token_tiles
    assert multi_token_tiles(8, 16, 128)          # 8 tokens x G 16 in one tile
    assert not multi_token_tiles(8, 16, 16)       # one token a tile
    assert not multi_token_tiles(8, 16, 8)        # half a token a tile
    assert multi_token_tiles(8, 16, 12)           # tiles straddle tokens
    assert not multi_token_tiles(1, 4, 128)       # one query per request


def test_cuda_graph_dense_plan_spreads_ragged_lengths_over_waves():
    """Without the lengths, a CUDA-graph plan of a dense batch splits into several waves of
    chunks (the CTA scheduler balances ragged requests) as long as chunks keep
    MIN_BALANCE_CHUNK_PAGES pages; a plan that sees the lengths and a sparse one stay at one
    wave."""
    from msa.schedules.decode import GRAPH_SPLIT_WAVES, MIN_BALANCE_CHUNK_PAGES
    lens = torch.full((32,), 100_000, dtype=torch.int32)
    pages = -(-125_000 // 128)
    graph = build_decode_schedule(lens, 128, 8, 64, 4, 128, 125_000, enable_cuda_graph=True)
    assert graph.split_kv and graph.kv_chunk_size >= MIN_BALANCE_CHUNK_PAGES
    waves = graph.num_work * graph.num_kv_heads / graph.max_grid_size
    assert 0.5 * GRAPH_SPLIT_WAVES < waves <= GRAPH_SPLIT_WAVES
    assert all(_covered_units(graph, b, pages) == list(range(pages)) for b in range(32))
    seen = build_decode_schedule(lens, 128, 8, 64, 4, 128, 125_000)
    assert not seen.split_kv and seen.num_work * seen.num_kv_heads <= seen.max_grid_size
    # Short contexts keep one wave: chunks would fall under the floor.
    short = build_decode_schedule(lens, 128, 8, 64, 4, 128, 5000, enable_cuda_graph=True)
    assert not short.split_kv


def test_dense_ping_pong_plans_carry_the_persistent_form():
    """Dense plans whose tiles take the ping-pong form (> 64 rows) carry the persistent form
    where it pays (>= 64 pages a CTA over all sequences, as the plan sees the lengths): one CTA
    per SM (max_grid_size) and two partial slots a CTA in the workspaces, beside the chunked
    work items every other form runs. Sparse plans, tiles of <= 64 rows, forced or disabled
    splits, too few pages and batches past PERSISTENT_MAX_REQUESTS do not."""
    from msa.schedules.decode import PERSISTENT_MAX_REQUESTS, PERSISTENT_MIN_PAGES_PER_CTA
    # 2 KV heads x (14 x 313 + 1 + 2) pages = 8770 pages: 66 a CTA at 132 CTAs.
    lens = torch.tensor([40000] * 14 + [0, 129], dtype=torch.int32)

    def plan(seqlen_q=8, max_seqlen_k=40000, **kw):
        kw.setdefault("max_grid_size", 132)
        return build_decode_schedule(kw.pop("lens", lens), 128, seqlen_q, 32, 2, 128,
                                     max_seqlen_k, **kw)

    assert PERSISTENT_MIN_PAGES_PER_CTA == 64
    many = torch.full((140,), 4000, dtype=torch.int32)    # 280 sequences of 32 pages: 68 a CTA
    for s in (plan(), plan(enable_cuda_graph=True), plan(seqlen_q=5), plan(seqlen_q=16),
              plan(lens=many, max_seqlen_k=4000), plan(lens=lens[:2], max_seqlen_k=40000,
                                                           max_grid_size=9)):
        assert s.persistent_ctas == s.max_grid_size and s.needs_workspaces
        o_shape, lse_shape = s.workspace_shapes()
        assert o_shape[0] == lse_shape[0] == max(2 * s.max_grid_size, s.num_partials)
        assert o_shape[1:] == (s.seqlen_q, 32, 128) and lse_shape[1:] == (s.seqlen_q, 32)
        assert s.num_work >= 1                       # the work items stay for the other forms
    assert plan(max_grid_size=7).persistent_ctas == 7
    short = torch.tensor([8000, 5], dtype=torch.int32)        # 63 pages, 4 sequences
    for s in (plan(seqlen_q=4), plan(sparse_topk=16), plan(fixed_split_size=2),
              plan(disable_split_kv=True), plan(qo_tile_rows=64),
              plan(lens=short, max_seqlen_k=8000), plan(lens=many[:130], max_seqlen_k=4000),
              plan(lens=lens[:2], max_seqlen_k=40000),    # 1252 pages: 9.5 a CTA
              plan(lens=torch.full((PERSISTENT_MAX_REQUESTS + 1,), 20000, dtype=torch.int32)),
              plan(persistent=False)):
        assert s.persistent_ctas == 0
        assert s.workspace_shapes()[0][0] == s.num_partials
    # A CUDA-graph plan sees every request at max_seqlen_k: 33 pages each, 65 a CTA.
    assert plan(lens=many[:130], max_seqlen_k=4200, enable_cuda_graph=True).persistent_ctas > 0
    assert not plan(disable_split_kv=True).needs_workspaces
    # persistent=True plans it wherever the call can take it, and refuses where it cannot.
    assert plan(lens=short, max_seqlen_k=8000, persistent=True).persistent_ctas == 132
    for bad in (dict(sparse_topk=16), dict(seqlen_q=4), dict(fixed_split_size=2)):
        with pytest.raises(ValueError, match="persistent"):
            plan(persistent=True, **bad)
    with pytest.raises(ValueError, match="persistent"):
        plan(persistent=1)


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------

def _plan(wrapper, table, seqused_k, seqlen_q, hq, hkv, q2k=None, **kw):
    return wrapper.plan(page_table=table, seqused_k=seqused_k, seqlen_q=seqlen_q,
                        max_seqlen_k=kw.pop("max_seqlen_k", 1024), q2k_indices=q2k,
                        num_qo_heads=hq, num_kv_heads=hkv, **kw)


@pytest.mark.parametrize("sparse", [False, True])
def test_wrapper_matches_function_and_split_matches_unsplit(seed, sparse):
    lens, seqlen_q, hkv, group = [1, 129, 1000], 4, 2, 4
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, FP8, FP8)
    q2k = random_q2k(lens, seqlen_q, hkv, 8) if sparse else None
    fn_out, fn_lse = msa.sparse_decode_atten_func(q, k, v, q2k, page_table=table,
                                                  seqused_k=seqused_k, seqlen_q=seqlen_q,
                                                  max_seqlen_k=1024, return_softmax_lse=True)
    unsplit = _plan(msa.SparseDecodePagedAttentionWrapper(), table, seqused_k, seqlen_q,
                    hkv * group, hkv, q2k, disable_split_kv=True)
    assert unsplit.decode_schedule.split_kv is False
    out, lse = unsplit.run(q, k, v, return_softmax_lse=True)
    assert torch.equal(out, fn_out) and torch.equal(lse, fn_lse)     # same computation

    forced = _plan(msa.SparseDecodePagedAttentionWrapper(), table, seqused_k, seqlen_q,
                   hkv * group, hkv, q2k, fixed_split_size=1)
    assert forced.decode_schedule.split_kv is True
    assert forced.decode_schedule.num_partials == (3 * 8 if sparse else 1 + 2 + 8)
    out_s, lse_s = forced.run(q, k, v, return_softmax_lse=True)
    finite = torch.isfinite(fn_lse)
    assert torch.equal(finite, torch.isfinite(lse_s))
    assert torch.allclose(lse_s[finite], fn_lse[finite], atol=1e-5, rtol=0)
    # bf16 outputs of fp32 values that differ by rounding: at most one bf16 ulp apart, except
    # elements that cancel to ~1e-7 (fp32 noise of the other summation order): absolute floor.
    assert torch.allclose(out_s.float(), fn_out.float(), atol=1e-6, rtol=2 ** -7)
    ref_u = fp32_reference(q, k, v, q2k, table, seqused_k, seqlen_q)
    ref_s = fp32_reference(q, k, v, q2k, table, seqused_k, seqlen_q, forced.decode_schedule)
    assert torch.allclose(ref_s[0], ref_u[0], atol=1e-5, rtol=0)

    # The workspaces hold normalized per-chunk partials; merging them reproduces the output.
    sched, o_part, lse_part = forced.decode_schedule, forced.O_partial, forced.LSE_partial
    for b in range(len(lens)):
        parts = slice(int(sched.merge_indptr_host[b]), int(sched.merge_indptr_host[b + 1]))
        lp = lse_part[parts].double()
        total = torch.logsumexp(lp, 0)
        w = torch.nan_to_num(torch.exp(lp - total), nan=0.0)
        merged = (w.unsqueeze(-1) * o_part[parts].double()).sum(0)
        rows = slice(b * seqlen_q, (b + 1) * seqlen_q)
        ok = torch.isfinite(total)
        assert torch.allclose(merged[ok], ref_s[0][rows][ok].double(), atol=1e-5)

    auto = _plan(msa.SparseDecodePagedAttentionWrapper(), table, seqused_k, seqlen_q,
                 hkv * group, hkv, q2k)
    out_a = auto.run(q, k, v)
    assert torch.allclose(out_a.float(), fn_out.float(), atol=1e-6, rtol=2 ** -7)


def test_function_accepts_schedule_and_workspaces(seed):
    lens, seqlen_q, hkv, group = [300, 50], 2, 1, 16
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group)
    sched = build_decode_schedule(seqused_k, 128, seqlen_q, 16, 1, 128, 512, fixed_split_size=1)
    o_shape, lse_shape = sched.workspace_shapes()
    o_part = torch.full(o_shape, float("nan"))
    lse_part = torch.full(lse_shape, float("nan"))
    out = msa.sparse_decode_atten_func(q, k, v, page_table=table, seqused_k=seqused_k,
                                       seqlen_q=seqlen_q, max_seqlen_k=512, schedule=sched,
                                       O_partial=o_part, LSE_partial=lse_part)
    assert not torch.isnan(o_part).any() and not torch.isnan(lse_part).any()
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q)
    check_against_oracle(out, torch.where(torch.isfinite(ref_lse), ref_lse, -math.inf).float(),
                         ref_out, ref_lse, fp8_pv=False)


@pytest.mark.parametrize("sparse", [False, True])
def test_wrapper_sees_buffer_contents_written_after_plan(seed, sparse):
    lens, seqlen_q, hkv, group = [129, 1000, 40], 2, 2, 2
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, BF16, BF16,
                                           spare_pages=30)
    q2k = random_q2k(lens, seqlen_q, hkv, 4) if sparse else None
    wrapper = _plan(msa.SparseDecodePagedAttentionWrapper(), table, seqused_k, seqlen_q,
                    hkv * group, hkv, q2k, fixed_split_size=2)
    planned = (wrapper.decode_schedule.merge_indptr_host.clone(), wrapper.O_partial.shape)
    before = wrapper.run(q, k, v)

    # New contents, same page counts (so the plan's sizes still describe the batch).
    seqused_k.copy_(torch.tensor([200, 900, 1], dtype=torch.int32))
    used = table[table >= 0]
    spare = torch.tensor(sorted(set(range(k.shape[0])) - set(used.tolist())), dtype=torch.int32)
    table[table >= 0] = spare[torch.randperm(spare.numel())[: used.numel()]]
    if sparse:
        q2k.copy_(random_q2k([200, 900, 1], seqlen_q, hkv, 4))
    after = wrapper.run(q, k, v)
    assert torch.equal(wrapper.decode_schedule.merge_indptr_host, planned[0])
    assert wrapper.O_partial.shape == planned[1]
    assert not torch.equal(before, after)
    expect = msa.sparse_decode_atten_func(q, k, v, q2k, page_table=table, seqused_k=seqused_k,
                                          seqlen_q=seqlen_q, max_seqlen_k=1024)
    # Split (the wrapper) and unsplit runs sum the same terms in another order (fp32): equal to
    # a bf16 ulp, except elements that cancel to ~1e-7, which may differ by fp32 noise (seed
    # 3851863617: -5.49e-08 vs -5.73e-08), hence the absolute floor.
    assert torch.allclose(after.float(), expect.float(), atol=1e-6, rtol=2 ** -7)
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q, q2k)
    check_against_oracle(after, torch.where(torch.isfinite(ref_lse), ref_lse, -math.inf).float(),
                         ref_out, ref_lse, fp8_pv=False)

    # Growth past the planned pages (no CUDA graph): the request's last chunk absorbs the tail.
    free = torch.tensor(sorted(set(range(k.shape[0])) - set(table[table >= 0].tolist())),
                        dtype=torch.int32)
    table[0, 2:6] = free[:4]
    seqused_k[0] = 700
    grown = wrapper.run(q, k, v)
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q, q2k)
    check_against_oracle(grown, torch.where(torch.isfinite(ref_lse), ref_lse, -math.inf).float(),
                         ref_out, ref_lse, fp8_pv=False)


def test_cuda_graph_plan_serves_longer_sequences(seed):
    """A CUDA-graph plan is sized from max_seqlen_k; lengths written later (up to it) work."""
    lens, seqlen_q, hkv, group = [10, 20], 1, 1, 8
    q, k, v, table, seqused_k = make_batch([1024, 1024], seqlen_q, hkv, group)
    seqused_k.copy_(torch.tensor(lens, dtype=torch.int32))
    wrapper = _plan(msa.SparseDecodePagedAttentionWrapper(), table, seqused_k, seqlen_q,
                    hkv * group, hkv, enable_cuda_graph=True, max_grid_size=8)
    sched = wrapper.decode_schedule
    assert sched.split_kv and sched.planned_units == [8, 8]
    for new_lens in ([10, 20], [1024, 700], [129, 1]):
        seqused_k.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out, lse = wrapper.run(q, k, v, return_softmax_lse=True)
        ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q)
        check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=False)


def test_wrapper_writes_preallocated_out_and_lse(seed):
    lens, seqlen_q, hkv, group = [100, 260], 8, 1, 4
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, BF16, FP8)
    wrapper = _plan(msa.SparseDecodePagedAttentionWrapper(), table, seqused_k, seqlen_q,
                    hkv * group, hkv)
    out = torch.full(q.shape, float("nan"), dtype=BF16)
    lse = torch.full(q.shape[:2], float("nan"))
    res_out, res_lse = wrapper.run(q, k, v, return_softmax_lse=True, out=out, lse=lse)
    assert res_out is out and res_lse is lse
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=False)
    # A given lse is written even when it is not returned.
    lse2 = torch.full(q.shape[:2], float("nan"))
    only = wrapper.run(q, k, v, lse=lse2)
    assert isinstance(only, torch.Tensor) and torch.equal(only, out) and torch.equal(lse2, lse)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def _good():
    q, k, v, table, seqused_k = make_batch([100, 200], 2, 2, 4)
    kw = dict(page_table=table, seqused_k=seqused_k, seqlen_q=2, max_seqlen_k=256)
    return q, k, v, kw


def _replace(kw, **changes):
    out = dict(kw)
    out.update(changes)
    return out


BAD_CALLS = {
    "fp16 q": (TypeError, "^q", lambda q, k, v, kw: ((q.half(), k, v), kw)),
    "fp8 q with bf16 kv": (TypeError, "^k", lambda q, k, v, kw: ((q.to(FP8), k, v), kw)),
    "k/v dtypes differ": (TypeError, "^v", lambda q, k, v, kw: ((q, k, v.to(FP8)), kw)),
    "G = 3": (NotImplementedError, "^q", lambda q, k, v, kw: ((q[:, :6].contiguous(), k, v), kw)),
    "G = 32": (NotImplementedError, "^q", lambda q, k, v, kw: (
        (q.repeat(1, 8, 1), k, v), kw)),
    "Hq not a multiple": (ValueError, "^q", lambda q, k, v, kw: (
        (q[:, :3].contiguous(), k, v), kw)),
    "head_dim 64": (NotImplementedError, "^q", lambda q, k, v, kw: (
        (q[..., :64].contiguous(), k, v), kw)),
    "causal False": (NotImplementedError, "^causal", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, causal=False))),
    "page size 64": (ValueError, "^k", lambda q, k, v, kw: (
        (q, k[:, :, :64].contiguous(), v[:, :, :64].contiguous()), kw)),
    "blk_kv 64": (ValueError, "^blk_kv", lambda q, k, v, kw: ((q, k, v), _replace(kw, blk_kv=64))),
    "dense k layout": (ValueError, "^k", lambda q, k, v, kw: (
        (q, k.flatten(0, 2)[:1000].contiguous(), v.flatten(0, 2)[:1000].contiguous()), kw)),
    "seqlen_q vs q rows": (ValueError, "^q", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, seqlen_q=3))),
    "seqlen_q 17": (NotImplementedError, "^seqlen_q", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, seqlen_q=17))),
    "seqlen_q 0": (ValueError, "^seqlen_q", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, seqlen_q=0))),
    "page_table int64": (TypeError, "^page_table", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, page_table=kw["page_table"].long()))),
    "page_table rows": (ValueError, "^page_table", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, page_table=kw["page_table"][:1]))),
    "seqused_k 2-D": (ValueError, "^seqused_k", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, seqused_k=kw["seqused_k"].view(1, 2)))),
    "q2k shape": (ValueError, "^q2k_indices", lambda q, k, v, kw: (
        (q, k, v, torch.zeros(2, 3, 4, dtype=torch.int32)), kw)),
    "q2k dtype": (TypeError, "^q2k_indices", lambda q, k, v, kw: (
        (q, k, v, torch.zeros(2, 4, 4, dtype=torch.int64)), kw)),
    "q2k topK 5": (ValueError, "^q2k_indices", lambda q, k, v, kw: (
        (q, k, v, torch.zeros(2, 4, 5, dtype=torch.int32)), kw)),
    "softmax_scale 0": (ValueError, "^softmax_scale", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, softmax_scale=0.0))),
    "schedule type": (TypeError, "^schedule", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, schedule=object()))),
    "schedule mismatch": (ValueError, "^schedule", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, schedule=build_decode_schedule(
            kw["seqused_k"], 128, 2, 16, 2, 128, 256)))),
    "O_partial dtype": (TypeError, "^O_partial", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, O_partial=torch.zeros(4, 2, 8, 128, dtype=BF16)))),
    "seqused_k past the page table": (ValueError, "^seqused_k", lambda q, k, v, kw: (
        (q, k, v), _replace(kw, seqused_k=torch.tensor([100, 5000], dtype=torch.int32)))),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_function_rejects_bad_arguments(case):
    error, match, mutate = BAD_CALLS[case]
    args, kw = mutate(*_good())
    with pytest.raises(error, match=match):
        msa.sparse_decode_atten_func(*args, **kw)


def test_wrapper_rejects_bad_arguments():
    q, k, v, kw = _good()
    plan_kw = dict(page_table=kw["page_table"], seqused_k=kw["seqused_k"], seqlen_q=2,
                   max_seqlen_k=256)
    W = msa.SparseDecodePagedAttentionWrapper
    with pytest.raises(NotImplementedError, match="^causal"):
        W(causal=False)
    with pytest.raises(ValueError, match="^blk_kv"):
        W(blk_kv=64)
    with pytest.raises(RuntimeError, match="^run"):
        W().run(q, k, v)
    with pytest.raises(ValueError, match="^num_qo_heads"):
        W().plan(**plan_kw, num_kv_heads=2)
    with pytest.raises(ValueError, match="^num_kv_heads"):
        W().plan(**plan_kw, num_qo_heads=8)
    with pytest.raises(NotImplementedError, match="^head_dim"):
        W().plan(**plan_kw, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    with pytest.raises(NotImplementedError, match="^num_qo_heads"):
        W().plan(**plan_kw, num_qo_heads=64, num_kv_heads=2)
    with pytest.raises(NotImplementedError, match="^num_qo_heads"):   # G = 3: no q to blame
        W().plan(**plan_kw, num_qo_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match="^num_qo_heads"):
        W().plan(**plan_kw, num_qo_heads=5, num_kv_heads=2)
    with pytest.raises(ValueError, match="^q2k_indices"):
        W().plan(**plan_kw, num_qo_heads=8, num_kv_heads=2,
                 q2k_indices=torch.zeros(1, 4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="^fixed_split_size"):
        W().plan(**plan_kw, num_qo_heads=8, num_kv_heads=2, fixed_split_size=1,
                 disable_split_kv=True)
    w = W().plan(**plan_kw, num_qo_heads=8, num_kv_heads=2)
    with pytest.raises(ValueError, match="^q"):
        w.run(q[:2].contiguous(), k, v)                  # rows != B * seqlen_q
    with pytest.raises(ValueError, match="^q"):
        w.run(q.repeat(1, 2, 1), k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))  # heads != plan
    with pytest.raises(TypeError, match="^out"):
        w.run(q, k, v, out=torch.empty(q.shape))
    with pytest.raises(ValueError, match="^out"):
        w.run(q, k, v, out=torch.empty(4, 8, 64, dtype=BF16))
    with pytest.raises(ValueError, match="^lse"):
        w.run(q, k, v, lse=torch.empty(4, 4))
    with pytest.raises(TypeError, match="^lse"):
        w.run(q, k, v, lse=torch.empty(4, 8, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# GPU: a 512k-token context (4096 pages) through the bounded-memory reference / native kernel
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", ["bf16", "fp8"])
def test_decode_512k_context_gpu(seed, dtypes):
    q_dtype, kv_dtype = DTYPES[dtypes]
    lens, seqlen_q, hkv, group = [512 * 1024, 3000], 2, 1, 16
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, hkv, group, q_dtype, kv_dtype,
                                           device="cuda")
    wrapper = _plan(msa.SparseDecodePagedAttentionWrapper(), table, seqused_k, seqlen_q,
                    hkv * group, hkv, max_seqlen_k=512 * 1024)
    assert wrapper.decode_schedule.split_kv
    out = torch.full(q.shape, float("nan"), dtype=BF16, device="cuda")
    out, lse = wrapper.run(q, k, v, return_softmax_lse=True, out=out)
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=q_dtype == FP8)
