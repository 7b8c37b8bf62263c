"""Block-sparse prefill attention, KV-outer, on Hopper warpgroup MMA (wgmma): form "wgmma" of
cute_kernels.variants.SPARSE_FORMS (16-bit or e4m3 partials, every dtype mode; the G 8 / 16
bf16 and all-e4m3 calls run on the TMA forms, sparse_prefill_sm90_ws.py).

Same work decomposition and semantics as the warp-MMA kernel (sparse_common.py: the work item,
the tile, the masking and the softmax). What differs is the MMA:

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

FP8 modes (``mode``; no scale factors are applied, contract §1.2):

* ``"bf16"``         bf16 Q/K/V (the path described above);
* ``"bf16_kv_e4m3"`` bf16 Q, e4m3 K/V (FP8 KV cache): K and V are loaded to registers, converted
  to bf16 and stored into the same bf16 tiles, then the bf16 path runs unchanged;
* ``"e4m3_pv_bf16"`` e4m3 Q/K/V with pv_dtype bf16: S = Q K^T on e4m3 wgmma (m64n128k32, fp32
  accumulate) from e4m3 Q/K tiles, V converted to bf16 as above, P.V as in the bf16 path;
* ``"e4m3"``         e4m3 Q/K/V with pv_dtype e4m3: e4m3 S wgmma; P = exp(s - m) rounded to e4m3
  and kept in registers for an RS P.V wgmma; V is stored transposed (Vt, channel x key,
  key-contiguous) because e4m3 wgmma needs K-major B. The normalizer is the sum of the unrounded
  P, as the reference's pv_quant_dtype models it. The e4m3 A fragment of an RS wgmma (m64nNk32)
  holds k = 4t + {0..3} and 16 + 4t + {0..3} (t = lane % 4) where the S accumulator holds
  columns 8j + 2t + {0, 1}; instead of moving P, the key order of the Vt tile is permuted so
  that accumulator column c lands at k = pi(c), with
  c = e + 2t + 8 jlo + 16 jhi + 32 g  ->  pi(c) = e + 4t + 2 jlo + 16 jhi + 32 g
  (a bijection inside each 32-key group, applied once per block by the transposing V store).
  Each A register then takes two converted accumulator pairs of the same row: no shared P tile
  and no barrier before P.V.
With e4m3 Q tiles (half the bytes) O cannot be staged in the Q rows: a separate bf16 tile is used.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass.cute.nvgpu import warpgroup

from .copies import copy_kv_rows, row_copy, smem_tile, warp_row_store_copy
from .fp8 import register_p_key_order, register_p_operand
from .geometry import BLOCK_N, HEAD_DIM, LOCAL_QUERY_MASK, LOG2_E, ROWS_PER_WARP, WG_ROWS
from .mma import (scale_rows, warpgroup_gemm, warpgroup_gemm_issue,
                  wgmma_accumulator_as_operand_a, wgmma_rows_cols_view)
from .sparse_common import SparsePrefillBase

TILE_M = WG_ROWS       # one warpgroup MMA row block
NUM_THREADS = 128
Q_STAGES = 2           # Q tile double buffer
MODES = ("bf16", "bf16_kv_e4m3", "e4m3_pv_bf16", "e4m3")


class SparsePrefillSm90Wgmma(SparsePrefillBase):
    """wgmma variant; bf16, fp16 or e4m3 partials (fp32 partials use the warp-MMA kernel).

    mode (see the module docstring) fixes the element types: qk_dtype (Q and K tiles, S MMA),
    kv_in_dtype (K/V in global memory), pv_dtype (P and V operands of O = P V)."""

    def __init__(self, qhead_per_kv: int, paged: bool, partial_dtype=cutlass.BFloat16,
                 mode: str = "bf16"):
        super().__init__(qhead_per_kv, paged, partial_dtype)
        assert partial_dtype.width == 16 or partial_dtype is cutlass.Float8E4M3FN, partial_dtype
        # O is staged in a 16-bit tile; e4m3 partials are staged as fp16 holding the values
        # already rounded to e4m3 (exact: one cvt each way), converted back as rows are written.
        self.stage_dtype = partial_dtype if partial_dtype.width == 16 else cutlass.Float16
        assert mode in MODES, mode
        self.tile_m = TILE_M
        self.num_threads = NUM_THREADS
        self.queries_per_tile = TILE_M // qhead_per_kv
        e4m3 = cutlass.Float8E4M3FN
        self.mode = mode
        self.qk_dtype = e4m3 if mode in ("e4m3_pv_bf16", "e4m3") else cutlass.BFloat16
        self.kv_in_dtype = cutlass.BFloat16 if mode == "bf16" else e4m3
        self.pv_dtype = e4m3 if mode == "e4m3" else cutlass.BFloat16
        # Which K/V tiles cannot be a plain cp.async of global memory.
        self.convert_k = self.kv_in_dtype is not self.qk_dtype
        self.convert_v = self.kv_in_dtype is not self.pv_dtype
        # e4m3 P.V: P in registers (RS wgmma) against a transposed, key-permuted Vt tile.
        self.transpose_v = self.pv_dtype.width == 8
        # O is staged (bf16) in the Q rows only when the Q tile is 16-bit.
        self.stage_o_in_q = self.qk_dtype.width == 16
        # 128-byte lines per Q row (2 for bf16, 1 for e4m3): the unit of the L2 prefetch.
        self.q_lines_per_row = HEAD_DIM * self.qk_dtype.width // 8 // 128

    def _shared_storage(self, q_layout, k_layout, v_layout, o_layout):
        """Shared-memory struct; the O tile exists only in the modes that use it (fields built as
        real annotations: this module's annotations are strings)."""
        fields = {"sQ": smem_tile(self.qk_dtype, q_layout),
                  "sK": smem_tile(self.qk_dtype, k_layout),
                  "sV": smem_tile(self.pv_dtype, v_layout)}
        if not self.stage_o_in_q:
            fields["sO"] = smem_tile(self.stage_dtype, o_layout)
        fields["sEntry"] = cute.struct.Align[
            cute.struct.MemRange[cutlass.Int32, TILE_M * Q_STAGES], 16]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                 cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, kv_lens: cute.Tensor,
                 page_table: cute.Tensor, k2q_row_ptr: cute.Tensor, qsplit: cute.Tensor,
                 metadata: cute.Tensor, work_count: cute.Tensor, o_partial: cute.Tensor,
                 lse_partial: cute.Tensor, lse_t_partial: cute.Tensor,
                 softmax_scale: cutlass.Float32, inv_temperature: cutlass.Float32,
                 causal: cutlass.Int32, want_lse_t: cutlass.Int32, stream):
        # K-major 128-byte-swizzle atom (8 rows x 128 bytes); its swizzle goes on the pointer.
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.qk_dtype)
        q_layout = cute.tile_to_shape(atom, (TILE_M, HEAD_DIM, Q_STAGES), (0, 1, 2))
        kv_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM), (0, 1))
        # o_layout is a placeholder in the modes without a separate O tile.
        v_layout = kv_layout
        o_layout = kv_layout
        if cutlass.const_expr(self.pv_dtype is not self.qk_dtype):
            # e4m3 Q/K with bf16 P.V: V is a bf16 [key, channel] tile.
            v_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                                     self.pv_dtype)
            v_layout = cute.tile_to_shape(v_atom, (BLOCK_N, HEAD_DIM), (0, 1))
        if cutlass.const_expr(self.transpose_v):
            # e4m3 P.V: Vt [channel, key] (key contiguous), K-major.
            v_layout = cute.tile_to_shape(atom, (HEAD_DIM, BLOCK_N), (0, 1))
        if cutlass.const_expr(not self.stage_o_in_q):
            o_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                                     self.stage_dtype)
            o_layout = cute.tile_to_shape(o_atom, (TILE_M, HEAD_DIM), (0, 1))
        SharedStorage = self._shared_storage(q_layout, kv_layout, v_layout, o_layout)

        # 16-byte chunks: 8 (bf16) or 16 (e4m3) elements per thread per row segment.
        gather_copy = row_copy(self.qk_dtype, NUM_THREADS // 8)
        # e4m3 K/V rows that must be converted or transposed: 16 bytes per thread into
        # registers (plain loads), 8 threads per 128-channel row.
        convert_load = row_copy(self.kv_in_dtype, NUM_THREADS // 8, async_copy=False)
        mma_qk = hopper.make_trivial_tiled_mma(
            self.qk_dtype, self.qk_dtype, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K, cutlass.Float32, (1, 1, 1), (TILE_M, BLOCK_N))
        if cutlass.const_expr(self.transpose_v):
            # e4m3 P.V with P in registers (RS) and the key-permuted Vt (K-major).
            mma_pv = hopper.make_trivial_tiled_mma(
                self.pv_dtype, self.pv_dtype, cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.K, cutlass.Float32, (1, 1, 1), (TILE_M, HEAD_DIM),
                a_source=warpgroup.OperandSource.RMEM)
        else:
            # V is stored [key, channel]: as the B operand (channel x key) of O = P V it is
            # MN-major.
            mma_pv = hopper.make_trivial_tiled_mma(
                self.pv_dtype, self.pv_dtype, cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.MN, cutlass.Float32, (1, 1, 1), (TILE_M, HEAD_DIM),
                a_source=warpgroup.OperandSource.RMEM)
        stage_o_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.stage_dtype,
                                num_bits_per_copy=2 * self.stage_dtype.width), mma_pv)
        store_o_copy = warp_row_store_copy(self.stage_dtype, HEAD_DIM)

        scale_log2 = softmax_scale * LOG2_E
        self.kernel_wgmma(q, k, v, cu_seqlens_q, cu_seqlens_k, kv_lens, page_table, k2q_row_ptr,
                          qsplit, metadata, work_count, o_partial, lse_partial, lse_t_partial,
                          scale_log2, inv_temperature, causal, want_lse_t, q_layout, kv_layout,
                          v_layout, o_layout, gather_copy, convert_load, mma_qk, mma_pv,
                          stage_o_copy, store_o_copy, SharedStorage).launch(
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
                     kv_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout,
                     o_layout: cute.ComposedLayout, gather_copy: cute.TiledCopy,
                     convert_load: cute.TiledCopy, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
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
            sQ_stages = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
            sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
            sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
            sEntry = storage.sEntry.get_tensor(cute.make_layout((TILE_M, Q_STAGES)))
            if cutlass.const_expr(self.transpose_v):
                # sV already is V^T (channel x key); the load writes it through a (key, channel)
                # view that stores key c of the block at Vt column pi(c) (module docstring).
                sVt = sV
                sV_rows = cute.composition(sV, register_p_key_order())
            else:
                # V^T (channel x key) view for the B operand of O = P V.
                sVt = cute.composition(sV, cute.make_ordered_layout((HEAD_DIM, BLOCK_N),
                                                                    order=(1, 0)))
                sV_rows = sV

            thr_copy = gather_copy.get_slice(tidx)
            tXsK = thr_copy.partition_D(sK)
            tXsV = thr_copy.partition_D(sV_rows)
            tXcKV = thr_copy.partition_S(cute.make_identity_tensor((BLOCK_N, HEAD_DIM)))
            kv_row_stride0 = cute.make_layout((BLOCK_N, HEAD_DIM), stride=(0, 1))
            tXcX = thr_copy.partition_S(cute.make_identity_tensor((TILE_M, HEAD_DIM)))
            row_stride0 = cute.make_layout((TILE_M, HEAD_DIM), stride=(0, 1))

            if cutlass.const_expr(self.mode == "bf16"):
                copy_kv_rows(mK, mV, self.paged, kv_row0, head_kv, n_keys, gather_copy,
                             thr_copy, tXsK, tXsV, tXcKV, kv_row_stride0)
            else:
                # FP8 modes: K by cp.async when its tile keeps e4m3, else converted; V always
                # goes through registers (converted to bf16, or transposed for e4m3 P.V).
                if cutlass.const_expr(self.convert_k):
                    self._load_kv_rows(convert_load, tidx, mK, kv_row0, head_kv, n_keys, sK,
                                       through_registers=True)
                else:
                    self._load_kv_rows(gather_copy, tidx, mK, kv_row0, head_kv, n_keys, sK)
                self._load_kv_rows(convert_load, tidx, mV, kv_row0, head_kv, n_keys, sV_rows,
                                   through_registers=True)

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

            (thr_stage_o, warp_idx, lane, thr_store_o, tWcO,
             warp_row_stride0) = self._epilogue_partitions(stage_o_copy, store_o_copy, tidx)

            entry0, n_tiles = self._tile_span(mRowPtr, head_kv, csr_row, q_begin, q_count)
            gather_entries = self._start_q_gather(tXcX, mQsplit, head_kv, entry0, q_count,
                                                  sQ_stages, sEntry, thr_copy, gather_copy, mQ,
                                                  q_start, q_len, row_stride0, tidx)
            # L2 prefetch two tiles ahead (no shared memory): thread t owns one 128-byte line
            # of tile row t // lines_per_row. Its entry is loaded a tile before it is used, so
            # the prefetch address never waits on a global load.
            prefetch_row = tidx // self.q_lines_per_row
            prefetch_entry = self._entry(mQsplit, head_kv, entry0, 2 * self.queries_per_tile,
                                         q_count, prefetch_row)
            # Software pipeline over query tiles: S(t+1) = Q(t+1) K^T is issued before tile t's
            # epilogue (normalize, stage, store), so the tensor core works while the warps
            # write partials. Q(t+2) is gathered into tile t's stage once its staged O rows
            # are stored.
            acc_s = cute.make_rmem_tensor(acc_s_shape, cutlass.Float32)
            cute.arch.cp_async_wait_group(0)
            # cp.async and st.shared are generic-proxy writes; wgmma reads through the
            # async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if n_tiles > 1:
                prefetch_entry = self._gather_q_tile_ahead(
                    1, 1, n_tiles, prefetch_entry, prefetch_row, gather_entries, sQ_stages,
                    sEntry, thr_copy, gather_copy, tXcX, mQ, mQsplit, entry0, q_count, q_start,
                    q_len, head_kv, row_stride0, tidx)
            cute.arch.cp_async_commit_group()
            warpgroup_gemm_issue(mma_qk, acc_s, tSrQ[None, None, None, 0], tSrK)
            for tile in range(n_tiles):
                stage = tile % Q_STAGES
                warpgroup.wait_group(0)                      # S(tile) = Q K^T is in acc_s

                # ---- mask + single-block softmax ---------------------------------------------
                s_rc = wgmma_rows_cols_view(acc_s)
                row_lse, row_lse_t, row_inv_sum = self._tile_softmax(
                    s_rc, tScS, n_my_rows, n_my_cols, sEntry, stage, n_keys, causal,
                    causal_shift, scale_log2, inv_temperature, want_lse_t)

                if cutlass.const_expr(self.transpose_v):
                    # ---- O = P V, e4m3 (RS wgmma): P rounded to e4m3, regrouped in registers -
                    r_p8 = cute.make_fragment_like(acc_s, self.pv_dtype)
                    r_p8.store(acc_s.load().to(self.pv_dtype))
                    t_p8 = register_p_operand(r_p8, thr_pv.partition_shape_A((TILE_M, BLOCK_N)))
                    acc_o = cute.make_rmem_tensor(acc_o_shape, cutlass.Float32)
                    warpgroup_gemm(mma_pv, acc_o, t_p8, tOrVt)
                else:
                    # ---- O = P V (RS wgmma, P in registers) ------------------------------------
                    r_p = cute.make_fragment_like(acc_s, self.pv_dtype)
                    r_p.store(acc_s.load().to(self.pv_dtype))
                    t_p = wgmma_accumulator_as_operand_a(r_p)
                    acc_o = cute.make_rmem_tensor(acc_o_shape, cutlass.Float32)
                    warpgroup_gemm(mma_pv, acc_o, t_p, tOrVt)

                # ---- issue S(tile + 1) while this tile's partials are written --------------
                if tile + 1 < n_tiles:
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.sync_threads()
                    warpgroup_gemm_issue(mma_qk, acc_s, tSrQ[None, None, None, 1 - stage],
                                         tSrK)

                # ---- normalize, stage in this warp's Q rows, write whole partial rows ----------
                scale_rows(wgmma_rows_cols_view(acc_o), row_inv_sum)
                r_o = cute.make_fragment_like(acc_o, self.stage_dtype)
                if cutlass.const_expr(self.stage_dtype is self.partial_dtype):
                    r_o.store(acc_o.load().to(self.partial_dtype))
                else:   # rounded once, to e4m3; fp16 holds it exactly
                    r_o.store(acc_o.load().to(self.partial_dtype).to(self.stage_dtype))
                # Warp w's accumulator rows are tile rows 16w..16w+15, the Q rows only its own
                # S wgmma read (complete: wait_group(0) above), viewed as the 16-bit stage
                # type. e4m3 Q tiles are too small: a separate 16-bit tile (each warp again
                # touches only its own rows).
                if cutlass.const_expr(self.stage_o_in_q):
                    sO = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner,
                                               dtype=self.stage_dtype)[None, None, stage]
                else:
                    sO = storage.sO.get_tensor(o_layout.outer, swizzle=o_layout.inner)
                cute.copy(stage_o_copy, thr_stage_o.retile(r_o), thr_stage_o.partition_D(sO))
                cute.arch.sync_warp()
                tWsO = thr_store_o.partition_S(
                    cute.local_tile(sO, (ROWS_PER_WARP, HEAD_DIM), (warp_idx, 0)))
                self._write_partial_rows(tWsO, tWcO, warp_idx * ROWS_PER_WARP, tScS, n_my_rows,
                                         row_lse, row_lse_t, want_lse_t, sEntry, stage,
                                         q_start, q_len, head_kv, mOPartial, mLsePartial,
                                         mLseTPartial, thr_store_o, store_o_copy,
                                         warp_row_stride0, lane)

                # ---- gather Q(tile + 2) into this tile's stage -------------------------------
                if tile + 2 < n_tiles:
                    cute.arch.sync_threads()          # every warp has stored its staged O rows
                    prefetch_entry = self._gather_q_tile_ahead(
                        tile + 2, stage, n_tiles, prefetch_entry, prefetch_row, gather_entries,
                        sQ_stages, sEntry, thr_copy, gather_copy, tXcX, mQ, mQsplit, entry0,
                        q_count, q_start, q_len, head_kv, row_stride0, tidx)
                cute.arch.cp_async_commit_group()
            warpgroup.wait_group(0)          # no tile (q_count == 0): S(0) was still issued

    @cute.jit
    def _gather_q_tile_ahead(self, tile: cutlass.Int32, stage: cutlass.Int32,
                             n_tiles: cutlass.Int32, prefetch_entry: cutlass.Int32,
                             prefetch_row: cutlass.Int32, gather_entries: cute.Tensor,
                             sQ_stages: cute.Tensor, sEntry: cute.Tensor, thr_copy,
                             gather_copy: cute.TiledCopy, tXcX: cute.Tensor, mQ: cute.Tensor,
                             mQsplit: cute.Tensor, entry0: cutlass.Int32,
                             q_count: cutlass.Int32, q_start: cutlass.Int32,
                             q_len: cutlass.Int32, head_kv: cutlass.Int32,
                             row_stride0: cute.Layout, tidx: cutlass.Int32) -> cutlass.Int32:
        """The Q-side pipeline step: gather tile `tile` into `stage` (gather_entries hold its
        entries), load the entries of tile + 1 and L2-prefetch tile + 1's rows (prefetch_entry
        holds this thread's entry of it). Returns this thread's entry of tile + 2, for the next
        prefetch."""
        self._gather_q_tile(gather_entries, sQ_stages, sEntry, stage, thr_copy, gather_copy,
                            tXcX, mQ, q_start, q_len, head_kv, row_stride0, tidx)
        self._load_gather_entries(gather_entries, mQsplit, head_kv, entry0,
                                  (tile + 1) * self.queries_per_tile, q_count, tXcX)
        if tile + 1 < n_tiles:
            self._prefetch_q_line(mQ, prefetch_entry, prefetch_row, q_start, q_len, head_kv,
                                  tidx)
            prefetch_entry = self._entry(mQsplit, head_kv, entry0,
                                         (tile + 2) * self.queries_per_tile, q_count,
                                         prefetch_row)
        return prefetch_entry

    @cute.jit
    def _prefetch_q_line(self, mQ: cute.Tensor, packed: cutlass.Int32, row: cutlass.Int32,
                         q_start: cutlass.Int32, q_len: cutlass.Int32, head_kv: cutlass.Int32,
                         tidx: cutlass.Int32):
        """prefetch.global.L2 of this thread's 128-byte line of Q tile row `row` (query
        row // G, head row % G), when the row holds a query of the request."""
        q_local = packed & LOCAL_QUERY_MASK
        if row < TILE_M and packed >= 0 and q_local < q_len:
            q_row = mQ[q_start + q_local, head_kv * self.group + row % self.group, None]
            line = tidx % self.q_lines_per_row
            elems_per_line = 1024 // self.qk_dtype.width
            cute.arch.prefetch((q_row.iterator + line * elems_per_line).llvm_ptr,
                               cache_level="L2")
