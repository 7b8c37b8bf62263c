"""Dense FMHA forward for Hopper (sm_90a), warp-specialized: the O-only forms of
cute_kernels.variants.FMHA_FORMS (bf16 wsu / wsup, e4m3 wsuts / wsutps).

Same semantics as the plain block loop (fmha_sm90.py) and its arguments plus the SM count
(num_ctas), O only. One CTA per query tile of a (head, request), or, persistent, min(items,
num_ctas) CTAs walking the (query tile, head, request) items. e4m3: P is rounded to e4m3 in
registers straight into the A fragment of P V, in the key order of fp8.register_p_key_order, so
P V reads a key-permuted, K-major Vt: the Vt blocks come transposed ahead of the kernel (the
fmha_transpose_v_e4m3 CUDA op) and the producer TMA-loads them as it loads K.

Roles (384 threads, one CTA per SM; the persistent forms walk work items, see
scheduling.persistent_item / snake_item, and their producer loads Q too, see `_load_q`):

* warpgroup 0 is the producer (setmaxnreg down to PRODUCER_REGS); its warp 0 loads the K and V
  blocks of every tile the CTA walks with TMA into a KV_STAGES-deep ring, K and V with their own
  full / empty mbarriers (full: one arrival plus the TMA's transaction bytes; empty: one arrival
  per consumer warp). Dense K/V: a 128-row box at the request's token offset (rows past the
  tensor are zero-filled by the TMA; rows past kv_len that belong to the next request are read
  and masked). Paged: the page from page_table (a page id outside the pool is out of the box's
  bounds, so the TMA zero-fills it). bf16: the V block holding kv_len's tail goes through a
  scratch mbarrier instead: the producer waits for it, zeroes the rows past kv_len (a masked P
  is exactly 0, but 0 * NaN from unused page slots or unused cache rows is not) and only then
  arrives on the V full barrier (e4m3 Vt blocks are zero past kv_len already).
* warpgroups 1 and 2 are consumers (setmaxnreg up to MMA_REGS), 64 query rows each, Q loaded by
  the warpgroup itself with cp.async (zero past q_len) or, persistent, by the producer. Per key
  block j a consumer issues S(j) = Q K(j)^T and O += P(j-1) V(j-1) back to back in one turn,
  waits for both, then runs the softmax of block j and rescales O; block 0's S and the last P V
  are peeled so the loop body issues its wgmmas unconditionally.
* static stages: every tile starts on K/V stage 0, the blocks every row of the tile sees whole
  run in unrolled pairs (block 2i+1 on stage 1, 2i+2 on stage 0, no mask), the rest one by one,
  and the consumer body is traced once per warpgroup, so that every wgmma descriptor is a
  constant offset of the shared-memory base held in uniform registers (rebuilding them in
  vector registers costs ~12 instructions per wgmma, the longest part of a turn). Stage phases
  come from the parity of each stage's uses (_stage_phase).
* ping-pong: the two GEMM issues of a block are a turn; turns alternate between the consumers
  through two named barriers (a consumer waits on its own, then arrives on the other's), so
  one warpgroup's softmax runs under the other's GEMMs (FlashAttention-3's schedule). Both
  consumers take n_blocks + 1 turns per tile, so the alternation stays matched.

Shared memory: bf16 Q 2 x 16 KB + 2 stages x (K 32 KB + V 32 KB) + mbarriers (160 KB; wsup
adds O 2 x 16 KB: 192 KB); e4m3 Q 2 x 8 KB + 2 stages x (K, Vt 16 KB each) + O 2 x 16 KB (bf16)
+ the 1 KB ones tile (113 KB). Registers: 24 (producer) / 240 (consumers); the persistent forms
40 / 232.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass.cute.nvgpu import cpasync, warpgroup

from .copies import load_q_rows, row_copy, smem_tile
from .epilogue import write_o_rows
from .fp8 import pack_e4m3_operand_a
from .geometry import BLOCK_N, HEAD_DIM, WG_ROWS
from .mma import (consumer_fragments, mmas_and_o_copies, pack_bf16_pairs, scale_rows,
                  warpgroup_gemm_issue, wgmma_accumulator_as_operand_a, wgmma_rows_cols_view)
from .pipeline import MbarrierRing, NamedBarrier, next_stage_parity, static_stage_phase
from .scheduling import (persistent_item, persistent_rounds, request_bounds, snake_item,
                         tile_key_blocks)
from .softmax import online_softmax

NUM_MMA_WARPGROUPS = 2
TILE_M = WG_ROWS * NUM_MMA_WARPGROUPS
NUM_THREADS = 128 * (1 + NUM_MMA_WARPGROUPS)
KV_STAGES = 2
# setmaxnreg moves registers inside the CTA's launch allocation: 384 threads launch with 168
# each (64512, not 64K), so producer * 128 + consumer * 256 must stay <= 64512 or the
# consumers' setmaxnreg.inc waits forever (tools/compile_cute.py --check enforces it).
PRODUCER_REGS = 24
MMA_REGS = 240           # 24 * 128 + 240 * 256 = 64512
# Persistent forms: the producer walks the work items too (with 24 registers it spills).
PRODUCER_REGS_PERSISTENT = 40
MMA_REGS_PERSISTENT = 232    # 40 * 128 + 232 * 256 = 64512
# mma_row_sum: P times a (key, SUM_COLS) tile of ones, the narrowest e4m3 wgmma (N = 8).
SUM_COLS = 8
# Named barriers (0 is sync_threads): a consumer warpgroup's own (Q published, O staged),
# and each consumer's ping-pong turn.
BAR_WG = 1               # + consumer index, 128 threads
BAR_TURN = 3             # + consumer index, 256 threads


# The kernel's mbarrier array: the K ring, the V ring (Vt for e4m3), the scratch barrier that
# holds back the bf16 V block with kv_len's tail until its rows past kv_len are zeroed, then
# (q_by_producer) Q full / Q empty.
K_RING = MbarrierRing(KV_STAGES)
V_RING = MbarrierRing(KV_STAGES, first=K_RING.count)
SCRATCH_MBARRIER = V_RING.first + V_RING.count


class FmhaSm90Ws:
    """Compile-time configuration of one warp-specialized dense FMHA variant (O only; bf16, or
    e4m3 q/k/v with V transposed ahead)."""

    def __init__(self, paged: bool, dtype=cutlass.BFloat16, v_transposed: bool = False,
                 persistent: bool = False, mma_row_sum: bool = False):
        assert dtype in (cutlass.BFloat16, cutlass.Float8E4M3FN), dtype
        self.paged = paged
        self.dtype = dtype
        self.fp8 = dtype.width == 8
        self.out_dtype = cutlass.BFloat16
        self.tile_bytes = BLOCK_N * HEAD_DIM * dtype.width // 8
        # v_transposed (the e4m3 forms): the v argument is Vt, V already in the Vt stages'
        # (channel, key') order, one (128 x 128) block per (request, key block), keys past
        # kv_len zero (the fmha_transpose_v_e4m3 op); page_table is then [2, B, W]: K's pages,
        # then each key block's Vt block. The producer TMA-loads Vt as it loads K.
        # mma_row_sum (the e4m3 forms): the row sums of P come from the tensor core, P (already
        # e4m3 in registers for P V) times a constant (key, 8) tile of ones in shared memory, 4
        # more wgmmas (N = 8) per block in P V's group; every thread then holds its rows' whole
        # sums of the block and adds them to an fp32 running sum (a fresh accumulator per block:
        # FP8 wgmmas add into their accumulator with fewer bits than fp32). The softmax's
        # 64-long FADD chains per block and thread go (the e4m3 loop is bound by the consumer's
        # instruction stream, not the tensor pipe); the sum is over the e4m3-rounded P that P V
        # uses (the quantized model's sum_quantized_p). P is rounded straight into the A
        # fragment's word order (fp8.pack_e4m3_operand_a: no byte moves after the conversion).
        assert v_transposed == mma_row_sum == self.fp8, "e4m3 forms read Vt and sum P on MMA"
        self.v_transposed = v_transposed
        self.mma_row_sum = mma_row_sum
        # persistent: min(work items, num_ctas) CTAs walk the (query tile, head, request) items
        # heaviest tile first (in boustrophedon rounds, scheduling.snake_item), the producer
        # running on into the next item's Q and blocks while the consumers finish one; a CTA
        # per tile otherwise pays its launch, Q load, first S-only block and O store alone.
        self.persistent = persistent
        # Persistent forms: the producer TMA-loads each item's Q into the Q rows as soon as
        # both consumers have issued their last S wgmma (Q full / Q empty mbarriers), so the
        # next item's Q lands under the last P V and the O store; O is then staged in a tile
        # of its own (the e4m3 forms have one anyway: their Q rows are too small).
        self.q_by_producer = persistent
        self.own_o_tile = self.fp8 or self.q_by_producer
        self.producer_regs, self.mma_regs = ((PRODUCER_REGS_PERSISTENT, MMA_REGS_PERSISTENT)
                                             if persistent else (PRODUCER_REGS, MMA_REGS))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor,
                 cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, kv_lens: cute.Tensor,
                 qo_offset: cute.Tensor, page_table: cute.Tensor,
                 logit_scale_log2: cutlass.Float32, output_scale: cutlass.Float32,
                 causal: cutlass.Int32, grid_q_tiles: cutlass.Int32, num_ctas: cutlass.Int32,
                 stream):
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        q_layout = cute.tile_to_shape(atom, (WG_ROWS, HEAD_DIM, NUM_MMA_WARPGROUPS), (0, 1, 2))
        kv_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM, KV_STAGES), (0, 1, 2))
        kv_tile = cute.slice_(kv_layout, (None, None, 0))
        # TMA views with the (key, channel) box first: dense (token, channel, head), paged
        # (slot, channel, head, page).
        modes = [2, 3, 1, 0] if cutlass.const_expr(self.paged) else [0, 2, 1]
        k_view = cute.make_tensor(k.iterator, cute.select(k.layout, mode=modes))
        v_view = cute.make_tensor(v.iterator, cute.select(v.layout, mode=modes))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, tK = cpasync.make_tiled_tma_atom(op, k_view, kv_tile, (BLOCK_N, HEAD_DIM))
        if cutlass.const_expr(self.v_transposed):
            # Vt (block, head, channel, key') -> (channel, key', head, block) boxes.
            vt_layout = self._vt_layout()
            vt_view = cute.make_tensor(v.iterator, cute.select(v.layout, mode=[2, 3, 1, 0]))
            tma_v, tV = cpasync.make_tiled_tma_atom(op, vt_view,
                                                    cute.slice_(vt_layout, (None, None, 0)),
                                                    (HEAD_DIM, BLOCK_N))
        else:
            tma_v, tV = cpasync.make_tiled_tma_atom(op, v_view, kv_tile, (BLOCK_N, HEAD_DIM))
        tma_q, tQ = None, None
        if cutlass.const_expr(self.q_by_producer):
            # Q (token, channel, head) boxes of one warpgroup's 64 rows.
            q_view = cute.make_tensor(q.iterator, cute.select(q.layout, mode=[0, 2, 1]))
            tma_q, tQ = cpasync.make_tiled_tma_atom(op, q_view,
                                                    cute.slice_(q_layout, (None, None, 0)),
                                                    (WG_ROWS, HEAD_DIM))
        SharedStorage = self._shared_storage(q_layout, kv_layout)

        q_copy = row_copy(self.dtype, 16)
        # Zeroing the V rows past kv_len: one warp, 4 rows per step, 16-byte stores.
        zero_copy = row_copy(self.dtype, 4, async_copy=False)
        mma_qk, mma_pv, stage_o_copy, store_o_copy = mmas_and_o_copies(self.dtype,
                                                                       self.out_dtype)
        mma_sum = None
        if cutlass.const_expr(self.mma_row_sum):
            mma_sum = hopper.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.K, cutlass.Float32, (1, 1, 1), (WG_ROWS, SUM_COLS),
                a_source=warpgroup.OperandSource.RMEM)
        grid = (grid_q_tiles, cute.size(q.shape[1]), cute.size(cu_seqlens_q.shape[0]) - 1)
        if cutlass.const_expr(self.persistent):
            # num_ctas (the SM count) CTAs, fewer when there are fewer items.
            n_items = grid_q_tiles * grid[1] * grid[2]
            grid = (cutlass.min(n_items, num_ctas), 1, 1)
        self.kernel(q, tK, tV, o, cu_seqlens_q, cu_seqlens_k, kv_lens, qo_offset, page_table,
                    logit_scale_log2, output_scale, causal, grid_q_tiles, tma_k, tma_v,
                    q_layout, kv_layout, q_copy, zero_copy, mma_qk, mma_pv, stage_o_copy,
                    store_o_copy, SharedStorage, tQ, tma_q, mma_sum).launch(
            grid=grid, block=(NUM_THREADS, 1, 1), stream=stream, min_blocks_per_mp=1)

    def _vt_layout(self):
        """e4m3: the key-permuted Vt stages (channel, key', stage). Static (tracing)."""
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        return cute.tile_to_shape(atom, (HEAD_DIM, BLOCK_N, KV_STAGES), (0, 1, 2))

    def _ones_layout(self):
        """mma_row_sum: the (SUM_COLS, key) ones tile, one 128-byte-swizzle atom of e4m3
        (K-major B of the row-sum wgmma). Static (tracing)."""
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        return cute.tile_to_shape(atom, (SUM_COLS, BLOCK_N), (0, 1))

    def _o_layout(self):
        """The consumers' bf16 O tiles (own_o_tile: the e4m3 Q rows are too small to stage O
        in, and the persistent forms' Q rows take the next item's Q meanwhile)."""
        o_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                                 self.out_dtype)
        return cute.tile_to_shape(o_atom, (WG_ROWS, HEAD_DIM, NUM_MMA_WARPGROUPS), (0, 1, 2))

    def _ring_mbarriers(self):
        """K full / empty, V full / empty per stage (kv_rings), one scratch barrier."""
        return SCRATCH_MBARRIER + 1

    def _n_mbarriers(self):
        """The ring's mbarriers, then q_by_producer's Q full / empty."""
        return self._ring_mbarriers() + (2 if self.q_by_producer else 0)

    def _q_mbarriers(self, mbar):
        """(Q full, Q empty) of the q_by_producer forms, after the ring's."""
        first = mbar + self._ring_mbarriers()
        return first, first + 1

    def _shared_storage(self, q_layout, kv_layout):
        """Q, K and V stages (e4m3: raw V, then Vt stages and O tiles), then the mbarriers
        (fields built as real annotations: this module's are strings)."""
        fields = {"sQ": smem_tile(self.dtype, q_layout), "sK": smem_tile(self.dtype, kv_layout)}
        if not self.v_transposed:
            fields["sV"] = smem_tile(self.dtype, kv_layout)
        if self.fp8:
            fields["sVt"] = smem_tile(self.dtype, self._vt_layout())
        if self.own_o_tile:
            fields["sO"] = smem_tile(self.out_dtype, self._o_layout())
        if self.mma_row_sum:
            fields["sOnes"] = smem_tile(self.dtype, self._ones_layout())
        fields["mbar"] = cute.struct.Align[
            cute.struct.MemRange[cutlass.Int64, self._n_mbarriers()], 8]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, tK: cute.Tensor, tV: cute.Tensor, mO: cute.Tensor,
               mCuQ: cute.Tensor, mCuK: cute.Tensor, mKvLens: cute.Tensor,
               mOffset: cute.Tensor, mPageTable: cute.Tensor,
               scale_log2: cutlass.Float32, output_scale: cutlass.Float32,
               causal: cutlass.Int32, grid_q_tiles: cutlass.Int32, tma_k: cute.CopyAtom,
               tma_v: cute.CopyAtom,
               q_layout: cute.ComposedLayout, kv_layout: cute.ComposedLayout,
               q_copy: cute.TiledCopy, zero_copy: cute.TiledCopy, mma_qk: cute.TiledMma,
               mma_pv: cute.TiledMma, stage_o_copy: cute.TiledCopy,
               store_o_copy: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
               tQ: Optional[cute.Tensor], tma_q: Optional[cute.CopyAtom],
               mma_sum: Optional[cute.TiledMma]):
        tidx, _, _ = cute.arch.thread_idx()
        cta_x, head, request = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        warp = cute.arch.make_warp_uniform(tidx // 32)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ_wgs = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK_stages = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sV_stages = None
        if cutlass.const_expr(not self.v_transposed):
            sV_stages = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        mbar = storage.mbar.data_ptr()
        sVt_stages = None
        sO_wgs = None
        if cutlass.const_expr(self.fp8):
            vt_layout = self._vt_layout()
            sVt_stages = storage.sVt.get_tensor(vt_layout.outer, swizzle=vt_layout.inner)
        if cutlass.const_expr(self.own_o_tile):
            o_layout = self._o_layout()
            sO_wgs = storage.sO.get_tensor(o_layout.outer, swizzle=o_layout.inner)
        if warp == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(KV_STAGES):
                    cute.arch.mbarrier_init(K_RING.full(mbar, s), 1)
                    cute.arch.mbarrier_init(K_RING.empty(mbar, s), 4 * NUM_MMA_WARPGROUPS)
                    cute.arch.mbarrier_init(V_RING.full(mbar, s), 1)
                    cute.arch.mbarrier_init(V_RING.empty(mbar, s), 4 * NUM_MMA_WARPGROUPS)
                cute.arch.mbarrier_init(mbar + SCRATCH_MBARRIER, 1)
                if cutlass.const_expr(self.q_by_producer):
                    q_full, q_empty = self._q_mbarriers(mbar)
                    cute.arch.mbarrier_init(q_full, 1)
                    cute.arch.mbarrier_init(q_empty, 4 * NUM_MMA_WARPGROUPS)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(self.q_by_producer):
                cpasync.prefetch_descriptor(tma_q)
        sOnes = None
        if cutlass.const_expr(self.mma_row_sum):
            ones_layout = self._ones_layout()
            sOnes = storage.sOnes.get_tensor(ones_layout.outer, swizzle=ones_layout.inner)
            # e4m3 1.0 in every byte (so the swizzle does not matter): a word per thread of
            # the consumers, published to the async proxy that the wgmmas read through.
            n_words = SUM_COLS * BLOCK_N * self.dtype.width // 32
            ones_words = cute.make_tensor(
                cute.recast_ptr(storage.sOnes.data_ptr(), dtype=cutlass.Int32),
                cute.make_layout(n_words))
            if tidx >= NUM_THREADS - n_words:
                ones_words[tidx - (NUM_THREADS - n_words)] = cutlass.Int32(0x38383838)
                cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        group = mQ.shape[1] // tK.shape[2]
        head_kv = head // group
        mVtTable = None
        if cutlass.const_expr(self.v_transposed):
            mVtTable = mPageTable[1, None, None]             # (request, key block) -> Vt block
            mPageTable = mPageTable[0, None, None]
        q_start, q_len, kv_len, offset, k_row0, n_q_tiles = request_bounds(
            mQ, mCuQ, mCuK, mKvLens, mOffset, mPageTable, request, tK.shape[0], self.paged,
            TILE_M)
        # Persistent: item w = (query tile rank, head, request), rank-major (every request's
        # heaviest tile first) with the heads of one KV head adjacent (their K / V share L2).
        n_heads = mQ.shape[1]
        n_requests = mCuQ.shape[0] - 1
        n_items = grid_q_tiles * n_heads * n_requests

        if wg == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                sKV = (sK_stages, sVt_stages if self.v_transposed else sV_stages, mbar)
                parity = cutlass.Int32(0)
                scratch = cutlass.Int32(0)
                if cutlass.const_expr(self.persistent):
                    q_uses = cutlass.Int32(0)         # items whose Q this CTA loaded
                    for rnd in range(persistent_rounds(n_items, grid_x)):
                        w = snake_item(rnd, cta_x, grid_x)
                        if w < n_items:
                            walk, i_head, i_request = persistent_item(w, n_heads, n_requests)
                            i_q_start, i_q_len, i_kv_len, i_offset, i_k_row0, i_tiles = \
                                request_bounds(mQ, mCuQ, mCuK, mKvLens, mOffset, mPageTable,
                                               i_request, tK.shape[0], self.paged, TILE_M)
                            if walk < i_tiles:
                                q_lo = (i_tiles - 1 - walk) * TILE_M
                                self._load_q(tQ, tma_q, sQ_wgs, mbar, i_q_start + q_lo, i_head,
                                             q_uses)
                                q_uses = q_uses + 1
                                parity, scratch = self._producer(
                                    tK, tV, mPageTable, tma_k, tma_v, zero_copy, *sKV,
                                    i_request, i_head // group, i_k_row0, i_kv_len, i_offset,
                                    causal, i_q_len, i_tiles, walk, grid_q_tiles, tidx % 32,
                                    mVtTable, (parity, scratch))
                else:
                    self._producer(tK, tV, mPageTable, tma_k, tma_v, zero_copy, *sKV, request,
                                   head_kv, k_row0, kv_len, offset, causal, q_len, n_q_tiles,
                                   cta_x, grid_x, tidx % 32, mVtTable, (parity, scratch))
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            args = (mQ, mO, head, q_start, q_len, kv_len, offset, causal, n_q_tiles, cta_x,
                    grid_x, scale_log2, output_scale, tidx)
            rest = (sQ_wgs, sK_stages, sV_stages, mbar, q_copy, mma_qk, mma_pv, stage_o_copy,
                    store_o_copy, sVt_stages, sO_wgs, mma_sum, sOnes)
            # Consumer 0 takes the first turn.
            if wg == 2:
                NamedBarrier(BAR_TURN, 256).arrive()
            parity = cutlass.Int32(0)
            if cutlass.const_expr(self.persistent):
                # One trace per consumer warpgroup (static index), each walking the items.
                items = SimpleNamespace(n_items=n_items, n_heads=n_heads, n_requests=n_requests,
                                        tensors=(mQ, mCuQ, mCuK, mKvLens, mOffset, mPageTable),
                                        key_rows=tK.shape[0])
                for mwg in cutlass.range_constexpr(NUM_MMA_WARPGROUPS):
                    if wg == 1 + mwg:
                        self._consumer(*args, mwg, *rest, parity, items)
            else:
                # One trace per consumer warpgroup: its index, hence its Q tile, is static.
                if wg == 1:
                    self._consumer(*args, 0, *rest, parity)
                else:
                    self._consumer(*args, 1, *rest, parity)

    @cute.jit
    def _load_q(self, tQ: cute.Tensor, tma_q: cute.CopyAtom, sQ_wgs: cute.Tensor, mbar, row0,
                head, uses):
        """q_by_producer: once both consumers released the Q rows (Q empty, `uses` items
        before), TMA both warpgroups' 64 rows from token row0 of `head` onto Q full. Rows past
        the tensor are zero-filled; rows of the next request are loaded and never stored (each
        row's softmax and O are its own)."""
        q_full, q_empty = self._q_mbarriers(mbar)
        gQ = cute.local_tile(cute.domain_offset((row0, 0), tQ[None, None, head]),
                             (WG_ROWS, HEAD_DIM), (None, 0))          # (row, ch, wg tile)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ_wgs, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        cute.arch.mbarrier_wait(q_empty, (uses & 1) ^ 1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(
                q_full, NUM_MMA_WARPGROUPS * WG_ROWS * HEAD_DIM * self.dtype.width // 8)
        for m in cutlass.range_constexpr(NUM_MMA_WARPGROUPS):
            cute.copy(tma_q, tQgQ[None, m], tQsQ[None, m], tma_bar_ptr=q_full)

    # ---- producer (one warp) ---------------------------------------------------------------
    @cute.jit
    def _producer(self, tK: cute.Tensor, tV: cute.Tensor, mPageTable: cute.Tensor,
                  tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, zero_copy: cute.TiledCopy,
                  sK_stages: cute.Tensor, sV_stages: cute.Tensor, mbar, request, head_kv,
                  k_row0, kv_len, offset, causal, q_len, n_q_tiles, cta_x, grid_x, lane,
                  mVtTable, state):
        """K and V (bf16) or K and Vt (e4m3: sV_stages are then the Vt stages) blocks of tiles
        cta_x, cta_x + grid_x, .. of one (head, request) into their rings. state = (stage-use
        parities, scratch phase) before them; returns it after them (persistent CTAs carry it
        over items)."""
        # (TMA, stage) smem and (TMA, block or page) gmem partitions of the K and V boxes.
        # (Vt: (channel, key', Vt block) in either layout.)
        if cutlass.const_expr(self.paged):
            gK = tK[None, None, head_kv, None]                          # (slot, ch, page)
            gV = tV[None, None, head_kv, None]
        else:
            gK = cute.local_tile(cute.domain_offset((k_row0, 0), tK[None, None, head_kv]),
                                 (BLOCK_N, HEAD_DIM), (None, 0))       # (key, ch, block)
            if cutlass.const_expr(self.v_transposed):
                gV = tV[None, None, head_kv, None]
            else:
                gV = cute.local_tile(cute.domain_offset((k_row0, 0), tV[None, None, head_kv]),
                                     (BLOCK_N, HEAD_DIM), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                           cute.group_modes(sK_stages, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                           cute.group_modes(sV_stages, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        thr_zero = zero_copy.get_slice(lane)
        tZcZ = thr_zero.partition_D(cute.make_identity_tensor((BLOCK_N, HEAD_DIM)))

        parity, scratch_phase = state         # the stage-use parities, the scratch phase
        for walk in range(cta_x, n_q_tiles, grid_x):
            q_lo, n_blocks = tile_key_blocks(walk, n_q_tiles, q_len, kv_len, offset, causal,
                                             TILE_M)
            for blk in range(n_blocks):
                stage, phase = static_stage_phase(blk, parity)
                free_phase = phase ^ 1
                src = blk
                if cutlass.const_expr(self.paged):
                    src = mPageTable[request, blk]    # outside the pool: the TMA zero-fills
                # K
                cute.arch.mbarrier_wait(K_RING.empty(mbar, stage), free_phase)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(K_RING.full(mbar, stage),
                                                            self.tile_bytes)
                cute.copy(tma_k, tKgK[None, src], tKsK[None, stage],
                          tma_bar_ptr=K_RING.full(mbar, stage))
                # V
                if cutlass.const_expr(self.v_transposed):
                    # Vt of this key block (keys past kv_len already zero).
                    cute.arch.mbarrier_wait(V_RING.empty(mbar, stage), free_phase)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(V_RING.full(mbar, stage),
                                                                self.tile_bytes)
                    cute.copy(tma_v, tVgV[None, mVtTable[request, blk]], tVsV[None, stage],
                              tma_bar_ptr=V_RING.full(mbar, stage))
                else:
                    cute.arch.mbarrier_wait(V_RING.empty(mbar, stage), free_phase)
                    n_keys = kv_len - blk * BLOCK_N
                    if n_keys >= BLOCK_N:
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(V_RING.full(mbar, stage),
                                                                    self.tile_bytes)
                        cute.copy(tma_v, tVgV[None, src], tVsV[None, stage],
                                  tma_bar_ptr=V_RING.full(mbar, stage))
                    else:
                        # kv_len's tail block: land it, zero the rows past kv_len, then publish.
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(mbar + SCRATCH_MBARRIER,
                                                                    self.tile_bytes)
                        cute.copy(tma_v, tVgV[None, src], tVsV[None, stage],
                                  tma_bar_ptr=mbar + SCRATCH_MBARRIER)
                        cute.arch.mbarrier_wait(mbar + SCRATCH_MBARRIER, scratch_phase)
                        scratch_phase = scratch_phase ^ 1
                        tZsV = thr_zero.partition_D(sV_stages[None, None, stage])
                        for m in cutlass.range_constexpr(cute.size(tZsV.shape[1])):
                            if tZcZ[0, m, 0][0] >= n_keys:
                                tZsV[None, m, None].fill(0)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.sync_warp()
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive(V_RING.full(mbar, stage))
            parity = next_stage_parity(parity, n_blocks)
        return parity, scratch_phase

    # ---- consumers (two warpgroups) --------------------------------------------------------
    @cute.jit
    def _consumer(self, mQ, mO, head, q_start, q_len, kv_len, offset, causal, n_q_tiles, cta_x,
                  grid_x, scale_log2, output_scale, tidx, mwg, sQ_wgs, sK_stages, sV_stages,
                  mbar, q_copy, mma_qk, mma_pv, stage_o_copy, store_o_copy, sVt_stages, sO_wgs,
                  mma_sum, sOnes, parity, items=None):
        """Query tiles cta_x, cta_x + grid_x, .. of one (head, request) for consumer warpgroup
        mwg, or (persistent; `items`: the item count and request_bounds' arguments) the work
        items of this CTA. The fragments are set up once, outside every loop (the wgmma
        descriptors stay static offsets). parity: the stage-use parities before them; returns
        them after them."""
        wg_tidx = tidx % 128
        lane = tidx % 32
        warp_in_wg = cute.arch.make_warp_uniform(wg_tidx // 32)

        if cutlass.const_expr(not self.fp8):
            sVt_stages = cute.composition(
                sV_stages, cute.make_ordered_layout((HEAD_DIM, BLOCK_N, KV_STAGES),
                                                    order=(1, 0, 2)))
        sQ_mine = sQ_wgs[None, None, mwg]
        thr_q_copy = q_copy.get_slice(wg_tidx)
        tQsQ = thr_q_copy.partition_D(sQ_mine)
        tQcQ = thr_q_copy.partition_S(cute.make_identity_tensor((WG_ROWS, HEAD_DIM)))

        # (.., .., K, warpgroup) Q, (.., .., K, stage) K and Vt fragments.
        tSrQ, tSrK, tOrVt, tScS, acc_s, acc_o, a_shape = consumer_fragments(
            mma_qk, mma_pv, wg_tidx, sQ_wgs, sK_stages, sVt_stages)
        tSrQ = tSrQ[None, None, None, mwg]
        n_my_rows = cute.size(tScS, mode=[0])
        n_my_cols = cute.size(tScS, mode=[1])
        o_rc = wgmma_rows_cols_view(acc_o)
        if cutlass.const_expr(self.mma_row_sum):
            r_p = cute.make_rmem_tensor(a_shape, self.dtype)      # P in A's register order
        else:
            r_p = cute.make_fragment_like(acc_s, self.dtype)
        t_p = r_p
        if cutlass.const_expr(not self.fp8):
            t_p = wgmma_accumulator_as_operand_a(r_p)
        row_max = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)   # running, log2 units
        # This thread's part of each row's sum (mma_row_sum: the whole sum).
        row_sum = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
        # mma_row_sum: P times the ones tile; each thread's accumulator columns all hold its
        # rows' whole sums.
        tSumB, acc_sum, sum_rc = None, None, None
        if cutlass.const_expr(self.mma_row_sum):
            thr_sum = mma_sum.get_slice(wg_tidx)
            tSumB = thr_sum.make_fragment_B(thr_sum.partition_B(sOnes))
            acc_sum = cute.make_rmem_tensor(thr_sum.partition_shape_C((WG_ROWS, SUM_COLS)),
                                            cutlass.Float32)
            sum_rc = wgmma_rows_cols_view(acc_sum)
        corr = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
        sO_mine = sQ_mine                          # bf16: O takes the Q rows' place
        if cutlass.const_expr(self.own_o_tile):
            sO_mine = sO_wgs[None, None, mwg]
        # What a tile needs (_consumer_tile and _turn are traced inline).
        c = SimpleNamespace(
            mQ=mQ, mO=mO, mwg=mwg, wg_tidx=wg_tidx, lane=lane, warp_in_wg=warp_in_wg,
            q_copy=q_copy, thr_q_copy=thr_q_copy, tQsQ=tQsQ, tQcQ=tQcQ, sO_mine=sO_mine,
            stage_o_copy=stage_o_copy, store_o_copy=store_o_copy, output_scale=output_scale,
            mma_qk=mma_qk, mma_pv=mma_pv, acc_s=acc_s, acc_o=acc_o, o_rc=o_rc, r_p=r_p, t_p=t_p,
            tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tScS=tScS, n_my_rows=n_my_rows,
            n_my_cols=n_my_cols, row_max=row_max, row_sum=row_sum, corr=corr, mbar=mbar,
            turn_mine=NamedBarrier(BAR_TURN + mwg, 256),
            turn_other=NamedBarrier(BAR_TURN + 1 - mwg, 256), causal=causal,
            scale_log2=scale_log2, mma_sum=mma_sum, tSumB=tSumB, acc_sum=acc_sum, sum_rc=sum_rc)

        if cutlass.const_expr(self.persistent):
            q_full, _ = self._q_mbarriers(mbar)
            q_uses = cutlass.Int32(0)
            for rnd in range(persistent_rounds(items.n_items, grid_x)):
                w = snake_item(rnd, cta_x, grid_x)
                if w < items.n_items:
                    walk, i_head, i_request = persistent_item(w, items.n_heads,
                                                              items.n_requests)
                    i_q_start, i_q_len, i_kv_len, i_offset, _, i_tiles = request_bounds(
                        *items.tensors, i_request, items.key_rows, self.paged, TILE_M)
                    if walk < i_tiles:
                        cute.arch.mbarrier_wait(q_full, q_uses & 1)       # this item's Q
                        q_uses = q_uses + 1
                        parity = self._consumer_tile(c, walk, i_tiles, i_head, i_q_start,
                                                     i_q_len, i_kv_len, i_offset, parity)
        else:
            for walk in range(cta_x, n_q_tiles, grid_x):
                parity = self._consumer_tile(c, walk, n_q_tiles, head, q_start, q_len,
                                             kv_len, offset, parity)
        return parity

    @cute.jit
    def _consumer_tile(self, c, walk, n_q_tiles, head, q_start, q_len, kv_len, offset,
                       parity):
        """One query tile of consumer warpgroup c.mwg: Q (q_by_producer: already waited for),
        its key blocks in ping-pong turns, O normalized and stored. Returns the stage-use
        parities after it."""
        # Locals, not c's fields, past the block loops: the DSL hands a namespace read after a
        # dynamic loop back with its static shapes turned dynamic.
        mbar, lane, causal, mwg = c.mbar, c.lane, c.causal, c.mwg
        mma_qk, mma_pv, acc_s, acc_o = c.mma_qk, c.mma_pv, c.acc_s, c.acc_o
        o_rc, r_p, t_p = c.o_rc, c.r_p, c.t_p
        tSrQ, tSrK, tOrVt, tScS = c.tSrQ, c.tSrK, c.tOrVt, c.tScS
        row_max, row_sum, corr, scale_log2 = c.row_max, c.row_sum, c.corr, c.scale_log2
        turn_mine, turn_other = c.turn_mine, c.turn_other
        n_my_rows, n_my_cols, output_scale = c.n_my_rows, c.n_my_cols, c.output_scale
        mO, sO_mine, wg_tidx, warp_in_wg = c.mO, c.sO_mine, c.wg_tidx, c.warp_in_wg
        stage_o_copy, store_o_copy = c.stage_o_copy, c.store_o_copy
        mma_sum, tSumB, acc_sum, sum_rc = c.mma_sum, c.tSumB, c.acc_sum, c.sum_rc
        q_lo, n_blocks = tile_key_blocks(walk, n_q_tiles, q_len, kv_len, offset, causal, TILE_M)
        wg_q0 = q_lo + mwg * WG_ROWS
        if cutlass.const_expr(not self.q_by_producer):
            # ---- Q rows of this warpgroup (zero past q_len), published to the async proxy
            load_q_rows(c.mQ, c.q_copy, c.thr_q_copy, c.tQsQ, c.tQcQ, wg_q0, q_start, q_len,
                        head)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            NamedBarrier(BAR_WG + mwg, 128).sync()

        acc_o.fill(0.0)
        for i in cutlass.range_constexpr(n_my_rows):
            row_max[i] = -cutlass.Float32.inf
            row_sum[i] = 0.0
        # What a turn needs besides its block's stages (_turn is traced inline).
        turn = SimpleNamespace(
            mma_qk=mma_qk, mma_pv=mma_pv, acc_s=acc_s, acc_o=acc_o, o_rc=o_rc,
            r_p=r_p, t_p=t_p, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt,
            tScS=tScS, row_max=row_max, row_sum=row_sum, corr=corr, mbar=mbar,
            lane=lane, turn_mine=turn_mine, turn_other=turn_other, wg_q0=wg_q0,
            kv_len=kv_len, offset=offset, causal=causal, scale_log2=scale_log2,
            mma_sum=mma_sum, tSumB=tSumB, acc_sum=acc_sum, sum_rc=sum_rc)
        if n_blocks > 0:
            # ---- block 0: S only
            stage, phase = static_stage_phase(0, parity)
            cute.arch.mbarrier_wait(K_RING.full(mbar, stage), phase)
            turn_mine.sync()
            warpgroup_gemm_issue(mma_qk, acc_s, tSrQ, tSrK[None, None, None, stage])
            turn_other.arrive()
            warpgroup.wait_group(0)
            if lane == 0:
                cute.arch.mbarrier_arrive(K_RING.empty(mbar, stage))             # K free
            online_softmax(acc_s, 0, row_max, self._softmax_sum(row_sum), tScS, wg_q0, kv_len,
                           offset, causal, scale_log2, corr=corr)
            if cutlass.const_expr(self.mma_row_sum):
                pack_e4m3_operand_a(acc_s, r_p)
            else:
                r_p.store(acc_s.load().to(self.dtype))
            # ---- blocks 1 .. n-1: S(j) and P(j-1) V(j-1) in one turn. Pairs of blocks (2i+1
            # on stage 1, 2i+2 on stage 0): static stages; only blocks every row of the tile
            # sees whole (no mask), the rest one by one below.
            first_dynamic = 1
            n_whole = kv_len
            if causal != 0:
                n_whole = cutlass.min(n_whole, q_lo + offset + 1)
            n_whole = cutlass.min(cutlass.max(n_whole, 0) // BLOCK_N, n_blocks)
            n_pairs = cutlass.max(n_whole - 1, 0) // 2
            for i in range(n_pairs):
                p0 = (parity ^ i) & 1                   # stage 0, use i
                p1 = ((parity >> 1) ^ i) & 1            # stage 1, use i
                self._turn(turn, 2 * i + 1, 1, p1, 0, p0, mask=False)
                self._turn(turn, 2 * i + 2, 0, p0 ^ 1, 1, p1, mask=False)
            first_dynamic = 2 * n_pairs + 1
            for blk in range(first_dynamic, n_blocks):
                stage, k_phase = static_stage_phase(blk, parity)
                prev, v_phase = static_stage_phase(blk - 1, parity)
                self._turn(turn, blk, stage, k_phase, prev, v_phase)
            if cutlass.const_expr(self.q_by_producer):
                if lane == 0:      # every S wgmma of the tile is done: Q rows free
                    cute.arch.mbarrier_arrive(self._q_mbarriers(mbar)[1])
            # ---- the last P V
            last, phase = static_stage_phase(n_blocks - 1, parity)
            cute.arch.mbarrier_wait(V_RING.full(mbar, last), phase)
            turn_mine.sync()
            self._issue_pv(mma_pv, acc_o, t_p, tOrVt[None, None, None, last], mma_sum, acc_sum,
                           tSumB)
            turn_other.arrive()
            warpgroup.wait_group(0)
            if lane == 0:
                cute.arch.mbarrier_arrive(V_RING.empty(mbar, last))              # V free
            if cutlass.const_expr(self.mma_row_sum):
                for i in cutlass.range_constexpr(n_my_rows):
                    row_sum[i] = row_sum[i] + sum_rc[i, 0]
        else:
            if cutlass.const_expr(self.q_by_producer):
                if lane == 0:      # no key block: the Q rows were never read
                    cute.arch.mbarrier_arrive(self._q_mbarriers(mbar)[1])
        parity = next_stage_parity(parity, n_blocks)

        # ---- normalize, stage (in this warpgroup's Q rows, or its O tile), write
        write_o_rows(mO, o_rc, acc_o, row_sum, n_my_rows, n_my_cols, output_scale, sO_mine,
                     wg_tidx, warp_in_wg, lane, wg_q0, q_start, q_len, head, stage_o_copy,
                     store_o_copy, self.out_dtype, row_sum_whole=self.mma_row_sum)
        if cutlass.const_expr(not self.q_by_producer):
            # The next tile reloads Q into these rows: the whole warpgroup must be done.
            NamedBarrier(BAR_WG + mwg, 128).sync()
        return parity

    @cute.jit
    def _turn(self, t, blk, stage, k_phase, prev, v_phase, mask: cutlass.Constexpr = True):
        """Key block blk >= 1: wait for K(blk) (stage, k_phase) and V(blk - 1) (prev, v_phase),
        issue S(blk) and P(blk-1) V(blk-1) in this consumer's ping-pong turn, run the softmax
        of block blk and leave P(blk) in t.r_p (t: the consumer's fragments and state)."""
        cute.arch.mbarrier_wait(K_RING.full(t.mbar, stage), k_phase)
        cute.arch.mbarrier_wait(V_RING.full(t.mbar, prev), v_phase)
        t.turn_mine.sync()
        warpgroup_gemm_issue(t.mma_qk, t.acc_s, t.tSrQ, t.tSrK[None, None, None, stage])
        self._issue_pv(t.mma_pv, t.acc_o, t.t_p, t.tOrVt[None, None, None, prev], t.mma_sum,
                       t.acc_sum, t.tSumB)
        t.turn_other.arrive()
        warpgroup.wait_group(0)                         # S(j) and P V(j-1)
        if t.lane == 0:
            cute.arch.mbarrier_arrive(K_RING.empty(t.mbar, stage))                 # K free
        online_softmax(t.acc_s, blk, t.row_max, self._softmax_sum(t.row_sum), t.tScS, t.wg_q0,
                       t.kv_len, t.offset, t.causal, t.scale_log2, corr=t.corr, mask=mask)
        # A no-op after the wait above, kept because the validated PTX has it.
        warpgroup.wait_group(0)
        if t.lane == 0:
            cute.arch.mbarrier_arrive(V_RING.empty(t.mbar, prev))                  # V free
        scale_rows(t.o_rc, t.corr)
        if cutlass.const_expr(self.mma_row_sum):
            # The sum of P(blk - 1) (relative to max blk - 1) joins the running sum, then both
            # move to max blk; P(blk) rounded straight into the A fragment.
            for i in cutlass.range_constexpr(cute.size(t.row_sum)):
                t.row_sum[i] = (t.row_sum[i] + t.sum_rc[i, 0]) * t.corr[i]
            pack_e4m3_operand_a(t.acc_s, t.r_p)
        else:
            # Pinned here: between the two turns of an unrolled pair LLVM would sink a plain
            # conversion under the next S wgmma (64 fp32 P live: C7512).
            pack_bf16_pairs(t.acc_s, t.r_p)

    def _softmax_sum(self, row_sum):
        """online_softmax's row_sum argument: None when the tensor core sums P."""
        return None if self.mma_row_sum else row_sum

    def _issue_pv(self, mma_pv, acc_o, p_operand, vt, mma_sum, acc_sum, sum_b):
        """O += P V as one wgmma group; mma_row_sum: the block's row sums = P times the ones
        tile in the same group (same P registers, one fence and commit)."""
        also = None
        if self.mma_row_sum:
            also = (mma_sum, acc_sum, p_operand, sum_b, False)
        warpgroup_gemm_issue(mma_pv, acc_o, p_operand, vt, accumulate=True, also=also)
