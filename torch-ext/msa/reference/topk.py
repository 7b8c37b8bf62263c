"""Exact PyTorch reference of ``sparse_topk_select`` (contract §2.3 plus the fork extensions).

Per output row (query t, output head h), with scores ``s[k]`` (k = block id in [0, K)):

* ``end`` = the number of eligible blocks: ``num_valid_pages`` (the int, or entry t of the per-query
  tensor), further capped to ``causal_end_block[t] + 1`` when that is given, clamped to [0, K].
  Only ids < ``end`` are ever emitted.
* forced set ``F = ({0..fb-1} ∪ {end-fe..end-1}) ∩ [0, end)``: always emitted, whatever its score.
* fill: the ``topk - |F|`` best eligible non-forced blocks by score, largest first, ties broken
  towards the lower block id; blocks whose score is -inf (or NaN) are never filled in.
* output: the selected ids in ascending order, then -1 up to ``topk`` (never inside the prefix).

The selection is exact and deterministic: each candidate gets a unique int64 key
``(rank class or order-preserving score bits) << 24 | (2^24 - 1 - id)``, so one ``torch.topk`` on
the keys picks exactly the set above with no tie ambiguity. Work is chunked over queries so the
scratch stays around a few tens of MB whatever T is.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

ID_BITS = 24                      # block ids must be < 2^24 (K up to 16.7M tiles)
MAX_TILES = 1 << ID_BITS
_ID_MASK = MAX_TILES - 1
_FORCED_CLASS = 1 << 32           # above every order-preserving fp32 code (< 2^32)
# Elements of one [T_chunk, H, K] scratch slice; the int64 keys of a chunk take 8x this in bytes.
_CHUNK_ELEMENTS = 1 << 21


def order_preserving_code(x: torch.Tensor) -> torch.Tensor:
    """Maps fp32 values to int64 codes in [0, 2^32) with the same total order (-0.0 == +0.0).

    Negative floats have their bits flipped, non-negative ones get the sign bit set, the classic
    radix-sort trick; adding 0.0 first turns -0.0 into +0.0 so equal values share a code.
    """
    bits = (x.float() + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -1 - bits, bits + (1 << 31))


def reduce_heads(scores: torch.Tensor, head_reduce: Optional[str], num_out_heads: int
                 ) -> torch.Tensor:
    """[H, K, n] -> [num_out_heads, K, n]: consecutive groups of H/num_out_heads heads, reduced by
    max, or by an fp32 sum taken in ascending head order (a -inf in any head makes the sum -inf)."""
    if head_reduce is None:
        return scores
    h, k, n = scores.shape
    grouped = scores.reshape(num_out_heads, h // num_out_heads, k, n)
    if head_reduce == "max":
        return grouped.amax(1)
    acc = grouped[:, 0].clone()
    for g in range(1, grouped.shape[1]):   # fixed left-to-right order: reproducible sums
        acc += grouped[:, g]
    return acc


def sparse_topk_select_reference(max_score: torch.Tensor, topk: int, *,
                                 num_valid_pages: Union[int, torch.Tensor, None] = None,
                                 force_begin_blocks: int = 0, force_end_blocks: int = 0,
                                 causal_end_block: Optional[torch.Tensor] = None,
                                 head_reduce: Optional[str] = None,
                                 num_out_heads: Optional[int] = None,
                                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Selection per the module docstring.

    Args:
      max_score: [H, K, T] float scores (any layout; read chunk by chunk).
      topk: slots per row (any positive int).
      num_valid_pages: None (= K), an int, or a [T] integer tensor (per query; clamped to [0, K]).
      force_begin_blocks, force_end_blocks: fb, fe >= 0.
      causal_end_block: optional [T] integer tensor; caps the eligible ids at causal_end_block[t]
        and anchors the force_end window there.
      head_reduce / num_out_heads: optional GQA reduction ("max" or "sum") to num_out_heads rows.
      out: optional [T, H_out, topk] int32 buffer to fill (returned).
    Returns [T, H_out, topk] int32 on max_score's device.
    """
    num_heads, num_tiles, total_q = max_score.shape
    out_heads = num_heads if head_reduce is None else num_out_heads
    device = max_score.device
    if out is None:
        out = torch.empty(total_q, out_heads, topk, dtype=torch.int32, device=device)
    width = min(topk, num_tiles)
    if total_q == 0:
        return out
    if width < topk:
        out[..., width:] = -1

    ids = torch.arange(num_tiles, device=device, dtype=torch.int64)
    id_code = _ID_MASK - ids                       # lower id -> larger code: lower id wins ties
    sentinel = MAX_TILES                           # sorts empty slots behind every real id
    chunk = max(1, _CHUNK_ELEMENTS // (num_heads * num_tiles))
    for t0 in range(0, total_q, chunk):
        t1 = min(total_q, t0 + chunk)
        scores = reduce_heads(max_score[:, :, t0:t1], head_reduce, out_heads)
        scores = scores.permute(2, 0, 1)                      # [n, H_out, K]
        end = _eligible_end(num_valid_pages, causal_end_block, num_tiles, t0, t1, device)
        eligible = ids < end
        forced = eligible & ((ids < force_begin_blocks) | (ids >= end - force_end_blocks))
        fillable = eligible & ~forced & (scores > float("-inf"))   # NaN compares False
        rank = torch.where(forced, _FORCED_CLASS, order_preserving_code(scores))
        key = torch.where(forced | fillable, (rank << ID_BITS) | id_code, -1)
        best = key.topk(width, dim=-1, sorted=False).values
        chosen = torch.where(best >= 0, _ID_MASK - (best & _ID_MASK), sentinel)
        chosen = chosen.sort(dim=-1).values
        out[t0:t1, :, :width] = torch.where(chosen == sentinel, -1, chosen).to(torch.int32)
    return out


def _eligible_end(num_valid_pages, causal_end_block, num_tiles, t0, t1, device) -> torch.Tensor:
    """[n, 1, 1] int64: the count of eligible block ids of each query in [t0, t1)."""
    if num_valid_pages is None:
        end = torch.full((t1 - t0,), num_tiles, dtype=torch.int64, device=device)
    elif isinstance(num_valid_pages, torch.Tensor):
        end = num_valid_pages[t0:t1].to(device, torch.int64)
    else:
        end = torch.full((t1 - t0,), int(num_valid_pages), dtype=torch.int64, device=device)
    if causal_end_block is not None:
        end = torch.minimum(end, causal_end_block[t0:t1].to(device, torch.int64) + 1)
    return end.clamp(0, num_tiles).view(-1, 1, 1)
