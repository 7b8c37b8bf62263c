"""Paged decode attention: ``sparse_decode_atten_func`` and ``SparseDecodePagedAttentionWrapper``
(contract §1.4; sparse decode per D6, G in {1, 2, 4, 8, 16} per D7).

A decode step runs ``seqlen_q`` (1..16, uniform; > 1 for multi-token prediction) queries per
request against that request's paged KV cache, bottom-right causal against ``seqused_k``. With
``q2k_indices`` each (query, KV head) attends only to the KV blocks it selected (sparse decode);
without, to every key of the request (dense decode).

Work is split FlashInfer-style (see :mod:`msa.schedules.decode`): the plan cuts each
request's KV range into chunks so the grid fills the GPU; chunks write normalized partials
(O_partial, LSE_partial, fp32) that a merge pass combines by log-sum-exp. The wrapper plans once
(host side, reading ``seqused_k``) and runs many times without host synchronization; it keeps
``page_table`` / ``seqused_k`` / ``q2k_indices`` by reference, so CUDA-graph replays see what
the caller writes into those same buffers.

Every call is validated on the host, then dispatched by ``_backend.choose("sparse_decode_atten",
...)``: a registered native kernel receives a :class:`DecodeCall` and writes ``call.out`` (and
``call.lse`` when not None) in place; otherwise the PyTorch reference runs (it may synchronize).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional

import torch

from . import _backend
from ._common import sm_count
from ._validation import (check_page_table, FP8, HEAD_DIM, check_decode_values, check_head_dim,
                          check_planned, check_positive_int, check_qhead_per_kv,
                          check_same_device, check_scale, check_shape, check_tensor, check_topk,
                          value_checks_requested)
from .reference.decode import decode_reference, split_decode_reference
from .schedules.decode import DecodeSchedule, build_decode_schedule, query_tile_rows

BF16 = torch.bfloat16
PAGE_SIZE = 128
MAX_SEQLEN_Q = 16
OP_NAME = "sparse_decode_atten"


@dataclasses.dataclass
class DecodeCall:
    """One validated decode call, as every backend receives it.

    q [B*seqlen_q, Hq, 128]; k, v [pages, Hkv, 128, 128]; q2k_indices [Hkv, B*seqlen_q, topK]
    or None (dense); page_table [B, max_pages] int32; seqused_k [B] int32. ``schedule`` and the
    fp32 workspaces o_partial [P, seqlen_q, Hq, 128] / lse_partial [P, seqlen_q, Hq] are set
    on the native path (P = schedule.num_partials). ``out`` [B*seqlen_q, Hq, 128] bf16 and
    ``lse`` [B*seqlen_q, Hq] fp32 (None unless requested) are the outputs, written in place.
    """
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q2k_indices: Optional[torch.Tensor]
    page_table: torch.Tensor
    seqused_k: torch.Tensor
    seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    schedule: Optional[DecodeSchedule] = None
    o_partial: Optional[torch.Tensor] = None
    lse_partial: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    check_values: bool = False       # check_input_valid / MSA_CHECK_INPUTS=1

    @property
    def batch_size(self) -> int:
        return self.seqused_k.numel()

    @property
    def qhead_per_kv(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def sparse(self) -> bool:
        return self.q2k_indices is not None

    @property
    def topk(self) -> Optional[int]:
        return None if self.q2k_indices is None else self.q2k_indices.shape[2]

    @property
    def pv_quant_dtype(self) -> Optional[torch.dtype]:
        """e4m3 when the P.V product runs in FP8 (e4m3 Q and K/V). bf16 Q with an e4m3 KV cache
        stages K/V to bf16 (contract §1.2), so P stays unrounded there."""
        return FP8 if (self.q.dtype == FP8 and self.v.dtype == FP8) else None

    def features(self) -> dict:
        return dict(q_dtype=self.q.dtype, kv_dtype=self.k.dtype, qhead_per_kv=self.qhead_per_kv,
                    seqlen_q=self.seqlen_q, sparse=self.sparse, topk=self.topk)


# ---------------------------------------------------------------------------------------------
# Validation (host metadata only; no device reads)
# ---------------------------------------------------------------------------------------------

def _check_layout_flags(blk_kv, causal) -> None:
    if causal is not True:
        raise NotImplementedError(f"causal: decode supports only causal=True (bottom-right "
                                  f"against seqused_k), got {causal!r}")
    if blk_kv != PAGE_SIZE:
        raise ValueError(f"blk_kv: only {PAGE_SIZE} is supported, got {blk_kv}")


def _check_seqlen_q(seqlen_q) -> int:
    if isinstance(seqlen_q, bool) or not isinstance(seqlen_q, int):
        raise TypeError(f"seqlen_q: expected an int, got {type(seqlen_q).__name__}")
    if seqlen_q < 1:
        raise ValueError(f"seqlen_q: must be >= 1, got {seqlen_q}")
    if seqlen_q > MAX_SEQLEN_Q:
        raise NotImplementedError(f"seqlen_q: {seqlen_q} queries per request is not supported; "
                                  f"decode takes 1..{MAX_SEQLEN_Q}")
    return seqlen_q


def _check_kv_metadata(page_table, seqused_k, seqlen_q, max_seqlen_k, q2k_indices,
                       num_kv_heads: Optional[int]) -> int:
    """Checks shared by the function and plan(); returns the batch size."""
    check_tensor("seqused_k", seqused_k, dtypes=(torch.int32,), ndim=1, contiguous=True)
    batch = seqused_k.numel()
    if batch < 1:
        raise ValueError("seqused_k: expected shape [B] with B >= 1, got [0]")
    check_page_table(page_table, batch, min_pages=1)
    _check_seqlen_q(seqlen_q)
    check_positive_int("max_seqlen_k", max_seqlen_k, minimum=1)
    if q2k_indices is not None:
        check_tensor("q2k_indices", q2k_indices, dtypes=(torch.int32,), ndim=3, contiguous=True)
        if num_kv_heads is not None:
            check_shape("q2k_indices", q2k_indices, (num_kv_heads, batch * seqlen_q, None))
        check_topk("q2k_indices.shape[2] (topK)", q2k_indices.shape[2])
    check_same_device(seqused_k=seqused_k, page_table=page_table, q2k_indices=q2k_indices)
    return batch


def check_decode_args(q, k, v, q2k_indices, *, page_table, seqused_k, seqlen_q, max_seqlen_k,
                      blk_kv, causal, softmax_scale, check_input_valid=False) -> DecodeCall:
    """Validate a decode call (contract error classes, argument named first)."""
    _check_layout_flags(blk_kv, causal)
    check_tensor("q", q, dtypes=(BF16, FP8), ndim=3, contiguous=True)
    check_head_dim("q", q.shape[2])
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, dtypes=(BF16, FP8), contiguous=True)
        if t.dim() != 4:
            raise ValueError(f"{name}: decode needs paged K/V [pages, Hkv, {PAGE_SIZE}, "
                             f"{HEAD_DIM}], got shape {list(t.shape)}")
    if v.dtype != k.dtype:
        raise TypeError(f"v: dtype {v.dtype} differs from k's {k.dtype}")
    if q.dtype == FP8 and k.dtype == BF16:
        raise TypeError("k: bf16 K/V needs a bf16 q; e4m3 q needs e4m3 K/V")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {list(v.shape)} differs from k's {list(k.shape)}")
    check_head_dim("k", k.shape[3])
    if k.shape[2] != blk_kv:
        raise ValueError(f"k: page size {k.shape[2]} must equal blk_kv {blk_kv}")
    hkv = k.shape[1]
    check_qhead_per_kv(q.shape[1], hkv)
    batch = _check_kv_metadata(page_table, seqused_k, seqlen_q, max_seqlen_k, q2k_indices, hkv)
    if q.shape[0] != batch * seqlen_q:
        raise ValueError(f"q: has {q.shape[0]} rows but B * seqlen_q = {batch} * {seqlen_q} = "
                         f"{batch * seqlen_q}")
    check_same_device(q=q, k=k, v=v, page_table=page_table, seqused_k=seqused_k,
                      q2k_indices=q2k_indices)
    scale = check_scale("softmax_scale", softmax_scale)
    return DecodeCall(q=q, k=k, v=v, q2k_indices=q2k_indices, page_table=page_table,
                      seqused_k=seqused_k, seqlen_q=seqlen_q, max_seqlen_k=int(max_seqlen_k),
                      softmax_scale=scale if scale is not None else 1.0 / math.sqrt(HEAD_DIM),
                      check_values=value_checks_requested(check_input_valid))


def _check_schedule(schedule, call: DecodeCall) -> None:
    if not isinstance(schedule, DecodeSchedule):
        raise TypeError(f"schedule: expected a DecodeSchedule (from build_decode_schedule or "
                        f"SparseDecodePagedAttentionWrapper.plan), got {type(schedule).__name__}")
    want = dict(batch_size=call.batch_size, seqlen_q=call.seqlen_q,
                num_qo_heads=call.q.shape[1], num_kv_heads=call.k.shape[1],
                head_dim=call.q.shape[2], page_size=call.k.shape[2], sparse_topk=call.topk)
    for field, value in want.items():
        if getattr(schedule, field) != value:
            raise ValueError(f"schedule: was planned for {field}={getattr(schedule, field)}, "
                             f"but this call has {value}")
    if schedule.merge_indptr.device != call.q.device:
        raise ValueError(f"schedule: lives on {schedule.merge_indptr.device}, q on {call.q.device}")


def _check_workspace(name: str, t, shape, device) -> None:
    check_tensor(name, t, dtypes=(torch.float32,), ndim=len(shape), contiguous=True)
    if t.shape[0] < shape[0] or tuple(t.shape[1:]) != tuple(shape[1:]):
        want = [f">= {shape[0]}"] + list(shape[1:])
        raise ValueError(f"{name}: expected shape [{', '.join(map(str, want))}] for this "
                         f"schedule, got {list(t.shape)}")
    _check_on_device(name, t, device)


def _check_on_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: is on {t.device} but q is on {device}")


def _check_output(name: str, t, dtype, shape, device) -> None:
    check_tensor(name, t, dtypes=(dtype,), contiguous=True)
    check_shape(name, t, shape)
    _check_on_device(name, t, device)


def _attach_workspaces(call: DecodeCall, schedule: DecodeSchedule, o_partial, lse_partial):
    _check_schedule(schedule, call)
    o_shape, lse_shape = schedule.workspace_shapes()
    device = call.q.device
    if o_partial is not None:
        _check_workspace("O_partial", o_partial, o_shape, device)
    elif schedule.needs_workspaces:
        o_partial = torch.empty(o_shape, dtype=torch.float32, device=device)
    if lse_partial is not None:
        _check_workspace("LSE_partial", lse_partial, lse_shape, device)
    elif schedule.needs_workspaces:
        lse_partial = torch.empty(lse_shape, dtype=torch.float32, device=device)
    call.schedule, call.o_partial, call.lse_partial = schedule, o_partial, lse_partial


_DEFAULT_SCHEDULES: "collections.OrderedDict" = collections.OrderedDict()
_DEFAULT_SCHEDULE_CACHE_SIZE = 32


def _default_schedule(call: DecodeCall) -> DecodeSchedule:
    """A plan that needs no device read: sized from max_seqlen_k like a CUDA-graph plan.

    It depends only on host metadata, so it is cached by that metadata: after a first (eager)
    call, later calls with the same shapes reuse the plan's device index tensors and issue no
    host-to-device copy, which keeps them CUDA-graph capturable. (The wrapper is the intended
    capture path; this only keeps the function from being a trap.)
    """
    max_seqlen_k = _capped_max_seqlen_k(call.max_seqlen_k, call.page_table)
    tile_rows = _query_tile_rows(call, max_seqlen_k)
    key = (call.batch_size, call.seqlen_q, call.q.shape[1], call.k.shape[1], max_seqlen_k,
           call.topk, tile_rows, str(call.seqused_k.device))
    schedule = _DEFAULT_SCHEDULES.get(key)
    if schedule is None:
        schedule = build_decode_schedule(
            call.seqused_k, PAGE_SIZE, call.seqlen_q, call.q.shape[1], call.k.shape[1], HEAD_DIM,
            max_seqlen_k, enable_cuda_graph=True, sparse_topk=call.topk, qo_tile_rows=tile_rows)
        _DEFAULT_SCHEDULES[key] = schedule
        if len(_DEFAULT_SCHEDULES) > _DEFAULT_SCHEDULE_CACHE_SIZE:
            _DEFAULT_SCHEDULES.popitem(last=False)
    else:
        _DEFAULT_SCHEDULES.move_to_end(key)
    return schedule


def _takes_query_tiles(call) -> bool:
    """Query tiles serve calls of e4m3 q and K/V (schedules.decode.query_tile_rows says why)."""
    return call.q.dtype == FP8 and call.k.dtype == FP8


def _query_tile_rows(call: DecodeCall, max_seqlen_k: int) -> Optional[int]:
    """The query tile rows a call takes (schedules.decode.query_tile_rows), else None (128-row
    tiles)."""
    if not _takes_query_tiles(call):
        return None
    device = call.q.device
    return query_tile_rows(call.seqlen_q, call.qhead_per_kv, max_seqlen_k, PAGE_SIZE, call.topk,
                           batch=call.batch_size, num_kv_heads=call.k.shape[1],
                           sms=sm_count(device), token_warps=_token_warps_served(device))


def _token_warps_served(device: torch.device) -> bool:
    """Whether the native decode serves sparse e4m3 tiles of > 16 rows with its token-warps
    form on `device` (msa._native.decode_cuda decides; never on the reference backend)."""
    if _backend.reference_only(device):
        return False
    from ._native import decode_cuda
    return decode_cuda.token_warps_served(device)


def _capped_max_seqlen_k(max_seqlen_k: int, page_table: torch.Tensor) -> int:
    # No request can hold more keys than its page_table row addresses.
    return max(1, min(max_seqlen_k, page_table.shape[1] * PAGE_SIZE))


# ---------------------------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------------------------

def _execute(call: DecodeCall, native, want_lse: bool):
    """Run a validated call on the chosen backend; fill/return call.out (and call.lse). The
    reference always checks the index values; a native call only when asked."""
    if native is None or call.check_values:
        check_decode_values(call, strict=call.check_values)
    if call.out is None:
        call.out = torch.empty(call.q.shape, dtype=BF16, device=call.q.device)
    if want_lse and call.lse is None:
        call.lse = torch.empty(call.q.shape[:2], dtype=torch.float32, device=call.q.device)
    if native is not None:
        native(call)
    else:
        out, lse = decode_reference_backend(call)
        call.out.copy_(out)
        if call.lse is not None:
            call.lse.copy_(lse)
    return (call.out, call.lse) if want_lse else call.out


def decode_reference_backend(call: DecodeCall, compute_dtype=torch.float32):
    """The reference backend: (O, LSE) in compute_dtype. With a schedule, the split-KV path
    (per-chunk partials in the workspaces, then the merge); without, the direct reference."""
    kwargs = dict(softmax_scale=call.softmax_scale, pv_quant_dtype=call.pv_quant_dtype,
                  compute_dtype=compute_dtype)
    args = (call.q, call.k, call.v, call.q2k_indices, call.page_table, call.seqused_k,
            call.seqlen_q)
    if call.schedule is None:
        return decode_reference(*args, **kwargs)
    return split_decode_reference(*args, call.schedule, o_partial=call.o_partial,
                                  lse_partial=call.lse_partial, **kwargs)


def sparse_decode_atten_func(q, k, v, q2k_indices=None, *, page_table, seqused_k, seqlen_q,
                             max_seqlen_k, blk_kv=128, causal=True, softmax_scale=None,
                             return_softmax_lse=False, schedule=None, O_partial=None,
                             LSE_partial=None, check_input_valid=False):
    """Paged decode attention, dense or block-sparse (contract §1.4; sparse per D6).

    Args:
      q: [B * seqlen_q, Hq, 128], bf16 or float8_e4m3fn; request b owns rows
        b*seqlen_q .. (b+1)*seqlen_q - 1 (its queries in order).
      k, v: paged HND [pages, Hkv, 128, 128], both bf16 or both e4m3 (bf16 q with e4m3 K/V is an
        FP8 KV cache staged to bf16; e4m3 q with bf16 K/V is a TypeError). Hq / Hkv = G in
        {1, 2, 4, 8, 16}.
      q2k_indices: None for dense decode, else [Hkv, B * seqlen_q, topK] int32 (topK in
        {4, 8, 16, 32}): the batch-local KV blocks each (query, KV head) attends; -1 = empty
        slot, ids >= ceil(seqused_k[b] / 128) are dropped.
      page_table: [B, max_pages] int32, logical page -> physical page of k/v.
      seqused_k: [B] int32 KV length of each request (its last seqlen_q keys are the queries').
      seqlen_q: queries per request, 1..16.
      max_seqlen_k: host upper bound of seqused_k (sizes the default split plan; natively a
        request past it still attends to all its keys: its last chunk runs to seqused_k).
      blk_kv: must be 128 (= page size). causal: must be True.
      softmax_scale: default 128 ** -0.5.
      schedule: a DecodeSchedule (build_decode_schedule / the wrapper's plan); default: a plan
        from max_seqlen_k that needs no device read (cached per shape; the first call with new
        shapes copies its index arrays to the device, so capture CUDA graphs after a warm-up
        call, or use the wrapper).
      O_partial, LSE_partial: optional fp32 split-KV workspaces,
        [>= P, seqlen_q, Hq, 128] and [>= P, seqlen_q, Hq] with P = schedule.num_partials.

      check_input_valid: also check the index values (one synchronization; ValueError naming
        the argument): seqused_k within [0, page_table width * 128] and at most max_seqlen_k,
        in-range page ids for every page holding keys, and q2k ids that are -1 or blocks of
        their request, without duplicates in a row. MSA_CHECK_INPUTS=1 turns it on for every
        call. The reference backend always checks all but the q2k ids (dropped when out of
        range, as natively). Unchecked native calls never read or write out of bounds: pages
        outside the pool and ids outside the request are skipped.

    Query i of request b sees key j iff j < seqused_k[b], j <= i + seqused_k[b] - seqlen_q and
    (sparse) block j // 128 is selected. s_j = softmax_scale * q.k_j; O = softmax(s).V;
    LSE = ln sum exp(s_j); rows that see nothing give O = 0 and LSE = -inf, while a NaN or
    +inf score (non-finite q or K) gives NaN, never the empty row. With e4m3 q and K/V the P.V
    product rounds exp(s - block max) to e4m3, as an FP8 MMA does.

    Returns O [B * seqlen_q, Hq, 128] bf16, plus LSE [B * seqlen_q, Hq] fp32 when
    return_softmax_lse. The native path launches on q's device and current stream without host
    synchronization.
    """
    call = check_decode_args(q, k, v, q2k_indices, page_table=page_table, seqused_k=seqused_k,
                             seqlen_q=seqlen_q, max_seqlen_k=max_seqlen_k, blk_kv=blk_kv,
                             causal=causal, softmax_scale=softmax_scale,
                             check_input_valid=check_input_valid)
    return run_decode(call, schedule, O_partial, LSE_partial, bool(return_softmax_lse))


def run_decode(call: DecodeCall, schedule: Optional[DecodeSchedule], o_partial, lse_partial,
               want_lse: bool):
    """A validated call (call.out / call.lse: optional output buffers) on the backend _backend
    chooses; returns O, or (O, LSE) when want_lse."""
    entry = _backend.compile_entry(OP_NAME)
    if entry is not None:
        return entry(call, schedule, o_partial, lse_partial, want_lse)
    _name, native = _backend.choose(OP_NAME, call.q.device, **call.features())
    # The reference without a schedule runs unsplit; anything else needs a complete plan.
    if schedule is not None or native is not None or o_partial is not None \
            or lse_partial is not None:
        _attach_workspaces(call, schedule if schedule is not None else _default_schedule(call),
                           o_partial, lse_partial)
    return _execute(call, native, want_lse)


# ---------------------------------------------------------------------------------------------
# Plan / run wrapper
# ---------------------------------------------------------------------------------------------

class SparseDecodePagedAttentionWrapper:
    """Plan-once, run-many paged decode (FlashInfer-style), dense or block-sparse.

    ``plan`` validates the batch layout, keeps ``page_table``, ``seqused_k`` and ``q2k_indices``
    by reference, builds the split-KV :class:`DecodeSchedule` on the host (reading seqused_k,
    unless ``enable_cuda_graph``) and allocates fixed-size fp32 workspaces. ``run`` computes
    exactly what :func:`sparse_decode_atten_func` computes for the buffers' current contents,
    through that schedule, without host synchronization on the native path. For CUDA graphs:
    plan with ``enable_cuda_graph=True`` outside capture, capture ``run``, and before each replay
    write new lengths / pages / selections into the same buffers (seqused_k may grow up to
    max_seqlen_k).
    """

    def __init__(self, *, blk_kv: int = 128, causal: bool = True):
        _check_layout_flags(blk_kv, causal)
        self.blk_kv = blk_kv
        self.causal = causal
        self.decode_schedule: Optional[DecodeSchedule] = None
        self.O_partial: Optional[torch.Tensor] = None
        self.LSE_partial: Optional[torch.Tensor] = None
        # The query-tile plan (schedules.decode.query_tile_rows) and its workspaces, which runs
        # of e4m3 q and K/V take instead; None when the batch has no use for it.
        self.query_tile_schedule: Optional[DecodeSchedule] = None
        self.query_tile_O_partial: Optional[torch.Tensor] = None
        self.query_tile_LSE_partial: Optional[torch.Tensor] = None
        self._page_table = self._seqused_k = self._q2k_indices = None
        self._seqlen_q = self._max_seqlen_k = None
        self._num_qo_heads = self._num_kv_heads = None
        self._check_input_valid = False

    def plan(self, *, page_table, seqused_k, seqlen_q, max_seqlen_k, q2k_indices=None,
             num_qo_heads=None, num_kv_heads=None, head_dim=128, enable_cuda_graph=False,
             max_grid_size=None, fixed_split_size=None, disable_split_kv=False,
             qo_tile_rows=None, persistent=None, check_input_valid=False):
        """Plan a batch; returns self.

        page_table [B, max_pages] int32, seqused_k [B] int32, q2k_indices None or
        [num_kv_heads, B * seqlen_q, topK] int32 are kept by reference. num_qo_heads and
        num_kv_heads are required; head_dim must be 128. max_grid_size caps the CTAs a split
        plan aims for (default: the SM count, 132 without a GPU); fixed_split_size (pages, or
        q2k slots when sparse) forces split-KV; disable_split_kv forbids it. qo_tile_rows
        (1..128) fixes the query rows (token * G + head in group) a CTA serves; by default 128,
        and sparse multi-token runs of e4m3 q and K/V against long contexts take 16-row query
        tiles (one token at G = 16: each tile streams its own token's selected pages instead
        of the union of 8 tokens'; :func:`msa.schedules.decode.query_tile_rows`), from a second
        plan made here. persistent (None, True, False) plans the persistent form of dense
        multi-token calls where it pays, wherever it applies, or never
        (:func:`msa.schedules.decode.build_decode_schedule`).
        Workspaces are sized for the plan's worst case (from max_seqlen_k with
        enable_cuda_graph) and reused by every run. check_input_valid=True (or
        MSA_CHECK_INPUTS=1) makes every run() check the buffers' values as
        :func:`sparse_decode_atten_func` does (one synchronization per run).
        """
        if num_qo_heads is None or num_kv_heads is None:
            missing = "num_qo_heads" if num_qo_heads is None else "num_kv_heads"
            raise ValueError(f"{missing}: plan() needs num_qo_heads and num_kv_heads")
        check_positive_int("num_qo_heads", num_qo_heads, minimum=1)
        check_positive_int("num_kv_heads", num_kv_heads, minimum=1)
        check_positive_int("head_dim", head_dim, minimum=1)
        check_head_dim("head_dim", head_dim)
        check_qhead_per_kv(num_qo_heads, num_kv_heads, name="num_qo_heads",
                           kv_name="KV heads of num_kv_heads")
        _check_kv_metadata(page_table, seqused_k, seqlen_q, max_seqlen_k, q2k_indices,
                           num_kv_heads)
        sparse_topk = None if q2k_indices is None else q2k_indices.shape[2]
        capped = _capped_max_seqlen_k(max_seqlen_k, page_table)

        def plan_tiles(rows, persistent=False):
            schedule = build_decode_schedule(
                seqused_k, self.blk_kv, seqlen_q, num_qo_heads, num_kv_heads, head_dim, capped,
                enable_cuda_graph=enable_cuda_graph, max_grid_size=max_grid_size,
                fixed_split_size=fixed_split_size, disable_split_kv=bool(disable_split_kv),
                sparse_topk=sparse_topk, qo_tile_rows=rows, persistent=persistent)
            o_shape, lse_shape = schedule.workspace_shapes()
            device = seqused_k.device
            return schedule, (torch.empty(o_shape, dtype=torch.float32, device=device),
                              torch.empty(lse_shape, dtype=torch.float32, device=device))

        schedule, (self.O_partial, self.LSE_partial) = plan_tiles(qo_tile_rows, persistent)
        self.query_tile_schedule = self.query_tile_O_partial = self.query_tile_LSE_partial = None
        device = seqused_k.device
        tile_rows = None if qo_tile_rows is not None else query_tile_rows(
            seqlen_q, num_qo_heads // num_kv_heads, capped, self.blk_kv, sparse_topk,
            batch=seqused_k.shape[0], num_kv_heads=num_kv_heads,
            sms=max_grid_size or sm_count(device), token_warps=_token_warps_served(device))
        if tile_rows is not None:
            self.query_tile_schedule, (self.query_tile_O_partial,
                                       self.query_tile_LSE_partial) = plan_tiles(tile_rows)
        self._page_table, self._seqused_k, self._q2k_indices = page_table, seqused_k, q2k_indices
        self._seqlen_q, self._max_seqlen_k = seqlen_q, int(max_seqlen_k)
        self._num_qo_heads, self._num_kv_heads = num_qo_heads, num_kv_heads
        self._check_input_valid = value_checks_requested(check_input_valid)
        self.decode_schedule = schedule
        return self

    def run(self, q, k, v, *, softmax_scale=None, return_softmax_lse=False, out=None, lse=None):
        """Decode attention over the planned batch (current contents of the planned buffers).

        q [B * seqlen_q, num_qo_heads, 128]; k, v [pages, num_kv_heads, 128, 128] (dtypes as in
        :func:`sparse_decode_atten_func`). out: optional bf16 tensor of q's shape, lse: optional
        fp32 [B * seqlen_q, num_qo_heads]; both are written in place and returned.
        Returns O, or (O, LSE) when return_softmax_lse.
        """
        call = self._prepare_run(q, k, v, softmax_scale=softmax_scale, out=out, lse=lse)
        # A preallocated lse is always written; it is returned only with return_softmax_lse.
        return run_decode(call, *self.plan_for(call), bool(return_softmax_lse))

    def plan_for(self, call: DecodeCall):
        """(schedule, O_partial, LSE_partial) a validated call of this plan runs with: the
        query-tile plan for e4m3 q and K/V when the plan made one, else the main plan."""
        if self.query_tile_schedule is not None and _takes_query_tiles(call):
            return self.query_tile_schedule, self.query_tile_O_partial, self.query_tile_LSE_partial
        return self.decode_schedule, self.O_partial, self.LSE_partial

    def _prepare_run(self, q, k, v, *, softmax_scale=None, out=None, lse=None):
        """run()'s validation, no launch: the call for :func:`run_decode`. Callers that launch
        other work first (the decode step) validate everything before."""
        if self.decode_schedule is None:
            raise RuntimeError("run: called before plan(); call plan(...) first")
        call = check_decode_args(q, k, v, self._q2k_indices, page_table=self._page_table,
                                 seqused_k=self._seqused_k, seqlen_q=self._seqlen_q,
                                 max_seqlen_k=self._max_seqlen_k, blk_kv=self.blk_kv,
                                 causal=self.causal, softmax_scale=softmax_scale,
                                 check_input_valid=self._check_input_valid)
        check_planned("q", q.shape[1], "heads", "num_qo_heads", self._num_qo_heads)
        check_planned("k", k.shape[1], "heads", "num_kv_heads", self._num_kv_heads)
        if out is not None:
            _check_output("out", out, BF16, tuple(q.shape), q.device)
        if lse is not None:
            _check_output("lse", lse, torch.float32, tuple(q.shape[:2]), q.device)
        call.out, call.lse = out, lse
        return call
