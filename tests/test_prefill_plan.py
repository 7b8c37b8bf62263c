"""msa.prefill on the CPU (reference backends): workspace sizing, query chunks, the indexer's key
splits, and the paged plan/run wrapper, each against the step-by-step public ops
(block_max_scores -> sparse_topk_select -> build_k2q_csr -> sparse_atten_func) on the same keys.

Chunked prefill (contract §0, bottom-right): request b's queries are the last q_len of its k_len
keys; query i sees key j iff j <= i + k_len - q_len.
"""

import pytest
import torch

import msa
from msa import _stages, prefill
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


@pytest.mark.parametrize("ctas,tiles,want", [(3, 433, 44), (26, 1059, 5), (256, 373, 1),
                                             (3, 6, 1), (1, 8, 2), (66, 400, 2), (1, 3, 1)])
def test_index_key_splits_fill_the_sms_once_with_at_least_four_tiles(ctas, tiles, want):
    splits = prefill.index_key_splits(ctas, tiles, 132)
    assert splits == want
    if splits > 1:
        assert splits * ctas <= 132 and tiles // splits >= prefill.SPLIT_K_MIN_TILES


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


@pytest.mark.parametrize("q_lens", [(9, 40, 1), (0, 40, 0)], ids=["three", "one"])
def test_chunk_index_scores_carry_the_key_splits_and_equal_the_unsplit_scores(seed, q_lens,
                                                                            monkeypatch):
    """A chunk's index stage hands its key splits to the indexer call (a native launch shape:
    the reference ignores it) and returns block_max_scores' result."""
    from msa import indexer
    gen = torch.Generator().manual_seed(seed)
    k_lens = (1100, 300, 650)
    x = _inputs(q_lens, k_lens, 2, 2, gen)
    cu_q, cu_k = cu(q_lens), cu(k_lens)
    want = msa.block_max_scores(x["q_idx"], x["k_idx"], cu_q, cu_k, max_seqlen_q=40,
                                max_seqlen_k=1100)
    nvp, own = msa.prefill._per_query_block_bounds(cu_q, cu_k, sum(q_lens))
    chunk = prefill.ChunkPlan(0, sum(q_lens), cu_q, cu_k, None, 40, 1100, sum(k_lens), None,
                              nvp, own, 3)
    calls = []
    real = indexer.run_block_max_scores
    monkeypatch.setattr(indexer, "run_block_max_scores",
                        lambda call: (calls.append(call), real(call))[1])
    opts = prefill.PrefillOptions(4, 1, True, BF16, None, 1.0, 2)
    got = prefill._index_scores(chunk, x["q_idx"], x["k_idx"], None, opts)
    assert [c.key_splits for c in calls] == [3] and not calls[0].planned_lengths
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="key_splits"):
        indexer.chunk_block_max_scores(x["q_idx"], x["k_idx"], cu_q, cu_k, max_seqlen_q=40,
                                       max_seqlen_k=1100, key_splits=0)


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
    assert any(c.index_splits > 1 for c in chunks)
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


def test_paged_plan_metadata_is_what_the_native_glue_would_derive(seed):
    """The paged wrapper's chunks are planned: the native glue takes their prefix sums as they
    are, so those must equal what it derives on the device for unplanned calls (the clamped,
    non-decreasing prefix sums), and so must the key lengths and the causal offsets it derives
    (the plan's own offsets are taken as they are too)."""
    from msa._native.block_max_score_sm90 import kernel_inputs
    from msa._validation import device_prefix_sums
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = (70, 300, 5, 130), (650, 300, 900, 1000)
    _, caches, table, itable = _paged_case(q_lens, k_lens, 2, 4, gen)
    wrapper = msa.MsaPrefillPagedWrapper(topk=8).plan(
        q_lens, k_lens, table, num_qo_heads=8, num_kv_heads=2, index_page_table=itable,
        max_chunk_tokens=128)
    assert any(c.index_splits > 1 for c in wrapper.chunks)
    k_idx = caches["k_idx_cache"]
    for chunk in wrapper.chunks:
        assert chunk.planned
        total = chunk.q_end - chunk.q_begin
        assert torch.equal(device_prefix_sums(chunk.cu_seqlens_q, total), chunk.cu_seqlens_q)
        assert torch.equal(device_prefix_sums(chunk.cu_seqlens_k, 2**31 - 1), chunk.cu_seqlens_k)
        rows = torch.empty(total, 2, 128)
        args = (rows, k_idx, chunk.cu_seqlens_q, None, None, itable, chunk.seqused_k)
        planned = kernel_inputs(*args, planned=True, planned_offsets=chunk.causal_offsets)
        derived = kernel_inputs(*args)
        assert planned.cu_q is chunk.cu_seqlens_q      # taken as they are
        assert planned.offsets is chunk.causal_offsets
        for name in ("cu_q", "k_lens", "offsets"):
            assert torch.equal(getattr(planned, name), getattr(derived, name)), name
    # The plan's offsets reach the indexer call, checked like any argument.
    from msa.indexer import chunk_block_max_scores
    chunk = wrapper.chunks[0]
    q_idx = torch.randn(chunk.q_end - chunk.q_begin, 2, 128).to(torch.bfloat16)
    kwargs = dict(max_seqlen_q=chunk.max_seqlen_q, max_seqlen_k=chunk.max_seqlen_k,
                  page_table=itable, seqused_k=chunk.seqused_k, max_k_tiles=chunk.max_k_tiles,
                  planned=True)
    want = chunk_block_max_scores(q_idx, k_idx.to(torch.bfloat16), chunk.cu_seqlens_q, None,
                                  **kwargs)
    got = chunk_block_max_scores(q_idx, k_idx.to(torch.bfloat16), chunk.cu_seqlens_q, None,
                                 planned_offsets=chunk.causal_offsets, **kwargs)
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="planned_offsets"):
        chunk_block_max_scores(q_idx, k_idx.to(torch.bfloat16), chunk.cu_seqlens_q, None,
                               planned_offsets=chunk.causal_offsets.long(), **kwargs)


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


E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [BF16, E4M3], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_decode_route_computes_what_the_sparse_route_computes(seed, dtype, causal):
    """attention_route="decode" (each query one decode request over the chunk's selection)
    against "sparse" (CSR + sparse attention + combine) on the same paged call, in chunks: the
    same selection, O within bf16 rounding, the same LSE; the decode route marks no CSR."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = (70, 300, 5, 130, 1), (650, 300, 900, 1000, 2000)
    x, caches, table, itable = _paged_case(q_lens, k_lens, 2, 4, gen)
    x = {name: t.to(dtype) for name, t in x.items()}
    caches = {name: t.to(dtype) for name, t in caches.items()}
    got = {}
    for route in ("sparse", "decode"):
        wrapper = msa.MsaPrefillPagedWrapper(topk=4, causal=causal, attention_route=route).plan(
            q_lens, k_lens, table, num_qo_heads=8, num_kv_heads=2, index_page_table=itable,
            max_chunk_tokens=256)
        assert wrapper.decode_routes == [route == "decode"] * 2
        marks = []
        with _stages.recording(marks.append):
            got[route] = wrapper.run(x["q"], caches["k_cache"], caches["v_cache"], x["q_idx"],
                                     caches["k_idx_cache"], return_lse=True,
                                     return_selection=True)
        assert ("csr" in marks) == (route == "sparse"), marks
    (o_s, lse_s, q2k_s), (o_d, lse_d, q2k_d) = got["sparse"], got["decode"]
    assert torch.equal(q2k_d, q2k_s)
    torch.testing.assert_close(o_d, o_s, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse_d, lse_s, atol=1e-4, rtol=1e-5)


def test_auto_route_takes_short_e4m3_chunks_against_long_prefixes(seed):
    """"auto" plans the decode route for chunks of <= DECODE_ROUTE_MAX_QUERIES queries with at
    least DECODE_ROUTE_MIN_KEYS_PER_QUERY keys per query (all the chunk's requests' keys), and
    runs it for e4m3 q and K/V only; no route plans one for a chunk where a query sees no
    key."""
    per_query = prefill.DECODE_ROUTE_MIN_KEYS_PER_QUERY
    assert prefill.takes_decode_route("auto", 171, 171 * per_query)
    assert not prefill.takes_decode_route("auto", 171, 171 * per_query - 1)
    assert not prefill.takes_decode_route("auto", prefill.DECODE_ROUTE_MAX_QUERIES + 1, 10 ** 7)
    assert not prefill.takes_decode_route("sparse", 1, 10 ** 6)
    assert prefill.takes_decode_route("decode", 10 ** 5, 1)
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = (3, 5), (1400, 1500)          # 362 keys a query
    x, caches, table, itable = _paged_case(q_lens, k_lens, 1, 4, gen)
    wrapper = msa.MsaPrefillPagedWrapper(topk=4).plan(q_lens, k_lens, table, num_qo_heads=4,
                                                      num_kv_heads=1, index_page_table=itable)
    assert wrapper.decode_routes == [True]
    # The bound counts every request's keys: 4 queries on 400 + 1000 keys take the route
    # (350 a query, though the longest request alone has 250 a query), on 400 + 996 not.
    for k_total, decode in ((1000, True), (996, False)):
        _, _, tbl, itbl = _paged_case((2, 2), (400, k_total), 1, 4, gen)
        plan = msa.MsaPrefillPagedWrapper(topk=4).plan(
            (2, 2), (400, k_total), tbl, num_qo_heads=4, num_kv_heads=1, index_page_table=itbl)
        assert plan.decode_routes == [decode]
    for dtype, decode in ((BF16, False), (E4M3, True)):
        marks = []
        with _stages.recording(marks.append):
            wrapper.run(*(t.to(dtype) for t in (x["q"], caches["k_cache"], caches["v_cache"],
                                                x["q_idx"], caches["k_idx_cache"])))
        assert ("csr" not in marks) == decode, (dtype, marks)
    # 200 queries on 150 keys: the first 50 see nothing (packed queries 100-149), so the two
    # chunks holding them keep the sparse route.
    w = msa.MsaPrefillPagedWrapper(topk=4, attention_route="decode").plan(
        (100, 200), (900, 150), torch.zeros(2, 8, dtype=torch.int32), num_qo_heads=4,
        num_kv_heads=1, max_chunk_tokens=128)
    assert w.decode_routes == [False, False, True]
    with pytest.raises(ValueError, match="attention_route"):
        msa.MsaPrefillPagedWrapper(attention_route="csr")


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
    with pytest.raises(NotImplementedError, match="num_qo_heads: 3 query heads"):
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


# ---------------------------------------------------------------------------------------------
# sparse_atten_from_selection: a caller's selection in query chunks
# ---------------------------------------------------------------------------------------------

def _random_selection(q_lens, k_lens, hkv, topk, gen, causal=True):
    """[Hkv, T, topk] int32: per (KV head, query) random distinct blocks the query may see (up to
    its own block when causal), the own block always in, -1 holes anywhere in the row."""
    rows = []
    for ql, kl in zip(q_lens, k_lens):
        blocks = -(-kl // 128)
        own = (torch.arange(ql) + kl - ql) // 128 if causal else torch.full((ql,), blocks - 1)
        score = torch.rand(hkv, ql, blocks, generator=gen)
        score = score.masked_fill(torch.arange(blocks).view(1, 1, -1) > own.view(1, -1, 1), -1.0)
        score.scatter_(2, own.clamp(min=0).view(1, -1, 1).expand(hkv, -1, 1), 2.0)
        value, ids = score.topk(min(topk, blocks), dim=2)
        ids = ids.masked_fill((value < 0) | (own < 0).view(1, -1, 1), -1)
        ids = ids.masked_fill(torch.rand(ids.shape, generator=gen) < 0.15, -1)
        rows.append(torch.nn.functional.pad(ids, (0, topk - ids.shape[2]), value=-1))
    perm = torch.randperm(topk, generator=gen)                       # -1 not only at the tail
    return torch.cat(rows, dim=1)[:, :, perm].to(torch.int32).contiguous()


def _one_csr_call(x, q2k, cu_q, cu_k, max_q, max_k, causal, **kw):
    """The selection through build_k2q_csr + sparse_atten_func in one call."""
    g = x["q"].shape[1] // x["k"].shape[1]
    lens = dict(max_seqlen_q=max_q, max_seqlen_k=max_k)
    row_ptr, q_ids = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=x["k"].shape[0],
                                       qhead_per_kv=g, **lens)
    return msa.sparse_atten_func(x["q"], x["k"], x["v"], row_ptr, q_ids, q2k.shape[2],
                                 cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, **lens,
                                 **kw)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sparse_atten_from_selection_in_chunks_equals_one_call(seed, monkeypatch, causal):
    """Prefix + chunk, self prefill, a short chunk, and key rows past the last request (a static
    cache): chunks of 128 queries give what one build_k2q_csr + sparse_atten_func call gives,
    which matches the float64 masked attention on the selection; the caller's q2k is kept."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = (150, 230, 40), (700, 230, 900)
    x = _inputs(q_lens, k_lens, 2, 4, gen)
    x["k"] = torch.cat([x["k"], torch.randn(77, 2, 128, generator=gen).to(BF16)])
    x["v"] = torch.cat([x["v"], torch.randn(77, 2, 128, generator=gen).to(BF16)])
    q2k = _random_selection(q_lens, k_lens, 2, 8, gen, causal)
    cu_q, cu_k = cu(q_lens), cu(k_lens)
    want_out, want_lse = _one_csr_call(x, q2k, cu_q, cu_k, 230, 900, causal,
                                       return_softmax_lse=True)
    monkeypatch.setattr(prefill, "MIN_CHUNK_TOKENS", 128)
    chunks = prefill.plan_dense_chunks(
        cu_q, cu_k, total_q=sum(q_lens), total_k=x["k"].shape[0], max_seqlen_q=230,
        max_seqlen_k=900, num_qo_heads=8, num_kv_heads=2,
        opts=prefill.PrefillOptions(8, 0, causal, BF16, None, 1.0, 4), workspace_bytes=1,
        index_stage=False)
    assert [(c.q_begin, c.q_end) for c in chunks] == [(0, 128), (128, 256), (256, 384),
                                                       (384, 420)]
    assert all(c.index_splits == 1 and c.own_block is None for c in chunks)
    q2k_before = q2k.clone()
    out, lse = prefill.sparse_atten_from_selection(
        x["q"], x["k"], x["v"], q2k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=230,
        max_seqlen_k=900, causal=causal, return_softmax_lse=True, workspace_bytes=1,
        check_input_valid=True)
    assert torch.equal(q2k, q2k_before)
    # The same per-(query, block) work; the fp32 reference's sums may round differently when
    # the batch changes (one bf16 ulp of O at most).
    torch.testing.assert_close(out, want_out, atol=1e-3, rtol=8e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    if causal:
        ref = dense_attention_from_selection(x["q"], x["k"], x["v"], q2k, q_lens, k_lens,
                                             128 ** -0.5)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    # One chunk when it fits: the same call as above.
    whole = prefill.sparse_atten_from_selection(
        x["q"], x["k"], x["v"], q2k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=230,
        max_seqlen_k=900, causal=causal)
    torch.testing.assert_close(whole, want_out, atol=1e-3, rtol=8e-3)


def test_sparse_atten_from_selection_chunk_size_follows_the_attention_workspace():
    """Without the index stage a query costs the partials, the chunk's O / LSE and the CSR:
    M3 at 512k tokens needs ~139 GiB unchunked and runs in 16 GiB chunks of ~60k queries."""
    t, hq, hkv = 512 * 1024, 64, 4
    per_query = prefill.workspace_bytes_per_query(num_qo_heads=hq, num_kv_heads=hkv, topk=16,
                                                  max_k_tiles=0, partial_dtype=BF16)
    assert per_query == 16 * hq * (128 * 2 + 4) + hq * (128 * 2 + 4) + 40 * hkv * 16
    assert t * per_query > 130 * 2 ** 30
    chunks = prefill.plan_dense_chunks(
        cu([t]), cu([t]), total_q=t, total_k=t, max_seqlen_q=t, max_seqlen_k=t,
        num_qo_heads=hq, num_kv_heads=hkv,
        opts=prefill.PrefillOptions(16, 0, True, BF16, None, 1.0, hq // hkv),
        index_stage=False)
    step = chunks[0].q_end
    assert step == prefill.chunk_tokens(t, per_query) and step % 128 == 0
    assert step * per_query <= prefill.DEFAULT_WORKSPACE_BYTES
    assert len(chunks) == -(-t // step) == 9


def test_sparse_atten_from_selection_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    q_lens, k_lens = (40, 20), (300, 20)
    x = _inputs(q_lens, k_lens, 2, 4, gen)
    q2k = _random_selection(q_lens, k_lens, 2, 4, gen)
    good = dict(cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens), max_seqlen_q=40,
                max_seqlen_k=300)
    call = lambda q2k=q2k, k=x["k"], v=x["v"], **kw: prefill.sparse_atten_from_selection(  # noqa
        x["q"], k, v, q2k, **{**good, **kw})
    with pytest.raises(ValueError, match="q2k_indices: expected shape"):
        call(q2k=q2k[:, :30].contiguous())
    with pytest.raises(ValueError, match="q2k_indices: expected shape"):
        call(q2k=q2k[:1].contiguous())
    with pytest.raises(TypeError, match="q2k_indices"):
        call(q2k=q2k.long())
    with pytest.raises(ValueError, match="q2k_indices.*topK"):
        call(q2k=q2k[:, :, :3].contiguous())
    with pytest.raises(ValueError, match="k: expected dense"):
        call(k=x["k"][:256].reshape(2, 2, 128, 128), v=x["v"][:256].reshape(2, 2, 128, 128))
    with pytest.raises(TypeError, match="v: dtype"):
        call(v=x["v"].float())
    with pytest.raises(TypeError, match="partial_dtype"):
        call(partial_dtype=torch.int8)
    with pytest.raises(ValueError, match="workspace_bytes"):
        call(workspace_bytes=0)
    with pytest.raises(TypeError, match="causal"):
        call(causal=1)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        call(check_input_valid=True, max_seqlen_q=39)
    bad = q2k.clone()
    bad[0, 45, 0] = 1                                   # request 1 has one block
    with pytest.raises(ValueError, match="q2k_indices"):
        call(q2k=bad, check_input_valid=True)
