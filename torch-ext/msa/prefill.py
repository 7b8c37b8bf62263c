"""Production MSA prefill: the pipeline in query chunks with bounded workspace, key splits of
the indexer for short chunks, and the plan/run wrapper over a paged KV cache.

One prefill call runs index scores -> top-k (own block forced) -> k2q CSR + schedule -> sparse
attention (docs/design-production-prefill.md). Two entry points share the machinery here:

* :class:`MsaPrefillPagedWrapper` (chunked prefill as engines hold the cache): K/V and index-K
  in 128-token pages, each request's new queries at the end of its keys. ``plan`` reads host
  lengths once per batch and builds every index tensor on the device; ``run`` only launches
  device work, so a CUDA graph can hold it.
* :func:`msa.msa_prefill` (dense K/V): the same stages; a call above the workspace budget runs
  in query chunks whose sub-batch metadata is computed on the device (no host sync).

**Query chunks.** A chunk is a range [t0, t1) of the call's packed queries. Request r (q_len Q,
k_len K) contributes its queries in the range as a sub-request; with causal masking (bottom-right:
query i sees keys j <= i + K - Q) the sub-request's keys end at its last query in the chunk:
k_sub = K - Q + (queries of r up to t1), so the bottom-right rule of the sub-request equals the
call's. A chunk's workspace (scores, selection, CSR, partials) is proportional to t1 - t0.

**Key splits of the indexer.** The prefill indexer kernel gives one CTA 256 / H_idx queries of
one request and walks the key tiles they see, so a chunk of a few hundred queries would run on a
few SMs (about 12 us per 1k keys). A chunk whose query tiles leave SMs idle launches S CTAs per
query tile instead, each computing an equal share of its key tiles in place
(:func:`index_key_splits`; the kernels' grid z): the same scores, no gather.

**Decode route for short chunks.** A chunk of a few hundred queries against a long prefix pays
the CSR, the KV-outer attention's per-block partials and their combine, each costing its launches
more than its bytes. :class:`DecodeRoute` runs such a chunk's attention as one paged decode call
instead (:class:`msa.SparseDecodePagedAttentionWrapper`, one decode request per query: that
query's page-table row, seqused_k = the keys it sees, the chunk's selection as q2k): no CSR, no
partials, O written once. ``attention_route="auto"`` takes it where the H200 measured a gain
(:func:`takes_decode_route`).

Peak memory of a call: at most inputs + O [T, Hq, 128] bf16 + min(T, C) * W_q, where W_q is
:func:`workspace_bytes_per_query` and C = :func:`chunk_tokens` (default budget 16 GiB).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import _backend, _stages
from ._common import owning_segment
from ._common import sm_count as _sm_count
from ._validation import (BLOCK_SIZE, FP8, HEAD_DIM, SUPPORTED_TOPK, check_cu_seqlens,
                          check_head_dim, check_hint, check_k2q_build_values, check_page_ids,
                          check_page_table, check_partial_dtype, check_planned,
                          check_positive_int, check_prefix_sums, check_qhead_per_kv,
                          check_same_device, check_scale, check_shape, check_tensor, check_topk,
                          host_int64, value_checks_requested)
from .decode import SparseDecodePagedAttentionWrapper
from .indexer import INDEX_DTYPES, chunk_block_max_scores
from .interface import (_check_k2q_csr_args, build_k2q_csr, check_attention_operands,
                        planned_sparse_atten, sparse_atten_func)
from .topk import sparse_topk_select

DEFAULT_WORKSPACE_BYTES = 16 << 30
MIN_CHUNK_TOKENS = 1024
# (query, index head) rows per CTA of the prefill indexer kernel, and rows per request that the
# paged decode indexer serves (it splits the keys across CTAs itself).
INDEXER_TILE_ROWS = 256
DECODE_INDEXER_ROWS = 64
# A split keeps at least this many 128-key tiles (the indexer keeps three in flight).
SPLIT_K_MIN_TILES = 4
# Where a chunk's attention runs: "sparse" (CSR + KV-outer sparse attention + combine),
# "decode" (the paged decode kernel, one request per query, wherever a chunk can take it) or
# "auto". "auto" takes the decode route for e4m3 q and K/V chunks of at most
# DECODE_ROUTE_MAX_QUERIES queries with at least DECODE_ROUTE_MIN_KEYS_PER_QUERY keys per query,
# the keys of all the chunk's requests counted: the decode route's time grows with the queries
# (~0.8 us each, flat in the keys), the sparse route's with the (block, KV head) work items, ~
# the chunk's keys. H100, MiniMax-M3's 11 short production chunks, e4m3, both routes forced in
# one process (`bench_prefill_production.py --impls paged-sparse,paged-decode`, sparse route on
# wsp3we): decode / sparse time 1.42x at 97 keys a query, 1.27x at 163, 1.18x at 221, 1.11x at
# 243, 1.07x at 324; 0.96x at 365, 0.92x at 379, 0.81x at 508, 0.78x at 525, 0.62x at 813: the
# bound sits between 324 and 365.
ATTENTION_ROUTES = ("auto", "sparse", "decode")
DECODE_ROUTE_MAX_QUERIES = 416
DECODE_ROUTE_MIN_KEYS_PER_QUERY = 350
# Bytes per (query, KV head, top-k slot) of the selection, q2k, CSR ids, qsplit ids and the
# CSR builder's sort keys / values (double-buffered).
_INDEX_BYTES_PER_SLOT = 40


# ---------------------------------------------------------------------------------------------
# Sizing
# ---------------------------------------------------------------------------------------------

def workspace_bytes_per_query(*, num_qo_heads: int, num_kv_heads: int, topk: int,
                              max_k_tiles: int, partial_dtype: torch.dtype) -> int:
    """Device bytes one query of a chunk needs beyond the call's inputs and output: index
    scores [Hkv, tiles, T] fp32, O / LSE partials [topk, T, Hq, 128 | 1], the chunk's O and LSE,
    and the selection / CSR. max_k_tiles=0: a chunk without the index stage
    (:func:`sparse_atten_from_selection`)."""
    partial = torch.empty((), dtype=partial_dtype).element_size()
    scores = 4 * num_kv_heads * max_k_tiles
    partials = topk * num_qo_heads * (HEAD_DIM * partial + 4)
    chunk_out = num_qo_heads * (HEAD_DIM * 2 + 4)
    return scores + partials + chunk_out + _INDEX_BYTES_PER_SLOT * num_kv_heads * topk


def chunk_tokens(total_q: int, bytes_per_query: int,
                 workspace_bytes: Optional[int] = None) -> int:
    """Queries per chunk: the whole call when it fits the budget, else the largest multiple of
    128 within it (at least MIN_CHUNK_TOKENS, so a tiny budget still makes progress)."""
    budget = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    if total_q * bytes_per_query <= budget:
        return max(total_q, 1)
    fit = max(budget // max(bytes_per_query, 1), MIN_CHUNK_TOKENS)
    return max(BLOCK_SIZE, fit // BLOCK_SIZE * BLOCK_SIZE)


def index_key_splits(indexer_ctas: int, max_k_tiles: int, sm_count: int) -> int:
    """CTAs per query tile of the prefill indexer (its key splits): as many as fill the SMs once
    (the kernel runs one CTA per SM), each split at least SPLIT_K_MIN_TILES of the longest
    request's tiles; 1 when the query tiles alone fill the GPU."""
    splits = min(sm_count // max(indexer_ctas, 1), max_k_tiles // SPLIT_K_MIN_TILES)
    return max(splits, 1)


# ---------------------------------------------------------------------------------------------
# Sub-call metadata (torch ops only: no host sync, any device)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ChunkPlan:
    """One query chunk [q_begin, q_end) of a prefill call, as the stages consume it."""
    q_begin: int
    q_end: int
    cu_seqlens_q: torch.Tensor           # [B'+1] int32
    cu_seqlens_k: torch.Tensor           # [B'+1] int32 (dense: key offsets; paged: prefix)
    seqused_k: Optional[torch.Tensor]    # paged: [B'] int32
    max_seqlen_q: int
    max_seqlen_k: int
    total_k: int                         # host hint of build_k2q_csr
    total_rows: Optional[int]            # exact CSR rows when the host knows them
    num_valid_pages: Optional[torch.Tensor]  # [T_c] int32 (None: no index stage)
    own_block: Optional[torch.Tensor]        # [T_c] int32 (None: no index stage)
    index_splits: int = 1                    # the indexer's CTAs per query tile (key splits)
    route: Optional["DecodeRoute"] = None    # paged: the chunk's attention as one decode call
    # Made on the host from the plan's lengths (MsaPrefillPagedWrapper.plan): its prefix sums
    # are valid by construction, so the stages' native glue takes them as they are.
    planned: bool = False
    # A planned causal chunk's [B'] int32 bottom-right offsets (seqused_k - the chunk's queries
    # per request), which the indexer's native glue would otherwise derive on the device.
    causal_offsets: Optional[torch.Tensor] = None

    @property
    def max_k_tiles(self) -> int:
        return -(-self.max_seqlen_k // BLOCK_SIZE)

    def to(self, device: torch.device) -> "ChunkPlan":
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


class DecodeRoute:
    """A paged chunk's attention as one paged decode call: decode request t is the chunk's query
    t (seqlen_q = 1) with its request's page-table row and seqused_k = the keys it sees, so the
    decode kernel's bottom-right rule is the chunk's; q2k is the chunk's selection. The buffers
    the decode plan keeps by reference are filled by :meth:`run` (the call's page table, gathered
    per query) and by the caller (the selection, :attr:`q2k`)."""

    def __init__(self, row_request: List[int], seqused_k: List[int], *, page_table_width: int,
                 num_qo_heads: int, num_kv_heads: int, topk: int, e4m3_only: bool,
                 device: torch.device):
        rows = len(row_request)
        self.e4m3_only = e4m3_only
        self.row_request = torch.tensor(row_request, dtype=torch.int64, device=device)
        self.seqused_k = torch.tensor(seqused_k, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(rows, page_table_width, dtype=torch.int32, device=device)
        self.q2k = torch.full((num_kv_heads, rows, topk), -1, dtype=torch.int32, device=device)
        # Sized from max_seqlen_k (no read of seqused_k): plan without a synchronization.
        self.wrapper = SparseDecodePagedAttentionWrapper().plan(
            page_table=self.page_table, seqused_k=self.seqused_k, seqlen_q=1,
            max_seqlen_k=max(seqused_k), q2k_indices=self.q2k, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, enable_cuda_graph=True)

    def serves(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether this call's dtypes take the route ("auto": e4m3 q and K/V only)."""
        return not self.e4m3_only or (q.dtype == FP8 and k.dtype == FP8)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            page_table: torch.Tensor, softmax_scale: Optional[float], want_lse: bool):
        """O (and LSE with want_lse) of the chunk's queries q over the selection in q2k."""
        torch.index_select(page_table, 0, self.row_request, out=self.page_table)
        return self.wrapper.run(q, k_cache, v_cache, softmax_scale=softmax_scale,
                                return_softmax_lse=want_lse)


def takes_decode_route(route: str, queries: int, keys: int) -> bool:
    """Whether a chunk of `queries` queries whose requests hold `keys` keys in all runs its
    attention through the decode route under `route` (ATTENTION_ROUTES; "auto" also needs e4m3
    q and K/V, checked at run)."""
    if route == "decode":
        return True
    return (route == "auto" and queries <= DECODE_ROUTE_MAX_QUERIES
            and queries * DECODE_ROUTE_MIN_KEYS_PER_QUERY <= keys)


def plan_decode_route(qo: Sequence[int], kv: Sequence[int], t0: int, t1: int, causal: bool,
                      **route_args) -> Optional[DecodeRoute]:
    """The decode route of the chunk [t0, t1) of a paged call (host lengths qo, kv), or None when
    one of its queries would see no key (a request with more queries than keys)."""
    row_request, seqused = [], []
    start = 0
    for b, (q_len, k_len) in enumerate(zip(qo, kv)):
        lo, hi = max(t0, start), min(t1, start + q_len)
        for t in range(lo, hi):
            seen = k_len - q_len + (t - start) + 1 if causal else k_len
            if seen < 1:
                return None
            row_request.append(b)
            seqused.append(seen)
        start += q_len
    return DecodeRoute(row_request, seqused, **route_args)


def _prefix(lengths: torch.Tensor) -> torch.Tensor:
    """[n] -> [n+1] int32 exclusive prefix sums starting at 0."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    out[1:] = lengths.reshape(-1).cumsum(0)
    return out.to(torch.int32)


def chunk_lengths(cu_q: torch.Tensor, k_len: torch.Tensor, t0: int, t1: int,
                  causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per request (int64): the queries it has in [t0, t1) and the keys they need (0 for a
    request without queries there; causal: up to the chunk's last query, bottom-right)."""
    cu_q = cu_q.to(torch.int64)
    k_len = k_len.to(torch.int64)
    q_start, q_len = cu_q[:-1], cu_q[1:] - cu_q[:-1]
    before = (t0 - q_start).clamp(min=0).minimum(q_len)
    upto = (t1 - q_start).clamp(min=0).minimum(q_len)
    q_sub = upto - before
    k_sub = (k_len - q_len + upto).clamp(min=0).minimum(k_len) if causal else k_len
    return q_sub, torch.where(q_sub > 0, k_sub, torch.zeros_like(k_sub))


def dense_chunk_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, t0: int, t1: int,
                        causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens_q, cu_seqlens_k) [2B+1] int32 of a dense chunk: request r becomes (r's
    queries in the chunk, its first k_sub keys) followed by a zero-query gap request holding its
    remaining keys, so every request keeps its key start and cu_seqlens_k stays a prefix sum."""
    cu_k64 = cu_k.to(torch.int64)
    q_sub, k_sub = chunk_lengths(cu_q, cu_k64[1:] - cu_k64[:-1], t0, t1, causal)
    starts = _prefix(q_sub)
    batch = q_sub.numel()
    cu_q_sub = torch.empty(2 * batch + 1, dtype=torch.int32, device=cu_q.device)
    cu_q_sub[0::2] = starts
    cu_q_sub[1::2] = starts[1:]
    cu_k_sub = torch.empty_like(cu_q_sub)
    cu_k_sub[0::2] = cu_k
    cu_k_sub[1::2] = (cu_k64[:-1] + k_sub).to(torch.int32)
    return cu_q_sub, cu_k_sub


# ---------------------------------------------------------------------------------------------
# The pipeline of one chunk
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PrefillOptions:
    topk: int
    local_blocks: int
    causal: bool
    partial_dtype: torch.dtype
    softmax_scale: Optional[float]
    index_scale: float
    qhead_per_kv: int


def _index_scores(chunk: ChunkPlan, q_idx: torch.Tensor, k_idx: torch.Tensor,
                  index_page_table: Optional[torch.Tensor], opts: PrefillOptions
                  ) -> torch.Tensor:
    """[Hkv, chunk.max_k_tiles, T_c] fp32 block max scores of the chunk's queries."""
    paged = index_page_table is not None
    return chunk_block_max_scores(
        q_idx, k_idx, chunk.cu_seqlens_q, None if paged else chunk.cu_seqlens_k,
        max_seqlen_q=chunk.max_seqlen_q, max_seqlen_k=chunk.max_seqlen_k,
        scale=opts.index_scale, causal=opts.causal, page_table=index_page_table,
        seqused_k=chunk.seqused_k if paged else None, max_k_tiles=chunk.max_k_tiles,
        planned=chunk.planned, key_splits=chunk.index_splits,
        planned_offsets=chunk.causal_offsets)


def run_chunk(chunk: ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              q_idx: torch.Tensor, k_idx: torch.Tensor, opts: PrefillOptions, *,
              page_table: Optional[torch.Tensor] = None,
              index_page_table: Optional[torch.Tensor] = None, want_lse: bool = False,
              want_selection: bool = False, q2k: Optional[torch.Tensor] = None):
    """The four stages on one chunk (q, q_idx: the chunk's rows); given the chunk's selection
    q2k [Hkv, T_c, topk] (contiguous), only the CSR and the attention; with the chunk's decode
    route (paged, dtypes it serves, its own selection), the attention as one decode call instead
    of the CSR, the sparse attention and its combine. Returns (O, LSE or None, q2k)."""
    # The decode route belongs to paged chunks, which compute their own selection.
    route = chunk.route if q2k is None and chunk.route is not None and chunk.route.serves(q, k) \
        else None
    if q2k is None:
        _stages.mark("indexer")
        scores = _index_scores(chunk, q_idx, k_idx, index_page_table, opts)
        _stages.mark("topk")
        # The top-k writes the q2k layout [Hkv, T_c, topk] itself (through its transposed view).
        q2k = route.q2k if route is not None else torch.empty(
            scores.shape[0], scores.shape[2], opts.topk, dtype=torch.int32, device=scores.device)
        sparse_topk_select(scores, opts.topk, chunk.num_valid_pages, output=q2k.permute(1, 0, 2),
                           force_end_blocks=opts.local_blocks,
                           causal_end_block=chunk.own_block if opts.causal else None)
        if route is not None and want_selection:
            q2k = route.q2k.clone()
        del scores                      # the attention's partials may reuse their memory
    if route is not None:
        _stages.mark("attention")
        result = route.run(q, k, v, page_table, opts.softmax_scale, want_lse)
        _stages.mark("end")
        out, lse = result if want_lse else (result, None)
        return out, lse, q2k
    _stages.mark("csr")
    row_ptr, q_ids, schedule = build_k2q_csr(
        q2k, chunk.cu_seqlens_q, chunk.cu_seqlens_k, BLOCK_SIZE, total_k=chunk.total_k,
        max_seqlen_k=chunk.max_seqlen_k, max_seqlen_q=chunk.max_seqlen_q,
        total_rows=chunk.total_rows, qhead_per_kv=opts.qhead_per_kv, return_schedule=True)
    _stages.mark("attention")
    result = (planned_sparse_atten if chunk.planned else sparse_atten_func)(
        q, k, v, row_ptr, q_ids, opts.topk, cu_seqlens_q=chunk.cu_seqlens_q,
        cu_seqlens_k=chunk.cu_seqlens_k, max_seqlen_q=chunk.max_seqlen_q,
        max_seqlen_k=chunk.max_seqlen_k, blk_kv=BLOCK_SIZE, causal=opts.causal,
        softmax_scale=opts.softmax_scale, partial_dtype=opts.partial_dtype,
        return_softmax_lse=want_lse, page_table=page_table,
        seqused_k=chunk.seqused_k if page_table is not None else None, schedule=schedule)
    _stages.mark("end")
    out, lse = result if want_lse else (result, None)
    return out, lse, q2k


def run_chunks(chunks: Sequence[ChunkPlan], q, k, v, q_idx, k_idx, opts: PrefillOptions, *,
               page_table=None, index_page_table=None, want_lse: bool = False,
               want_selection: bool = False, out: Optional[torch.Tensor] = None,
               lse: Optional[torch.Tensor] = None, selection: Optional[torch.Tensor] = None):
    """Every chunk in order; a single chunk's fresh outputs are returned as they are (copied
    into `out` / `lse` when given). With `selection` (the call's q2k [Hkv, T, topk]) the chunks
    skip the index stages and attend over its rows (copied per chunk when Hkv > 1, where a
    chunk's rows are not contiguous). Returns (O, LSE or None, q2k or None)."""
    total_q, num_kv_heads = q.shape[0], k.shape[1]
    q2k_all = None
    for chunk in chunks:
        t0, t1 = chunk.q_begin, chunk.q_end
        whole = t0 == 0 and t1 == total_q      # no view of the inputs when the chunk is the call
        rows = (lambda t: t) if whole else (lambda t: t[t0:t1])
        o_c, lse_c, q2k_c = run_chunk(
            chunk, rows(q), k, v, None if q_idx is None else rows(q_idx), k_idx, opts,
            page_table=page_table, index_page_table=index_page_table, want_lse=want_lse,
            want_selection=want_selection,
            q2k=None if selection is None else selection[:, t0:t1].contiguous())
        if len(chunks) == 1 and out is None and lse is None:
            return o_c, lse_c, (q2k_c if want_selection else None)
        if out is None:
            out = torch.empty(total_q, *o_c.shape[1:], dtype=o_c.dtype, device=o_c.device)
        out[t0:t1].copy_(o_c)
        if want_lse:
            if lse is None:
                lse = torch.empty(total_q, o_c.shape[1], dtype=torch.float32, device=o_c.device)
            lse[t0:t1].copy_(lse_c)
        if want_selection:
            if q2k_all is None:
                q2k_all = torch.empty(num_kv_heads, total_q, opts.topk, dtype=torch.int32,
                                      device=q2k_c.device)
            q2k_all[:, t0:t1].copy_(q2k_c)
        del o_c, lse_c, q2k_c
    return out, (lse if want_lse else None), q2k_all


# ---------------------------------------------------------------------------------------------
# msa_prefill (dense K/V)
# ---------------------------------------------------------------------------------------------

def plan_dense_chunks(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, total_q: int,
                      total_k: int, max_seqlen_q: int, max_seqlen_k: int, num_qo_heads: int,
                      num_kv_heads: int, opts: PrefillOptions,
                      workspace_bytes: Optional[int] = None,
                      index_stage: bool = True) -> List[ChunkPlan]:
    """Chunks of a dense call from host bounds only (lengths stay on the device).
    index_stage=False: chunks for a given selection (no index scores, no top-k metadata)."""
    tiles = -(-max(max_seqlen_k, 1) // BLOCK_SIZE)
    per_query = workspace_bytes_per_query(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                          topk=opts.topk,
                                          max_k_tiles=tiles if index_stage else 0,
                                          partial_dtype=opts.partial_dtype)
    step = chunk_tokens(total_q, per_query, workspace_bytes)
    device = cu_seqlens_q.device
    sm_count = _sm_count(device)
    chunks = []
    for t0 in range(0, max(total_q, 1), step):
        t1 = min(total_q, t0 + step)
        if t0 == 0 and t1 == total_q:
            cu_q, cu_k, mq = cu_seqlens_q, cu_seqlens_k, max_seqlen_q
        else:
            cu_q, cu_k = dense_chunk_seqlens(cu_seqlens_q, cu_seqlens_k, t0, t1, opts.causal)
            mq = min(max_seqlen_q, t1 - t0)
        if not index_stage:
            chunks.append(ChunkPlan(t0, t1, cu_q, cu_k, None, mq, max_seqlen_k, total_k, None,
                                    None, None))
            continue
        nvp, own = _per_query_block_bounds(cu_q, cu_k, t1 - t0)
        # The lengths are on the device: the chunk's CTAs counted as if it were one request (a
        # lower bound when it holds several).
        ctas = -(-(t1 - t0) * num_kv_heads // INDEXER_TILE_ROWS)
        chunks.append(ChunkPlan(t0, t1, cu_q, cu_k, None, mq, max_seqlen_k, total_k, None,
                                nvp, own, index_key_splits(ctas, tiles, sm_count)))
    return chunks


def run_dense_prefill(q, k, v, q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q,
                      max_seqlen_k, opts: PrefillOptions, return_selection: bool,
                      workspace_bytes: Optional[int] = None):
    """msa_prefill after validation: plan the chunks on the device and run them."""
    chunks = plan_dense_chunks(cu_seqlens_q, cu_seqlens_k, total_q=q.shape[0],
                               total_k=k.shape[0], max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, num_qo_heads=q.shape[1],
                               num_kv_heads=k.shape[1], opts=opts,
                               workspace_bytes=workspace_bytes)
    out, _lse, q2k = run_chunks(chunks, q, k, v, q_idx, k_idx, opts,
                                want_selection=return_selection)
    return (out, q2k) if return_selection else out


# ---------------------------------------------------------------------------------------------
# Sparse attention over a given selection (dense K/V)
# ---------------------------------------------------------------------------------------------

def msa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor,
                k_idx: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                max_seqlen_q: int, max_seqlen_k: int, topk: int = 16,
                softmax_scale: Optional[float] = None, index_scale: float = 1.0,
                local_blocks: int = 1, causal: bool = True, return_selection: bool = False,
                partial_dtype: torch.dtype = torch.bfloat16,
                workspace_bytes: Optional[int] = None, check_input_valid: bool = False):
    """MSA prefill: index scores -> top-k blocks per (query, KV head) -> block-sparse attention.

    Args:
      q: [total_q, Hq, 128]; k, v: dense [total_k, Hkv, 128] (dtypes as ``sparse_atten_func``:
        all bf16, all e4m3, or bf16 q with e4m3 k/v); Hq / Hkv in {1, 2, 4, 8, 16}.
      q_idx: [total_q, Hkv, 128] index queries, one index head per KV head group (M3: 4).
      k_idx: [total_k, Hk, 128] index keys with Hkv % Hk == 0 (M3: Hk = 1, a shared index key).
      cu_seqlens_q, cu_seqlens_k: [B+1] int32; cu_seqlens_q[-1] == total_q.
      max_seqlen_q, max_seqlen_k: host upper bounds on the lengths.
      topk: blocks per (query, KV head), in {4, 8, 16, 32} (M3: 16).
      softmax_scale: attention logit scale, default 128**-0.5.
      index_scale: index score scale (M3: 1.0; it does not change the selection).
      local_blocks: how many blocks ending at the query's own block are forced (M3: 1), 0..topk.
      causal: bottom-right causal attention and causal index scores. With causal=False every
        key of the request is visible, and the forced window is the request's last
        local_blocks blocks instead.
      return_selection: also return the selection.
      partial_dtype: the sparse attention's per-block partial dtype (``sparse_atten_func``:
        fp32, bf16, fp16 or e4m3; e4m3 halves the partial traffic at the contract's looser fp8
        tolerance).
      workspace_bytes: bound on the call's scratch memory (default 16 GiB, see
        ``msa.prefill``): a call whose workspace would exceed it runs in query chunks of
        ``msa.prefill.chunk_tokens`` queries (same result; peak memory <= inputs + O + one
        chunk's workspace).
      check_input_valid: check the index values once before any launch (prefix sums, the
        max_seqlen hints); MSA_CHECK_INPUTS=1 does so for every call.

    Returns O [total_q, Hq, 128] bf16, or (O, q2k [Hkv, total_q, topk] int32) with
    return_selection (ids ascending, -1 tail, own block always present when causal).

    Call sequence (engines can replicate it step by step; none of it syncs the host here):
      1. scores = block_max_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k,
             max_seqlen_q=..., max_seqlen_k=..., scale=index_scale, causal=causal)
             -> [Hkv, ceil(max_seqlen_k/128), total_q]
      2. per query t of request b at local position i, on the device:
             num_valid_pages[t] = ceil(k_len_b / 128)
             causal_end_block[t] = (i + k_len_b - q_len_b) // 128       (its own block)
      3. q2k = torch.empty(Hkv, total_q, topk, dtype=torch.int32)
      4. sparse_topk_select(scores, topk, num_valid_pages, output=q2k.permute(1, 0, 2),
             force_end_blocks=local_blocks, causal_end_block=causal_end_block)
                                               -> q2k [Hkv, total_q, topk], the selection
      5. row_ptr, q_ids, schedule = build_k2q_csr(q2k, cu_seqlens_q, cu_seqlens_k, 128,
             total_k=k.shape[0], max_seqlen_k=..., max_seqlen_q=..., qhead_per_kv=Hq // Hkv,
             return_schedule=True)
      6. O = sparse_atten_func(q, k, v, row_ptr, q_ids, topk, cu_seqlens_q=..., cu_seqlens_k=...,
             max_seqlen_q=..., max_seqlen_k=..., causal=causal, softmax_scale=softmax_scale,
             partial_dtype=partial_dtype, schedule=schedule)
    A call of few queries against many keys runs step 1 on key splits (more CTAs per query
    tile, the same scores); a call past ``workspace_bytes`` runs steps 1-6 per
    query chunk. :class:`msa.MsaPrefillPagedWrapper` is the same pipeline over a paged cache
    with the metadata planned once per batch.
    """
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=3)
    check_tensor("q_idx", q_idx, ndim=3)
    check_tensor("k_idx", k_idx, ndim=3)
    num_kv_heads = k.shape[1]
    qhead_per_kv = check_qhead_per_kv(q.shape[1], num_kv_heads)
    check_topk("topk", topk, SUPPORTED_TOPK)
    check_positive_int("local_blocks", local_blocks)
    if local_blocks > topk:
        raise ValueError(f"local_blocks: {local_blocks} exceeds topk = {topk}")
    if q_idx.shape[0] != q.shape[0]:
        raise ValueError(f"q_idx: has {q_idx.shape[0]} tokens but q has {q.shape[0]}")
    if q_idx.shape[1] != num_kv_heads:
        raise ValueError(f"q_idx: expected {num_kv_heads} index heads (one per KV head), got "
                         f"{q_idx.shape[1]}")
    if k_idx.shape[0] != k.shape[0]:
        raise ValueError(f"k_idx: has {k_idx.shape[0]} tokens but k has {k.shape[0]}")
    check_same_device(q=q, k=k, v=v, q_idx=q_idx, k_idx=k_idx, cu_seqlens_q=cu_seqlens_q)
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)

    if workspace_bytes is not None:
        check_positive_int("workspace_bytes", workspace_bytes, minimum=1)
    if value_checks_requested(check_input_valid):      # TypeError before any launch
        _check_prefill_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    opts = PrefillOptions(topk=topk, local_blocks=local_blocks, causal=bool(causal),
                          partial_dtype=partial_dtype, softmax_scale=softmax_scale,
                          index_scale=index_scale, qhead_per_kv=qhead_per_kv)
    return run_dense_prefill(q, k, v, q_idx, k_idx, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, opts=opts,
                             return_selection=return_selection, workspace_bytes=workspace_bytes)


def _check_prefill_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """msa_prefill's index values (one sync): both prefix sums start at 0 and never decrease,
    cu_seqlens_q ends at q.shape[0], cu_seqlens_k within k, and the max_seqlen hints are at least
    the longest request. The steps inside run on metadata derived from these."""
    host = host_int64(cu_q=cu_seqlens_q, cu_k=cu_seqlens_k)
    q_lens = check_prefix_sums("cu_seqlens_q", host["cu_q"], q.shape[0], "q.shape[0]")
    k_lens = check_prefix_sums("cu_seqlens_k", host["cu_k"], k.shape[0], "k.shape[0]",
                               exact=False)
    check_hint("max_seqlen_q", max_seqlen_q, int(q_lens.max()) if q_lens.numel() else 0,
               "the longest request's queries")
    check_hint("max_seqlen_k", max_seqlen_k, int(k_lens.max()) if k_lens.numel() else 0,
               "the longest request's keys")


def _per_query_block_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            total_q: int):
    """Per query token, on the device and without a host sync: (num_valid_pages [total_q],
    own block (i + k_len - q_len) // 128 [total_q]), both int32. Floor division keeps a query
    that sees no key (k_len < q_len, early rows) at a negative own block: it selects nothing."""
    device = cu_seqlens_q.device
    token = torch.arange(total_q, device=device, dtype=torch.int64)
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_k = cu_seqlens_k.to(torch.int64)
    request = owning_segment(cu_q, token)
    q_len = cu_q[request + 1] - cu_q[request]
    k_len = cu_k[request + 1] - cu_k[request]
    local = token - cu_q[request]
    num_valid_pages = torch.div(k_len + BLOCK_SIZE - 1, BLOCK_SIZE, rounding_mode="floor")
    own_block = torch.div(local + k_len - q_len, BLOCK_SIZE, rounding_mode="floor")
    return num_valid_pages.to(torch.int32), own_block.to(torch.int32)


def sparse_atten_from_selection(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                q2k_indices: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                causal: bool = True, softmax_scale: Optional[float] = None,
                                partial_dtype: torch.dtype = torch.bfloat16,
                                return_softmax_lse: bool = False,
                                workspace_bytes: Optional[int] = None,
                                check_input_valid: bool = False):
    """``build_k2q_csr`` + ``sparse_atten_func`` on a q2k selection, in query chunks whose
    workspace fits ``workspace_bytes`` (default 16 GiB): for a caller that selects its blocks
    itself (a model's own indexer) and whose call may be long (the partials alone are
    topK * Hq * 260 bytes per query with bf16 partials: 139 GB for 512k M3 queries).

    Args:
      q: [total_q, Hq, 128]; k, v: dense [total_k, Hkv, 128] (dtypes as ``sparse_atten_func``).
      q2k_indices: [Hkv, total_q, topK] int32, contiguous, batch-local block ids, -1 = empty
        slot (``build_k2q_csr``'s input); topK in {4, 8, 16, 32}.
      cu_seqlens_q, cu_seqlens_k: [B+1] int32 prefix sums (cu_seqlens_k[-1] <= total_k).
      max_seqlen_q, max_seqlen_k: host upper bounds on the lengths.
      causal, softmax_scale, partial_dtype, return_softmax_lse: as ``sparse_atten_func``.
      workspace_bytes: bound on the scratch of one chunk (CSR, schedule, partials, the chunk's
        O and LSE): chunks of :func:`chunk_tokens` queries for
        ``workspace_bytes_per_query(max_k_tiles=0)`` bytes each.
      check_input_valid: check the index values once before any launch (the prefix sums, the
        hints, every q2k id a block of its request); MSA_CHECK_INPUTS=1 does so for every call.

    Returns O [total_q, Hq, 128] bf16, or (O, LSE [total_q, Hq] fp32) with return_softmax_lse:
    what ``sparse_atten_func`` returns on the CSR of the whole selection (chunk c's queries
    attend, bottom-right causal, to their request's keys up to the chunk's last query, which is
    all a causal query of the chunk can see). No host synchronization; a chunk copies its own
    rows of q2k_indices (when Hkv > 1), never the whole selection.
    """
    qhead_per_kv = check_attention_operands(q, k, v)
    if k.dim() != 3:
        raise ValueError(f"k: expected dense [total_k, Hkv, 128], got {list(k.shape)} (a paged "
                         "cache goes through msa.MsaPrefillPagedWrapper)")
    csr_call = _check_k2q_csr_args(
        q2k_indices, cu_seqlens_q, cu_seqlens_k, BLOCK_SIZE, total_k=k.shape[0],
        max_seqlen_k=max_seqlen_k, max_seqlen_q=max_seqlen_q, total_rows=None,
        qhead_per_kv=qhead_per_kv, return_schedule=True, check_input_valid=check_input_valid)
    check_shape("q2k_indices", q2k_indices, (k.shape[1], q.shape[0], None))
    check_same_device(q=q, k=k, v=v, q2k_indices=q2k_indices, cu_seqlens_q=cu_seqlens_q)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    check_partial_dtype(partial_dtype)
    check_scale("softmax_scale", softmax_scale)
    if workspace_bytes is not None:
        check_positive_int("workspace_bytes", workspace_bytes, minimum=1)
    if csr_call.check_values:
        check_k2q_build_values(csr_call, strict=True)
    opts = PrefillOptions(topk=q2k_indices.shape[2], local_blocks=0, causal=causal,
                          partial_dtype=partial_dtype, softmax_scale=softmax_scale,
                          index_scale=1.0, qhead_per_kv=qhead_per_kv)
    chunks = plan_dense_chunks(cu_seqlens_q, cu_seqlens_k, total_q=q.shape[0],
                               total_k=k.shape[0], max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, num_qo_heads=q.shape[1],
                               num_kv_heads=k.shape[1], opts=opts,
                               workspace_bytes=workspace_bytes, index_stage=False)
    out, lse, _ = run_chunks(chunks, q, k, v, None, None, opts, want_lse=return_softmax_lse,
                             selection=q2k_indices)
    return (out, lse) if return_softmax_lse else out


# ---------------------------------------------------------------------------------------------
# Paged plan / run
# ---------------------------------------------------------------------------------------------

def _host_lengths(name: str, values) -> List[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-D integer tensor or a sequence of ints, got "
                             f"{values.dtype} of shape {list(values.shape)}")
        values = values.tolist()
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of ints, got {type(values).__name__}") \
            from None
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}: expected ints, got {type(x).__name__}")
        if x < 0:
            raise ValueError(f"{name}: lengths must be >= 0, got {x}")
    return values


class MsaPrefillPagedWrapper:
    """Plan-once, run-many MSA prefill over a paged KV cache (chunked prefill as engines run it).

    Request b has ``kv_lens[b]`` keys in the paged caches, its last ``qo_lens[b]`` of them being
    the new tokens whose queries this call computes (bottom-right causal: query i of b sees key
    j iff j <= i + kv_lens[b] - qo_lens[b]). Pages are 128 tokens; logical block beta of b is
    physical page ``page_table[b, beta]`` of k_cache / v_cache (and of k_idx_cache, through
    ``index_page_table``, default the same table).

    ``plan`` validates the layout, reads the host lengths, splits the call into query chunks
    whose workspace fits ``workspace_bytes`` (default 16 GiB), and puts every index tensor of
    every chunk on the device. ``run`` computes exactly what :func:`msa.msa_prefill` computes on
    the same keys: index scores, top-k with the own block forced, the k2q CSR and the sparse
    attention, without host synchronization and without host-to-device copies, so a CUDA graph
    can capture it (plan outside the capture). ``page_table`` / ``index_page_table`` are kept by
    reference: replays read their current contents.

    ``attention_route`` picks where each chunk's attention runs: ``"sparse"`` (the k2q CSR, the
    KV-outer sparse attention and its combine), ``"decode"`` (one paged decode call per chunk,
    one decode request per query: the same selection and masking, another summation order;
    every chunk whose queries all see a key) or ``"auto"`` (the default: the decode route for
    short e4m3 chunks against long prefixes, where it measured faster, see
    ``DECODE_ROUTE_MAX_QUERIES``). A decode-routed chunk keeps a [T_c, page_table width] int32
    copy of its queries' page-table rows and its selection on the device.
    """

    def __init__(self, *, topk: int = 16, local_blocks: int = 1, causal: bool = True,
                 partial_dtype: torch.dtype = torch.bfloat16,
                 workspace_bytes: Optional[int] = None, attention_route: str = "auto"):
        check_topk("topk", topk, SUPPORTED_TOPK)
        if attention_route not in ATTENTION_ROUTES:
            raise ValueError(f"attention_route: expected one of {list(ATTENTION_ROUTES)}, got "
                             f"{attention_route!r}")
        check_positive_int("local_blocks", local_blocks)
        if local_blocks > topk:
            raise ValueError(f"local_blocks: {local_blocks} exceeds topk = {topk}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
        check_partial_dtype(partial_dtype)
        if workspace_bytes is not None:
            check_positive_int("workspace_bytes", workspace_bytes, minimum=1)
        self.topk, self.local_blocks, self.causal = topk, local_blocks, causal
        self.partial_dtype = partial_dtype
        self.workspace_bytes = workspace_bytes
        self.attention_route = attention_route
        self.chunks: List[ChunkPlan] = []
        self._planned = False

    def plan(self, qo_lens: Union[Sequence[int], torch.Tensor],
             kv_lens: Union[Sequence[int], torch.Tensor], page_table: torch.Tensor, *,
             num_qo_heads: int, num_kv_heads: int, head_dim: int = HEAD_DIM,
             index_page_table: Optional[torch.Tensor] = None,
             max_chunk_tokens: Optional[int] = None,
             check_input_valid: bool = False) -> "MsaPrefillPagedWrapper":
        """Plan one batch; returns self.

        qo_lens, kv_lens: host ints per request (sequences or CPU tensors; kv_lens counts the
        prefix and the new tokens; a request with more queries than keys has early queries
        that see nothing). page_table [B, max_pages] int32 on the device, at least
        ceil(max(kv_lens) / 128) pages wide; index_page_table likewise for k_idx_cache.
        max_chunk_tokens caps the queries per chunk below what the workspace budget allows.
        check_input_valid=True (or MSA_CHECK_INPUTS=1) makes every run() check the page ids of
        every page holding keys against k_cache / k_idx_cache (one synchronization per run; the
        reference backend always checks). Unchecked native runs skip pages outside the pools.
        """
        qo = _host_lengths("qo_lens", qo_lens)
        kv = _host_lengths("kv_lens", kv_lens)
        if not qo:
            raise ValueError("qo_lens: expected at least one request")
        if len(kv) != len(qo):
            raise ValueError(f"kv_lens: has {len(kv)} requests but qo_lens has {len(qo)}")
        check_positive_int("num_qo_heads", num_qo_heads, minimum=1)
        check_positive_int("num_kv_heads", num_kv_heads, minimum=1)
        if head_dim != HEAD_DIM:
            raise NotImplementedError(f"head_dim: {head_dim} is not supported; only {HEAD_DIM}")
        g = check_qhead_per_kv(num_qo_heads, num_kv_heads, name="num_qo_heads",
                               kv_name="KV heads of num_kv_heads")
        if max_chunk_tokens is not None:
            check_positive_int("max_chunk_tokens", max_chunk_tokens, minimum=1)
        check_values = value_checks_requested(check_input_valid)
        self._index_table_name = "page_table" if index_page_table is None else "index_page_table"
        index_page_table = page_table if index_page_table is None else index_page_table
        needed = -(-max(kv) // BLOCK_SIZE) if max(kv) > 0 else 0
        for name, table in (("page_table", page_table), ("index_page_table", index_page_table)):
            check_page_table(table, len(qo))
            if table.shape[1] < max(needed, 1):
                raise ValueError(f"{name}: {table.shape[1]} pages per request cannot hold "
                                 f"{max(kv)} keys ({needed} pages of {BLOCK_SIZE})")
        check_same_device(page_table=page_table, index_page_table=index_page_table)

        total_q, max_kv = sum(qo), max(kv)
        tiles = max(-(-max_kv // BLOCK_SIZE), 1)
        per_query = workspace_bytes_per_query(num_qo_heads=num_qo_heads,
                                              num_kv_heads=num_kv_heads, topk=self.topk,
                                              max_k_tiles=tiles,
                                              partial_dtype=self.partial_dtype)
        step = chunk_tokens(total_q, per_query, self.workspace_bytes)
        if max_chunk_tokens is not None:
            step = min(step, max_chunk_tokens)
        device = page_table.device
        sm_count = _sm_count(device)
        cu_q = _prefix(torch.tensor(qo, dtype=torch.int64))
        kv_cpu = torch.tensor(kv, dtype=torch.int64)
        chunks = []
        for t0 in range(0, total_q, step):
            t1 = min(total_q, t0 + step)
            q_sub, k_sub = chunk_lengths(cu_q, kv_cpu, t0, t1, self.causal)
            cu_q_sub, cu_k_sub = _prefix(q_sub), _prefix(k_sub)
            nvp, own = _per_query_block_bounds(cu_q_sub, cu_k_sub, t1 - t0)
            max_q, max_k = int(q_sub.max()), max(int(k_sub.max()), 1)
            chunk_tiles = -(-max_k // BLOCK_SIZE)
            splits = 1
            # The paged decode indexer splits the keys itself for <= 64 rows per request.
            if max_q * num_kv_heads > DECODE_INDEXER_ROWS:
                ctas = sum(-(-int(n) * num_kv_heads // INDEXER_TILE_ROWS) for n in q_sub)
                splits = index_key_splits(ctas, chunk_tiles, sm_count)
            keys = int(k_sub.sum())
            route = None
            if takes_decode_route(self.attention_route, t1 - t0, keys):
                route = plan_decode_route(
                    qo, kv, t0, t1, self.causal, page_table_width=page_table.shape[1],
                    num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, topk=self.topk,
                    e4m3_only=self.attention_route == "auto", device=device)
            chunks.append(ChunkPlan(
                t0, t1, cu_q_sub, cu_k_sub, k_sub.to(torch.int32), max(max_q, 1), max_k,
                max(keys, 1), max(int(((k_sub + BLOCK_SIZE - 1) // BLOCK_SIZE).sum()), 1),
                nvp, own, splits, route, planned=True,
                causal_offsets=(k_sub - q_sub).to(torch.int32) if self.causal else None
            ).to(device))
        self.chunks = chunks
        self._qo, self._kv = qo, kv
        self._page_table, self._index_page_table = page_table, index_page_table
        self._num_qo_heads, self._num_kv_heads, self._qhead_per_kv = num_qo_heads, num_kv_heads, g
        self._total_q = total_q
        self._check_values = check_values
        self._planned = True
        return self

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def decode_routes(self) -> List[bool]:
        """Whether each chunk's attention can run as one decode call (for "auto": when q and
        K/V are e4m3)."""
        return [c.route is not None for c in self.chunks]

    @property
    def index_splits(self) -> List[int]:
        """Key splits of each chunk's indexer: CTAs per query tile (1: unsplit)."""
        return [c.index_splits for c in self.chunks]

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            q_idx: torch.Tensor, k_idx_cache: torch.Tensor, *,
            softmax_scale: Optional[float] = None, index_scale: float = 1.0,
            return_lse: bool = False, return_selection: bool = False,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
        """MSA prefill of the planned batch.

        q [T, Hq, 128] (T = sum(qo_lens), requests in order), k_cache / v_cache
        [pages, Hkv, 128, 128] (all bf16, all e4m3, or bf16 q with e4m3 K/V), q_idx
        [T, Hkv, 128] index queries (one index head per KV head), k_idx_cache
        [index pages, 1, 128, 128] (q_idx's dtype). softmax_scale default 128**-0.5;
        index_scale scales the index scores (> 0; it does not change the selection). out
        (bf16 [T, Hq, 128]) and lse (fp32 [T, Hq]) are written in place when given. Every
        argument is checked before the first launch.

        Returns O [T, Hq, 128] bf16, then LSE [T, Hq] fp32 with return_lse and q2k
        [Hkv, T, topk] int32 with return_selection (ids ascending, -1 tail).
        """
        if not self._planned:
            raise RuntimeError("run: called before plan(); call plan(...) first")
        _check_paged_prefill_tensors(q, k_cache, v_cache, q_idx, k_idx_cache)
        softmax_scale = check_scale("softmax_scale", softmax_scale)
        index_scale = check_scale("index_scale", index_scale, allow_none=False)
        check_planned("q", q.shape[0], "rows", "sum(qo_lens)", self._total_q)
        check_planned("q", q.shape[1], "heads", "num_qo_heads", self._num_qo_heads)
        check_planned("k_cache", k_cache.shape[1], "heads", "num_kv_heads", self._num_kv_heads)
        check_shape("q_idx", q_idx, (self._total_q, self._num_kv_heads, None))
        check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, q_idx=q_idx,
                          k_idx_cache=k_idx_cache, page_table=self._page_table)
        if out is not None:
            check_tensor("out", out, dtypes=(torch.bfloat16,), contiguous=True)
            check_shape("out", out, tuple(q.shape))
        if lse is not None:
            check_tensor("lse", lse, dtypes=(torch.float32,), contiguous=True)
            check_shape("lse", lse, tuple(q.shape[:2]))
        if self._check_values or _backend.reference_only(q.device):
            self._check_page_ids(k_cache.shape[0], k_idx_cache.shape[0])
        opts = PrefillOptions(self.topk, self.local_blocks, self.causal, self.partial_dtype,
                              softmax_scale, index_scale, self._qhead_per_kv)
        if self._total_q == 0:
            o = out if out is not None else torch.empty(q.shape, dtype=torch.bfloat16,
                                                        device=q.device)
            lse_out = lse if lse is not None else torch.full(
                q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
            sel = torch.empty(self._num_kv_heads, 0, self.topk, dtype=torch.int32,
                              device=q.device)
            return _shape_result(o, lse_out, sel, return_lse, return_selection)
        o, lse_out, q2k = run_chunks(self.chunks, q, k_cache, v_cache, q_idx, k_idx_cache, opts,
                                     page_table=self._page_table,
                                     index_page_table=self._index_page_table,
                                     want_lse=return_lse or lse is not None,
                                     want_selection=return_selection, out=out, lse=lse)
        return _shape_result(o, lse_out, q2k, return_lse, return_selection)

    def _check_page_ids(self, num_pages: int, num_index_pages: int) -> None:
        """The pages holding each request's keys lie in the K/V pool and the index-K pool (one
        synchronization)."""
        host = host_int64(page_table=self._page_table, index_page_table=self._index_page_table)
        lens = torch.tensor(self._kv, dtype=torch.int64)
        check_page_ids("page_table", host["page_table"], lens, BLOCK_SIZE, num_pages)
        check_page_ids(self._index_table_name, host["index_page_table"], lens, BLOCK_SIZE,
                       num_index_pages)


def _check_paged_prefill_tensors(q, k_cache, v_cache, q_idx, k_idx_cache) -> None:
    """dtypes, ranks, page size and head dims of a paged prefill run (metadata only)."""
    check_tensor("q", q, dtypes=(torch.bfloat16, FP8), ndim=3, contiguous=True)
    check_head_dim("q", q.shape[2])
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, dtypes=(torch.bfloat16, FP8), ndim=4, contiguous=True)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    if q.dtype == FP8 and k_cache.dtype != FP8:
        raise TypeError("k_cache: bf16 K/V needs a bf16 q; e4m3 q needs e4m3 K/V")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {list(v_cache.shape)} differs from k_cache's "
                         f"{list(k_cache.shape)}")
    if k_cache.shape[2] != BLOCK_SIZE:
        raise ValueError(f"k_cache: page size {k_cache.shape[2]} is not supported; only "
                         f"{BLOCK_SIZE}")
    check_head_dim("k_cache", k_cache.shape[3])
    check_tensor("q_idx", q_idx, dtypes=INDEX_DTYPES, ndim=3, contiguous=True)
    check_head_dim("q_idx", q_idx.shape[2])
    check_tensor("k_idx_cache", k_idx_cache, dtypes=(q_idx.dtype,), ndim=4, contiguous=True)
    if tuple(k_idx_cache.shape[1:]) != (1, BLOCK_SIZE, HEAD_DIM):
        raise ValueError(f"k_idx_cache: expected [pages, 1, {BLOCK_SIZE}, {HEAD_DIM}] (one shared "
                         f"index-key head), got {list(k_idx_cache.shape)}")


def _shape_result(out, lse, q2k, return_lse: bool, return_selection: bool):
    result = (out,) + ((lse,) if return_lse else ()) + ((q2k,) if return_selection else ())
    return result[0] if len(result) == 1 else result


__all__ = ["msa_prefill", "MsaPrefillPagedWrapper", "sparse_atten_from_selection",
           "workspace_bytes_per_query", "chunk_tokens", "index_key_splits"]
