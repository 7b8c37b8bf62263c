"""Memory building blocks: shared-memory struct fields, global <-> shared row copies with 64-bit
row addresses, the cp.async K/V and Q row loads of a tile and the staged O row store."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .geometry import HEAD_DIM, WG_ROWS


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



@cute.jit
def load_q_rows(mQ: cute.Tensor, q_copy: cute.TiledCopy, thr_q_copy, tQsQ: cute.Tensor,
                tQcQ: cute.Tensor, wg_q0: cutlass.Int32, q_start: cutlass.Int32,
                q_len: cutlass.Int32, head: cutlass.Int32):
    """cp.async a warpgroup's Q rows (tQsQ: its partition of the warpgroup's Q tile, tQcQ the
    matching coordinates; row r is query wg_q0 + r of the request, head `head`); rows past
    q_len are zero-filled, never read. The caller commits the copy group. Shared by the plain
    and the warp-specialized kernels."""
    row_stride0 = cute.make_layout((WG_ROWS, HEAD_DIM), stride=(0, 1))
    for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
        q_local = wg_q0 + tQcQ[0, m, 0][0]
        if q_local < q_len:
            q_row = mQ[q_start + q_local, head, None]
            gQ = thr_q_copy.partition_S(cute.make_tensor(q_row.iterator, row_stride0))
            cute.copy(q_copy, gQ[None, m, None], tQsQ[None, m, None])
        else:
            tQsQ[None, m, None].fill(0)


@cute.jit
def copy_kv_rows(mK: cute.Tensor, mV: cute.Tensor, paged: cutlass.Constexpr, base, head_kv,
                 n_keys, row_copy_: cute.TiledCopy, thr_copy, tKsK: cute.Tensor,
                 tVsV: cute.Tensor, tKVc: cute.Tensor, row_stride0: cute.Layout):
    """cp.async the K and V rows of one 128-key block into their shared tiles (tKsK, tVsV: this
    thread's partitions by thr_copy of row_copy_, tKVc the matching coordinates, row_stride0 the
    (key, channel) layout of one global row): row r is key r of page `base` (paged) or token
    base + r (dense). Keys at or past n_keys are zero-filled, never read."""
    for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
        key = tKVc[0, m, 0][0]
        if key < n_keys:
            k_ptr = kv_row_iterator(mK, paged, base, head_kv, key)
            v_ptr = kv_row_iterator(mV, paged, base, head_kv, key)
            gK = thr_copy.partition_S(cute.make_tensor(k_ptr, row_stride0))
            gV = thr_copy.partition_S(cute.make_tensor(v_ptr, row_stride0))
            cute.copy(row_copy_, gK[None, m, None], tKsK[None, m, None])
            cute.copy(row_copy_, gV[None, m, None], tVsV[None, m, None])
        else:
            tKsK[None, m, None].fill(0)
            tVsV[None, m, None].fill(0)
