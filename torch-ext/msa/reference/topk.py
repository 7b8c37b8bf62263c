"""Exact PyTorch reference of ``sparse_topk_select`` (contract §2.3 plus the fork extensions).

Per output row (query t, output head h), with scores ``s[k]`` (k = block id in [0, K)):

* ``end`` = the number of eligible blocks: ``num_valid_pages`` (the int, or entry t of the per-query
  tensor), further capped to ``causal_end_block[t] + 1`` when that is given, clamped to [0, K].
  Only ids < ``end`` are ever emitted.
* forced set ``F = ({0..fb-1} ∪ {end-fe..end-1}) ∩ [0, end)``: always emitted, whatever its score.
* fill: the ``topk - |F|`` best eligible non-forced blocks by score, largest first, ties broken
  towards the lower block id; blocks whose score is -inf (or NaN) are never filled in.
* output: the selected ids in ascending order, then -1 up to ``topk`` (never inside the prefix).

The selection is exact and deterministic. A candidate's rank is the int64 key
``order-preserving score bits << 24 | (2^24 - 1 - id)``: unique per block, so sorting by it
settles every tie towards the lower id (forced ids are added separately). To stay fast on long rows, one
``torch.topk`` per query chunk first takes a short candidate list per row; rows whose answer
provably lies inside that list are finished on the list, the rest (ties straddling its edge, NaN)
rerun on their whole row. Work is chunked over queries, so scratch stays at tens of MB whatever
T is, and the input is never modified.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

ID_BITS = 24                      # block ids must be < 2^24 (K up to 16.7M tiles)
MAX_TILES = 1 << ID_BITS
_ID_MASK = MAX_TILES - 1
# Score elements ([H, K, T_chunk]) handled per query chunk.
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
      max_score: [H, K, T] float scores (any layout; read chunk by chunk, never modified).
      topk: slots per row (any positive int).
      num_valid_pages: None (= K), an int, or a [T] integer tensor (per query; clamped to [0, K]).
      force_begin_blocks, force_end_blocks: fb, fe >= 0.
      causal_end_block: optional [T] integer tensor; caps the eligible ids at causal_end_block[t]
        and anchors the force_end window there.
      head_reduce / num_out_heads: optional GQA reduction ("max" or "sum") to num_out_heads rows.
      out: optional [T, H_out, topk] int32 buffer to fill (returned), any strides.
    Returns [T, H_out, topk] int32 on max_score's device.

    How: one ``torch.topk`` over the block axis of each query chunk finds a short candidate list
    L (topk + fb + fe + 1 entries) per row. When L provably contains every block that can win a
    fill slot (the r-th best fillable score is strictly above L's minimum, or L already reaches
    -inf), ties inside L are settled exactly with the int64 keys; the remaining rows (ties that
    straddle L's edge, NaN, many finite ineligible scores) rerun on their full rows with the keys.
    """
    num_heads, num_tiles, total_q = max_score.shape
    out_heads = num_heads if head_reduce is None else num_out_heads
    device = max_score.device
    if out is None:
        out = torch.empty(total_q, out_heads, topk, dtype=torch.int32, device=device)
    if total_q == 0:
        return out
    fb, fe = int(force_begin_blocks), int(force_end_blocks)
    per_query_end = causal_end_block is not None or isinstance(num_valid_pages, torch.Tensor)
    # With one global end, ids >= end are simply sliced away; otherwise they are filtered.
    if per_query_end:
        columns = num_tiles
    else:
        columns = num_tiles if num_valid_pages is None else min(int(num_valid_pages), num_tiles)
    chunk = max(1, _CHUNK_ELEMENTS // (num_heads * max(columns, 1)))
    for t0 in range(0, total_q, chunk):
        t1 = min(total_q, t0 + chunk)
        n = t1 - t0
        scores = reduce_heads(max_score[:, :columns, t0:t1], head_reduce, out_heads)
        end = _eligible_end(num_valid_pages, causal_end_block, num_tiles, t0, t1, device)
        end = end.view(n, 1).expand(n, out_heads).reshape(-1)            # per row
        if columns == 0:
            out[t0:t1].fill_(-1)
            continue
        width = min(topk + fb + fe + 1, columns)
        cand_val, cand_id = scores.topk(width, dim=1, sorted=False)  # [H_out, width, n]
        # Order each short list by value, descending (NaN first, as topk ranks it).
        cand_val, order = cand_val.permute(2, 0, 1).reshape(-1, width).sort(dim=1, descending=True)
        cand_id = cand_id.permute(2, 0, 1).reshape(-1, width).gather(1, order)
        result, unresolved = _select_from_candidates(cand_val, cand_id, end, fb, fe, topk,
                                                     complete=(width == columns))
        if bool(unresolved.any()):
            which = torch.nonzero(unresolved).flatten()
            token, head = which // out_heads, which % out_heads
            full_rows = scores[head, :, token]                         # [m, columns]
            result[which] = _select_rows_exact(full_rows, end[which], fb, fe, topk)
        out[t0:t1].copy_(result.view(n, out_heads, topk))    # any row layout of `out`
    return out


def _forced_ids(end: torch.Tensor, fb: int, fe: int) -> torch.Tensor:
    """[R, fb+fe] int64: the forced ids of each row, MAX_TILES where a slot holds none.
    The force_end window skips ids already in the force_begin prefix (no duplicates)."""
    device = end.device
    begin = torch.arange(fb, device=device).view(1, -1).expand(end.numel(), fb)
    begin = torch.where(begin < end.view(-1, 1), begin, MAX_TILES)
    window = end.view(-1, 1) - fe + torch.arange(fe, device=device).view(1, -1)
    window = torch.where((window >= fb) & (window >= 0), window, MAX_TILES)
    return torch.cat([begin, window], dim=1)


def _assemble(forced: torch.Tensor, fill: torch.Tensor, topk: int) -> torch.Tensor:
    """Forced and fill ids (MAX_TILES = none) -> [R, topk] ascending, -1 tail."""
    ids = torch.cat([forced, fill], dim=1).sort(dim=1).values
    if ids.shape[1] < topk:
        pad = torch.full((ids.shape[0], topk - ids.shape[1]), MAX_TILES, dtype=ids.dtype,
                         device=ids.device)
        ids = torch.cat([ids, pad], dim=1)
    ids = ids[:, :topk]
    return torch.where(ids == MAX_TILES, -1, ids)


def _best_fill(values: torch.Tensor, ids: torch.Tensor, fillable: torch.Tensor,
               needed: torch.Tensor, topk: int) -> torch.Tensor:
    """The `needed` (per row) best fillable entries, ties to the lower id: [R, <=topk] ids,
    MAX_TILES where unused. values/ids/fillable are [R, W] candidate lists."""
    key = torch.where(fillable, (order_preserving_code(values) << ID_BITS) | (_ID_MASK - ids), -1)
    take = min(topk, key.shape[1])
    best = key.topk(take, dim=1, sorted=True).values                 # unique keys: exact order
    slot = torch.arange(take, device=key.device).view(1, -1)
    keep = (best >= 0) & (slot < needed.view(-1, 1))
    return torch.where(keep, _ID_MASK - (best & _ID_MASK), MAX_TILES)


def _is_fillable(values, ids, end, fb, fe):
    end = end.view(-1, 1)
    forced = (ids < fb) | (ids >= end - fe)
    return (ids < end) & ~forced & (values > float("-inf"))


def _select_from_candidates(cand_val, cand_id, end, fb, fe, topk, *, complete):
    """Selection from each row's candidate list; returns (ids [R, topk] int64, unresolved [R])."""
    forced = _forced_ids(end, fb, fe)
    needed = topk - (forced != MAX_TILES).sum(dim=1)
    fillable = _is_fillable(cand_val, cand_id, end, fb, fe)
    result = _assemble(forced, _best_fill(cand_val, cand_id, fillable, needed, topk), topk)
    if complete:                  # the list is the whole row: nothing can hide outside it
        return result, torch.zeros_like(needed, dtype=torch.bool)
    # Value of the needed-th best fillable candidate (by value; ties do not change the value).
    fill_rank = torch.cumsum(fillable.to(torch.int64), dim=1)
    found = fill_rank[:, -1]
    at_needed = (fill_rank == needed.view(-1, 1)) & fillable
    first = torch.argmax(at_needed.to(torch.int8), dim=1, keepdim=True)
    threshold = cand_val.gather(1, first).flatten()
    floor = cand_val[:, -1]                  # every block outside the list scores <= floor
    decided_full = (found >= needed) & (threshold > floor)
    decided_short = (found < needed) & (floor == float("-inf"))
    unresolved = (needed > 0) & ~(decided_full | decided_short)
    return result, unresolved


def _select_rows_exact(rows: torch.Tensor, end: torch.Tensor, fb: int, fe: int, topk: int
                       ) -> torch.Tensor:
    """The same selection over whole rows [R, C] (ids = column index): [R, topk] int64."""
    ids = torch.arange(rows.shape[1], device=rows.device).view(1, -1).expand_as(rows)
    forced = _forced_ids(end, fb, fe)
    needed = topk - (forced != MAX_TILES).sum(dim=1)
    fillable = _is_fillable(rows, ids, end, fb, fe)
    return _assemble(forced, _best_fill(rows, ids, fillable, needed, topk), topk)


def _eligible_end(num_valid_pages, causal_end_block, num_tiles, t0, t1, device) -> torch.Tensor:
    """[n] int64: the count of eligible block ids of each query in [t0, t1)."""
    if num_valid_pages is None:
        end = torch.full((t1 - t0,), num_tiles, dtype=torch.int64, device=device)
    elif isinstance(num_valid_pages, torch.Tensor):
        end = num_valid_pages.reshape(-1)[t0:t1].to(device, torch.int64)
    else:
        end = torch.full((t1 - t0,), int(num_valid_pages), dtype=torch.int64, device=device)
    if causal_end_block is not None:
        end = torch.minimum(end, causal_end_block.reshape(-1)[t0:t1].to(device, torch.int64) + 1)
    return end.clamp(0, num_tiles)
