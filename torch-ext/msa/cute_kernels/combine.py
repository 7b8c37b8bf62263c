"""Combine of the per-block partial attention outputs (the second kernel of sparse prefill).

For each (query q_abs, query head hq) with n = split_counts[q_abs, hq // G] slots:
  L = logsumexp_s LSE_s,   O = sum_s exp(LSE_s - L) * O_s,   (LSE_T likewise from LSE_T_s)
written as O bf16 [total_q, Hq, 128] and LSE fp32 [total_q, Hq]. Rows with no slot, or whose
slots are all -inf, give O = 0 and LSE = -inf. A NaN slot LSE (non-finite data) makes the row's
O and LSE NaN. A row whose split count exceeds the topK slots of o_partial lost work (a CSR
with more rows per query than the call's topK): it comes back NaN too, never silently short.

Each lane reads 16 bytes of a partial row per slot (4 fp32, 8 bf16/fp16 or 16 e4m3 channels),
so a row is a group of 32 (fp32), 16 (16-bit) or 8 (e4m3) lanes and a warp combines 1, 2 or 4
consecutive rows (consecutive heads of one query: contiguous partials). Short calls run the
combine in one wave, bound by the latency of its loads rather than by bytes, so the merge is one
pass: each step issues the loads of UNROLL slots' partial rows and LSEs together (every lane
reads its row's LSEs itself: same addresses across the row, one transaction) and folds them in
with a running max, the accumulator rescaled when the max grows: at topK 16 a thread waits for
memory three times (the split count, then two steps of 8 slots). 16 slots a step (one wait
fewer) ran 1-4 % slower on an H100: twice the registers, fewer warps an SM. The LSE_T merge,
asked for only with the max-score output, spreads the slot LSEs over the row's lanes and
reduces them by shuffles. Lanes of a row past the end still take part (their loads are
clamped to a valid row); only the stores are skipped.
Tensors:
  o_partial [topK, total_q, Hq, 128] fp32, bf16, fp16 or e4m3;
  lse_partial, lse_t_partial [topK, total_q, Hq]; split_counts [total_q, Hkv] int32;
  out [total_q, Hq, 128] bf16;  lse, lse_t [total_q, Hq] fp32
  want_lse_t: int32 flag (lse_t_partial / lse_t are only touched when set)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .geometry import HEAD_DIM, LN_2, LOG2_E
from .softmax import group_max, group_sum

WARPS_PER_CTA = 4
UNROLL = 8             # slots whose partial rows are loaded together (4 for fp32 partials)


class SparseCombineSm90:
    """Compile-time configuration: only the partial dtype changes the code."""

    def __init__(self, partial_dtype=cutlass.Float32):
        self.partial_dtype = partial_dtype
        self.vec = 128 // partial_dtype.width                 # channels per 16-byte load
        self.lanes_per_row = HEAD_DIM // self.vec
        self.rows_per_warp = 32 // self.lanes_per_row
        # fp32 partials: 4 slots in flight (8 made ptxas spill a register across the loop).
        self.unroll = UNROLL if partial_dtype.width < 32 else 4

    @cute.jit
    def __call__(self, o_partial: cute.Tensor, lse_partial: cute.Tensor,
                 lse_t_partial: cute.Tensor, split_counts: cute.Tensor, out: cute.Tensor,
                 lse: cute.Tensor, lse_t: cute.Tensor, want_lse_t: cutlass.Int32, stream):
        rows = out.shape[0] * out.shape[1]
        rows_per_cta = WARPS_PER_CTA * self.rows_per_warp
        self.kernel(o_partial, lse_partial, lse_t_partial, split_counts, out, lse, lse_t,
                    want_lse_t).launch(
            grid=((rows + rows_per_cta - 1) // rows_per_cta, 1, 1),
            block=(WARPS_PER_CTA * 32, 1, 1), stream=stream)

    @cute.jit
    def _lse_merge(self, a: cutlass.Float32, b: cutlass.Float32,
                   s0: cutlass.Int32) -> cutlass.Float32:
        """log(exp(a) + exp(b)); exactly b on the first pass (s0 == 0, a == -inf). NaN
        propagates (fmax drops a NaN operand, so the -inf branch adds a + b: -inf, or NaN)."""
        merged = b
        if s0 > 0:
            hi = cute.arch.fmax(a, b)
            merged = a + b
            if hi != -cutlass.Float32.inf:
                merged = hi + cute.math.log2(
                    cute.math.exp2((a - hi) * LOG2_E, fastmath=True)
                    + cute.math.exp2((b - hi) * LOG2_E, fastmath=True), fastmath=True) * LN_2
        return merged

    @cute.jit
    def _row_lse(self, mLse: cute.Tensor, n_slots: cutlass.Int32, q_abs: cutlass.Int32,
                 hq: cutlass.Int32, lane_in_row: cutlass.Int32):
        """(max_log2, weight_sum, L): the log2-scaled max slot LSE (0 when every slot is -inf,
        so exp2 of -inf stays 0), sum_s exp2(LSE_s log2(e) - max_log2), and the merged LSE
        (-inf for an empty row, NaN when a slot LSE is NaN: != is an unordered compare)."""
        lanes = self.lanes_per_row
        lse_s = -cutlass.Float32.inf
        for s0 in range(0, n_slots, lanes):
            if s0 + lane_in_row < n_slots:
                lse_s = self._lse_merge(lse_s, mLse[s0 + lane_in_row, q_abs, hq], s0)
        lse_max = group_max(lse_s, lanes)
        max_log2 = lse_max * LOG2_E
        if lse_max == -cutlass.Float32.inf:
            max_log2 = 0.0
        weight_sum = group_sum(cute.math.exp2(lse_s * LOG2_E - max_log2, fastmath=True), lanes)
        merged = -cutlass.Float32.inf
        if weight_sum != 0.0:
            merged = (max_log2 + cute.math.log2(weight_sum, fastmath=True)) * LN_2
        return max_log2, weight_sum, merged

    @cute.kernel
    def kernel(self, mOPartial: cute.Tensor, mLsePartial: cute.Tensor,
               mLseTPartial: cute.Tensor, mSplitCounts: cute.Tensor, mOut: cute.Tensor,
               mLse: cute.Tensor, mLseT: cute.Tensor, want_lse_t: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane_in_row = tidx % self.lanes_per_row
        num_heads = mOut.shape[1]
        rows = mOut.shape[0] * num_heads
        row = cta * (WARPS_PER_CTA * self.rows_per_warp) + tidx // self.lanes_per_row
        in_range = row < rows
        row = cutlass.min(row, rows - 1)       # past the end: reads row rows - 1, stores nothing
        q_abs = row // num_heads
        hq = row % num_heads
        group = num_heads // mSplitCounts.shape[1]
        n_entries = mSplitCounts[q_abs, hq // group]
        n_slots = cutlass.min(n_entries, mOPartial.shape[0])

        # One pass over the slots, self.unroll at a time, every load of a step issued before
        # any is used: weights exp2(LSE_s log2(e) - base), base the running max (0 while every
        # slot so far is -inf, so their weights are 0), the sums rescaled when it grows. Slots
        # past the end are clamped to a written slot and get LSE -inf. fmax drops a NaN LSE
        # from the max, but its weight is NaN, so NaN reaches O and the LSE.
        acc = cute.make_rmem_tensor((self.vec,), cutlass.Float32)
        acc.fill(0.0)
        running_max = -cutlass.Float32.inf
        weight_sum = cutlass.Float32(0.0)
        for s0 in range(0, n_slots, self.unroll):
            parts = []
            lses = []
            for u in cutlass.range_constexpr(self.unroll):
                s = cutlass.min(s0 + u, n_slots - 1)
                lse_s = mLsePartial[s, q_abs, hq] * LOG2_E
                if s0 + u >= n_slots:
                    lse_s = -cutlass.Float32.inf
                lses.append(lse_s)
                parts.append(cute.local_tile(mOPartial[s, q_abs, hq, None], (self.vec,),
                                             (lane_in_row,)).load())
            step_max = running_max
            for u in cutlass.range_constexpr(self.unroll):
                step_max = cute.arch.fmax(step_max, lses[u])
            new_base = step_max
            if step_max == -cutlass.Float32.inf:
                new_base = 0.0
            # The earlier max, not the earlier base: 0 while no slot so far was finite (an
            # exponent of -base could overflow to inf and turn the zero sums into NaN).
            rescale = cute.math.exp2(running_max - new_base, fastmath=True)
            weight_sum = weight_sum * rescale
            acc.store(acc.load() * rescale)
            for u in cutlass.range_constexpr(self.unroll):
                w = cute.math.exp2(lses[u] - new_base, fastmath=True)
                weight_sum = weight_sum + w
                acc.store(acc.load() + parts[u].to(cutlass.Float32) * w)
            running_max = step_max

        out_lse = -cutlass.Float32.inf
        if n_entries > mOPartial.shape[0]:
            weight_sum = cutlass.Float32.nan      # entries past the slots were dropped
        inv = cutlass.Float32(0.0)
        if weight_sum != 0.0:                     # true for NaN too: NaN reaches O and LSE
            # A nonzero sum had a finite running max as its last base (a NaN sum gives NaN
            # whatever the max).
            inv = 1.0 / weight_sum
            out_lse = (running_max + cute.math.log2(weight_sum, fastmath=True)) * LN_2
        acc.store(acc.load() * inv)

        want_t = want_lse_t != 0
        out_lse_t = -cutlass.Float32.inf
        if want_t:
            _, _, out_lse_t = self._row_lse(mLseTPartial, n_slots, q_abs, hq, lane_in_row)
            if n_entries > mOPartial.shape[0]:
                out_lse_t = cutlass.Float32.nan
        if in_range:
            dst = cute.local_tile(mOut[q_abs, hq, None], (self.vec,), (lane_in_row,))
            dst.store(acc.load().to(mOut.element_type))
            if lane_in_row == 0:
                mLse[q_abs, hq] = out_lse
                if want_t:
                    mLseT[q_abs, hq] = out_lse_t
