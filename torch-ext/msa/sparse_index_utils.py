"""q2k <-> k2q index conversions and the exact reference of the k2q CSR builder.

Terms (contract §0, §1.1):
  q2k_indices    [Hkv, total_q, topK] int32: per query and KV head, the selected batch-local
                 KV block ids; -1 marks an empty slot anywhere in the row.
  k2q_row_ptr    [Hkv, total_rows + 1] int32: exclusive prefix over CSR rows.
  k2q_q_indices  [Hkv, >= total_q * topK] int32: batch-local query ids, ascending within a row;
                 entries past row_ptr[h, -1] are -1 here (unspecified in native builders).

A CSR row is one (request b, KV block beta). Rows are packed round-robin: every request's
block 0, then every request's block 1, ..., skipping requests that have no such block.

These helpers read device tensors on the host: they are for tests, references and offline
preprocessing, never for a capture-safe hot path.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._validation import check_cu_seqlens, check_same_device, check_tensor
# The row layout lives with the schedules; its helpers stay importable from here for clients.
from .schedules.csr_rows import (exact_total_rows, packed_row_index,  # noqa: F401
                                 packed_row_owner, rows_per_request, safe_total_rows)


def build_k2q_csr_torch_reference(q2k_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                  cu_seqlens_k: torch.Tensor, kv_block_size: int = 128, *,
                                  total_rows: Optional[int] = None
                                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference q2k -> k2q CSR conversion (contract §1.1), exact to the native builders.

    Args:
      q2k_indices: [Hkv, total_q, topK] int32, batch-local block ids, -1 = empty slot.
      cu_seqlens_q, cu_seqlens_k: [B+1] int32 prefix sums (same device as q2k_indices).
      kv_block_size: tokens per KV block (128).
      total_rows: number of CSR rows to emit; default the exact count. Extra rows stay empty,
        rows past it are dropped (as the runtime builders do).

    Returns (k2q_row_ptr [Hkv, total_rows+1], k2q_q_indices [Hkv, total_q*topK]) int32, on the
    device of q2k_indices; the q-index tail past row_ptr[h, -1] is -1.

    Raises ValueError for a block id >= ceil(k_len_b / kv_block_size) (the runtime builders
    drop such ids silently) and for a q2k whose second dim differs from cu_seqlens_q[-1].
    """
    check_tensor("q2k_indices", q2k_indices, dtypes=(torch.int32,), ndim=3)
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    check_same_device(q2k_indices=q2k_indices, cu_seqlens_q=cu_seqlens_q)
    if kv_block_size <= 0:
        raise ValueError(f"kv_block_size: must be > 0, got {kv_block_size}")
    device = q2k_indices.device
    hkv, total_q, topk = q2k_indices.shape
    cu_q = cu_seqlens_q.to("cpu", torch.int64)
    if int(cu_q[-1]) != total_q:
        raise ValueError(f"q2k_indices: dim 1 is {total_q} but cu_seqlens_q[-1] is {int(cu_q[-1])}")
    rows_b = rows_per_request(cu_seqlens_k, kv_block_size)
    n_rows = sum(rows_b) if total_rows is None else int(total_rows)
    row_of = packed_row_index(rows_b)

    q2k = q2k_indices.to("cpu", torch.int64)
    batch = cu_q.numel() - 1
    # Request of every query and its batch-local id.
    q_batch = torch.repeat_interleave(torch.arange(batch), cu_q[1:] - cu_q[:-1])
    q_local = torch.arange(total_q) - cu_q[q_batch]
    valid = q2k >= 0
    if valid.any():
        rows_t = torch.tensor(rows_b, dtype=torch.int64)
        limit = rows_t[q_batch].view(1, total_q, 1).expand_as(q2k)
        bad = valid & (q2k >= limit)
        if bad.any():
            h, q, s = [int(x) for x in torch.nonzero(bad)[0]]
            b = int(q_batch[q])
            raise ValueError(f"q2k_indices: block {int(q2k[h, q, s])} at [{h}, {q}, {s}] is out of "
                             f"range for request {b}, which has {rows_b[b]} blocks")
    row_ptr = torch.zeros(hkv, n_rows + 1, dtype=torch.int64)
    q_idx = torch.full((hkv, total_q * topk), -1, dtype=torch.int64)
    if total_q and topk and row_of.numel():
        safe_block = torch.where(valid, q2k, 0)
        row = row_of[q_batch.view(1, -1, 1).expand_as(q2k), safe_block]
        keep = valid & (row < n_rows)
        for h in range(hkv):
            r = row[h][keep[h]]
            ql = q_local.view(-1, 1).expand(total_q, topk)[keep[h]]
            order = torch.argsort(r * (total_q + 1) + ql, stable=True)
            q_idx[h, : r.numel()] = ql[order]
            row_ptr[h, 1:] = torch.bincount(r, minlength=n_rows)[:n_rows].cumsum(0)
    return row_ptr.to(device, torch.int32), q_idx.to(device, torch.int32)


def q2k_to_k2q(q2k_indices: torch.Tensor, num_kv_blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense inverse of a fixed-length batch layout.

    q2k_indices [B, Hkv, Sq, topK] int32 (-1 padded) -> (k2q_indices [B, Hkv, num_kv_blocks, Sq]
    int32, query ids ascending and left-packed, -1 padded; k2q_counts [B, Hkv, num_kv_blocks]).
    Ids outside [0, num_kv_blocks) are ignored.
    """
    check_tensor("q2k_indices", q2k_indices, dtypes=(torch.int32,), ndim=4)
    b, h, sq, topk = q2k_indices.shape
    ids = q2k_indices.long()
    hit = torch.zeros(b, h, num_kv_blocks, sq, dtype=torch.bool, device=q2k_indices.device)
    ok = (ids >= 0) & (ids < num_kv_blocks)
    bi, hi, qi, si = torch.nonzero(ok, as_tuple=True)
    hit[bi, hi, ids[bi, hi, qi, si], qi] = True
    counts = hit.sum(-1, dtype=torch.int32)
    # Stable sort of "not hit" puts hit query ids first, in ascending order.
    order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)
    k2q = torch.where(torch.arange(sq, device=hit.device) < counts.unsqueeze(-1), order, -1)
    return k2q.to(torch.int32), counts


def k2q_to_q2k(k2q_indices: torch.Tensor, k2q_counts: torch.Tensor, Sq: int, topK: int
               ) -> torch.Tensor:
    """Inverse of :func:`q2k_to_k2q`: [B, Hkv, Sq, topK] int32, block ids ascending, -1 tail.
    A query that appears in more than topK blocks keeps its topK lowest block ids."""
    b, h, nblk, width = k2q_indices.shape
    device = k2q_indices.device
    valid = torch.arange(width, device=device) < k2q_counts.unsqueeze(-1).long()
    valid &= (k2q_indices >= 0) & (k2q_indices < Sq)
    hit = torch.zeros(b, h, Sq, nblk, dtype=torch.bool, device=device)
    bi, hi, ki, wi = torch.nonzero(valid, as_tuple=True)
    hit[bi, hi, k2q_indices[bi, hi, ki, wi].long(), ki] = True
    n = hit.sum(-1)
    order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)[..., :topK]
    if order.shape[-1] < topK:
        pad = torch.zeros(b, h, Sq, topK - order.shape[-1], dtype=order.dtype, device=device)
        order = torch.cat([order, pad], -1)
    keep = torch.arange(topK, device=device) < n.unsqueeze(-1)
    return torch.where(keep, order, -1).to(torch.int32)
