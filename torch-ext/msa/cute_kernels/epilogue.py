"""The dense FMHA's O epilogue: normalize a warpgroup's accumulator rows, stage them in shared
memory and write them as 16-byte row segments."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .geometry import HEAD_DIM, ROWS_PER_WARP
from .softmax import quad_sum


@cute.jit
def write_o_rows(mO, o_rc, acc_o, row_sum, n_my_rows: cutlass.Constexpr,
                 n_my_cols: cutlass.Constexpr, output_scale, sO_mine, wg_tidx, warp_in_wg, lane,
                 wg_q0, q_start, q_len, head, stage_o_copy, store_o_copy, out_dtype,
                 row_sum_whole: cutlass.Constexpr = False):
    """A warpgroup's O rows: acc / sum * output_scale, staged (out_dtype) in sO_mine (its Q
    rows, or its own O tile for e4m3 q) and written as 16-byte row segments of mO. Warp w of
    the warpgroup holds rows 16w..16w+15, which only its own S wgmmas read. Shared by the plain
    and the warp-specialized kernels. row_sum: this thread's part of each row's sum (summed
    over the quad here), or with row_sum_whole the whole sum."""
    for i in cutlass.range_constexpr(n_my_rows):
        total = row_sum[i]
        if cutlass.const_expr(not row_sum_whole):
            total = quad_sum(row_sum[i])
        inv = cutlass.Float32(0.0)
        if total > 0.0:
            inv = output_scale / total
        for j in cutlass.range_constexpr(n_my_cols):
            o_rc[i, j] = o_rc[i, j] * inv
    r_o = cute.make_fragment_like(acc_o, out_dtype)
    r_o.store(acc_o.load().to(out_dtype))
    thr_stage_o = stage_o_copy.get_slice(wg_tidx)
    cute.copy(stage_o_copy, thr_stage_o.retile(r_o), thr_stage_o.partition_D(sO_mine))
    cute.arch.sync_warp()
    thr_store_o = store_o_copy.get_slice(lane)
    tWsO = thr_store_o.partition_S(
        cute.local_tile(sO_mine, (ROWS_PER_WARP, HEAD_DIM), (warp_in_wg, 0)))
    tWcO = thr_store_o.partition_S(cute.make_identity_tensor((ROWS_PER_WARP, HEAD_DIM)))
    r_out = cute.make_fragment_like(tWsO)
    r_out.store(tWsO.load())
    warp_row_stride0 = cute.make_layout((ROWS_PER_WARP, HEAD_DIM), stride=(0, 1))
    for m in cutlass.range_constexpr(cute.size(tWsO.shape[1])):
        q_local = wg_q0 + warp_in_wg * ROWS_PER_WARP + tWcO[0, m, 0][0]
        if q_local < q_len:
            o_row = mO[q_start + q_local, head, None]
            gO = thr_store_o.partition_D(cute.make_tensor(o_row.iterator, warp_row_stride0))
            cute.copy(store_o_copy, r_out[None, m, None], gO[None, m, None])

