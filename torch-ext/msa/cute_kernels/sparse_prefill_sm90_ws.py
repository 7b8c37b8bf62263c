"""Block-sparse prefill attention, KV-outer, warp-specialized with TMA (Hopper, sm_90a), for
head groups G = 8 and 16 (the MSA configuration, Hq = 64 over Hkv = 4, is G = 16).

Forms "ws" and "ws3w" of cute_kernels.variants.SPARSE_FORMS. Same work items, masking, softmax
and outputs as the wgmma kernel (sparse_common.py, sparse_prefill_sm90_wgmma.py); what differs
is who moves the bytes. In the wgmma kernel every
thread computes cp.async gather addresses for its Q rows and 16-byte store addresses for its
partial-O rows, about 40 % of the instructions per tile. Here a query's G heads are one
contiguous G x 128 run of q (and of a slot of o_partial), so one TMA box of G rows x 128 bytes
moves it:

* warp 0 (producer, its warpgroup drops to PRODUCER_REGS): per 64-row tile it loads the tile's
  qsplit entries (lane i: query i), publishes them in shared memory and TMA-loads each query's
  G x 128 Q rows (2 boxes for bf16, 1 for e4m3) into a Q_STAGES-deep ring (full barrier: one
  arrival plus the boxes' bytes; empty: one arrival per warp of the consuming warpgroup).
  A query without a slot (entry -1) is loaded from token q_start + 2^24 - 1: past q (the TMA
  zero-fills the box) unless the batch holds more tokens, and its rows are never written.
* warpgroups 1 and 2 (consumers) take tiles alternately (one warpgroup's softmax and epilogue
  run under the other's MMAs). First they load the block's K and V once (cp.async; e4m3 V is
  transposed through registers into the key-permuted Vt, as in the wgmma kernel), then per tile:
  S = Q K^T (SS wgmma), single-block softmax, O = P V (RS wgmma), normalize, stage O in the
  warpgroup's own O tile (partial dtype, 128-byte swizzle) and TMA-store each valid query's G
  rows to its slot (warp w stores queries w, w + 4); LSE rows are written by the threads. A
  warpgroup waits for its previous stores to have read the O tile before refilling it, and
  releases the Q stage (and the entries) after its last read.

Form "ws3w" (the table's options consumers=3, q_stages=6): three consumer warpgroups taking
tiles round-robin and 6 Q stages, for more tiles in flight (the path is latency-bound); the
first two still zero the Q ring and load K and V.

Form "wsp3w" (persistent=True, o_in_q_stage=True, bf16, three consumers, 6 Q stages):
min(items, num_ctas) CTAs take the work items from a queue: CTA c starts on item c and then
fetches num_ctas + atomicAdd(item_counter, 1) (item_counter: one int32 zeroed by the caller),
so the items' uneven tile counts balance over the CTAs as a non-persistent grid's do; the
producer publishes each item's number in shared memory beside its K/V stage (-1 after the
last). The producer warpgroup (56 registers) loads each item's K and V into a two-stage K/V
ring (cp.async, rows past the keys zeroed; full: each loader's cp.async.mbarrier.arrive.noinc
plus a plain arrive after its zero stores; empty: one arrival per consumer warp), so the next
item's block lands under this item's tiles, and its warp 0 keeps the Q ring running across
items (the ring's tile number continues from item to item); the consumers (152 registers)
take tiles round-robin by that number and fence for the async proxy after the K/V wait. No O
tiles: each tile's O is staged over its own Q stage (dead once S is done) and the stage goes
back once the TMA store has read it: Q 6 x 16 KB + K/V 2 x 64 KB = 224 KB. (With O tiles,
persistent=True fits two consumers: Q 4 x 16 KB + K/V 2 x 64 KB + O 2 x 16 KB.)

Form "wsp3we" (persistent=True, e4m3, three consumers, 6 Q stages): the same queue and rings
with O tiles (an 8 KB e4m3 Q stage cannot hold a bf16 O tile). The producer warpgroup copies
each item's raw V rows into a 16 KB stage (cp.async), waits for its own copies and moves the
chunks it copied into the K/V stage's key-permuted Vt through registers (no barrier: a thread
reads only its own chunks), so the consumers never transpose: Q 6 x 8 KB + K/V 2 x 32 KB + raw
V 16 KB + O 3 x 16 KB = 176 KB.

Shared memory (bf16, bf16 partials): Q 4 x 16 KB + K 32 KB + V 32 KB + O 2 x 16 KB = 160 KB
(ws3w: Q 6 x 16 KB, O 3 x 16 KB, 208 KB); one CTA per SM. The kernel never reads or writes out
of bounds whatever the schedule says: TMA boxes are clipped to q and o_partial, K/V rows past
the block's keys are zero-filled.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup

from .copies import row_copy, smem_tile
from .fp8 import register_p_key_order, register_p_operand
from .geometry import BLOCK_N, HEAD_DIM, LOCAL_QUERY_MASK, LOG2_E, SLOT_SHIFT, WG_ROWS
from .mma import (consumer_fragments, mmas_and_o_copies, scale_rows, warpgroup_gemm,
                  wgmma_accumulator_as_operand_a, wgmma_rows_cols_view)
from .pipeline import MbarrierRing, NamedBarrier
from .sparse_common import SparsePrefillBase

WS_MODES = ("bf16", "e4m3")
# Head groups whose queries' rows fill whole 1 KB swizzle atoms (one TMA box per query).
WS_GROUPS = (8, 16)
NUM_MMA_WARPGROUPS = 2
Q_STAGES = 4
PRODUCER_REGS = 40
MMA_REGS = 232              # 40 * 128 + 232 * 256 = 64512 = 168 * 384 (launch allocation)
# Three consumers (form ws3w) launch 512 threads with 128 registers each and take
# mma_regs=152: 40 * 128 + 152 * 384 = 63488 (ptxas fits the consumers in 130).
# Named barriers (0 is sync_threads): both consumer warpgroups (K/V landed), the persistent
# form's producer warpgroup (the next item's number published), and each consumer warpgroup's
# own (its O tile free / written).
BAR_CONSUMERS = 1
BAR_PRODUCER = 2
BAR_WG = 3                  # + consumer index
# The persistent form's K/V ring: the next work item's block loads while this one's tiles run.
KV_STAGES = 2


class SparsePrefillSm90Ws(SparsePrefillBase):
    """Warp-specialized TMA variant; mode "bf16" (bf16 Q/K/V) or "e4m3" (e4m3 Q/K/V and P.V),
    bf16, fp16 or e4m3 partials, G in WS_GROUPS."""

    def __init__(self, qhead_per_kv: int, paged: bool, partial_dtype=cutlass.BFloat16,
                 mode: str = "bf16", consumers: int = NUM_MMA_WARPGROUPS,
                 q_stages: int = Q_STAGES, mma_regs: int = MMA_REGS,
                 producer_regs: int = PRODUCER_REGS, persistent: bool = False,
                 o_in_q_stage: bool = False):
        super().__init__(qhead_per_kv, paged, partial_dtype)
        assert consumers in (2, 3), consumers
        # Consumers take tiles round-robin and wait on a Q stage's parity only: the stage's
        # previous use must be the same consumer's tile (tools/lab/model_sparse_persistent.py).
        assert q_stages % consumers == 0, (q_stages, consumers)
        self.consumers = consumers
        self.q_stages = q_stages
        # The Q ring's full (producer TMA) / empty (one arrival per consumer warp) mbarriers.
        self.q_ring = MbarrierRing(q_stages)
        # persistent: min(work items, num_ctas) CTAs walk the items; the producer warpgroup
        # loads each item's K and V into the K/V ring (full: two arrivals per loader thread,
        # its cp.async completion and its zeroed rows; empty: one per consumer warp).
        self.persistent = persistent
        self.kv_ring = MbarrierRing(KV_STAGES, first=self.q_ring.count)
        self.mma_regs = mma_regs
        self.producer_regs = producer_regs
        # o_in_q_stage: a tile's O is staged over its own Q stage (dead once S is computed) and
        # the stage goes back to the producer when the TMA store has read it: no O tiles.
        self.o_in_q_stage = o_in_q_stage
        assert qhead_per_kv in WS_GROUPS, qhead_per_kv
        assert partial_dtype.width == 16 or partial_dtype is cutlass.Float8E4M3FN, partial_dtype
        assert mode in WS_MODES, mode
        assert not o_in_q_stage or partial_dtype is cutlass.BFloat16 and mode == "bf16", \
            "O staged over Q needs the Q stage's layout: bf16 Q and bf16 partials"
        self.mode = mode
        self.qk_dtype = cutlass.Float8E4M3FN if mode == "e4m3" else cutlass.BFloat16
        self.pv_dtype = self.qk_dtype
        self.transpose_v = mode == "e4m3"
        self.tile_m = WG_ROWS
        self.queries_per_tile = WG_ROWS // qhead_per_kv
        # One TMA box = a query's G rows x 128 bytes (the swizzle span): 64 bf16 / 128 e4m3.
        self.q_box_cols = 1024 // self.qk_dtype.width
        self.o_box_cols = 1024 // partial_dtype.width
        self.q_query_bytes = qhead_per_kv * HEAD_DIM * self.qk_dtype.width // 8

    def _shared_storage(self, q_layout, k_layout, v_layout, o_layout, v_raw_layout):
        fields = {"sQ": smem_tile(self.qk_dtype, q_layout),
                  "sK": smem_tile(self.qk_dtype, k_layout),
                  "sV": smem_tile(self.pv_dtype, v_layout),
                  "sEntry": cute.struct.Align[cute.struct.MemRange[
                      cutlass.Int32, self.queries_per_tile * self.q_stages], 16],
                  "mbar": cute.struct.Align[cute.struct.MemRange[cutlass.Int64,
                                                                 self._mbarrier_count()],
                                            8]}
        if not self.o_in_q_stage:
            fields["sO"] = smem_tile(self.partial_dtype, o_layout)
        if self.persistent and self.transpose_v:
            # The producer's raw V rows (cp.async), transposed into the stage's Vt once landed.
            fields["sVraw"] = smem_tile(self.qk_dtype, v_raw_layout)
        if self.persistent:
            # [0, KV_STAGES): the work item of each K/V stage (-1: no more); then two slots
            # that hand the producer warpgroup the CTA's next item.
            fields["sItem"] = cute.struct.Align[cute.struct.MemRange[
                cutlass.Int32, KV_STAGES + 2], 16]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _mbarrier_count(self) -> int:
        return self.q_ring.count + (self.kv_ring.count if self.persistent else 0)

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                 cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, kv_lens: cute.Tensor,
                 page_table: cute.Tensor, k2q_row_ptr: cute.Tensor, qsplit: cute.Tensor,
                 metadata: cute.Tensor, work_count: cute.Tensor, o_partial: cute.Tensor,
                 lse_partial: cute.Tensor, lse_t_partial: cute.Tensor,
                 softmax_scale: cutlass.Float32, inv_temperature: cutlass.Float32,
                 causal: cutlass.Int32, want_lse_t: cutlass.Int32, item_counter: cute.Tensor,
                 num_ctas: cutlass.Int32, stream):
        G = self.group
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.qk_dtype)
        q_layout = cute.tile_to_shape(atom, (WG_ROWS, HEAD_DIM, self.q_stages), (0, 1, 2))
        q_box = cute.tile_to_shape(atom, (G, self.q_box_cols), (0, 1))
        k_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM), (0, 1))
        if cutlass.const_expr(self.persistent):
            k_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM, KV_STAGES), (0, 1, 2))
        v_layout = k_layout
        v_raw_layout = cute.tile_to_shape(atom, (BLOCK_N, HEAD_DIM), (0, 1))
        if cutlass.const_expr(self.transpose_v):
            v_layout = cute.tile_to_shape(atom, (HEAD_DIM, BLOCK_N), (0, 1))   # Vt
            if cutlass.const_expr(self.persistent):
                v_layout = cute.tile_to_shape(atom, (HEAD_DIM, BLOCK_N, KV_STAGES), (0, 1, 2))
        o_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                                 self.partial_dtype)
        o_layout = cute.tile_to_shape(o_atom, (WG_ROWS, HEAD_DIM, self.consumers), (0, 1, 2))
        o_box = cute.tile_to_shape(o_atom, (G, self.o_box_cols), (0, 1))
        SharedStorage = self._shared_storage(q_layout, k_layout, v_layout, o_layout,
                                             v_raw_layout)

        # TMA views with the (head, channel) box first: q (head, channel, token), o_partial
        # (head, channel, token, slot).
        q_view = cute.make_tensor(q.iterator, cute.select(q.layout, mode=[1, 2, 0]))
        o_view = cute.make_tensor(o_partial.iterator,
                                  cute.select(o_partial.layout, mode=[2, 3, 1, 0]))
        tma_q, tQ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q_view,
                                                q_box, (G, self.q_box_cols))
        tma_o, tO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), o_view,
                                                o_box, (G, self.o_box_cols))

        gather_copy = row_copy(self.qk_dtype, 16)                       # one warpgroup
        convert_load = row_copy(self.qk_dtype, 16, async_copy=False)
        # The dense FMHA's warpgroup MMAs (Q/K/V and P of one dtype; e4m3 P V reads the
        # key-permuted Vt K-major) and its accumulator -> staged-O copy, in the partial dtype.
        mma_qk, mma_pv, stage_o_copy, _ = mmas_and_o_copies(self.qk_dtype, self.partial_dtype)

        grid = (cute.size(metadata.shape[0]), 1, 1)       # a CTA per possible work item
        if cutlass.const_expr(self.persistent):
            grid = (cutlass.min(cute.size(metadata.shape[0]), num_ctas), 1, 1)
        self.kernel_ws(q, k, v, cu_seqlens_q, cu_seqlens_k, kv_lens, page_table, k2q_row_ptr,
                       qsplit, metadata, work_count, lse_partial, lse_t_partial,
                       softmax_scale * LOG2_E, inv_temperature, causal, want_lse_t,
                       item_counter, tQ, tO,
                       tma_q, tma_o, q_layout, k_layout, v_layout, o_layout, v_raw_layout,
                       gather_copy, convert_load, mma_qk, mma_pv, stage_o_copy,
                       SharedStorage).launch(
            grid=grid, block=(128 * (1 + self.consumers), 1, 1), stream=stream,
            min_blocks_per_mp=1)

    @cute.kernel
    def kernel_ws(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuQ: cute.Tensor,
                  mCuK: cute.Tensor, mKvLens: cute.Tensor, mPageTable: cute.Tensor,
                  mRowPtr: cute.Tensor, mQsplit: cute.Tensor, mMeta: cute.Tensor,
                  mWorkCount: cute.Tensor, mLsePartial: cute.Tensor, mLseTPartial: cute.Tensor,
                  scale_log2: cutlass.Float32, inv_temperature: cutlass.Float32,
                  causal: cutlass.Int32, want_lse_t: cutlass.Int32,
                  mItemCounter: cute.Tensor, tQ: cute.Tensor,
                  tO: cute.Tensor, tma_q: cute.CopyAtom, tma_o: cute.CopyAtom,
                  q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout,
                  v_layout: cute.ComposedLayout, o_layout: cute.ComposedLayout,
                  v_raw_layout: cute.ComposedLayout,
                  gather_copy: cute.TiledCopy, convert_load: cute.TiledCopy,
                  mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, stage_o_copy: cute.TiledCopy,
                  SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        work, _, _ = cute.arch.block_idx()
        if work < mWorkCount[0]:
            storage, sQ_stages, sO_wgs, sEntry, mbar, wg, warp = self._cta_setup(
                tidx, tma_q, tma_o, q_layout, o_layout, SharedStorage)
            if cutlass.const_expr(self.persistent):
                # CTA `work` starts on item `work` and fetches the next ones from the item
                # counter (grid <= the SM count), never past the schedule's rows whatever
                # work_count says.
                n_ctas, _, _ = cute.arch.grid_dim()
                n_work = cutlass.min(mWorkCount[0], mMeta.shape[0])
                sItem = storage.sItem.get_tensor(cute.make_layout(KV_STAGES + 2))
                if wg == 0:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    self._produce_items(mK, mV, mCuQ, mCuK, mKvLens, mPageTable, mRowPtr,
                                        mQsplit, mMeta, n_work, mItemCounter, tQ, tma_q,
                                        storage, sQ_stages, sEntry, sItem, mbar, k_layout,
                                        v_layout, v_raw_layout, gather_copy, convert_load,
                                        work, n_ctas, tidx, warp)
                else:
                    cute.arch.setmaxregister_increase(self.mma_regs)
                    self._consume_items(mK, mCuQ, mCuK, mKvLens, mPageTable, mRowPtr, mMeta,
                                        mLsePartial, mLseTPartial, tO, tma_o, storage,
                                        sQ_stages, sO_wgs, sEntry, sItem, mbar, k_layout,
                                        v_layout, mma_qk, mma_pv, stage_o_copy, scale_log2,
                                        inv_temperature, causal, want_lse_t, tidx - 128,
                                        wg - 1)
            else:
                (head_kv, csr_row, q_begin, q_count, batch, kv_block, q_start,
                 q_len) = self._work_item(mMeta, mCuQ, work)
                entry0, n_tiles = self._tile_span(mRowPtr, head_kv, csr_row, q_begin, q_count)
                if wg == 0:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if warp == 0:
                        self._produce_q(mQsplit, tQ, tma_q, sQ_stages, sEntry, mbar, head_kv,
                                        entry0, q_count, q_start, n_tiles, tidx % 32, 0)
                else:
                    cute.arch.setmaxregister_increase(self.mma_regs)
                    self._consume(mK, mV, mCuK, mKvLens, mPageTable, mLsePartial,
                                  mLseTPartial, tO, tma_o, storage, sQ_stages, sO_wgs, sEntry,
                                  mbar, k_layout, v_layout, gather_copy, convert_load, mma_qk,
                                  mma_pv, stage_o_copy, head_kv, batch, kv_block, q_start,
                                  q_len, n_tiles, scale_log2, inv_temperature, causal,
                                  want_lse_t, tidx - 128, wg - 1)

    @cute.jit
    def _cta_setup(self, tidx, tma_q: cute.CopyAtom, tma_o: cute.CopyAtom,
                   q_layout: cute.ComposedLayout, o_layout: cute.ComposedLayout,
                   SharedStorage: cutlass.Constexpr):
        """Shared memory, the rings' mbarriers, the zeroed Q ring; returns (storage, Q stages,
        O tiles, entries, mbarriers, warpgroup, warp) after a CTA barrier."""
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ_stages = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sO_wgs = sQ_stages                      # o_in_q_stage: O over the tile's Q stage
        if cutlass.const_expr(not self.o_in_q_stage):
            sO_wgs = storage.sO.get_tensor(o_layout.outer, swizzle=o_layout.inner)
        sEntry = storage.sEntry.get_tensor(
            cute.make_layout((self.queries_per_tile, self.q_stages)))
        mbar = storage.mbar.data_ptr()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        warp = cute.arch.make_warp_uniform(tidx // 32)
        if warp == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.q_stages):
                    cute.arch.mbarrier_init(self.q_ring.full(mbar, s), 1)
                    cute.arch.mbarrier_init(self.q_ring.empty(mbar, s), 4)
                if cutlass.const_expr(self.persistent):
                    for s in cutlass.range_constexpr(KV_STAGES):
                        cute.arch.mbarrier_init(self.kv_ring.full(mbar, s), 2 * 128)
                        cute.arch.mbarrier_init(self.kv_ring.empty(mbar, s),
                                                4 * self.consumers)
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_o)
        zeroing = wg > 0
        if cutlass.const_expr(self.consumers > 2):
            zeroing = zeroing & (wg < 3)        # the zeroing copy spans 256 threads
        if zeroing:
            # Rows of missing queries are multiplied too: start the ring from zeros, and
            # publish the zeros to the async proxy before the first TMA lands.
            zero_copy = row_copy(self.qk_dtype, 16 * min(self.consumers, 2),
                                 async_copy=False)
            thr_zero = zero_copy.get_slice(tidx - 128)
            for s in cutlass.range_constexpr(self.q_stages):
                thr_zero.partition_D(sQ_stages[None, None, s]).fill(0)
            cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return storage, sQ_stages, sO_wgs, sEntry, mbar, wg, warp

    # ---- producer (one warp) ---------------------------------------------------------------
    @cute.jit
    def _produce_q(self, mQsplit: cute.Tensor, tQ: cute.Tensor, tma_q: cute.CopyAtom,
                   sQ_stages: cute.Tensor, sEntry: cute.Tensor, mbar, head_kv: cutlass.Int32,
                   entry0: cutlass.Int32, q_count: cutlass.Int32, q_start: cutlass.Int32,
                   n_tiles: cutlass.Int32, lane: cutlass.Int32, ring_base):
        """Per tile: wait for the stage to be free, publish the tile's entries (lane i: query
        i, -1 past the work item) and TMA-load the G x 128 Q rows of each of its queries.
        ring_base: the Q ring's tiles before this item's (the persistent form's earlier items;
        0 for one item a CTA)."""
        G = self.group
        qpt = self.queries_per_tile
        # ((G, cols) box, query, column half, stage) and ((G, cols) box, head group, column
        # half, token).
        sQ_boxes = cute.group_modes(cute.flat_divide(sQ_stages, (G, self.q_box_cols)), 0, 2)
        gQ_boxes = cute.group_modes(cute.flat_divide(tQ, (G, self.q_box_cols)), 0, 2)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), sQ_boxes, gQ_boxes)
        for tile in range(n_tiles):
            ring_tile = ring_base + tile
            stage = ring_tile % self.q_stages
            self.q_ring.wait_empty(mbar, ring_tile)
            n_valid = cutlass.min(qpt, q_count - tile * qpt)
            packed = cutlass.Int32(-1)
            if lane < n_valid:
                packed = mQsplit[head_kv, entry0 + tile * qpt + lane]
            if lane < qpt:
                sEntry[lane, stage] = packed
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(self.q_ring.full(mbar, stage),
                                                        n_valid * self.q_query_bytes)
            for i in cutlass.range_constexpr(qpt):
                packed_i = cute.arch.shuffle_sync(packed, i)
                if i < n_valid:
                    # -1 (no slot) maps past q: the TMA zero-fills the box.
                    token = q_start + (packed_i & LOCAL_QUERY_MASK)
                    for h in cutlass.range_constexpr(HEAD_DIM // self.q_box_cols):
                        cute.copy(tma_q, tQgQ[None, head_kv, h, token],
                                  tQsQ[None, i, h, stage],
                                  tma_bar_ptr=self.q_ring.full(mbar, stage))

    @cute.jit
    def _load_v_rows(self, gather_copy, convert_load, wg_tidx, mV, kv_row0, head_kv, n_keys,
                     sV_rows):
        """The block's V rows (e4m3: transposed through registers into the key-permuted Vt)."""
        if cutlass.const_expr(self.transpose_v):
            self._load_kv_rows(convert_load, wg_tidx, mV, kv_row0, head_kv, n_keys, sV_rows,
                               through_registers=True)
        else:
            self._load_kv_rows(gather_copy, wg_tidx, mV, kv_row0, head_kv, n_keys, sV_rows)

    @cute.jit
    def _move_rows(self, row_copy_, tidx, src, dst):
        """Copy this thread's chunks of a (key, channel) tile, as row_copy_ partitions it (the
        chunks its own row copy wrote), from src to dst through registers."""
        thr = row_copy_.get_slice(tidx)
        tS = thr.partition_D(src)
        tD = thr.partition_D(dst)
        for m in cutlass.range(cute.size(tD.shape[1]), unroll=1):
            frag = cute.make_fragment_like(tS[None, m, None])
            frag.store(tS[None, m, None].load())
            tD[None, m, None].store(frag.load())

    # ---- consumers (two or three warpgroups) ----------------------------------------------
    @cute.jit
    def _consume(self, mK, mV, mCuK, mKvLens, mPageTable, mLsePartial, mLseTPartial, tO,
                 tma_o, storage, sQ_stages, sO_wgs, sEntry, mbar, k_layout, v_layout,
                 gather_copy, convert_load, mma_qk, mma_pv, stage_o_copy, head_kv, batch,
                 kv_block, q_start, q_len, n_tiles, scale_log2, inv_temperature, causal,
                 want_lse_t, ctidx, mwg):
        wg_tidx = ctidx % 128
        lane = ctidx % 32
        warp_in_wg = cute.arch.make_warp_uniform(wg_tidx // 32)
        kv_row0, n_keys, causal_shift = self._kv_block_bounds(mK, mCuK, mKvLens, mPageTable,
                                                              batch, kv_block, q_len)

        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        if cutlass.const_expr(self.transpose_v):
            # sV is Vt (channel x key); the load stores key c at Vt column pi(c).
            sVt = sV
            sV_rows = cute.composition(sV, register_p_key_order())
        else:
            sVt = cute.composition(sV, cute.make_ordered_layout((HEAD_DIM, BLOCK_N),
                                                                order=(1, 0)))
            sV_rows = sV

        # ---- the block's K (warpgroup 0) and V (warpgroup 1), rows past n_keys zeroed
        if mwg == 0:
            self._load_kv_rows(gather_copy, wg_tidx, mK, kv_row0, head_kv, n_keys, sK)
        if mwg == 1:
            self._load_v_rows(gather_copy, convert_load, wg_tidx, mV, kv_row0, head_kv, n_keys,
                              sV_rows)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        NamedBarrier(BAR_CONSUMERS, 128 * self.consumers).sync()

        # (.., .., K, stage) Q fragments.
        tSrQ, tSrK, tOrVt, tScS, acc_s, acc_o, a_shape = consumer_fragments(
            mma_qk, mma_pv, wg_tidx, sQ_stages, sK, sVt)
        thr_stage_o, tOsO_mine, tOsO, tOgO = self._o_store_partitions(
            stage_o_copy, wg_tidx, sO_wgs, tO, tma_o, mwg)

        for tile in range(mwg, n_tiles, self.consumers):
            self._consume_tile(tile, tSrQ, tSrK, tOrVt, tScS, acc_s, acc_o, a_shape,
                               thr_stage_o, tOsO_mine, sO_wgs, tOsO, tOgO, tma_o, sEntry, mbar,
                               mma_qk, mma_pv, stage_o_copy, mLsePartial, mLseTPartial,
                               head_kv, q_start, q_len, n_keys, causal_shift, scale_log2,
                               inv_temperature, causal, want_lse_t, mwg, warp_in_wg, lane)
        # The O tile must outlive the stores reading it.
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    def _o_store_partitions(self, stage_o_copy, wg_tidx, sO_wgs, tO, tma_o, mwg):
        """(thr_stage_o, this warpgroup's staged O tile, the TMA store's shared and global
        boxes): ((G, cols) box, query, column half, warpgroup) and ((G, cols) box, head group,
        column half, token, slot)."""
        G = self.group
        thr_stage_o = stage_o_copy.get_slice(wg_tidx)
        tOsO_mine = thr_stage_o.partition_D(sO_wgs[None, None, mwg])
        sO_boxes = cute.group_modes(cute.flat_divide(sO_wgs, (G, self.o_box_cols)), 0, 2)
        gO_boxes = cute.group_modes(cute.flat_divide(tO, (G, self.o_box_cols)), 0, 2)
        tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), sO_boxes, gO_boxes)
        return thr_stage_o, tOsO_mine, tOsO, tOgO

    @cute.jit
    def _consume_tile(self, ring_tile, tSrQ, tSrK, tOrVt, tScS, acc_s, acc_o, a_shape,
                      thr_stage_o, tOsO_mine, sO_wgs, tOsO, tOgO, tma_o, sEntry, mbar, mma_qk,
                      mma_pv,
                      stage_o_copy, mLsePartial, mLseTPartial, head_kv, q_start, q_len, n_keys,
                      causal_shift, scale_log2, inv_temperature, causal, want_lse_t, mwg,
                      warp_in_wg, lane):
        """One 64-row tile on Q ring tile ring_tile against the block's K (tSrK) and V (tOrVt):
        S = Q K^T, the block's softmax, O = P V, O staged and TMA-stored into each query's
        slot, the LSE rows written, the Q stage handed back (o_in_q_stage: O staged over the
        tile's Q stage, handed back once the stores have read it)."""
        n_my_rows = cute.size(tScS, mode=[0])
        n_my_cols = cute.size(tScS, mode=[1])
        stage = ring_tile % self.q_stages
        self.q_ring.wait_full(mbar, ring_tile)
        warpgroup_gemm(mma_qk, acc_s, tSrQ[None, None, None, stage], tSrK)

        s_rc = wgmma_rows_cols_view(acc_s)
        row_lse, row_lse_t, row_inv_sum = self._tile_softmax(
            s_rc, tScS, n_my_rows, n_my_cols, sEntry, stage, n_keys, causal, causal_shift,
            scale_log2, inv_temperature, want_lse_t)
        r_p = cute.make_fragment_like(acc_s, self.pv_dtype)
        r_p.store(acc_s.load().to(self.pv_dtype))
        if cutlass.const_expr(self.transpose_v):
            t_p = register_p_operand(r_p, a_shape)
        else:
            t_p = wgmma_accumulator_as_operand_a(r_p)
        warpgroup_gemm(mma_pv, acc_o, t_p, tOrVt)

        scale_rows(wgmma_rows_cols_view(acc_o), row_inv_sum)
        r_o = cute.make_fragment_like(acc_o, self.partial_dtype)
        r_o.store(acc_o.load().to(self.partial_dtype))
        o_slot = mwg
        o_staged = tOsO_mine
        if cutlass.const_expr(self.o_in_q_stage):
            o_slot = stage
            o_staged = thr_stage_o.partition_D(sO_wgs[None, None, stage])
        else:
            # The O tile is free once this warpgroup's previous stores have read it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        NamedBarrier(BAR_WG + mwg, 128).sync()
        cute.copy(stage_o_copy, thr_stage_o.retile(r_o), o_staged)
        cute.arch.fence_proxy("async.shared", space="cta")
        NamedBarrier(BAR_WG + mwg, 128).sync()
        # Warp w stores queries w, w + 4: G rows x 128 channels into the query's slot.
        for i in cutlass.range_constexpr((self.queries_per_tile + 3) // 4):
            query = warp_in_wg + 4 * i
            if query < self.queries_per_tile:
                packed = sEntry[query, stage]
                q_local = packed & LOCAL_QUERY_MASK
                if packed >= 0 and q_local < q_len:
                    for h in cutlass.range_constexpr(HEAD_DIM // self.o_box_cols):
                        cute.copy(tma_o, tOsO[None, query, h, o_slot],
                                  tOgO[None, head_kv, h, q_start + q_local,
                                       packed >> SLOT_SHIFT])
        cute.arch.cp_async_bulk_commit_group()
        self._write_lse_rows(tScS, n_my_rows, row_lse, row_lse_t, want_lse_t, sEntry, stage,
                             q_start, q_len, head_kv, mLsePartial, mLseTPartial, lane)
        if cutlass.const_expr(self.o_in_q_stage):
            cute.arch.cp_async_bulk_wait_group(0, read=True)     # the stores read the stage
        # Last reads of this stage's entries are done: hand the Q stage back.
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(self.q_ring.empty(mbar, stage))

    # ---- the persistent form: producer warpgroup and consumers over a CTA's work items --------
    @cute.jit
    def _produce_items(self, mK, mV, mCuQ, mCuK, mKvLens, mPageTable, mRowPtr, mQsplit, mMeta,
                       n_work, mItemCounter, tQ, tma_q, storage, sQ_stages, sEntry, sItem, mbar,
                       k_layout, v_layout, v_raw_layout, gather_copy, convert_load, first_work,
                       n_ctas, tidx, warp):
        """Every thread of the producer warpgroup loads its share of each item's K and V rows
        into the item's K/V stage (cp.async; rows past the keys zeroed) and arrives on the
        stage's full barrier twice: when its copies land and after its zero stores; thread 0
        publishes the item's number beside the stage first and fetches the CTA's next item
        from the counter (its atomic in flight under the copies); warp 0 then TMA-loads the
        item's Q tiles into the Q ring, numbered on from earlier items. After the last item
        the next stage carries -1. e4m3 (transpose_v): the V rows land in a raw stage first;
        each thread then moves the chunks it copied itself (no barrier) into the stage's
        key-permuted Vt, before its second arrival."""
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        item = cutlass.Int32(0)
        ring_base = cutlass.Int32(0)
        work = first_work
        while work < n_work:
            fetched = cutlass.Int32(0)
            if tidx == 0:
                fetched = cute.arch.atomic_add(mItemCounter.iterator, cutlass.Int32(1),
                                               sem="relaxed", scope="gpu")
            (head_kv, csr_row, q_begin, q_count, batch, kv_block, q_start,
             q_len) = self._work_item(mMeta, mCuQ, work)
            entry0, n_tiles = self._tile_span(mRowPtr, head_kv, csr_row, q_begin, q_count)
            kv_row0, n_keys, _ = self._kv_block_bounds(mK, mCuK, mKvLens, mPageTable, batch,
                                                       kv_block, q_len)
            kv_stage = item % KV_STAGES
            self.kv_ring.wait_empty(mbar, item)
            if tidx == 0:
                sItem[kv_stage] = work
            self._load_kv_rows(gather_copy, tidx, mK, kv_row0, head_kv, n_keys,
                               sK[None, None, kv_stage])
            if cutlass.const_expr(self.transpose_v):
                sVraw = storage.sVraw.get_tensor(v_raw_layout.outer, swizzle=v_raw_layout.inner)
                self._load_kv_rows(gather_copy, tidx, mV, kv_row0, head_kv, n_keys, sVraw)
            else:
                self._load_kv_rows(gather_copy, tidx, mV, kv_row0, head_kv, n_keys,
                                   sV[None, None, kv_stage])
            cute.arch.cp_async_mbarrier_arrive_noinc(self.kv_ring.full(mbar, kv_stage))
            if cutlass.const_expr(self.transpose_v):
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                self._move_rows(convert_load, tidx, sVraw, cute.composition(
                    sV[None, None, kv_stage], register_p_key_order()))
            cute.arch.fence_proxy("async.shared", space="cta")       # zeroed / moved rows
            cute.arch.mbarrier_arrive(self.kv_ring.full(mbar, kv_stage))
            # The next item, through a slot that alternates per item (a slot is rewritten
            # two items later, after every thread passed the barrier between).
            if tidx == 0:
                sItem[KV_STAGES + item % 2] = n_ctas + fetched
            NamedBarrier(BAR_PRODUCER, 128).sync()
            next_work = sItem[KV_STAGES + item % 2]
            if warp == 0:
                self._produce_q(mQsplit, tQ, tma_q, sQ_stages, sEntry, mbar, head_kv, entry0,
                                q_count, q_start, n_tiles, tidx % 32, ring_base)
            ring_base = ring_base + n_tiles
            item = item + 1
            work = next_work
        # No more items: the next stage says so (two arrivals a thread, as for an item).
        kv_stage = item % KV_STAGES
        self.kv_ring.wait_empty(mbar, item)
        if tidx == 0:
            sItem[kv_stage] = -1
        cute.arch.mbarrier_arrive(self.kv_ring.full(mbar, kv_stage))
        cute.arch.mbarrier_arrive(self.kv_ring.full(mbar, kv_stage))
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _consume_items(self, mK, mCuQ, mCuK, mKvLens, mPageTable, mRowPtr, mMeta, mLsePartial,
                       mLseTPartial, tO, tma_o, storage, sQ_stages, sO_wgs, sEntry, sItem, mbar,
                       k_layout, v_layout, mma_qk, mma_pv, stage_o_copy, scale_log2,
                       inv_temperature, causal, want_lse_t, ctidx, mwg):
        """Per item: wait for its K/V stage and read the item's number beside it (-1: done),
        take the item's tiles whose Q ring number falls to this warpgroup (round-robin over
        the consumers), then release the stage (one arrival per warp)."""
        wg_tidx = ctidx % 128
        lane = ctidx % 32
        warp_in_wg = cute.arch.make_warp_uniform(wg_tidx // 32)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sVt = sV                             # e4m3: the producer wrote Vt
        if cutlass.const_expr(not self.transpose_v):
            sVt = cute.composition(sV, cute.make_ordered_layout(
                (HEAD_DIM, BLOCK_N, KV_STAGES), order=(1, 0, 2)))
        # (.., .., K, stage) fragments of the Q ring and of both K/V stages.
        tSrQ, tSrK, tOrVt, tScS, acc_s, acc_o, a_shape = consumer_fragments(
            mma_qk, mma_pv, wg_tidx, sQ_stages, sK, sVt)
        thr_stage_o, tOsO_mine, tOsO, tOgO = self._o_store_partitions(
            stage_o_copy, wg_tidx, sO_wgs, tO, tma_o, mwg)
        item = cutlass.Int32(0)
        ring_base = cutlass.Int32(0)
        self.kv_ring.wait_full(mbar, 0)
        work = sItem[0]
        while work >= 0:
            kv_stage = item % KV_STAGES
            cute.arch.fence_proxy("async.shared", space="cta")
            (head_kv, csr_row, q_begin, q_count, batch, kv_block, q_start,
             q_len) = self._work_item(mMeta, mCuQ, work)
            n_tiles = (q_count + self.queries_per_tile - 1) // self.queries_per_tile
            _, n_keys, causal_shift = self._kv_block_bounds(mK, mCuK, mKvLens, mPageTable,
                                                            batch, kv_block, q_len)
            first = (mwg + self.consumers - ring_base % self.consumers) % self.consumers
            for tile in range(first, n_tiles, self.consumers):
                self._consume_tile(ring_base + tile, tSrQ, tSrK[None, None, None, kv_stage],
                                   tOrVt[None, None, None, kv_stage], tScS, acc_s, acc_o,
                                   a_shape, thr_stage_o, tOsO_mine, sO_wgs, tOsO, tOgO, tma_o,
                                   sEntry, mbar, mma_qk, mma_pv, stage_o_copy, mLsePartial,
                                   mLseTPartial, head_kv, q_start, q_len, n_keys, causal_shift,
                                   scale_log2, inv_temperature, causal, want_lse_t, mwg,
                                   warp_in_wg, lane)
            # This warp's wgmmas on the stage are done (each tile waits for its own) and its
            # lanes read the item's number: hand the stage back.
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(self.kv_ring.empty(mbar, kv_stage))
            ring_base = ring_base + n_tiles
            item = item + 1
            self.kv_ring.wait_full(mbar, item)
            work = sItem[item % KV_STAGES]
        # The O tile must outlive the stores reading it.
        cute.arch.cp_async_bulk_wait_group(0, read=True)
