"""The k2q CSR's row layout (contract §1.1): one row per (request b, KV block beta), packed
round-robin: every request's block 0, then every request's block 1, ..., skipping requests that
have no such block. Host-side (lists and CPU tensors); imports only torch, so the validation,
the references and the schedules share it.
"""

from __future__ import annotations

from typing import List, Tuple

import torch


def rows_per_request(cu_seqlens_k: torch.Tensor, kv_block_size: int) -> List[int]:
    """ceil(k_len_b / kv_block_size) for every request b (host list)."""
    cu = cu_seqlens_k.to("cpu", torch.int64)
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    return ((lens + kv_block_size - 1) // kv_block_size).tolist()


def packed_row_index(rows_b: List[int]) -> torch.Tensor:
    """[B, max_rows] int64 map (b, beta) -> CSR row, -1 where request b has no block beta."""
    batch = len(rows_b)
    max_rows = max(rows_b, default=0)
    table = torch.full((batch, max_rows), -1, dtype=torch.int64)
    rows = torch.tensor(rows_b, dtype=torch.int64)
    next_row = 0
    for beta in range(max_rows):
        active = torch.nonzero(rows > beta).flatten()
        table[active, beta] = torch.arange(next_row, next_row + active.numel())
        next_row += active.numel()
    return table


def packed_row_owner(rows_b: List[int]) -> List[Tuple[int, int]]:
    """The inverse map: CSR row -> (request b, block beta)."""
    owners = []
    for beta in range(max(rows_b, default=0)):
        owners.extend((b, beta) for b, r in enumerate(rows_b) if r > beta)
    return owners


def exact_total_rows(cu_seqlens_k: torch.Tensor, kv_block_size: int = 128) -> int:
    return int(sum(rows_per_request(cu_seqlens_k, kv_block_size)))


def safe_total_rows(total_k: int, batch: int, kv_block_size: int = 128) -> int:
    """An upper bound on the CSR row count that needs no device read (contract D9)."""
    return (total_k + batch * (kv_block_size - 1)) // kv_block_size
