"""The sparse attention schedule: work items over k2q CSR rows and per-query combine slots.

A work item is one chunk of at most ``target_q_per_cta`` queries of one (KV head, CSR row).
``scheduler_metadata[w]`` = (head_kv, row, q_begin, q_count, batch, kv_block). Every CSR entry
gets a combine slot ``s`` in [0, split_counts[q, h]) and is stored packed in ``qsplit_indices`` as
``q_local | s << 24``. Treat the tensors as opaque; only the native kernels read them.

Three builders fill the same tensors, all sized by :func:`schedule_size`:
  * :func:`prepare_sparse_fwd_schedule_and_split`: the reference (host loops; it synchronizes);
  * :func:`build_schedule_on_device`: tensor ops on the CSR's device, capture-safe, used when a
    native attention call comes without a schedule;
  * the CUDA op ``run_build_k2q_csr_with_schedule`` (``csrc/build_k2q_csr.cu``), reached
    through ``msa.build_k2q_csr(..., return_schedule=True)``.
Work items are ordered (head, row, chunk): the items a grid runs at once then gather the queries
of one KV head, whose rows L2 holds better (1.04-1.08x on a 16k-query chunk's attention + combine,
benchmarks/lab/sparse_item_order.py on an H100). A slot is the rank of an entry's row among its
(query, head)'s rows, whatever the item order, and the three builders agree exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from .._common import KV_BLOCK, sm_count
from .._validation import device_prefix_sums
from .csr_rows import packed_row_owner, rows_per_request

METADATA_COLUMNS = 6
SLOT_SHIFT = 24
INT32_MAX = (1 << 31) - 1


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


def schedule_size(*, total_rows: int, total_q: int, topk: int, head_kv: int, qhead_per_kv: int,
                  device: torch.device, usable_SM_count: int = -1,
                  blk_kv: int = KV_BLOCK) -> Tuple[int, int]:
    """(target_q_per_cta, work capacity) of the schedule of a CSR with ``total_rows`` rows:
    what every builder allocates and what the custom op's traced shapes expect."""
    target = target_q_per_cta(total_q=total_q, topk=topk, blk_kv=blk_kv, head_kv=head_kv,
                              qhead_per_kv=qhead_per_kv, device=device,
                              usable_SM_count=usable_SM_count)
    return target, schedule_capacity(total_rows=total_rows, total_q=total_q, topk=topk,
                                     head_kv=head_kv, target_q_per_cta=target)


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
    and returns the schedule. Work items are ordered by (head, row, chunk) and slots are given
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
    target, capacity = schedule_size(total_rows=total_rows, total_q=total_q, topk=topk,
                                     head_kv=head_kv, qhead_per_kv=qhead_per_kv, device=device,
                                     usable_SM_count=usable_SM_count, blk_kv=blk_kv)
    owners = packed_row_owner(rows_per_request(cu_seqlens_k, blk_kv))
    row_ptr = k2q_row_ptr.to("cpu", torch.int64)
    q_idx = k2q_q_indices.to("cpu", torch.int64)
    cu_q = cu_seqlens_q.to("cpu", torch.int64)
    meta = torch.zeros(capacity, METADATA_COLUMNS, dtype=torch.int64)
    qsplit = torch.full_like(q_idx, -1)
    counts = torch.zeros(total_q, head_kv, dtype=torch.int64)
    n_work = 0
    for h in range(head_kv):
        for r in range(min(total_rows, len(owners))):
            b, beta = owners[r]
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
    split_counts.copy_(counts.clamp_max(INT32_MAX).to(torch.int32))
    return SparseAttentionSchedule(
        enabled=True, scheduler_metadata=meta.to(device, torch.int32),
        work_count=torch.tensor([min(n_work, capacity)], dtype=torch.int32, device=device),
        qsplit_indices=k2q_qsplit_indices, split_counts=split_counts, target_q_per_cta=target,
        k2q_row_ptr=k2q_row_ptr, batch=cu_q.numel() - 1, topk=topk)


def build_schedule_on_device(call, cu_seqlens_q: Optional[torch.Tensor] = None,
                             cu_seqlens_k: Optional[torch.Tensor] = None
                             ) -> SparseAttentionSchedule:
    """A complete schedule for the k2q CSR of a validated sparse attention call
    (``msa.interface.SparseAttentionCall``), built with tensor ops on the CSR's device (no host
    synchronization; sizes come from the tensors' shapes, never from host hints).

    Work items are (head, row, chunk) ordered like the reference builder: each (KV head, CSR
    row) is cut into chunks of target_q_per_cta queries. Slots number a (query, KV head)'s
    entries in CSR row order. Entries whose query id is out of range for the request get -1
    and no slot; split_counts keeps the full entry count, so the combine can flag a (query,
    KV head) with more entries than slots. metadata rows past work_count are never read (the
    grid is the capacity and CTAs past work_count exit).

    Whatever the index values, every gather stays in bounds: cu_seqlens_q/k (default: the
    call's, made trustworthy with device_prefix_sums) and the row pointer are clamped monotone
    within their tensors; the schedule keeps that clamped row pointer for the kernel.
    """
    q_idx = call.k2q_q_indices
    device = q_idx.device
    hkv, n_entries = q_idx.shape
    total_q = call.q.shape[0]
    if cu_seqlens_q is None:
        cu_seqlens_q = device_prefix_sums(call.cu_seqlens_q, total_q)
    if cu_seqlens_k is None:
        cu_seqlens_k = device_prefix_sums(call.cu_seqlens_k, INT32_MAX)
    # A monotone row pointer within k2q_q_indices (the given one when it is valid).
    row_ptr = device_prefix_sums(call.k2q_row_ptr.t(), n_entries).t().contiguous()
    total_rows = row_ptr.shape[1] - 1
    topk = call.topk
    target, capacity = schedule_size(total_rows=total_rows, total_q=total_q, topk=topk,
                                     head_kv=hkv, qhead_per_kv=call.qhead_per_kv,
                                     device=device, usable_SM_count=call.usable_SM_count)
    i64 = torch.int64
    cu_q = cu_seqlens_q.to(i64)
    cu_k = cu_seqlens_k.to(i64)
    batch = cu_q.numel() - 1
    # The owner block of CSR row r is at most r, so total_rows block indices cover every row
    # whatever max_seqlen_k says (a short hint must not make rows look absent).
    max_blocks = max(total_rows, 1)

    # Owner (request b, block beta) of every packed CSR row (round-robin over requests).
    rows_b = (cu_k[1:] - cu_k[:-1] + KV_BLOCK - 1) // KV_BLOCK                     # [B]
    betas = torch.arange(max_blocks + 1, device=device, dtype=i64)
    rows_before = torch.minimum(rows_b.view(1, -1), betas.view(-1, 1)).sum(1)      # [beta+1]
    r_all = torch.arange(total_rows, device=device, dtype=i64)
    row_beta = (torch.searchsorted(rows_before, r_all, right=True) - 1).clamp(0, max_blocks - 1)
    rank = r_all - rows_before[row_beta]
    has_block = (rows_b.view(1, -1) > betas[:max_blocks].view(-1, 1)).to(i64)      # [beta, B]
    nth = has_block.cumsum(1)[row_beta]                                            # [rows, B]
    row_batch = (nth <= rank.view(-1, 1)).sum(1).clamp_max(max(batch - 1, 0))
    row_exists = r_all < rows_before[-1]

    # Work items: chunks of each (head, row), flattened in (head, row) order.
    counts = (row_ptr[:, 1:] - row_ptr[:, :-1]).to(i64).clamp_min(0)               # [H, rows]
    counts = torch.where(row_exists.view(1, -1), counts, torch.zeros_like(counts))
    chunks = ((counts + target - 1) // target).reshape(-1)                         # [H*rows]
    chunk_end = chunks.cumsum(0)
    w = torch.arange(capacity, device=device, dtype=i64)
    pair = torch.searchsorted(chunk_end, w, right=True).clamp_max(max(chunks.numel() - 1, 0))
    chunk_in_pair = w - (chunk_end[pair] - chunks[pair])
    w_head, w_row = pair // max(total_rows, 1), pair % max(total_rows, 1)
    q_begin = chunk_in_pair * target
    q_count = (counts[w_head, w_row] - q_begin).clamp(0, target)
    meta = torch.stack([w_head, w_row, q_begin, q_count, row_batch[w_row], row_beta[w_row]], 1)
    work_count = chunk_end[-1:].clamp_max(capacity).to(torch.int32) if chunks.numel() else \
        torch.zeros(1, dtype=torch.int32, device=device)

    # Slots: rank of each entry among the entries of its (KV head, query) in CSR order.
    e = torch.arange(n_entries, device=device, dtype=i64).view(1, -1).expand(hkv, -1)
    e_row = torch.searchsorted(row_ptr.to(i64).contiguous(), e.contiguous(), right=True) - 1
    e_row = e_row.clamp(0, max(total_rows - 1, 0))
    e_batch = row_batch[e_row]
    q_local = q_idx.to(i64)
    q_len = (cu_q[1:] - cu_q[:-1])[e_batch]
    valid = ((e < row_ptr[:, -1:].to(i64)) & row_exists[e_row] & (q_local >= 0)
             & (q_local < q_len))
    q_abs = torch.where(valid, cu_q[e_batch] + q_local, torch.zeros_like(q_local))
    heads = torch.arange(hkv, device=device, dtype=i64).view(-1, 1)
    key = torch.where(valid, heads * total_q + q_abs, torch.full_like(q_abs, hkv * total_q))
    flat_key = key.reshape(-1)
    order = torch.sort(flat_key, stable=True).indices
    sorted_key = flat_key[order]
    group_start = torch.searchsorted(sorted_key, sorted_key, right=False)
    slot_sorted = torch.arange(flat_key.numel(), device=device, dtype=i64) - group_start
    slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted).view(hkv, n_entries)
    valid = valid & (slot < topk)
    qsplit = torch.where(valid, q_local | (slot << SLOT_SHIFT), torch.full_like(q_local, -1))
    # scatter_add, not bincount: bincount reads the max on the host (a sync).
    per_key = torch.zeros(hkv * total_q + 1, dtype=i64, device=device).scatter_add_(
        0, flat_key, torch.ones_like(flat_key))[: hkv * total_q]
    split_counts = per_key.view(hkv, total_q).t().clamp_max(INT32_MAX)
    return SparseAttentionSchedule(
        enabled=True, scheduler_metadata=meta.to(torch.int32).contiguous(),
        work_count=work_count, qsplit_indices=qsplit.to(torch.int32).contiguous(),
        split_counts=split_counts.to(torch.int32).contiguous(), target_q_per_cta=target,
        k2q_row_ptr=row_ptr, batch=batch, topk=topk)


def window_capacity(schedule: SparseAttentionSchedule, total_q: int, window: int) -> int:
    """Work items :func:`split_items_by_query_window` may make: each (KV head, CSR row) of
    ascending query ids is cut by at most windows - 1 window edges besides its chunks."""
    hkv, rows_plus_one = schedule.k2q_row_ptr.shape
    windows = -(-max(total_q, 1) // window)
    return schedule.work_capacity + hkv * (rows_plus_one - 1) * (windows - 1)


def split_items_by_query_window(schedule: SparseAttentionSchedule,
                                k2q_q_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                window: int) -> SparseAttentionSchedule:
    """The schedule's work items cut at query windows of ``window`` queries and ordered
    (KV head, window, CSR row): the items a grid runs at once then TMA-gather the query rows of
    one KV head's window instead of the whole chunk's Q; the lab's item-order experiment
    (benchmarks/lab/sparse_item_order.py; measured in docs/design-production-prefill.md, "Item
    order"; nothing serves it). Items are independent and a slot is the rank of a row among its
    query's rows, so every order gives the same O and LSE bit for bit.

    Tensor ops on the schedule's device, no host synchronization (capture-safe); the capacity
    is :func:`window_capacity`. A query id's window is taken as the running maximum along its
    CSR row, so rows of unsorted ids (an unchecked caller's CSR) still fit the capacity: every
    entry stays in exactly one item, only the grouping loosens.
    """
    if window < 1:
        raise ValueError(f"window: needs >= 1 queries, got {window}")
    i64 = torch.int64
    meta = schedule.scheduler_metadata.to(i64)
    device = meta.device
    row_ptr = schedule.k2q_row_ptr.to(i64)
    hkv, n = k2q_q_indices.shape
    total_rows = row_ptr.shape[1] - 1
    total_q = schedule.split_counts.shape[0]
    windows = -(-max(total_q, 1) // window)
    capacity = window_capacity(schedule, total_q, window)
    items = meta.shape[0]
    head, row, q_begin, q_count = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3]
    live = (torch.arange(items, device=device) < schedule.work_count.to(i64)) & (q_count > 0)
    start = row_ptr[head.clamp(0, hkv - 1), row.clamp(0, total_rows)] + q_begin

    # The item covering each entry: its start marked, then carried forward along the entries.
    flat = hkv * n
    marks = torch.full((flat + 1,), -1, dtype=i64, device=device)
    marks.scatter_(0, torch.where(live, head * n + start, torch.full_like(start, flat)),
                   torch.arange(items, device=device, dtype=i64))
    positions = torch.arange(flat, device=device, dtype=i64)
    last_mark = torch.where(marks[:flat] >= 0, positions, torch.full_like(positions, -1))
    last_mark = torch.cummax(last_mark, 0).values
    item = torch.where(last_mark >= 0, marks[last_mark.clamp_min(0)], torch.zeros_like(last_mark))
    pos = positions % n
    covered = (last_mark >= 0) & (pos - start[item] < q_count[item]) & (pos >= start[item])

    # Each entry's window, kept monotone along its (head, row) segment.
    cu_q = cu_seqlens_q.to(i64)
    batch = meta[:, 4].clamp(0, cu_q.numel() - 2)
    q_abs = (cu_q[batch[item]] + k2q_q_indices.reshape(-1).to(i64)).clamp(0, max(total_q - 1, 0))
    segment = (positions // n) * (total_rows + 1) + row[item]
    w = torch.cummax(torch.where(covered, segment * windows + q_abs // window,
                                 torch.zeros_like(q_abs)), 0).values - segment * windows
    w = w.clamp(0, windows - 1)

    # A piece starts at an item's start or where the window changes inside the item.
    prev_w = torch.cat([w.new_full((1,), -1), w[:-1]])
    starts = covered & ((pos == start[item]) | (w != prev_w))
    piece = torch.cumsum(starts.to(i64), 0) - 1
    piece = torch.where(covered, piece.clamp(0, capacity - 1), torch.full_like(piece, capacity))
    counts = torch.zeros(capacity + 1, dtype=i64, device=device).scatter_add_(
        0, piece, torch.ones_like(piece))[:capacity]
    first = torch.full((capacity + 1,), flat, dtype=i64, device=device).scatter_(
        0, torch.where(starts, piece, torch.full_like(piece, capacity)), positions)[:capacity]
    used = counts > 0
    first_item = item[first.clamp_max(flat - 1)]
    pieces = torch.stack([head[first_item], row[first_item],
                          q_begin[first_item] + (first % n) - start[first_item], counts,
                          meta[first_item, 4], meta[first_item, 5]], 1)
    key = torch.where(used, (first // n * windows + w[first.clamp_max(flat - 1)]) * (n + 1)
                      + first % n, torch.full_like(first, torch.iinfo(i64).max))
    order = torch.sort(key).indices
    new_meta = torch.where(used[order].view(-1, 1), pieces[order], torch.zeros_like(pieces))
    return dataclasses.replace(
        schedule, scheduler_metadata=new_meta.to(torch.int32).contiguous(),
        work_count=starts.sum().clamp_max(capacity).view(1).to(torch.int32))
