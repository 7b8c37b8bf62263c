"""Native paged decode attention (csrc/decode_attention.cu), registered as
("sparse_decode_atten", "sm90") and, without its warpgroup form and gated like the rest of the
tier, for the portable tier (SM100 and every other capability >= 8.0).

One CUDA launch per call (plus a merge launch when the schedule splits KV): a CTA per
(work item of the :class:`~msa.schedules.decode.DecodeSchedule`, KV head) streams its
chunk's K/V pages once and serves every query row of that KV head (up to 128 rows per qo tile),
with mma.sync bf16 tensor-core math (the direct e4m3 form of a sparse call instead runs one CTA
per SM, each streaming an equal range of those tiles); the merge pass combines the fp32 partials
by log-sum-exp.
Semantics are :mod:`msa.reference.decode` (dense, sparse via q2k, e4m3 P only when Q and K/V are
e4m3). The launch reads only device tensors, never synchronizes and can be captured in a CUDA
graph.

Forms of the kernel are picked inside the launch, per qo tile: tiles of at most 16 rows split
each page's keys across all 8 warps (instead of one warp computing while seven idle), and such
tiles with e4m3 q and K/V read them straight from a raw page ring (two pages per step, widened
to f16 in registers, no bf16 staging pass); tiles of more rows take the warpgroup (wgmma) form
when it is validated for the call's dtype (VALIDATED_WARPGROUP), sparse ones with e4m3 q and
K/V the token-warps form where VALIDATED_TOKEN_WARPS. The debug hooks decode_split_keys,
decode_direct_fp8, decode_warpgroup and decode_token_warps force them on or off (tests cover
every path). The portable tier never runs the warpgroup form (its wgmma body is sm_90a code;
the launch refuses it elsewhere): its tiles of > 16 rows take the row form, whatever the hook says.
Importing this module does not touch CUDA.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from ..schedules import decode as schedules_decode
from . import debug

from . import compiled_ops
from .compiled_ops import ops

OP_NAME = "sparse_decode_atten"
# The warpgroup form (wgmma, served on tiles of > 16 rows, i.e. multi-token prediction, with q
# and K/V both bf16 or both e4m3), validated per dtype: each passed its cases of
# tests/test_decode_gpu.py on the H200 (the matrix, multi-token prediction, 512k keys, NaN bytes
# past the keys; memcheck clean) and beat the row form in bench_decode_production.py (MTP 8,
# B 32-128: bf16 2.1x, e4m3 1.8x). A dtype left out would run the row form.
VALIDATED_WARPGROUP = frozenset({"bf16", "e4m3"})
# Its ping-pong form (tiles of > 64 rows: a producer warpgroup streaming K and V through
# mbarrier rings, two consumer warpgroups taking turns on the tensor cores so one's softmax
# hides under the other's wgmmas), per dtype. Both passed tests/test_decode_gpu.py on the H200
# (memcheck clean) and beat the two-stage form in bench_decode_production.py (MTP 8, B 32-128,
# 4k-100k): bf16 1.04-1.15x; e4m3 1.18-1.34x with both K and V widened to f16 by the producer,
# and since its Q K^T runs on e4m3 wgmma straight from the raw pages (only V widened) another
# 1.08-1.18x (S is held to the contract's fp8 tolerance, not to the fp32 scores of the
# quantized reference: see docs/design-decode.md).
VALIDATED_PINGPONG = frozenset({"bf16", "e4m3"})
PINGPONG_MIN_ROWS = 65
# Its persistent form (dense calls of a plan with schedule.persistent_ctas: one CTA per SM over
# equal page shares of all (request, KV head) sequences, cut on the device from the live
# lengths), per dtype; a dtype left out runs the plan's work items on the ping-pong form. It
# beats the plan's work items where the plan takes it (schedules.decode.persistent_pays: a CTA
# streams >= 64 pages): MTP 8, 1.04-1.27x (bench_decode_production --attention-forms
# pingpong,persistent, e319220); e4m3 only where the plan's requests average >= 64 pages
# (schedules.decode.persistent_pays_e4m3). Validated on the H200: tests/test_decode_gpu.py and
# memcheck.
VALIDATED_PERSISTENT = frozenset({"bf16", "e4m3"})
# The e4m3 ping-pong and persistent forms with P.V on e4m3 wgmma (K and V pages by TMA, the
# producer warpgroup transposing each V page into a V^T tile instead of widening it to f16; P
# rounded to e4m3 as before, each page's P.V folded into O in fp32), validated on the H200
# (tests/test_decode_gpu.py, memcheck; 21463cb, 40dd92f). Served where it was faster in the
# production suite (40dd92f, MTP 8, same process): the persistent form (dense B 32-128 at
# 10k-100k keys 2-12 % faster) and sparse tiles (the step's 128-row tiles at 4k keys, 2-3.5 %).
# Dense work items too since the consumers' turn got shorter (e1842db): on an H100 (a0af333,
# --attention-forms served,pingpong,pingpong_pv8, one process) dense e4m3 on work items 7-13 %
# faster at 1k-5k (B 32 / 1k 29.3 -> 26.6 us, B 64 / 4k 162.5 -> 144.5, B 128 / 5k 372.8 ->
# 334.5), so the 1k step (the dense call) 6-8 % faster at B 32-128.
VALIDATED_PV_FP8 = frozenset({"persistent", "sparse", "dense"})
# The token-warps form (sparse tiles of > 16 rows with e4m3 q and K/V: a warp per 16 rows
# computing only the union pages its rows' tokens selected, pages by TMA from a producer
# warpgroup, each warp widening its pages' K and V in registers; csrc/decode_attention.cu,
# docs/design-decode.md). Validated on an H100 (f6e4e96: tests/test_decode_gpu.py
# ~token_warps, 42 cases; memcheck). Served: faster than the ping-pong union and the 16-row
# query tiles from 5k keys at B 32 (the step's attention 106 vs 124 us at 5k, 124 vs 165 at
# 10k, 187 vs 195 at 100k), except where the union is dense (schedules.decode.union_dense: 4k-5k,
# where the ping-pong form skips a warp's unselected pages). TOKEN_WARPS_FORM is the form
# served (and forced by decode_token_warps=True); the hook also takes its name.
VALIDATED_TOKEN_WARPS = True
TOKEN_WARPS_FORMS = {"per_warp": 1}   # the binding's argument
TOKEN_WARPS_FORM = "per_warp"
MAX_ROWS_PER_KV_HEAD = 16 * 16   # seqlen_q <= 16, G <= 16 (qo tiles of 128 rows)
MAX_TOPK = 32


def supports(*, seqlen_q=1, qhead_per_kv=1, topk=None, **_features) -> Optional[str]:
    """None when the compiled kernel can serve a call with these features, else the reason."""
    missing = compiled_ops.missing_reason("sparse_decode_attention")
    if missing is not None:
        return missing
    if seqlen_q * qhead_per_kv > MAX_ROWS_PER_KV_HEAD:
        return f"seqlen_q * G = {seqlen_q * qhead_per_kv} rows exceeds {MAX_ROWS_PER_KV_HEAD}"
    if topk is not None and topk > MAX_TOPK:
        return f"topK {topk} exceeds {MAX_TOPK}"
    return None


_last_launch = {"warpgroup": False, "pingpong": False, "persistent": False, "pv_fp8": False,
                "token_warps": 0}


def last_launch() -> dict:
    """The forms the last launch asked for: {"warpgroup": bool, "pingpong": bool,
    "persistent": bool, "pv_fp8": bool, "token_warps": 0 or a TOKEN_WARPS_FORMS code} (the
    binding applies them only to q and K/V of one dtype, the persistent form within its bounds,
    pv_fp8 to e4m3, token_warps to sparse e4m3 tiles of > 16 rows where the launcher can make
    the caches' tensor maps). Tests read it to know which form ran."""
    return dict(_last_launch)


def run(call) -> None:
    """Run one validated :class:`msa.decode.DecodeCall` on the GPU.

    Needs ``call.schedule`` (and, when it splits KV, the fp32 workspaces ``call.o_partial``
    [>= P, seqlen_q, Hq, 128] / ``call.lse_partial`` [>= P, seqlen_q, Hq]). Writes ``call.out``
    [B * seqlen_q, Hq, 128] bf16 and, when not None, ``call.lse`` [B * seqlen_q, Hq] fp32 in
    place; rows that see no key get O = 0 and LSE = -inf.
    """
    warpgroup = _warpgroup(call)
    _launch(call, warpgroup, warpgroup and _pingpong(call), _token_warps(call))


def run_portable(call) -> None:
    """:func:`run` on the portable tier: split-keys, direct e4m3 and row forms only."""
    _launch(call, False, False, 0)


def _launch(call, warpgroup: bool, pingpong: bool, token_warps: int) -> None:
    s = call.schedule
    if s is None:
        raise ValueError("schedule: the native decode kernel needs a DecodeSchedule")
    split = bool(s.split_kv)
    persistent = pingpong and _persistent(call)
    # The persistent form's request table (written by the attention pass, read by its merge).
    request_pages = (torch.empty(s.batch_size + 1, dtype=torch.int64, device=call.q.device)
                     if persistent else None)
    workspaces = split or persistent
    pv_fp8 = pingpong and _pv_fp8(call, persistent)
    _last_launch.update(warpgroup=warpgroup, pingpong=pingpong, persistent=persistent,
                        pv_fp8=pv_fp8, token_warps=token_warps)
    ops.sparse_decode_attention(
        call.q, call.k, call.v, call.q2k_indices, call.page_table, call.seqused_k,
        s.request_indices, s.kv_tile_indices, s.qo_tile_indices, s.num_splits, s.merge_indptr,
        call.o_partial if workspaces else None, call.lse_partial if workspaces else None,
        call.out, call.lse, int(call.seqlen_q), int(s.kv_chunk_size), split,
        float(call.softmax_scale), _split_keys(), _direct_fp8(), warpgroup, pingpong,
        int(s.qo_tile_rows), request_pages, int(s.persistent_ctas) if persistent else 0, pv_fp8,
        int(token_warps))


def _split_keys() -> bool:
    """Whether the kernel may split page keys across warps (it does so only for tiles of <= 16
    rows); the decode_split_keys hook turns it off."""
    return debug.forced("decode_split_keys") is not False


def _direct_fp8() -> bool:
    """Whether split-keys tiles with e4m3 q and K/V take the direct e4m3 form (the binding
    applies it only there); the decode_direct_fp8 hook turns it off."""
    return debug.forced("decode_direct_fp8") is not False


def _tile_rows(call) -> int:
    """Query rows of the call's qo tiles (the schedule's qo_tile_rows, at most seqlen_q * G)."""
    rows = call.seqlen_q * call.qhead_per_kv
    schedule = getattr(call, "schedule", None)
    return rows if schedule is None else min(rows, int(schedule.qo_tile_rows))


def _form_dtype(call) -> str:
    """The dtype the warpgroup forms' validation tables name: "bf16", or "e4m3" (e4m3 q and
    K/V)."""
    return "bf16" if call.pv_quant_dtype is None else "e4m3"


def _warpgroup(call) -> bool:
    """Whether this call uses the warpgroup (wgmma) form (the binding applies it only with q and
    K/V of one dtype): qo tiles of > 16 rows when validated for the call's dtype; the
    decode_warpgroup hook forces it on any tile (True) or off (False)."""
    return debug.gate("decode_warpgroup", _tile_rows(call) > 16
                      and _backend.may_serve(_form_dtype(call) in VALIDATED_WARPGROUP))


def _pingpong(call) -> bool:
    """Whether a warpgroup-form call takes its ping-pong form (q and K/V of one dtype, as the
    warpgroup form): tiles of > 64 rows when validated for the call's dtype; the decode_pingpong
    hook forces it on any warpgroup-form tile (True) or off (False)."""
    return debug.gate("decode_pingpong", _tile_rows(call) >= PINGPONG_MIN_ROWS
                      and _backend.may_serve(_form_dtype(call) in VALIDATED_PINGPONG))


def _persistent(call) -> bool:
    """Whether a ping-pong call takes the persistent form: a dense call whose plan has it
    (schedule.persistent_ctas), validated for the call's dtype, and for e4m3 only on long
    requests (schedules.decode.persistent_pays_e4m3); the decode_persistent hook forces it on
    any such call (True) or off (False)."""
    if call.q2k_indices is not None or not call.schedule.persistent_ctas:
        return False
    dtype = _form_dtype(call)
    pays = dtype != "e4m3" or schedules_decode.persistent_pays_e4m3(call.schedule.planned_units)
    return debug.gate("decode_persistent",
                      pays and _backend.may_serve(dtype in VALIDATED_PERSISTENT))


def _pv_fp8(call, persistent: bool) -> bool:
    """Whether an e4m3 ping-pong (or persistent) call runs P.V on e4m3 wgmma: where its form
    ("persistent", "sparse" or "dense" work items) is in VALIDATED_PV_FP8; the decode_pv_fp8
    hook forces it on (True) or off (False). The binding applies it only with e4m3 q and K/V,
    the launcher where it can make the caches' tensor maps (else the f16 P.V form serves)."""
    if _form_dtype(call) != "e4m3":
        return False
    form = ("persistent" if persistent else
            "sparse" if call.q2k_indices is not None else "dense")
    return debug.gate("decode_pv_fp8", _backend.may_serve(form in VALIDATED_PV_FP8))


def token_warps_served(device: torch.device) -> bool:
    """Whether sparse calls of e4m3 q and K/V on `device` take the token-warps form for tiles
    of > 16 rows (the decode plan then keeps 128-row tiles wherever they fill the SMs): the
    Hopper kernels where VALIDATED_TOKEN_WARPS, or as the decode_token_warps hook says."""
    return _backend.arch_family(device) == "sm90" and _token_warps_form() != 0


def _token_warps_form() -> int:
    """The binding's token-warps code the gate and the decode_token_warps hook give a call it
    applies to: a forced form's, TOKEN_WARPS_FORM's where served, else 0."""
    forced = debug.forced("decode_token_warps")
    if isinstance(forced, str):
        if forced not in TOKEN_WARPS_FORMS:
            raise ValueError(f"decode_token_warps: a form of {sorted(TOKEN_WARPS_FORMS)}, True "
                             f"or False, got {forced!r}")
        return TOKEN_WARPS_FORMS[forced]
    served = debug.gate("decode_token_warps", _backend.may_serve(VALIDATED_TOKEN_WARPS))
    return TOKEN_WARPS_FORMS[TOKEN_WARPS_FORM] if served else 0


def _token_warps(call) -> int:
    """The token-warps form (the binding's code: 0 none, else TOKEN_WARPS_FORMS) a sparse call
    of e4m3 q and K/V with tiles of > 16 rows takes: TOKEN_WARPS_FORM where
    VALIDATED_TOKEN_WARPS (or with MSA_UNVALIDATED_KERNELS=1). The decode_token_warps hook
    forces it on such calls (True: TOKEN_WARPS_FORM, or a form's name) or off (False). Unforced,
    calls of few tiles (schedules.decode.few_tiles) leave their split tiles to the ping-pong
    form, and so do calls whose tiles take the ping-pong form and whose union is dense in their
    planned blocks (schedules.decode.union_dense; measured on 128-row tiles). The launcher takes
    it where it can make the caches' tensor maps; elsewhere the warpgroup forms serve."""
    if call.q2k_indices is None or _form_dtype(call) != "e4m3" or _tile_rows(call) <= 16:
        return 0
    schedule = call.schedule   # its tiles, CTA budget and planned pages: what the plan saw
    if debug.forced("decode_token_warps") is None and (
            schedules_decode.few_tiles(call.batch_size, call.k.shape[1], schedule.num_qo_tiles,
                                       schedule.max_grid_size)
            or (not schedule.slot_chunks and _warpgroup(call) and _pingpong(call)
                and schedules_decode.union_dense(
                    call.seqlen_q, call.qhead_per_kv, max(schedule.planned_units, default=0),
                    schedule.sparse_topk))):
        return 0
    return _token_warps_form()


_backend.register_native(OP_NAME, "sm90", run, supports)
for _arch in ("sm100", _backend.PORTABLE):
    _backend.register_native(OP_NAME, _arch, run_portable,
                             _backend.portable_supports(supports, "the portable tier's decode"),
                             tier=_backend.PORTABLE,
                             device_check=compiled_ops.image_check("sparse_decode_attention"))
