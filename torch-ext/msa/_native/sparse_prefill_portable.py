"""Portable native sparse prefill (csrc/sparse_prefill_portable.cu): bf16 or e4m3 q/k/v, the
portable tier of docs/design-portable.md, registered for the "portable" and "sm100" families.

The same two launches as the Hopper path (sparse_prefill_sm90.py), with the same schedule,
partials and host preparation (``prepare_launch``): the warp-MMA attention kernel writes the
per-slot partials and LSE, the csrc combine merges them. No host synchronization.

Validated by proxy on the H200 (its GPU tests and memcheck, built as compute_80 PTX); the tier's
gate ``_backend.PORTABLE_VALIDATED`` would refuse it again (``MSA_UNVALIDATED_KERNELS=1`` serves).
Served: the Hopper tier's dtype modes (contract §1.2, no scale factors): bf16 q/k/v; bf16 q
with e4m3 K/V; e4m3 q/k/v with pv_dtype bf16 or e4m3 (P rounded to e4m3 before P.V, as the
reference defines it). Dense or paged K/V, G in {1, 2, 4, 8, 16}; bf16 / fp16 / e4m3 partials,
and fp32 partials with bf16 inputs (FP8 modes take 16-bit or e4m3 partials, as on Hopper).
e4m3 is widened exactly on load, so the kernel's MMAs are 16-bit on every arch. Not native:
NVFP4 K/V (the reference serves it).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _backend, _stages
from . import compiled_ops, debug
from .compiled_ops import ops
from .sparse_prefill_sm90 import attention_mode, prepare_launch, refusal

OPS = ("sparse_prefill_portable", "sparse_combine_portable")
# The name debug.last_variant("sparse_atten") reports for this kernel.
VARIANT = "sparse_prefill_portable"


def supports(*, q_dtype=None, k_dtype=None, v_dtype=None, pv_dtype=None, qhead_per_kv=None,
             partial_dtype=None, nvfp4=False, **_ignored) -> Optional[str]:
    """None when the portable kernels serve a call with these features, else why not."""
    missing = compiled_ops.missing_reason(*OPS)
    if missing is not None:
        return missing
    why = refusal("in the portable tier", attention_mode(q_dtype, k_dtype, v_dtype, pv_dtype),
                  q_dtype=q_dtype, k_dtype=k_dtype, v_dtype=v_dtype, pv_dtype=pv_dtype,
                  partial_dtype=partial_dtype, qhead_per_kv=qhead_per_kv, nvfp4=nvfp4)
    if why is not None:
        return why
    return _backend.unvalidated_reason("the portable sparse prefill kernel",
                                       _backend.PORTABLE_VALIDATED)


def reads_in_place(x: torch.Tensor) -> bool:
    """Whether a portable kernel reads x (bf16 or e4m3) as it is: channels contiguous, every
    row 16-byte aligned."""
    per_16_bytes = 16 // x.element_size()
    return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all(s % per_16_bytes == 0 for s in x.stride()[:-1]))


def _kernel_inputs(call) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the kernel reads them (contiguous copies where a layout does not suit it; k
    and v share one layout)."""
    q = call.q if reads_in_place(call.q) else call.q.contiguous()
    k, v = call.k, call.v
    if not (reads_in_place(k) and reads_in_place(v) and k.stride() == v.stride()):
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def run(call) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Returns (O bf16 [total_q, Hq, 128], LSE fp32 [total_q, Hq] or None, LSE_T or None);
    every output is freshly allocated."""
    launch = prepare_launch(call)
    if call.q.shape[0] == 0:
        return launch.results(call)
    schedule = launch.schedule
    lse_t_partial = launch.lse_t_partial if launch.want_lse_t else None
    debug.record("sparse_atten", VARIANT)
    ops.sparse_prefill_portable(
        *_kernel_inputs(call), launch.cu_q, launch.cu_k,
        launch.kv_lens, launch.page_table if call.paged else None,
        schedule.k2q_row_ptr.contiguous(), schedule.qsplit_indices.contiguous(),
        schedule.scheduler_metadata.contiguous(), schedule.work_count.contiguous(),
        launch.o_partial, launch.lse_partial, lse_t_partial, float(call.softmax_scale),
        1.0 / float(call.lse_temperature_scale), bool(call.causal),
        call.pv_dtype == torch.float8_e4m3fn)
    _stages.mark("combine")
    ops.sparse_combine_portable(
        launch.o_partial, launch.lse_partial, lse_t_partial, schedule.split_counts.contiguous(),
        launch.out,
        launch.lse, launch.lse_t if launch.want_lse_t else None)
    return launch.results(call)


for _arch in ("sm100", _backend.PORTABLE):
    _backend.register_native("sparse_atten", _arch, run, supports, tier=_backend.PORTABLE,
                             device_check=compiled_ops.image_check(*OPS))
