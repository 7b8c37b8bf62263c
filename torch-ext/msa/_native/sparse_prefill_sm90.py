"""Native SM90 sparse prefill: the CuTe-DSL KV-outer attention kernel plus its combine.

``run(call)`` takes a validated :class:`msa.interface.SparseAttentionCall` and launches two
kernels on q's device and current stream, with no host synchronization:

1. attention (cute_kernels/sparse_prefill_sm90_ws.py, warp-specialized with TMA, for G 8 / 16
   with bf16 or all-e4m3 q/k/v and 16-bit or e4m3 partials; cute_kernels/sparse_prefill_sm90_
   wgmma.py, warpgroup MMA, for the other 16-bit / e4m3-partial calls;
   cute_kernels/sparse_prefill_sm90.py for fp32 partials): one CTA per schedule
   work item writes the per-block partials O_partial [topK, total_q, Hq, 128] (partial_dtype)
   and LSE_partial [topK, total_q, Hq] (plus LSE_T_partial when a temperature LSE is
   requested);
2. combine (cute_kernels/combine.py): log-sum-exp merge into O bf16 [total_q, Hq, 128] and
   LSE fp32 [total_q, Hq].

When the call carries no schedule it is built here on the device with tensor ops
(:func:`build_schedule_on_device`), so the path stays capture-safe.

FP8 (contract §1.2, no scale factors): three modes are compiled (cute_kernels.variants.FP8_MODES,
bf16, fp16 or e4m3 partials) -- ``bf16_kv_e4m3`` (bf16 q, e4m3 k/v), ``e4m3_pv_bf16`` (e4m3 q/k/v,
pv_dtype bf16) and ``e4m3`` (e4m3 q/k/v, pv_dtype e4m3, P kept in registers). **Validation
gate:** supports() serves an FP8 mode only when it is listed in :data:`VALIDATED_FP8_MODES` (add
a mode there only after its GPU test in tests/test_sparse_prefill_gpu.py passed on an H200), or
when the environment sets ``MSA_UNVALIDATED_KERNELS=1`` (the GPU tests do, to validate them).
Otherwise the reference runs (or MSA_BACKEND=native raises with the reason).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union


import torch

from .. import _backend, _stages
from ..src.sm100.prepare_scheduler import (SLOT_SHIFT, SparseAttentionSchedule,
                                          schedule_capacity, target_q_per_cta)
from . import cute_runtime

KV_BLOCK = 128
# Tests set this to fill every buffer the kernels write with NaN first (catches unwritten rows).
POISON_BUFFERS_FOR_TESTS = False
_SUPPORTED_G = (1, 2, 4, 8, 16)
_FP8 = torch.float8_e4m3fn
# partial_dtype -> (variant dtype name, short name in artifact names); every contract dtype.
_PARTIALS = {torch.float32: ("float32", "f32"), torch.bfloat16: ("bfloat16", "bf16"),
             torch.float16: ("float16", "f16"), _FP8: ("e4m3", "e4m3")}
# Partial dtypes proven on an H200 (tests/test_sparse_prefill_gpu.py). fp16 and e4m3 partials
# (wgmma kernel: O staged in 16 bits, e4m3 rows converted as they are written; combine reading
# them) passed every bf16 case and G = 2, 16 of each FP8 mode on 2026-11-30 (session 5),
# memcheck clean.
VALIDATED_PARTIAL_DTYPES: set = {torch.float32, torch.bfloat16, torch.float16, _FP8}
# FP8 modes proven correct on hardware (GPU test passed on an H200); a mode missing here is
# compiled and shipped but refused by supports() unless MSA_UNVALIDATED_KERNELS=1.
# Passed tests/test_sparse_prefill_gpu.py on the H200 (2026-11-30, session 2): every G, dense
# and paged. "e4m3" (P rounded to e4m3) matches the quantized model except for isolated one-ulp
# P flips at e4m3 midpoints (diagnosed: the error vector of such a row is parallel to one V row).
# Its kernel now keeps P in registers; that form passed the same test on the H200 (2026-11-30)
# and replaced the shared-memory-P form.
VALIDATED_FP8_MODES: set = {"bf16_kv_e4m3", "e4m3_pv_bf16", "e4m3"}
UNVALIDATED_ENV = _backend.UNVALIDATED_ENV
# The warp-specialized form (variants sparse_prefill_sm90_{bfloat16,e4m3}_g{8,16}_*_ws,
# cute_kernels/sparse_prefill_sm90_ws.py: a TMA producer warp gathers each query's G x 128 Q
# rows, two consumer warpgroups take tiles alternately and TMA-store each query's partial rows):
# for G in WS_GROUPS, bf16 or all-e4m3 Q/K/V, 16-bit or e4m3 partials. Compiled for sm_90a (no
# spills). On the H200 (2026-12-01, session 6) its 36 cases in tests/test_sparse_prefill_gpu.py
# passed, then the whole file (163 cases, both forms), tests/test_msa_prefill_gpu.py, the
# transformers MiniMax-M3 test and memcheck of its cases: 1.17x (bf16) to 1.29x (e4m3 with e4m3
# partials) faster than the wgmma kernel at 32k. It serves those calls; the wgmma kernel keeps
# the other G and dtype modes.
VALIDATED_WARP_SPECIALIZED = True
# None: the gate decides; False: the wgmma kernel; True: the served warp-specialized form
# wherever it exists; a form name ("ws", "ws3w"): that form (tests and benchmarks).
WARP_SPECIALIZED_FOR_TESTS: Union[None, bool, str] = None
# The three-consumer-warpgroup form (variants ..._ws3w, 6 Q stages; consumers within 130
# registers, no spills). On the H200 (2026-12-01, session 7, 7861e3d) its 36 cases passed (every
# mode / partial dtype / G / layout of ws) and memcheck of its cases ran clean. Timed against ws
# (32k / 128k random, ms): e4m3 with bf16 partials 6.68 -> 6.16 / 28.25 -> 25.76, e4m3 with e4m3
# partials 5.61 -> 5.45 / 22.67 -> 20.87, bf16 with bf16 partials 7.64 -> 7.04 / 31.56 -> 29.67,
# but bf16 with e4m3 partials 6.47 -> 7.36 / 27.68 -> 25.20 (mixed) and fp16 partials not
# timed. It serves the (dtype mode, partial dtype) pairs measured faster at both lengths.
VALIDATED_WS3W: set = {("e4m3", torch.bfloat16), ("e4m3", _FP8), ("bfloat16", torch.bfloat16)}
WS_FORMS = ("ws", "ws3w")
WS_GROUPS = (8, 16)
WS_MODES = ("bfloat16", "e4m3")
# The attention artifact of the most recent run() (tests and benchmarks check the form).
last_attention_variant: Optional[str] = None


def attention_mode(q_dtype, k_dtype, v_dtype, pv_dtype) -> Optional[str]:
    """The compiled attention dtype mode for these dtypes ("bfloat16" or a
    cute_kernels.variants.FP8_MODES name), or None when no kernel exists for them. pv_dtype
    None means the contract default (v's compute dtype)."""
    bf16 = torch.bfloat16
    if q_dtype == bf16 and k_dtype == bf16 and v_dtype == bf16:
        return "bfloat16" if pv_dtype in (None, bf16) else None
    if q_dtype == bf16 and k_dtype == _FP8 and v_dtype == _FP8:
        return "bf16_kv_e4m3" if pv_dtype in (None, bf16) else None
    if q_dtype == _FP8 and k_dtype == _FP8 and v_dtype == _FP8:
        if pv_dtype in (None, _FP8):
            return "e4m3"
        return "e4m3_pv_bf16" if pv_dtype == bf16 else None
    return None


def warp_specialized(qhead_per_kv: int, partial_dtype: torch.dtype, mode: str) -> bool:
    """Whether the warp-specialized form runs this call: it exists for the head group, dtype
    mode and partial dtype, and the gate (or WARP_SPECIALIZED_FOR_TESTS) allows it."""
    if (qhead_per_kv not in WS_GROUPS or mode not in WS_MODES
            or partial_dtype == torch.float32):
        return False
    forced = WARP_SPECIALIZED_FOR_TESTS
    return _backend.form_enabled(True if isinstance(forced, str) else forced,
                                 "the warp-specialized sm90 sparse attention",
                                 VALIDATED_WARP_SPECIALIZED)


def form_validated(form: str, mode: str, partial_dtype: torch.dtype) -> bool:
    """Whether kernel `form` ("wgmma", "ws", "ws3w") is validated for this dtype mode and
    partial dtype (ws3w per (mode, partial) pair: VALIDATED_WS3W)."""
    if form == "wgmma":
        return True
    if not VALIDATED_WARP_SPECIALIZED:
        return False
    return form == "ws" or (mode, partial_dtype) in VALIDATED_WS3W


def variant_form(attention_name: str) -> str:
    """The kernel form of an attention artifact name: "ws", "ws3w" or "wgmma" (the wgmma and
    warp-MMA kernels)."""
    for form in WS_FORMS:
        if attention_name.endswith("_" + form):
            return form
    return "wgmma"


def _variant_names(qhead_per_kv: int, paged: bool, partial_dtype: torch.dtype,
                   mode: str = "bfloat16") -> Tuple[str, str]:
    """(attention, combine) artifact names of the form that serves the call; must match
    cute_kernels.variants."""
    short = _PARTIALS[partial_dtype][1]
    layout = "paged" if paged else "dense"
    form = ""
    if warp_specialized(qhead_per_kv, partial_dtype, mode):
        forced = WARP_SPECIALIZED_FOR_TESTS
        if isinstance(forced, str):
            if forced not in WS_FORMS:
                raise ValueError(f"WARP_SPECIALIZED_FOR_TESTS={forced!r}: the warp-specialized "
                                 f"forms are {', '.join(WS_FORMS)}")
            form = "_" + forced
        else:
            form = "_ws3w" if _backend.form_enabled(
                None, "the three-warpgroup sm90 sparse attention",
                form_validated("ws3w", mode, partial_dtype)) else "_ws"
    return (f"sparse_prefill_sm90_{mode}_g{qhead_per_kv}_{layout}_p{short}{form}",
            f"sparse_combine_sm90_p{short}")


def supports(*, q_dtype=None, k_dtype=None, v_dtype=None, pv_dtype=None, paged=False,
             causal=False, qhead_per_kv=None, topk=None, partial_dtype=None, nvfp4=False,
             **_ignored) -> Optional[str]:
    """None if the native kernel serves a call with these features, else the reason."""
    if nvfp4:
        return "NVFP4 K/V is not native on sm90 yet"
    mode = attention_mode(q_dtype, k_dtype, v_dtype, pv_dtype)
    if mode is None:
        return (f"q/k/v dtypes {q_dtype}/{k_dtype}/{v_dtype} with pv_dtype {pv_dtype}: "
                "not native on sm90")
    if mode != "bfloat16":
        gate = _backend.unvalidated_reason(f"FP8 mode {mode}", mode in VALIDATED_FP8_MODES)
        if gate is not None:
            return gate
        if partial_dtype == torch.float32:
            return ("partial_dtype torch.float32: FP8 modes are native with bfloat16, float16 "
                    "and e4m3 partials")
    if partial_dtype not in _PARTIALS:
        return f"partial_dtype {partial_dtype} is not native on sm90"
    gate = _backend.unvalidated_reason(f"partial_dtype {partial_dtype}",
                                       partial_dtype in VALIDATED_PARTIAL_DTYPES)
    if gate is not None:
        return gate
    if qhead_per_kv not in _SUPPORTED_G:
        return f"qhead_per_kv {qhead_per_kv} is not native"
    return cute_runtime.unavailable_reason(*_variant_names(qhead_per_kv, bool(paged),
                                                           partial_dtype, mode))


def check_launch_limits(call) -> None:
    """NotImplementedError for sizes the kernels cannot count in int32. q, k, v and the
    partials may hold 2^31 elements or more (row offsets are 64-bit: page or token index times a
    64-bit stride); the combine numbers its output rows total_q * Hq in 32 bits, and a paged call
    without seqused_k takes max_pages * 128 as an int32 key length."""
    total_q, num_heads = call.q.shape[0], call.q.shape[1]
    cute_runtime.check_int32_count("q", total_q * num_heads,
                                   "total_q * Hq (rows of the combine)")
    if call.paged and call.seqused_k is None:
        cute_runtime.check_int32_count("page_table", call.page_table.shape[1] * KV_BLOCK,
                                       f"max_pages * {KV_BLOCK} (the key length without "
                                       f"seqused_k)")


def run(call) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Returns (O bf16 [total_q, Hq, 128], LSE fp32 [total_q, Hq] or None, LSE_T or None);
    every output is freshly allocated."""
    q, k, v = call.q, call.k, call.v
    device = q.device
    total_q, num_heads, head_dim = q.shape
    check_launch_limits(call)
    want_lse_t = call.want_temperature_lse and not call.temperature_is_one
    out = torch.empty(total_q, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=device)
    lse_t = torch.empty_like(lse) if want_lse_t else lse
    if total_q == 0:
        return out, (lse if call.want_lse else None), (lse_t if want_lse_t else None)

    schedule = call.schedule
    if schedule is None:
        schedule = build_schedule_on_device(call)
    mode = attention_mode(q.dtype, k.dtype, v.dtype, call.pv_dtype)
    attention_name, combine_name = _variant_names(call.qhead_per_kv, call.paged,
                                                  call.partial_dtype, mode)
    batch = call.cu_seqlens_q.numel() - 1
    cu_k = call.cu_seqlens_k
    if call.paged:
        if call.seqused_k is not None:
            kv_lens = call.seqused_k
        else:  # upstream quirk D11: the whole table width counts as the length
            kv_lens = torch.full((batch,), call.page_table.shape[1] * KV_BLOCK,
                                 dtype=torch.int32, device=device)
        page_table = call.page_table.contiguous()
    else:
        kv_lens = (cu_k[1:] - cu_k[:-1]).contiguous()
        page_table = kv_lens.view(batch, 1)          # unused by the dense variant
    o_partial = torch.empty(call.topk, total_q, num_heads, head_dim, dtype=call.partial_dtype,
                            device=device)
    lse_partial = torch.empty(call.topk, total_q, num_heads, dtype=torch.float32, device=device)
    lse_t_partial = torch.empty_like(lse_partial) if want_lse_t else lse_partial
    if POISON_BUFFERS_FOR_TESTS:
        for buffer in (o_partial, lse_partial, lse_t_partial, out, lse, lse_t):
            buffer.fill_(float("nan"))
    global last_attention_variant
    last_attention_variant = attention_name
    cute_runtime.launch(
        attention_name, device, q, k, v, call.cu_seqlens_q, cu_k, kv_lens, page_table,
        call.k2q_row_ptr, schedule.qsplit_indices, schedule.scheduler_metadata,
        schedule.work_count, o_partial, lse_partial, lse_t_partial, float(call.softmax_scale),
        1.0 / float(call.lse_temperature_scale), int(call.causal), int(want_lse_t))
    _stages.mark("combine")
    cute_runtime.launch(
        combine_name, device, o_partial, lse_partial, lse_t_partial, schedule.split_counts,
        out, lse, lse_t, int(want_lse_t))
    return out, (lse if call.want_lse else None), (lse_t if want_lse_t else None)


def build_schedule_on_device(call) -> SparseAttentionSchedule:
    """A complete schedule for the call's k2q CSR, built with tensor ops on the CSR's device
    (no host synchronization; sizes come from host-known bounds).

    Work items are (row, head, chunk) ordered like the reference builder: each (KV head, CSR
    row) is cut into chunks of target_q_per_cta queries. Slots number a (query, KV head)'s
    entries in CSR row order. Entries whose query id is out of range for the request get -1
    and no slot. metadata rows past work_count are never read (the grid is the capacity and
    CTAs past work_count exit).
    """
    row_ptr = call.k2q_row_ptr
    q_idx = call.k2q_q_indices
    device = row_ptr.device
    hkv, n_entries = q_idx.shape
    total_rows = row_ptr.shape[1] - 1
    total_q = call.q.shape[0]
    topk = call.topk
    target = target_q_per_cta(total_q=total_q, topk=topk, blk_kv=KV_BLOCK, head_kv=hkv,
                              qhead_per_kv=call.qhead_per_kv, device=device,
                              usable_SM_count=call.usable_SM_count)
    capacity = schedule_capacity(total_rows=total_rows, total_q=total_q, topk=topk,
                                 head_kv=hkv, target_q_per_cta=target)
    i64 = torch.int64
    cu_q = call.cu_seqlens_q.to(i64)
    cu_k = call.cu_seqlens_k.to(i64)
    batch = cu_q.numel() - 1
    max_blocks = -(-max(call.max_seqlen_k, KV_BLOCK) // KV_BLOCK)

    # Owner (request b, block beta) of every packed CSR row (round-robin over requests).
    rows_b = (cu_k[1:] - cu_k[:-1] + KV_BLOCK - 1) // KV_BLOCK                     # [B]
    betas = torch.arange(max_blocks + 1, device=device, dtype=i64)
    rows_before = torch.minimum(rows_b.view(1, -1), betas.view(-1, 1)).sum(1)      # [beta+1]
    r_all = torch.arange(total_rows, device=device, dtype=i64)
    row_beta = (torch.searchsorted(rows_before, r_all, right=True) - 1).clamp(0, max_blocks - 1)
    rank = r_all - rows_before[row_beta]
    has_block = (rows_b.view(1, -1) > betas[:max_blocks].view(-1, 1)).to(i64)      # [beta, B]
    nth = has_block.cumsum(1)[row_beta]                                            # [rows, B]
    row_batch = (nth <= rank.view(-1, 1)).sum(1).clamp_max(max(batch - 1, 0))
    row_exists = r_all < rows_before[-1]

    # Work items: chunks of each (row, head), flattened in (row, head) order.
    counts = (row_ptr[:, 1:] - row_ptr[:, :-1]).to(i64).clamp_min(0)               # [H, rows]
    counts = torch.where(row_exists.view(1, -1), counts, torch.zeros_like(counts))
    chunks = ((counts + target - 1) // target).t().reshape(-1)                     # [rows*H]
    chunk_end = chunks.cumsum(0)
    w = torch.arange(capacity, device=device, dtype=i64)
    pair = torch.searchsorted(chunk_end, w, right=True).clamp_max(max(chunks.numel() - 1, 0))
    chunk_in_pair = w - (chunk_end[pair] - chunks[pair])
    w_row, w_head = pair // hkv, pair % hkv
    q_begin = chunk_in_pair * target
    q_count = (counts[w_head, w_row] - q_begin).clamp(0, target)
    meta = torch.stack([w_head, w_row, q_begin, q_count, row_batch[w_row], row_beta[w_row]], 1)
    work_count = chunk_end[-1:].clamp_max(capacity).to(torch.int32) if chunks.numel() else \
        torch.zeros(1, dtype=torch.int32, device=device)

    # Slots: rank of each entry among the entries of its (KV head, query) in CSR order.
    e = torch.arange(n_entries, device=device, dtype=i64).view(1, -1).expand(hkv, -1)
    e_row = torch.searchsorted(row_ptr.to(i64).contiguous(), e.contiguous(), right=True) - 1
    e_row = e_row.clamp(0, max(total_rows - 1, 0))
    e_batch = row_batch[e_row]
    q_local = q_idx.to(i64)
    q_len = (cu_q[1:] - cu_q[:-1])[e_batch]
    valid = ((e < row_ptr[:, -1:].to(i64)) & row_exists[e_row] & (q_local >= 0)
             & (q_local < q_len))
    q_abs = torch.where(valid, cu_q[e_batch] + q_local, torch.zeros_like(q_local))
    heads = torch.arange(hkv, device=device, dtype=i64).view(-1, 1)
    key = torch.where(valid, heads * total_q + q_abs, torch.full_like(q_abs, hkv * total_q))
    flat_key = key.reshape(-1)
    order = torch.sort(flat_key, stable=True).indices
    sorted_key = flat_key[order]
    group_start = torch.searchsorted(sorted_key, sorted_key, right=False)
    slot_sorted = torch.arange(flat_key.numel(), device=device, dtype=i64) - group_start
    slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted).view(hkv, n_entries)
    valid = valid & (slot < topk)
    qsplit = torch.where(valid, q_local | (slot << SLOT_SHIFT), torch.full_like(q_local, -1))
    # scatter_add, not bincount: bincount reads the max on the host (a sync).
    per_key = torch.zeros(hkv * total_q + 1, dtype=i64, device=device).scatter_add_(
        0, flat_key, torch.ones_like(flat_key))[: hkv * total_q]
    split_counts = per_key.view(hkv, total_q).t().clamp_max(topk)
    return SparseAttentionSchedule(
        enabled=True, scheduler_metadata=meta.to(torch.int32).contiguous(),
        work_count=work_count, qsplit_indices=qsplit.to(torch.int32).contiguous(),
        split_counts=split_counts.to(torch.int32).contiguous(), target_q_per_cta=target)


_backend.register_native("sparse_atten", "sm90", run, supports)
