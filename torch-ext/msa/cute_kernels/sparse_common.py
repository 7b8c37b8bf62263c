"""What the KV-outer sparse prefill attention kernels share (sparse_prefill_sm90.py warp MMA,
sparse_prefill_sm90_wgmma.py, sparse_prefill_sm90_ws.py): the work item and its KV block, the
gather of a Q tile (each query's G heads are G * 128 contiguous elements of q), the single-block
softmax of a tile's rows, and the epilogue that writes each query's partial rows and LSE to its
slot.

A work item of the k2q schedule (msa.src.sm100.prepare_scheduler) is (KV head h, CSR row,
q_begin, q_count, request b, KV block beta): one 128x128 K and V block of (b, beta, h) against
the item's queries, in tiles of tile_m rows = (tile_m / G queries) x (G query heads of h). The
softmax covers one block only (no online rescale): LSE_blk = m + ln sum exp(s - m), and rows
that see no key get LSE = -inf, O = 0; the combine kernel (combine.py) merges the slots.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .copies import kv_row_iterator, warp_row_store_copy
from .geometry import BLOCK_N, HEAD_DIM, LN_2, LOCAL_QUERY_MASK, ROWS_PER_WARP, SLOT_SHIFT
from .softmax import mask_row_and_max, quad_max, quad_sum


class SparsePrefillBase:
    """The compile-time configuration every sparse attention kernel has (head group G, KV
    layout, partial dtype) and the device code they share. Subclasses set tile_m and
    queries_per_tile = tile_m // G."""

    def __init__(self, qhead_per_kv: int, paged: bool, partial_dtype=cutlass.Float32):
        assert qhead_per_kv in (1, 2, 4, 8, 16)
        self.group = qhead_per_kv
        self.paged = paged
        self.partial_dtype = partial_dtype

    @cute.jit
    def _tile_span(self, mRowPtr: cute.Tensor, head_kv: cutlass.Int32, csr_row: cutlass.Int32,
                   q_begin: cutlass.Int32, q_count: cutlass.Int32):
        """(entry0, n_tiles): the work item's first qsplit entry and its number of Q tiles."""
        entry0 = mRowPtr[head_kv, csr_row] + q_begin
        n_tiles = (q_count + self.queries_per_tile - 1) // self.queries_per_tile
        return entry0, n_tiles

    def _epilogue_partitions(self, stage_o_copy: cute.TiledCopy, store_o_copy: cute.TiledCopy,
                             tidx):
        """(thr_stage_o, warp_idx, lane, thr_store_o, tWcO, warp_row_stride0): this thread's
        slice of the accumulator -> staged-O copy, its warp and lane, the warp's slice of the
        staged-row store and the coordinates and global row layout of its 16 rows."""
        thr_stage_o = stage_o_copy.get_slice(tidx)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        thr_store_o = store_o_copy.get_slice(lane)
        tWcO = thr_store_o.partition_S(cute.make_identity_tensor((ROWS_PER_WARP, HEAD_DIM)))
        warp_row_stride0 = cute.make_layout((ROWS_PER_WARP, HEAD_DIM), stride=(0, 1))
        return thr_stage_o, warp_idx, lane, thr_store_o, tWcO, warp_row_stride0

    @cute.jit
    def _start_q_gather(self, tXcX: cute.Tensor, mQsplit: cute.Tensor, head_kv, entry0,
                        q_count, sQ_stages: cute.Tensor, sEntry: cute.Tensor, thr_copy,
                        gather_copy: cute.TiledCopy, mQ: cute.Tensor, q_start, q_len,
                        row_stride0: cute.Layout, tidx):
        """Issue the cp.async gather of Q tile 0 into stage 0 (one commit group) and return
        this thread's gather entries of tile 1 (loaded a tile ahead, so the cp.async addresses
        never wait on a global load)."""
        n_gather_rows = cute.size(tXcX.shape[1])
        gather_entries = cute.make_rmem_tensor((n_gather_rows,), cutlass.Int32)
        self._load_gather_entries(gather_entries, mQsplit, head_kv, entry0, 0, q_count, tXcX)
        self._gather_q_tile(gather_entries, sQ_stages, sEntry, 0, thr_copy, gather_copy, tXcX,
                            mQ, q_start, q_len, head_kv, row_stride0, tidx)
        cute.arch.cp_async_commit_group()
        self._load_gather_entries(gather_entries, mQsplit, head_kv, entry0,
                                  self.queries_per_tile, q_count, tXcX)
        return gather_entries

    @cute.jit
    def _tile_softmax(self, s_rc: cute.Tensor, tScS: cute.Tensor, n_my_rows: cutlass.Constexpr,
                      n_my_cols: cutlass.Constexpr, sEntry: cute.Tensor, stage, n_keys, causal,
                      causal_shift, scale_log2, inv_temperature, want_lse_t):
        """The single-block softmax of this thread's rows of a tile (_softmax_rows, S -> P in
        place); returns (row_lse, row_lse_t, row_inv_sum)."""
        row_lse = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
        row_lse_t = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
        row_inv_sum = cute.make_rmem_tensor((n_my_rows,), cutlass.Float32)
        self._softmax_rows(s_rc, tScS, n_my_rows, n_my_cols, sEntry, stage, n_keys, causal,
                           causal_shift, scale_log2, inv_temperature, want_lse_t, row_lse,
                           row_lse_t, row_inv_sum)
        return row_lse, row_lse_t, row_inv_sum

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
        1/sum, LSE and the temperature LSE (-inf and 0 for a row that sees no key; NaN for a
        row whose scores hold a NaN or +inf)."""
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
            # Only a zero sum means "no visible key"; a NaN sum (a NaN or +inf score) must
            # reach O and LSE as NaN (!= is an unordered compare: true for NaN).
            if row_sum != 0.0:
                row_inv_sum[i] = 1.0 / row_sum
                row_lse[i] = (max_scaled + cute.math.log2(row_sum, fastmath=True)) * LN_2
            if want_lse_t != 0:
                row_sum_t = quad_sum(row_sum_t)
                if row_sum_t != 0.0:
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
