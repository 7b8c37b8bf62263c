"""Public entry points of MSA block-sparse prefill: ``build_k2q_csr`` and ``sparse_atten_func``.

Each function validates its arguments on the host (contract error classes, the argument named
first), then hands one call object to the backend chosen by :mod:`msa._backend`: a native kernel
when one serves the call, otherwise the exact PyTorch reference.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from . import _backend
from ._validation import (check_page_table, FP8, HEAD_DIM, check_cu_seqlens, check_head_dim,
                          check_k2q_build_values, check_partial_dtype, check_positive_int,
                          check_qhead_per_kv, check_same_device, check_scale,
                          check_sparse_attention_values, check_tensor, check_topk,
                          value_checks_requested)
from .reference.sparse_attention import make_kv_source, sparse_attention_csr
from .schedules.csr_rows import safe_total_rows
from .schedules.sparse import SparseAttentionSchedule, prepare_sparse_fwd_schedule_and_split
from .sparse_index_utils import build_k2q_csr_torch_reference

BF16 = torch.bfloat16
KV_BLOCK = 128


# ---------------------------------------------------------------------------------------------
# build_k2q_csr
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class K2qCsrCall:
    q2k_indices: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    total_rows: int
    max_kv_blocks: int
    max_seqlen_q: Optional[int]
    qhead_per_kv: int
    return_schedule: bool
    usable_SM_count: int = -1
    total_k: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    check_values: bool = False       # check_input_valid / MSA_CHECK_INPUTS=1

    @property
    def topk(self) -> int:
        return self.q2k_indices.shape[2]


def build_k2q_csr(q2k_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, kv_block_size: int, *, total_k: Optional[int] = None,
                  max_seqlen_k: Optional[int] = None, max_seqlen_q: Optional[int] = None,
                  total_rows: Optional[int] = None, qhead_per_kv: int = 1,
                  return_schedule: bool = False, check_input_valid: bool = False):
    """Invert a q2k block selection into the k2q CSR that the KV-outer attention consumes.

    Args:
      q2k_indices: [Hkv, total_q, topK] int32, contiguous; batch-local block ids, -1 = empty
        slot (anywhere in a row), ids >= ceil(k_len_b/128) are dropped. topK in {4, 8, 16, 32}.
      cu_seqlens_q, cu_seqlens_k: [B+1] int32 prefix sums on the device of q2k_indices.
      kv_block_size: must be 128.
      total_k: required host int (k.shape[0] for dense KV, sum of KV lengths for paged).
      max_seqlen_k / max_seqlen_q: host upper bounds (required with return_schedule).
      total_rows: CSR rows to emit; default ceil((total_k + B*127)/128), a bound that is never
        short (extra rows stay empty). A total_rows (or total_k) below the truth drops the rows
        past it on the native path; only the value checks can see it (the true row count needs
        the lengths on the host; a static KV cache makes total_k no lower bound of it).
      qhead_per_kv: G, used to size schedule chunks.
      check_input_valid: also check the index values (one synchronization): cu_seqlens start
        at 0, rise and end at total_q (cu_seqlens_k at most total_k), every q2k id is -1 or a
        block of its request with no duplicate in a row, and max_seqlen_q / max_seqlen_k /
        total_rows are at least the truth (ValueError naming the argument).
        MSA_CHECK_INPUTS=1 turns it on for every call. The reference backend always checks all
        but the q2k ids (which it drops like the native builder, contract D4).

    Returns (k2q_row_ptr [Hkv, total_rows+1], k2q_q_indices [Hkv, total_q*topK]) int32, plus a
    :class:`SparseAttentionSchedule` when return_schedule. Rows are round-robin over requests
    (all block-0 rows, then all block-1 rows, ...); query ids ascend within a row. Only the first
    row_ptr[h, -1] entries of k2q_q_indices are meaningful. No device-to-host synchronization on
    the native path (unless check_input_valid). The host hints never lose work natively:
    max_seqlen_k only sizes a lookup table, max_seqlen_q only bounds the 2^24 query-id packing.
    """
    call = _check_k2q_csr_args(q2k_indices, cu_seqlens_q, cu_seqlens_k, kv_block_size,
                               total_k=total_k, max_seqlen_k=max_seqlen_k,
                               max_seqlen_q=max_seqlen_q, total_rows=total_rows,
                               qhead_per_kv=qhead_per_kv, return_schedule=return_schedule,
                               check_input_valid=check_input_valid)
    return run_build_k2q_csr(call)


def run_build_k2q_csr(call: K2qCsrCall):
    entry = _backend.compile_entry("build_k2q_csr")
    if entry is not None:
        return entry(call)
    _name, native = _backend.choose("build_k2q_csr", call.q2k_indices.device,
                                    return_schedule=call.return_schedule,
                                    total_q=call.q2k_indices.shape[1])
    if native is None or call.check_values:
        check_k2q_build_values(call, strict=call.check_values)
    if native is not None:
        return native(call)
    return _build_k2q_csr_reference(call)


def _check_k2q_csr_args(q2k_indices, cu_seqlens_q, cu_seqlens_k, kv_block_size, *, total_k,
                        max_seqlen_k, max_seqlen_q, total_rows, qhead_per_kv,
                        return_schedule, check_input_valid=False) -> K2qCsrCall:
    if total_k is None:
        raise ValueError("total_k: build_k2q_csr needs the host total KV token count "
                         "(k.shape[0] for dense KV)")
    check_positive_int("total_k", total_k)
    if kv_block_size != KV_BLOCK:
        raise ValueError(f"kv_block_size: only {KV_BLOCK} is supported, got {kv_block_size}")
    check_tensor("q2k_indices", q2k_indices, dtypes=(torch.int32,), ndim=3, contiguous=True)
    check_topk("q2k_indices.shape[2] (topK)", q2k_indices.shape[2])
    batch = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    check_same_device(q2k_indices=q2k_indices, cu_seqlens_q=cu_seqlens_q)
    check_positive_int("max_seqlen_k", max_seqlen_k, allow_none=True)
    check_positive_int("max_seqlen_q", max_seqlen_q, allow_none=True)
    check_positive_int("qhead_per_kv", qhead_per_kv, minimum=1)
    for name, hint in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if return_schedule and hint is None:
            raise ValueError(f"{name}: return_schedule=True needs max_seqlen_q and "
                             "max_seqlen_k")
    if total_rows is None:
        total_rows = safe_total_rows(total_k, batch, KV_BLOCK)
    check_positive_int("total_rows", total_rows)
    max_kv_blocks = -(-max(max_seqlen_k or total_k, KV_BLOCK) // KV_BLOCK)
    return K2qCsrCall(q2k_indices, cu_seqlens_q, cu_seqlens_k, int(total_rows), max_kv_blocks,
                      max_seqlen_q, qhead_per_kv, bool(return_schedule), total_k=int(total_k),
                      max_seqlen_k=max_seqlen_k,
                      check_values=value_checks_requested(check_input_valid))


def _drop_out_of_range(q2k: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """Runtime semantics: ids >= the request's block count behave like -1."""
    cu_q64, cu_k64 = cu_q.to("cpu", torch.int64), cu_k.to("cpu", torch.int64)
    q_lens = cu_q64[1:] - cu_q64[:-1]
    blocks = (cu_k64[1:] - cu_k64[:-1] + KV_BLOCK - 1) // KV_BLOCK
    limit = torch.repeat_interleave(blocks, q_lens).to(q2k.device).view(1, -1, 1)
    return torch.where(q2k < limit, q2k, torch.full_like(q2k, -1))


def _build_k2q_csr_reference(call: K2qCsrCall):
    q2k = _drop_out_of_range(call.q2k_indices, call.cu_seqlens_q, call.cu_seqlens_k)
    row_ptr, q_idx = build_k2q_csr_torch_reference(q2k, call.cu_seqlens_q, call.cu_seqlens_k,
                                                   KV_BLOCK, total_rows=call.total_rows)
    if not call.return_schedule:
        return row_ptr, q_idx
    hkv, total_q, topk = call.q2k_indices.shape
    schedule = prepare_sparse_fwd_schedule_and_split(
        k2q_row_ptr=row_ptr, k2q_q_indices=q_idx, k2q_qsplit_indices=torch.empty_like(q_idx),
        split_counts=torch.zeros(total_q, hkv, dtype=torch.int32, device=q_idx.device),
        cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k, total_q=total_q,
        max_seqlen_q=call.max_seqlen_q, topk=topk, head_kv=hkv, qhead_per_kv=call.qhead_per_kv,
        blk_kv=KV_BLOCK, device=q_idx.device, enabled=True,
        usable_SM_count=call.usable_SM_count)
    return row_ptr, q_idx, schedule


class SparseK2qCsrBuilderSm100:
    """Callable form of :func:`build_k2q_csr` (the upstream name; it runs on any hardware).

    ``builder(q2k [Hkv, total_q, topK] int32, cu_seqlens_q [B+1], cu_seqlens_k [B+1], *,
    total_k, blk_kv=128, ...)`` returns (k2q_row_ptr [Hkv, rows+1], k2q_q_indices
    [Hkv, total_q*topK]) and, with return_schedule, the schedule; see build_k2q_csr."""

    def __call__(self, q2k_indices, cu_seqlens_q, cu_seqlens_k, *, total_k, blk_kv=128,
                 max_seqlen_k=None, max_seqlen_q=None, total_rows=None, qhead_per_kv=1,
                 return_schedule=False, check_input_valid=False):
        return build_k2q_csr(q2k_indices, cu_seqlens_q, cu_seqlens_k, blk_kv, total_k=total_k,
                             max_seqlen_k=max_seqlen_k, max_seqlen_q=max_seqlen_q,
                             total_rows=total_rows, qhead_per_kv=qhead_per_kv,
                             return_schedule=return_schedule,
                             check_input_valid=check_input_valid)


# ---------------------------------------------------------------------------------------------
# sparse_atten_func
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SparseAttentionCall:
    """One validated sparse attention call, as every backend receives it."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k2q_row_ptr: torch.Tensor
    k2q_q_indices: torch.Tensor
    topk: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float
    lse_temperature_scale: float
    want_lse: bool
    want_temperature_lse: bool
    partial_dtype: torch.dtype
    page_table: Optional[torch.Tensor]
    seqused_k: Optional[torch.Tensor]
    schedule: Optional[SparseAttentionSchedule]
    usable_SM_count: int
    pv_dtype: torch.dtype
    # NVFP4 K/V only: dequantized on the fly; V's global scale is applied in the combine.
    k_dequant: Optional[object] = None
    v_dequant: Optional[object] = None
    v_global_scale: Optional[torch.Tensor] = None
    k_scale_128x4: Optional[torch.Tensor] = None
    v_scale_128x4: Optional[torch.Tensor] = None
    k_global_scale: Optional[torch.Tensor] = None
    check_values: bool = False       # check_input_valid / MSA_CHECK_INPUTS=1
    # A plan's call (msa.prefill): cu_seqlens_q / cu_seqlens_k are prefix sums it made, valid by
    # construction, which the native glue takes as they are.
    planned_lengths: bool = False

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    @property
    def qhead_per_kv(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def temperature_is_one(self) -> bool:
        return abs(self.lse_temperature_scale - 1.0) <= 1e-12

    def features(self) -> dict:
        return dict(q_dtype=self.q.dtype, k_dtype=self.k.dtype, v_dtype=self.v.dtype,
                    pv_dtype=self.pv_dtype, paged=self.paged, causal=self.causal,
                    qhead_per_kv=self.qhead_per_kv, topk=self.topk,
                    partial_dtype=self.partial_dtype, nvfp4=self.k_dequant is not None,
                    total_q=int(self.q.shape[0]))


def sparse_atten_func(q, k, v, k2q_row_ptr, k2q_q_indices, topK, *, cu_seqlens_q, cu_seqlens_k,
                      max_seqlen_q, max_seqlen_k, blk_kv=128, causal=False, softmax_scale=None,
                      lse_temperature_scale=1.0, return_temperature_lse=False,
                      partial_dtype=torch.bfloat16, return_softmax_lse=False, page_table=None,
                      seqused_k=None, schedule=None, usable_SM_count=-1, qk_dtype=None,
                      pv_dtype=None, check_input_valid=False):
    """Block-sparse varlen attention over the KV blocks each query selected (contract §1.2).

    Shapes: q [total_q, Hq, 128]; k, v dense [total_k, Hkv, 128] or paged
    [pages, Hkv, 128, 128] with page_table [B, max_pages] int32 (and optional seqused_k [B]
    int32, paged only); Hq / Hkv in {1, 2, 4, 8, 16}. The selection is the k2q CSR from
    :func:`build_k2q_csr` (k2q_row_ptr [Hkv, rows+1], k2q_q_indices [Hkv, >= total_q*topK]);
    topK in {4, 8, 16, 32}.

    Key j of request b is visible to its query i through KV head h when block j//128 is selected
    by (i, h), j < k_len_b, and, if causal, j <= i + k_len_b - q_len_b (bottom-right).
    s_j = softmax_scale * q.k_j (default 128**-0.5); O = softmax(s).V; LSE = ln sum exp(s_j);
    LSE_T = ln sum exp(s_j / lse_temperature_scale). Rows that see no key give O = 0 and
    LSE = -inf. Each selected block's partial output is rounded to partial_dtype before the
    log-sum-exp combine. Non-finite data is never hidden, on every backend: a NaN or +inf score
    (NaN / Inf in q or k) makes that row's O and LSE NaN (LSE may be +inf), and a NaN / Inf V
    element the row gives weight makes its O channel non-finite; only a row that sees no key
    gives O = 0, LSE = -inf. A score of -inf (an infinite key element against a query element
    of the other sign) counts as that key being masked, as IEEE exp(-inf) = 0 says. Rows that
    select a block but cannot see its non-finite V key may or may not turn NaN (0 * NaN).

    Dtypes: all bf16, all float8_e4m3fn, or bf16 q with e4m3 k/v. qk_dtype must equal q's dtype;
    pv_dtype defaults to v's dtype and may be bf16 with e4m3 v. No FP8 scale factors are applied.

    Returns O [total_q, Hq, 128] bf16; with return_softmax_lse (O, LSE [total_q, Hq] fp32);
    with return_temperature_lse as well (O, LSE, LSE_T), where LSE_T is LSE itself when the
    temperature is 1. Launches on q's device and current stream, without host synchronization.

    Index values (seen only by reading the tensors): check_input_valid=True (or
    MSA_CHECK_INPUTS=1) checks them once, with one synchronization, and raises ValueError naming
    the argument: prefix sums that start at 0, rise and end at q.shape[0] (dense: within k),
    seqused_k within the page table, in-range page ids for every page holding keys, the
    max_seqlen hints at least the truth, a CSR with a row per (request, block), ascending
    in-range query ids and at most topK rows per (query, KV head), and a schedule built for
    this k2q_row_ptr. The reference backend always checks all but the CSR's query ids (skipped
    when out of range, as natively). Unchecked native calls never read or write out of bounds
    and do not depend on max_seqlen_q / max_seqlen_k; for invalid values their output is
    unspecified, except that a (query, KV head) in more CSR rows than combine slots comes back
    NaN rather than silently short.
    """
    call = check_sparse_atten_args(
        q, k, v, k2q_row_ptr, k2q_q_indices, topK, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        blk_kv=blk_kv, causal=causal, softmax_scale=softmax_scale,
        lse_temperature_scale=lse_temperature_scale,
        return_temperature_lse=return_temperature_lse, partial_dtype=partial_dtype,
        return_softmax_lse=return_softmax_lse, page_table=page_table, seqused_k=seqused_k,
        schedule=schedule, usable_SM_count=usable_SM_count, qk_dtype=qk_dtype, pv_dtype=pv_dtype,
        kv_dtypes=(BF16, FP8), kv_last_dim=HEAD_DIM, check_input_valid=check_input_valid)
    return run_sparse_attention(call)


def planned_sparse_atten(q, k, v, k2q_row_ptr, k2q_q_indices, topK, *,
                         lse_temperature_scale=1.0, return_temperature_lse=False,
                         usable_SM_count=-1, qk_dtype=None, pv_dtype=None, **kwargs):
    """sparse_atten_func (the same arguments, checks and result) on a plan's own prefix sums
    (msa.prefill: valid by construction), which the native glue takes as they are instead of
    clamping them on the device (six small launches a call)."""
    call = check_sparse_atten_args(
        q, k, v, k2q_row_ptr, k2q_q_indices, topK, lse_temperature_scale=lse_temperature_scale,
        return_temperature_lse=return_temperature_lse, usable_SM_count=usable_SM_count,
        qk_dtype=qk_dtype, pv_dtype=pv_dtype, kv_dtypes=(BF16, FP8), kv_last_dim=HEAD_DIM,
        check_input_valid=False, **kwargs)
    call.planned_lengths = True
    return run_sparse_attention(call)


def run_sparse_attention(call: SparseAttentionCall):
    """Dispatch a validated call and shape the result as the contract says."""
    entry = _backend.compile_entry("sparse_atten") if call.k_dequant is None else None
    out, lse, lse_t = entry(call) if entry is not None else sparse_attention_outputs(call)
    if not call.want_lse:
        return out
    if not call.want_temperature_lse:
        return out, lse
    return out, lse, (lse if call.temperature_is_one else lse_t)


def sparse_attention_outputs(call: SparseAttentionCall):
    """(O bf16, LSE, LSE_T) of a validated call on the backend _backend chooses (the LSEs
    may be None when the call does not want them)."""
    _name, native = _backend.choose("sparse_atten", call.q.device, **call.features())
    if native is None or call.check_values:
        check_sparse_attention_values(call, strict=call.check_values)
    if native is not None:
        return native(call)
    out, lse, lse_t = sparse_attention_reference(call)
    return out.to(BF16), lse.float(), lse_t.float()


def sparse_attention_reference(call: SparseAttentionCall, compute_dtype=torch.float32):
    """The reference backend: (O, LSE, LSE_T) in compute_dtype (the caller rounds O to bf16)."""
    k = call.k if call.k_dequant is None else call.k_dequant(call.k)
    v = call.v if call.v_dequant is None else call.v_dequant(call.v)
    kv = make_kv_source(k, v, call.cu_seqlens_k, call.page_table, call.seqused_k)
    pv_quant = FP8 if call.pv_dtype == FP8 else None
    out, lse, lse_t = sparse_attention_csr(
        call.q, kv, call.k2q_row_ptr, call.k2q_q_indices, cu_seqlens_q=call.cu_seqlens_q,
        causal=call.causal, softmax_scale=call.softmax_scale, partial_dtype=call.partial_dtype,
        pv_quant_dtype=pv_quant, lse_temperature_scale=call.lse_temperature_scale,
        compute_dtype=compute_dtype)
    if call.v_global_scale is not None:
        out = out * call.v_global_scale.reshape(-1)[0].to(out.dtype)
    return out, lse, lse_t


def check_attention_operands(q, k, v, *, kv_dtypes=(BF16, FP8), kv_last_dim=HEAD_DIM) -> int:
    """q [total_q, Hq, 128] and k / v (dense [total_k, Hkv, last] or paged [pages, Hkv, 128,
    last]) as sparse_atten_func takes them: dtypes, ranks, contiguity, head counts. Returns
    Hq / Hkv."""
    check_tensor("q", q, dtypes=(BF16, FP8), ndim=3, contiguous=True)
    check_head_dim("q", q.shape[2])
    check_tensor("k", k, dtypes=kv_dtypes, ndim=(3, 4), contiguous=True)
    check_tensor("v", v, dtypes=kv_dtypes, ndim=(3, 4), contiguous=True)
    if v.dtype != k.dtype:
        raise TypeError(f"v: dtype {v.dtype} differs from k's {k.dtype}")
    if q.dtype == FP8 and k.dtype == BF16:
        raise TypeError("k: bf16 K/V needs a bf16 q; e4m3 q needs e4m3 K/V")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {list(v.shape)} differs from k's {list(k.shape)}")
    if k.shape[-1] != kv_last_dim:
        if kv_last_dim == HEAD_DIM:
            check_head_dim("k", k.shape[-1])
        raise ValueError(f"k: last dimension must be {kv_last_dim} (packed), got {k.shape[-1]}")
    return check_qhead_per_kv(q.shape[1], k.shape[1])


def check_sparse_atten_args(q, k, v, k2q_row_ptr, k2q_q_indices, topK, *, cu_seqlens_q,
                            cu_seqlens_k, max_seqlen_q, max_seqlen_k, blk_kv, causal,
                            softmax_scale, lse_temperature_scale, return_temperature_lse,
                            partial_dtype, return_softmax_lse, page_table, seqused_k, schedule,
                            usable_SM_count, qk_dtype, pv_dtype, kv_dtypes, kv_last_dim,
                            check_input_valid=False) -> SparseAttentionCall:
    """Shared by the bf16/FP8 and the NVFP4 entry points (which pass their own K/V dtypes and
    packed last dimension)."""
    check_attention_operands(q, k, v, kv_dtypes=kv_dtypes, kv_last_dim=kv_last_dim)
    hkv = k.shape[1]
    if blk_kv != KV_BLOCK:
        raise ValueError(f"blk_kv: only {KV_BLOCK} is supported, got {blk_kv}")
    topk = check_topk("topK", topK)
    batch = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    check_tensor("k2q_row_ptr", k2q_row_ptr, dtypes=(torch.int32,), ndim=2, contiguous=True)
    check_tensor("k2q_q_indices", k2q_q_indices, dtypes=(torch.int32,), ndim=2, contiguous=True)
    if k2q_row_ptr.shape[0] != hkv or k2q_row_ptr.shape[1] < 1:
        raise ValueError(f"k2q_row_ptr: expected shape [{hkv}, rows+1] (Hkv rows), got "
                         f"{list(k2q_row_ptr.shape)}")
    if k2q_q_indices.shape[0] != hkv or k2q_q_indices.shape[1] < q.shape[0] * topk:
        raise ValueError(f"k2q_q_indices: expected shape [{hkv}, >= total_q*topK = "
                         f"{q.shape[0] * topk}], got {list(k2q_q_indices.shape)}")
    if k.dim() == 4:
        if page_table is None:
            raise ValueError("page_table: paged k/v [pages, Hkv, page, D] need a page_table")
        if k.shape[2] != blk_kv:
            raise ValueError(f"k: page size {k.shape[2]} must equal blk_kv {blk_kv}")
        check_page_table(page_table, batch, seqused_k=seqused_k)
    else:
        if page_table is not None:
            raise ValueError("page_table: given with dense k of shape [total_k, Hkv, D]; paged "
                             "k/v must be [pages, Hkv, page, D]")
        if seqused_k is not None:
            raise ValueError("seqused_k: allowed only with paged k/v (page_table)")
    check_same_device(q=q, k=k, v=v, k2q_row_ptr=k2q_row_ptr, k2q_q_indices=k2q_q_indices,
                      cu_seqlens_q=cu_seqlens_q, page_table=page_table, seqused_k=seqused_k)
    check_positive_int("max_seqlen_q", max_seqlen_q)
    check_positive_int("max_seqlen_k", max_seqlen_k)
    check_positive_int("usable_SM_count", usable_SM_count, minimum=-1)
    check_partial_dtype(partial_dtype)
    scale = check_scale("softmax_scale", softmax_scale)
    temperature = check_scale("lse_temperature_scale", lse_temperature_scale, allow_none=False)
    if return_temperature_lse and not return_softmax_lse:
        raise ValueError("return_temperature_lse: requires return_softmax_lse=True")
    if qk_dtype is not None and qk_dtype != q.dtype:
        raise TypeError(f"qk_dtype: must equal q's dtype {q.dtype}, got {qk_dtype}")
    # bf16 q stages e4m3 (and NVFP4) K/V to bf16, so its P.V runs in bf16 (contract §1.2).
    v_compute = v.dtype if (q.dtype == FP8 and v.dtype == FP8) else BF16
    if pv_dtype is None:
        pv_dtype = v_compute
    elif pv_dtype not in (v_compute, BF16):
        raise TypeError(f"pv_dtype: {pv_dtype} is not supported with v of dtype {v.dtype}")
    if schedule is not None:
        _check_schedule_matches(schedule, q, k2q_row_ptr, k2q_q_indices, batch)
    return SparseAttentionCall(
        q=q, k=k, v=v, k2q_row_ptr=k2q_row_ptr, k2q_q_indices=k2q_q_indices, topk=topk,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k), causal=bool(causal),
        softmax_scale=scale if scale is not None else 1.0 / math.sqrt(HEAD_DIM),
        lse_temperature_scale=temperature, want_lse=bool(return_softmax_lse),
        want_temperature_lse=bool(return_temperature_lse), partial_dtype=partial_dtype,
        page_table=page_table, seqused_k=seqused_k, schedule=schedule,
        usable_SM_count=int(usable_SM_count), pv_dtype=pv_dtype,
        check_values=value_checks_requested(check_input_valid))


def _check_schedule_matches(schedule, q, k2q_row_ptr, k2q_q_indices, batch: int) -> None:
    """A schedule must come from a builder (it records what it was built for) and match the
    call's shapes; its own row pointer is what the kernels read (see SparseAttentionSchedule),
    and the value checks compare it with k2q_row_ptr."""
    if not isinstance(schedule, SparseAttentionSchedule) or not schedule.complete:
        raise ValueError("schedule: incomplete; build it with build_k2q_csr(..., "
                         "return_schedule=True) or pass None")
    if not schedule.built_by_a_builder:
        raise ValueError("schedule: was not made by build_k2q_csr(..., return_schedule=True) "
                         "(it does not record the CSR it was built for); pass None")
    if schedule.qsplit_indices.shape != k2q_q_indices.shape:
        raise ValueError("schedule: qsplit_indices does not match k2q_q_indices")
    if schedule.k2q_row_ptr.shape != k2q_row_ptr.shape:
        raise ValueError(f"schedule: was built for k2q_row_ptr of shape "
                         f"{list(schedule.k2q_row_ptr.shape)}, got {list(k2q_row_ptr.shape)}")
    if tuple(schedule.split_counts.shape) != (q.shape[0], k2q_row_ptr.shape[0]):
        raise ValueError(f"schedule: was built for {schedule.split_counts.shape[0]} queries, "
                         f"q has {q.shape[0]}")
    if schedule.batch != batch:
        raise ValueError(f"schedule: was built for {schedule.batch} requests, cu_seqlens_q "
                         f"has {batch}")
    check_same_device(q=q, schedule=schedule.scheduler_metadata)
