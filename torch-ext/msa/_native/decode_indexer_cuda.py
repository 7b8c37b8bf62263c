"""Native fused decode indexer + top-k (csrc/decode_indexer.cu), registered as
("decode_indexer_topk", "sm90") and ("decode_indexer_plan_update", "sm90"), and for the portable
tier (SM100 and every other capability >= 8.0; it is mma.sync code) behind the tier's gate too.

One launch per layer (the indexer, grid = the plan's capacity) plus one per step (the plan
update, one CTA). Both read only device tensors, never synchronize and can be captured in a CUDA
graph. Importing this module does not touch CUDA.

Validated on the H200 (tests/test_decode_indexer_gpu.py against float64, memcheck including
garbage page ids and lengths); ``VALIDATED`` is the gate a rewrite would close again (then
``supports()`` refuses unless ``MSA_UNVALIDATED_KERNELS=1``). The plan update shares the gate.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import debug

from . import compiled_ops
from .compiled_ops import ops

OP_NAME = "decode_indexer_topk"
PLAN_OP_NAME = "decode_indexer_plan_update"
VALIDATED = True
# e4m3 index pages as one TMA copy each (a tensor map of the cache, 128-byte swizzled stages)
# instead of every thread's cp.asyncs into padded rows, on sm_90+: its GPU tests and memcheck
# passed on the H200 (3ac8975) and the indexer ran 11 % faster (timeline: one query B 32 / 128k
# 162.5 -> 144.5 us, MTP 8 B 32 / 100k 195.4 -> 173.3). The decode_indexer_tma hook forces
# either form; the launcher keeps cp.async where it cannot encode the tensor map.
VALIDATED_TMA_PAGES = True
# Calls of 17-32 rows a request (MTP 5-8 at four index heads): a ninth warp holds the candidate
# lists and offers a page's scores while the eight scoring warps score the next one, instead of
# warp 0 doing both (its offers, ~1000 cycles a page at MTP 8, set the period). Correct on an
# H100 (f6e4e96: test_decode_indexer_gpu.py ~offer_warp, memcheck) but not faster there (MTP 8,
# B 32 / 100k timeline: 175.0 vs 173.2 us; the scoring warps then wait on the copies), so not
# served; the decode_indexer_offer_warp hook forces it either way.
VALIDATED_OFFER_WARP = False
# The merge of a request's chunk lists (its last CTA, a segment of lanes a row) as a butterfly
# over the segment: log2(lanes) levels of bitonic merges of 64-bit (score, id) keys, every lane
# ending with the row's best entries, instead of topk - 1 dependent rounds of segment maxima
# (csrc/decode_indexer.cu, segment_best_keys). Correct on an H100 (fba08cc:
# test_decode_indexer_gpu.py, the same picks as the rounds; memcheck) and faster at every shape
# of benchmarks/lab/decode_indexer_phases.sh (MTP 8, the merge's rounds and stores 8.1-9.9k
# cycles against 10.4-12.1k; a call 0.2-0.9 us shorter, e.g. B 8 / 4k 20.1 -> 19.2 us, B 32 /
# 10k 36.3 -> 35.5); the decode_indexer_butterfly_merge hook forces it either way.
VALIDATED_BUTTERFLY_MERGE = True
MAX_ROWS = 128
MAX_TOPK = 32
# q dtype each index-key format is served with (the kernel's MMA type needs an exact widening).
_Q_DTYPE_FOR_FORMAT = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
                       "nvfp4": torch.float8_e4m3fn}


def _compiled_reason(op: str) -> Optional[str]:
    missing = compiled_ops.missing_reason(op)
    if missing is not None:
        return missing
    return _backend.unvalidated_reason("the sm90 decode indexer", VALIDATED)


def supports(*, q_dtype=None, k_format=None, topk=16, rows=1, **_features) -> Optional[str]:
    """None when the compiled kernel serves a call with these features, else the reason."""
    reason = _compiled_reason(OP_NAME)
    if reason is not None:
        return reason
    want = _Q_DTYPE_FOR_FORMAT.get(k_format)
    if want is None or q_dtype != want:
        return (f"q_idx {q_dtype} with {k_format} index keys: the kernel serves bf16 q with bf16 "
                f"keys and e4m3 q with e4m3 or NVFP4 keys")
    if rows > MAX_ROWS:
        return f"{rows} rows per request exceed {MAX_ROWS}"
    if topk > MAX_TOPK:
        return f"topk {topk} exceeds {MAX_TOPK}"
    return None


def supports_plan(**_features) -> Optional[str]:
    return _compiled_reason(PLAN_OP_NAME)


_last_launch = {"butterfly_merge": False}


def last_launch() -> dict:
    """The forms the last native call asked for: {"butterfly_merge": bool} (tests read it to
    know which merge ran)."""
    return dict(_last_launch)


def run(call) -> None:
    """Fill ``call.out`` (and ``call.scores`` when not None) for one validated
    :class:`msa.decode_indexer.DecodeIndexerCall`."""
    plan = call.plan
    butterfly = _butterfly_merge()
    _last_launch.update(butterfly_merge=butterfly)
    ops.decode_indexer_topk(
        call.q_idx, call.k_idx, call.k_scale, call.scale_layout == "linear",
        call.k_global_scale, call.page_table, plan.seqused_k, plan.work, plan.requests,
        plan.chunk_pages, plan.partials, call.out, call.scores, int(plan.seqlen_q),
        int(call.topk), float(call.scale), _tma_pages(), _offer_warp(), butterfly)


def _tma_pages() -> bool:
    """Whether e4m3 index pages may arrive as TMA copies (the launcher applies it to e4m3 keys
    on sm_90+): when validated or with MSA_UNVALIDATED_KERNELS=1; the decode_indexer_tma hook
    forces it on (True) or off (False)."""
    return debug.gate("decode_indexer_tma", _backend.may_serve(VALIDATED_TMA_PAGES))


def _offer_warp() -> bool:
    """Whether calls of 17-32 rows a request run the offer-warp form: when validated or with
    MSA_UNVALIDATED_KERNELS=1; the decode_indexer_offer_warp hook forces it on or off."""
    return debug.gate("decode_indexer_offer_warp", _backend.may_serve(VALIDATED_OFFER_WARP))


def _butterfly_merge() -> bool:
    """Whether the merge of a request's chunk lists runs as a butterfly: when validated or with
    MSA_UNVALIDATED_KERNELS=1; the decode_indexer_butterfly_merge hook forces it on or off."""
    return debug.gate("decode_indexer_butterfly_merge",
                      _backend.may_serve(VALIDATED_BUTTERFLY_MERGE))


def run_plan_update(plan) -> None:
    """Re-split ``plan``'s work from its live seqused_k (device side)."""
    ops.decode_indexer_plan_update(plan.seqused_k, plan.work, plan.requests, plan.chunk_pages)


_backend.register_native(OP_NAME, "sm90", run, supports)
_backend.register_native(PLAN_OP_NAME, "sm90", run_plan_update, supports_plan)
for _arch in ("sm100", _backend.PORTABLE):
    for _op, _run, _supports in ((OP_NAME, run, supports),
                                 (PLAN_OP_NAME, run_plan_update, supports_plan)):
        _backend.register_native(
            _op, _arch, _run,
            _backend.portable_supports(_supports, "the portable tier's decode indexer"),
            tier=_backend.PORTABLE, device_check=compiled_ops.image_check(_op))
