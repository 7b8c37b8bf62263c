"""Combine of the per-block partial attention outputs (the second kernel of sparse prefill).

For each (query q_abs, query head hq) with n = split_counts[q_abs, hq // G] slots:
  L = logsumexp_s LSE_s,   O = sum_s exp(LSE_s - L) * O_s,   (LSE_T likewise from LSE_T_s)
written as O bf16 [total_q, Hq, 128] and LSE fp32 [total_q, Hq]. Rows with no slot, or whose
slots are all -inf, give O = 0 and LSE = -inf.

One warp per output row; each lane owns 4 consecutive channels (vector loads of the partials).
Lane s loads slot s's LSE, so the max and the weight sum are two warp reductions instead of a
serial loop over slots; the slot outputs are then read UNROLL at a time (loads in flight together).
Tensors:
  o_partial [topK, total_q, Hq, 128] fp32 or bf16;  lse_partial, lse_t_partial [topK, total_q, Hq]
  split_counts [total_q, Hkv] int32;  out [total_q, Hq, 128] bf16;  lse, lse_t [total_q, Hq] fp32
  want_lse_t: int32 flag (lse_t_partial / lse_t are only touched when set)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .tile_utils import warp_max, warp_sum

HEAD_DIM = 128
WARPS_PER_CTA = 4
CHANNELS_PER_LANE = HEAD_DIM // 32
UNROLL = 4             # slots whose partial rows are loaded together
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


class SparseCombineSm90:
    """Compile-time configuration: only the partial dtype changes the code."""

    def __init__(self, partial_dtype=cutlass.Float32):
        self.partial_dtype = partial_dtype

    @cute.jit
    def __call__(self, o_partial: cute.Tensor, lse_partial: cute.Tensor,
                 lse_t_partial: cute.Tensor, split_counts: cute.Tensor, out: cute.Tensor,
                 lse: cute.Tensor, lse_t: cute.Tensor, want_lse_t: cutlass.Int32, stream):
        rows = out.shape[0] * out.shape[1]
        self.kernel(o_partial, lse_partial, lse_t_partial, split_counts, out, lse, lse_t,
                    want_lse_t).launch(
            grid=((rows + WARPS_PER_CTA - 1) // WARPS_PER_CTA, 1, 1),
            block=(WARPS_PER_CTA * 32, 1, 1), stream=stream)

    @cute.jit
    def _lse_merge(self, a: cutlass.Float32, b: cutlass.Float32,
                   s0: cutlass.Int32) -> cutlass.Float32:
        """log(exp(a) + exp(b)); exactly b on the first pass (s0 == 0, a == -inf)."""
        merged = b
        if s0 > 0:
            hi = cute.arch.fmax(a, b)
            if hi != -cutlass.Float32.inf:
                merged = hi + cute.math.log2(
                    cute.math.exp2((a - hi) * LOG2_E, fastmath=True)
                    + cute.math.exp2((b - hi) * LOG2_E, fastmath=True), fastmath=True) * LN_2
        return merged

    @cute.kernel
    def kernel(self, mOPartial: cute.Tensor, mLsePartial: cute.Tensor,
               mLseTPartial: cute.Tensor, mSplitCounts: cute.Tensor, mOut: cute.Tensor,
               mLse: cute.Tensor, mLseT: cute.Tensor, want_lse_t: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = cta * WARPS_PER_CTA + tidx // 32
        num_heads = mOut.shape[1]
        if row < mOut.shape[0] * num_heads:
            q_abs = row // num_heads
            hq = row % num_heads
            group = num_heads // mSplitCounts.shape[1]
            n_slots = cutlass.min(mSplitCounts[q_abs, hq // group], mOPartial.shape[0])

            # Lane s holds slot s's LSE (all slot LSEs are loaded at once, not one by one); the
            # contract's topK <= 32 per (query, KV head) keeps every slot in one warp (slots
            # past 32, if any, are folded in by the loop below).
            lse_s = -cutlass.Float32.inf
            lse_t_s = -cutlass.Float32.inf
            for s0 in range(0, n_slots, 32):
                if s0 + lane < n_slots:
                    lse_s = self._lse_merge(lse_s, mLsePartial[s0 + lane, q_abs, hq], s0)
                    if want_lse_t != 0:
                        lse_t_s = self._lse_merge(lse_t_s, mLseTPartial[s0 + lane, q_abs, hq],
                                                  s0)
            lse_max = warp_max(lse_s)
            max_log2 = lse_max * LOG2_E
            if lse_max == -cutlass.Float32.inf:
                max_log2 = 0.0
            weight_sum = warp_sum(cute.math.exp2(lse_s * LOG2_E - max_log2, fastmath=True))
            out_lse = -cutlass.Float32.inf
            inv = cutlass.Float32(0.0)
            if weight_sum > 0.0:
                inv = 1.0 / weight_sum
                out_lse = (max_log2 + cute.math.log2(weight_sum, fastmath=True)) * LN_2

            # Weighted sum of the slot outputs; weights exp(LSE_s - L), UNROLL slots per step
            # with their loads issued together (slot indices past the end are clamped to a
            # written slot and get weight 0).
            acc = cute.make_rmem_tensor((CHANNELS_PER_LANE,), cutlass.Float32)
            acc.fill(0.0)
            for s0 in range(0, n_slots, UNROLL):
                parts = []
                weights = []
                for u in cutlass.range_constexpr(UNROLL):
                    s = cutlass.min(s0 + u, n_slots - 1)
                    lse_u = mLsePartial[s, q_abs, hq]
                    w = cute.math.exp2(lse_u * LOG2_E - max_log2, fastmath=True) * inv
                    if s0 + u >= n_slots:
                        w = 0.0
                    weights.append(w)
                    parts.append(cute.local_tile(mOPartial[s, q_abs, hq, None],
                                                 (CHANNELS_PER_LANE,), (lane,)).load())
                for u in cutlass.range_constexpr(UNROLL):
                    acc.store(acc.load() + parts[u].to(cutlass.Float32) * weights[u])

            dst = cute.local_tile(mOut[q_abs, hq, None], (CHANNELS_PER_LANE,), (lane,))
            dst.store(acc.load().to(mOut.element_type))
            if lane == 0:
                mLse[q_abs, hq] = out_lse
            if want_lse_t != 0:
                lse_t_max = warp_max(lse_t_s)
                max_t_log2 = lse_t_max * LOG2_E
                if lse_t_max == -cutlass.Float32.inf:
                    max_t_log2 = 0.0
                weight_t_sum = warp_sum(cute.math.exp2(lse_t_s * LOG2_E - max_t_log2,
                                                       fastmath=True))
                if lane == 0:
                    out_lse_t = -cutlass.Float32.inf
                    if weight_t_sum > 0.0:
                        out_lse_t = (max_t_log2 + cute.math.log2(weight_t_sum, fastmath=True)) * LN_2
                    mLseT[q_abs, hq] = out_lse_t
