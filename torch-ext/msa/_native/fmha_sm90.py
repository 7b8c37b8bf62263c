"""Native SM90 dense FMHA (the "fmha_dense" op): the CuTe-DSL kernel of
cute_kernels/fmha_sm90.py behind ``fmha_sm100`` / ``fmha`` (contract §2.2).

``run(call)`` takes a validated :class:`msa.fmha.FmhaDenseCall` and launches one kernel (two
with split-KV: the partial rows, then the combine) on q's device and current stream, with no
host synchronization (every size comes from the plan's host values): O = output_scale *
softmax(logit_scale * q k^T) v over the visible keys (causal bottom-right with the plan's or the
override's qo_offset), 0 for rows that see nothing.

Served: bf16 q/k/v, any GQA group, dense K/V or paged K/V with 128-token pages, causal or not,
output O (mode 3; bf16 on the warp-specialized kernel), and O with the max-score output (mode
1); e4m3 q/k/v with O only. Plans with num_kv_splits > 1 run the split-KV form. Other calls
(mixed dtypes, other page sizes, block-selected mode) fall back to the reference through
``supports``; the block-selected mode goes to the sparse bridge before dispatch when the plan
has one.

Validated on the H200: tests/test_fmha_gpu.py (plain loop and max-score 2026-11-30, e4m3
session 4, warp-specialized form 2026-12-01).

Also registered here: "fmha_max_score" (mode 2, the max-score-only proxy pass), which is the
indexer's computation and runs on the validated sm90 block max-score kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Union

import torch

from .. import _backend
# The form table is plain Python (variants.py imports no cutlass).
from ..cute_kernels import variants as _forms
from . import block_max_score_sm90, cute_runtime

from . import compiled_ops
from .compiled_ops import ops

PAGE = 128
# tests/test_fmha_gpu.py passed on the H200 (2026-11-30, session 3): 7 tests.
VALIDATED = True
# O + max-score (mode 1; variants fmha_sm90_*_maxscore: each row's scaled max over a block's
# visible keys is written as the block streams by): test_fmha_native_o_and_max_score_match_the_
# reference passed on the H200 (2026-11-30).
VALIDATED_MAX_SCORE = True
# e4m3 q/k/v (variants fmha_sm90_e4m3_*: e4m3 QK^T wgmma, P rounded to e4m3 in registers, V
# transposed per block into a key-permuted Vt; O bf16; q/k/v/o scales folded into the logit and
# output scales): test_fmha_native_e4m3_matches_the_quantized_model passed on the H200
# (2026-11-30, session 4; 8 cases: with exact-product q/k every row equals the e4m3-P model)
# and memcheck ran it clean; again with the word-wise V transpose (55ab96c): 511-537 TFLOP/s
# at 8k-32k, 1.10-1.13x the bf16 kernel.
VALIDATED_FP8 = True
# The warp-specialized form (variants fmha_sm90_bfloat16_*_ws, cute_kernels/fmha_sm90_ws.py: a
# TMA producer warp over a K/V mbarrier ring, setmaxnreg, two ping-pong consumer warpgroups
# with S(j) and P(j-1) V(j-1) in one turn; bf16, O only): compiled for sm_90a (no spills, no
# serialized wgmma). Passed the "ws" cases of tests/test_fmha_gpu.py and memcheck on the H200
# (2026-12-01, session 5) at 0.86-0.92x cuDNN against 0.72-0.78x for the plain loop: it serves
# bf16 O-only calls.
VALIDATED_WARP_SPECIALIZED = True
# e4m3 q/k/v on the warp-specialized kernel (variants fmha_sm90_e4m3_*_ws*: raw V by TMA, three
# producer warps transpose it into key-permuted Vt stages; P e4m3 in registers as the plain
# e4m3 kernel). Hung until session 7 (setmaxnreg 80 / 216 overdrew the launch registers; now
# 72 / 216); then on the H200 (2026-12-01, 622bf2c) every e4m3 form passed the quantized-model
# cases (exact products: every row on the e4m3-P model) and NaN-past-kv_len, memcheck clean;
# "ws" 527-582 TFLOP/s at 8k-32k, 1.07-1.09x the plain e4m3 kernel: it serves e4m3 O-only calls.
VALIDATED_WARP_SPECIALIZED_FP8 = True
# None: the gates above decide (the served form is SERVED_WS_FORM's); False: the plain kernel;
# True: "ws"; a form name: that form (WS_FORMS of the call's dtype; a name the dtype lacks is an
# error).
WARP_SPECIALIZED_FOR_TESTS: Union[None, bool, str] = None
# Warp-specialized forms per q/k/v dtype (cute_kernels.variants.FMHA_WS_FORMS: the one table).
WS_FORMS = {"bfloat16": _forms.WS_FORMS, "e4m3": _forms.WS_FP8_FORMS}
# "wsf" (FlashAttention-3's intra-warpgroup order: O rescaled under S(j), the softmax of block j
# under the own P(j-1) V(j-1)): on the H200 (2026-12-01, session 8, 05edc2d) its float64,
# quantized-model and NaN-past-kv_len cases passed in both dtypes and memcheck was clean. Timed
# next to ws in the same run (Hq 64 / Hkv 4, dense): e4m3 faster in all four cells (8k causal
# 2.107 -> 2.073 ms, 8k 4.004 -> 3.933, 32k causal 30.93 -> 30.07, 32k 60.96 -> 59.65), bf16
# slower in all four (e.g. 32k causal 31.87 -> 34.42 ms). So each dtype serves its faster form.
# "wsu" (bf16; cute_kernels/fmha_sm90_ws.py `uniform`: every tile starts on K/V stage 0, the
# blocks every row sees whole run as unrolled pairs on static stages, the consumer is traced
# per warpgroup, so the wgmma descriptors are static offsets in uniform registers): on the H200
# (2026-12-01, session 8, 5fb4b37) its float64 and NaN-past-kv_len cases passed (with ws / wsf,
# whose PTX the shared refactor reordered: 45 cases) and memcheck was clean; same run, Hq 64 /
# Hkv 4, dense, ms, ws -> wsu: 8k causal 2.112 -> 1.894, 8k 4.035 -> 3.497, 32k causal 31.71 ->
# 31.12, 32k 63.25 -> 54.12 (650 TFLOP/s, 1.03x cuDNN). It serves bf16. e4m3 "wsu" (the same
# with the transposer warps on the per-tile stages and P rounded to e4m3 in place): on the H200
# (0c091a1) its quantized-model cases (exact products: every row on the e4m3-P model) and
# NaN-past-kv_len passed, memcheck clean; same run, ms, wsf -> wsu: 8k causal 2.092 -> 1.759,
# 8k 3.959 -> 3.230, 32k causal 30.29 -> 25.34 (694 TFLOP/s, 1.18x cuDNN), 32k 59.59 -> 52.53.
# It serves e4m3.
# e4m3 "wsut" (session 9): wsu reading V transposed ahead of the kernel (transpose_v, the
# fmha_transpose_v_e4m3 CUDA op: one pass over the request's V blocks) instead of transposing
# it in three producer warps; ncu of e4m3 wsu at 8k showed those warps issuing a third of the
# kernel's instructions (half of them mbarrier polling) on the consumers' schedulers. On the
# H200 (383b56c) its quantized-model and NaN-past-kv_len cases and the transpose op's
# byte-exact check passed, memcheck clean (with ws / wsu / split-KV); same run, Hq 64 / Hkv 4,
# ms: 32k causal wsu 25.71 -> wsut 21.75 (809 TFLOP/s, 1.31x our bf16 28.43, 1.38x cuDNN),
# paged 21.70; 32k non-causal 43.36 (1.29x bf16). It serves e4m3.
# "wsup" / "wsutp" (session 10): wsu / wsut on persistent CTAs (min(items, SMs) CTAs walk the
# (query tile, head, request) items, every head's heaviest tile first; run() passes the SM
# count). On the H200 (6358306) the whole test_fmha_gpu.py passed with them (float64,
# quantized-model, NaN past kv_len, the 2^31-element pool) and memcheck was clean. Two runs in
# opposite order, dense, 4k / 8k / 32k x 64/4, 32/8 x causal or not: e4m3 wsutp 0.89-1.01x
# wsut's time (geomean 0.975; 4k causal 64/4 0.455 -> 0.407 ms), so it serves e4m3; bf16 wsup
# 0.96-0.98x causal at 4k-8k but 1.01-1.035x non-causal, so bf16 keeps wsu (wsup validated,
# not served).
# Session 11 (c7f57ea): the persistent forms' producer loads each item's Q (TMA, under the
# previous item's last P V and O store) and CTAs take items in boustrophedon rounds (the
# busiest CTA of a causal 4k call streamed 1.125x the mean blocks, now ~1.0x). All GPU tests
# (FMHA 117, sparse prefill, block max-score, transformers, csrc) passed, memcheck clean. Two
# runs in opposite order, dense: e4m3 wsutp / wsut 0.83-0.85 causal at 4k, 0.92-0.94 at 8k,
# 0.98-1.03 otherwise; bf16 wsup / wsu 0.89-0.92 causal at 4k, 0.95-0.96 at 8k, 0.985-1.016 at
# 32k (run-to-run noise there), but 0.985-1.045 non-causal. So bf16 serves wsup for causal
# calls and wsu otherwise (SERVED_WS_FORM_CAUSAL); e4m3 serves wsutp for both. The next run
# (fbe4685, served forms) showed the persistent forms losing at 128k (bf16 wsup causal 245 / 485
# ms against wsu's 224 / 449 at 890fb14, e4m3 wsutp 1.03-1.08x wsut): their rounds spread the
# concurrent CTAs over every KV head, where the non-persistent grid's concurrent CTAs share one
# head's K/V in L2. So calls of more than PERSISTENT_MAX_ITEMS work items (32k and up with 32
# or 64 heads, where the persistent forms were at best even) serve SERVED_WS_FORM_LONG.
# "wsuts" / "wsutps" (session 13): wsut / wsutp with the softmax's row sums on the tensor core
# (P times a ones tile, an N = 8 wgmma per 32 keys in P V's group; each block's sums join an
# fp32 running sum) and P rounded straight into the A fragment's word order: 911 -> 793 SASS
# instructions per pair of turns. On the H200 (43f899b) their quantized-model cases (exact
# products: every row on the model that sums the rounded P) and NaN-past-kv_len passed, memcheck
# clean; A/B in one process, both orders, e4m3 time vs wsutp: 0.92-0.94 at 4k-8k; wsuts vs wsut
# at 32k 0.93-0.97. They serve e4m3 (the whole test file and memcheck passed with them served:
# logs/fmha_row_sum_on_mma_served_tests_memcheck_h200_2026-12-02_s13.log).
VALIDATED_WS_FORMS = {"bfloat16": ("ws", "wsf", "wsu", "wsup"),
                      "e4m3": ("ws", "wsf", "wsu", "wsut", "wsutp", "wsuts", "wsutps")}
SERVED_WS_FORM = {"bfloat16": "wsu", "e4m3": "wsutps"}
SERVED_WS_FORM_CAUSAL = {"bfloat16": "wsup", "e4m3": "wsutps"}
SERVED_WS_FORM_LONG = {"bfloat16": "wsu", "e4m3": "wsuts"}
PERSISTENT_MAX_ITEMS = 4096     # (query tile, head, request) items: ~31 rounds of 132 CTAs
# Split-KV for plans with num_kv_splits > 1 (decode-like: few query tiles, long KV; variants
# fmha_sm90_*_split, FmhaSm90Split: each CTA streams one key range and writes fp32 partial rows
# + LSE, merged by the sparse combine, one slot per split). Passed the "split" cases of
# tests/test_fmha_gpu.py and memcheck on the H200 (2026-12-01, session 5): 1.20-1.52x the
# unsplit kernel on plans the planner splits (B=1, q 1 / 128, 32k / 128k keys). The hook forces
# it on or off.
VALIDATED_SPLIT_KV = True
SPLIT_KV_FOR_TESTS: Optional[bool] = None
SPLIT_COMBINE = "sparse_combine_sm90_pf32"
MODE_O_ONLY = 3
MODE_O_AND_SCORE = 1
# served q/k/v dtypes (variants.FMHA_DTYPES)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "e4m3"}
# Tests set this to fill O with NaN before the launch (catches rows the kernel does not write).
POISON_BUFFERS_FOR_TESTS = False
# The FMHA artifact of the most recent run() (tests check which form served a call).
last_variant: Optional[str] = None
# Forms whose v argument is V transposed ahead of the kernel (transpose_v).
V_TRANSPOSED_FORMS = _forms.fmha_ws_forms_with("v_transposed")
# Forms that sum the softmax's P on the tensor core (cute_kernels.fmha_sm90_ws `mma_row_sum`):
# the row sum is over the e4m3-rounded P, as P V's (the quantized model's sum_quantized_p).
ROW_SUM_ON_MMA_FORMS = _forms.fmha_ws_forms_with("mma_row_sum")
TRANSPOSE_V_OP = "fmha_transpose_v_e4m3"


def vt_column_keys(block: int = PAGE):
    """The key each column of a transposed V block holds: column r = x0 + 2 x1 + 4 t + 16 j
    (t < 4) holds key x0 + 8 x1 + 2 t + 16 j, the order in which the e4m3 kernels hand P from
    registers to the P.V wgmma (cute_kernels.tile_utils.register_p_row_order; the CUDA op
    computes the same, tests check all three agree)."""
    return [(r & ~0xF) | (r & 1) | (((r >> 1) & 1) << 3) | (((r >> 2) & 3) << 1)
            for r in range(block)]


def vt_table(kv_lens: torch.Tensor, width: int, cap: Optional[int] = None) -> torch.Tensor:
    """[B, width] int32: the block of the transposed V holding key block j of request b,
    request after request (block j < ceil(kv_len_b / 128), kv_len clamped to cap tokens when
    given). What the transpose op writes as the second half of its table (tests compare)."""
    lens = kv_lens.to(torch.int64).clamp_min(0)
    if cap is not None:
        lens = lens.clamp_max(cap)
    blocks = (lens + PAGE - 1) // PAGE
    base = torch.cumsum(blocks, 0) - blocks
    cols = torch.arange(width, device=kv_lens.device, dtype=torch.int64)
    return (base[:, None] + cols[None, :]).to(torch.int32)


def transpose_v(v: torch.Tensor, cu_seqlens_k: torch.Tensor, kv_lens: torch.Tensor,
                page_table: Optional[torch.Tensor], host_kv_lens) -> tuple:
    """e4m3 V (dense [tokens, Hkv, 128] or paged [pages, Hkv, 128, 128]; page_table
    contiguous) -> (Vt [blocks, Hkv, 128 channels, 128 keys'], tables [2, B, W]) for the wsut
    form: Vt[tables[1, b, j], h, c, r] = V(key vt_column_keys()[r] of block j of request b,
    head h, channel c), zero at or past kv_len (paged: kv_len clamped to the table's width *
    128, as the FMHA clamps it) and for rows outside the tensor or pool; tables[0] = the page
    table (paged) or 0, tables[1] = vt_table(kv_lens, W, cap) (the kernel's page_table). One
    launch (capture-safe: sizes from the host lengths)."""
    cap = page_table.shape[1] * PAGE if page_table is not None else None
    blocks = [-(-max(0, n if cap is None else min(n, cap)) // PAGE) for n in host_kv_lens]
    width = page_table.shape[1] if page_table is not None else max(max(blocks, default=0), 1)
    tables = torch.empty(2, kv_lens.shape[0], width, dtype=torch.int32, device=v.device)
    vt = torch.empty(max(sum(blocks), 1), v.shape[1], PAGE, PAGE, dtype=v.dtype,
                     device=v.device)
    if POISON_BUFFERS_FOR_TESTS:
        tables.fill_(-1)
        vt.view(torch.uint8).fill_(0x7F)                     # e4m3 NaN
    getattr(ops, TRANSPOSE_V_OP)(v, cu_seqlens_k, kv_lens, page_table, tables, vt)
    return vt, tables


def transpose_v_reference(v: torch.Tensor, cu_seqlens_k: torch.Tensor, kv_lens: torch.Tensor,
                          page_table: Optional[torch.Tensor], table: torch.Tensor,
                          num_blocks: int) -> torch.Tensor:
    """What transpose_v writes, in plain torch (tests): Vt [num_blocks, Hkv, 128, 128] with the
    blocks no request owns left zero."""
    hkv = v.shape[1]
    vt = torch.zeros(num_blocks, hkv, PAGE, PAGE, dtype=torch.uint8, device=v.device)
    raw = v.view(torch.uint8)
    keys = torch.tensor(vt_column_keys(), device=v.device)
    for b in range(kv_lens.shape[0]):
        n = int(kv_lens[b])
        if page_table is not None:
            n = min(n, page_table.shape[1] * PAGE)
        for j in range(-(-n // PAGE)):
            block = torch.zeros(PAGE, hkv, PAGE, dtype=torch.uint8, device=v.device)
            live = min(PAGE, n - j * PAGE)
            if page_table is not None:
                page = int(page_table[b, j])
                if 0 <= page < v.shape[0]:
                    block[:live] = raw[page, :, :live].transpose(0, 1)
            else:
                start = int(cu_seqlens_k[b]) + j * PAGE
                rows = max(0, min(live, v.shape[0] - start))
                block[:rows] = raw[start:start + rows]
            vt[int(table[b, j])] = block[keys].permute(1, 2, 0)
    return vt.view(v.dtype)


def variant_name(paged: bool, dtype: torch.dtype = torch.bfloat16,
                 max_score: bool = False, form: str = "plain") -> str:
    """Artifact name; must match cute_kernels.variants.FmhaVariant."""
    suffix = "_maxscore" if max_score else ""
    if form != "plain":
        suffix += f"_{form}"
    return f"fmha_sm90_{_DTYPE_NAMES[dtype]}_{'paged' if paged else 'dense'}{suffix}"


@functools.lru_cache(maxsize=None)
def variant_form(name: str) -> str:
    """The kernel form of an FMHA artifact name (variant_name's suffix): a warp-specialized
    form, "split", or "plain"."""
    for form in sorted({*WS_FORMS["bfloat16"], *WS_FORMS["e4m3"], "split"}):
        if name.endswith("_" + form):
            return form
    return "plain"


def form_validated(form: str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether kernel `form` ("plain", "split" or a warp-specialized form) is validated for q/k/v
    `dtype` (the dispatcher's gate and the benchmarks' "-unvalidated" label)."""
    fp8 = dtype == torch.float8_e4m3fn
    if not (VALIDATED_FP8 if fp8 else VALIDATED):
        return False
    if form == "plain":
        return True
    if form == "split":
        return VALIDATED_SPLIT_KV
    return ((VALIDATED_WARP_SPECIALIZED_FP8 if fp8 else VALIDATED_WARP_SPECIALIZED)
            and form in VALIDATED_WS_FORMS[_DTYPE_NAMES[dtype]])


def served_ws_form(dtype_name: str, causal: bool, work_items: Optional[int]) -> str:
    """The validated warp-specialized form a call of `work_items` (query tile, head, request)
    items is served by: SERVED_WS_FORM_LONG past PERSISTENT_MAX_ITEMS, else
    SERVED_WS_FORM_CAUSAL (causal) or SERVED_WS_FORM."""
    if work_items is not None and work_items > PERSISTENT_MAX_ITEMS:
        return SERVED_WS_FORM_LONG[dtype_name]
    return (SERVED_WS_FORM_CAUSAL if causal else SERVED_WS_FORM)[dtype_name]


def warp_specialized_form(dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                          work_items: Optional[int] = None) -> Optional[str]:
    """The warp-specialized form serving O-only calls of q/k/v `dtype`, or None (the plain
    kernel): WARP_SPECIALIZED_FOR_TESTS when set, else served_ws_form's once validated for the
    dtype (or with MSA_UNVALIDATED_KERNELS=1)."""
    forms = WS_FORMS[_DTYPE_NAMES[dtype]]
    forced = WARP_SPECIALIZED_FOR_TESTS
    if isinstance(forced, str):
        if forced not in forms:
            raise ValueError(f"WARP_SPECIALIZED_FOR_TESTS={forced!r}: the {_DTYPE_NAMES[dtype]} "
                             f"warp-specialized forms are {', '.join(forms)}")
        return forced
    fp8 = dtype == torch.float8_e4m3fn
    served = served_ws_form(_DTYPE_NAMES[dtype], causal, work_items)
    if forced is True:
        return "ws"
    enabled = _backend.form_enabled(
        forced, f"the warp-specialized ({served}) e4m3 sm90 FMHA" if fp8 else
        f"the warp-specialized ({served}) sm90 FMHA", form_validated(served, dtype))
    return served if enabled else None


def supports(*, q_dtype=None, k_dtype=None, paged=False, page_size=-1, causal=True, mode=None,
             qhead_per_kv=None, work_items=None, **_ignored) -> Optional[str]:
    """None if the native kernel serves a call with these features, else the reason."""
    gate = _backend.unvalidated_reason("the sm90 dense FMHA kernel", VALIDATED)
    if gate is not None:
        return gate
    if q_dtype != k_dtype or q_dtype not in _DTYPE_NAMES:
        return (f"q/k dtypes {q_dtype}/{k_dtype}: the sm90 FMHA serves bf16 or e4m3 q/k/v "
                "(one dtype)")
    if mode not in (MODE_O_ONLY, MODE_O_AND_SCORE):
        return f"mode {mode}: the sm90 FMHA writes O, or O and the max-score output"
    if q_dtype == torch.float8_e4m3fn:
        gate = _backend.unvalidated_reason("the e4m3 sm90 FMHA", VALIDATED_FP8)
        if gate is not None:
            return gate
        if mode != MODE_O_ONLY:
            return f"mode {mode}: the e4m3 sm90 FMHA writes O only"
    if mode == MODE_O_AND_SCORE:
        gate = _backend.unvalidated_reason("the sm90 FMHA with max-score output",
                                           VALIDATED_MAX_SCORE)
        if gate is not None:
            return gate
    if paged and page_size != PAGE:
        return f"page_size {page_size}: the sm90 FMHA pages by {PAGE} tokens"
    variant = _variant_for(bool(paged), mode, q_dtype, bool(causal), work_items)
    if variant_form(variant) in V_TRANSPOSED_FORMS and not compiled_ops.has(TRANSPOSE_V_OP):
        return (f"{variant} reads V transposed by the compiled {TRANSPOSE_V_OP} op: "
                + compiled_ops.missing_reason(TRANSPOSE_V_OP))
    return cute_runtime.unavailable_reason(variant)


def _variant_for(paged: bool, mode: int, dtype: torch.dtype = torch.bfloat16,
                 causal: bool = False, work_items: Optional[int] = None) -> str:
    """The artifact serving mode 3 (O; bf16 or e4m3) or mode 1 (O + max-score, bf16); O runs on
    a warp-specialized form when warp_specialized_form(dtype, causal, work_items) names one."""
    if mode == MODE_O_ONLY:
        form = warp_specialized_form(dtype, causal, work_items)
        if form is not None:
            return variant_name(paged, dtype, form=form)
    return variant_name(paged, dtype, max_score=mode == MODE_O_AND_SCORE)


def split_kv_count(plan, with_score: bool, paged: bool = False,
                   dtype: torch.dtype = torch.bfloat16) -> int:
    """The plan's num_kv_splits when the split-KV form runs it (O only, validated or forced,
    its artifact for this layout and dtype and the combine present), else 1."""
    splits = int(plan.get("num_kv_splits", 1) or 1)
    if splits <= 1 or with_score:
        return 1
    if not _backend.form_enabled(SPLIT_KV_FOR_TESTS, "the split-KV sm90 FMHA",
                                 VALIDATED_SPLIT_KV):
        return 1
    if cute_runtime.unavailable_reason(variant_name(paged, dtype, form="split"), SPLIT_COMBINE):
        return 1
    return splits


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_launch_limits(call) -> None:
    """NotImplementedError for sizes the kernel cannot count in int32. q, k, v and O may hold
    2^31 elements or more (their row offsets are 64-bit: the page or token index times a 64-bit
    stride); the kernel clamps key lengths to max_pages * 128 in 32 bits, so that must fit."""
    if call.paged:
        cute_runtime.check_int32_count("page_table", call.page_table.shape[1] * PAGE,
                                       f"max_pages * {PAGE} (the longest key range the table "
                                       f"maps)")


def run(call):
    """Returns (O [total_q, Hq, 128] bf16, max_score [Hq, max_k_tiles, total_q] fp32 in mode 1
    (-inf where no key of the tile is visible to the row) or None)."""
    q, k, v = call.q, call.k, call.v
    device = q.device
    plan = call.plan
    total_q, num_heads, head_dim = q.shape
    check_launch_limits(call)
    out = torch.empty(total_q, num_heads, head_dim, dtype=call.out_dtype, device=device)
    with_score = call.max_k_tiles > 0
    # The kernel writes the tiles each row's query tile streams; the rest stays -inf.
    max_score = (torch.full((num_heads, call.max_k_tiles, total_q), float("-inf"),
                            dtype=torch.float32, device=device) if with_score else None)
    if total_q == 0:
        return out, max_score

    from ..fmha import _to
    cu_q = _to(plan["cu_seqlens_q"], device)
    cu_k = _to(plan["cu_seqlens_k"], device)
    kv_lens = _to(plan["kv_segment_lens"], device)
    # The fmha call always carries [B] offsets; clamped as the indexer clamps them.
    offsets = block_max_score_sm90.causal_offsets(call.qo_offset, None, kv_lens,
                                                  call.host_qo_offset).contiguous()
    batch = cu_q.numel() - 1
    table = call.page_table if call.paged else kv_lens.view(batch, 1)   # unused when dense
    grid_q_tiles = call.q_tiles          # 128-query tiles (cute_kernels.fmha_sm90.TILE_M)
    if POISON_BUFFERS_FOR_TESTS:
        out.fill_(float("nan"))
    scalars = [float(call.logit_scale) * math.log2(math.e), float(call.output_scale),
               int(bool(plan["causal"])), grid_q_tiles]
    global last_variant
    splits = split_kv_count(plan, with_score, call.paged, q.dtype)
    if splits > 1:
        # fp32 partial rows + LSE per split, merged by the combine (one slot per split).
        o_partial = torch.empty(splits, total_q, num_heads, head_dim, dtype=torch.float32,
                                device=device)
        lse_partial = torch.empty(splits, total_q, num_heads, dtype=torch.float32,
                                  device=device)
        if POISON_BUFFERS_FOR_TESTS:
            o_partial.fill_(float("nan"))
            lse_partial.fill_(float("nan"))
        last_variant = variant_name(call.paged, q.dtype, form="split")
        cute_runtime.launch(last_variant, device, q, k, v,
                            o_partial, lse_partial, cu_q, cu_k, kv_lens, offsets,
                            table.contiguous(), *scalars, splits)
        counts = torch.full((total_q, 1), splits, dtype=torch.int32, device=device)
        lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=device)
        cute_runtime.launch(SPLIT_COMBINE, device, o_partial, lse_partial, lse_partial, counts,
                            out, lse, lse, 0)
        return out, None
    name = _variant_for(call.paged, MODE_O_AND_SCORE if with_score else MODE_O_ONLY, q.dtype,
                        bool(plan["causal"]), call.work_items)
    table = table.contiguous()
    form = variant_form(name)
    if form in V_TRANSPOSED_FORMS:
        # V -> Vt once for the call; the op also writes the kernel's [2, B, W] table (K's
        # pages, Vt's blocks).
        v, table = transpose_v(v, cu_k, kv_lens, table if call.paged else None,
                               plan["host_kv_lens"])
    args = [q, k, v, out, cu_q, cu_k, kv_lens, offsets, table] + scalars
    if with_score:     # max-score values are scaled by sm_scale * q_scale * k_scale
        args += [max_score, float(call.logit_scale)]
    if form in WS_FORMS[_DTYPE_NAMES[q.dtype]]:
        args.append(_sm_count(device))        # the persistent forms' CTA count
    last_variant = name
    cute_runtime.launch(name, device, *args)
    return out, max_score


_backend.register_native("fmha_dense", "sm90", run, supports)


def max_score_supports(*, q_dtype=None, k_dtype=None, paged=False, page_size=-1, causal=True,
                       num_qo_heads=None, num_kv_heads=None, **_ignored) -> Optional[str]:
    """The max-score-only proxy pass (mode 2) is the indexer's computation: native when the
    sm90 block max-score kernel serves it (one shared key head, 128-token pages or dense K;
    e4m3 inputs are widened to bf16 exactly, as the reference path does)."""
    if num_kv_heads != 1:
        return f"{num_kv_heads} KV heads: the native max-score pass needs num_kv_heads = 1"
    if paged and page_size != PAGE:
        return f"page_size {page_size}: the native max-score pass pages by {PAGE} tokens"
    return block_max_score_sm90.supports(q_dtype=torch.bfloat16, k_dtype=torch.bfloat16,
                                         paged=paged, causal=causal, num_heads=num_qo_heads,
                                         num_k_heads=1)


def max_score_run(call):
    """max_score [Hq, max_k_tiles, total_q] fp32 from the native indexer kernel."""
    from ..fmha import _max_score_via_indexer
    return _max_score_via_indexer(call)


_backend.register_native("fmha_max_score", "sm90", max_score_run, max_score_supports)
