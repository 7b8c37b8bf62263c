"""Warpgroup and warp MMA building blocks: accumulator views, operand reuse, GEMM issue, the
FMHA-style tile MMAs and their per-warpgroup fragments. Called while a kernel is traced.

The accumulators of a warp-level ``m16n8k16`` tiled MMA are laid out as ((2, 2), MMA_M, MMA_N):
per thread two rows (``lane // 4`` and ``lane // 4 + 8`` of the warp's 16) times two adjacent
columns per 8-column atom. ``rows_cols_view`` regroups that into (rows, cols) so softmax code can
walk "my rows" and "my columns of a row"; the four lanes of a quad share a row, so row reductions
finish with two butterfly shuffles (softmax.quad_max / quad_sum). ``wgmma_rows_cols_view`` does
the same for warpgroup-MMA accumulators.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T

from .copies import warp_row_store_copy
from .geometry import BLOCK_N, HEAD_DIM, WG_ROWS


def rows_cols_view(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2), M, N) accumulator -> ((2, M), (2, N)) view: mode 0 = this thread's rows,
    mode 1 = this thread's columns of each of those rows."""
    compact = cute.make_layout(acc.layout.shape)
    regroup = cute.make_layout(
        ((compact.shape[0][1], compact.shape[1]), (compact.shape[0][0], compact.shape[2])),
        stride=((compact.stride[0][1], compact.stride[1]),
                (compact.stride[0][0], compact.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, regroup))


def accumulator_as_operand_a(acc_in_16bit: cute.Tensor) -> cute.Tensor:
    """Reinterpret an m16n8 C fragment (converted to 16-bit) as the A operand of the next
    m16n8k16 MMA: ((2, 2), M, N) -> ((2, 2, 2), M, N / 2). This is the register-level
    "P stays in registers" trick of flash attention: two adjacent 8-column C atoms hold exactly
    one 16-wide K slice of A."""
    split = cute.logical_divide(acc_in_16bit.layout, (None, None, 2))
    layout = cute.make_layout(
        ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
        stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1]))
    return cute.make_tensor(acc_in_16bit.iterator, layout)


def warpgroup_gemm_issue(tiled_mma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
                         accumulate: bool = False, also=None) -> None:
    """Issue acc = A B (acc += A B with accumulate) as one warpgroup-MMA chain over A's K
    slices and commit it as one group; acc must not be touched until warpgroup.wait_group. A is
    a register or smem fragment, B an smem fragment, both (MMA, M or N, K). also: another
    (tiled_mma, acc, a, b, accumulate) chain issued after it in the same group."""
    warpgroup.fence()
    chains = ((tiled_mma, acc, a, b, accumulate),) + ((also,) if also is not None else ())
    for mma, c, x, y, acc_in in chains:
        atom = cute.make_mma_atom(mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, acc_in)
        # A plain Python loop unrolls at trace time (this helper is not preprocessed by
        # cute.jit).
        for kk in range(cute.size(x.shape[2])):
            cute.gemm(atom, c, x[None, None, kk], y[None, None, kk], c)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def warpgroup_gemm(tiled_mma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
                   accumulate: bool = False) -> None:
    """acc = A B, or acc += A B (warpgroup_gemm_issue), waited for."""
    warpgroup_gemm_issue(tiled_mma, acc, a, b, accumulate)
    warpgroup.wait_group(0)


def scale_rows(rows_cols: cute.Tensor, factors: cute.Tensor) -> None:
    """rows_cols[i, j] *= factors[i]: a wgmma_rows_cols_view of an accumulator, one factor per
    row of this thread (e.g. the online-softmax correction of O)."""
    for i in range(cute.size(rows_cols, mode=[0])):
        for j in range(cute.size(rows_cols, mode=[1])):
            rows_cols[i, j] = rows_cols[i, j] * factors[i]


def wgmma_rows_cols_view(acc: cute.Tensor) -> cute.Tensor:
    """Warpgroup-MMA accumulator ((2, 2, V), M, N) -> ((2, M), (2, V, N)) view: mode 0 = this
    thread's rows (lane // 4 and lane // 4 + 8 of its warp's 16), mode 1 = its columns of each
    row (a pair per 8-column group). Same quad-shares-a-row property as m16n8k16. (An N = 8
    accumulator is ((2, 2), M, N): one column group.)"""
    compact = cute.make_layout(acc.layout.shape)
    groups, group_stride = ((compact.shape[0][2], compact.stride[0][2])
                            if len(compact.shape[0]) == 3 else (1, 0))
    regroup = cute.make_layout(
        ((compact.shape[0][1], compact.shape[1]),
         (compact.shape[0][0], groups, compact.shape[2])),
        stride=((compact.stride[0][1], compact.stride[1]),
                (compact.stride[0][0], group_stride, compact.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, regroup))


def wgmma_accumulator_as_operand_a(acc_in_16bit: cute.Tensor) -> cute.Tensor:
    """Reinterpret a warpgroup-MMA C fragment ((2, 2, N/8), M, 1) (converted to 16-bit) as the
    register A operand of the next warpgroup MMA: ((2, 2, 2), M, N/16). Two adjacent 8-column
    groups of C are one 16-wide K slice of A (P stays in registers for O = P V)."""
    split = cute.logical_divide(acc_in_16bit.layout, ((None, None, 2), None, None))
    layout = cute.make_layout(
        ((split.shape[0][0], split.shape[0][1], split.shape[0][2][0]), split.shape[1],
         (split.shape[0][2][1], split.shape[2])),
        stride=((split.stride[0][0], split.stride[0][1], split.stride[0][2][0]), split.stride[1],
                (split.stride[0][2][1], split.stride[2])))
    return cute.make_tensor(acc_in_16bit.iterator, layout)


@cute.jit
def pack_bf16_pairs(acc: cute.Tensor, r_p: cute.Tensor):
    """r_p (a 16-bit copy of the fp32 accumulator acc, same layout) = acc rounded to bf16, one
    cvt.rn.bf16x2.f32 per element pair, emitted as inline assembly with side effects so that
    it stays where it is written. (A plain conversion at the end of a loop body is moved by
    LLVM past the loop's phi, to the next iteration's use: the fp32 values then stay live
    across the loop back edge, 32 registers more, and ptxas serializes the wgmmas around
    them, C7512.)"""
    words = cute.recast_tensor(r_p, cutlass.Uint32)
    for w in cutlass.range_constexpr(cute.size(words)):
        words[w] = cutlass.Uint32(llvm.inline_asm(
            T.i32(), [cutlass.Float32(acc[2 * w + 1]).ir_value(),
                      cutlass.Float32(acc[2 * w]).ir_value()],
            "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=True,
            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))



def mmas_and_o_copies(dtype, out_dtype):
    """(mma_qk, mma_pv, stage_o_copy, store_o_copy) of a 64-row warpgroup tile: S = Q K^T
    (SS, both K-major), O = P V with P in registers (V stored [key, channel] is the MN-major B
    operand; e4m3: B is the K-major Vt tile), accumulator -> staged O rows (two adjacent columns
    per store), then 16-byte row segments to global memory. Shared by the plain and the
    warp-specialized kernels; called while tracing."""
    mma_qk = hopper.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
        cutlass.Float32, (1, 1, 1), (WG_ROWS, BLOCK_N))
    mma_pv = hopper.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K,
        cute.nvgpu.OperandMajorMode.K if dtype.width == 8 else cute.nvgpu.OperandMajorMode.MN,
        cutlass.Float32, (1, 1, 1), (WG_ROWS, HEAD_DIM),
        a_source=warpgroup.OperandSource.RMEM)
    stage_o_copy = cute.make_tiled_copy_C(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype,
                            num_bits_per_copy=2 * out_dtype.width), mma_pv)
    return mma_qk, mma_pv, stage_o_copy, warp_row_store_copy(out_dtype, HEAD_DIM)


def consumer_fragments(mma_qk, mma_pv, wg_tidx, sQ: cute.Tensor, sK: cute.Tensor,
                       sVt: cute.Tensor):
    """A 64-row consumer warpgroup's views of the MMAs of mmas_and_o_copies: (tSrQ, tSrK,
    tOrVt) fragments of the Q / K / Vt tiles (trailing stage modes kept), tScS the (row, col)
    coordinates of its S accumulator, the S and O accumulators (fp32) and the shape of P as
    the A operand of P V. Shared by the warp-specialized FMHA and sparse kernels; called while
    tracing."""
    thr_qk = mma_qk.get_slice(wg_tidx)
    thr_pv = mma_pv.get_slice(wg_tidx)
    tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
    tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
    tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
    tScS = wgmma_rows_cols_view(
        thr_qk.partition_C(cute.make_identity_tensor((WG_ROWS, BLOCK_N))))
    acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((WG_ROWS, BLOCK_N)),
                                  cutlass.Float32)
    acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((WG_ROWS, HEAD_DIM)),
                                  cutlass.Float32)
    return tSrQ, tSrK, tOrVt, tScS, acc_s, acc_o, thr_pv.partition_shape_A((WG_ROWS, BLOCK_N))

