"""Native SM90 sparse prefill: the CuTe-DSL KV-outer attention kernels plus their combine.

``supports`` picks the attention form of a call from cute_kernels.variants.SPARSE_FORMS (the
serving table: the TMA warp-specialized forms, persistent wsp3w / wsp3we or ws3w / ws, for
G 8 / 16 with bf16 or all-e4m3 q/k/v and 16-bit or e4m3 partials, the wgmma kernel for the
other 16-bit / e4m3-partial calls, the warp-MMA kernel for fp32 partials) and ``run(call,
kernel)`` launches two kernels on q's device and current stream, with no host synchronization:

1. attention: one CTA per schedule work item (the persistent forms: a CTA an SM, taking work
   items from a queue) writes the per-block partials
   O_partial [topK, total_q, Hq, 128] (partial_dtype) and LSE_partial [topK, total_q, Hq] (plus
   LSE_T_partial when a temperature LSE is requested);
2. combine (cute_kernels/combine.py): log-sum-exp merge into O bf16 [total_q, Hq, 128] and
   LSE fp32 [total_q, Hq].

When the call carries no schedule it is built on the device with tensor ops
(:func:`msa.schedules.sparse.build_schedule_on_device`), so the path stays capture-safe.

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
from ..schedules.sparse import INT32_MAX, SparseAttentionSchedule, build_schedule_on_device
from . import cute_runtime, debug, serving

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


def refusal(where: str, mode: Optional[str], *, q_dtype=None, k_dtype=None, v_dtype=None,
            pv_dtype=None, partial_dtype=None, qhead_per_kv=None, nvfp4=False) -> Optional[str]:
    """Why no sparse attention kernel `where` ("on sm90", "in the portable tier": both tiers
    build the same dtype modes, partials and groups) serves these features, or None. `mode` is
    attention_mode() of the dtypes."""
    if nvfp4:
        return f"NVFP4 K/V is not native {where}"
    if mode is None:
        return (f"q/k/v dtypes {q_dtype}/{k_dtype}/{v_dtype} with pv_dtype {pv_dtype}: not "
                f"native {where}")
    if partial_dtype not in _PARTIALS:
        return f"partial_dtype {partial_dtype} is not native {where}"
    if mode != "bfloat16" and partial_dtype == torch.float32:
        return ("partial_dtype torch.float32: FP8 modes are native with bfloat16, float16 "
                "and e4m3 partials")
    if qhead_per_kv not in variants.QHEAD_PER_KV:
        return f"qhead_per_kv {qhead_per_kv} is not native"
    return None


@dataclasses.dataclass(frozen=True)
class SparseKernel:
    """The kernels supports() picked for a call, as run() launches them."""
    form: str                  # a name of cute_kernels.variants.SPARSE_FORMS
    attention: str             # the attention artifact
    combine: str               # the combine artifact (by partial dtype)
    trailing_args: Tuple[str, ...]     # variants.TRAILING_ARGS of the attention's kernel
    persistent: bool           # its CTAs fetch work items from a zeroed counter


@functools.lru_cache(maxsize=None)
def sparse_kernel(mode: str, qhead_per_kv: int, paged: bool, partial: str,
                  form: str) -> SparseKernel:
    """The SparseKernel of `form` for a dtype mode, head group, layout and partial dtype."""
    return SparseKernel(
        form=form,
        attention=variants.AttentionVariant(qhead_per_kv, paged, partial, mode, form).name,
        combine=variants.CombineVariant(partial).name,
        trailing_args=variants.SPARSE_FORMS[form].trailing_args,
        persistent=bool(variants.SPARSE_FORMS[form].options.get("persistent")))


def call_features(total_q: Optional[int]) -> dict:
    """The run-time features the sparse serving table reads (variants.SPARSE_CALLS):
    call_size "few" (at most FEW_CALL_QUERIES queries) or "many"."""
    few = total_q is not None and total_q <= variants.FEW_CALL_QUERIES
    return dict(call_size="few" if few else "many")


def supports(*, q_dtype=None, k_dtype=None, v_dtype=None, pv_dtype=None, paged=False,
             causal=False, qhead_per_kv=None, topk=None, partial_dtype=None, nvfp4=False,
             total_q=None, **_ignored) -> _backend.Verdict:
    """The kernels serving a call with these features (_backend.Served), else the reason none
    can. debug hook: sparse_form (a form to run wherever it is built)."""
    mode = attention_mode(q_dtype, k_dtype, v_dtype, pv_dtype)
    why = refusal("on sm90", mode, q_dtype=q_dtype, k_dtype=k_dtype, v_dtype=v_dtype,
                  pv_dtype=pv_dtype, partial_dtype=partial_dtype, qhead_per_kv=qhead_per_kv,
                  nvfp4=nvfp4)
    if why is not None:
        return why
    partial, paged = _PARTIALS[partial_dtype], bool(paged)
    form = serving.pick("sparse", mode,
                        lambda f: (sparse_kernel(mode, qhead_per_kv, paged, partial,
                                                 f.name).attention,
                                   variants.CombineVariant(partial).name),
                        group=qhead_per_kv, partial=partial, forced=debug.forced("sparse_form"),
                        **call_features(total_q))
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

    # Prefix sums the kernels can trust (unchanged when valid; see the module docstring); a
    # plan's own are valid by construction.
    if call.planned_lengths:
        launch.cu_q, launch.cu_k = call.cu_seqlens_q, call.cu_seqlens_k
    else:
        launch.cu_q = device_prefix_sums(call.cu_seqlens_q, total_q)
        launch.cu_k = device_prefix_sums(call.cu_seqlens_k,
                                         INT32_MAX if call.paged else k.shape[0])
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
    args = [call.q, call.k, call.v, launch.cu_q, launch.cu_k, launch.kv_lens, launch.page_table,
            schedule.k2q_row_ptr, schedule.qsplit_indices, schedule.scheduler_metadata,
            schedule.work_count, launch.o_partial, launch.lse_partial, launch.lse_t_partial,
            float(call.softmax_scale), 1.0 / float(call.lse_temperature_scale),
            int(call.causal), int(launch.want_lse_t)]
    # Only the persistent forms read the item counter: the others get an unread placeholder
    # instead of a zeroed tensor (a memset launch fewer).
    args += cute_runtime.trailing_args(
        kernel.trailing_args, device,
        item_counter=None if kernel.persistent else schedule.work_count)
    cute_runtime.launch(kernel.attention, device, *args)
    _stages.mark("combine")
    cute_runtime.launch(
        kernel.combine, device, launch.o_partial, launch.lse_partial, launch.lse_t_partial,
        schedule.split_counts, launch.out, launch.lse, launch.lse_t, int(launch.want_lse_t))
    return launch.results(call)


_backend.register_native("sparse_atten", "sm90", run, supports)
