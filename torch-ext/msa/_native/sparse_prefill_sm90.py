"""Native SM90 sparse prefill: the CuTe-DSL KV-outer attention kernels plus their combine.

``supports`` picks the attention form of a call from cute_kernels.variants.SPARSE_FORMS (the
serving table: the TMA warp-specialized forms ws3w / ws for G 8 / 16 with bf16 or all-e4m3 q/k/v
and 16-bit or e4m3 partials, the wgmma kernel for the other 16-bit / e4m3-partial calls, the
warp-MMA kernel for fp32 partials) and ``run(call, kernel)`` launches two kernels on q's device
and current stream, with no host synchronization:

1. attention: one CTA per schedule work item writes the per-block partials
   O_partial [topK, total_q, Hq, 128] (partial_dtype) and LSE_partial [topK, total_q, Hq] (plus
   LSE_T_partial when a temperature LSE is requested);
2. combine (cute_kernels/combine.py): log-sum-exp merge into O bf16 [total_q, Hq, 128] and
   LSE fp32 [total_q, Hq].

When the call carries no schedule it is built here on the device with tensor ops
(:func:`build_schedule_on_device`), so the path stays capture-safe.

Bad metadata (no host sync can see it): the kernels get prefix sums made monotone within the
tensors (``device_prefix_sums``) and read the CSR rows through the schedule's own row pointer,
so no index value can make them read or write out of bounds; the host hints max_seqlen_q /
max_seqlen_k are not used at all. A (query, KV head) with more CSR entries than combine slots
comes back NaN (the combine flags the lost slots) instead of silently missing blocks.

FP8 (contract §1.2, no scale factors): three dtype modes (cute_kernels.variants.FP8_MODES, bf16,
fp16 or e4m3 partials): ``bf16_kv_e4m3`` (bf16 q, e4m3 k/v), ``e4m3_pv_bf16`` (e4m3 q/k/v,
pv_dtype bf16) and ``e4m3`` (e4m3 q/k/v, pv_dtype e4m3, P kept in registers).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from .. import _backend, _stages
from .._common import key_lengths
from .._validation import device_prefix_sums
from ..cute_kernels import variants
from ..src.sm100.prepare_scheduler import (SLOT_SHIFT, SparseAttentionSchedule,
                                          schedule_capacity, target_q_per_cta)
from . import cute_runtime, debug, serving

INT32_MAX = (1 << 31) - 1
KV_BLOCK = variants.KV_BLOCK
_FP8 = torch.float8_e4m3fn
# partial_dtype -> its name in the serving table (every contract partial dtype).
_PARTIALS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
             _FP8: "e4m3"}


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


@dataclasses.dataclass(frozen=True)
class SparseKernel:
    """The kernels supports() picked for a call, as run() launches them."""
    form: str                  # a name of cute_kernels.variants.SPARSE_FORMS
    attention: str             # the attention artifact
    combine: str               # the combine artifact (by partial dtype)


@functools.lru_cache(maxsize=None)
def sparse_kernel(mode: str, qhead_per_kv: int, paged: bool, partial: str,
                  form: str) -> SparseKernel:
    """The SparseKernel of `form` for a dtype mode, head group, layout and partial dtype."""
    return SparseKernel(
        form=form,
        attention=variants.AttentionVariant(qhead_per_kv, paged, partial, mode, form).name,
        combine=variants.CombineVariant(partial).name)


def supports(*, q_dtype=None, k_dtype=None, v_dtype=None, pv_dtype=None, paged=False,
             causal=False, qhead_per_kv=None, topk=None, partial_dtype=None, nvfp4=False,
             **_ignored) -> _backend.Verdict:
    """The kernels serving a call with these features (_backend.Served), else the reason none
    can. debug hook: sparse_form (a form to run wherever it is built)."""
    if nvfp4:
        return "NVFP4 K/V is not native on sm90 yet"
    mode = attention_mode(q_dtype, k_dtype, v_dtype, pv_dtype)
    if mode is None:
        return (f"q/k/v dtypes {q_dtype}/{k_dtype}/{v_dtype} with pv_dtype {pv_dtype}: "
                "not native on sm90")
    if partial_dtype not in _PARTIALS:
        return f"partial_dtype {partial_dtype} is not native on sm90"
    if mode != "bfloat16" and partial_dtype == torch.float32:
        return ("partial_dtype torch.float32: FP8 modes are native with bfloat16, float16 "
                "and e4m3 partials")
    if qhead_per_kv not in variants.QHEAD_PER_KV:
        return f"qhead_per_kv {qhead_per_kv} is not native"
    partial, paged = _PARTIALS[partial_dtype], bool(paged)
    form = serving.pick("sparse", mode,
                        lambda f: (sparse_kernel(mode, qhead_per_kv, paged, partial,
                                                 f.name).attention,
                                   variants.CombineVariant(partial).name),
                        group=qhead_per_kv, partial=partial, forced=debug.forced("sparse_form"))
    if isinstance(form, str):
        return form
    return _served(mode, qhead_per_kv, paged, partial, form.name)


@functools.lru_cache(maxsize=None)
def _served(mode: str, qhead_per_kv: int, paged: bool, partial: str,
            form: str) -> _backend.Served:
    return _backend.Served(sparse_kernel(mode, qhead_per_kv, paged, partial, form))


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


@dataclasses.dataclass
class Launch:
    """What both kernels of a sparse prefill call read and write (prepare_launch): the outputs,
    prefix sums the kernels can trust, the key lengths, the schedule and the partials."""
    out: torch.Tensor
    lse: torch.Tensor
    lse_t: torch.Tensor                # lse itself when no temperature LSE is asked
    want_lse_t: bool
    cu_q: Optional[torch.Tensor] = None
    cu_k: Optional[torch.Tensor] = None
    kv_lens: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    schedule: Optional[SparseAttentionSchedule] = None
    o_partial: Optional[torch.Tensor] = None
    lse_partial: Optional[torch.Tensor] = None
    lse_t_partial: Optional[torch.Tensor] = None

    def results(self, call):
        """(O, LSE or None, LSE_T or None) as sparse_atten_func returns them."""
        return (self.out, (self.lse if call.want_lse else None),
                (self.lse_t if self.want_lse_t else None))


def prepare_launch(call) -> Launch:
    """Allocate the outputs and, unless total_q is 0, everything the attention and combine
    kernels take (every native tier's sparse prefill shares this); no host synchronization."""
    q, k = call.q, call.k
    device = q.device
    total_q, num_heads, head_dim = q.shape
    check_launch_limits(call)
    want_lse_t = call.want_temperature_lse and not call.temperature_is_one
    out = torch.empty(total_q, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=device)
    lse_t = torch.empty_like(lse) if want_lse_t else lse
    launch = Launch(out=out, lse=lse, lse_t=lse_t, want_lse_t=want_lse_t)
    if total_q == 0:
        return launch

    # Prefix sums the kernels can trust (unchanged when valid; see the module docstring).
    launch.cu_q = device_prefix_sums(call.cu_seqlens_q, total_q)
    launch.cu_k = device_prefix_sums(call.cu_seqlens_k, INT32_MAX if call.paged else k.shape[0])
    schedule = call.schedule
    if schedule is None:
        schedule = build_schedule_on_device(call, launch.cu_q, launch.cu_k)
    launch.schedule = schedule
    batch = call.cu_seqlens_q.numel() - 1
    launch.kv_lens = key_lengths(batch, device, cu_seqlens_k=launch.cu_k,
                                 page_table=call.page_table if call.paged else None,
                                 seqused_k=call.seqused_k if call.paged else None)
    launch.page_table = (call.page_table.contiguous() if call.paged
                         else launch.kv_lens.view(batch, 1))    # unused by the dense variants
    # A schedule from build_k2q_csr numbers up to its own topK slots per (query, KV head).
    slots = max(call.topk, schedule.topk)
    launch.o_partial = torch.empty(slots, total_q, num_heads, head_dim,
                                   dtype=call.partial_dtype, device=device)
    launch.lse_partial = torch.empty(slots, total_q, num_heads, dtype=torch.float32,
                                     device=device)
    launch.lse_t_partial = (torch.empty_like(launch.lse_partial) if want_lse_t
                            else launch.lse_partial)
    if debug.poison():
        for buffer in (launch.o_partial, launch.lse_partial, launch.lse_t_partial, out, lse,
                       lse_t):
            buffer.fill_(float("nan"))
    return launch


def run(call, kernel: SparseKernel
        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Returns (O bf16 [total_q, Hq, 128], LSE fp32 [total_q, Hq] or None, LSE_T or None);
    every output is freshly allocated."""
    launch = prepare_launch(call)
    if call.q.shape[0] == 0:
        return launch.results(call)
    device = call.q.device
    schedule = launch.schedule
    debug.record("sparse_atten", kernel.attention)
    cute_runtime.launch(
        kernel.attention, device, call.q, call.k, call.v, launch.cu_q, launch.cu_k,
        launch.kv_lens, launch.page_table, schedule.k2q_row_ptr, schedule.qsplit_indices,
        schedule.scheduler_metadata, schedule.work_count, launch.o_partial, launch.lse_partial,
        launch.lse_t_partial, float(call.softmax_scale), 1.0 / float(call.lse_temperature_scale),
        int(call.causal), int(launch.want_lse_t))
    _stages.mark("combine")
    cute_runtime.launch(
        kernel.combine, device, launch.o_partial, launch.lse_partial, launch.lse_t_partial,
        schedule.split_counts, launch.out, launch.lse, launch.lse_t, int(launch.want_lse_t))
    return launch.results(call)


def build_schedule_on_device(call, cu_seqlens_q: Optional[torch.Tensor] = None,
                             cu_seqlens_k: Optional[torch.Tensor] = None
                             ) -> SparseAttentionSchedule:
    """A complete schedule for the call's k2q CSR, built with tensor ops on the CSR's device
    (no host synchronization; sizes come from the tensors' shapes, never from host hints).

    Work items are (row, head, chunk) ordered like the reference builder: each (KV head, CSR
    row) is cut into chunks of target_q_per_cta queries. Slots number a (query, KV head)'s
    entries in CSR row order. Entries whose query id is out of range for the request get -1
    and no slot; split_counts keeps the full entry count, so the combine can flag a (query,
    KV head) with more entries than slots. metadata rows past work_count are never read (the
    grid is the capacity and CTAs past work_count exit).

    Whatever the index values, every gather stays in bounds: cu_seqlens_q/k (default: the
    call's, made trustworthy with device_prefix_sums) and the row pointer are clamped monotone
    within their tensors; the schedule keeps that clamped row pointer for the kernel.
    """
    q_idx = call.k2q_q_indices
    device = q_idx.device
    hkv, n_entries = q_idx.shape
    total_q = call.q.shape[0]
    if cu_seqlens_q is None:
        cu_seqlens_q = device_prefix_sums(call.cu_seqlens_q, total_q)
    if cu_seqlens_k is None:
        cu_seqlens_k = device_prefix_sums(call.cu_seqlens_k, INT32_MAX)
    # A monotone row pointer within k2q_q_indices (the given one when it is valid).
    row_ptr = device_prefix_sums(call.k2q_row_ptr.t(), n_entries).t().contiguous()
    total_rows = row_ptr.shape[1] - 1
    topk = call.topk
    target = target_q_per_cta(total_q=total_q, topk=topk, blk_kv=KV_BLOCK, head_kv=hkv,
                              qhead_per_kv=call.qhead_per_kv, device=device,
                              usable_SM_count=call.usable_SM_count)
    capacity = schedule_capacity(total_rows=total_rows, total_q=total_q, topk=topk,
                                 head_kv=hkv, target_q_per_cta=target)
    i64 = torch.int64
    cu_q = cu_seqlens_q.to(i64)
    cu_k = cu_seqlens_k.to(i64)
    batch = cu_q.numel() - 1
    # The owner block of CSR row r is at most r, so total_rows block indices cover every row
    # whatever max_seqlen_k says (a short hint must not make rows look absent).
    max_blocks = max(total_rows, 1)

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
    split_counts = per_key.view(hkv, total_q).t().clamp_max(INT32_MAX)
    return SparseAttentionSchedule(
        enabled=True, scheduler_metadata=meta.to(torch.int32).contiguous(),
        work_count=work_count, qsplit_indices=qsplit.to(torch.int32).contiguous(),
        split_counts=split_counts.to(torch.int32).contiguous(), target_q_per_cta=target,
        k2q_row_ptr=row_ptr, batch=batch, topk=topk)


_backend.register_native("sparse_atten", "sm90", run, supports)
