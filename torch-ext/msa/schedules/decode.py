"""Split-KV schedule of paged decode (host-side planner, in the style of FlashInfer's decode plan).

A decode step has few query rows per request (``seqlen_q * G`` <= 256 per KV head), so one CTA per
(request, KV head) leaves most SMs idle when the batch is small and the context long. Split-KV
cuts each request's KV range into chunks of ``kv_chunk_size`` units; every (request, chunk,
qo tile) is one work item, run for each KV head (grid = ``[num_work, num_kv_heads]``). Each work
item writes a normalized partial output and its log-sum-exp into the workspaces; a merge pass
combines the partials of request b, found at ``merge_indptr[b] .. merge_indptr[b+1]``, with
``L = logsumexp_s LSE_s`` and ``O = sum_s exp(LSE_s - L) * O_s``.

Units of the KV range:
  * dense decode: KV pages of ``page_size`` tokens (logical page ids of the request);
  * sparse decode with qo tiles of one token: slots of the ``q2k`` row (the token's selected
    blocks, distinct, so equal slot counts balance), ``topK`` per request;
  * sparse decode with qo tiles spanning several tokens (MTP at G < qo_tile_rows): logical pages,
    as dense. A tile streams the union of its tokens' selections; cut by slots, a block that the
    tokens select in different slots would be streamed once per chunk. A page chunk reads every
    slot of its tokens and keeps the blocks in its page range (:func:`multi_token_tiles`).

Chunk s of a request covers units ``[s * kv_chunk_size, (s + 1) * kv_chunk_size)``, except the
request's last chunk, which runs to the request's end as the kernel sees it on the device
(``ceil(seqused_k[b] / page_size)`` pages, or ``topK`` slots). Hence a schedule stays correct
when the lengths grow after planning (as under CUDA-graph replays): the tail just lands in the
last chunk, and chunks past a shorter request's end are empty (O = 0, LSE = -inf).

The planner runs on the host. With ``enable_cuda_graph`` it sizes everything from
``max_seqlen_k`` (it never reads ``seqused_k``), so the grid and workspaces stay fixed across
replays; otherwise it reads ``seqused_k`` on the host (planning happens outside any capture).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

from .._common import sm_count
from .._validation import check_positive_int, check_tensor

# Query rows one CTA of the decode kernel covers for one KV head at most: two 64-row warpgroup
# MMA tiles. seqlen_q * G > 128 (e.g. MTP 16 x G 16) takes several qo tiles.
QO_TILE_ROWS = 128
# Query tiles of sparse multi-token decode. The tokens of a qo tile share its CTA's pages (the
# union of their selections), so where the tokens' selections barely overlap a 128-row tile
# (8 tokens x G 16) computes every row against ~8 x topK pages that one token each selected.
# Tiles of 16 rows (one token at G = 16) stream only their tokens' pages, on the kernel's
# split-keys forms. On the H200 (MTP 8, G 16, top-16, e4m3 q and K/V, B 32-128) they took the
# step's attention from 170 to 200 us at 4k keys (32 blocks for 128 selections: the union pays),
# from 311 to 206 us at 10k (78 blocks) and from 472 to 210 us at 100k; with bf16 the 128-row
# ping-pong form stays ahead everywhere. So: e4m3 q and K/V, and at least half as many blocks
# as the 128-row tile's selections. Two more rules, measured on an H100 (f6e4e96, MTP 8, G 16,
# Hkv 4, top-16, e4m3; benchmarks/lab/decode_sparse_mtp_forms.cu and bench_decode_production):
#  * where the 128-row tiles are fewer than half the SMs (B x Hkv x qo tiles; B 8 at Hkv 4: 32)
#    the query tiles' CTAs fill the GPU: B 8 / 4k attention 46.5 us against the ping-pong's 94
#    and the token-warps form's 88 (taken from 2 x topK blocks on; shorter contexts unmeasured);
#  * where the token-warps form serves the 128-row tiles (a warp per token, only its own
#    pages), it beats the query tiles: B 32 attention 106 vs 124 us at 5k, 124 vs 165 at 10k,
#    187 vs 195 at 100k; where the union is dense (union_dense, 4k-5k) the ping-pong union serves
#    the 128-row tiles instead.
QUERY_TILE_ROWS = 16
# A CUDA-graph plan of a dense call cannot see the lengths, so one wave of equal chunks finishes
# when the longest request does (a batch of lengths nominal +- 25 % ran ~1.25x its mean time).
# It aims for GRAPH_SPLIT_WAVES waves instead, whose chunks the hardware's CTA scheduler hands to
# SMs as they free up, where those chunks keep MIN_BALANCE_CHUNK_PAGES pages: a chunk costs its
# partial (fp32 O of its rows, written and read back: ~2 pages of K/V traffic) and a pipeline
# fill. On the H200 (MTP 8, bf16, lengths 100k +- 25 %): B 32 2198 -> 1999 us and B 64 4396 ->
# 3884 us at 8 waves (chunks of 123 / 245 pages); B 8 with 16 chunks of 61 pages a request was
# 10 % slower than with its one-wave 4 chunks, hence the floor of 96 pages. 16 or 32 waves of
# >= 32-page chunks gained nothing over 8 (B 8-128 x 50k / 100k): finer chunks pay in fills and
# partials what they save in balance.
GRAPH_SPLIT_WAVES = 8
MIN_BALANCE_CHUNK_PAGES = 96
# The persistent form of dense decode (the native kernel's persistent ping-pong form): one CTA
# per SM (persistent_ctas = max_grid_size) streams an equal share of all pages, the (request,
# KV head, qo tile) page sequences laid end to end and cut on the device from the live lengths,
# so neither ragged lengths nor a CUDA-graph plan's chunking leave SMs idle; a sequence cut by
# a share boundary leaves one partial per piece (at most two per CTA: workspace slots
# 2 * persistent_ctas). Planned for dense calls whose tiles take the ping-pong form (more than
# 64 rows) and batches of at most PERSISTENT_MAX_REQUESTS (its request table sits in shared
# memory), where it pays (persistent_pays). The chunked work items above stay in the plan:
# every other form runs them.
PERSISTENT_MIN_ROWS = 65
PERSISTENT_MAX_REQUESTS = 1024
# Pages per CTA (all sequences' pages as the plan sees them over persistent_ctas) from which the
# persistent form pays. Its costs are per piece (a turn without overlap, a finalize) and per cut
# sequence (a partial each piece writes and its merge reads back), so a CTA needs a long share
# to repay them. On the H200 (bench_decode_production --attention-forms pingpong,persistent,
# MTP 8, G 16, Hkv 4, the protocol's ragged lengths, one process, e319220), persistent vs the
# chunked plan: 1.07-1.14x at 4k-5k tokens and B 64-128 (60-120 pages a CTA), 1.04-1.27x from
# 10k at B >= 32 and from 50k at B 8 (76-3800); 0.94x at B 8 / 10k (24), 0.96-0.99x at B 32 /
# 4k-5k (30-38), 0.64-1.08x at 1k (2-31).
PERSISTENT_MIN_PAGES_PER_CTA = 64


def persistent_can_run(batch: int, seqlen_q: int, group: int, qo_tile_rows: int, *,
                       sparse_topk: Optional[int] = None,
                       fixed_split_size: Optional[int] = None,
                       disable_split_kv: bool = False) -> bool:
    """Whether a plan of these arguments can carry the persistent form (dense, no forced or
    disabled split, tiles of more than 64 rows, at most PERSISTENT_MAX_REQUESTS requests)."""
    return (sparse_topk is None and not disable_split_kv and fixed_split_size is None
            and batch <= PERSISTENT_MAX_REQUESTS
            and min(qo_tile_rows, seqlen_q * group) >= PERSISTENT_MIN_ROWS)


# e4m3 calls (P.V on e4m3 wgmma; bound by the consumers, not by HBM) gain nothing from the
# balance at 4k-5k keys, where the persistent form's pieces and merge cost more than the work
# items' tail (H100, one process, the protocol's ragged lengths, --attention-forms
# persistent_pv8,pingpong_pv8; persistent vs work items): B 64 / 4k 164.5 vs 144.5 us, B 128 /
# 4k 294.4 vs 269.9, B 64 / 5k 191.2 vs 183.4, B 128 / 5k 352.1 vs 330.4 (6fe4746; the same
# direction at a0af333 before the persistent turn loop lost its spills: 201.0 vs 182.3,
# 301.2 vs 274.9, 369.2 vs 334.5), while from 50k it is 1-10 % ahead and at 10k within 5 %
# either way (82d1706). So e4m3 takes it only where the plan's requests average at least this
# many pages (8k keys).
PERSISTENT_E4M3_MIN_PAGES_PER_REQUEST = 64


def persistent_pays_e4m3(planned_units: Sequence[int]) -> bool:
    """Whether an e4m3 call of a plan with the persistent form takes it: its requests'
    planned pages (schedule.planned_units) average PERSISTENT_E4M3_MIN_PAGES_PER_REQUEST."""
    return sum(planned_units) >= PERSISTENT_E4M3_MIN_PAGES_PER_REQUEST * max(len(planned_units), 1)


def persistent_pays(total_pages: int, ctas: int) -> bool:
    """Whether the persistent form beats the chunked plan for `total_pages` pages over all
    (request, KV head, qo tile) sequences (as the plan sees the lengths: max_seqlen_k for a
    CUDA-graph plan) and `ctas` CTAs."""
    return total_pages >= PERSISTENT_MIN_PAGES_PER_CTA * ctas


def multi_token_tiles(seqlen_q: int, group: int, qo_tile_rows: int) -> bool:
    """Whether a qo tile can hold rows of several tokens (rows are token * G + head in
    group, cut into tiles of qo_tile_rows): then a sparse plan's chunks are page ranges, not q2k
    slot ranges. The decode kernel applies the same rule to the same arguments."""
    return seqlen_q > 1 and group % qo_tile_rows != 0


def few_tiles(batch: int, num_kv_heads: int, qo_tiles: int, sms: int) -> bool:
    """Whether batch x num_kv_heads x qo_tiles tiles are fewer than half of `sms` SMs: one CTA a
    tile leaves the GPU idle, so the plan splits their keys over CTAs (the ping-pong form runs
    the splits) and the token-warps form, which streams each tile's pages in one CTA, does not
    pay (B 8 / 4k at Hkv 4, MTP 8 on an H100: 42 us ping-pong vs 57 token warps)."""
    return 2 * batch * num_kv_heads * qo_tiles < sms


def union_collapses(seqlen_q: int, group: int, max_seqlen_k: int, page_size: int,
                    sparse_topk: int) -> bool:
    """Whether a 128-row tile's union of selections holds at most half its tokens' selections
    (the context has fewer blocks than half of them): the tile then reads each page once where
    query tiles read it once a token."""
    selections = min(seqlen_q, QO_TILE_ROWS // group) * sparse_topk
    return 2 * _ceil_div(max_seqlen_k, page_size) < selections


# Selections of a 128-row tile per block of the planned context from which its sparse e4m3
# tiles take the ping-pong union rather than the token-warps form. A warp of the ping-pong form
# whose token did not select a union page skips that page's softmax; where the union is dense
# every warp of the token-warps form computes nearly every page anyway, and widens its K and V
# itself, where the ping-pong form reads the e4m3 pages on wgmma. On an H100 (07b845b, MTP 8,
# G 16, Hkv 4, top-16, the step's attention, protocol lengths nominal +- 25 %, planned for the
# longest): 4k (40 planned blocks, 3.2 selections a block) B 32 92.9 vs 104.7 us, B 128 342.5
# vs 354.1. With e4m3 P.V on the union's tiles (H100, a0af333, one process) 5k (49 blocks, 2.6)
# went its way too: B 32 98.3 vs 109.6 us, B 64 195.3 vs 193.2, B 128 366.8 vs 365.1; at 10k
# (1.3) the token warps stay ahead (B 32 122.5 vs 132.8, decode_sparse_mtp_forms.cu).
PINGPONG_UNION_MIN_SELECTIONS_PER_BLOCK = 2.5


def union_dense(seqlen_q: int, group: int, blocks: int, sparse_topk: int) -> bool:
    """Whether a 128-row tile's tokens make at least PINGPONG_UNION_MIN_SELECTIONS_PER_BLOCK
    selections per block of a `blocks`-block context: its sparse e4m3 tiles then take the
    ping-pong union instead of the token-warps form (where the ping-pong form takes them: more
    than 64 rows)."""
    selections = min(seqlen_q, QO_TILE_ROWS // group) * sparse_topk
    return PINGPONG_UNION_MIN_SELECTIONS_PER_BLOCK * blocks <= selections


def query_tile_rows(seqlen_q: int, group: int, max_seqlen_k: int, page_size: int,
                    sparse_topk: Optional[int], *, batch: Optional[int] = None,
                    num_kv_heads: int = 1, sms: Optional[int] = None,
                    token_warps: bool = False) -> Optional[int]:
    """Rows of the query tiles a sparse call of e4m3 q and K/V takes instead of QO_TILE_ROWS
    (the largest whole-token tile of at most QUERY_TILE_ROWS rows: one token at G = 16), or None
    where 128-row tiles serve: dense calls and tiles of <= QUERY_TILE_ROWS rows anyway. With
    batch and sms given: 128-row tiles where their union collapses (union_collapses) and the
    query tiles would take more than one wave of CTAs; query tiles where the 128-row tiles are
    few (few_tiles) and the context holds at least 2 x topK blocks. Otherwise 128-row tiles
    where the token-warps form serves them (token_warps) or the union collapses.

    Measured on an H100 (0aae2ed, 5edd7a9; MTP 8, G 16, top-16, Hkv 4, the step's attention):
    B 8 / 4k 41.6 us on split 128-row ping-pong tiles vs 47.3 on query tiles (256 CTAs, two
    waves), B 8 / 5k 48.8 vs 48.5; B 1 / 4k 28.5 vs 16.9, B 4 / 4k 33.1 vs 28.6 (one wave)."""
    rows = seqlen_q * group
    if sparse_topk is None or rows <= QUERY_TILE_ROWS or group > QUERY_TILE_ROWS:
        return None
    query_rows = group * (QUERY_TILE_ROWS // group)
    blocks = _ceil_div(max_seqlen_k, page_size)
    collapses = union_collapses(seqlen_q, group, max_seqlen_k, page_size, sparse_topk)
    if batch is not None and sms is not None:
        query_tiles = batch * num_kv_heads * _ceil_div(rows, query_rows)
        if collapses and query_tiles > sms:
            return None
        if blocks >= 2 * sparse_topk and few_tiles(batch, num_kv_heads,
                                                   _ceil_div(rows, QO_TILE_ROWS), sms):
            return query_rows
    return None if token_warps or collapses else query_rows


@dataclasses.dataclass
class DecodeSchedule:
    """The plan of one paged decode call. Index tensors live on the device of ``seqused_k``;
    the ``*_host`` twins are CPU copies for references and tests. Native kernels read only the
    device tensors, so a plan is launch-ready without any device-to-host copy."""

    batch_size: int
    seqlen_q: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sparse_topk: Optional[int]          # topK of the q2k rows for sparse decode, None when dense
    enable_cuda_graph: bool
    max_grid_size: int                  # CTA budget the split size was chosen for
    split_kv: bool                      # partials + merge (True) or direct output (False)
    kv_chunk_size: int                  # units (pages, or q2k slots when sparse) per chunk
    qo_tile_rows: int                   # rows (token * G + head in group) per qo tile
    slot_chunks: bool                   # sparse units are q2k slots (else pages; see module doc)
    num_qo_tiles: int                   # ceil(seqlen_q * G / qo_tile_rows)
    planned_units: List[int]            # per request: pages, or topK with slot_chunks, planned for
    num_splits_host: torch.Tensor       # [B] int32: chunks of each request
    merge_indptr_host: torch.Tensor     # [B+1] int32: exclusive prefix of num_splits
    request_indices_host: torch.Tensor  # [num_work] int32: work item -> request
    kv_tile_indices_host: torch.Tensor  # [num_work] int32: work item -> chunk within request
    qo_tile_indices_host: torch.Tensor  # [num_work] int32: work item -> qo tile
    num_splits: torch.Tensor            # device copies of the above
    merge_indptr: torch.Tensor
    request_indices: torch.Tensor
    kv_tile_indices: torch.Tensor
    qo_tile_indices: torch.Tensor
    persistent_ctas: int = 0            # CTAs of the persistent form; 0: not planned

    @property
    def sparse(self) -> bool:
        return self.sparse_topk is not None

    @property
    def qhead_per_kv(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def num_work(self) -> int:
        return int(self.request_indices_host.numel())

    @property
    def grid(self):
        """(work items, KV heads): the launch grid of the attention pass."""
        return (self.num_work, self.num_kv_heads)

    @property
    def num_partials(self) -> int:
        """Partial-output slots per query row: one per (request, chunk) when split, else 0."""
        return int(self.merge_indptr_host[-1]) if self.split_kv else 0

    @property
    def kv_chunk_size_tokens(self) -> Optional[int]:
        """Chunk length in KV tokens (dense decode only)."""
        return None if self.sparse else self.kv_chunk_size * self.page_size

    @property
    def needs_workspaces(self) -> bool:
        """Whether a run may write partials: a split plan, or one with the persistent form."""
        return self.split_kv or self.persistent_ctas > 0

    def workspace_shapes(self):
        """(O_partial shape, LSE_partial shape), both float32:
        O_partial [P, seqlen_q, Hq, D], LSE_partial [P, seqlen_q, Hq]; partial slot
        p = merge_indptr[b] + chunk holds rows of request b (P >= num_partials), and the
        persistent form's slots 2c, 2c + 1 the pieces of CTA c (P >= 2 persistent_ctas)."""
        p = max(self.num_partials, 2 * self.persistent_ctas)
        return ((p, self.seqlen_q, self.num_qo_heads, self.head_dim),
                (p, self.seqlen_q, self.num_qo_heads))

    def chunk_range(self, request: int, chunk: int, units_now: int):
        """[begin, end) units of one chunk given the request's current unit count (pages from
        today's seqused_k, or topK): the last chunk absorbs any growth since planning."""
        begin = chunk * self.kv_chunk_size
        last = chunk == int(self.num_splits_host[request]) - 1
        end = units_now if last else min(begin + self.kv_chunk_size, units_now)
        return begin, max(begin, end)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _chunks_needed(units: List[int], chunk: int) -> int:
    # Every request keeps at least one chunk: an empty request still writes O = 0, LSE = -inf.
    return sum(max(1, _ceil_div(u, chunk)) for u in units)


def choose_kv_chunk_size(units: List[int], ctas_per_chunk: int, max_grid_size: int) -> int:
    """The smallest chunk (in units) whose work fits one wave of ``max_grid_size`` CTAs.

    Total CTAs for chunk c are ``ctas_per_chunk * sum_b ceil(units_b / c)``, non-increasing in c,
    so a binary search finds the smallest c that fits; smaller chunks mean more parallelism.
    If even c = max(units) (no split) does not fit, splitting cannot help and max(units) wins.
    """
    longest = max(units, default=0)
    if longest <= 1:
        return max(longest, 1)
    budget = max(1, max_grid_size // max(ctas_per_chunk, 1))
    if _chunks_needed(units, longest) >= budget:
        return longest
    lo, hi = 1, longest
    while lo < hi:
        mid = (lo + hi) // 2
        if _chunks_needed(units, mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def build_decode_schedule(seqused_k: torch.Tensor, page_size: int, seqlen_q: int,
                          num_qo_heads: int, num_kv_heads: int, head_dim: int, max_seqlen_k: int,
                          enable_cuda_graph: bool = False, max_grid_size: Optional[int] = None,
                          fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
                          *, sparse_topk: Optional[int] = None,
                          qo_tile_rows: Optional[int] = None,
                          persistent: Optional[bool] = None) -> DecodeSchedule:
    """Plan the split-KV decode of a batch (host-side; see the module docstring).

    Args:
      seqused_k: [B] int32 KV lengths. Read on the host unless ``enable_cuda_graph`` or sparse
        (neither needs the lengths), so call this outside CUDA-graph capture.
      page_size: tokens per KV page (128).
      seqlen_q: queries per request (uniform; 1 for plain decode, >1 for MTP).
      num_qo_heads, num_kv_heads, head_dim: head layout (Hq a multiple of Hkv).
      max_seqlen_k: upper bound of any request's KV length; sizes the CUDA-graph plan.
      enable_cuda_graph: size the plan from ``max_seqlen_k`` for every request, so one plan
        serves every replay whatever the lengths are.
      max_grid_size: CTA budget (default: the device's SM count, 132 without a GPU).
      fixed_split_size: chunk size in units (pages; slots with slot chunks); forces split-KV.
      disable_split_kv: one chunk per request, direct output, no workspaces.
      sparse_topk: topK of the q2k rows for sparse decode (units are then q2k slots, or pages
        when a qo tile spans several tokens: see the module docstring).
      qo_tile_rows: query rows per CTA tile, 1..QO_TILE_ROWS (default QO_TILE_ROWS).
      persistent: plan the persistent form (see PERSISTENT_MIN_ROWS): None where it pays
        (:func:`persistent_pays`), True wherever the call can take it (dense, tiles of > 64
        rows, at most PERSISTENT_MAX_REQUESTS requests, neither fixed_split_size nor
        disable_split_kv; anything else raises), False never.

    Returns a :class:`DecodeSchedule` with index tensors on ``seqused_k``'s device.
    """
    check_tensor("seqused_k", seqused_k, dtypes=(torch.int32,), ndim=1)
    check_positive_int("page_size", page_size, minimum=1)
    check_positive_int("seqlen_q", seqlen_q, minimum=1)
    check_positive_int("num_qo_heads", num_qo_heads, minimum=1)
    check_positive_int("num_kv_heads", num_kv_heads, minimum=1)
    check_positive_int("head_dim", head_dim, minimum=1)
    check_positive_int("max_seqlen_k", max_seqlen_k)
    check_positive_int("max_grid_size", max_grid_size, allow_none=True, minimum=1)
    check_positive_int("fixed_split_size", fixed_split_size, allow_none=True, minimum=1)
    check_positive_int("sparse_topk", sparse_topk, allow_none=True, minimum=1)
    check_positive_int("qo_tile_rows", qo_tile_rows, allow_none=True, minimum=1)
    if qo_tile_rows is not None and qo_tile_rows > QO_TILE_ROWS:
        raise ValueError(f"qo_tile_rows: at most {QO_TILE_ROWS}, got {qo_tile_rows}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if persistent is not None and not isinstance(persistent, bool):
        raise ValueError(f"persistent: expected None, True or False, got {persistent!r}")
    if fixed_split_size is not None and disable_split_kv:
        raise ValueError("fixed_split_size: forces split-KV, which disable_split_kv=True forbids")
    batch = seqused_k.numel()
    device = seqused_k.device
    if max_grid_size is None:
        max_grid_size = sm_count(device)

    group = num_qo_heads // num_kv_heads
    if qo_tile_rows is None:
        qo_tile_rows = QO_TILE_ROWS
    slot_chunks = sparse_topk is not None and not multi_token_tiles(seqlen_q, group,
                                                                      qo_tile_rows)
    if slot_chunks:
        units = [sparse_topk] * batch
    elif sparse_topk is not None:
        units = [_ceil_div(max_seqlen_k, page_size)] * batch
    elif enable_cuda_graph:
        units = [_ceil_div(max_seqlen_k, page_size)] * batch
    else:
        lens = seqused_k.to("cpu", torch.int64).clamp_min(0)
        units = [_ceil_div(int(n), page_size) for n in lens.tolist()]

    num_qo_tiles = _ceil_div(seqlen_q * group, qo_tile_rows)
    ctas_per_chunk = num_qo_tiles * num_kv_heads
    longest = max(max(units, default=0), 1)
    if disable_split_kv:
        chunk, split_kv = longest, False
    elif fixed_split_size is not None:
        chunk, split_kv = fixed_split_size, True
    else:
        chunk = choose_kv_chunk_size(units, ctas_per_chunk, max_grid_size)
        if enable_cuda_graph and sparse_topk is None:
            balanced = choose_kv_chunk_size(units, ctas_per_chunk,
                                            GRAPH_SPLIT_WAVES * max_grid_size)
            if balanced >= MIN_BALANCE_CHUNK_PAGES:
                chunk = min(chunk, balanced)
        split_kv = any(u > chunk for u in units)
    if not split_kv:
        chunk = longest  # one chunk per request: the last (only) chunk runs to the end anyway

    eligible = persistent_can_run(batch, seqlen_q, group, qo_tile_rows,
                                  sparse_topk=sparse_topk, fixed_split_size=fixed_split_size,
                                  disable_split_kv=disable_split_kv)
    if persistent and not eligible:
        raise ValueError(
            "persistent: the persistent form serves dense plans (no sparse_topk, "
            "fixed_split_size or disable_split_kv) of tiles of more than 64 rows "
            f"(seqlen_q * G, at most qo_tile_rows) and at most {PERSISTENT_MAX_REQUESTS} "
            "requests")
    if persistent is None:
        persistent = eligible and persistent_pays(
            ctas_per_chunk * sum(max(u, 1) for u in units), max_grid_size)
    num_splits = [max(1, _ceil_div(u, chunk)) for u in units]
    request_idx, kv_tile_idx, qo_tile_idx = [], [], []
    for b, n in enumerate(num_splits):
        for s in range(n):
            for t in range(num_qo_tiles):
                request_idx.append(b)
                kv_tile_idx.append(s)
                qo_tile_idx.append(t)
    i32 = dict(dtype=torch.int32)
    num_splits_host = torch.tensor(num_splits, **i32)
    merge_indptr_host = torch.zeros(batch + 1, **i32)
    merge_indptr_host[1:] = torch.cumsum(num_splits_host, 0)
    host = dict(request=torch.tensor(request_idx, **i32), kv=torch.tensor(kv_tile_idx, **i32),
                qo=torch.tensor(qo_tile_idx, **i32))
    return DecodeSchedule(
        batch_size=batch, seqlen_q=seqlen_q, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        sparse_topk=sparse_topk, enable_cuda_graph=bool(enable_cuda_graph),
        max_grid_size=int(max_grid_size), split_kv=bool(split_kv), kv_chunk_size=int(chunk),
        qo_tile_rows=int(qo_tile_rows), slot_chunks=slot_chunks, num_qo_tiles=num_qo_tiles,
        planned_units=units, num_splits_host=num_splits_host,
        merge_indptr_host=merge_indptr_host, request_indices_host=host["request"],
        kv_tile_indices_host=host["kv"], qo_tile_indices_host=host["qo"],
        num_splits=num_splits_host.to(device), merge_indptr=merge_indptr_host.to(device),
        request_indices=host["request"].to(device), kv_tile_indices=host["kv"].to(device),
        qo_tile_indices=host["qo"].to(device),
        persistent_ctas=int(max_grid_size) if persistent else 0)
