"""Work scheduling of the dense FMHA kernels: a request's bounds, the key blocks a query tile
streams, and the persistent CTAs' walk over (query tile, head, request) work items."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .geometry import BLOCK_N


@cute.jit
def request_bounds(mQ, mCuQ, mCuK, mKvLens, mOffset, mPageTable, request, key_rows,
                   paged: cutlass.Constexpr, tile_m: cutlass.Constexpr):
    """(q_start, q_len, kv_len, offset, k_row0, n_q_tiles) of one request of the dense FMHA
    (n_q_tiles: its tile_m-query tiles), every index clamped to the tensor it addresses: query
    rows to q, dense key rows to the key_rows of k, paged key lengths to the page table's
    width."""
    total_q = mQ.shape[0]
    q_start = cutlass.max(cutlass.min(mCuQ[request], total_q), 0)
    q_len = cutlass.min(mCuQ[request + 1], total_q) - q_start
    kv_len = mKvLens[request]
    offset = mOffset[request]
    k_row0 = cutlass.Int32(0)
    if cutlass.const_expr(not paged):
        k_row0 = cutlass.max(mCuK[request], 0)
        kv_len = cutlass.min(kv_len, key_rows - k_row0)
    else:
        kv_len = cutlass.min(kv_len, mPageTable.shape[1] * BLOCK_N)
    n_q_tiles = (q_len + tile_m - 1) // tile_m
    return q_start, q_len, kv_len, offset, k_row0, n_q_tiles



@cute.jit
def tile_key_blocks(walk, n_q_tiles, q_len, kv_len, offset, causal, tile_m: cutlass.Constexpr):
    """(first local query, number of key blocks) of the walk-th tile_m-query tile a CTA takes:
    the last (heaviest) tiles first, keys [0, kv_end) visible to some query of the tile."""
    q_lo = (n_q_tiles - 1 - walk) * tile_m
    kv_end = kv_len
    if causal != 0:
        kv_end = cutlass.min(kv_end, cutlass.min(q_lo + tile_m, q_len) + offset)
    return q_lo, cutlass.max((kv_end + BLOCK_N - 1) // BLOCK_N, 0)


def persistent_item(w, n_heads, n_requests):
    """Persistent work item w -> (query tile rank: 0 is the request's heaviest, head,
    request), rank-major: every head's heaviest tile comes before any lighter one, so the
    heavy causal tiles spread over all CTAs first (the non-persistent grid's head-major order
    balances worse), and the heads of one KV head stay adjacent (their K / V share L2)."""
    per_rank = n_heads * n_requests
    rank = w // per_rank
    rest = w - rank * per_rank
    return rank, rest % n_heads, rest // n_heads


def persistent_rounds(n_items, grid_x):
    """Rounds of grid_x items (the last one partial)."""
    return (n_items + grid_x - 1) // grid_x


def snake_item(rnd, cta_x, grid_x):
    """The item CTA cta_x takes in round rnd, boustrophedon (even rounds ascending, odd ones
    descending): with the items heaviest first, a CTA that took a heavy item takes a light one
    next (causal 4k, 1024 items on 132 CTAs: the busiest CTA streams the mean number of blocks,
    where w = cta_x + rnd * grid_x gives it 1.125x)."""
    return rnd * grid_x + cta_x + (rnd & 1) * (grid_x - 1 - 2 * cta_x)
