"""Block-sparse prefill attention, KV-outer, for Hopper (sm_90a), in the CuTe DSL: warp-MMA kernel.

One CTA per work item of the k2q schedule (msa.src.sm100.prepare_scheduler): a work item is
(KV head h, CSR row, q_begin, q_count, request b, KV block beta). The CTA loads the 128x128 K and
V block of (b, beta, h) into shared memory once, then walks the item's queries in M tiles of
TILE_M rows = (TILE_M / G queries) x (G query heads of KV head h). Per tile:

  gather Q rows (each query's G heads are G*128 contiguous elements of q [total_q, Hq, 128])
  S = Q K^T (fp32)  ->  scale, mask (j < k_len, causal bottom-right)  ->  single-block softmax
  O = P V  ->  normalize  ->  O_partial[slot, q_abs, hq, :], LSE_partial[slot, q_abs, hq]

The softmax covers one block only, so there is no online rescale: LSE_blk = m + ln sum exp(s - m)
(rows that see no key: LSE = -inf, O = 0). The combine kernel (combine.py) merges the slots.

Overlap: the Q tile is double-buffered (cp.async gather of tile t+1 in flight while tile t
computes; the qsplit entries of tile t+2 are loaded meanwhile and each tile's entries are kept in
shared memory for the softmax and the epilogue). Epilogue: each warp stages its 16 output rows in
shared memory and writes them as 16-byte vectors (a query's G heads are one contiguous run).

MMA: warp-level mma.sync m16n8k16 (bf16 in, fp32 accumulate) with ldmatrix operand loads; each
warp owns 16 rows of the tile. fp32 partials: 128-row tiles, 8 warps, a separate fp32 O staging
tile, 1 CTA/SM. bf16 partials: 64-row tiles, 4 warps, O staged in the tile's own Q rows, ~97 KB
of shared memory, 2 CTAs/SM. The shipped bf16 variants use the warpgroup-MMA kernel instead
(sparse_prefill_sm90_wgmma.py, which reuses this class's helpers); see cute_kernels/build.py.

Tensors (all dynamic sizes are runtime values):
  q            [total_q, Hq, 128] bf16, Hq = G * Hkv
  k, v         dense [total_k, Hkv, 128] or paged [pages, Hkv, 128, 128], bf16
  cu_seqlens_q [B+1] int32;  cu_seqlens_k [B+1] int32 (dense token offsets);  kv_lens [B] int32
  page_table   [B, max_pages] int32 (paged only)
  k2q_row_ptr  [Hkv, rows+1] int32;  qsplit [Hkv, E] int32 (q_local | slot << 24)
  metadata     [capacity, 6] int32;  work_count [1] int32
  o_partial    [topK, total_q, Hq, 128] fp32 or bf16
  lse_partial, lse_t_partial  [topK, total_q, Hq] fp32
  softmax_scale, inv_temperature: fp32; causal, want_lse_t: int32 flags
"""

from __future__ import annotations


import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from .tile_utils import (accumulator_as_operand_a, mask_row_and_max, quad_max, quad_sum,
                         kv_row_iterator, row_copy, rows_cols_view, warp_row_store_copy)

HEAD_DIM = 128
BLOCK_N = 128          # keys per KV block (= page size)
ROWS_PER_WARP = 16     # each warp owns 16 rows of the M tile (m16n8k16)
Q_STAGES = 2           # Q tile double buffer
SLOT_SHIFT = 24
LOCAL_QUERY_MASK = (1 << SLOT_SHIFT) - 1
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


class SparsePrefillSm90:
    """Compile-time configuration of one attention variant (see cute_kernels.variants)."""

    def __init__(self, qhead_per_kv: int, paged: bool, partial_dtype=cutlass.Float32):
        assert qhead_per_kv in (1, 2, 4, 8, 16)
        self.group = qhead_per_kv
        self.paged = paged
        self.partial_dtype = partial_dtype
        # bf16 partials: 64-row tiles, 4 warps, O staged in the tile's own Q rows -> ~97 KB of
        # shared memory, so two CTAs share an SM and one's softmax/epilogue overlaps the other's
        # MMAs. fp32 partials need a separate fp32 staging tile: 128-row tiles, 8 warps, 1 CTA/SM.
        self.stage_o_in_q = partial_dtype.width == 16
        self.tile_m = 64 if self.stage_o_in_q else 128
        self.num_threads = self.tile_m // ROWS_PER_WARP * 32
        self.queries_per_tile = self.tile_m // qhead_per_kv
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
        o_rows = 8 if self.stage_o_in_q else self.tile_m     # unused when staged in sQ
        o_layout = cute.tile_to_shape(o_atom, (o_rows, HEAD_DIM), (0, 1))

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
            for m in cutlass.range_constexpr(cute.size(tXsK.shape[1])):
                key = tXcKV[0, m, 0][0]
                if key < n_keys:
                    k_ptr = kv_row_iterator(mK, self.paged, kv_row0, head_kv, key)
                    v_ptr = kv_row_iterator(mV, self.paged, kv_row0, head_kv, key)
                    gK = thr_copy.partition_S(cute.make_tensor(k_ptr, kv_row_stride0))
                    gV = thr_copy.partition_S(cute.make_tensor(v_ptr, kv_row_stride0))
                    cute.copy(gather_copy, gK[None, m, None], tXsK[None, m, None])
                    cute.copy(gather_copy, gV[None, m, None], tXsV[None, m, None])
                else:
                    tXsK[None, m, None].fill(0)
                    tXsV[None, m, None].fill(0)

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
            thr_stage_o = stage_o_copy.get_slice(tidx)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tidx % 32
            rows_per_warp = ROWS_PER_WARP
            thr_store_o = store_o_copy.get_slice(lane)
            tWcO = thr_store_o.partition_S(cute.make_identity_tensor((rows_per_warp, HEAD_DIM)))
            warp_row_stride0 = cute.make_layout((rows_per_warp, HEAD_DIM), stride=(0, 1))

            entry0 = mRowPtr[head_kv, csr_row] + q_begin
            n_tiles = (q_count + self.queries_per_tile - 1) // self.queries_per_tile
            n_gather_rows = cute.size(tXcX.shape[1])
            # qsplit entries of the rows this thread gathers, loaded one tile ahead so the
            # cp.async addresses never wait on a global load.
            gather_entries = cute.make_rmem_tensor((n_gather_rows,), cutlass.Int32)
            self._load_gather_entries(gather_entries, mQsplit, head_kv, entry0, 0, q_count,
                                      tXcX)
            self._gather_q_tile(gather_entries, sQ_stages, sEntry, 0, thr_copy, gather_copy,
                                tXcX, mQ, q_start, q_len, head_kv, row_stride0, tidx)
            cute.arch.cp_async_commit_group()
            self._load_gather_entries(gather_entries, mQsplit, head_kv, entry0,
                                      self.queries_per_tile, q_count, tXcX)
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
                if cutlass.const_expr(not self.stage_o_in_q):
                    sO = storage.sO.get_tensor(o_layout)
                else:
                    # Warp w's O rows overwrite its own Q rows (only warp w read them, and its
                    # S MMAs are done by the epilogue); the stage is refilled after a barrier.
                    sO = sQ
                tOsO = thr_stage_o.partition_D(sO)
                tWsO = thr_store_o.partition_S(
                    cute.local_tile(sO, (rows_per_warp, HEAD_DIM), (warp_idx, 0)))

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
                row_lse = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
                row_lse_t = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
                row_inv_sum = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
                self._softmax_rows(s_rc, tScS, n_my_rows, n_my_cols, sEntry, stage, n_keys,
                                   causal, causal_shift, scale_log2, inv_temperature, want_lse_t,
                                   row_lse, row_lse_t, row_inv_sum)

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
                o_rc = rows_cols_view(acc_o)
                for i in cutlass.range_constexpr(n_my_rows):
                    for j in cutlass.range_constexpr(n_my_cols):
                        o_rc[i, j] = o_rc[i, j] * row_inv_sum[i]
                r_o = cute.make_fragment_like(acc_o, self.partial_dtype)
                r_o.store(acc_o.load().to(self.partial_dtype))
                cute.copy(stage_o_copy, thr_stage_o.retile(r_o), tOsO)
                # Each warp reads back only the rows it wrote (the MMA gives warp w rows
                # 16w..16w+15), so a warp barrier suffices.
                cute.arch.sync_warp()
                self._write_partial_rows(tWsO, tWcO, warp_idx * rows_per_warp, tScS, n_my_rows,
                                         row_lse, row_lse_t, want_lse_t, sEntry, stage,
                                         q_start, q_len, head_kv, mOPartial, mLsePartial,
                                         mLseTPartial, thr_store_o, store_o_copy,
                                         warp_row_stride0, lane)

    @cute.jit
    def _work_item(self, mMeta: cute.Tensor, mCuQ: cute.Tensor, work: cutlass.Int32):
        """Schedule row `work` (head_kv, csr_row, q_begin, q_count, batch, kv_block) and its
        request's queries (q_start, q_len)."""
        head_kv = mMeta[work, 0]
        csr_row = mMeta[work, 1]
        q_begin = mMeta[work, 2]
        q_count = mMeta[work, 3]
        batch = mMeta[work, 4]
        kv_block = mMeta[work, 5]
        q_start = mCuQ[batch]
        q_len = mCuQ[batch + 1] - q_start
        return head_kv, csr_row, q_begin, q_count, batch, kv_block, q_start, q_len

    @cute.jit
    def _kv_block_bounds(self, mK: cute.Tensor, mCuK: cute.Tensor, mKvLens: cute.Tensor,
                         mPageTable: cute.Tensor, batch: cutlass.Int32,
                         kv_block: cutlass.Int32, q_len: cutlass.Int32):
        """(kv_row0, n_keys, causal_shift) of KV block kv_block of request batch: its first token
        (dense) or physical page (paged); how many of its keys exist and may be read (0 for a
        page outside the table or the pool; never past the K/V tensor); and the bottom-right
        causal shift (block key j is visible to query q_local iff j <= q_local + shift)."""
        k_len = mKvLens[batch]
        key0 = kv_block * BLOCK_N
        n_keys = cutlass.min(k_len - key0, BLOCK_N)
        kv_row0 = cutlass.Int32(0)
        if cutlass.const_expr(self.paged):
            kv_row0 = -1
            if kv_block < mPageTable.shape[1]:
                kv_row0 = mPageTable[batch, kv_block]
            if kv_row0 < 0 or kv_row0 >= mK.shape[0]:
                n_keys = 0
                kv_row0 = 0
        else:
            kv_row0 = mCuK[batch] + key0
            n_keys = cutlass.min(n_keys, mK.shape[0] - kv_row0)
        return kv_row0, n_keys, k_len - q_len - key0

    @cute.jit
    def _softmax_rows(self, s_rc: cute.Tensor, tScS: cute.Tensor, n_my_rows: cutlass.Constexpr,
                      n_my_cols: cutlass.Constexpr, sEntry: cute.Tensor, stage: cutlass.Int32,
                      n_keys: cutlass.Int32, causal: cutlass.Int32, causal_shift: cutlass.Int32,
                      scale_log2: cutlass.Float32, inv_temperature: cutlass.Float32,
                      want_lse_t: cutlass.Int32, row_lse: cute.Tensor, row_lse_t: cute.Tensor,
                      row_inv_sum: cute.Tensor):
        """Single-block softmax of this thread's rows of S (s_rc, in place: S -> unnormalized
        P = exp(S - row max)): causal / length mask, row max and sum over the quad, and per row
        1/sum, LSE and the temperature LSE (-inf and 0 for a row that sees no key)."""
        for i in cutlass.range_constexpr(n_my_rows):
            r = tScS[i, 0][0]
            packed = sEntry[r // self.group, stage]
            visible_end = n_keys                       # keys [0, visible_end) visible
            if causal != 0:
                visible_end = cutlass.min(visible_end,
                                          (packed & LOCAL_QUERY_MASK) + causal_shift + 1)
            row_max = mask_row_and_max(s_rc, i, tScS, n_my_cols, visible_end, BLOCK_N)
            row_max = quad_max(row_max)
            # Fully masked row: use 0 as the max so exp2 gives exact zeros, never NaN.
            max_scaled = row_max * scale_log2
            if row_max == -cutlass.Float32.inf:
                max_scaled = 0.0
            row_sum = cutlass.Float32(0.0)
            row_sum_t = cutlass.Float32(0.0)
            # The flag test stays outside the element loops: a branch per element
            # would split the loop into blocks the scheduler cannot interleave.
            if want_lse_t != 0:
                for j in cutlass.range_constexpr(n_my_cols):
                    row_sum_t = row_sum_t + cute.math.exp2(
                        (s_rc[i, j] * scale_log2 - max_scaled) * inv_temperature,
                        fastmath=True)
            for j in cutlass.range_constexpr(n_my_cols):
                p = cute.math.exp2(s_rc[i, j] * scale_log2 - max_scaled, fastmath=True)
                row_sum = row_sum + p
                s_rc[i, j] = p
            row_sum = quad_sum(row_sum)
            row_inv_sum[i] = 0.0
            row_lse[i] = -cutlass.Float32.inf
            row_lse_t[i] = -cutlass.Float32.inf
            if row_sum > 0.0:
                row_inv_sum[i] = 1.0 / row_sum
                row_lse[i] = (max_scaled + cute.math.log2(row_sum, fastmath=True)) * LN_2
            if want_lse_t != 0:
                row_sum_t = quad_sum(row_sum_t)
                if row_sum_t > 0.0:
                    row_lse_t[i] = (max_scaled * inv_temperature
                                    + cute.math.log2(row_sum_t, fastmath=True)) * LN_2

    @cute.jit
    def _write_partial_rows(self, tWsO: cute.Tensor, tWcO: cute.Tensor, warp_row0: cutlass.Int32,
                            tScS: cute.Tensor, n_my_rows: cutlass.Constexpr,
                            row_lse: cute.Tensor, row_lse_t: cute.Tensor,
                            want_lse_t: cutlass.Int32, sEntry: cute.Tensor,
                            stage: cutlass.Int32, q_start: cutlass.Int32, q_len: cutlass.Int32,
                            head_kv: cutlass.Int32, mOPartial: cute.Tensor,
                            mLsePartial: cute.Tensor, mLseTPartial: cute.Tensor,
                            thr_store_o, store_o_copy: cute.TiledCopy,
                            warp_row_stride0: cute.Layout, lane: cutlass.Int32):
        """Write this warp's staged partial-O rows (tWsO: its slice of the shared O tile, rows
        warp_row0 + tWcO) and the LSE / LSE_T of this thread's accumulator rows to slot
        `packed >> SLOT_SHIFT` of their query; rows without a query of the request are skipped.
        The shared reads come first and unconditionally (one vectorized fragment), so their
        swizzled addresses are not recomputed inside each row's branch."""
        r_out = cute.make_fragment_like(tWsO)
        r_out.store(tWsO.load())
        if cutlass.const_expr(mOPartial.element_type is not tWsO.element_type):
            # e4m3 partials staged in 16 bits (values already on the e4m3 grid): convert, and
            # write each lane's elements as one narrower vector on the same thread mapping.
            r_narrow = cute.make_fragment_like(r_out, mOPartial.element_type)
            r_narrow.store(r_out.load().to(mOPartial.element_type))
            r_out = r_narrow
            store_o_copy = warp_row_store_copy(mOPartial.element_type, HEAD_DIM,
                                               128 // tWsO.element_type.width)
            thr_store_o = store_o_copy.get_slice(lane)
        for m in cutlass.range_constexpr(cute.size(tWsO.shape[1])):
            r = warp_row0 + tWcO[0, m, 0][0]
            packed = sEntry[r // self.group, stage]
            q_local = packed & LOCAL_QUERY_MASK
            if packed >= 0 and q_local < q_len:
                o_row = mOPartial[packed >> SLOT_SHIFT, q_start + q_local,
                                  head_kv * self.group + r % self.group, None]
                gO = thr_store_o.partition_D(cute.make_tensor(o_row.iterator, warp_row_stride0))
                cute.copy(store_o_copy, r_out[None, m, None], gO[None, m, None])
        self._write_lse_rows(tScS, n_my_rows, row_lse, row_lse_t, want_lse_t, sEntry, stage,
                             q_start, q_len, head_kv, mLsePartial, mLseTPartial, lane)

    @cute.jit
    def _write_lse_rows(self, tScS: cute.Tensor, n_my_rows: cutlass.Constexpr,
                        row_lse: cute.Tensor, row_lse_t: cute.Tensor, want_lse_t: cutlass.Int32,
                        sEntry: cute.Tensor, stage: cutlass.Int32, q_start: cutlass.Int32,
                        q_len: cutlass.Int32, head_kv: cutlass.Int32, mLsePartial: cute.Tensor,
                        mLseTPartial: cute.Tensor, lane: cutlass.Int32):
        """LSE (and LSE_T) of this thread's accumulator rows into slot `packed >> SLOT_SHIFT` of
        their query (one lane per quad: the quad shares a row); rows without a query of the
        request are skipped."""
        if lane % 4 == 0:
            for i in cutlass.range_constexpr(n_my_rows):
                r = tScS[i, 0][0]
                packed = sEntry[r // self.group, stage]
                q_local = packed & LOCAL_QUERY_MASK
                if packed >= 0 and q_local < q_len:
                    slot = packed >> SLOT_SHIFT
                    q_abs = q_start + q_local
                    hq = head_kv * self.group + r % self.group
                    mLsePartial[slot, q_abs, hq] = row_lse[i]
                    if want_lse_t != 0:
                        mLseTPartial[slot, q_abs, hq] = row_lse_t[i]

    @cute.jit
    def _load_kv_rows(self, row_copy_: cute.TiledCopy, tidx: cutlass.Int32, mKV: cute.Tensor,
                      kv_row0: cutlass.Int32, head_kv: cutlass.Int32, n_keys: cutlass.Int32,
                      dst: cute.Tensor, through_registers: cutlass.Constexpr = False):
        """Load the block's 128 x 128 K or V rows into dst, a (key, channel) view of a shared
        tile; keys at or past n_keys are zero-filled and nothing is read out of bounds.
        row_copy_ is a cp.async row copy (dst has the source's element type), or, with
        through_registers, plain 16-byte loads whose registers are converted to dst's element
        type and stored through dst (bf16 [key, channel] from e4m3, or the e4m3 Vt [channel,
        key] of the transposed store)."""
        thr = row_copy_.get_slice(tidx)
        tXd = thr.partition_D(dst)
        tXc = thr.partition_S(cute.make_identity_tensor((BLOCK_N, HEAD_DIM)))
        row_stride0 = cute.make_layout((BLOCK_N, HEAD_DIM), stride=(0, 1))
        for m in cutlass.range_constexpr(cute.size(tXd.shape[1])):
            key = tXc[0, m, 0][0]
            if key < n_keys:
                ptr = kv_row_iterator(mKV, self.paged, kv_row0, head_kv, key)
                gX = thr.partition_S(cute.make_tensor(ptr, row_stride0))
                if cutlass.const_expr(through_registers):
                    frag = cute.make_fragment_like(gX[None, m, None])
                    cute.copy(row_copy_, gX[None, m, None], frag)
                    tXd[None, m, None].store(frag.load().to(dst.element_type))
                else:
                    cute.copy(row_copy_, gX[None, m, None], tXd[None, m, None])
            else:
                tXd[None, m, None].fill(0)

    @cute.jit
    def _load_gather_entries(self, entries: cute.Tensor, mQsplit: cute.Tensor,
                             head_kv: cutlass.Int32, entry0: cutlass.Int32,
                             tile_q0: cutlass.Int32, q_count: cutlass.Int32, tXcX: cute.Tensor):
        """entries[m] = packed qsplit entry of the m-th row this thread gathers (or -1)."""
        for m in cutlass.range_constexpr(cute.size(entries)):
            entries[m] = self._entry(mQsplit, head_kv, entry0, tile_q0, q_count,
                                     tXcX[0, m, 0][0])

    @cute.jit
    def _gather_q_tile(self, entries: cute.Tensor, sQ_stages: cute.Tensor, sEntry: cute.Tensor,
                       stage: cutlass.Int32, thr_copy, gather_copy: cute.TiledCopy,
                       tXcX: cute.Tensor, mQ: cute.Tensor, q_start: cutlass.Int32,
                       q_len: cutlass.Int32, head_kv: cutlass.Int32, row_stride0: cute.Layout,
                       tidx: cutlass.Int32):
        """Issue the cp.async gather of one Q tile into stage `stage` (row r = query r // G,
        head r % G; missing queries zero-filled) and record each query's entry in sEntry."""
        tXsQ = thr_copy.partition_D(sQ_stages[None, None, stage])
        for m in cutlass.range_constexpr(cute.size(entries)):
            r = tXcX[0, m, 0][0]
            packed = entries[m]
            q_local = packed & LOCAL_QUERY_MASK
            if tidx % 8 == 0 and r % self.group == 0:
                sEntry[r // self.group, stage] = packed
            if packed >= 0 and q_local < q_len:
                q_row = mQ[q_start + q_local, head_kv * self.group + r % self.group, None]
                gQ = thr_copy.partition_S(cute.make_tensor(q_row.iterator, row_stride0))
                cute.copy(gather_copy, gQ[None, m, None], tXsQ[None, m, None])
            else:
                tXsQ[None, m, None].fill(0)

    @cute.jit
    def _entry(self, mQsplit: cute.Tensor, head_kv: cutlass.Int32, entry0: cutlass.Int32,
               tile_q0: cutlass.Int32, q_count: cutlass.Int32, row: cutlass.Int32) -> cutlass.Int32:
        """Packed (q_local | slot << 24) of tile row `row`, or -1 past the work item's end."""
        local = tile_q0 + row // self.group
        packed = cutlass.Int32(-1)
        if local < q_count:
            packed = mQsplit[head_kv, entry0 + local]
        return packed
