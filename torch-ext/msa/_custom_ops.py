"""The package's torch custom ops: what torch.compile sees of each native call family.

Every public entry point validates its arguments in Python, which torch.compile traces, and
hands one validated call to its dispatcher (``run_sparse_attention``, ``run_block_max_scores``,
...). While torch.compile traces, the dispatcher calls the family's custom op instead
(``msa._compile_entries`` packs the call into the op's arguments); the op's implementation
rebuilds the call and runs the dispatcher, which then picks the native kernel or the reference
exactly as in eager mode. The fake implementations give the outputs' shapes and dtypes without
running anything. Eager calls do not go through these ops, so the hot path pays no dispatcher
overhead.

Names go through ``add_op_namespace_prefix`` (the variant's unique op namespace), so builds
loaded side by side never collide. The source tree has no ``_ops.py`` and no custom ops; a
second copy of one build in a process reuses the first copy's ops (msa/__init__.py).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import decode as _decode
from . import indexer as _indexer
from . import interface as _interface
from . import topk as _topk
from .fmha.call import FmhaDenseCall
from .fmha.run import run_fmha_dense
from ._compile_entries import (DECODE_BOOL_FIELDS, DECODE_INT_FIELDS, DECODE_TENSOR_FIELDS,
                               FMHA_PLAN_TENSORS, FMHA_PLAN_VALUES)
from ._ops import add_op_namespace_prefix
from .schedules.decode import DecodeSchedule
from .schedules.sparse import METADATA_COLUMNS, SparseAttentionSchedule

Tensor = torch.Tensor


def _empty(like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The placeholder of an output the call does not want."""
    return like.new_empty(0, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# sparse_atten_func
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("sparse_atten_func"), mutates_args=())
def sparse_atten_func(q: Tensor, k: Tensor, v: Tensor, k2q_row_ptr: Tensor, k2q_q_indices: Tensor,
                 cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, page_table: Optional[Tensor],
                 seqused_k: Optional[Tensor], schedule: List[Tensor], schedule_target: int,
                 schedule_row_ptr: Optional[Tensor], schedule_batch: int, schedule_topk: int,
                 topk: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                 softmax_scale: float, lse_temperature_scale: float, want_lse: bool,
                 want_temperature_lse: bool, partial_dtype: torch.dtype, pv_dtype: torch.dtype,
                 usable_SM_count: int, check_values: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(O, LSE or [0], LSE_T or [0]) of one validated sparse attention call; `schedule` is []
    or (scheduler_metadata, work_count, qsplit_indices, split_counts), built for
    schedule_row_ptr / schedule_batch / schedule_topk."""
    plan = None
    if schedule:
        plan = SparseAttentionSchedule(True, *schedule, target_q_per_cta=schedule_target,
                                       k2q_row_ptr=schedule_row_ptr, batch=schedule_batch,
                                       topk=schedule_topk)
    call = _interface.SparseAttentionCall(
        q=q, k=k, v=v, k2q_row_ptr=k2q_row_ptr, k2q_q_indices=k2q_q_indices, topk=topk,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        lse_temperature_scale=lse_temperature_scale, want_lse=want_lse,
        want_temperature_lse=want_temperature_lse, partial_dtype=partial_dtype,
        page_table=page_table, seqused_k=seqused_k, schedule=plan,
        usable_SM_count=usable_SM_count, pv_dtype=pv_dtype, check_values=check_values)
    out, lse, lse_t = _interface.sparse_attention_outputs(call)
    lse = lse if want_lse and lse is not None else _empty(q)
    if not (want_temperature_lse and lse_t is not None):
        lse_t = _empty(q)
    elif lse_t is lse:                      # outputs may not alias each other
        lse_t = lse.clone()
    return out, lse, lse_t


@sparse_atten_func.register_fake
def _(q, k, v, k2q_row_ptr, k2q_q_indices, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k,
      schedule, schedule_target, schedule_row_ptr, schedule_batch, schedule_topk, topk,
      max_seqlen_q, max_seqlen_k, causal, softmax_scale, lse_temperature_scale, want_lse,
      want_temperature_lse, partial_dtype, pv_dtype, usable_SM_count, check_values):
    rows = (q.shape[0], q.shape[1])
    out = q.new_empty(q.shape, dtype=torch.bfloat16)
    lse = q.new_empty(rows, dtype=torch.float32) if want_lse else _empty(q)
    lse_t = q.new_empty(rows, dtype=torch.float32) if want_temperature_lse else _empty(q)
    return out, lse, lse_t


# ---------------------------------------------------------------------------------------------
# build_k2q_csr
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("build_k2q_csr"), mutates_args=())
def build_k2q_csr(q2k_indices: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                  total_rows: int, max_kv_blocks: int, max_seqlen_q: Optional[int],
                  qhead_per_kv: int, return_schedule: bool, usable_SM_count: int,
                  schedule_capacity: int, total_k: Optional[int], max_seqlen_k: Optional[int],
                  check_values: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(row_ptr, q_idx, then the schedule's metadata, work_count, qsplit_indices and
    split_counts, or four [0] tensors without return_schedule)."""
    call = _interface.K2qCsrCall(q2k_indices, cu_seqlens_q, cu_seqlens_k, total_rows,
                                 max_kv_blocks, max_seqlen_q, qhead_per_kv, return_schedule,
                                 usable_SM_count, total_k, max_seqlen_k, check_values)
    result = _interface.run_build_k2q_csr(call)
    if not return_schedule:
        return (*result, *(_empty(q2k_indices, torch.int32) for _ in range(4)))
    row_ptr, q_idx, schedule = result
    if schedule.work_capacity != schedule_capacity:
        raise RuntimeError(f"build_k2q_csr: the schedule holds {schedule.work_capacity} work "
                           f"items, the traced graph expected {schedule_capacity}")
    return (row_ptr, q_idx, schedule.scheduler_metadata, schedule.work_count,
            schedule.qsplit_indices, schedule.split_counts)


@build_k2q_csr.register_fake
def _(q2k_indices, cu_seqlens_q, cu_seqlens_k, total_rows, max_kv_blocks, max_seqlen_q,
      qhead_per_kv, return_schedule, usable_SM_count, schedule_capacity, total_k, max_seqlen_k,
      check_values):
    hkv, total_q, topk = q2k_indices.shape
    i32 = dict(dtype=torch.int32)
    row_ptr = q2k_indices.new_empty((hkv, total_rows + 1), **i32)
    q_idx = q2k_indices.new_empty((hkv, total_q * topk), **i32)
    if not return_schedule:
        return (row_ptr, q_idx, *(_empty(q2k_indices, torch.int32) for _ in range(4)))
    return (row_ptr, q_idx, q2k_indices.new_empty((schedule_capacity, METADATA_COLUMNS), **i32),
            q2k_indices.new_empty((1,), **i32), q2k_indices.new_empty((hkv, total_q * topk), **i32),
            q2k_indices.new_empty((total_q, hkv), **i32))


# ---------------------------------------------------------------------------------------------
# block_max_scores
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("block_max_scores"), mutates_args=())
def block_max_scores(q_idx: Tensor, k_idx: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                     max_k_tiles: int, scale: float, causal: bool,
                     qo_offset_tensor: Optional[Tensor], qo_offset_int: Optional[int],
                     page_table: Optional[Tensor], seqused_k: Optional[Tensor],
                     check_values: bool) -> Tensor:
    """max_score [H, max_k_tiles, total_q] fp32 of one validated indexer call (qo_offset is
    the tensor, else the int, else None)."""
    offset = qo_offset_tensor if qo_offset_tensor is not None else qo_offset_int
    call = _indexer.BlockMaxScoreCall(
        q_idx=q_idx, k_idx=k_idx, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, max_k_tiles=max_k_tiles,
        scale=scale, causal=causal, qo_offset=offset, page_table=page_table,
        seqused_k=seqused_k, check_values=check_values)
    return _indexer.run_block_max_scores(call)


@block_max_scores.register_fake
def _(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, max_k_tiles, scale,
      causal, qo_offset_tensor, qo_offset_int, page_table, seqused_k, check_values):
    return q_idx.new_empty((q_idx.shape[1], max_k_tiles, q_idx.shape[0]), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# sparse_topk_select
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("topk_select"), mutates_args=())
def topk_select(max_score: Tensor, topk: int, num_valid_pages_int: int,
                       num_valid_pages: Optional[Tensor], force_begin_blocks: int,
                       force_end_blocks: int, causal_end_block: Optional[Tensor],
                       head_reduce: str, num_out_heads: int) -> Tensor:
    """[T, H_out, topk] int32 selection of one validated call (num_valid_pages: the tensor,
    else the int; head_reduce "" for none)."""
    output = max_score.new_empty((max_score.shape[2], num_out_heads, topk), dtype=torch.int32)
    call = _topk.TopkSelectCall(
        max_score=max_score, topk=topk,
        num_valid_pages=num_valid_pages if num_valid_pages is not None else num_valid_pages_int,
        output=output, force_begin_blocks=force_begin_blocks,
        force_end_blocks=force_end_blocks, causal_end_block=causal_end_block,
        head_reduce=head_reduce or None, num_out_heads=num_out_heads)
    return _topk.run_topk_select(call)


@topk_select.register_fake
def _(max_score, topk, num_valid_pages_int, num_valid_pages, force_begin_blocks,
      force_end_blocks, causal_end_block, head_reduce, num_out_heads):
    return max_score.new_empty((max_score.shape[2], num_out_heads, topk), dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# fmha (dense, paged, block-selected; O and / or the max-score output)
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op(add_op_namespace_prefix("fmha_dense"), mutates_args=())
def fmha_dense(q: Tensor, k: Tensor, v: Tensor, qo_offset: Tensor,
               host_qo_offset: Optional[List[int]], page_table: Optional[Tensor],
               kv_block_indexes: Optional[Tensor], logit_scale: float, output_scale: float,
               want_o: bool, max_k_tiles: int, out_dtype: torch.dtype,
               plan_tensors: List[Tensor], causal: bool, batch: int, max_seqlen_q: int,
               max_seqlen_k: int, num_kv_splits: int, host_qo_lens: List[int],
               host_kv_lens: List[int]) -> Tuple[Tensor, Tensor]:
    """(O or [0], max_score or [0]) of one validated dense fmha call; plan_tensors are the
    plan's FMHA_PLAN_TENSORS."""
    plan = dict(zip(FMHA_PLAN_TENSORS, plan_tensors))
    plan.update(zip(FMHA_PLAN_VALUES, (causal, batch, max_seqlen_q, max_seqlen_k,
                                       num_kv_splits, list(host_qo_lens), list(host_kv_lens))))
    call = FmhaDenseCall(
        q=q, k=k, v=v, plan=plan, qo_offset=qo_offset,
        host_qo_offset=None if host_qo_offset is None else list(host_qo_offset),
        page_table=page_table, kv_block_indexes=kv_block_indexes, logit_scale=logit_scale,
        output_scale=output_scale, want_o=want_o, max_k_tiles=max_k_tiles, out_dtype=out_dtype)
    o, ms = run_fmha_dense(call)
    return (o if o is not None else _empty(q, out_dtype),
            ms if ms is not None else _empty(q))


@fmha_dense.register_fake
def _(q, k, v, qo_offset, host_qo_offset, page_table, kv_block_indexes, logit_scale,
      output_scale, want_o, max_k_tiles, out_dtype, plan_tensors, causal, batch, max_seqlen_q,
      max_seqlen_k, num_kv_splits, host_qo_lens, host_kv_lens):
    o = q.new_empty(q.shape, dtype=out_dtype) if want_o else _empty(q, out_dtype)
    ms = q.new_empty((q.shape[1], max_k_tiles, q.shape[0]), dtype=torch.float32) \
        if max_k_tiles > 0 else _empty(q)
    return o, ms


# ---------------------------------------------------------------------------------------------
# Paged decode (sparse_decode_atten_func and SparseDecodePagedAttentionWrapper.run)
# ---------------------------------------------------------------------------------------------

def decode_schedule_from(tensors: List[Tensor], ints: List[int],
                         planned_units: List[int]) -> Optional[DecodeSchedule]:
    if not ints:
        return None
    fields = dict(zip(DECODE_TENSOR_FIELDS, tensors))
    for name, value in zip(DECODE_INT_FIELDS, ints):
        fields[name] = bool(value) if name in DECODE_BOOL_FIELDS else value
    if fields["sparse_topk"] < 0:
        fields["sparse_topk"] = None
    return DecodeSchedule(planned_units=list(planned_units), **fields)


@torch.library.custom_op(add_op_namespace_prefix("sparse_decode_atten"),
                         mutates_args=("o_partial", "lse_partial"))
def sparse_decode_atten(q: Tensor, k: Tensor, v: Tensor, q2k_indices: Optional[Tensor],
                  page_table: Tensor, seqused_k: Tensor, seqlen_q: int, max_seqlen_k: int,
                  softmax_scale: float, want_lse: bool, schedule_tensors: List[Tensor],
                  schedule_ints: List[int], planned_units: List[int],
                  o_partial: Optional[Tensor], lse_partial: Optional[Tensor],
                  check_values: bool) -> Tuple[Tensor, Tensor]:
    """(O, LSE or [0]) of one validated decode call; the schedule is given as its
    DECODE_TENSOR_FIELDS / DECODE_INT_FIELDS values (both [] for none). Writes the split-KV
    workspaces when the call uses them."""
    call = _decode.DecodeCall(q=q, k=k, v=v, q2k_indices=q2k_indices, page_table=page_table,
                              seqused_k=seqused_k, seqlen_q=seqlen_q, max_seqlen_k=max_seqlen_k,
                              softmax_scale=softmax_scale, check_values=check_values)
    schedule = decode_schedule_from(schedule_tensors, schedule_ints, planned_units)
    result = _decode.run_decode(call, schedule, o_partial, lse_partial, want_lse)
    return result if want_lse else (result, _empty(q))


@sparse_decode_atten.register_fake
def _(q, k, v, q2k_indices, page_table, seqused_k, seqlen_q, max_seqlen_k, softmax_scale,
      want_lse, schedule_tensors, schedule_ints, planned_units, o_partial, lse_partial,
      check_values):
    out = q.new_empty(q.shape, dtype=torch.bfloat16)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32) if want_lse else _empty(q)
    return out, lse
