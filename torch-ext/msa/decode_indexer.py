"""Fused decode indexer + top-k over a paged index-K cache (``decode_indexer_topk``) and the plan
that several layers of one decode step share (:class:`DecodeIndexerPlan`).

One call scores, for every query row (request b, MTP query q, index head h), each history block
of the request against the row's index query and keeps the best ``topk - 1`` blocks plus the
row's own (local) block, without materializing a score matrix: blocks are scored and ranked on
chip, chunk by chunk, and the chunks of a request are merged by the last CTA that finishes one.
Semantics, layouts and the output contract (upstream msa_v1: valid ids as a prefix, the local
block last among them, then -1) are those of :mod:`msa.reference.decode_indexer`.

Work scales with the live lengths, not with the capture bound: :meth:`DecodeIndexerPlan.update`
(one tiny kernel, capturable) splits the batch's live history blocks over a fixed number of CTAs
from ``seqused_k``; call it once per decode step after writing the new lengths, then run the
indexer of every layer. A plan that was not updated stays correct (each request's last chunk runs
to its live end); it is only less balanced.

Dispatch: ``_backend.choose("decode_indexer_topk", ...)``; the native kernel is
csrc/decode_indexer.cu (``msa._native.decode_indexer_cuda``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import _backend
from ._common import sm_count
from ._validation import (FP8, HEAD_DIM, check_decode_indexer_values, check_page_table,
                          check_positive_int, check_same_device, check_scale, check_shape,
                          check_tensor, check_topk, value_checks_requested)
from .decode import _check_seqlen_q
from .reference.decode_indexer import decode_indexer_reference

BF16 = torch.bfloat16
PAGE_SIZE = 128
OP_NAME = "decode_indexer_topk"
MAX_ROWS = 128                 # seqlen_q * index heads per request
NVFP4_BYTES = HEAD_DIM // 2
NVFP4_SCALES = HEAD_DIM // 16
SCALE_LAYOUTS = ("128x4", "linear")
PLAN_UPDATE_OP = "decode_indexer_plan_update"


@dataclasses.dataclass
class DecodeIndexerPlan:
    """Work split of the fused decode indexer over one decode step's live lengths.

    Build it once (outside CUDA-graph capture) per batch layout; it keeps ``seqused_k`` by
    reference. ``update()`` re-splits from the current ``seqused_k`` on the device (no host
    sync, capturable): once per decode step, before the layers' ``decode_indexer_topk`` calls,
    which all read the same split and share the plan's workspace (they run one after another on
    one stream).

    Device buffers (int32): ``work`` [capacity, 2] (request, chunk) per CTA, -1 = idle;
    ``requests`` [B, 3] (first work item, chunk count, arrival counter); ``chunk_pages`` [1];
    ``partials`` [capacity, seqlen_q * num_index_heads, list_capacity, 2] (score bits, block id).
    """
    seqused_k: torch.Tensor
    seqlen_q: int
    num_index_heads: int
    topk: int
    max_seqlen_k: int
    capacity: int
    work: torch.Tensor
    requests: torch.Tensor
    chunk_pages: torch.Tensor
    partials: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.seqused_k.numel()

    @property
    def rows_per_request(self) -> int:
        return self.seqlen_q * self.num_index_heads

    @property
    def list_capacity(self) -> int:
        return self.partials.shape[2]

    def update(self) -> "DecodeIndexerPlan":
        """Re-split the work from the live ``seqused_k``: on the device without host sync
        (native), else by :func:`plan_work_split` on the host (the reference path, which
        synchronizes)."""
        _name, native = _backend.choose(PLAN_UPDATE_OP, self.seqused_k.device)
        if native is not None:
            native(self)
            return self
        work, requests, chunk = plan_work_split(self.seqused_k.tolist(), self.capacity)
        self.work.copy_(work)
        self.requests.copy_(requests)
        self.chunk_pages.fill_(chunk)
        return self


MIN_CHUNK_PAGES = 4
INT32_MAX = (1 << 31) - 1


def plan_work_split(lengths, capacity: int):
    """The plan update's split, on the host: (work [capacity, 2], requests [B, 3], chunk_pages).

    Request b has h_b = (L_b - 1) // 128 history blocks (0 when L_b <= 0); with chunks of c
    blocks it gets n_b(c) = max(1, ceil(h_b / c)) consecutive work items starting at the
    exclusive prefix sum of n. Over spread = capacity - B slots (the grid's CTAs) the kernel
    takes waves(c) x c, waves(c) = ceil(sum n_b(c) / spread): a few items past a wave cost a
    whole chunk's time. chunk_pages is the c of least waves x c among ceil(sum h / spread) (the
    plain split: at most spread + B = capacity items), the smallest c whose items fit the
    capacity and the smallest whose items fit one wave of spread (on ties the later one), each
    at least 4 and at most INT32_MAX. work[w] = (request, chunk), -1 past the last item
    (sum n <= capacity); requests[b] = (first item, n_b, 0). The native update kernel computes
    exactly this."""
    history = [max(int(n), 0) and (max(int(n), 0) - 1) // PAGE_SIZE for n in lengths]
    batch = len(history)
    spread = max(capacity - batch, 1)
    total = sum(history)

    def items(c):
        return sum(max(1, -(-h // c)) for h in history)

    def clamp(c):   # the kernel caps at INT32_MAX (garbage lengths must not overflow the plan)
        return min(max(c, MIN_CHUNK_PAGES), INT32_MAX)

    def cost(c):
        return -(-items(c) // spread) * c

    chunk = clamp(-(-total // spread))
    best = cost(chunk)
    for cap in (capacity, spread):
        if cap <= batch:
            continue
        lo = clamp(-(-total // cap))
        hi = clamp(max(lo, -(-total // (cap - batch))))
        while lo < hi:              # the smallest c in [lo, hi] whose items fit cap
            mid = lo + (hi - lo) // 2
            if items(mid) <= cap:
                hi = mid
            else:
                lo = mid + 1
        if cost(lo) <= best:
            chunk, best = lo, cost(lo)
    work = torch.full((capacity, 2), -1, dtype=torch.int32)
    requests = torch.zeros(len(history), 3, dtype=torch.int32)
    first = 0
    for b, h in enumerate(history):
        n = max(1, -(-h // chunk))
        requests[b, 0], requests[b, 1] = first, n
        for c in range(n):
            if first + c < capacity:
                work[first + c, 0], work[first + c, 1] = b, c
        first += n
    return work, requests, chunk


def list_capacity_for(topk: int) -> int:
    """Per-row candidate list length of the kernel: 16 for topk <= 16, else 32."""
    return 16 if topk <= 16 else 32


def make_decode_indexer_plan(seqused_k: torch.Tensor, *, seqlen_q: int, num_index_heads: int,
                             max_seqlen_k: int, topk: int = 16,
                             max_ctas: Optional[int] = None) -> DecodeIndexerPlan:
    """A :class:`DecodeIndexerPlan` for ``seqused_k`` [B] int32, already updated once.

    seqlen_q: queries per request (1..16); num_index_heads: H of q_idx; seqlen_q * H <= 128.
    max_seqlen_k: host bound of the lengths (>= 1). topk in {4, 8, 16, 32}. max_ctas: CTAs the
    history blocks are spread over (default two per SM); the grid is max_ctas + B.
    """
    check_tensor("seqused_k", seqused_k, dtypes=(torch.int32,), ndim=1, contiguous=True)
    batch = seqused_k.numel()
    if batch < 1:
        raise ValueError("seqused_k: expected shape [B] with B >= 1, got [0]")
    _check_seqlen_q(seqlen_q)
    check_positive_int("num_index_heads", num_index_heads, minimum=1)
    if seqlen_q * num_index_heads > MAX_ROWS:
        raise NotImplementedError(f"num_index_heads: seqlen_q * num_index_heads = "
                                  f"{seqlen_q * num_index_heads} rows per request exceeds "
                                  f"{MAX_ROWS}")
    check_positive_int("max_seqlen_k", max_seqlen_k, minimum=1)
    check_topk("topk", topk)
    check_positive_int("max_ctas", max_ctas, allow_none=True, minimum=1)
    device = seqused_k.device
    if max_ctas is None:
        max_ctas = 2 * sm_count(device)
    capacity = max_ctas + batch
    i32 = dict(dtype=torch.int32, device=device)
    plan = DecodeIndexerPlan(
        seqused_k=seqused_k, seqlen_q=seqlen_q, num_index_heads=num_index_heads, topk=topk,
        max_seqlen_k=int(max_seqlen_k), capacity=capacity,
        work=torch.full((capacity, 2), -1, **i32), requests=torch.zeros(batch, 3, **i32),
        chunk_pages=torch.ones(1, **i32),
        partials=torch.empty(capacity, seqlen_q * num_index_heads, list_capacity_for(topk), 2,
                             **i32))
    return plan.update()


@dataclasses.dataclass
class DecodeIndexerCall:
    """One validated ``decode_indexer_topk`` call, as every backend receives it."""
    q_idx: torch.Tensor                 # [B * Q, H, 128] bf16 / e4m3
    k_idx: torch.Tensor                 # [pages, 1, 128, 128] bf16 / e4m3, or [pages, 1, 128, 64] u8
    k_scale: Optional[torch.Tensor]     # NVFP4 block scales (uint8 view), else None
    k_global_scale: Optional[torch.Tensor]
    scale_layout: str
    page_table: torch.Tensor            # [B, max_pages] int32
    plan: DecodeIndexerPlan
    topk: int
    scale: float
    out: torch.Tensor                   # [H * repeat, B * Q, topk] int32
    scores: Optional[torch.Tensor]      # [H, B * Q, max_pages] fp32 or None
    check_values: bool = False          # check_input_valid / MSA_CHECK_INPUTS=1

    @property
    def k_format(self) -> str:
        return "nvfp4" if self.k_idx.dtype == torch.uint8 else (
            "e4m3" if self.k_idx.dtype == FP8 else "bf16")

    @property
    def out_head_repeat(self) -> int:
        return self.out.shape[0] // self.q_idx.shape[1]

    def features(self) -> dict:
        return dict(q_dtype=self.q_idx.dtype, k_format=self.k_format, topk=self.topk,
                    rows=self.plan.rows_per_request)


def decode_indexer_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, *, plan: DecodeIndexerPlan,
                        page_table: torch.Tensor, scale: float = 1.0,
                        k_scale: Optional[torch.Tensor] = None,
                        k_global_scale: Optional[torch.Tensor] = None,
                        k_scale_layout: str = "128x4", out: Optional[torch.Tensor] = None,
                        return_scores: bool = False, check_input_valid: bool = False):
    """Top-k KV blocks per decode query row from a paged index-K cache, top-k fused.

    Args:
      q_idx: [B * seqlen_q, H, 128] index queries (request b owns rows b*Q .. b*Q + Q - 1), bf16
        with bf16 keys, e4m3 with e4m3 or NVFP4 keys (other pairs run the reference).
      k_idx: the paged index-K cache of one shared key head: bf16 / float8_e4m3fn
        [pages, 1, 128, 128], or NVFP4 uint8 [pages, 1, 128, 64] (two E2M1 codes per byte, the
        even element in the low nibble).
      plan: a :class:`DecodeIndexerPlan` for this batch (holds seqused_k, seqlen_q, H, topk).
      page_table: [B, max_pages] int32, logical block -> physical page of k_idx.
      scale: multiplies every score (> 0; the ranking does not depend on it).
      k_scale: NVFP4 only: the E4M3 scales (uint8 or float8_e4m3fn), one per 16 elements, in the
        128x4 tiled layout of ``msa.quantize`` over rows page * 128 + slot (>= pages * 1024
        bytes), or with ``k_scale_layout="linear"`` [pages, 1, 128, 8].
      k_global_scale: NVFP4 only, optional fp32 tensor (>= 1 element, > 0) multiplying the keys.
      out: optional [H * r, B * Q, topk] int32 output (r >= 1: index head h fills out heads
        h*r .. h*r + r - 1, e.g. one index head shared by r KV heads); written in place.
      return_scores: also return the block scores [H, B * Q, max_pages] fp32 (-inf where a
        block is not a candidate of the row); for tests and diagnostics.
      check_input_valid: also check the index values (one synchronization; ValueError naming
        the argument): the plan's seqused_k within [0, page_table width * 128] and at most its
        max_seqlen_k, and in-range page ids for every page holding keys. MSA_CHECK_INPUTS=1
        turns it on for every call; the reference backend always checks. Unchecked native
        calls never read or write out of bounds: pages outside k_idx are skipped and lengths
        are clamped to the page table.

    Returns out (and the scores when requested). The selection of row (b, q, h): the plan's
    topk - 1 best history blocks (blocks before the row's own block (L - Q + q) // 128, by score,
    ties to the lower id, non-finite-low scores never), in rank order, then the own block, then
    -1. A block's score is the max over its keys' finite-or-infinite scores (a key whose score
    is NaN is passed over, as the hardware max does; a block of NaN keys only is NaN). Launches
    on q_idx's device and current stream without host synchronization.
    """
    call = check_indexer_args(q_idx, k_idx, plan, page_table, scale, k_scale, k_global_scale,
                              k_scale_layout, out, return_scores, check_input_valid)
    run_indexer_call(call)
    return (call.out, call.scores) if return_scores else call.out


def run_indexer_call(call: DecodeIndexerCall) -> None:
    """Dispatch and run a validated call: the reference always checks the index values, a
    native call only when asked."""
    _name, native = _backend.choose(OP_NAME, call.q_idx.device, **call.features())
    if native is None or call.check_values:
        check_decode_indexer_values(call)
    if native is not None:
        native(call)
        return
    plan = call.plan
    selection, scores = decode_indexer_reference(
        call.q_idx, call.k_idx, call.page_table, plan.seqused_k, plan.seqlen_q, call.topk,
        scale=call.scale, k_scale=call.k_scale, k_global_scale=call.k_global_scale,
        scale_layout=call.scale_layout, out_head_repeat=call.out_head_repeat)
    call.out.copy_(selection)
    if call.scores is not None:
        call.scores.copy_(scores)


# The decode step wrapper names some arguments differently (k_idx_scale, index_scale, ...).
_ARG_NAMES = ("q_idx", "k_idx", "plan", "page_table", "scale", "k_scale", "k_global_scale",
              "k_scale_layout", "out")


def check_indexer_args(q_idx, k_idx, plan, page_table, scale, k_scale, k_global_scale, layout,
                       out, return_scores, check_input_valid=False, names=None
                       ) -> DecodeIndexerCall:
    """Validate a decode_indexer_topk call from metadata only (no launch, no sync). names maps
    this function's argument names to the caller's (errors name the caller's argument)."""
    n = dict(zip(_ARG_NAMES, _ARG_NAMES))
    n.update(names or {})
    if not isinstance(plan, DecodeIndexerPlan):
        raise TypeError(f"{n['plan']}: expected a DecodeIndexerPlan (make_decode_indexer_plan), "
                        f"got {type(plan).__name__}")
    check_values = value_checks_requested(check_input_valid)
    check_tensor(n["q_idx"], q_idx, dtypes=(BF16, FP8), ndim=3, contiguous=True)
    batch, heads = plan.batch_size, plan.num_index_heads
    total_q = batch * plan.seqlen_q
    check_shape(n["q_idx"], q_idx, (total_q, heads, HEAD_DIM))
    check_tensor(n["k_idx"], k_idx, dtypes=(BF16, FP8, torch.uint8), ndim=4, contiguous=True)
    width = NVFP4_BYTES if k_idx.dtype == torch.uint8 else HEAD_DIM
    if k_idx.shape[1] != 1 or k_idx.shape[2] != PAGE_SIZE or k_idx.shape[3] != width:
        raise ValueError(f"{n['k_idx']}: expected [pages, 1, {PAGE_SIZE}, {width}] (one shared "
                         f"index key head), got {list(k_idx.shape)}")
    if k_idx.shape[0] < 1:
        raise ValueError(f"{n['k_idx']}: needs at least one page")
    if layout not in SCALE_LAYOUTS:
        raise ValueError(f"{n['k_scale_layout']}: expected one of {SCALE_LAYOUTS}, got "
                         f"{layout!r}")
    if k_idx.dtype == torch.uint8:
        if k_scale is None:
            raise ValueError(f"{n['k_scale']}: NVFP4 index keys (uint8 {n['k_idx']}) need their "
                             "block scales")
        check_tensor(n["k_scale"], k_scale, dtypes=(torch.uint8, FP8), contiguous=True)
        need = k_idx.shape[0] * PAGE_SIZE * NVFP4_SCALES
        if k_scale.numel() < need:
            raise ValueError(f"{n['k_scale']}: has {k_scale.numel()} bytes, needs >= {need} for "
                             f"{k_idx.shape[0]} pages")
        k_scale = k_scale.view(torch.uint8)
        if k_global_scale is not None:
            check_tensor(n["k_global_scale"], k_global_scale, dtypes=(torch.float32,))
            if k_global_scale.numel() < 1:
                raise ValueError(f"{n['k_global_scale']}: must hold at least one element")
    elif k_scale is not None or k_global_scale is not None:
        which = n["k_scale"] if k_scale is not None else n["k_global_scale"]
        raise ValueError(f"{which}: block scales are only for NVFP4 (uint8) index keys")
    check_page_table(page_table, batch, min_pages=1)
    scale = check_scale(n["scale"], scale, allow_none=False)
    if out is None:
        out = torch.empty(heads, total_q, plan.topk, dtype=torch.int32, device=q_idx.device)
    else:
        check_tensor(n["out"], out, dtypes=(torch.int32,), ndim=3, contiguous=True)
        if out.shape[0] % heads or out.shape[0] < heads or tuple(out.shape[1:]) != (
                total_q, plan.topk):
            raise ValueError(f"{n['out']}: expected [{heads} * r, {total_q}, {plan.topk}], got "
                             f"{list(out.shape)}")
    check_same_device(**{n["q_idx"]: q_idx, n["k_idx"]: k_idx, n["page_table"]: page_table,
                         "seqused_k": plan.seqused_k, n["k_scale"]: k_scale,
                         n["k_global_scale"]: k_global_scale, n["out"]: out})
    scores = None
    if return_scores:
        scores = torch.full((heads, total_q, page_table.shape[1]), float("-inf"),
                            dtype=torch.float32, device=q_idx.device)
    return DecodeIndexerCall(q_idx=q_idx, k_idx=k_idx, k_scale=k_scale,
                             k_global_scale=k_global_scale, scale_layout=layout,
                             page_table=page_table, plan=plan, topk=plan.topk, scale=scale,
                             out=out, scores=scores, check_values=check_values)


__all__ = ["DecodeIndexerPlan", "make_decode_indexer_plan", "decode_indexer_topk",
           "plan_work_split"]
