"""Block-sparse prefill attention, KV-outer, on Hopper warpgroup MMA (wgmma), bf16 partials.

Same work decomposition and semantics as sparse_prefill_sm90.SparsePrefillSm90 (read its module
docstring for the work item, the tile, the masking and the softmax). What differs is the MMA:

* one warpgroup (4 warps, 128 threads) per CTA and 64-row M tiles (64 / G queries x G heads);
* S = Q K^T is one SS wgmma chain m64n128k16 x 8 reading Q and K straight from shared memory,
  O = P V an RS wgmma chain with P (bf16) in registers and V^T read as an MN-major operand;
* shared tiles use the canonical 128-byte swizzle, carried by the shared-memory pointer (the
  wgmma descriptors require it), and are filled with cp.async, so every gather ends with a
  generic -> async proxy fence before the barrier that precedes the wgmma;
* O is staged (bf16) in the warp's own 16 Q rows of the current stage, then streamed out in
  16-byte vectors, as in the warp-MMA kernel.

About 97 KB of shared memory and < 200 registers per thread: two CTAs per SM, so one CTA's
softmax and epilogue overlap the other's MMAs. Compared with 4 warps of mma.sync, shared-memory
operand traffic per tile drops from 4 x (Q rows + K + V) to Q + K + V.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass.cute.nvgpu import cpasync, warpgroup

from .sparse_prefill_sm90 import (BLOCK_N, HEAD_DIM, LN_2, LOCAL_QUERY_MASK, LOG2_E, Q_STAGES,
                                  ROWS_PER_WARP, SLOT_SHIFT, SparsePrefillSm90)
from .tile_utils import (quad_max, quad_sum, wgmma_accumulator_as_operand_a,
                         wgmma_rows_cols_view)

TILE_M = 64            # one warpgroup MMA row block
NUM_THREADS = 128


class SparsePrefillSm90Wgmma(SparsePrefillSm90):
    """wgmma variant; bf16 partials only (fp32 partials use the warp-MMA kernel)."""

    def __init__(self, qhead_per_kv: int, paged: bool, partial_dtype=cutlass.BFloat16):
        super().__init__(qhead_per_kv, paged, partial_dtype)
        assert partial_dtype.width == 16, "the wgmma kernel stages O in the bf16 Q tile"
        self.tile_m = TILE_M
        self.num_threads = NUM_THREADS
        self.queries_per_tile = TILE_M // qhead_per_kv

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                 cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, kv_lens: cute.Tensor,
                 page_table: cute.Tensor, k2q_row_ptr: cute.Tensor, qsplit: cute.Tensor,
                 metadata: cute.Tensor, work_count: cute.Tensor, o_partial: cute.Tensor,
                 lse_partial: cute.Tensor, lse_t_partial: cute.Tensor,
                 softmax_scale: cutlass.Float32, inv_temperature: cutlass.Float32,
                 causal: cutlass.Int32, want_lse_t: cutlass.Int32, stream):
        # K-major 128-byte-swizzle atom (8 rows x 64 bf16); its swizzle goes on the pointer.
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        q_layout = cute.tile_to_shape(atom, (TILE_M, HEAD_DIM, Q_STAGES), (0, 1, 2))
        kv_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sEntry: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, TILE_M * Q_STAGES], 16]

        copy_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                        self.dtype, num_bits_per_copy=128)
        gather_copy = cute.make_tiled_copy_tv(
            copy_atom, cute.make_layout((NUM_THREADS // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)))
        mma_qk = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (TILE_M, BLOCK_N))
        # V is stored [key, channel]: as the B operand (channel x key) of O = P V it is MN-major.
        mma_pv = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (TILE_M, HEAD_DIM), a_source=warpgroup.OperandSource.RMEM)
        stage_o_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.partial_dtype,
                                num_bits_per_copy=2 * self.partial_dtype.width), mma_pv)
        vec = 128 // self.partial_dtype.width
        lanes_per_row = HEAD_DIM // vec
        store_o_copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.partial_dtype,
                                num_bits_per_copy=128),
            cute.make_layout((32 // lanes_per_row, lanes_per_row), stride=(lanes_per_row, 1)),
            cute.make_layout((1, vec)))

        scale_log2 = softmax_scale * LOG2_E
        self.kernel_wgmma(q, k, v, cu_seqlens_q, cu_seqlens_k, kv_lens, page_table, k2q_row_ptr,
                          qsplit, metadata, work_count, o_partial, lse_partial, lse_t_partial,
                          scale_log2, inv_temperature, causal, want_lse_t, q_layout, kv_layout,
                          gather_copy, mma_qk, mma_pv, stage_o_copy, store_o_copy,
                          SharedStorage).launch(
            grid=(cute.size(metadata.shape[0]), 1, 1), block=(NUM_THREADS, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel_wgmma(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuQ: cute.Tensor,
                     mCuK: cute.Tensor, mKvLens: cute.Tensor, mPageTable: cute.Tensor,
                     mRowPtr: cute.Tensor, mQsplit: cute.Tensor, mMeta: cute.Tensor,
                     mWorkCount: cute.Tensor, mOPartial: cute.Tensor, mLsePartial: cute.Tensor,
                     mLseTPartial: cute.Tensor, scale_log2: cutlass.Float32,
                     inv_temperature: cutlass.Float32, causal: cutlass.Int32,
                     want_lse_t: cutlass.Int32, q_layout: cute.ComposedLayout,
                     kv_layout: cute.ComposedLayout, gather_copy: cute.TiledCopy,
                     mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
                     stage_o_copy: cute.TiledCopy, store_o_copy: cute.TiledCopy,
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
            causal_shift = k_len - q_len - key0

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ_stages = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
            sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
            sV = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
            sEntry = storage.sEntry.get_tensor(cute.make_layout((TILE_M, Q_STAGES)))
            # V^T (channel x key) view for the B operand of O = P V.
            sVt = cute.composition(sV, cute.make_ordered_layout((HEAD_DIM, BLOCK_N), order=(1, 0)))

            thr_copy = gather_copy.get_slice(tidx)
            tXsK = thr_copy.partition_D(sK)
            tXsV = thr_copy.partition_D(sV)
            tXcKV = thr_copy.partition_S(cute.make_identity_tensor((BLOCK_N, HEAD_DIM)))
            kv_row_stride0 = cute.make_layout((BLOCK_N, HEAD_DIM), stride=(0, 1))
            tXcX = thr_copy.partition_S(cute.make_identity_tensor((TILE_M, HEAD_DIM)))
            row_stride0 = cute.make_layout((TILE_M, HEAD_DIM), stride=(0, 1))

            for m in cutlass.range_constexpr(cute.size(tXsK.shape[1])):
                key = tXcKV[0, m, 0][0]
                if key < n_keys:
                    k_ptr = self._kv_row_ptr(mK, kv_row0, head_kv, key)
                    v_ptr = self._kv_row_ptr(mV, kv_row0, head_kv, key)
                    gK = thr_copy.partition_S(cute.make_tensor(k_ptr, kv_row_stride0))
                    gV = thr_copy.partition_S(cute.make_tensor(v_ptr, kv_row_stride0))
                    cute.copy(gather_copy, gK[None, m, None], tXsK[None, m, None])
                    cute.copy(gather_copy, gV[None, m, None], tXsV[None, m, None])
                else:
                    tXsK[None, m, None].fill(0)
                    tXsV[None, m, None].fill(0)

            # ---- warpgroup MMA operands ------------------------------------------------------
            thr_qk = mma_qk.get_slice(tidx)
            thr_pv = mma_pv.get_slice(tidx)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ_stages))   # (.., .., K, stage)
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
            tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
            acc_s_shape = thr_qk.partition_shape_C((TILE_M, BLOCK_N))
            acc_o_shape = thr_pv.partition_shape_C((TILE_M, HEAD_DIM))
            tScS = wgmma_rows_cols_view(thr_qk.partition_C(
                cute.make_identity_tensor((TILE_M, BLOCK_N))))
            n_my_rows = cute.size(tScS, mode=[0])
            n_my_cols = cute.size(tScS, mode=[1])

            thr_stage_o = stage_o_copy.get_slice(tidx)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tidx % 32
            thr_store_o = store_o_copy.get_slice(lane)
            tWcO = thr_store_o.partition_S(cute.make_identity_tensor((ROWS_PER_WARP, HEAD_DIM)))
            warp_row_stride0 = cute.make_layout((ROWS_PER_WARP, HEAD_DIM), stride=(0, 1))

            entry0 = mRowPtr[head_kv, csr_row] + q_begin
            n_tiles = (q_count + self.queries_per_tile - 1) // self.queries_per_tile
            n_gather_rows = cute.size(tXcX.shape[1])
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
                cute.arch.cp_async_wait_group(0)
                # cp.async and st.shared are generic-proxy writes; wgmma reads through the
                # async proxy.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
                if tile + 1 < n_tiles:
                    self._gather_q_tile(gather_entries, sQ_stages, sEntry, 1 - stage, thr_copy,
                                        gather_copy, tXcX, mQ, q_start, q_len, head_kv,
                                        row_stride0, tidx)
                    self._load_gather_entries(gather_entries, mQsplit, head_kv, entry0,
                                              (tile + 2) * self.queries_per_tile, q_count, tXcX)
                cute.arch.cp_async_commit_group()

                # ---- S = Q K^T (SS wgmma) ------------------------------------------------------
                acc_s = cute.make_rmem_tensor(acc_s_shape, cutlass.Float32)
                tSrQ_stage = tSrQ[None, None, None, stage]
                warpgroup.fence()
                qk_atom = cute.make_mma_atom(mma_qk.op)
                qk_atom.set(warpgroup.Field.ACCUMULATE, False)
                for kk in cutlass.range_constexpr(cute.size(tSrQ_stage.shape[2])):
                    cute.gemm(qk_atom, acc_s, tSrQ_stage[None, None, kk], tSrK[None, None, kk],
                              acc_s)
                    qk_atom.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # ---- mask + single-block softmax ---------------------------------------------
                s_rc = wgmma_rows_cols_view(acc_s)
                row_lse = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
                row_lse_t = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
                row_inv_sum = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
                for i in cutlass.range_constexpr(n_my_rows):
                    r = tScS[i, 0][0]
                    packed = sEntry[r // self.group, stage]
                    visible_end = n_keys
                    if causal != 0:
                        visible_end = cutlass.min(visible_end,
                                                  (packed & LOCAL_QUERY_MASK) + causal_shift + 1)
                    row_max = -cutlass.Float32.inf
                    for j in cutlass.range_constexpr(n_my_cols):
                        if tScS[0, j][1] >= visible_end:
                            s_rc[i, j] = -cutlass.Float32.inf
                        row_max = cute.arch.fmax(row_max, s_rc[i, j])
                    row_max = quad_max(row_max)
                    max_scaled = row_max * scale_log2
                    if row_max == -cutlass.Float32.inf:
                        max_scaled = 0.0
                    row_sum = cutlass.Float32(0.0)
                    row_sum_t = cutlass.Float32(0.0)
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

                # ---- O = P V (RS wgmma, P in registers) ----------------------------------------
                r_p = cute.make_fragment_like(acc_s, self.dtype)
                r_p.store(acc_s.load().to(self.dtype))
                t_p = wgmma_accumulator_as_operand_a(r_p)
                acc_o = cute.make_rmem_tensor(acc_o_shape, cutlass.Float32)
                warpgroup.fence()
                pv_atom = cute.make_mma_atom(mma_pv.op)
                pv_atom.set(warpgroup.Field.ACCUMULATE, False)
                for kk in cutlass.range_constexpr(cute.size(t_p.shape[2])):
                    cute.gemm(pv_atom, acc_o, t_p[None, None, kk], tOrVt[None, None, kk], acc_o)
                    pv_atom.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # ---- normalize, stage in this warp's Q rows, write whole partial rows ----------
                o_rc = wgmma_rows_cols_view(acc_o)
                for i in cutlass.range_constexpr(n_my_rows):
                    for j in cutlass.range_constexpr(n_my_cols):
                        o_rc[i, j] = o_rc[i, j] * row_inv_sum[i]
                r_o = cute.make_fragment_like(acc_o, self.partial_dtype)
                r_o.store(acc_o.load().to(self.partial_dtype))
                # Warp w's accumulator rows are tile rows 16w..16w+15, the Q rows only its own
                # S wgmma read (complete: wait_group(0) above).
                sO = sQ_stages[None, None, stage]
                cute.copy(stage_o_copy, thr_stage_o.retile(r_o), thr_stage_o.partition_D(sO))
                cute.arch.sync_warp()
                tWsO = thr_store_o.partition_S(
                    cute.local_tile(sO, (ROWS_PER_WARP, HEAD_DIM), (warp_idx, 0)))
                for m in cutlass.range_constexpr(cute.size(tWsO.shape[1])):
                    r = warp_idx * ROWS_PER_WARP + tWcO[0, m, 0][0]
                    packed = sEntry[r // self.group, stage]
                    q_local = packed & LOCAL_QUERY_MASK
                    if packed >= 0 and q_local < q_len:
                        o_row = mOPartial[packed >> SLOT_SHIFT, q_start + q_local,
                                          head_kv * self.group + r % self.group, None]
                        gO = thr_store_o.partition_D(cute.make_tensor(o_row.iterator,
                                                                      warp_row_stride0))
                        cute.copy(store_o_copy, tWsO[None, m, None], gO[None, m, None])
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
