"""msa.prefill on the CPU (reference backends): workspace sizing, query chunks, the split-K
indexer metadata, and the paged plan/run wrapper, each against the step-by-step public ops
(block_max_scores -> sparse_topk_select -> build_k2q_csr -> sparse_atten_func) on the same keys.

Chunked prefill (contract §0, bottom-right): request b's queries are the last q_len of its k_len
keys; query i sees key j iff j <= i + k_len - q_len.
"""

import pytest
import torch

import msa
from msa import prefill
from msa_testing import to_paged
from test_indexer import cu, dense_attention_from_selection

BF16 = torch.bfloat16


def _inputs(q_lens, k_lens, hkv, g, gen):
    draw = lambda *shape: torch.randn(*shape, generator=gen).to(BF16)  # noqa: E731
    tq, tk = sum(q_lens), sum(k_lens)
    return dict(q=draw(tq, hkv * g, 128), k=draw(tk, hkv, 128), v=draw(tk, hkv, 128),
                q_idx=draw(tq, hkv, 128), k_idx=draw(tk, 1, 128))


def _stepwise(x, q_lens, k_lens, topk, causal=True):
    """The pipeline as msa_prefill's docstring spells it, one public op per step, unsplit."""
    cu_q, cu_k = cu(q_lens), cu(k_lens)
    lens = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))
    scores = msa.block_max_scores(x["q_idx"], x["k_idx"], cu_q, cu_k, causal=causal, **lens)
    tok = torch.arange(sum(q_lens))
    req = torch.searchsorted(cu_q[1:].long(), tok, right=True)
    ql, kl = torch.tensor(q_lens)[req], torch.tensor(k_lens)[req]
    nvp = ((kl + 127) // 128).to(torch.int32)
    own = torch.div(tok - cu_q[req].long() + kl - ql, 128, rounding_mode="floor").to(torch.int32)
    sel = msa.sparse_topk_select(scores, topk, nvp, force_end_blocks=1,
                                 causal_end_block=own if causal else None)
    q2k = sel.permute(1, 0, 2).contiguous()
    g = x["q"].shape[1] // x["k"].shape[1]
    row_ptr, q_ids = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=sum(k_lens),
                                       qhead_per_kv=g, **lens)
    out = msa.sparse_atten_func(x["q"], x["k"], x["v"], row_ptr, q_ids, topk, cu_seqlens_q=cu_q,
                                cu_seqlens_k=cu_k, causal=causal, **lens)
    return out, q2k, scores


# ---------------------------------------------------------------------------------------------
# Sizing
# ---------------------------------------------------------------------------------------------

def test_chunk_tokens_keeps_a_fitting_call_whole_and_cuts_the_rest_in_128s():
    assert prefill.chunk_tokens(5000, 1000, 10 ** 7) == 5000
    step = prefill.chunk_tokens(100_000, 300_000, 4 << 30)
    assert step % 128 == 0 and step * 300_000 <= 4 << 30 and (step + 128) * 300_000 > 4 << 30
    # A budget below one minimum chunk still makes progress.
    assert prefill.chunk_tokens(10_000, 10 ** 6, 1) == prefill.MIN_CHUNK_TOKENS


def test_one_million_token_call_fits_an_h200_by_the_formula():
    """M3 (Hq 64, Hkv 4, top-16) at 1M tokens, bf16 partials: inputs + O + one chunk."""
    t, hq, hkv = 1 << 20, 64, 4
    tiles = t // 128
    per_query = prefill.workspace_bytes_per_query(num_qo_heads=hq, num_kv_heads=hkv, topk=16,
                                                  max_k_tiles=tiles, partial_dtype=BF16)
    step = prefill.chunk_tokens(t, per_query)
    inputs = t * (hq + 2 * hkv + hkv + 1) * 128 * 2          # q, k, v, q_idx, k_idx (bf16)
    peak = inputs + t * hq * 128 * 2 + step * per_query
    assert step < t and step * per_query <= prefill.DEFAULT_WORKSPACE_BYTES
    assert peak < 60 * 2 ** 30, peak / 2 ** 30
    # Unchunked, the partials alone would take 256 GiB.
    assert t * per_query > 300 * 2 ** 30


@pytest.mark.parametrize("ctas,tiles,want", [(3, 433, (44, 10)), (26, 1059, (5, 212)),
                                             (256, 373, (1, 373)), (3, 6, (1, 6)),
                                             (1, 8, (2, 4)), (66, 400, (2, 200))])
def test_index_key_splits_fill_the_sms_once_with_at_least_four_tiles(ctas, tiles, want):
    splits, per_split = prefill.index_key_splits(ctas, tiles, 132)
    assert (splits, per_split) == want
    assert splits * per_split >= tiles and (splits - 1) * per_split < tiles
    if splits > 1:
        assert splits * ctas <= 132 and per_split >= prefill.SPLIT_K_MIN_TILES


# ---------------------------------------------------------------------------------------------
# Chunk and split metadata
# ---------------------------------------------------------------------------------------------

def test_chunk_lengths_end_each_request_at_its_last_query_in_the_chunk():
    cu_q = cu((100, 50, 10))
    k_len = torch.tensor([1000, 50, 5])
    q_sub, k_sub = prefill.chunk_lengths(cu_q, k_len, 60, 155, causal=True)
    # request 0: queries 60..99 (40), keys up to 900 + 100; request 1: all 50; request 2:
    # queries 0..4 of 10 but it has 5 keys: k = 5 - 10 + 5 = 0 (they see nothing).
    assert q_sub.tolist() == [40, 50, 5]
    assert k_sub.tolist() == [1000, 50, 0]
    q_sub, k_sub = prefill.chunk_lengths(cu_q, k_len, 0, 60, causal=True)
    assert q_sub.tolist() == [60, 0, 0] and k_sub.tolist() == [960, 0, 0]
    q_sub, k_sub = prefill.chunk_lengths(cu_q, k_len, 0, 60, causal=False)
    assert k_sub.tolist() == [1000, 0, 0]


def test_dense_chunk_keeps_key_starts_with_gap_requests():
    cu_q, cu_k = cu((100, 50)), cu((1000, 80))
    cu_q_sub, cu_k_sub = prefill.dense_chunk_seqlens(cu_q, cu_k, 60, 120, causal=True)
    # (r0: its last 40 queries, all its keys [0, 1000)), an empty gap, (r1: its first 20
    # queries, keys [1000, 1050)), gap [1050, 1080).
    assert cu_q_sub.tolist() == [0, 40, 40, 60, 60]
    assert cu_k_sub.tolist() == [0, 1000, 1000, 1050, 1080]
    cu_q_sub, cu_k_sub = prefill.dense_chunk_seqlens(cu_q, cu_k, 20, 60, causal=True)
    # (r0: queries 20..59, keys [0, 960)), gap [960, 1000), r1 and its gap hold no query.
    assert cu_q_sub.tolist() == [0, 40, 40, 40, 40]
    assert cu_k_sub.tolist() == [0, 960, 1000, 1000, 1080]


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_index_split_covers_every_query_and_key_once(paged):
    q_lens, k_lens = [7, 0, 20, 3], [900, 300, 130, 40]
    cu_q, cu_k = cu(q_lens), cu(k_lens)
    splits, n = 3, 3
    width = 9
    split = prefill.index_split(cu_q, cu_k, sum(q_lens), splits, n, causal=True, paged=paged,
                                page_table_width=width)
    span = 128 * n
    qrows = split.query_rows.tolist()
    cu_qs = split.cu_seqlens_q.tolist()
    for r, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        for s in range(splits):
            sub = r * splits + s
            lo, hi = cu_qs[sub], cu_qs[sub + 1]
            assert qrows[lo:hi] == list(range(int(cu_q[r]), int(cu_q[r]) + ql))
            want_keys = max(0, min(kl - s * span, span))
            if paged:
                assert int(split.seqused_k[sub]) == want_keys
                want_pages = [r * width + min(s * n + j, width - 1) for j in range(n)]
                assert split.page_index[sub].tolist() == want_pages
            else:
                k0, k1 = int(split.cu_seqlens_k[sub]), int(split.cu_seqlens_k[sub + 1])
                assert k0 == int(cu_k[r]) + min(s * span, kl)
                assert k1 - k0 == want_keys
            assert int(split.qo_offset[sub]) == kl - ql - s * span
    # columns[(s, q)] points at query q's row in split s.
    cols = split.columns.view(splits, -1)
    for q in range(sum(q_lens)):
        for s in range(splits):
            c = int(cols[s, q])
            sub = next(i for i in range(len(cu_qs) - 1) if cu_qs[i] <= c < cu_qs[i + 1])
            assert sub % splits == s and qrows[c] == q


def test_split_k_scores_equal_the_unsplit_scores(seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = (9, 40, 1), (1100, 300, 650)
    x = _inputs(q_lens, k_lens, 2, 2, gen)
    cu_q, cu_k = cu(q_lens), cu(k_lens)
    want = msa.block_max_scores(x["q_idx"], x["k_idx"], cu_q, cu_k, max_seqlen_q=40,
                                max_seqlen_k=1100)
    nvp, own = msa.indexer._per_query_block_bounds(cu_q, cu_k, sum(q_lens))
    split = prefill.index_split(cu_q, cu_k, sum(q_lens), 3, 3, causal=True, paged=False)
    chunk = prefill.ChunkPlan(0, sum(q_lens), cu_q, cu_k, None, 40, 1100, sum(k_lens), None,
                              nvp, own, split)
    opts = prefill.PrefillOptions(4, 1, True, BF16, None, 1.0, 2)
    got = prefill._index_scores(chunk, x["q_idx"], x["k_idx"], None, opts)
    assert got.shape == (2, 9, sum(q_lens))
    assert torch.equal(torch.isinf(got[:, :want.shape[1]]), torch.isinf(want))
    torch.testing.assert_close(got[:, :want.shape[1]], want, rtol=1e-5, atol=1e-4)
    assert bool(torch.isneginf(got[:, want.shape[1]:]).all())


# ---------------------------------------------------------------------------------------------
# msa_prefill in chunks, the paged wrapper
# ---------------------------------------------------------------------------------------------

def test_msa_prefill_in_query_chunks_equals_the_stepwise_pipeline(seed, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = (150, 230, 40), (700, 230, 900)   # prefix + chunk, self, short chunk
    x = _inputs(q_lens, k_lens, 2, 4, gen)
    want_out, want_q2k, _ = _stepwise(x, q_lens, k_lens, 8)
    monkeypatch.setattr(prefill, "MIN_CHUNK_TOKENS", 128)
    chunks = prefill.plan_dense_chunks(
        cu(q_lens), cu(k_lens), total_q=sum(q_lens), total_k=sum(k_lens), max_seqlen_q=230,
        max_seqlen_k=900, num_qo_heads=8, num_kv_heads=2,
        opts=prefill.PrefillOptions(8, 1, True, BF16, None, 1.0, 4), workspace_bytes=1)
    assert [(c.q_begin, c.q_end) for c in chunks] == [(0, 128), (128, 256), (256, 384),
                                                       (384, 420)]
    assert any(c.split is not None for c in chunks)
    out, q2k = msa.msa_prefill(**x, cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens),
                               max_seqlen_q=230, max_seqlen_k=900, topk=8,
                               return_selection=True, workspace_bytes=1)
    assert torch.equal(q2k, want_q2k)
    torch.testing.assert_close(out, want_out, atol=1e-2, rtol=1e-2)
    ref = dense_attention_from_selection(x["q"], x["k"], x["v"], q2k, q_lens, k_lens,
                                         128 ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def _paged_case(q_lens, k_lens, hkv, g, gen):
    x = _inputs(q_lens, k_lens, hkv, g, gen)
    kp, vp, table, _ = to_paged(x["k"], x["v"], list(k_lens), generator=gen)
    kip, _, itable, _ = to_paged(x["k_idx"], x["k_idx"], list(k_lens), generator=gen)
    return x, dict(k_cache=kp, v_cache=vp, k_idx_cache=kip), table, itable


@pytest.mark.parametrize("max_chunk", [None, 128], ids=["one-chunk", "chunks"])
def test_paged_wrapper_equals_the_dense_stepwise_pipeline(seed, max_chunk):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = (70, 300, 5, 130), (650, 300, 900, 1000)
    x, caches, table, itable = _paged_case(q_lens, k_lens, 2, 4, gen)
    want_out, want_q2k, _ = _stepwise(x, q_lens, k_lens, 8)
    wrapper = msa.MsaPrefillPagedWrapper(topk=8)
    wrapper.plan(q_lens, k_lens, table, num_qo_heads=8, num_kv_heads=2, index_page_table=itable,
                 max_chunk_tokens=max_chunk)
    if max_chunk:
        assert wrapper.num_chunks == 4 and max(wrapper.index_splits) > 1
    out, lse, q2k = wrapper.run(x["q"], caches["k_cache"], caches["v_cache"], x["q_idx"],
                                caches["k_idx_cache"], return_lse=True, return_selection=True)
    assert torch.equal(q2k, want_q2k)
    torch.testing.assert_close(out, want_out, atol=1e-2, rtol=1e-2)
    assert lse.shape == (sum(q_lens), 8) and bool(torch.isfinite(lse).all())
    # out= / lse= are written in place.
    o2 = torch.full_like(out, float("nan"))
    l2 = torch.full_like(lse, float("nan"))
    wrapper.run(x["q"], caches["k_cache"], caches["v_cache"], x["q_idx"], caches["k_idx_cache"],
                out=o2, lse=l2)
    assert torch.equal(o2, out) and torch.equal(l2, lse)


def test_paged_wrapper_non_causal_sees_every_key(seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = (40, 20), (500, 260)
    x, caches, table, itable = _paged_case(q_lens, k_lens, 1, 4, gen)
    want_out, want_q2k, _ = _stepwise(x, q_lens, k_lens, 4, causal=False)
    wrapper = msa.MsaPrefillPagedWrapper(topk=4, causal=False).plan(
        q_lens, k_lens, table, num_qo_heads=4, num_kv_heads=1, index_page_table=itable,
        max_chunk_tokens=32)
    out, q2k = wrapper.run(x["q"], caches["k_cache"], caches["v_cache"], x["q_idx"],
                           caches["k_idx_cache"], return_selection=True)
    assert torch.equal(q2k, want_q2k)
    torch.testing.assert_close(out, want_out, atol=1e-2, rtol=1e-2)


def test_paged_wrapper_rejects_bad_plans_and_runs():
    table = torch.zeros(2, 3, dtype=torch.int32)
    w = msa.MsaPrefillPagedWrapper()
    with pytest.raises(RuntimeError, match="run: called before plan"):
        w.run(torch.zeros(1, 16, 128), None, None, None, None)
    with pytest.raises(ValueError, match="kv_lens"):
        w.plan([1, 2], [300], table, num_qo_heads=16, num_kv_heads=1)
    with pytest.raises(ValueError, match="page_table: 3 pages"):
        w.plan([1, 2], [300, 500], table, num_qo_heads=16, num_kv_heads=1)
    with pytest.raises(TypeError, match="qo_lens"):
        w.plan([1.5, 2], [300, 200], table, num_qo_heads=16, num_kv_heads=1)
    with pytest.raises(ValueError, match="qo_lens"):
        w.plan([-1, 2], [300, 200], table, num_qo_heads=16, num_kv_heads=1)
    with pytest.raises(NotImplementedError, match="q: 3 query heads"):
        w.plan([1, 2], [300, 200], table, num_qo_heads=12, num_kv_heads=4)
    with pytest.raises(ValueError, match="local_blocks"):
        msa.MsaPrefillPagedWrapper(topk=4, local_blocks=5)
    w.plan([1, 2], [300, 200], table, num_qo_heads=16, num_kv_heads=1)
    kc = torch.zeros(4, 1, 128, 128, dtype=BF16)
    with pytest.raises(ValueError, match="q: has 4 rows"):
        w.run(torch.zeros(4, 16, 128, dtype=BF16), kc, kc, torch.zeros(4, 1, 128, dtype=BF16),
              kc)
    with pytest.raises(ValueError, match="q_idx"):
        w.run(torch.zeros(3, 16, 128, dtype=BF16), kc, kc, torch.zeros(3, 2, 128, dtype=BF16),
              kc)
