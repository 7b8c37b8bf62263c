"""Combine of the per-block partial attention outputs (the second kernel of sparse prefill).

For each (query q_abs, query head hq) with n = split_counts[q_abs, hq // G] slots:
  L = logsumexp_s LSE_s,   O = sum_s exp(LSE_s - L) * O_s,   (LSE_T likewise from LSE_T_s)
written as O bf16 [total_q, Hq, 128] and LSE fp32 [total_q, Hq]. Rows with no slot, or whose
slots are all -inf, give O = 0 and LSE = -inf.

One warp per output row; each lane owns 4 consecutive channels (vector loads of the partials).
Tensors:
  o_partial [topK, total_q, Hq, 128] fp32 or bf16;  lse_partial, lse_t_partial [topK, total_q, Hq]
  split_counts [total_q, Hkv] int32;  out [total_q, Hq, 128] bf16;  lse, lse_t [total_q, Hq] fp32
  want_lse_t: int32 flag (lse_t_partial / lse_t are only touched when set)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

HEAD_DIM = 128
WARPS_PER_CTA = 4
CHANNELS_PER_LANE = HEAD_DIM // 32
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

            # Pass 1: the largest slot LSE (every lane reads the same few scalars).
            lse_max = -cutlass.Float32.inf
            lse_t_max = -cutlass.Float32.inf
            for s in range(n_slots):
                lse_max = cute.arch.fmax(lse_max, mLsePartial[s, q_abs, hq])
                if want_lse_t != 0:
                    lse_t_max = cute.arch.fmax(lse_t_max, mLseTPartial[s, q_abs, hq])
            max_log2 = lse_max * LOG2_E
            if lse_max == -cutlass.Float32.inf:
                max_log2 = 0.0
            max_t_log2 = lse_t_max * LOG2_E
            if lse_t_max == -cutlass.Float32.inf:
                max_t_log2 = 0.0

            # Pass 2: weights exp(LSE_s - max) and the weighted sum of the slot outputs.
            acc = cute.make_rmem_tensor((CHANNELS_PER_LANE,), cutlass.Float32)
            acc.fill(0.0)
            weight_sum = cutlass.Float32(0.0)
            weight_t_sum = cutlass.Float32(0.0)
            for s in range(n_slots):
                weight = cute.math.exp2(mLsePartial[s, q_abs, hq] * LOG2_E - max_log2,
                                        fastmath=True)
                weight_sum = weight_sum + weight
                part = cute.local_tile(mOPartial[s, q_abs, hq, None], (CHANNELS_PER_LANE,),
                                       (lane,))
                acc.store(acc.load() + part.load().to(cutlass.Float32) * weight)
                if want_lse_t != 0:
                    weight_t_sum = weight_t_sum + cute.math.exp2(
                        mLseTPartial[s, q_abs, hq] * LOG2_E - max_t_log2, fastmath=True)

            inv = cutlass.Float32(0.0)
            out_lse = -cutlass.Float32.inf
            if weight_sum > 0.0:
                inv = 1.0 / weight_sum
                out_lse = (max_log2 + cute.math.log2(weight_sum, fastmath=True)) * LN_2
            dst = cute.local_tile(mOut[q_abs, hq, None], (CHANNELS_PER_LANE,), (lane,))
            dst.store((acc.load() * inv).to(mOut.element_type))
            if lane == 0:
                mLse[q_abs, hq] = out_lse
                if want_lse_t != 0:
                    out_lse_t = -cutlass.Float32.inf
                    if weight_t_sum > 0.0:
                        out_lse_t = (max_t_log2 + cute.math.log2(weight_t_sum, fastmath=True)) * LN_2
                    mLseT[q_abs, hq] = out_lse_t
