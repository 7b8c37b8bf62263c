"""Native paged decode attention (csrc/decode_attention.cu), registered as
("sparse_decode_atten", "sm90").

One CUDA launch per call (plus a merge launch when the schedule splits KV): a CTA per
(work item of the :class:`~msa.src.sm100.decode_schedule.DecodeSchedule`, KV head) streams its
chunk's K/V pages once and serves every query row of that KV head (up to 128 rows per qo tile),
with mma.sync bf16 tensor-core math; the merge pass combines the fp32 partials by log-sum-exp.
Semantics are :mod:`msa.reference.decode` (dense, sparse via q2k, e4m3 P only when Q and K/V are
e4m3). The launch reads only device tensors, never synchronizes and can be captured in a CUDA
graph.

Gated until its GPU test (tests/test_decode_gpu.py) passes on the H200: ``supports()`` refuses
while ``VALIDATED`` is False unless ``MSA_UNVALIDATED_KERNELS=1``.
Importing this module does not touch CUDA.
"""

from __future__ import annotations

from typing import Optional

from .. import _backend

from . import compiled_ops
from .compiled_ops import ops

OP_NAME = "sparse_decode_atten"
# Flip to True only after tests/test_decode_gpu.py passes on the H200.
# tests/test_decode_gpu.py passed on the H200 (2026-11-30): 118 cases, dense + sparse, graph replay.
VALIDATED = True
# The split-keys form (all 8 warps share the <= 16 rows of a decode tile and split each page's
# keys, instead of one warp computing while seven idle): its "split" cases of
# tests/test_decode_gpu.py passed on the H200 (2026-11-30, session 3; 226 cases in all). Tests
# force it on or off through SPLIT_KEYS_FOR_TESTS (None: the gate decides).
VALIDATED_SPLIT_KEYS = True
SPLIT_KEYS_FOR_TESTS: Optional[bool] = None
# The direct e4m3 form of the split-keys kernel (e4m3 q and K/V read straight from a six-stage
# raw page ring, two pages per step, widened to f16 in registers; no bf16 conversion pass): its
# cases of tests/test_decode_gpu.py passed on the H200 (2026-11-30, session 4: the page-pair
# loop, 39 cases incl. NaN bytes past the keys; memcheck clean). It read 3.20-3.39 TB/s at
# B >= 32 where the one-page loop it replaced read 2.99-3.11. DIRECT_FP8_FOR_TESTS forces it on
# or off.
VALIDATED_DIRECT_FP8 = True
DIRECT_FP8_FOR_TESTS: Optional[bool] = None
# The warpgroup form (wgmma; served on tiles of > 16 rows, i.e. multi-token prediction, with q
# and K/V both bf16 or both e4m3): flip after its cases of tests/test_decode_gpu.py pass on the
# H200. WARPGROUP_FOR_TESTS forces it on (any tile, e.g. one query to compare with the
# split-keys forms) or off.
VALIDATED_WARPGROUP = False
WARPGROUP_FOR_TESTS: Optional[bool] = None
UNVALIDATED_ENV = _backend.UNVALIDATED_ENV
MAX_ROWS_PER_KV_HEAD = 16 * 16   # seqlen_q <= 16, G <= 16 (qo tiles of 128 rows)
MAX_TOPK = 32


def supports(*, seqlen_q=1, qhead_per_kv=1, topk=None, **_features) -> Optional[str]:
    """None when the compiled kernel can serve a call with these features, else the reason."""
    missing = compiled_ops.missing_reason("sparse_decode_attention")
    if missing is not None:
        return missing
    gate = _backend.unvalidated_reason("the sm90 decode kernel", VALIDATED)
    if gate is not None:
        return gate
    if seqlen_q * qhead_per_kv > MAX_ROWS_PER_KV_HEAD:
        return f"seqlen_q * G = {seqlen_q * qhead_per_kv} rows exceeds {MAX_ROWS_PER_KV_HEAD}"
    if topk is not None and topk > MAX_TOPK:
        return f"topK {topk} exceeds {MAX_TOPK}"
    return None


def run(call) -> None:
    """Run one validated :class:`msa.decode.DecodeCall` on the GPU.

    Needs ``call.schedule`` (and, when it splits KV, the fp32 workspaces ``call.o_partial``
    [>= P, seqlen_q, Hq, 128] / ``call.lse_partial`` [>= P, seqlen_q, Hq]). Writes ``call.out``
    [B * seqlen_q, Hq, 128] bf16 and, when not None, ``call.lse`` [B * seqlen_q, Hq] fp32 in
    place; rows that see no key get O = 0 and LSE = -inf.
    """
    s = call.schedule
    if s is None:
        raise ValueError("schedule: the native decode kernel needs a DecodeSchedule")
    split = bool(s.split_kv)
    ops.sparse_decode_attention(
        call.q, call.k, call.v, call.q2k_indices, call.page_table, call.seqused_k,
        s.request_indices, s.kv_tile_indices, s.qo_tile_indices, s.num_splits, s.merge_indptr,
        call.o_partial if split else None, call.lse_partial if split else None,
        call.out, call.lse, int(call.seqlen_q), int(s.kv_chunk_size), split,
        float(call.softmax_scale), _split_keys(), _direct_fp8(), _warpgroup(call))


def _split_keys() -> bool:
    """Whether to let the kernel split page keys across warps (it does so only for tiles of
    <= 16 rows): forced by tests, else once validated (or MSA_UNVALIDATED_KERNELS=1)."""
    return _backend.form_enabled(SPLIT_KEYS_FOR_TESTS, "the split-keys decode kernel",
                                 VALIDATED_SPLIT_KEYS)


def _direct_fp8() -> bool:
    """Whether split-keys tiles with e4m3 q and K/V may use the direct e4m3 form (the binding
    applies it only there): forced by tests, else once validated (or MSA_UNVALIDATED_KERNELS=1)."""
    return _backend.form_enabled(DIRECT_FP8_FOR_TESTS, "the direct e4m3 decode kernel",
                                 VALIDATED_DIRECT_FP8)


def _warpgroup(call) -> bool:
    """Whether this call uses the warpgroup (wgmma) form (the binding applies it only with q and
    K/V of one dtype): tiles of > 16 rows once validated (or MSA_UNVALIDATED_KERNELS=1), any
    tile when WARPGROUP_FOR_TESTS is True, none when it is False."""
    if WARPGROUP_FOR_TESTS is not None:
        return WARPGROUP_FOR_TESTS
    rows = call.seqlen_q * call.qhead_per_kv
    return rows > 16 and _backend.form_enabled(None, "the warpgroup decode kernel",
                                               VALIDATED_WARPGROUP)


_backend.register_native(OP_NAME, "sm90", run, supports)
