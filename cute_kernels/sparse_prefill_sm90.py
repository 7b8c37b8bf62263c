"""Block-sparse prefill attention, KV-outer, for Hopper (sm_90a), in the CuTe DSL.

One CTA per work item of the k2q schedule (msa.src.sm100.prepare_scheduler): a work item is
(KV head h, CSR row, q_begin, q_count, request b, KV block beta). The CTA loads the 128x128 K and
V block of (b, beta, h) into shared memory once, then walks the item's queries in M tiles of 128
rows = (128 / G queries) x (G query heads of KV head h). Per tile:

  gather Q rows (each query's G heads are G*128 contiguous elements of q [total_q, Hq, 128])
  S = Q K^T (fp32)  ->  scale, mask (j < k_len, causal bottom-right)  ->  single-block softmax
  O = P V  ->  normalize  ->  O_partial[slot, q_abs, hq, :], LSE_partial[slot, q_abs, hq]

The softmax covers one block only, so there is no online rescale: LSE_blk = m + ln sum exp(s - m)
(rows that see no key: LSE = -inf, O = 0). The combine kernel (combine.py) merges the slots.

MMA: warp-level mma.sync m16n8k16 (bf16 in, fp32 accumulate) with ldmatrix operand loads and
cp.async gathers; 8 warps, each owning 16 rows of the tile. This is the first correct version;
wgmma (sm_90a warpgroup MMA) is the planned upgrade (see docs/design-sparse-prefill.md).

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
from cutlass.cute.nvgpu import cpasync, warp

from .tile_utils import accumulator_as_operand_a, quad_max, quad_sum, rows_cols_view

HEAD_DIM = 128
BLOCK_N = 128          # keys per KV block (= page size)
TILE_M = 128           # query rows per MMA tile
NUM_THREADS = 256      # 8 warps x 16 rows
SLOT_SHIFT = 24
LOCAL_QUERY_MASK = (1 << SLOT_SHIFT) - 1
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


class SparsePrefillSm90:
    """Compile-time configuration of one attention variant (see cute_kernels.variants)."""

    def __init__(self, qhead_per_kv: int, paged: bool, partial_dtype=cutlass.Float32):
        assert qhead_per_kv in (1, 2, 4, 8, 16)
        self.group = qhead_per_kv
        self.queries_per_tile = TILE_M // qhead_per_kv
        self.paged = paged
        self.partial_dtype = partial_dtype
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
        tile_layout = cute.tile_to_shape(atom, (TILE_M, HEAD_DIM), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(tile_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(tile_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(tile_layout)], 1024]

        # Gmem -> smem: 16-byte cp.async chunks; 8 threads cover 64 columns of a row.
        copy_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                        self.dtype, num_bits_per_copy=128)
        gather_copy = cute.make_tiled_copy_tv(
            copy_atom, cute.make_layout((NUM_THREADS // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)))
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (NUM_THREADS // 32, 1, 1), permutation_mnk=(TILE_M, 16, 16))

        scale_log2 = softmax_scale * LOG2_E
        self.kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, kv_lens, page_table, k2q_row_ptr,
                    qsplit, metadata, work_count, o_partial, lse_partial, lse_t_partial,
                    scale_log2, inv_temperature, causal, want_lse_t, tile_layout, gather_copy,
                    tiled_mma, SharedStorage).launch(
            grid=(cute.size(metadata.shape[0]), 1, 1), block=(NUM_THREADS, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuQ: cute.Tensor,
               mCuK: cute.Tensor, mKvLens: cute.Tensor, mPageTable: cute.Tensor,
               mRowPtr: cute.Tensor, mQsplit: cute.Tensor, mMeta: cute.Tensor,
               mWorkCount: cute.Tensor, mOPartial: cute.Tensor, mLsePartial: cute.Tensor,
               mLseTPartial: cute.Tensor, scale_log2: cutlass.Float32,
               inv_temperature: cutlass.Float32, causal: cutlass.Int32,
               want_lse_t: cutlass.Int32, tile_layout: cute.ComposedLayout,
               gather_copy: cute.TiledCopy, tiled_mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        work, _, _ = cute.arch.block_idx()
        if work < mWorkCount[0]:
            head_kv = mMeta[work, 0]
            csr_row = mMeta[work, 1]
            q_begin = mMeta[work, 2]
            q_count = mMeta[work, 3]
            batch = mMeta[work, 4]
            kv_block = mMeta[work, 5]

            q_start = mCuQ[batch]
            q_len = mCuQ[batch + 1] - q_start
            k_len = mKvLens[batch]
            key0 = kv_block * BLOCK_N
            # Keys of this block that exist; never read past the K/V tensor.
            n_keys = cutlass.min(k_len - key0, BLOCK_N)
            kv_row0 = cutlass.Int32(0)     # dense: first token; paged: physical page
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
            causal_shift = k_len - q_len - key0   # key j visible iff j <= q_local + shift

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(tile_layout)
            sK = storage.sK.get_tensor(tile_layout)
            sV = storage.sV.get_tensor(tile_layout)
            # V^T view (D x N) for the B operand of O = P V.
            sVt = cute.composition(sV, cute.make_layout((HEAD_DIM, BLOCK_N), stride=(BLOCK_N, 1)))

            thr_copy = gather_copy.get_slice(tidx)
            tXsQ = thr_copy.partition_D(sQ)
            tXsK = thr_copy.partition_D(sK)
            tXsV = thr_copy.partition_D(sV)
            tXcX = thr_copy.partition_S(cute.make_identity_tensor((TILE_M, HEAD_DIM)))
            row_stride0 = cute.make_layout((TILE_M, HEAD_DIM), stride=(0, 1))

            # ---- K and V block: loaded once, rows past n_keys zero-filled --------------------
            for m in cutlass.range_constexpr(cute.size(tXsK.shape[1])):
                key = tXcX[0, m, 0][0]
                if key < n_keys:
                    k_ptr = self._kv_row_ptr(mK, kv_row0, head_kv, key)
                    v_ptr = self._kv_row_ptr(mV, kv_row0, head_kv, key)
                    gK = thr_copy.partition_S(cute.make_tensor(k_ptr, row_stride0))
                    gV = thr_copy.partition_S(cute.make_tensor(v_ptr, row_stride0))
                    cute.copy(gather_copy, gK[None, m, None], tXsK[None, m, None])
                    cute.copy(gather_copy, gV[None, m, None], tXsV[None, m, None])
                else:
                    tXsK[None, m, None].fill(0)
                    tXsV[None, m, None].fill(0)
            cute.arch.cp_async_commit_group()

            # ---- MMA partitions ---------------------------------------------------------------
            thr_mma = tiled_mma.get_slice(tidx)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                       self.dtype)
            ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                         self.dtype)
            copy_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
            copy_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
            copy_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
            tSsQ = copy_q.partition_S(sQ)
            tSrQ_view = copy_q.retile(tSrQ)
            tSsK = copy_k.partition_S(sK)
            tSrK_view = copy_k.retile(tSrK)
            tOsVt = copy_v.partition_S(sVt)
            tOrVt_view = copy_v.retile(tOrVt)

            tScS = rows_cols_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, BLOCK_N))))
            acc_shape = thr_mma.partition_shape_C((TILE_M, BLOCK_N))
            n_my_rows = cute.size(tScS, mode=[0])
            n_my_cols = cute.size(tScS, mode=[1])

            entry0 = mRowPtr[head_kv, csr_row] + q_begin
            n_tiles = (q_count + self.queries_per_tile - 1) // self.queries_per_tile
            for tile in range(n_tiles):
                tile_q0 = tile * self.queries_per_tile
                # ---- gather this tile's Q rows (row r = query r // G, head r % G) --------------
                for m in cutlass.range_constexpr(cute.size(tXsQ.shape[1])):
                    r = tXcX[0, m, 0][0]
                    packed = self._entry(mQsplit, head_kv, entry0, tile_q0, q_count, r)
                    q_local = packed & LOCAL_QUERY_MASK
                    if packed >= 0 and q_local < q_len:
                        q_row = mQ[q_start + q_local, head_kv * self.group + r % self.group, None]
                        gQ = thr_copy.partition_S(cute.make_tensor(q_row.iterator, row_stride0))
                        cute.copy(gather_copy, gQ[None, m, None], tXsQ[None, m, None])
                    else:
                        tXsQ[None, m, None].fill(0)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()

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
                for i in cutlass.range_constexpr(n_my_rows):
                    r = tScS[i, 0][0]
                    packed = self._entry(mQsplit, head_kv, entry0, tile_q0, q_count, r)
                    visible_end = n_keys                       # keys [0, visible_end) visible
                    if causal != 0:
                        visible_end = cutlass.min(visible_end,
                                                  (packed & LOCAL_QUERY_MASK) + causal_shift + 1)
                    row_max = -cutlass.Float32.inf
                    for j in cutlass.range_constexpr(n_my_cols):
                        if tScS[0, j][1] >= visible_end:
                            s_rc[i, j] = -cutlass.Float32.inf
                        row_max = cute.arch.fmax(row_max, s_rc[i, j])
                    row_max = quad_max(row_max)
                    # Fully masked row: use 0 as the max so exp2 gives exact zeros, never NaN.
                    max_scaled = row_max * scale_log2
                    if row_max == -cutlass.Float32.inf:
                        max_scaled = 0.0
                    row_sum = cutlass.Float32(0.0)
                    row_sum_t = cutlass.Float32(0.0)
                    for j in cutlass.range_constexpr(n_my_cols):
                        x = s_rc[i, j] * scale_log2 - max_scaled
                        p = cute.math.exp2(x, fastmath=True)
                        row_sum = row_sum + p
                        if want_lse_t != 0:
                            row_sum_t = row_sum_t + cute.math.exp2(x * inv_temperature,
                                                                   fastmath=True)
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

                # ---- O = P V (P stays in registers) -------------------------------------------
                r_p = cute.make_fragment_like(acc_s, self.dtype)
                r_p.store(acc_s.load().to(self.dtype))
                t_p = accumulator_as_operand_a(r_p)
                acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, HEAD_DIM)),
                                              cutlass.Float32)
                acc_o.fill(0.0)
                n_kv = cute.size(t_p.shape[2])
                cute.copy(copy_v, tOsVt[None, None, 0], tOrVt_view[None, None, 0])
                for kk in cutlass.range_constexpr(n_kv):
                    if cutlass.const_expr(kk + 1 < n_kv):
                        cute.copy(copy_v, tOsVt[None, None, kk + 1], tOrVt_view[None, None, kk + 1])
                    cute.gemm(tiled_mma, acc_o, t_p[None, None, kk], tOrVt[None, None, kk], acc_o)

                # ---- normalize and write this tile's partial rows -------------------------------
                o_rc = rows_cols_view(acc_o)
                lane_in_quad = tidx % 4
                for i in cutlass.range_constexpr(n_my_rows):
                    r = tScS[i, 0][0]
                    packed = self._entry(mQsplit, head_kv, entry0, tile_q0, q_count, r)
                    q_local = packed & LOCAL_QUERY_MASK
                    if packed >= 0 and q_local < q_len:
                        slot = packed >> SLOT_SHIFT
                        q_abs = q_start + q_local
                        hq = head_kv * self.group + r % self.group
                        o_row = mOPartial[slot, q_abs, hq, None]
                        for j in cutlass.range_constexpr(n_my_cols):
                            o_row[tScS[0, j][1]] = (o_rc[i, j] * row_inv_sum[i]).to(
                                self.partial_dtype)
                        if lane_in_quad == 0:
                            mLsePartial[slot, q_abs, hq] = row_lse[i]
                            if want_lse_t != 0:
                                mLseTPartial[slot, q_abs, hq] = row_lse_t[i]
                # The next tile overwrites sQ.
                cute.arch.sync_threads()

    @cute.jit
    def _kv_row_ptr(self, mKV: cute.Tensor, kv_row0: cutlass.Int32, head_kv: cutlass.Int32,
                    key: cutlass.Int32):
        """Address of the 128 channels of key `key` of the block (dense: token kv_row0 + key;
        paged: page kv_row0, slot key)."""
        if cutlass.const_expr(self.paged):
            return mKV[kv_row0, head_kv, key, None].iterator
        return mKV[kv_row0 + key, head_kv, None].iterator

    @cute.jit
    def _entry(self, mQsplit: cute.Tensor, head_kv: cutlass.Int32, entry0: cutlass.Int32,
               tile_q0: cutlass.Int32, q_count: cutlass.Int32, row: cutlass.Int32) -> cutlass.Int32:
        """Packed (q_local | slot << 24) of tile row `row`, or -1 past the work item's end."""
        local = tile_q0 + row // self.group
        packed = cutlass.Int32(-1)
        if local < q_count:
            packed = mQsplit[head_kv, entry0 + local]
        return packed
