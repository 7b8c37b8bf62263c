"""Native SM90 dense FMHA (the "fmha_dense" op): the CuTe-DSL kernels behind ``fmha_sm100`` /
``fmha`` (contract §2.2), and the max-score-only pass ("fmha_max_score").

``supports`` picks the kernel form of a call from cute_kernels.variants.FMHA_FORMS (the serving
table: the max-score form for O + max-score, the split-KV form for plans the planner splits, else
the warp-specialized forms by dtype, causality and work items) and ``run(call, kernel)``
launches it on q's device and current stream with no host synchronization (every size comes
from the plan's host values): O = output_scale * softmax(logit_scale * q k^T) v over the visible
keys (causal bottom-right with the plan's or the override's qo_offset), 0 for rows that see
nothing.

Served: bf16 or e4m3 q/k/v (one dtype), any GQA group, dense K/V or paged K/V with 128-token
pages, causal or not; O for both dtypes, O with the max-score output (mode 1) for bf16. Other
calls (mixed dtypes, other page sizes, e4m3 mode 1) fall back to the reference through
``supports``; the block-selected mode goes to the sparse bridge before dispatch when the plan has
one.

"fmha_max_score" (mode 2, the max-score-only proxy pass) is the indexer's computation and runs
on the block max-score kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import torch

from .. import _backend
from .._common import causal_offsets, to_device
from ..cute_kernels import variants
from . import block_max_score_sm90, cute_runtime, debug, serving

from . import compiled_ops
from .compiled_ops import ops

PAGE = variants.KV_BLOCK
MODE_O_ONLY = 3
MODE_O_AND_SCORE = 1
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "e4m3"}
SPLIT_COMBINE = variants.CombineVariant("float32").name
TRANSPOSE_V_OP = "fmha_transpose_v_e4m3"
# Forms whose v argument is V transposed ahead of the kernel (transpose_v), and forms that sum
# the softmax's P on the tensor core: the row sum is then over the e4m3-rounded P, as P V's (the
# quantized model's sum_quantized_p).
V_TRANSPOSED_FORMS = variants.forms_with(variants.FMHA_FORMS, "v_transposed")
ROW_SUM_ON_MMA_FORMS = variants.forms_with(variants.FMHA_FORMS, "mma_row_sum")


def vt_column_keys(block: int = PAGE):
    """The key each column of a transposed V block holds: column r = x0 + 2 x1 + 4 t + 16 j
    (t < 4) holds key x0 + 8 x1 + 2 t + 16 j, the order in which the e4m3 kernels hand P from
    registers to the P.V wgmma (cute_kernels.fp8.register_p_row_order; the CUDA op
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
    contiguous) -> (Vt [blocks, Hkv, 128 channels, 128 keys'], tables [2, B, W]) for the e4m3
    forms (V_TRANSPOSED_FORMS): Vt[tables[1, b, j], h, c, r] = V(key vt_column_keys()[r] of
    block j of request b, head h, channel c), zero at or past kv_len (paged: kv_len clamped to
    the table's width * 128, as the FMHA clamps it) and for rows outside the tensor or pool;
    tables[0] = the page table (paged) or 0, tables[1] = vt_table(kv_lens, W, cap) (the
    kernel's page_table). One launch (capture-safe: sizes from the host lengths)."""
    cap = page_table.shape[1] * PAGE if page_table is not None else None
    blocks = [-(-max(0, n if cap is None else min(n, cap)) // PAGE) for n in host_kv_lens]
    width = page_table.shape[1] if page_table is not None else max(max(blocks, default=0), 1)
    tables = torch.empty(2, kv_lens.shape[0], width, dtype=torch.int32, device=v.device)
    vt = torch.empty(max(sum(blocks), 1), v.shape[1], PAGE, PAGE, dtype=v.dtype,
                     device=v.device)
    if debug.poison():
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


@dataclasses.dataclass(frozen=True)
class FmhaKernel:
    """The kernel supports() picked for a call, as run() launches it."""
    form: str                  # a name of cute_kernels.variants.FMHA_FORMS
    variant: str               # its artifact
    artifacts: Tuple[str, ...]     # every artifact the call launches (split-KV: + the combine)
    split: bool                # fp32 partial rows per key range, then the combine
    with_score: bool           # also writes the max-score output (mode 1)
    v_transposed: bool         # v is Vt, transposed ahead by TRANSPOSE_V_OP
    trailing_args: Tuple[str, ...]     # variants.TRAILING_ARGS of its kernel class


@functools.lru_cache(maxsize=None)
def fmha_kernel(dtype_name: str, paged: bool, form_name: str) -> FmhaKernel:
    """The FmhaKernel of form `form_name` for q/k/v `dtype_name` ("bfloat16" / "e4m3")."""
    form = variants.FMHA_FORMS[form_name]
    variant = variants.FmhaVariant(paged, dtype_name, form_name).name
    split = form.kernel == "FmhaSm90Split"
    return FmhaKernel(form=form_name, variant=variant,
                      artifacts=(variant, SPLIT_COMBINE) if split else (variant,), split=split,
                      with_score=form.kernel == "FmhaSm90MaxScore",
                      v_transposed=bool(form.options.get("v_transposed")),
                      trailing_args=form.trailing_args)


def supports(*, q_dtype=None, k_dtype=None, paged=False, page_size=-1, causal=True, mode=None,
             work_items=0, kv_splits=1, **_ignored) -> _backend.Verdict:
    """The kernel serving a call with these features (_backend.Served), else the reason none
    can. debug hooks: fmha_form (an O-only form to run), fmha_split_kv=False (never split)."""
    if q_dtype != k_dtype or q_dtype not in _DTYPE_NAMES:
        return (f"q/k dtypes {q_dtype}/{k_dtype}: the sm90 FMHA serves bf16 or e4m3 q/k/v "
                "(one dtype)")
    if mode not in (MODE_O_ONLY, MODE_O_AND_SCORE):
        return f"mode {mode}: the sm90 FMHA writes O, or O and the max-score output"
    if paged and page_size != PAGE:
        return f"page_size {page_size}: the sm90 FMHA pages by {PAGE} tokens"
    dtype_name = _DTYPE_NAMES[q_dtype]
    with_score = mode == MODE_O_AND_SCORE
    if with_score and dtype_name == "e4m3":
        return f"mode {mode}: the e4m3 sm90 FMHA writes O only"
    forced = None if with_score else debug.forced("fmha_form")
    if forced is not None and variants.FMHA_FORMS.get(forced) is not None \
            and variants.FMHA_FORMS[forced].kernel == "FmhaSm90MaxScore":
        raise ValueError(f"fmha_form {forced!r}: serves O + max-score calls only; force an "
                         "O-only form")
    if debug.forced("fmha_split_kv") is False:
        kv_splits = 1
    paged = bool(paged)
    form = serving.pick("fmha", dtype_name,
                        lambda f: fmha_kernel(dtype_name, paged, f.name).artifacts,
                        forced=forced, with_score=with_score, kv_splits=int(kv_splits or 1),
                        causal=bool(causal), work_items=int(work_items or 0))
    if isinstance(form, str):
        return form
    kernel = fmha_kernel(dtype_name, paged, form.name)
    if kernel.v_transposed and not compiled_ops.has(TRANSPOSE_V_OP):
        return (f"{kernel.variant} reads V transposed by the compiled {TRANSPOSE_V_OP} op: "
                + compiled_ops.missing_reason(TRANSPOSE_V_OP))
    return _served(kernel)


@functools.lru_cache(maxsize=None)
def _served(kernel: FmhaKernel) -> _backend.Served:
    return _backend.Served(kernel)


def check_launch_limits(call) -> None:
    """NotImplementedError for sizes the kernel cannot count in int32. q, k, v and O may hold
    2^31 elements or more (their row offsets are 64-bit: the page or token index times a 64-bit
    stride); the kernel clamps key lengths to max_pages * 128 in 32 bits, so that must fit."""
    if call.paged:
        cute_runtime.check_int32_count("page_table", call.page_table.shape[1] * PAGE,
                                       f"max_pages * {PAGE} (the longest key range the table "
                                       f"maps)")


def run(call, kernel: FmhaKernel):
    """Returns (O [total_q, Hq, 128] bf16, max_score [Hq, max_k_tiles, total_q] fp32 in mode 1
    (-inf where no key of the tile is visible to the row) or None)."""
    q, k, v = call.q, call.k, call.v
    device = q.device
    plan = call.plan
    total_q, num_heads, head_dim = q.shape
    check_launch_limits(call)
    out = torch.empty(total_q, num_heads, head_dim, dtype=call.out_dtype, device=device)
    # The kernel writes the tiles each row's query tile streams; the rest stays -inf.
    max_score = (torch.full((num_heads, call.max_k_tiles, total_q), float("-inf"),
                            dtype=torch.float32, device=device) if kernel.with_score else None)
    if total_q == 0:
        return out, max_score

    cu_q = to_device(plan["cu_seqlens_q"], device)
    cu_k = to_device(plan["cu_seqlens_k"], device)
    kv_lens = to_device(plan["kv_segment_lens"], device)
    # The fmha call always carries [B] offsets; clamped as the indexer clamps them.
    offsets = causal_offsets(call.qo_offset, None, kv_lens, call.host_qo_offset).contiguous()
    batch = cu_q.numel() - 1
    table = call.page_table if call.paged else kv_lens.view(batch, 1)   # unused when dense
    grid_q_tiles = call.q_tiles          # 128-query tiles of the longest request
    poison = debug.poison()
    if poison:
        out.fill_(float("nan"))
    scalars = [float(call.logit_scale) * math.log2(math.e), float(call.output_scale),
               int(bool(plan["causal"])), grid_q_tiles]
    debug.record("fmha_dense", kernel.variant)
    if kernel.split:
        # fp32 partial rows + LSE per split, merged by the combine (one slot per split).
        splits = max(int(plan.get("num_kv_splits", 1) or 1), 1)
        o_partial = torch.empty(splits, total_q, num_heads, head_dim, dtype=torch.float32,
                                device=device)
        lse_partial = torch.empty(splits, total_q, num_heads, dtype=torch.float32,
                                  device=device)
        if poison:
            o_partial.fill_(float("nan"))
            lse_partial.fill_(float("nan"))
        cute_runtime.launch(kernel.variant, device, q, k, v, o_partial, lse_partial, cu_q, cu_k,
                            kv_lens, offsets, table.contiguous(), *scalars, splits)
        counts = torch.full((total_q, 1), splits, dtype=torch.int32, device=device)
        lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=device)
        cute_runtime.launch(SPLIT_COMBINE, device, o_partial, lse_partial, lse_partial, counts,
                            out, lse, lse, 0)
        return out, None
    table = table.contiguous()
    if kernel.v_transposed:
        # V -> Vt once for the call; the op also writes the kernel's [2, B, W] table (K's
        # pages, Vt's blocks).
        v, table = transpose_v(v, cu_k, kv_lens, table if call.paged else None,
                               plan["host_kv_lens"])
    args = [q, k, v, out, cu_q, cu_k, kv_lens, offsets, table] + scalars
    if kernel.with_score:     # max-score values are scaled by sm_scale * q_scale * k_scale
        args += [max_score, float(call.logit_scale)]
    args += cute_runtime.trailing_args(kernel.trailing_args, device)
    cute_runtime.launch(kernel.variant, device, *args)
    return out, max_score


_backend.register_native("fmha_dense", "sm90", run, supports)


def max_score_supports(*, q_dtype=None, k_dtype=None, paged=False, page_size=-1, causal=True,
                       num_qo_heads=None, num_kv_heads=None, **_ignored) -> _backend.Verdict:
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


def max_score_run(call) -> torch.Tensor:
    """max_score [Hq, max_k_tiles, total_q] fp32 from the block max-score kernel, scaled by
    sm_scale * q_scale * k_scale (e4m3 q / k widened to bf16: exact)."""
    plan = call.plan
    device = call.q.device
    q = call.q if call.q.dtype == torch.bfloat16 else call.q.to(torch.bfloat16)
    k = call.k if call.k.dtype == torch.bfloat16 else call.k.to(torch.bfloat16)
    causal = bool(plan["causal"])
    return block_max_score_sm90.max_scores(
        q, k, to_device(plan["cu_seqlens_q"], device), to_device(plan["cu_seqlens_k"], device),
        max_seqlen_q=int(plan["max_seqlen_q"]), max_k_tiles=call.max_k_tiles,
        scale=float(call.logit_scale), causal=causal,
        qo_offset=call.qo_offset if causal else None,
        page_table=call.page_table if call.paged else None,
        seqused_k=to_device(plan["kv_segment_lens"], device) if call.paged else None)


_backend.register_native("fmha_max_score", "sm90", max_score_run, max_score_supports)
