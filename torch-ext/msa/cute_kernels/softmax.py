"""Softmax building blocks: masking a score row, quad / warp group reductions, the online
softmax of the dense FMHA's block loop (with the optional per-block max-score output)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .geometry import BLOCK_N
from .mma import wgmma_rows_cols_view


@cute.jit
def mask_row_and_max(s_rc: cute.Tensor, row: cutlass.Constexpr, coords: cute.Tensor,
                     n_cols: cutlass.Constexpr, visible_end: cutlass.Int32,
                     full_width: cutlass.Constexpr) -> cutlass.Float32:
    """Set the scores of columns >= visible_end in row `row` of s_rc (a rows x cols view of an
    accumulator; `coords` the matching identity view) to -inf and return the row's max over
    this thread's columns. A select per element, never an `if` around the element store: a
    dynamic `if` carries the whole fragment through the branch, which ptxas turned into
    quadratic FSEL chains (1058 FSEL per 64-element tile row pair, half the kernel's issue)."""
    row_max = -cutlass.Float32.inf
    if visible_end < full_width:
        for j in cutlass.range_constexpr(n_cols):
            s = cutlass.select_(coords[0, j][1] >= visible_end, -cutlass.Float32.inf,
                                s_rc[row, j])
            s_rc[row, j] = s
            row_max = cute.arch.fmax(row_max, s)
    else:
        for j in cutlass.range_constexpr(n_cols):
            row_max = cute.arch.fmax(row_max, s_rc[row, j])
    return row_max


@cute.jit
def group_max(value: cutlass.Float32, lanes: cutlass.Constexpr) -> cutlass.Float32:
    """Max over each aligned group of `lanes` lanes (a power of two <= 32; every lane of the
    group gets the result). Every lane of the warp must execute it."""
    for i in cutlass.range_constexpr(lanes.bit_length() - 1):
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=(lanes >> 1) >> i))
    return value


@cute.jit
def group_sum(value: cutlass.Float32, lanes: cutlass.Constexpr) -> cutlass.Float32:
    """Sum over each aligned group of `lanes` lanes (as group_max)."""
    for i in cutlass.range_constexpr(lanes.bit_length() - 1):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=(lanes >> 1) >> i)
    return value


@cute.jit
def quad_max(value: cutlass.Float32) -> cutlass.Float32:
    """Max over the 4 lanes of a quad (the lanes that share an accumulator row)."""
    return group_max(value, 4)


@cute.jit
def quad_sum(value: cutlass.Float32) -> cutlass.Float32:
    """Sum over the 4 lanes of a quad."""
    return group_sum(value, 4)



@cute.jit
def store_max_score(mMaxScore: cute.Tensor, score_scale: cutlass.Float32,
                    blk_max: cutlass.Float32, head: cutlass.Int32, blk: cutlass.Int32,
                    q_start: cutlass.Int32, q_local: cutlass.Int32, q_len: cutlass.Int32,
                    lane: cutlass.Int32):
    """max_score[head, blk, query] = score_scale * (the row's max over the block's visible
    keys), -inf where none is visible; one lane of the quad that shares the row writes.
    Blocks the tile never streams keep the caller's -inf fill."""
    if lane % 4 == 0 and q_local < q_len and blk < mMaxScore.shape[1]:
        value = blk_max * score_scale
        if blk_max == -cutlass.Float32.inf:
            value = -cutlass.Float32.inf
        mMaxScore[head, blk, q_start + q_local] = value


@cute.jit
def online_softmax(acc_s: cute.Tensor, blk: cutlass.Int32, row_max: cute.Tensor,
                   row_sum: cute.Tensor, tScS: cute.Tensor, wg_q0: cutlass.Int32,
                   kv_len: cutlass.Int32, offset: cutlass.Int32, causal: cutlass.Int32,
                   scale_log2: cutlass.Float32, o_rc=None, corr=None, max_score=None,
                   mask: cutlass.Constexpr = True):
    """S of key block `blk` -> P = exp2(S * scale_log2 - new max) in place (masked keys 0); the
    running max and sum move on. The correction exp2(old max - new max) rescales the O
    accumulator rows o_rc here, or is left in corr[i] for the caller to apply (the
    warp-specialized kernel, whose previous P V may still be in flight). With max_score =
    (mMaxScore, score_scale, head, q_start, q_len, lane), each row's scaled max over the block's
    visible keys is stored too (store_max_score). mask=False: every row sees the whole block.
    row_sum=None: the caller sums P elsewhere (the e4m3 forms that add P times a ones tile on
    the tensor core, FmhaSm90Ws's mma_row_sum)."""
    key0 = blk * BLOCK_N
    s_rc = wgmma_rows_cols_view(acc_s)
    n_my_cols = cute.size(tScS, mode=[1])
    for i in cutlass.range_constexpr(cute.size(tScS, mode=[0])):
        q_local = wg_q0 + tScS[i, 0][0]
        visible_end = BLOCK_N                           # block keys [0, end) visible
        if cutlass.const_expr(mask):                    # (else the caller knows: all of them)
            visible_end = kv_len - key0
            if causal != 0:
                visible_end = cutlass.min(visible_end, q_local + offset - key0 + 1)
        blk_max = quad_max(mask_row_and_max(s_rc, i, tScS, n_my_cols, visible_end, BLOCK_N))
        if cutlass.const_expr(max_score is not None):
            mMaxScore, score_scale, head, q_start, q_len, lane = max_score
            store_max_score(mMaxScore, score_scale, blk_max, head, blk, q_start, q_local,
                            q_len, lane)
        new_max = cute.arch.fmax(row_max[i], blk_max * scale_log2)
        base = new_max
        if new_max == -cutlass.Float32.inf:
            base = 0.0                                  # nothing visible yet: p = 0
        correction = cute.math.exp2(row_max[i] - base, fastmath=True)
        row_max[i] = new_max
        part = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(n_my_cols):
            p = cute.math.exp2(s_rc[i, j] * scale_log2 - base, fastmath=True)
            if cutlass.const_expr(row_sum is not None):
                part = part + p
            s_rc[i, j] = p
        if cutlass.const_expr(row_sum is not None):
            row_sum[i] = row_sum[i] * correction + part
        if cutlass.const_expr(o_rc is not None):
            for j in cutlass.range_constexpr(n_my_cols):
                o_rc[i, j] = o_rc[i, j] * correction
        else:
            corr[i] = correction

