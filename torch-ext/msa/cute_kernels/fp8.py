"""e4m3 building blocks: P kept in registers as the A operand of an e4m3 P.V wgmma, the key order
that requires of a (transposed) V tile, the in-shared-memory V -> Vt word transpose, and P
rounded to e4m3 straight into the A fragment's words."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


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

