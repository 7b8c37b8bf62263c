"""Portable native indexer block max-scores (csrc/block_max_score_portable.cu): bf16 or e4m3,
the portable tier of docs/design-portable.md, registered for the "portable" and "sm100" families.

One launch on q_idx's device and current stream, no host synchronization: per (query, index
head, 128-key tile) the max of ``scale * q.k`` over the causally visible keys, -inf where none
is, into a fresh ``[H, max_k_tiles, total_q]`` fp32 tensor whose every element the kernel
writes. Host preparation (trusted prefix sums, key lengths, causal offsets) is the Hopper
path's (block_max_score_sm90.kernel_inputs).

Served: bf16 or e4m3 q_idx and k_idx (the same dtype; e4m3 is widened exactly to f16 on load,
the MMAs stay 16-bit), H in {1, 2, 4, 8} index heads against one shared key head, dense or
paged keys, causal or not, any qo_offset. Mixed dtypes and the rest run the reference. Behind
the whole tier's gate (``_backend.PORTABLE_VALIDATED``, open since the H200 proxy validation).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import compiled_ops, debug
from .block_max_score_sm90 import check_launch_limits, kernel_inputs, launch_key_splits
from .compiled_ops import ops
from .sparse_prefill_portable import reads_in_place

OP = "block_max_score_portable"
HEADS = (1, 2, 4, 8)
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
ROWS_PER_CTA = 128          # (query, head) rows of one CTA: must match the kernel's kRows
MAX_REQUESTS = 65534        # the grid's y is requests + 1


def supports(*, q_dtype=None, k_dtype=None, num_heads=None, num_k_heads=None, batch=None,
             **_ignored) -> Optional[str]:
    """None when the portable kernel serves a call with these features, else why not."""
    missing = compiled_ops.missing_reason(OP)
    if missing is not None:
        return missing
    if q_dtype != k_dtype or q_dtype not in DTYPES:
        return (f"q_idx/k_idx dtypes {q_dtype}/{k_dtype}: the portable tier serves bf16/bf16 "
                "and e4m3/e4m3")
    if num_k_heads != 1:
        return f"{num_k_heads} index-key heads: the portable kernel serves one shared key head"
    if num_heads not in HEADS:
        return f"{num_heads} index heads: the portable kernel serves {HEADS}"
    if batch is not None and batch > MAX_REQUESTS:
        return f"{batch} requests: the portable kernel serves up to {MAX_REQUESTS}"
    return _backend.unvalidated_reason("the portable indexer kernel",
                                       _backend.PORTABLE_VALIDATED)


def _in_place(x: torch.Tensor) -> torch.Tensor:
    """x when the kernel reads it as it is (channels contiguous, rows 16-byte aligned), else a
    contiguous copy."""
    return x if reads_in_place(x) else x.contiguous()


def run(call) -> torch.Tensor:
    """Returns max_score [H, max_k_tiles, total_q] fp32 for a validated
    :class:`msa.indexer.BlockMaxScoreCall` (freshly allocated, every element written)."""
    q, k = call.q_idx, call.k_idx
    total_q, num_heads, _ = q.shape
    check_launch_limits(call.max_k_tiles, call.page_table, call.seqused_k)
    out = torch.empty(num_heads, call.max_k_tiles, total_q, dtype=torch.float32,
                      device=q.device)
    if total_q == 0:
        return out
    inputs = kernel_inputs(q, k, call.cu_seqlens_q, call.cu_seqlens_k, call.qo_offset,
                           call.page_table, call.seqused_k, planned=call.planned_lengths,
                           planned_offsets=call.planned_offsets)
    if inputs.batch > MAX_REQUESTS:     # supports() saw no batch: the reference serves it
        raise NotImplementedError(f"cu_seqlens_q: {inputs.batch} requests; the portable "
                                  f"indexer serves up to {MAX_REQUESTS}")
    if debug.poison():
        out.fill_(float("nan"))
    # CTAs per request along its query tiles (they stride, so a short hint drops nothing; no
    # request has more than total_q queries, so a long one adds no idle CTAs past that).
    queries_per_cta = ROWS_PER_CTA // num_heads
    grid_x = max(1, -(-min(int(call.max_seqlen_q), total_q) // queries_per_cta))
    key_splits = launch_key_splits(call.key_splits, call.max_k_tiles)
    debug.record("block_max_scores", OP)
    ops.block_max_score_portable(_in_place(q), _in_place(k), inputs.cu_q, inputs.cu_k,
                                 inputs.k_lens, inputs.offsets, inputs.page_table, out,
                                 float(call.scale), bool(call.causal), grid_x, key_splits)
    return out


for _arch in ("sm100", _backend.PORTABLE):
    _backend.register_native("block_max_scores", _arch, run, supports, tier=_backend.PORTABLE,
                             device_check=compiled_ops.image_check(OP))
