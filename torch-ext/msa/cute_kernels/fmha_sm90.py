"""Dense FMHA forward for Hopper (sm_90a), the plain block loop: the max-score form (O and the
per-block max-score output, fmha mode 1) and the split-KV form of
cute_kernels.variants.FMHA_FORMS. (O-only calls run on the warp-specialized forms,
fmha_sm90_ws.py.)

Semantics (contract §2.2, msa.reference.dense_attention): for request b, batch-local query i and
q head h (KV head h // G), key j is visible iff j < kv_len[b] and, when causal,
j <= i + qo_offset[b]; O = output_scale * softmax(logit_scale * q k^T) v over the visible keys,
0 for a row that sees none.

Work decomposition (query-outer, FlashAttention style):

* a CTA owns 128 consecutive queries of one request and one q head: two warpgroups of 64 rows,
  each with its own Q rows in shared memory (loaded once, zero-filled past q_len);
* it streams the request's 128-key blocks 0 .. (last block any of its queries sees) through a
  two-stage cp.async ring (K and V of one block per stage, zero-filled past kv_len, pages looked
  up in page_table when paged), shared by both warpgroups;
* per block each warpgroup runs S = Q K^T (SS wgmma m64n128k16 x 8), the online softmax
  (running row max and sum, accumulator rescaled when the max grows, masking only in rows that
  do not see the whole block), and O += P V with P in registers (RS wgmma, V MN-major; e4m3:
  P rounded to e4m3, V transposed per block into a key-permuted Vt);
* at the end O / sum * output_scale is staged in the warpgroup's Q rows and written as 16-byte
  row segments (split-KV: fp32 partial rows and their LSE, straight from the accumulator).

Per block: a barrier, then S, the softmax and P V, each waited for (the max-score and split-KV
calls it serves are few; the O-only calls run the warp-specialized forms).

Shared memory: Q 2 x 16 KB + 2 stages x (K 32 KB + V 32 KB) = 160 KB, one CTA (8 warps) per SM.
Grid (max query tiles, Hq, B) (split-KV: B x num_splits); x runs from the last (heaviest under
causal masking) tile. Every index read from a tensor (lengths, offsets, pages) is clamped to the
tensor it addresses: a request's rows past the tensors are neither read nor written.

Tensors (dynamic sizes are runtime values):
  q            [total_q, Hq, 128] bf16 / e4m3   o  [total_q, Hq, 128] bf16
  k, v         dense [total_k, Hkv, 128] or paged [pages, Hkv, 128, 128], q's dtype
  cu_seqlens_q [B+1] int32; cu_seqlens_k [B+1] int32 (dense token offsets; unused when paged)
  kv_lens      [B] int32;  qo_offset [B] int32;  page_table [B, max_pages] int32 (paged)
  logit_scale_log2, output_scale: fp32; causal: int32 flag.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from .copies import copy_kv_rows, load_q_rows, row_copy, smem_tile
from .epilogue import write_o_rows
from .fp8 import register_p_operand, transpose_v_copies, transpose_v_words
from .geometry import BLOCK_N, HEAD_DIM, LN_2, WG_ROWS
from .mma import (mmas_and_o_copies, warpgroup_gemm, wgmma_accumulator_as_operand_a,
                  wgmma_rows_cols_view)
from .scheduling import request_bounds, tile_key_blocks
from .softmax import online_softmax, quad_sum

NUM_WARPGROUPS = 2
TILE_M = WG_ROWS * NUM_WARPGROUPS
NUM_THREADS = 128 * NUM_WARPGROUPS
KV_STAGES = 2


class FmhaSm90:
    """The plain block loop, configured at compile time (dense or paged K/V, bf16 or e4m3);
    FmhaSm90MaxScore and FmhaSm90Split are the compiled forms."""

    def __init__(self, paged: bool, dtype=cutlass.BFloat16):
        assert dtype in (cutlass.BFloat16, cutlass.Float8E4M3FN), dtype
        self.paged = paged
        self.dtype = dtype                 # q, k, v
        self.out_dtype = cutlass.BFloat16  # O (bf16 for e4m3 q too, contract §2.2)
        # e4m3: QK^T on e4m3 wgmma; P rounded to e4m3 and kept in registers; V transposed per
        # block into a key-permuted Vt tile (the e4m3 B operand must be K-major).
        self.fp8 = dtype.width == 8

    @cute.jit
    def _launch(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor,
                cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, kv_lens: cute.Tensor,
                qo_offset: cute.Tensor, page_table: cute.Tensor,
                logit_scale_log2: cutlass.Float32, output_scale: cutlass.Float32,
                causal: cutlass.Int32, grid_q_tiles: cutlass.Int32, max_score, score_scale,
                stream, split=None):
        """Launch with or without the max-score output (max_score None: O only); with split =
        (lse_partial, num_splits), o is o_partial and the split-KV kernel runs."""
        # K-major 128-byte-swizzle atom (8 rows x 64 bf16); the swizzle rides on the pointer.
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        q_layout = cute.tile_to_shape(atom, (WG_ROWS, HEAD_DIM, NUM_WARPGROUPS), (0, 1, 2))
        kv_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM, KV_STAGES), (0, 1, 2))

        # e4m3 only (placeholders otherwise): the key-permuted Vt tile and a bf16 O tile (the
        # e4m3 Q rows are too small to stage O in).
        vt_layout = kv_layout
        o_layout = kv_layout
        if cutlass.const_expr(self.fp8):
            vt_layout = cute.tile_to_shape(atom, (HEAD_DIM, BLOCK_N), (0, 1))
            o_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                                     self.out_dtype)
            o_layout = cute.tile_to_shape(o_atom, (WG_ROWS, HEAD_DIM, NUM_WARPGROUPS), (0, 1, 2))
        SharedStorage = self._shared_storage(q_layout, kv_layout, vt_layout, o_layout)

        # A warpgroup loads its own 64 Q rows (16 per step); the whole CTA loads K / V blocks.
        q_copy = row_copy(self.dtype, 16)
        kv_copy = row_copy(self.dtype, NUM_THREADS // 8)
        mma_qk, mma_pv, stage_o_copy, store_o_copy = mmas_and_o_copies(self.dtype,
                                                                       self.out_dtype)
        launch = dict(grid=(grid_q_tiles, cute.size(q.shape[1]),
                            cute.size(cu_seqlens_q.shape[0]) - 1),
                      block=(NUM_THREADS, 1, 1), stream=stream)
        if cutlass.const_expr(split is not None):
            lse_partial, num_splits = split
            launch["grid"] = (grid_q_tiles, cute.size(q.shape[1]),
                              (cute.size(cu_seqlens_q.shape[0]) - 1) * num_splits)
            self.kernel_split(q, k, v, o, lse_partial, num_splits, cu_seqlens_q, cu_seqlens_k,
                              kv_lens, qo_offset, page_table, logit_scale_log2, output_scale,
                              causal, q_layout, kv_layout, q_copy, kv_copy, mma_qk, mma_pv,
                              stage_o_copy, store_o_copy, vt_layout, o_layout,
                              SharedStorage).launch(**launch)
        else:
            self.kernel_max_score(q, k, v, o, cu_seqlens_q, cu_seqlens_k, kv_lens, qo_offset,
                                  page_table, logit_scale_log2, output_scale, causal, max_score,
                                  score_scale, q_layout, kv_layout, q_copy, kv_copy, mma_qk,
                                  mma_pv, stage_o_copy, store_o_copy, vt_layout, o_layout,
                                  SharedStorage).launch(**launch)

    @cute.kernel
    def kernel_max_score(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                         mO: cute.Tensor, mCuQ: cute.Tensor, mCuK: cute.Tensor,
                         mKvLens: cute.Tensor, mOffset: cute.Tensor, mPageTable: cute.Tensor,
                         scale_log2: cutlass.Float32, output_scale: cutlass.Float32,
                         causal: cutlass.Int32, mMaxScore: cute.Tensor,
                         score_scale: cutlass.Float32, q_layout: cute.ComposedLayout,
                         kv_layout: cute.ComposedLayout, q_copy: cute.TiledCopy,
                         kv_copy: cute.TiledCopy, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
                         stage_o_copy: cute.TiledCopy, store_o_copy: cute.TiledCopy,
                         vt_layout, o_layout, SharedStorage: cutlass.Constexpr):
        self._cta(mQ, mK, mV, mO, mCuQ, mCuK, mKvLens, mOffset, mPageTable, scale_log2,
                  output_scale, causal, mMaxScore, score_scale, q_layout, kv_layout, q_copy,
                  kv_copy, mma_qk, mma_pv, stage_o_copy, store_o_copy, vt_layout, o_layout,
                  SharedStorage)

    @cute.kernel
    def kernel_split(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                     mOPartial: cute.Tensor, mLsePartial: cute.Tensor, num_splits: cutlass.Int32,
                     mCuQ: cute.Tensor, mCuK: cute.Tensor, mKvLens: cute.Tensor,
                     mOffset: cute.Tensor, mPageTable: cute.Tensor,
                     scale_log2: cutlass.Float32, output_scale: cutlass.Float32,
                     causal: cutlass.Int32, q_layout: cute.ComposedLayout,
                     kv_layout: cute.ComposedLayout, q_copy: cute.TiledCopy,
                     kv_copy: cute.TiledCopy, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
                     stage_o_copy: cute.TiledCopy, store_o_copy: cute.TiledCopy, vt_layout,
                     o_layout, SharedStorage: cutlass.Constexpr):
        """Split-KV: grid z = request x split. A tile's key blocks [0, n_blocks) are cut into
        num_splits ranges of ceil(n_blocks / num_splits); this CTA streams its range (the keys
        shifted to start at the range: key offset, causal offset and page-table column move
        with it) and writes fp32 partial rows o_partial[split] and their LSE."""
        self._cta(mQ, mK, mV, mOPartial, mCuQ, mCuK, mKvLens, mOffset, mPageTable, scale_log2,
                  output_scale, causal, None, None, q_layout, kv_layout, q_copy, kv_copy, mma_qk,
                  mma_pv, stage_o_copy, store_o_copy, vt_layout, o_layout, SharedStorage,
                  mLsePartial, num_splits)

    @cute.jit
    def _cta(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
             mCuQ: cute.Tensor, mCuK: cute.Tensor, mKvLens: cute.Tensor, mOffset: cute.Tensor,
             mPageTable: cute.Tensor, scale_log2: cutlass.Float32,
             output_scale: cutlass.Float32, causal: cutlass.Int32, mMaxScore, score_scale,
             q_layout: cute.ComposedLayout, kv_layout: cute.ComposedLayout,
             q_copy: cute.TiledCopy, kv_copy: cute.TiledCopy, mma_qk: cute.TiledMma,
             mma_pv: cute.TiledMma, stage_o_copy: cute.TiledCopy, store_o_copy: cute.TiledCopy,
             vt_layout, o_layout, SharedStorage: cutlass.Constexpr, mLsePartial=None,
             num_splits=None):
        """One CTA: its query tiles of one request and q head (mMaxScore None: O only). With
        num_splits (split-KV), grid z is request x split and mO is o_partial."""
        tidx, _, _ = cute.arch.thread_idx()
        cta_x, head, request = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        mLse = None
        if cutlass.const_expr(num_splits is not None):
            split = request % num_splits
            request = request // num_splits
            mO = mO[split, None, None, None]
            mLse = mLsePartial[split, None, None]
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_tidx = tidx % 128
        lane = tidx % 32
        warp_in_wg = cute.arch.make_warp_uniform(wg_tidx // 32)

        head_kv = head // (mQ.shape[1] // mK.shape[1])
        q_start, q_len, kv_len, offset, k_row0, n_q_tiles = request_bounds(
            mQ, mCuQ, mCuK, mKvLens, mOffset, mPageTable, request, mK.shape[0], self.paged,
            TILE_M)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ_wgs = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK_stages = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sV_stages = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sVt = None
        sO_wgs = None
        if cutlass.const_expr(self.fp8):
            sVt = storage.sVt.get_tensor(vt_layout.outer, swizzle=vt_layout.inner)
            sO_wgs = storage.sO.get_tensor(o_layout.outer, swizzle=o_layout.inner)

        # The last (heaviest) tiles first; x strides when the grid is smaller than the tiles.
        for walk in range(cta_x, n_q_tiles, grid_x):
            q_lo, n_blocks = tile_key_blocks(walk, n_q_tiles, q_len, kv_len, offset, causal,
                                             TILE_M)
            if cutlass.const_expr(num_splits is None):
                self._tile(mQ, mK, mV, mO, mPageTable, request, head, head_kv, q_start, q_len,
                           q_lo, kv_len, k_row0, offset, causal, n_blocks, scale_log2,
                           output_scale, tidx, wg, wg_tidx, lane, warp_in_wg, sQ_wgs, sK_stages,
                           sV_stages, q_copy, kv_copy, mma_qk, mma_pv, stage_o_copy,
                           store_o_copy, mMaxScore, score_scale, sVt, sO_wgs)
            else:
                # This split's key blocks of the tile, the key origin shifted to the first.
                per_split = (n_blocks + num_splits - 1) // num_splits
                first = cutlass.min(split * per_split, n_blocks)
                count = cutlass.min(per_split, n_blocks - first)
                shift = first * BLOCK_N
                table = mPageTable
                if cutlass.const_expr(self.paged):
                    table = cute.make_tensor(mPageTable.iterator + first, mPageTable.layout)
                self._tile(mQ, mK, mV, mO, table, request, head, head_kv, q_start, q_len, q_lo,
                           kv_len - shift, k_row0 + shift, offset - shift, causal, count,
                           scale_log2, output_scale, tidx, wg, wg_tidx, lane, warp_in_wg,
                           sQ_wgs, sK_stages, sV_stages, q_copy, kv_copy, mma_qk, mma_pv,
                           stage_o_copy, store_o_copy, None, None, sVt, None, mLse)

    @cute.jit
    def _tile(self, mQ, mK, mV, mO, mPageTable, request, head, head_kv, q_start, q_len, q_lo,
              kv_len, k_row0, offset, causal, n_blocks, scale_log2, output_scale, tidx, wg,
              wg_tidx, lane, warp_in_wg, sQ_wgs, sK_stages, sV_stages, q_copy, kv_copy, mma_qk,
              mma_pv, stage_o_copy, store_o_copy, mMaxScore=None, score_scale=None, sVt=None,
              sO_wgs=None, mLse=None):
        """One 128-query tile: load Q, stream the key blocks, write O (and, with mMaxScore,
        each row's scaled max over the visible keys of every block it streams). With mLse
        (split-KV), mO is fp32: the rows are written straight from the accumulator, normalized
        over this call's blocks, with their LSE (natural log, logit scale included)."""
        # V^T (channel x key) views of the V stages for the B operand of O = P V.
        sVt_stages = cute.composition(
            sV_stages, cute.make_ordered_layout((HEAD_DIM, BLOCK_N, KV_STAGES), order=(1, 0, 2)))

        # ---- Q rows of this warpgroup (zero past q_len) ------------------------------------
        thr_q_copy = q_copy.get_slice(wg_tidx)
        sQ_mine = sQ_wgs[None, None, wg]
        tQsQ = thr_q_copy.partition_D(sQ_mine)
        tQcQ = thr_q_copy.partition_S(cute.make_identity_tensor((WG_ROWS, HEAD_DIM)))
        wg_q0 = q_lo + wg * WG_ROWS
        load_q_rows(mQ, q_copy, thr_q_copy, tQsQ, tQcQ, wg_q0, q_start, q_len, head)

        thr_kv_copy = kv_copy.get_slice(tidx)
        tKVcKV = thr_kv_copy.partition_S(cute.make_identity_tensor((BLOCK_N, HEAD_DIM)))
        kv_row_stride0 = cute.make_layout((BLOCK_N, HEAD_DIM), stride=(0, 1))

        if n_blocks > 0:
            self._load_kv_block(mK, mV, mPageTable, request, head_kv, k_row0, kv_len, 0, 0,
                                sK_stages, sV_stages, thr_kv_copy, kv_copy, tKVcKV,
                                kv_row_stride0)
        cute.arch.cp_async_commit_group()                # Q rides in the first group

        # ---- warpgroup MMA operands --------------------------------------------------------
        thr_qk = mma_qk.get_slice(wg_tidx)
        thr_pv = mma_pv.get_slice(wg_tidx)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ_wgs))[None, None, None, wg]
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK_stages))      # (.., .., K, stage)
        if cutlass.const_expr(self.fp8):
            tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))       # (.., .., K)
        else:
            tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt_stages))  # (.., .., K, stage)
        acc_s_shape = thr_qk.partition_shape_C((WG_ROWS, BLOCK_N))
        tScS = wgmma_rows_cols_view(thr_qk.partition_C(
            cute.make_identity_tensor((WG_ROWS, BLOCK_N))))
        n_my_rows = cute.size(tScS, mode=[0])
        n_my_cols = cute.size(tScS, mode=[1])
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((WG_ROWS, HEAD_DIM)),
                                      cutlass.Float32)
        acc_o.fill(0.0)
        o_rc = wgmma_rows_cols_view(acc_o)
        row_max = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)   # running, scaled log2
        row_sum = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)   # this thread's part
        for i in cutlass.range_constexpr(n_my_rows):
            row_max[i] = -cutlass.Float32.inf
            row_sum[i] = 0.0

        for blk in range(n_blocks):
            stage = blk % KV_STAGES
            # After the barrier both warpgroups are also done with the stage refilled below.
            self._publish_stages()
            if blk + 1 < n_blocks:
                self._load_kv_block(mK, mV, mPageTable, request, head_kv, k_row0, kv_len,
                                    blk + 1, 1 - stage, sK_stages, sV_stages, thr_kv_copy,
                                    kv_copy, tKVcKV, kv_row_stride0)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.fp8):
                # V(blk) -> Vt, keys permuted; every warpgroup finished P V(blk - 1) on Vt
                # before the barrier above.
                self._transpose_v(sV_stages[None, None, stage], sVt, tidx)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()

            # ---- S = Q K^T -----------------------------------------------------------------
            acc_s = cute.make_rmem_tensor(acc_s_shape, cutlass.Float32)
            warpgroup_gemm(mma_qk, acc_s, tSrQ, tSrK[None, None, None, stage])

            # ---- online softmax ------------------------------------------------------------
            max_score = None
            if cutlass.const_expr(mMaxScore is not None):
                max_score = (mMaxScore, score_scale, head, q_start, q_len, lane)
            online_softmax(acc_s, blk, row_max, row_sum, tScS, wg_q0, kv_len, offset, causal,
                           scale_log2, o_rc=o_rc, max_score=max_score)

            # ---- O += P V (P in registers) -------------------------------------------------
            if cutlass.const_expr(self.fp8):
                # P rounded to e4m3 (as the reference's p_quant models an FP8 MMA), handed
                # to the RS wgmma in the key order of the permuted Vt.
                r_p8 = cute.make_fragment_like(acc_s, self.dtype)
                r_p8.store(acc_s.load().to(self.dtype))
                t_p8 = register_p_operand(r_p8, thr_pv.partition_shape_A((WG_ROWS, BLOCK_N)))
                warpgroup_gemm(mma_pv, acc_o, t_p8, tOrVt, accumulate=True)
            else:
                r_p = cute.make_fragment_like(acc_s, self.dtype)
                r_p.store(acc_s.load().to(self.dtype))
                t_p = wgmma_accumulator_as_operand_a(r_p)
                warpgroup_gemm(mma_pv, acc_o, t_p, tOrVt[None, None, None, stage],
                               accumulate=True)
        cute.arch.cp_async_wait_group(0)
        # The Q rows are staged over below by other threads than the ones that loaded (or
        # zero-filled) them: with no key block the loop's barrier never ran.
        cute.arch.sync_threads()

        if cutlass.const_expr(mLse is not None):
            self._write_split_rows(mO, mLse, o_rc, row_max, row_sum, tScS, n_my_rows,
                                   n_my_cols, wg_q0, q_start, q_len, head, output_scale, lane)
        else:
            sO_mine = sQ_mine                              # bf16: O takes the Q rows' place
            if cutlass.const_expr(self.fp8):
                sO_mine = sO_wgs[None, None, wg]
            write_o_rows(mO, o_rc, acc_o, row_sum, n_my_rows, n_my_cols, output_scale,
                         sO_mine, wg_tidx, warp_in_wg, lane, wg_q0, q_start, q_len, head,
                         stage_o_copy, store_o_copy, self.out_dtype)
        # The next tile of this CTA reloads Q into these rows: everyone must be done reading.
        cute.arch.sync_threads()

    @cute.jit
    def _write_split_rows(self, mO, mLse, o_rc, row_max, row_sum, tScS,
                          n_my_rows: cutlass.Constexpr, n_my_cols: cutlass.Constexpr, wg_q0,
                          q_start, q_len, head, output_scale, lane):
        """Split-KV partial rows: O_s = acc / sum * output_scale (fp32, straight from the
        accumulator) and LSE_s = (max + log2 sum) ln 2; a row that saw no key of this split
        gets O_s = 0 and LSE_s = -inf (weight 0 in the combine)."""
        for i in cutlass.range_constexpr(n_my_rows):
            total = quad_sum(row_sum[i])
            inv = cutlass.Float32(0.0)
            lse = -cutlass.Float32.inf
            if total > 0.0:
                inv = output_scale / total
                lse = (row_max[i] + cute.math.log2(total, fastmath=True)) * LN_2
            q_local = wg_q0 + tScS[i, 0][0]
            if q_local < q_len:
                for j in cutlass.range_constexpr(n_my_cols):
                    mO[q_start + q_local, head, tScS[i, j][1]] = o_rc[i, j] * inv
                if lane % 4 == 0:
                    mLse[q_start + q_local, head] = lse

    @cute.jit
    def _load_kv_block(self, mK: cute.Tensor, mV: cute.Tensor, mPageTable: cute.Tensor,
                       request: cutlass.Int32, head_kv: cutlass.Int32, k_row0: cutlass.Int32,
                       kv_len: cutlass.Int32, blk: cutlass.Int32, stage: cutlass.Int32,
                       sK_stages: cute.Tensor, sV_stages: cute.Tensor, thr_kv_copy,
                       kv_copy: cute.TiledCopy, tKVcKV: cute.Tensor,
                       kv_row_stride0: cute.Layout):
        """cp.async the K and V rows of key block `blk` into `stage`; keys past kv_len (or on a
        page outside the pool) are zero-filled, never read."""
        n_keys = cutlass.min(kv_len - blk * BLOCK_N, BLOCK_N)
        base = k_row0 + blk * BLOCK_N
        if cutlass.const_expr(self.paged):
            base = mPageTable[request, blk]
            if base < 0 or base >= mK.shape[0]:
                n_keys = 0
                base = 0
        tKsK = thr_kv_copy.partition_D(sK_stages[None, None, stage])
        tVsV = thr_kv_copy.partition_D(sV_stages[None, None, stage])
        copy_kv_rows(mK, mV, self.paged, base, head_kv, n_keys, kv_copy, thr_kv_copy, tKsK, tVsV,
                     tKVcKV, kv_row_stride0)

    def _shared_storage(self, q_layout, kv_layout, vt_layout, o_layout):
        """Shared-memory struct: Q, K and V stages; e4m3 adds the key-permuted Vt tile and a
        bf16 O tile (fields built as real annotations: this module's are strings)."""
        fields = {"sQ": smem_tile(self.dtype, q_layout),
                  "sK": smem_tile(self.dtype, kv_layout), "sV": smem_tile(self.dtype, kv_layout)}
        if self.fp8:
            fields["sVt"] = smem_tile(self.dtype, vt_layout)
            fields["sO"] = smem_tile(self.out_dtype, o_layout)
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def _transpose_v(self, sV_stage: cute.Tensor, sVt: cute.Tensor, tidx: cutlass.Int32):
        """e4m3: the V rows of a stage (key, channel) into Vt (channel, pi(key)), the key order
        register_p_operand hands P in, a 4-byte word per store (fp8.transpose_v_words)."""
        load, store = transpose_v_copies(self.dtype)
        transpose_v_words(sV_stage, sVt, load, store, tidx)

    @cute.jit
    def _publish_stages(self):
        """Every thread's cp.async rows have landed and are visible to the async proxy (wgmma
        reads shared memory through it); every warpgroup has passed its previous wgmma waits."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

class FmhaSm90MaxScore(FmhaSm90):
    """The kernel that also writes the max-score output (fmha mode 1, O + score):
    max_score [Hq, max_k_tiles, total_q] fp32, filled with -inf by the caller; the kernel writes
    score_scale * (max over the visible keys of the block) for every block a row's tile
    streams. Arguments: FmhaSm90's, then max_score and score_scale before the stream."""

    def __init__(self, paged: bool, dtype=cutlass.BFloat16):
        super().__init__(paged, dtype)

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor,
                 cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, kv_lens: cute.Tensor,
                 qo_offset: cute.Tensor, page_table: cute.Tensor,
                 logit_scale_log2: cutlass.Float32, output_scale: cutlass.Float32,
                 causal: cutlass.Int32, grid_q_tiles: cutlass.Int32, max_score: cute.Tensor,
                 score_scale: cutlass.Float32, stream):
        self._launch(q, k, v, o, cu_seqlens_q, cu_seqlens_k, kv_lens, qo_offset, page_table,
                     logit_scale_log2, output_scale, causal, grid_q_tiles, max_score,
                     score_scale, stream)


class FmhaSm90Split(FmhaSm90):
    """Split-KV (decode-like plans: few query tiles, long KV): FmhaSm90 whose CTAs each stream
    one of num_splits ranges of a tile's key blocks and write fp32 partial rows
    o_partial [num_splits, total_q, Hq, 128] and lse_partial [num_splits, total_q, Hq]; the
    sparse combine (pf32, one slot per split) merges them. Arguments: FmhaSm90's with o replaced
    by o_partial, lse_partial, and num_splits before the stream."""

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o_partial: cute.Tensor,
                 lse_partial: cute.Tensor, cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor,
                 kv_lens: cute.Tensor, qo_offset: cute.Tensor, page_table: cute.Tensor,
                 logit_scale_log2: cutlass.Float32, output_scale: cutlass.Float32,
                 causal: cutlass.Int32, grid_q_tiles: cutlass.Int32, num_splits: cutlass.Int32,
                 stream):
        self._launch(q, k, v, o_partial, cu_seqlens_q, cu_seqlens_k, kv_lens, qo_offset,
                     page_table, logit_scale_log2, output_scale, causal, grid_q_tiles, None,
                     None, stream, split=(lse_partial, num_splits))
