"""Small register-tile helpers shared by the CuTe-DSL attention kernels.

The accumulators of a warp-level ``m16n8k16`` tiled MMA are laid out as ((2, 2), MMA_M, MMA_N):
per thread two rows (``lane // 4`` and ``lane // 4 + 8`` of the warp's 16) times two adjacent
columns per 8-column atom. ``rows_cols_view`` regroups that into (rows, cols) so softmax code can
walk "my rows" and "my columns of a row"; the four lanes of a quad share a row, so row reductions
finish with two butterfly shuffles.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T


def smem_tile(dtype, layout):
    """A shared-storage struct field holding `layout` (its cosize) of `dtype`, 1024-byte
    aligned (the 128-byte swizzle's period); for cute.struct field annotations."""
    return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]


def row_copy(dtype, rows_per_step: int, async_copy: bool = True) -> cute.TiledCopy:
    """Copy of 128-channel rows in 16-byte chunks, 8 threads per row: rows_per_step rows per
    step of 8 * rows_per_step threads. cp.async global -> shared (async_copy), else plain
    16-byte loads / stores (through registers)."""
    if async_copy:
        op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
    else:
        op = cute.nvgpu.CopyUniversalOp()
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((rows_per_step, 8), stride=(8, 1)),
                                   cute.make_layout((1, 128 // dtype.width)))


def kv_row_iterator(mKV: cute.Tensor, paged: bool, base, head, key):
    """Address of the 128 channels of one key of a K or V tensor: paged [pages, H, 128, D] ->
    page `base`, slot `key`; dense [tokens, H, D] -> token `base + key`.

    The page / token index enters the offset as a 64-bit integer: a [pages, 1, 128, 128] pool
    passes 2^31 elements at 2^17 pages, and with all strides static (H = 1 compiled in) the DSL
    would otherwise multiply Int32 x Int32 (page << 14 in 32 bits). One 64-bit multiply-add per
    row address; the page and token indices themselves stay Int32."""
    if paged:
        return mKV[cutlass.Int64(base), head, key, None].iterator
    return mKV[cutlass.Int64(base + key), head, None].iterator


def row_iterator(mX: cute.Tensor, row, head):
    """Address of the last-mode vector [row, head, :] of a [rows, H, D] tensor (Q, O), with the
    row entering the offset as a 64-bit integer (rows * H * D may pass 2^31 elements; with H
    static the DSL would multiply in 32 bits)."""
    return mX[cutlass.Int64(row), head, None].iterator


def warp_row_store_copy(dtype, head_dim: int, vec: int = 0) -> cute.TiledCopy:
    """One warp writing whole staged rows in segments of vec elements (default: 16 bytes):
    head_dim / vec lanes per row, 32 / that rows per step (plain stores, shared -> registers
    -> global)."""
    vec = vec or 128 // dtype.width
    lanes_per_row = head_dim // vec
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype,
                            num_bits_per_copy=vec * dtype.width),
        cute.make_layout((32 // lanes_per_row, lanes_per_row), stride=(lanes_per_row, 1)),
        cute.make_layout((1, vec)))


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


def register_p_key_order(block_n: int = 128, head_dim: int = 128) -> cute.Layout:
    """e4m3 P.V with P in registers: (key, channel) -> index into a Vt tile (channel +
    head_dim * key'), key c = e + 2t + 8 jlo + 16 jhi + 32 g stored at key' = pi(c) =
    e + 4t + 2 jlo + 16 jhi + 32 g, the order in which register_p_operand hands P to the RS
    wgmma. (Called while a kernel is traced.)"""
    return cute.make_layout(
        ((2, 4, 2, 2, block_n // 32), head_dim),
        stride=((head_dim, 4 * head_dim, 2 * head_dim, 16 * head_dim, 32 * head_dim), 1))


@cute.jit
def register_p_operand(r_p8: cute.Tensor, a_shape) -> cute.Tensor:
    """The e4m3 S-accumulator-layout P ((2, 2, N/8): pair e, row half h, 8-column group j) as
    the A fragment of the RS P.V wgmma ((4, 2, 2), 1, K/32: v, h, g2, k-block kk), for the
    key-permuted Vt (register_p_key_order): A(v, h, g2, kk) = P(v % 2, h, v // 2 + 2 g2 + 4 kk).
    Compile-time register moves only."""
    t_a = cute.make_rmem_tensor(a_shape, r_p8.element_type)
    for kk in cutlass.range_constexpr(cute.size(r_p8) // 16):
        for g2 in cutlass.range_constexpr(2):
            for h in cutlass.range_constexpr(2):
                for v in cutlass.range_constexpr(4):
                    t_a[v + 4 * h + 8 * g2 + 16 * kk] = \
                        r_p8[v % 2 + 2 * h + 4 * (v // 2 + 2 * g2 + 4 * kk)]
    return t_a


def register_p_row_order(block_n: int = 128, head_dim: int = 128) -> cute.Layout:
    """The inverse view of register_p_key_order for a V tile (key, channel): (r, channel) ->
    index into V (key + block_n * channel) with key = pi^-1(r), i.e. row r of the result is the
    key that Vt column r holds (r = x0 + 2 x1 + 4t + 16 jhi + 32 g <-> key x0 + 8 x1 + 2t +
    16 jhi + 32 g). (Called while a kernel is traced.)"""
    return cute.make_layout(
        ((2, 2, 4, 2, block_n // 32), head_dim),
        stride=((1, 8, 2, 16, 32), block_n))


def transpose_v_copies(dtype):
    """The two tiled copies of transpose_v_words (8 warps): warp c, lane w reads rows 4w .. 4w+3
    x channels 16c .. 16c+15 of the row-permuted V (four 16-byte loads) and writes channels
    16c .. 16c+15 x columns 4w .. 4w+3 of Vt (sixteen 4-byte stores; the 32 lanes of a store
    write one channel row, 32 distinct banks of a 128-byte swizzled row)."""
    load = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
        cute.make_layout((32, 8), stride=(1, 32)), cute.make_layout((4, 16), stride=(16, 1)))
    store = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=32),
        cute.make_layout((8, 32), stride=(32, 1)), cute.make_layout((16, 4), stride=(4, 1)))
    return load, store


@cute.jit
def transpose_words_4x4(w_in: cute.Tensor, w_out: cute.Tensor, m: int):
    """w_out[4m + i] = byte i of w_in[m], w_in[4 + m], w_in[8 + m], w_in[12 + m] (words of four
    rows x, channels 4m .. 4m+3 -> words of channel 4m + i, rows 0..3): eight byte permutes."""
    a0, a1, a2, a3 = (w_in[x * 4 + m] for x in range(4))
    lo01 = cute.arch.prmt(a0, a1, 0x5140)        # a0.0 a1.0 a0.1 a1.1
    hi01 = cute.arch.prmt(a0, a1, 0x7362)        # a0.2 a1.2 a0.3 a1.3
    lo23 = cute.arch.prmt(a2, a3, 0x5140)
    hi23 = cute.arch.prmt(a2, a3, 0x7362)
    w_out[4 * m + 0] = cute.arch.prmt(lo01, lo23, 0x5410)   # a0.0 a1.0 a2.0 a3.0
    w_out[4 * m + 1] = cute.arch.prmt(lo01, lo23, 0x7632)
    w_out[4 * m + 2] = cute.arch.prmt(hi01, hi23, 0x5410)
    w_out[4 * m + 3] = cute.arch.prmt(hi01, hi23, 0x7632)


@cute.jit
def transpose_v_words(sV_stage: cute.Tensor, sVt: cute.Tensor, load: cute.TiledCopy,
                      store: cute.TiledCopy, tidx: cutlass.Int32):
    """e4m3 V tile (key, channel) -> Vt (channel, pi(key)) in the register-P key order, in
    words: a thread's four rows of the row-permuted V (register_p_row_order) are four keys
    whose bytes of one channel make one Vt word; eight byte permutes per 4 x 4 block."""
    v_rows = cute.composition(sV_stage, register_p_row_order(cute.size(sV_stage, mode=[0]),
                                                              cute.size(sV_stage, mode=[1])))
    src = load.get_slice(tidx).partition_S(v_rows)
    r_in = cute.make_fragment_like(src)
    cute.copy(load, src, r_in)
    dst = store.get_slice(tidx).partition_D(sVt)
    r_out = cute.make_fragment_like(dst)
    w_in = cute.recast_tensor(r_in, cutlass.Uint32)     # [row x * 4 + m]: channels 16c + 4m ..
    w_out = cute.recast_tensor(r_out, cutlass.Uint32)   # [4m + i]: channel 16c + 4m + i, rows 0..3
    for m in cutlass.range_constexpr(4):
        transpose_words_4x4(w_in, w_out, m)
    cute.copy(store, r_out, dst)


@cute.jit
def pack_bf16_pairs(acc: cute.Tensor, r_p: cute.Tensor):
    """r_p (a 16-bit copy of the fp32 accumulator acc, same layout) = acc rounded to bf16, one
    cvt.rn.bf16x2.f32 per element pair, emitted as inline assembly with side effects so that
    it stays where it is written. (A plain conversion at the end of a loop body is moved by
    LLVM past the loop's phi, to the next iteration's use: the fp32 values then stay live
    across the loop back edge, 32 registers more, which made ptxas serialize the wgmmas of
    the overlapped FMHA loop, C7512.)"""
    words = cute.recast_tensor(r_p, cutlass.Uint32)
    for w in cutlass.range_constexpr(cute.size(words)):
        words[w] = cutlass.Uint32(llvm.inline_asm(
            T.i32(), [cutlass.Float32(acc[2 * w + 1]).ir_value(),
                      cutlass.Float32(acc[2 * w]).ir_value()],
            "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=True,
            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def e4m3_quad_word(values) -> cutlass.Uint32:
    """Four fp32 values rounded to e4m3 (cvt.rn.satfinite.e4m3x2.f32, as the DSL's conversion)
    in one 32-bit word, values[0] in the low byte; inline assembly with side effects, so that
    it stays where it is written (pack_bf16_pairs says why). Traced inline."""
    return cutlass.Uint32(llvm.inline_asm(
        T.i32(), [cutlass.Float32(x).ir_value() for x in values],
        "{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi};\n}", "=r,f,f,f,f", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def pack_e4m3_operand_a(acc: cute.Tensor, t_a: cute.Tensor):
    """t_a (the A fragment of the RS P.V wgmma, register_p_operand's layout) = acc rounded to
    e4m3 (e4m3_quad_word), packed straight into A's words: A word h + 2 g2 + 4 kk holds
    elements 4c + 2h, 4c + 2h + 1 (low half) and 4c + 4 + 2h, 4c + 5 + 2h (high half) of
    acc, c = 2 g2 + 4 kk: register_p_operand's words without its byte moves (two PRMT per word,
    32 per 128-key block and thread)."""
    words = cute.recast_tensor(t_a, cutlass.Uint32)
    for kk in cutlass.range_constexpr(cute.size(acc) // 16):
        for g2 in cutlass.range_constexpr(2):
            for h in cutlass.range_constexpr(2):
                lo = 4 * (2 * g2 + 4 * kk) + 2 * h
                words[h + 2 * g2 + 4 * kk] = e4m3_quad_word(
                    [acc[i] for i in (lo, lo + 1, lo + 4, lo + 5)])
