"""Sparse forward schedule: work items over k2q CSR rows and per-query combine slots.

A work item is one chunk of at most ``target_q_per_cta`` queries of one (KV head, CSR row).
``scheduler_metadata[w]`` = (head_kv, row, q_begin, q_count, batch, kv_block). Every CSR entry
gets a combine slot ``s`` in [0, split_counts[q, h]) and is stored packed in ``qsplit_indices`` as
``q_local | s << 24``. Treat the tensors as opaque; only the native kernels read them.

This module holds the dataclass, the sizing model shared by every backend, and the reference
builder (host loops; it synchronizes). The capture-safe GPU builder is the native
``run_build_k2q_csr_with_schedule`` op, reached through ``msa.build_k2q_csr``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..._common import sm_count
from ...sparse_index_utils import packed_row_owner, rows_per_request

METADATA_COLUMNS = 6
SLOT_SHIFT = 24


@dataclasses.dataclass
class SparseAttentionSchedule:
    """The opaque schedule. Besides the contract's fields it records what it was built for:
    ``k2q_row_ptr`` (the CSR row pointer it cuts into work items, kept by reference), the
    request count ``batch`` and the ``topk`` its slots were numbered for. The attention checks
    a call against them on the host and reads the CSR rows through the schedule's own
    ``k2q_row_ptr``, so a schedule addresses only its own buffers whatever else the call
    passes. A schedule without them was not made by a builder and is refused."""
    enabled: bool
    scheduler_metadata: Optional[torch.Tensor]
    work_count: Optional[torch.Tensor]
    qsplit_indices: Optional[torch.Tensor] = None
    split_counts: Optional[torch.Tensor] = None
    target_q_per_cta: int = 0
    k2q_row_ptr: Optional[torch.Tensor] = None
    batch: int = 0
    topk: int = 0

    @property
    def work_capacity(self) -> int:
        return 0 if self.scheduler_metadata is None else int(self.scheduler_metadata.shape[0])

    @property
    def complete(self) -> bool:
        return (self.enabled and self.scheduler_metadata is not None
                and self.work_count is not None and self.qsplit_indices is not None
                and self.split_counts is not None and self.target_q_per_cta > 0)

    @property
    def built_by_a_builder(self) -> bool:
        return self.complete and self.k2q_row_ptr is not None and self.batch > 0 \
            and self.topk > 0


SparseSchedulePlan = SparseAttentionSchedule


def target_q_per_cta(*, total_q: int, topk: int, blk_kv: int, head_kv: int, qhead_per_kv: int,
                     device: torch.device, usable_SM_count: int = -1) -> int:
    """Queries per work item: enough items for two waves of CTAs, but hot rows (sink, local
    blocks) split into chunks of at most 2*topK*blk_kv queries; a multiple of 128/G so a chunk
    fills whole 128-row MMA tiles."""
    group = max(1, 128 // qhead_per_kv)
    refs = max(total_q * topk * head_kv, 1)
    items = 2 * sm_count(device, usable_SM_count)
    occupancy = -(-refs // items)
    cap = max(group, 2 * topk * blk_kv)
    target = min(max(occupancy, group), cap)
    return -(-target // group) * group


def schedule_capacity(*, total_rows: int, total_q: int, topk: int, head_kv: int,
                      target_q_per_cta: int) -> int:
    """Upper bound on work items: one per (row, head) plus one per full chunk of entries."""
    refs = max(total_q * topk * head_kv, 1)
    return max(1, total_rows * head_kv + -(-refs // max(target_q_per_cta, 1)))


def prepare_sparse_fwd_schedule_and_split(*, k2q_row_ptr: torch.Tensor,
                                          k2q_q_indices: torch.Tensor,
                                          k2q_qsplit_indices: torch.Tensor,
                                          split_counts: torch.Tensor,
                                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                          total_q: int, max_seqlen_q: int, topk: int,
                                          head_kv: int, qhead_per_kv: int, blk_kv: int,
                                          device: torch.device, enabled: bool,
                                          usable_SM_count: int = -1) -> SparseAttentionSchedule:
    """Reference schedule builder. Fills ``k2q_qsplit_indices`` and ``split_counts`` in place
    and returns the schedule. Work items are ordered by (row, head, chunk) and slots are given
    in that order, so the result is deterministic. An entry gets a slot when its query id lies
    in [0, q_len_b) of the row's request (max_seqlen_q is only checked against the 2^24
    packing limit), so a short max_seqlen_q hint loses no work."""
    if not enabled:
        return SparseAttentionSchedule(False, None, None)
    if k2q_qsplit_indices.shape != k2q_q_indices.shape:
        raise ValueError("k2q_qsplit_indices: shape must match k2q_q_indices")
    if split_counts.shape != (total_q, head_kv):
        raise ValueError(f"split_counts: expected shape [{total_q}, {head_kv}], got "
                         f"{list(split_counts.shape)}")
    if topk > 255:
        raise ValueError(f"topk: packed slots hold at most 255, got {topk}")
    if max_seqlen_q >= 1 << SLOT_SHIFT:
        raise ValueError(f"max_seqlen_q: packed query ids need < 2^24, got {max_seqlen_q}")
    total_rows = k2q_row_ptr.shape[1] - 1
    target = target_q_per_cta(total_q=total_q, topk=topk, blk_kv=blk_kv, head_kv=head_kv,
                              qhead_per_kv=qhead_per_kv, device=device,
                              usable_SM_count=usable_SM_count)
    capacity = schedule_capacity(total_rows=total_rows, total_q=total_q, topk=topk,
                                 head_kv=head_kv, target_q_per_cta=target)
    owners = packed_row_owner(rows_per_request(cu_seqlens_k, blk_kv))
    row_ptr = k2q_row_ptr.to("cpu", torch.int64)
    q_idx = k2q_q_indices.to("cpu", torch.int64)
    cu_q = cu_seqlens_q.to("cpu", torch.int64)
    meta = torch.zeros(capacity, METADATA_COLUMNS, dtype=torch.int64)
    qsplit = torch.full_like(q_idx, -1)
    counts = torch.zeros(total_q, head_kv, dtype=torch.int64)
    n_work = 0
    for r in range(min(total_rows, len(owners))):
        b, beta = owners[r]
        for h in range(head_kv):
            lo, hi = int(row_ptr[h, r]), int(row_ptr[h, r + 1])
            for q0 in range(0, max(hi - lo, 0), target):
                n = min(target, hi - lo - q0)
                if n_work < capacity:
                    meta[n_work] = torch.tensor([h, r, q0, n, b, beta])
                n_work += 1
                for e in range(lo + q0, lo + q0 + n):
                    ql = int(q_idx[h, e])
                    if 0 <= ql < int(cu_q[b + 1] - cu_q[b]):
                        qa = int(cu_q[b]) + ql
                        if not 0 <= qa < total_q:
                            continue
                        slot = int(counts[qa, h])
                        counts[qa, h] += 1
                        if slot < topk:
                            qsplit[h, e] = ql | (slot << SLOT_SHIFT)
    k2q_qsplit_indices.copy_(qsplit.to(torch.int32))
    # The full entry count (<= topk for a CSR of a topk-wide q2k): a larger one makes the
    # combine flag the (query, head) as NaN instead of silently dropping entries past the slots.
    split_counts.copy_(counts.clamp_max((1 << 31) - 1).to(torch.int32))
    return SparseAttentionSchedule(
        enabled=True, scheduler_metadata=meta.to(device, torch.int32),
        work_count=torch.tensor([min(n_work, capacity)], dtype=torch.int32, device=device),
        qsplit_indices=k2q_qsplit_indices, split_counts=split_counts, target_q_per_cta=target,
        k2q_row_ptr=k2q_row_ptr, batch=cu_q.numel() - 1, topk=topk)
