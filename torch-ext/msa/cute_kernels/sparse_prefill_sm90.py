"""Block-sparse prefill attention, KV-outer, for Hopper (sm_90a), in the CuTe DSL: the warp-MMA
kernel (form "mma" of cute_kernels.variants.SPARSE_FORMS: bf16 q/k/v with fp32 partials).

One CTA per work item of the k2q schedule (sparse_common.py: the work item, the Q gather, the
single-block softmax and the partial-row epilogue are shared with the wgmma and TMA kernels).
The CTA loads the 128x128 K and V block of (b, beta, h) into shared memory once, then walks the
item's queries in 128-row tiles = (128 / G queries) x (G query heads of KV head h). Per tile:

  gather Q rows (each query's G heads are G*128 contiguous elements of q [total_q, Hq, 128])
  S = Q K^T (fp32)  ->  scale, mask (j < k_len, causal bottom-right)  ->  single-block softmax
  O = P V  ->  normalize  ->  O_partial[slot, q_abs, hq, :], LSE_partial[slot, q_abs, hq]

Overlap: the Q tile is double-buffered (cp.async gather of tile t+1 in flight while tile t
computes; the qsplit entries of tile t+2 are loaded meanwhile and each tile's entries are kept in
shared memory for the softmax and the epilogue). Epilogue: each warp stages its 16 output rows
in a separate fp32 tile and writes them as 16-byte vectors (a query's G heads are one contiguous
run).

MMA: warp-level mma.sync m16n8k16 (bf16 in, fp32 accumulate) with ldmatrix operand loads; each
of the 8 warps owns 16 rows of the tile; one CTA per SM.

Tensors (all dynamic sizes are runtime values):
  q            [total_q, Hq, 128] bf16, Hq = G * Hkv
  k, v         dense [total_k, Hkv, 128] or paged [pages, Hkv, 128, 128], bf16
  cu_seqlens_q [B+1] int32;  cu_seqlens_k [B+1] int32 (dense token offsets);  kv_lens [B] int32
  page_table   [B, max_pages] int32 (paged only)
  k2q_row_ptr  [Hkv, rows+1] int32;  qsplit [Hkv, E] int32 (q_local | slot << 24)
  metadata     [capacity, 6] int32;  work_count [1] int32
  o_partial    [topK, total_q, Hq, 128] fp32 (16-bit and e4m3 partials: the other kernels)
  lse_partial, lse_t_partial  [topK, total_q, Hq] fp32
  softmax_scale, inv_temperature: fp32; causal, want_lse_t: int32 flags
"""

from __future__ import annotations


import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from .copies import copy_kv_rows, row_copy, warp_row_store_copy
from .geometry import BLOCK_N, HEAD_DIM, LOG2_E, ROWS_PER_WARP
from .mma import accumulator_as_operand_a, rows_cols_view, scale_rows
from .sparse_common import SparsePrefillBase

TILE_M = 128           # rows per tile: 8 warps x 16
NUM_THREADS = TILE_M // ROWS_PER_WARP * 32
Q_STAGES = 2           # Q tile double buffer


class SparsePrefillSm90(SparsePrefillBase):
    """Compile-time configuration of one warp-MMA attention variant (fp32 partials)."""

    def __init__(self, qhead_per_kv: int, paged: bool, partial_dtype=cutlass.Float32):
        super().__init__(qhead_per_kv, paged, partial_dtype)
        assert partial_dtype is cutlass.Float32, partial_dtype
        self.tile_m = TILE_M
        self.num_threads = NUM_THREADS
        self.queries_per_tile = TILE_M // qhead_per_kv
        self.dtype = cutlass.BFloat16

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                 cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, kv_lens: cute.Tensor,
                 page_table: cute.Tensor, k2q_row_ptr: cute.Tensor, qsplit: cute.Tensor,
                 metadata: cute.Tensor, work_count: cute.Tensor, o_partial: cute.Tensor,
                 lse_partial: cute.Tensor, lse_t_partial: cute.Tensor,
                 softmax_scale: cutlass.Float32, inv_temperature: cutlass.Float32,
                 causal: cutlass.Int32, want_lse_t: cutlass.Int32, stream):
        # Shared tiles: 8x64 atoms with a 3-bit XOR swizzle so ldmatrix rows hit distinct banks.
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                         cute.make_layout((8, 64), stride=(64, 1)))
        tile_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM), (0, 1))
        # Q is double-buffered: the gather of tile t+1 runs while tile t computes.
        q_layout = cute.tile_to_shape(atom, (self.tile_m, HEAD_DIM, Q_STAGES), (0, 1, 2))
        # O staging tile (partial dtype): the epilogue writes its fragment here, then each warp
        # streams its own 16 rows out as 16-byte vectors (whole 256/512-byte rows per store).
        o_atom_cols = 128 // self.partial_dtype.width * 8     # 64 bf16 or 32 fp32 = 128 bytes
        o_atom = cute.make_composed_layout(
            cute.make_swizzle(3, 4 - self.partial_dtype.width // 16, 3), 0,
            cute.make_layout((8, o_atom_cols), stride=(o_atom_cols, 1)))
        o_layout = cute.tile_to_shape(o_atom, (self.tile_m, HEAD_DIM), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(tile_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(tile_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.partial_dtype,
                                                       cute.cosize(o_layout)], 1024]
            # Packed qsplit entry of each query of the tile, per Q stage (read by softmax and
            # epilogue instead of global memory).
            sEntry: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.tile_m * Q_STAGES], 16]

        # Gmem -> smem: 16-byte cp.async chunks; 8 threads cover 64 columns of a row.
        gather_copy = row_copy(self.dtype, self.num_threads // 8)
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (self.num_threads // 32, 1, 1), permutation_mnk=(self.tile_m, 16, 16))
        # Accumulator fragment -> sO: two adjacent columns per store (32 or 64 bits).
        stage_o_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.partial_dtype,
                                num_bits_per_copy=2 * self.partial_dtype.width), tiled_mma)
        # sO -> O_partial, one warp: 16-byte vectors, a row is 128/vec consecutive lanes.
        store_o_copy = warp_row_store_copy(self.partial_dtype, HEAD_DIM)

        scale_log2 = softmax_scale * LOG2_E
        self.kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, kv_lens, page_table, k2q_row_ptr,
                    qsplit, metadata, work_count, o_partial, lse_partial, lse_t_partial,
                    scale_log2, inv_temperature, causal, want_lse_t, tile_layout, q_layout,
                    o_layout, gather_copy, tiled_mma, stage_o_copy, store_o_copy,
                    SharedStorage).launch(
            grid=(cute.size(metadata.shape[0]), 1, 1), block=(self.num_threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuQ: cute.Tensor,
               mCuK: cute.Tensor, mKvLens: cute.Tensor, mPageTable: cute.Tensor,
               mRowPtr: cute.Tensor, mQsplit: cute.Tensor, mMeta: cute.Tensor,
               mWorkCount: cute.Tensor, mOPartial: cute.Tensor, mLsePartial: cute.Tensor,
               mLseTPartial: cute.Tensor, scale_log2: cutlass.Float32,
               inv_temperature: cutlass.Float32, causal: cutlass.Int32,
               want_lse_t: cutlass.Int32, tile_layout: cute.ComposedLayout,
               q_layout: cute.ComposedLayout, o_layout: cute.ComposedLayout,
               gather_copy: cute.TiledCopy, tiled_mma: cute.TiledMma,
               stage_o_copy: cute.TiledCopy, store_o_copy: cute.TiledCopy,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        work, _, _ = cute.arch.block_idx()
        if work < mWorkCount[0]:
            (head_kv, csr_row, q_begin, q_count, batch, kv_block, q_start,
             q_len) = self._work_item(mMeta, mCuQ, work)
            kv_row0, n_keys, causal_shift = self._kv_block_bounds(
                mK, mCuK, mKvLens, mPageTable, batch, kv_block, q_len)

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ_stages = storage.sQ.get_tensor(q_layout)
            sK = storage.sK.get_tensor(tile_layout)
            sV = storage.sV.get_tensor(tile_layout)
            sEntry = storage.sEntry.get_tensor(cute.make_layout((self.tile_m, Q_STAGES)))
            # V^T view (D x N) for the B operand of O = P V.
            sVt = cute.composition(sV, cute.make_layout((HEAD_DIM, BLOCK_N), stride=(BLOCK_N, 1)))

            thr_copy = gather_copy.get_slice(tidx)
            tXsK = thr_copy.partition_D(sK)
            tXsV = thr_copy.partition_D(sV)
            tXcKV = thr_copy.partition_S(cute.make_identity_tensor((BLOCK_N, HEAD_DIM)))
            kv_row_stride0 = cute.make_layout((BLOCK_N, HEAD_DIM), stride=(0, 1))
            tXcX = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, HEAD_DIM)))
            row_stride0 = cute.make_layout((self.tile_m, HEAD_DIM), stride=(0, 1))

            # ---- K and V block: loaded once, rows past n_keys zero-filled --------------------
            copy_kv_rows(mK, mV, self.paged, kv_row0, head_kv, n_keys, gather_copy, thr_copy,
                         tXsK, tXsV, tXcKV, kv_row_stride0)

            # ---- MMA partitions ---------------------------------------------------------------
            thr_mma = tiled_mma.get_slice(tidx)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ_stages[None, None, 0]))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                       self.dtype)
            ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                         self.dtype)
            copy_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
            copy_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
            copy_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
            tSrQ_view = copy_q.retile(tSrQ)
            tSsK = copy_k.partition_S(sK)
            tSrK_view = copy_k.retile(tSrK)
            tOsVt = copy_v.partition_S(sVt)
            tOrVt_view = copy_v.retile(tOrVt)

            tScS = rows_cols_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, BLOCK_N))))
            acc_shape = thr_mma.partition_shape_C((self.tile_m, BLOCK_N))
            n_my_rows = cute.size(tScS, mode=[0])
            n_my_cols = cute.size(tScS, mode=[1])

            # Epilogue partitions: fragment -> sO, and this warp's 16 rows of sO -> gmem.
            (thr_stage_o, warp_idx, lane, thr_store_o, tWcO,
             warp_row_stride0) = self._epilogue_partitions(stage_o_copy, store_o_copy, tidx)

            entry0, n_tiles = self._tile_span(mRowPtr, head_kv, csr_row, q_begin, q_count)
            gather_entries = self._start_q_gather(tXcX, mQsplit, head_kv, entry0, q_count,
                                                  sQ_stages, sEntry, thr_copy, gather_copy, mQ,
                                                  q_start, q_len, row_stride0, tidx)
            for tile in range(n_tiles):
                stage = tile % Q_STAGES
                # Tile `tile` (and, first time, K/V) has landed; every warp is done with the
                # previous tile, so its Q stage and entries may be overwritten now.
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                if tile + 1 < n_tiles:
                    self._gather_q_tile(gather_entries, sQ_stages, sEntry, 1 - stage, thr_copy,
                                        gather_copy, tXcX, mQ, q_start, q_len, head_kv,
                                        row_stride0, tidx)
                    self._load_gather_entries(gather_entries, mQsplit, head_kv, entry0,
                                              (tile + 2) * self.queries_per_tile, q_count, tXcX)
                cute.arch.cp_async_commit_group()
                sQ = sQ_stages[None, None, stage]
                tSsQ = copy_q.partition_S(sQ)
                sO = storage.sO.get_tensor(o_layout)
                tOsO = thr_stage_o.partition_D(sO)
                tWsO = thr_store_o.partition_S(
                    cute.local_tile(sO, (ROWS_PER_WARP, HEAD_DIM), (warp_idx, 0)))

                # ---- S = Q K^T ---------------------------------------------------------------
                acc_s = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
                acc_s.fill(0.0)
                n_k = cute.size(tSsQ.shape[2])
                cute.copy(copy_q, tSsQ[None, None, 0], tSrQ_view[None, None, 0])
                cute.copy(copy_k, tSsK[None, None, 0], tSrK_view[None, None, 0])
                for kk in cutlass.range_constexpr(n_k):
                    if cutlass.const_expr(kk + 1 < n_k):
                        cute.copy(copy_q, tSsQ[None, None, kk + 1], tSrQ_view[None, None, kk + 1])
                        cute.copy(copy_k, tSsK[None, None, kk + 1], tSrK_view[None, None, kk + 1])
                    cute.gemm(tiled_mma, acc_s, tSrQ[None, None, kk], tSrK[None, None, kk], acc_s)

                # ---- mask + single-block softmax, per owned row -------------------------------
                s_rc = rows_cols_view(acc_s)
                row_lse, row_lse_t, row_inv_sum = self._tile_softmax(
                    s_rc, tScS, n_my_rows, n_my_cols, sEntry, stage, n_keys, causal,
                    causal_shift, scale_log2, inv_temperature, want_lse_t)

                # ---- O = P V (P stays in registers) -------------------------------------------
                r_p = cute.make_fragment_like(acc_s, self.dtype)
                r_p.store(acc_s.load().to(self.dtype))
                t_p = accumulator_as_operand_a(r_p)
                acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, HEAD_DIM)),
                                              cutlass.Float32)
                acc_o.fill(0.0)
                n_kv = cute.size(t_p.shape[2])
                cute.copy(copy_v, tOsVt[None, None, 0], tOrVt_view[None, None, 0])
                for kk in cutlass.range_constexpr(n_kv):
                    if cutlass.const_expr(kk + 1 < n_kv):
                        cute.copy(copy_v, tOsVt[None, None, kk + 1], tOrVt_view[None, None, kk + 1])
                    cute.gemm(tiled_mma, acc_o, t_p[None, None, kk], tOrVt[None, None, kk], acc_o)

                # ---- normalize, stage through sO, write whole partial rows ----------------------
                scale_rows(rows_cols_view(acc_o), row_inv_sum)
                r_o = cute.make_fragment_like(acc_o, self.partial_dtype)
                r_o.store(acc_o.load().to(self.partial_dtype))
                cute.copy(stage_o_copy, thr_stage_o.retile(r_o), tOsO)
                # Each warp reads back only the rows it wrote (the MMA gives warp w rows
                # 16w..16w+15), so a warp barrier suffices.
                cute.arch.sync_warp()
                self._write_partial_rows(tWsO, tWcO, warp_idx * ROWS_PER_WARP, tScS, n_my_rows,
                                         row_lse, row_lse_t, want_lse_t, sEntry, stage,
                                         q_start, q_len, head_kv, mOPartial, mLsePartial,
                                         mLseTPartial, thr_store_o, store_o_copy,
                                         warp_row_stride0, lane)
