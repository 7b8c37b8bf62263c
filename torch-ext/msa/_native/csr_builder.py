"""Native k2q CSR builder (csrc/build_k2q_csr.cu), registered as ("build_k2q_csr", sm90/sm100)
and, behind the tier's gate like the rest of it, for the portable tier.

The CUDA ops ``run_build_k2q_csr`` and ``run_build_k2q_csr_with_schedule`` produce outputs
bit-identical to the reference CSR builder (msa.sparse_index_utils.build_k2q_csr_torch_reference
behind msa.build_k2q_csr) and
:func:`msa.schedules.sparse.prepare_sparse_fwd_schedule_and_split` (schedule). They
take every size from host hints, so a call never synchronizes and can be captured in a CUDA
graph. A schedule for 2^24 - 1 or more query tokens is refused by ``supports`` (the kernel packs
the local query id and the slot into one int32 while sorting), so msa._backend runs the
reference for it and logs that. Importing this module does not touch CUDA.

Two forms build the same bits: the radix sort (~12 launches: entry keys, cub's radix sort,
row_ptr, payloads, and the schedule's rows, scan and items) and, for small calls (the short
production chunks; :func:`counting_sort_applies`), a counting sort spread over several CTAs a KV
head (each span's row counts, then each span's scatter, the second launch also building the
schedule): two launches, where a short chunk's CSR stage was launch-bound. debug's
``csr_counting_sort`` hook forces either; ``last_variant("build_k2q_csr")`` says which ran.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from ..schedules.sparse import (METADATA_COLUMNS, SLOT_SHIFT, SparseAttentionSchedule,
                                schedule_size)

from . import compiled_ops, debug
from .compiled_ops import ops

OP_NAME = "build_k2q_csr"
KV_BLOCK = 128

# The counting-sort form (csrc/build_k2q_csr.cu fits_counting_sort) takes calls of at most
# COUNTING_SORT_MAX_BATCH requests and COUNTING_SORT_MAX_ROWS rows (and, with a schedule,
# COUNTING_SORT_MAX_ROW_HEADS (head, row) pairs) whose heads' entries (total_q * topK) cut into
# spans of at most COUNTING_SORT_MAX_SPAN entries over at most counting_sort_spans(rows) CTAs.
# Validated on an H100 (0a63c8f: tests/test_csrc_gpu.py ~k2q 78 passed: both forms against the
# reference on each limit's sides, garbage ids, short hints, graph replay; memcheck section csr
# clean). benchmarks/lab/csr_forms.py (H100, graph replays, counting vs radix): 12.1 vs 50.4 us
# at 182 queries / 17.7k keys (count 2.0 + scatter and schedule 7.3), 13.7 vs 52.9 at 171 / 55k,
# 22.5 vs 57.5 at 347 / 132k, 13.4 vs 55.3 at 2 x ~163 / 27k, 13.0 vs 54.1 at 630 / 32.7k,
# 16.5 vs 55.6 at 1000 / 60k, 19.0 vs 58.0 at 2000 / 40k, 33.1 vs 64.1 at 3584 / 140k (the one
# CTA a head before it: 24.6, 27.8 and 46.3 us at the first three).
VALIDATED_COUNTING_SORT = True
COUNTING_SORT_MAX_SPAN = 4096
COUNTING_SORT_MAX_SPANS = 64
COUNTING_SORT_MAX_COUNTS = 16384               # spans x (rows + 1): what each span CTA sums
COUNTING_SORT_MAX_ROWS = 2047
COUNTING_SORT_MAX_BATCH = 64
COUNTING_SORT_MAX_ROW_HEADS = 8192             # Hkv * total_rows, with a schedule


def counting_sort_spans(total_rows: int) -> int:
    """The most span CTAs a KV head's counting sort may take at `total_rows` rows."""
    return max(1, min(COUNTING_SORT_MAX_SPANS, COUNTING_SORT_MAX_COUNTS // (total_rows + 1)))


def counting_sort_applies(call) -> bool:
    """Whether a call's sizes take the counting-sort form when it may serve (the launcher's
    fits_counting_sort, on the same host values)."""
    hkv, total_q, topk = call.q2k_indices.shape
    return (total_q * topk <= COUNTING_SORT_MAX_SPAN * counting_sort_spans(call.total_rows)
            and call.total_rows <= COUNTING_SORT_MAX_ROWS
            and call.cu_seqlens_q.numel() - 1 <= COUNTING_SORT_MAX_BATCH
            and (not call.return_schedule
                 or hkv * call.total_rows <= COUNTING_SORT_MAX_ROW_HEADS))


# Queries a schedule build packs with their slot into one int32 (24 bits of local query id).
MAX_SCHEDULE_QUERIES = (1 << SLOT_SHIFT) - 1


def supports(*, return_schedule: bool = False, total_q: int = 0, **_features) -> Optional[str]:
    """None when the compiled ops can serve the call, else the reason they cannot."""
    missing = compiled_ops.missing_reason(*OPS)
    if missing is not None:
        return missing
    if return_schedule and total_q >= MAX_SCHEDULE_QUERIES:
        return (f"total_q {total_q}: the native schedule build packs query ids in "
                f"{SLOT_SHIFT} bits (< {MAX_SCHEDULE_QUERIES} queries)")
    return None


def run(call):
    """Build the k2q CSR (and the schedule when ``call.return_schedule``) on the GPU.

    Args:
      call: a validated :class:`msa.interface.K2qCsrCall` (q2k [Hkv, total_q, topK] int32,
        cu_seqlens_q/k [B+1] int32, host hints total_rows, max_kv_blocks, max_seqlen_q).

    Returns (k2q_row_ptr [Hkv, total_rows+1], k2q_q_indices [Hkv, total_q*topK]) int32, plus a
    :class:`SparseAttentionSchedule` when ``call.return_schedule``. Every output element is
    written by the kernels (the q-index tail past row_ptr[h, -1] is -1, like the reference), so
    the buffers are allocated uninitialized.
    """
    q2k = call.q2k_indices
    hkv, total_q, topk = q2k.shape
    device = q2k.device
    row_ptr = torch.empty(hkv, call.total_rows + 1, dtype=torch.int32, device=device)
    q_idx = torch.empty(hkv, total_q * topk, dtype=torch.int32, device=device)
    counting_sort = debug.gate("csr_counting_sort", _backend.may_serve(VALIDATED_COUNTING_SORT))
    debug.record(OP_NAME, "counting_sort" if counting_sort and counting_sort_applies(call)
                 else "radix_sort")
    if not call.return_schedule:
        ops.run_build_k2q_csr(q2k, call.cu_seqlens_q, call.cu_seqlens_k, row_ptr, q_idx, topk,
                              KV_BLOCK, call.total_rows, call.max_kv_blocks, counting_sort)
        return row_ptr, q_idx

    max_seqlen_q = int(call.max_seqlen_q)
    if max_seqlen_q >= 1 << SLOT_SHIFT:   # the reference's error, same class and message
        raise ValueError(f"max_seqlen_q: packed query ids need < 2^24, got {max_seqlen_q}")
    if total_q >= MAX_SCHEDULE_QUERIES:   # supports() refused it: the reference serves it
        raise NotImplementedError(f"q2k_indices: {total_q} queries; the native schedule build "
                                  f"packs query ids in {SLOT_SHIFT} bits")
    target, capacity = schedule_size(total_rows=call.total_rows, total_q=total_q, topk=topk,
                                     head_kv=hkv, qhead_per_kv=call.qhead_per_kv,
                                     device=device, usable_SM_count=call.usable_SM_count)
    metadata = torch.empty(capacity, METADATA_COLUMNS, dtype=torch.int32, device=device)
    work_count = torch.empty(1, dtype=torch.int32, device=device)
    qsplit = torch.empty_like(q_idx)
    split_counts = torch.empty(total_q, hkv, dtype=torch.int32, device=device)
    ops.run_build_k2q_csr_with_schedule(
        q2k, call.cu_seqlens_q, call.cu_seqlens_k, row_ptr, q_idx, topk, KV_BLOCK,
        call.total_rows, call.max_kv_blocks, metadata, work_count, qsplit, split_counts, target,
        capacity, max_seqlen_q, counting_sort)
    schedule = SparseAttentionSchedule(enabled=True, scheduler_metadata=metadata,
                                       work_count=work_count, qsplit_indices=qsplit,
                                       split_counts=split_counts, target_q_per_cta=target,
                                       k2q_row_ptr=row_ptr,
                                       batch=call.cu_seqlens_q.numel() - 1, topk=topk)
    return row_ptr, q_idx, schedule


OPS = ("run_build_k2q_csr", "run_build_k2q_csr_with_schedule")
_backend.register_native(OP_NAME, "sm90", run, supports)
_backend.register_native(OP_NAME, "sm100", run, supports,
                         device_check=compiled_ops.image_check(*OPS))
_backend.register_native(OP_NAME, _backend.PORTABLE, run,
                         _backend.portable_supports(supports, "the portable tier's CSR builder"),
                         tier=_backend.PORTABLE, device_check=compiled_ops.image_check(*OPS))
