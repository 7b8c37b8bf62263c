"""What each dispatcher calls while torch.compile traces it: the validated call packed into the
arguments of its custom op (msa._custom_ops), and the op's outputs shaped as the dispatcher
returns them. Registered with msa._backend by msa/__init__.py when the build has an op
namespace (``_ops.py``); eager calls never come here.
"""

from __future__ import annotations

import torch

from . import _backend
from ._native.compiled_ops import ops
from .schedules.sparse import SparseAttentionSchedule, schedule_size

# DecodeSchedule fields as the decode op carries them (the rest is planned_units, a list).
DECODE_TENSOR_FIELDS = ("num_splits_host", "merge_indptr_host", "request_indices_host",
                        "kv_tile_indices_host", "qo_tile_indices_host", "num_splits",
                        "merge_indptr", "request_indices", "kv_tile_indices", "qo_tile_indices")
DECODE_INT_FIELDS = ("batch_size", "seqlen_q", "num_qo_heads", "num_kv_heads", "head_dim",
                     "page_size", "sparse_topk", "enable_cuda_graph", "max_grid_size",
                     "split_kv", "kv_chunk_size", "qo_tile_rows", "slot_chunks",
                     "num_qo_tiles", "persistent_ctas")
DECODE_BOOL_FIELDS = ("enable_cuda_graph", "split_kv", "slot_chunks")
# The plan entries the dense fmha backends read (a test checks they read no other).
FMHA_PLAN_TENSORS = ("cu_seqlens_q", "cu_seqlens_k", "kv_segment_lens")
FMHA_PLAN_VALUES = ("causal", "batch", "max_seqlen_q", "max_seqlen_k", "num_kv_splits",
                    "host_qo_lens", "host_kv_lens")
# Dispatcher op name -> custom op name (csrc owns the names it registers, e.g.
# sparse_topk_select, so the Python ops are named after the public entry points).
CUSTOM_OPS = {"sparse_atten": "sparse_atten_func", "build_k2q_csr": "build_k2q_csr",
              "block_max_scores": "block_max_scores", "sparse_topk_select": "topk_select",
              "fmha_dense": "fmha_dense", "sparse_decode_atten": "sparse_decode_atten"}


def sparse_atten(call):
    s = call.schedule
    schedule = [] if s is None else [s.scheduler_metadata, s.work_count, s.qsplit_indices,
                                     s.split_counts]
    return ops.sparse_atten_func(
        call.q, call.k, call.v, call.k2q_row_ptr, call.k2q_q_indices, call.cu_seqlens_q,
        call.cu_seqlens_k, call.page_table, call.seqused_k, schedule,
        0 if s is None else s.target_q_per_cta, None if s is None else s.k2q_row_ptr,
        0 if s is None else s.batch, 0 if s is None else s.topk, call.topk, call.max_seqlen_q,
        call.max_seqlen_k, call.causal, call.softmax_scale, call.lse_temperature_scale,
        call.want_lse, call.want_temperature_lse, call.partial_dtype, call.pv_dtype,
        call.usable_SM_count, call.check_values)


def build_k2q_csr(call):
    hkv, total_q, topk = call.q2k_indices.shape
    target = capacity = 0
    if call.return_schedule:     # the schedule's size, as both backends compute it
        target, capacity = schedule_size(total_rows=call.total_rows, total_q=total_q,
                                         topk=topk, head_kv=hkv,
                                         qhead_per_kv=call.qhead_per_kv,
                                         device=call.q2k_indices.device,
                                         usable_SM_count=call.usable_SM_count)
    row_ptr, q_idx, metadata, work_count, qsplit, counts = ops.build_k2q_csr(
        call.q2k_indices, call.cu_seqlens_q, call.cu_seqlens_k, call.total_rows,
        call.max_kv_blocks, call.max_seqlen_q, call.qhead_per_kv, call.return_schedule,
        call.usable_SM_count, capacity, call.total_k, call.max_seqlen_k, call.check_values)
    if not call.return_schedule:
        return row_ptr, q_idx
    return row_ptr, q_idx, SparseAttentionSchedule(
        True, metadata, work_count, qsplit, counts, target, k2q_row_ptr=row_ptr,
        batch=call.cu_seqlens_q.numel() - 1, topk=topk)


def block_max_scores(call):
    offset = call.qo_offset
    tensor = offset if isinstance(offset, torch.Tensor) else None
    value = offset if tensor is None else None
    return ops.block_max_scores(call.q_idx, call.k_idx, call.cu_seqlens_q, call.cu_seqlens_k,
                                call.max_seqlen_q, call.max_seqlen_k, call.max_k_tiles,
                                call.scale, call.causal, tensor, value, call.page_table,
                                call.seqused_k, call.check_values)


def sparse_topk_select(call):
    pages = call.num_valid_pages
    tensor = pages if isinstance(pages, torch.Tensor) else None
    selection = ops.topk_select(call.max_score, call.topk, 0 if tensor is not None else pages,
                                tensor, call.force_begin_blocks, call.force_end_blocks,
                                call.causal_end_block, call.head_reduce or "",
                                call.num_out_heads)
    call.output.copy_(selection)       # the caller's buffer (or the one validation allocated)
    return call.output


def fmha_dense(call):
    plan = call.plan
    o, max_score = ops.fmha_dense(
        call.q, call.k, call.v, call.qo_offset, call.host_qo_offset, call.page_table,
        call.kv_block_indexes, call.logit_scale, call.output_scale, call.want_o,
        call.max_k_tiles, call.out_dtype, [plan[name] for name in FMHA_PLAN_TENSORS],
        bool(plan["causal"]), int(plan.get("batch", 1)), int(plan.get("max_seqlen_q", 0)),
        int(plan.get("max_seqlen_k", 0)), int(plan.get("num_kv_splits", 1) or 1),
        plan["host_qo_lens"], plan["host_kv_lens"])
    return (o if call.want_o else None), (max_score if call.max_k_tiles > 0 else None)


def sparse_decode_atten(call, schedule, o_partial, lse_partial, want_lse: bool):
    tensors, ints, units = [], [], []
    if schedule is not None:
        tensors = [getattr(schedule, name) for name in DECODE_TENSOR_FIELDS]
        for name in DECODE_INT_FIELDS:
            value = getattr(schedule, name)
            ints.append(-1 if value is None else int(value))
        units = list(schedule.planned_units)
    out, lse = ops.sparse_decode_atten(
        call.q, call.k, call.v, call.q2k_indices, call.page_table, call.seqused_k,
        call.seqlen_q, call.max_seqlen_k, call.softmax_scale, want_lse or call.lse is not None,
        tensors, ints, units, o_partial, lse_partial, call.check_values)
    if call.out is not None:
        call.out.copy_(out)
        out = call.out
    if call.lse is not None:           # a preallocated lse is always written
        call.lse.copy_(lse)
        lse = call.lse
    return (out, lse) if want_lse else out


for _op, _entry in (("sparse_atten", sparse_atten), ("build_k2q_csr", build_k2q_csr),
                    ("block_max_scores", block_max_scores),
                    ("sparse_topk_select", sparse_topk_select), ("fmha_dense", fmha_dense),
                    ("sparse_decode_atten", sparse_decode_atten)):
    _backend.register_compile_entry(_op, _entry)
