"""Native ``sparse_topk_select`` (csrc/sparse_topk_select.cu), registered for sm90 and sm100
and, behind the tier's gate like the rest of it, for the portable tier.

Exact to :func:`msa.reference.topk.sparse_topk_select_reference`: same ids, same order, ties to
the lower id. One launch, no host synchronization, capturable in a CUDA graph. Importing this
module does not touch CUDA.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from .._common import sm_count

from . import compiled_ops, debug
from .compiled_ops import ops

OP_NAME = "sparse_topk_select"
MAX_TOPK = 64
# Codes of the op's head_reduce argument.
HEAD_REDUCE_CODES = {None: 0, "sum": 1, "max": 2}
# The staged kernel (csrc/sparse_topk_select.cu: 8-32 queries' scores staged in shared memory,
# as many as still fill the SMs; a warp per row, candidates thresholded by the lanes' maxima and
# bitonic-sorted) for calls of >= 64 queries against 64..768 blocks with topk <= 16: the prefill
# chunks, where the lane-per-query tile kernel runs an insertion chain per candidate. Validated
# on an H100 (f6e4e96: tests/test_csrc_gpu.py ~topk_staged); faster there on 16k-query chunks
# (373 / 660 blocks: 169 / 287 vs 201 / 336 us) and short ones (21-28 vs 25-38 us; 10-13 us
# with narrow CTAs, d21bc0a); slower at 1360 blocks (one CTA an SM), hence the cap.
VALIDATED_STAGED = True
# Past 768 blocks where a CTA takes 8 or 16 queries (its scores' shared memory then holds up to
# 2816 / 1490 blocks): the short chunks on long prefixes. On an H200 (topk_forms lab, 7ec9dd3)
# 19.3 vs 55.6 us at 347 queries / 1028 blocks, 19.7 vs 57.5 at 327 / 1094.
VALIDATED_STAGED_WIDE = True
# Where the launcher applies it (csrc's kStagedMinQueries, kStagedMinTiles, kStagedFloats,
# kStagedMaxWidth and staged_queries_per_cta; the launcher checks them itself, these say which
# kernel ran and keep wide calls off it unless VALIDATED_STAGED_WIDE).
STAGED_MIN_QUERIES = 64
STAGED_FLOATS = 768 * 33
STAGED_TILES = (64, STAGED_FLOATS // 33)    # 768: the room at 32 queries a CTA, and the cap
                                            # at any width without VALIDATED_STAGED_WIDE
STAGED_MAX_WIDTH = 16
_INT32_MAX = (1 << 31) - 1


def supports(*, topk: int = 1, num_tiles: int = 1, head_reduce: Optional[str] = None,
             **_features) -> Optional[str]:
    """None when the compiled kernel serves the call (features from TopkSelectCall.features())."""
    missing = compiled_ops.missing_reason("sparse_topk_select")
    if missing is not None:
        return missing
    if not 1 <= topk <= MAX_TOPK:
        return f"topk {topk} is outside [1, {MAX_TOPK}]"
    if head_reduce not in HEAD_REDUCE_CODES:
        return f"head_reduce {head_reduce!r} is not supported"
    if num_tiles >= _INT32_MAX:
        return f"{num_tiles} KV tiles do not fit the kernel's int32 indexing"
    return None


def run(call) -> torch.Tensor:
    """Fill ``call.output`` [T, H_out, topk] int32 from ``call.max_score`` [H, K, T] fp32.

    Args:
      call: a validated :class:`msa.topk.TopkSelectCall` (num_valid_pages an int or a [T] int32
        tensor, causal_end_block None or [T] int32, head_reduce None / "max" / "sum").
    Returns ``call.output``.
    """
    max_score = call.max_score
    if max_score.dtype != torch.float32 or not max_score.is_contiguous():
        max_score = max_score.float().contiguous()
    per_query = call.num_valid_pages if isinstance(call.num_valid_pages, torch.Tensor) else None
    # The staged kernel where VALIDATED_STAGED (or MSA_UNVALIDATED_KERNELS=1) and the shape
    # takes it (the launcher applies it by shape); the topk_staged hook forces it.
    # Past STAGED_TILES only where VALIDATED_STAGED_WIDE (the topk_staged_wide hook forces it).
    staged = debug.gate("topk_staged", _backend.may_serve(VALIDATED_STAGED))
    wide = debug.gate("topk_staged_wide", _backend.may_serve(VALIDATED_STAGED_WIDE))
    staged = staged and (wide or call.num_tiles <= STAGED_TILES[1])
    nvp_int = call.num_tiles if per_query is not None else int(call.num_valid_pages)
    ops.sparse_topk_select(max_score, call.output, call.topk, nvp_int, per_query,
                           call.force_begin_blocks, call.force_end_blocks,
                           call.causal_end_block, call.num_out_heads,
                           HEAD_REDUCE_CODES[call.head_reduce], staged)
    debug.record(OP_NAME, "staged" if staged and staged_applies(call) else "unstaged")
    return call.output


def staged_queries_per_cta(total_q: int, out_heads: int, sms: int) -> int:
    """Queries a staged CTA takes (csrc's staged_queries_per_cta): the most of 32 / 16 whose grid
    still covers every SM, else 8."""
    for queries in (32, 16):
        if -(-total_q // queries) * out_heads >= sms:
            return queries
    return 8


def staged_applies(call) -> bool:
    """Whether the launcher takes the staged kernel for a call it is asked to stage (its shape
    and the blocks its CTA width leaves room for)."""
    _heads, tiles, total_q = call.max_score.shape
    queries = staged_queries_per_cta(total_q, call.num_out_heads,
                                     sm_count(call.max_score.device))
    return (total_q >= STAGED_MIN_QUERIES and STAGED_TILES[0] <= tiles
            and tiles <= STAGED_FLOATS // (queries + 1)
            and min(call.topk, tiles) <= STAGED_MAX_WIDTH)


_backend.register_native(OP_NAME, "sm90", run, supports)
_backend.register_native(OP_NAME, "sm100", run, supports,
                         device_check=compiled_ops.image_check("sparse_topk_select"))
_backend.register_native(OP_NAME, _backend.PORTABLE, run,
                         _backend.portable_supports(supports, "the portable tier's top-k"),
                         tier=_backend.PORTABLE,
                         device_check=compiled_ops.image_check("sparse_topk_select"))
