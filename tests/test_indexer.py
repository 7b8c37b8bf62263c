"""block_max_scores against a dense float64 score matrix, and msa_prefill against a dense float64
masked attention built from the selection it returns."""

import math

import pytest
import torch

import msa
from msa import _backend
from msa.reference import max_score as max_score_reference

FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


def rand_index(shape, dtype):
    x = torch.randn(shape)
    if dtype == FP8:
        x = x * 4  # use the e4m3 range
    return x.to(dtype)


def paginate(keys_per_request, hk, generator_perm):
    """Dense per-request keys -> shuffled HND pages [pages, Hk, 128, D] + page_table [B, P]."""
    counts = [-(-kk.shape[0] // 128) for kk in keys_per_request]
    total = sum(counts)
    perm = generator_perm(total)
    d = keys_per_request[0].shape[-1]
    dtype = keys_per_request[0].dtype
    pages = rand_index((total, hk, 128, d), torch.float32).to(dtype)   # junk in unused slots
    table = torch.full((len(counts), max(counts) + 1), -7, dtype=torch.int32)  # junk past end
    logical = 0
    for b, kk in enumerate(keys_per_request):
        for beta in range(counts[b]):
            page = int(perm[logical])
            logical += 1
            chunk = kk[beta * 128:(beta + 1) * 128]
            pages[page, :, :chunk.shape[0]] = chunk.transpose(0, 1)
            table[b, beta] = page
    return pages.contiguous(), table


def dense_block_max(q, keys_per_request, q_lens, scale, causal, offsets, tiles):
    """Independent oracle: the full float64 score matrix per request, mask, per-128 max."""
    total_q, h, _ = q.shape
    out = torch.full((h, tiles, total_q), NEG_INF, dtype=torch.float64)
    start = 0
    for b, kk in enumerate(keys_per_request):
        ql, kl = q_lens[b], kk.shape[0]
        qb = q[start:start + ql].double()
        kb = kk.double().repeat_interleave(h // kk.shape[1], dim=1)          # [kl, H, D]
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if causal:
            i = torch.arange(ql).view(-1, 1)
            j = torch.arange(kl).view(1, -1)
            s = s.masked_fill(j > i + offsets[b], NEG_INF)
        nt = -(-kl // 128)
        padded = torch.full((h, ql, nt * 128), NEG_INF, dtype=torch.float64)
        padded[..., :kl] = s
        bm = padded.view(h, ql, nt, 128).amax(-1).transpose(1, 2)            # [H, nt, ql]
        n = min(nt, tiles)
        out[:, :n, start:start + ql] = bm[:, :n]
        start += ql
    return out


def assert_scores_close(got, want):
    assert got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf pattern differs"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# block_max_scores
# ----------------------------------------------------------------------------------------------

CASES = [
    # q_lens, k_lens: lengths not multiples of 128; one request with k < q (rows that see nothing)
    ((70, 200, 1), (300, 200, 129)),
    ((130, 5, 257), (130, 261, 200)),
]


@pytest.mark.parametrize("lens", CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,hk", [(torch.bfloat16, 1), (FP8, 2), (torch.float32, 4)])
def test_block_max_scores_dense(seed, lens, causal, dtype, hk):
    q_lens, k_lens = lens
    h = 4
    q = rand_index((sum(q_lens), h, 128), dtype)
    k = rand_index((sum(k_lens), hk, 128), dtype)
    scale = 0.37
    got = msa.block_max_scores(q, k, cu(q_lens), cu(k_lens), max_seqlen_q=max(q_lens),
                               max_seqlen_k=max(k_lens), scale=scale, causal=causal)
    tiles = -(-max(k_lens) // 128)
    assert got.shape == (h, tiles, sum(q_lens)) and got.is_contiguous()
    keys = list(torch.split(k, list(k_lens)))
    offsets = [kl - ql for ql, kl in zip(q_lens, k_lens)]
    assert_scores_close(got, dense_block_max(q, keys, q_lens, scale, causal, offsets, tiles))
    assert _backend.last_backend("block_max_scores") == "reference"


@pytest.mark.parametrize("qo_offset_kind", ["int", "tensor"])
def test_block_max_scores_qo_offset_and_wide_tiles(seed, qo_offset_kind):
    q_lens, k_lens = (90, 300, 17), (400, 300, 140)
    q = rand_index((sum(q_lens), 2, 128), torch.bfloat16)
    k = rand_index((sum(k_lens), 1, 128), torch.bfloat16)
    if qo_offset_kind == "int":
        offsets = [-40] * 3
        qo = -40
    else:
        offsets = [250, -10, 0]
        qo = torch.tensor(offsets, dtype=torch.int32)
    got = msa.block_max_scores(q, k, cu(q_lens), cu(k_lens), max_seqlen_q=300, max_seqlen_k=400,
                               qo_offset=qo, max_k_tiles=7)
    assert got.shape == (2, 7, sum(q_lens))
    keys = list(torch.split(k, list(k_lens)))
    want = dense_block_max(q, keys, q_lens, 1.0, True, offsets, 7)
    assert_scores_close(got, want)
    assert bool(torch.isneginf(got[:, 4:]).all())      # past every request's tiles


@pytest.mark.parametrize("causal", [True, False])
def test_block_max_scores_paged_shuffled(seed, causal):
    q_lens, k_lens = (60, 256, 3), (333, 256, 129)
    h, hk = 4, 1
    q = rand_index((sum(q_lens), h, 128), torch.bfloat16)
    keys = [rand_index((kl, hk, 128), torch.bfloat16) for kl in k_lens]
    pages, table = paginate(keys, hk, torch.randperm)
    seqused = torch.tensor(k_lens, dtype=torch.int32)
    got = msa.block_max_scores(q, pages, cu(q_lens), cu(k_lens), max_seqlen_q=256,
                               max_seqlen_k=333, causal=causal, page_table=table,
                               seqused_k=seqused)
    offsets = [kl - ql for ql, kl in zip(q_lens, k_lens)]
    assert_scores_close(got, dense_block_max(q, keys, q_lens, 1.0, causal, offsets, 3))
    # cu_seqlens_k is optional in paged mode (seqused_k is the length)
    again = msa.block_max_scores(q, pages, cu(q_lens), None, max_seqlen_q=256, max_seqlen_k=333,
                                 causal=causal, page_table=table, seqused_k=seqused)
    assert torch.equal(again, got)


def test_block_max_scores_small_chunks_match(seed, monkeypatch):
    q_lens, k_lens = (300, 77), (700, 77)
    q = rand_index((sum(q_lens), 4, 128), torch.bfloat16)
    k = rand_index((sum(k_lens), 1, 128), torch.bfloat16)
    args = (q, k, cu(q_lens), cu(k_lens))
    kw = dict(max_seqlen_q=300, max_seqlen_k=700)
    whole = msa.block_max_scores(*args, **kw)
    monkeypatch.setattr(max_score_reference, "_SCORE_TILE_ELEMENTS", 4 * 256 * 7)
    small = msa.block_max_scores(*args, **kw)      # fp32 sums may differ in the last bit
    assert torch.equal(torch.isneginf(small), torch.isneginf(whole))
    finite = torch.isfinite(whole)
    torch.testing.assert_close(small[finite], whole[finite], rtol=1e-5, atol=1e-5)
    keys = list(torch.split(k, list(k_lens)))
    assert_scores_close(small, dense_block_max(q, keys, q_lens, 1.0, True, [400, 0], 6))


# ----------------------------------------------------------------------------------------------
# msa_prefill
# ----------------------------------------------------------------------------------------------

def dense_attention_from_selection(q, k, v, q2k, q_lens, k_lens, scale):
    """float64 oracle: token mask from the q2k blocks, bottom-right causal, softmax, O=0 rows."""
    total_q, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(total_q, hq, 128, dtype=torch.float64)
    qs = ks = 0
    for b, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        qb, kb, vb = q[qs:qs + ql].double(), k[ks:ks + kl].double(), v[ks:ks + kl].double()
        for h in range(hq):
            sel = q2k[h // g, qs:qs + ql].long()                           # [ql, topk]
            blocks = torch.arange(kl) // 128
            in_sel = (blocks.view(1, -1, 1) == sel.view(ql, 1, -1)).any(-1)  # [ql, kl]
            causal = torch.arange(kl).view(1, -1) <= torch.arange(ql).view(-1, 1) + (kl - ql)
            mask = in_sel & causal
            s = (qb[:, h] @ kb[:, h // g].T) * scale
            s = s.masked_fill(~mask, NEG_INF)
            p = torch.softmax(s, -1).nan_to_num(0.0)
            out[qs:qs + ql, h] = p @ vb[:, h // g]
        qs += ql
        ks += kl
    return out


def test_msa_prefill_matches_dense_reference(seed):
    q_lens, k_lens = (300, 520), (300, 700)
    hkv, g, topk = 2, 2, 4
    hq = hkv * g
    q = torch.randn(sum(q_lens), hq, 128).to(torch.bfloat16)
    k = torch.randn(sum(k_lens), hkv, 128).to(torch.bfloat16)
    v = torch.randn(sum(k_lens), hkv, 128).to(torch.bfloat16)
    q_idx = torch.randn(sum(q_lens), hkv, 128).to(torch.bfloat16)
    k_idx = torch.randn(sum(k_lens), 1, 128).to(torch.bfloat16)
    cu_q, cu_k = cu(q_lens), cu(k_lens)
    out, q2k = msa.msa_prefill(q, k, v, q_idx, k_idx, cu_q, cu_k, max_seqlen_q=520,
                               max_seqlen_k=700, topk=topk, return_selection=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert q2k.shape == (hkv, sum(q_lens), topk) and q2k.dtype == torch.int32

    # The query's own block is always selected; nothing past it; ascending with a -1 tail.
    for b, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        rows = q2k[:, int(cu_q[b]):int(cu_q[b + 1])]
        own = (torch.arange(ql) + kl - ql) // 128
        assert bool((rows == own.view(1, -1, 1)).any(-1).all())
        assert bool((rows <= own.view(1, -1, 1)).all())
    valid = q2k >= 0
    assert torch.equal(valid, torch.arange(topk) < valid.sum(-1, keepdim=True))

    # The selection is the top-k of the index scores (checked against the brute force of
    # test_topk on the same scores, own block forced).
    scores = msa.block_max_scores(q_idx, k_idx, cu_q, cu_k, max_seqlen_q=520, max_seqlen_k=700)
    from test_topk import brute_select
    tok = torch.arange(sum(q_lens))
    b_of = (tok >= int(cu_q[1])).long()
    ql_t = torch.tensor(q_lens)[b_of]
    kl_t = torch.tensor(k_lens)[b_of]
    own = ((tok - cu_q[b_of].long() + kl_t - ql_t) // 128).to(torch.int32)
    nvp = ((kl_t + 127) // 128).to(torch.int32)
    want = brute_select(scores, topk, nvp, 0, 1, own).permute(1, 0, 2)
    assert torch.equal(q2k, want)

    ref = dense_attention_from_selection(q, k, v, q2k, q_lens, k_lens, 128 ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_msa_prefill_short_requests_and_softmax_scale(seed):
    # Requests shorter than topk blocks: rows end in -1; a custom softmax scale and local_blocks=2.
    q_lens, k_lens = (5, 200), (40, 200)
    hkv, g, topk = 1, 4, 8
    q = torch.randn(sum(q_lens), hkv * g, 128).to(torch.bfloat16)
    k = torch.randn(sum(k_lens), hkv, 128).to(torch.bfloat16)
    v = torch.randn(sum(k_lens), hkv, 128).to(torch.bfloat16)
    q_idx = torch.randn(sum(q_lens), hkv, 128).to(torch.bfloat16)
    k_idx = torch.randn(sum(k_lens), 1, 128).to(torch.bfloat16)
    out, q2k = msa.msa_prefill(q, k, v, q_idx, k_idx, cu(q_lens), cu(k_lens), max_seqlen_q=200,
                               max_seqlen_k=200, topk=topk, softmax_scale=0.05, local_blocks=2,
                               return_selection=True)
    # Every visible block is selected (there are at most 2), the tail is -1.
    assert bool((q2k[..., 2:] == -1).all())
    assert bool((q2k[0, :5, 0] == 0).all()) and bool((q2k[0, :5, 1] == -1).all())
    ref = dense_attention_from_selection(q, k, v, q2k, q_lens, k_lens, 0.05)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_per_query_bounds_need_no_host_data():
    from msa.prefill import _per_query_block_bounds
    nvp, own = _per_query_block_bounds(cu((3, 130)), cu((1, 300)), 133)
    assert nvp.tolist() == [1] * 3 + [3] * 130
    # request 0: k_len < q_len, so the first two rows see nothing (negative own block)
    assert own[:3].tolist() == [-1, -1, 0]
    assert own[3:].tolist() == [(i + 170) // 128 for i in range(130)]


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------

def _ok_index_args():
    q = torch.randn(10, 2, 128).to(torch.bfloat16)
    k = torch.randn(20, 1, 128).to(torch.bfloat16)
    return dict(q_idx=q, k_idx=k, cu_seqlens_q=cu((10,)), cu_seqlens_k=cu((20,)),
                max_seqlen_q=10, max_seqlen_k=20)


@pytest.mark.parametrize("kwargs,err,name", [
    (dict(q_idx=torch.randn(10, 2, 128).half()), TypeError, "q_idx"),
    (dict(q_idx=torch.randn(10, 2, 64).to(torch.bfloat16)), NotImplementedError, "q_idx"),
    (dict(q_idx=torch.randn(10, 3, 128).to(torch.bfloat16),
          k_idx=torch.randn(20, 2, 128).to(torch.bfloat16)), ValueError, "q_idx"),
    (dict(k_idx=torch.randn(2, 1, 128, 128).to(torch.bfloat16)), ValueError, "page_table"),
    (dict(seqused_k=torch.tensor([20], dtype=torch.int32)), ValueError, "seqused_k"),
    (dict(cu_seqlens_q=torch.tensor([0, 10])), TypeError, "cu_seqlens_q"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(causal=False, qo_offset=3), ValueError, "qo_offset"),
    (dict(qo_offset=torch.zeros(2, dtype=torch.int32)), ValueError, "qo_offset"),
    (dict(qo_offset=1.5), TypeError, "qo_offset"),
    (dict(max_seqlen_k=0), ValueError, "max_seqlen_k"),
    (dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k"),
])
def test_block_max_scores_bad_inputs(kwargs, err, name):
    args = _ok_index_args()
    args.update(kwargs)
    with pytest.raises(err, match=f"^{name}"):
        msa.block_max_scores(**args)


def test_block_max_scores_bad_paged_inputs():
    q = torch.randn(10, 2, 128).to(torch.bfloat16)
    pages = torch.randn(2, 1, 64, 128).to(torch.bfloat16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="^k_idx"):
        msa.block_max_scores(q, pages, cu((10,)), cu((20,)), max_seqlen_q=10, max_seqlen_k=20,
                             page_table=table)
    pages = torch.randn(2, 1, 128, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="^page_table"):
        msa.block_max_scores(q, pages, cu((10,)), cu((20,)), max_seqlen_q=10, max_seqlen_k=20,
                             page_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="^page_table"):   # page id out of range
        msa.block_max_scores(q, pages, cu((10,)), cu((20,)), max_seqlen_q=10, max_seqlen_k=20,
                             page_table=torch.full((1, 2), 5, dtype=torch.int32),
                             seqused_k=torch.tensor([20], dtype=torch.int32))


def _ok_prefill_args():
    t, s = 40, 40
    return dict(q=torch.randn(t, 4, 128).to(torch.bfloat16),
                k=torch.randn(s, 2, 128).to(torch.bfloat16),
                v=torch.randn(s, 2, 128).to(torch.bfloat16),
                q_idx=torch.randn(t, 2, 128).to(torch.bfloat16),
                k_idx=torch.randn(s, 1, 128).to(torch.bfloat16),
                cu_seqlens_q=cu((t,)), cu_seqlens_k=cu((s,)), max_seqlen_q=t, max_seqlen_k=s)


@pytest.mark.parametrize("kwargs,err,name", [
    (dict(topk=12), ValueError, "topk"),
    (dict(local_blocks=5), ValueError, "local_blocks"),
    (dict(local_blocks=-1), ValueError, "local_blocks"),
    (dict(q_idx=torch.randn(40, 4, 128).to(torch.bfloat16)), ValueError, "q_idx"),
    (dict(q_idx=torch.randn(39, 2, 128).to(torch.bfloat16)), ValueError, "q_idx"),
    (dict(k_idx=torch.randn(41, 1, 128).to(torch.bfloat16)), ValueError, "k_idx"),
    (dict(q=torch.randn(40, 6, 128).to(torch.bfloat16)), NotImplementedError, "q"),
])
def test_msa_prefill_bad_inputs(kwargs, err, name):
    args = _ok_prefill_args()
    args.update(kwargs)
    with pytest.raises(err, match=f"^{name}"):
        msa.msa_prefill(**args, **({"topk": 4} if "topk" not in kwargs else {}))


def test_msa_prefill_smoke_small(seed):
    args = _ok_prefill_args()
    out = msa.msa_prefill(**args, topk=4)
    assert out.shape == (40, 4, 128) and bool(torch.isfinite(out.float()).all())
    assert not math.isnan(float(out.float().sum()))
