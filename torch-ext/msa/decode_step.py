"""One MSA decode step of a layer as one plan / run: the fused decode indexer + top-k writes the
q2k selection, then block-sparse paged decode attention reads it (:class:`MSADecodeStepWrapper`).

``plan`` (outside CUDA-graph capture) builds the indexer's work split, a persistent q2k buffer
[Hkv, B * seqlen_q, topk] and a :class:`msa.SparseDecodePagedAttentionWrapper` planned on that
buffer (its sparse schedule depends only on topk, so it serves every length). When no request
can hold more than topk blocks (``ceil(max_seqlen_k / 128) <= topk``) the top-k keeps every
visible block whatever the scores: run() then writes that selection directly (history blocks
ascending, the own block last, as the top-k contract allows) and attends densely, which is the
same attention without the index scores or the q2k union. The attention then does not read the
selection, so its two launches can run on a side stream forked after the caller's work and
joined before run() returns (a branch in a captured graph; ``SIDE_STREAM_VALIDATED``, its GPU
test passed on the H200). Per decode step,
after writing new lengths into ``seqused_k``: ``update()`` once (the indexer's split of the live
blocks; several layers' wrappers may share one plan, see ``plan(indexer_plan=...)``), then
``run(...)`` for the layer. Everything run does is capturable: no host synchronization, fixed
buffers.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _backend
from ._validation import (check_decode_indexer_values, check_decode_values, check_positive_int,
                          check_qhead_per_kv, check_tensor, check_topk, value_checks_requested)
from .decode import PAGE_SIZE, SparseDecodePagedAttentionWrapper, _check_seqlen_q, run_decode
from .decode_indexer import (DecodeIndexerPlan, check_indexer_args, make_decode_indexer_plan,
                             run_indexer_call)


def selects_every_block(max_seqlen_k: int, topk: int) -> bool:
    """Whether the top-k keeps every visible block of every request of at most max_seqlen_k
    keys, whatever the scores (no request holds more than topk blocks)."""
    return -(-max_seqlen_k // PAGE_SIZE) <= topk


# Whether the every-block selection's side-stream branch passed its GPU test on the H200
# (tests/test_decode_indexer_gpu.py::
# test_native_step_wrapper_selects_every_block_of_short_requests, at 3ac8975). False forks only
# under MSA_UNVALIDATED_KERNELS=1.
SIDE_STREAM_VALIDATED = True
_side_streams = {}


def _side_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The process's side stream of `device` for the every-block selection (one per device,
    shared by every wrapper), or None when run() should stay on the caller's stream."""
    if device.type != "cuda" or not _backend.may_serve(SIDE_STREAM_VALIDATED):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


# run()'s names for the arguments it hands decode_indexer_topk (its errors name these).
_INDEXER_NAMES = dict(scale="index_scale", k_scale="k_idx_scale",
                      k_global_scale="k_idx_global_scale", k_scale_layout="k_idx_scale_layout")


class MSADecodeStepWrapper:
    """Plan-once, run-many MSA decode step: index scores -> top-k blocks -> sparse attention.

    The selection of query row (request b, MTP query q) and KV head h is index head
    h // (Hkv / H_idx)'s topk - 1 best history blocks plus the row's own block
    (:func:`msa.decode_indexer_topk`); attention then sees exactly those blocks, causally
    (:func:`msa.sparse_decode_atten_func`).
    """

    def __init__(self):
        self.indexer_plan: Optional[DecodeIndexerPlan] = None
        self.attention: Optional[SparseDecodePagedAttentionWrapper] = None
        self.q2k_indices: Optional[torch.Tensor] = None
        self.selects_every_block = False
        self._page_table = None
        self._seqused_k = None
        self._slot_needs = None
        self._slots = None
        self._no_block = None
        self._check_input_valid = False

    def plan(self, *, page_table, seqused_k, seqlen_q, max_seqlen_k, num_qo_heads, num_kv_heads,
             num_index_heads=None, topk=16, max_ctas=None,
             indexer_plan: Optional[DecodeIndexerPlan] = None, qo_tile_rows=None,
             fixed_split_size=None, check_input_valid=False):
        """Plan a batch; returns self.

        page_table [B, max_pages] int32 and seqused_k [B] int32 are kept by reference (write
        new lengths / pages into them before each step). max_seqlen_k bounds every length; with
        ceil(max_seqlen_k / 128) <= topk every visible block is selected, and run() skips the
        index scores (``selects_every_block``). seqlen_q: queries per request (1..16,
        MTP). num_index_heads: index heads H_idx of q_idx (default num_kv_heads; must divide
        it). topk in {4, 8, 16, 32}. max_ctas: the indexer's CTA budget (default two per SM).
        indexer_plan: a :class:`DecodeIndexerPlan` of this batch to share with other layers'
        wrappers (its seqlen_q, heads and topk must match); by default the wrapper makes one.
        qo_tile_rows: the attention's query rows per CTA, as in
        :meth:`SparseDecodePagedAttentionWrapper.plan` (default: 128, and 16-row query tiles for
        e4m3 q and K/V against long contexts). fixed_split_size: the attention's KV chunk in pages
        (slots for one-token tiles), forcing split-KV, as in that plan (default: the plan's).
        check_input_valid=True (or MSA_CHECK_INPUTS=1) makes every run() check the lengths and
        page ids as :func:`msa.decode_indexer_topk` and :func:`msa.sparse_decode_atten_func` do
        (one synchronization per run). Everything is validated before the indexer plan's first
        launch.
        """
        check_positive_int("num_qo_heads", num_qo_heads, minimum=1)
        check_positive_int("num_kv_heads", num_kv_heads, minimum=1)
        check_qhead_per_kv(num_qo_heads, num_kv_heads, name="num_qo_heads",
                           kv_name="KV heads of num_kv_heads")
        if num_index_heads is None:
            num_index_heads = num_kv_heads
        check_positive_int("num_index_heads", num_index_heads, minimum=1)
        if num_kv_heads % num_index_heads:
            raise ValueError(f"num_index_heads: {num_index_heads} does not divide num_kv_heads "
                             f"{num_kv_heads}")
        check_topk("topk", topk)
        check_tensor("seqused_k", seqused_k, dtypes=(torch.int32,), ndim=1, contiguous=True)
        check_values = value_checks_requested(check_input_valid)
        if indexer_plan is not None:
            if not isinstance(indexer_plan, DecodeIndexerPlan):
                raise TypeError(f"indexer_plan: expected a DecodeIndexerPlan, got "
                                f"{type(indexer_plan).__name__}")
            if (indexer_plan.seqused_k is not seqused_k or indexer_plan.seqlen_q != seqlen_q
                    or indexer_plan.num_index_heads != num_index_heads
                    or indexer_plan.topk != topk):
                raise ValueError("indexer_plan: was made for other lengths, seqlen_q, index "
                                 "heads or topk than this plan call")
        _check_seqlen_q(seqlen_q)
        check_positive_int("max_seqlen_k", max_seqlen_k, minimum=1)
        batch, device = seqused_k.numel(), seqused_k.device
        q2k = torch.full((num_kv_heads, batch * seqlen_q, topk), -1, dtype=torch.int32,
                         device=device)
        every_block = selects_every_block(max_seqlen_k, topk)
        # The attention plan validates the layout (no launch); the indexer plan launches its
        # first update, so it comes last.
        attention = SparseDecodePagedAttentionWrapper().plan(
            page_table=page_table, seqused_k=seqused_k, seqlen_q=seqlen_q,
            max_seqlen_k=max_seqlen_k, q2k_indices=None if every_block else q2k,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, enable_cuda_graph=True,
            qo_tile_rows=qo_tile_rows, fixed_split_size=fixed_split_size,
            check_input_valid=check_values)
        if every_block:
            # Slot j of MTP query i holds block j while 128 j <= its position
            # seqused_k - seqlen_q + i, i.e. while 128 j + seqlen_q - i <= seqused_k.
            slots = torch.arange(topk, dtype=torch.int32, device=device)
            query = torch.arange(seqlen_q, dtype=torch.int32, device=device)
            needs = PAGE_SIZE * slots + (seqlen_q - query)[:, None]          # [Q, topk]
            self._slot_needs = needs.expand(num_kv_heads, 1, seqlen_q, topk)
            self._slots = slots
            self._no_block = torch.full((), -1, dtype=torch.int32, device=device)
        if indexer_plan is None:
            indexer_plan = make_decode_indexer_plan(
                seqused_k, seqlen_q=seqlen_q, num_index_heads=num_index_heads,
                max_seqlen_k=max_seqlen_k, topk=topk, max_ctas=max_ctas)
        self.indexer_plan, self.attention, self.q2k_indices = indexer_plan, attention, q2k
        self.selects_every_block = every_block
        self._page_table, self._seqused_k = page_table, seqused_k
        self._check_input_valid = check_values
        return self

    def update(self) -> "MSADecodeStepWrapper":
        """Re-split the indexer's work from the live seqused_k (once per decode step). Skipped
        when the indexer plan's own max_seqlen_k keeps every block selected: wrappers within
        that bound do not score, and a split left as it is stays correct."""
        self._require_plan()
        plan = self.indexer_plan
        if not selects_every_block(plan.max_seqlen_k, plan.topk):
            plan.update()
        return self

    def run(self, q, k, v, q_idx, k_idx, *, k_idx_scale=None, k_idx_global_scale=None,
            k_idx_scale_layout="128x4", index_scale=1.0, softmax_scale=None,
            return_softmax_lse=False, out=None, lse=None):
        """One layer's decode step over the planned batch.

        q [B * seqlen_q, Hq, 128] and paged k, v [pages, Hkv, 128, 128] as in
        :func:`msa.sparse_decode_atten_func`; q_idx [B * seqlen_q, H_idx, 128] and the paged
        index-K cache k_idx (with k_idx_scale / k_idx_global_scale / k_idx_scale_layout for
        NVFP4) as in :func:`msa.decode_indexer_topk`; index_scale scales the index scores.
        out / lse: optional preallocated bf16 [B * seqlen_q, Hq, 128] / fp32 [B * seqlen_q, Hq].
        Returns O, or (O, LSE) with return_softmax_lse. The selection stays in
        ``self.q2k_indices`` [Hkv, B * seqlen_q, topk] until the next run. Every argument is
        validated before the indexer launches.
        """
        self._require_plan()
        index_call = check_indexer_args(
            q_idx, k_idx, self.indexer_plan, self._page_table, index_scale, k_idx_scale,
            k_idx_global_scale, k_idx_scale_layout, self.q2k_indices, False,
            self._check_input_valid, names=_INDEXER_NAMES)
        attention = self.attention
        call = attention._prepare_run(q, k, v, softmax_scale=softmax_scale, out=out, lse=lse)
        if call.check_values or _backend.reference_only(q.device):
            # Lengths and pages before any launch; the selection is the indexer's own output.
            check_decode_values(call, strict=False)
            call.check_values = False
        if self.selects_every_block:
            # The index keys are not read, but a call is judged the same either way: their pool
            # against the page table, as the indexer would check it.
            if index_call.check_values or _backend.reference_only(q.device):
                check_decode_indexer_values(index_call)
            side = None if _backend.reference_only(q.device) else _side_stream(q.device)
            if side is not None:
                caller = torch.cuda.current_stream(q.device)
                side.wait_stream(caller)
                with torch.cuda.stream(side):
                    self._write_every_visible_block()
                result = run_decode(call, *attention.plan_for(call), bool(return_softmax_lse))
                caller.wait_stream(side)
                return result
            self._write_every_visible_block()
        else:
            run_indexer_call(index_call)
        return run_decode(call, *attention.plan_for(call), bool(return_softmax_lse))

    def _write_every_visible_block(self):
        """q2k when the top-k keeps every visible block: blocks 0 .. own in ascending order
        (the own block last), -1 after; rows without keys all -1. Two capturable launches on the
        current stream (their temporary is freed to that stream's pool)."""
        q2k = self.q2k_indices
        batch = self._seqused_k.numel()
        visible = self._slot_needs <= self._seqused_k.view(1, batch, 1, 1)   # [Hkv, B, Q, topk]
        torch.where(visible, self._slots, self._no_block,
                    out=q2k.view(q2k.shape[0], batch, -1, q2k.shape[2]))

    def _require_plan(self):
        if self.attention is None:
            raise RuntimeError("run: called before plan(); call plan(...) first")


__all__ = ["MSADecodeStepWrapper"]
