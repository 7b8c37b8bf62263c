"""The shared bad-input table: every public function, fed bad arguments and bad data.

Each :class:`Case` builds one call on a given device and states the outcome the contract
promises, whatever backend serves it:

* :class:`Error` - a host-visible mistake (dtype, shape, device, a host int): the contract's error
  class, the message starting with the argument's name, before any launch, on every backend.
* :class:`Invalid` - an index value only a device read can see (malformed prefix sums, page ids
  out of the pool, a host hint shorter than the truth, ...): the reference backend (which reads
  those values anyway) and every call with check_input_valid / MSA_CHECK_INPUTS=1 raise it; an
  unchecked native call returns without touching memory outside its buffers (its values are
  then unspecified) and the process keeps working.
* :class:`Skip` - a documented runtime skip (contract §0 / D4: q2k ids past the request's blocks
  are dropped, CSR query ids past the request are skipped): unchecked, every backend gives the
  same output; with the value checks it is a ValueError naming the argument.
* :class:`Same` - a valid edge case (empty requests, -1 slots anywhere, hints larger than the
  truth, junk page-table entries past a request's pages, ...): the same output on every backend.
* :class:`NonFinite` - NaN / Inf data: the rows that meet it come back non-finite (never the
  empty row's O = 0, LSE = -inf), the rows that do not are exactly the clean call's.

tests/test_bad_inputs.py runs the table on the CPU (reference backend, unchecked and checked);
tests/test_bad_inputs_gpu.py runs it on an SM90 GPU with the native backends asserted;
tools/sanitize_cases.py replays its malformed-metadata cases under compute-sanitizer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import msa
from msa.sparse_index_utils import build_k2q_csr_torch_reference
from msa_testing import cu_seqlens, to_paged

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
D = 128
BLOCK = 128
NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------------------
# Outcomes
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Error:
    cls: type
    arg: str


@dataclasses.dataclass(frozen=True)
class Invalid:
    arg: str
    cls: type = ValueError
    # The unchecked reference may meet the bad value in a tensor the call derives from the
    # argument (the sparse bridge turns kv_indices into a page_table) and name that one.
    reference_arg: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Skip:
    arg: str


@dataclasses.dataclass(frozen=True)
class Same:
    pass


@dataclasses.dataclass(frozen=True)
class NonFinite:
    lse_too: bool = True     # False for bad V data: LSE does not read V


@dataclasses.dataclass
class Made:
    """One built call. ``affected`` / ``unaffected`` ([T, Hq] bool, for NonFinite): rows whose
    O (and LSE) must be non-finite, and rows that must equal the clean call's exactly;
    ``channels`` limits the affected check to some O channels (bad V data)."""
    call: Callable[[], Any]
    inputs: Sequence[torch.Tensor] = ()
    clean: Optional[Callable[[], Any]] = None
    affected: Optional[torch.Tensor] = None
    unaffected: Optional[torch.Tensor] = None
    channels: Optional[Sequence[int]] = None


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    fn: str                                   # the public name ("module.name" in a module)
    ops: Tuple[str, ...]                      # native ops it reaches ((): reference only)
    make: Callable[[torch.device, torch.Generator], Made]
    expect: Any
    gpu_only: bool = False                    # needs two devices (a CUDA tensor)


def outputs_of(result) -> List[torch.Tensor]:
    """The tensors of a result (nested tuples, schedules, quantized tensors), in order."""
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in outputs_of(r)]
    if isinstance(result, msa.interface.SparseAttentionSchedule):
        return [result.work_count, result.split_counts, result.qsplit_indices]
    if isinstance(result, msa.Nvfp4QuantizedTensor):
        return [result.data, result.scale_128x4, result.global_scale]
    if isinstance(result, msa.DecodeIndexerPlan):
        return [result.work, result.requests, result.chunk_pages]
    if isinstance(result, (msa.SparseDecodePagedAttentionWrapper, msa.MsaPrefillPagedWrapper,
                           msa.MSADecodeStepWrapper)):
        return []
    raise TypeError(f"unexpected result type {type(result).__name__}")


# ---------------------------------------------------------------------------------------------
# Base problems (small, ragged, random; CSR built by the torch reference on the host)
# ---------------------------------------------------------------------------------------------

def _randn(shape, gen, dtype=BF16):
    return torch.randn(*shape, generator=gen).to(dtype)


def _selection(q_lens, k_lens, hkv, topk, gen, causal=True) -> torch.Tensor:
    """q2k [Hkv, T, topK]: per (query, head) distinct causally visible blocks at random slots,
    -1 elsewhere (the query's own block always selected)."""
    total_q = sum(q_lens)
    q2k = torch.full((hkv, total_q, topk), -1, dtype=torch.int32)
    row = 0
    for ql, kl in zip(q_lens, k_lens):
        nblk = -(-kl // BLOCK)
        for i in range(ql):
            last = min(nblk - 1, (i + kl - ql) // BLOCK) if causal else nblk - 1
            if last < 0:
                continue
            for h in range(hkv):
                others = torch.randperm(last, generator=gen)[: topk - 1] if last else \
                    torch.empty(0, dtype=torch.int64)
                ids = torch.cat([torch.tensor([last]), others]).to(torch.int32)
                slots = torch.randperm(topk, generator=gen)[: ids.numel()]
                q2k[h, row + i, slots] = ids
        row += ql
    return q2k


@dataclasses.dataclass
class Sparse:
    """A valid sparse_atten_func call (dense or paged K/V) plus what the table mutates."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q2k: torch.Tensor
    row_ptr: torch.Tensor
    q_idx: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    q_lens: List[int]
    k_lens: List[int]
    topk: int
    causal: bool
    page_table: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    k_dense: Optional[torch.Tensor] = None
    v_dense: Optional[torch.Tensor] = None

    def kwargs(self, **change) -> Dict[str, Any]:
        kw = dict(cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                  max_seqlen_q=max(self.q_lens), max_seqlen_k=max(self.k_lens),
                  causal=self.causal, return_softmax_lse=True)
        if self.page_table is not None:
            kw.update(page_table=self.page_table, seqused_k=self.seqused_k)
        kw.update(change)
        return kw

    def call(self, **change):
        args = dict(q=self.q, k=self.k, v=self.v, k2q_row_ptr=self.row_ptr,
                    k2q_q_indices=self.q_idx, topK=self.topk)
        kw = self.kwargs()
        for name, value in change.items():
            (args if name in args else kw)[name] = value
        return lambda: msa.sparse_atten_func(**args, **kw)

    def tensors(self):
        return [t for t in (self.q, self.k, self.v, self.row_ptr, self.q_idx, self.cu_q,
                            self.cu_k, self.page_table, self.seqused_k) if t is not None]


def sparse_problem(device, gen, *, paged=False, causal=True, dtype=BF16, hkv=2, group=4,
                   topk=4, q_lens=(100, 60), k_lens=(300, 200), csr_topk=None,
                   total_rows=None) -> Sparse:
    q_lens, k_lens = list(q_lens), list(k_lens)
    q2k = _selection(q_lens, k_lens, hkv, csr_topk or topk, gen, causal)
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    row_ptr, q_idx = build_k2q_csr_torch_reference(q2k, cu_q, cu_k, BLOCK, total_rows=total_rows)
    q = _randn((sum(q_lens), hkv * group, D), gen)
    k = _randn((sum(k_lens), hkv, D), gen)
    v = _randn((sum(k_lens), hkv, D), gen)
    p = Sparse(q=q, k=k, v=v, q2k=q2k, row_ptr=row_ptr, q_idx=q_idx, cu_q=cu_q, cu_k=cu_k,
               q_lens=q_lens, k_lens=k_lens, topk=topk, causal=causal, k_dense=k, v_dense=v)
    if paged:
        p.k, p.v, p.page_table, p.seqused_k = to_paged(k, v, k_lens, extra_pages=2,
                                                       generator=gen)
        _junk_past_the_keys(p.page_table, k_lens, gen)
    if dtype != BF16:
        p.q, p.k, p.v = p.q.to(dtype), p.k.to(dtype), p.v.to(dtype)
    return to_device(p, device)


def _junk_past_the_keys(table: torch.Tensor, k_lens, gen) -> None:
    """Page-table entries past a request's pages get random junk: the contract says they are
    never read."""
    for b, n in enumerate(k_lens):
        pages = -(-n // BLOCK)
        table[b, pages:] = torch.randint(-(1 << 20), 1 << 20, (table.shape[1] - pages,),
                                         generator=gen, dtype=torch.int32)


def _scattered_ints(shape, low: int, high: int) -> torch.Tensor:
    """int32 values spread over [low, high) in a fixed scattered order. Cases whose outputs are
    compared between two calls (native against reference) build their edits from the case's
    generator or from this, never from the global RNG, so both calls see the same inputs."""
    n = 1
    for d in shape:
        n *= d
    span = high - low
    values = (torch.arange(n, dtype=torch.int64) * 7919) % span + low
    return values.to(torch.int32).reshape(shape)


def to_device(obj, device):
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, torch.Tensor):
            setattr(obj, field.name, value.to(device))
    return obj


# ---------------------------------------------------------------------------------------------
# Visibility oracle (float64, from the contract's §0 rule) for the NonFinite cases
# ---------------------------------------------------------------------------------------------

def scores_f64(p: Sparse, q=None, k=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s [T, Hq, Kmax] float64 with -inf where not visible, visible [T, Hq, Kmax] bool,
    selected [T, Hq, Kmax] bool: the key's block is selected and the key exists) in request-local
    key positions, computed from dense K (p.k_dense, or `k`)."""
    q = (p.q if q is None else q).cpu().double()
    k = (p.k_dense if k is None else k).cpu().double()
    total_q, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kmax = max(p.k_lens)
    s = torch.full((total_q, hq, kmax), -INF, dtype=torch.float64)
    visible = torch.zeros(total_q, hq, kmax, dtype=torch.bool)
    selected = torch.zeros_like(visible)
    q2k = p.q2k.cpu().long()
    q0 = k0 = 0
    for ql, kl in zip(p.q_lens, p.k_lens):
        if ql and kl:
            nblk = -(-kl // BLOCK)
            ids = q2k[:, q0:q0 + ql]                                        # [Hkv, ql, topK]
            hit = torch.zeros(hkv, ql, nblk + 1, dtype=torch.bool)
            hit.scatter_(2, torch.where((ids >= 0) & (ids < nblk), ids, nblk), True)
            j = torch.arange(kl)
            sel = hit[:, :, j // BLOCK].permute(1, 0, 2).repeat_interleave(g, 1)  # [ql, Hq, kl]
            vis = sel
            if p.causal:
                vis = sel & (j.view(1, -1) <= torch.arange(ql).view(-1, 1) + kl - ql).unsqueeze(1)
            kb = k[k0:k0 + kl].repeat_interleave(g, 1)                       # [kl, Hq, D]
            dots = torch.einsum("qhd,khd->qhk", q[q0:q0 + ql], kb)
            selected[q0:q0 + ql, :, :kl] = sel
            visible[q0:q0 + ql, :, :kl] = vis
            s[q0:q0 + ql, :, :kl] = torch.where(vis, dots, torch.tensor(-INF, dtype=torch.float64))
        q0 += ql
        k0 += kl
    return s, visible, selected


def key_position(p: Sparse, b: int, j: int) -> int:
    """Dense token row of key j of request b."""
    return sum(p.k_lens[:b]) + j


def poison_dense_and_paged(p: Sparse, which: str, b: int, j: int, head: int, channel: int,
                           value: float) -> None:
    """Write `value` into K or V element (request b, key j, KV head, channel), in the dense copy
    and (paged) in the page that holds it."""
    row = key_position(p, b, j)
    dense = p.k_dense if which == "k" else p.v_dense
    dense = dense.clone()
    dense[row, head, channel] = value
    if which == "k":
        p.k_dense = dense
    else:
        p.v_dense = dense
    if p.page_table is None:
        setattr(p, which, dense.to(getattr(p, which).dtype))
        return
    pages = getattr(p, which).clone()
    page = int(p.page_table[b, j // BLOCK])
    pages[page, head, j % BLOCK, channel] = value
    setattr(p, which, pages)


# ---------------------------------------------------------------------------------------------
# build_k2q_csr / SparseK2qCsrBuilderSm100
# ---------------------------------------------------------------------------------------------

CASES: List[Case] = []


def _add(case_id, fn, ops, make, expect, gpu_only=False):
    CASES.append(Case(case_id, fn, tuple(ops), make, expect, gpu_only))


def _csr_problem(device, gen, q_lens=(100, 60), k_lens=(300, 200), hkv=2, topk=4):
    q2k = _selection(list(q_lens), list(k_lens), hkv, topk, gen)
    return dict(q2k=q2k.to(device), cu_q=cu_seqlens(q_lens, device),
                cu_k=cu_seqlens(k_lens, device), total_k=sum(k_lens),
                max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))


def _csr_make(change: Callable[[dict], None], schedule: bool, via_class: bool = False, **problem):
    def make(device, gen):
        p = _csr_problem(device, gen, **problem)
        p.update(kv_block_size=128, qhead_per_kv=4, return_schedule=schedule)
        change(p)
        args = (p.pop("q2k"), p.pop("cu_q"), p.pop("cu_k"))
        block = p.pop("kv_block_size")
        if via_class:
            builder = msa.SparseK2qCsrBuilderSm100()
            call = lambda: builder(*args, blk_kv=block, **p)     # noqa: E731
        else:
            call = lambda: msa.build_k2q_csr(*args, block, **p)  # noqa: E731
        return Made(call, [a for a in args if isinstance(a, torch.Tensor)])
    return make


def _set(**values):
    return lambda p: p.update(values)


def _tensor_edit(name, edit):
    def change(p):
        t = p[name].clone()
        edit(t)
        p[name] = t
    return change


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


_CSR_HOST_ERRORS = [
    ("total_k missing", _set(total_k=None), ValueError, "total_k"),
    ("total_k negative", _set(total_k=-1), ValueError, "total_k"),
    ("total_k float", _set(total_k=500.0), TypeError, "total_k"),
    ("block size 64", _set(kv_block_size=64), ValueError, "kv_block_size"),
    ("q2k int64", lambda p: p.update(q2k=p["q2k"].long()), TypeError, "q2k_indices"),
    ("q2k float", lambda p: p.update(q2k=p["q2k"].float()), TypeError, "q2k_indices"),
    ("q2k rank 2", lambda p: p.update(q2k=p["q2k"][0]), ValueError, "q2k_indices"),
    ("q2k not contiguous", lambda p: p.update(q2k=p["q2k"].transpose(0, 1).contiguous()
                                              .transpose(0, 1)), ValueError, "q2k_indices"),
    ("topK 3", lambda p: p.update(q2k=p["q2k"][..., :3].contiguous()), ValueError,
     "q2k_indices"),
    ("topK 64", lambda p: p.update(q2k=p["q2k"].repeat(1, 1, 16)), ValueError, "q2k_indices"),
    ("q2k list", lambda p: p.update(q2k=p["q2k"].tolist()), TypeError, "q2k_indices"),
    ("cu_seqlens_q int64", lambda p: p.update(cu_q=p["cu_q"].long()), TypeError,
     "cu_seqlens_q"),
    ("cu_seqlens_q float", lambda p: p.update(cu_q=p["cu_q"].float()), TypeError,
     "cu_seqlens_q"),
    ("cu_seqlens_q rank 2", lambda p: p.update(cu_q=p["cu_q"].view(1, -1)), ValueError,
     "cu_seqlens_q"),
    ("cu_seqlens_q one entry", lambda p: p.update(cu_q=p["cu_q"][:1]), ValueError,
     "cu_seqlens_q"),
    ("cu_seqlens_k shape", lambda p: p.update(cu_k=torch.cat([p["cu_k"], p["cu_k"][-1:]])),
     ValueError, "cu_seqlens_k"),
    ("cu_seqlens_k not contiguous", lambda p: p.update(cu_k=torch.stack([p["cu_k"]] * 2, 1)[:, 0]),
     ValueError, "cu_seqlens_k"),
    ("schedule without max_seqlen_q", lambda p: p.update(return_schedule=True, max_seqlen_q=None),
     ValueError, "max_seqlen_q"),
    ("schedule without max_seqlen_k", lambda p: p.update(return_schedule=True, max_seqlen_k=None),
     ValueError, "max_seqlen_k"),
    ("total_rows negative", _set(total_rows=-1), ValueError, "total_rows"),
    ("qhead_per_kv 0", _set(qhead_per_kv=0), ValueError, "qhead_per_kv"),
    ("qhead_per_kv bool", _set(qhead_per_kv=True), TypeError, "qhead_per_kv"),
    ("max_seqlen_q negative", _set(max_seqlen_q=-5), ValueError, "max_seqlen_q"),
    ("max_seqlen_k float", _set(max_seqlen_k=300.0), TypeError, "max_seqlen_k"),
    ("max_seqlen_q past 2^24", lambda p: p.update(return_schedule=True, max_seqlen_q=1 << 24),
     ValueError, "max_seqlen_q"),
    ("check_input_valid string", _set(check_input_valid="yes"), TypeError, "check_input_valid"),
]
for _name, _change, _cls, _arg in _CSR_HOST_ERRORS:
    _add(f"build_k2q_csr: {_name}", "build_k2q_csr", ["build_k2q_csr"],
         _csr_make(_change, False), Error(_cls, _arg))
for _name, _change, _cls, _arg in _CSR_HOST_ERRORS[:6]:
    _add(f"SparseK2qCsrBuilderSm100: {_name}", "SparseK2qCsrBuilderSm100", ["build_k2q_csr"],
         _csr_make(_change, False, via_class=True), Error(_cls, _arg))

_CSR_VALUES = [
    # Invalid: values only a device read sees.
    ("cu_seqlens_q starts at 5", lambda p: p.update(cu_q=_i32([5, 100, 160], p["q2k"].device)),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q negative start", lambda p: p.update(cu_q=_i32([-9, 100, 160],
                                                                 p["q2k"].device)),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q ends past total_q", lambda p: p.update(cu_q=_i32([0, 100, 170],
                                                                    p["q2k"].device)),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q ends short", lambda p: p.update(cu_q=_i32([0, 100, 150], p["q2k"].device)),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q decreasing", lambda p: p.update(cu_q=_i32([0, 170, 160], p["q2k"].device)),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q huge", lambda p: p.update(cu_q=_i32([0, 1 << 30, 160], p["q2k"].device)),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_k starts at 7", lambda p: p.update(cu_k=_i32([7, 300, 500], p["q2k"].device)),
     Invalid("cu_seqlens_k")),
    ("cu_seqlens_k decreasing", lambda p: p.update(cu_k=_i32([0, 600, 500], p["q2k"].device)),
     Invalid("cu_seqlens_k")),
    ("cu_seqlens_k past total_k", lambda p: p.update(cu_k=_i32([0, 300, 700],
                                                               p["q2k"].device)),
     Invalid("total_k")),
    ("total_k short", _set(total_k=400), Invalid("total_k")),
    ("total_rows below total_k blocks", _set(total_rows=3), Invalid("total_rows")),
    ("max_seqlen_q short", _set(max_seqlen_q=10), Invalid("max_seqlen_q")),
    ("max_seqlen_k short", _set(max_seqlen_k=100), Invalid("max_seqlen_k")),
    # Skip: ids outside the request are dropped (contract D4); duplicates are the caller's
    # promise (D2). The value checks reject both.
    ("q2k id past the request", _tensor_edit("q2k", lambda t: t[0, 3].__setitem__(0, 3)),
     Skip("q2k_indices")),
    ("q2k id 2^30", _tensor_edit("q2k", lambda t: t[1, 150].__setitem__(1, 1 << 30)),
     Skip("q2k_indices")),
    ("q2k id -2", _tensor_edit("q2k", lambda t: t[0, 7].__setitem__(2, -2)),
     Skip("q2k_indices")),
    ("q2k id INT32_MIN", _tensor_edit("q2k", lambda t: t[1, 0].__setitem__(3, -(1 << 31))),
     Skip("q2k_indices")),
    ("q2k duplicate ids", _tensor_edit("q2k", lambda t: t[0, 99].copy_(
        torch.tensor([0, 0, -1, -1], dtype=torch.int32))), Skip("q2k_indices")),
    # Same: valid edge cases.
    ("all slots -1", _tensor_edit("q2k", lambda t: t.fill_(-1)), Same()),
    ("hints larger than the truth", _set(max_seqlen_q=1 << 20, max_seqlen_k=1 << 22,
                                         total_rows=64), Same()),
]
for _schedule in (False, True):
    _tag = " (schedule)" if _schedule else ""
    for _name, _change, _expect in _CSR_VALUES:
        _add(f"build_k2q_csr: {_name}{_tag}", "build_k2q_csr", ["build_k2q_csr"],
             _csr_make(_change, _schedule), _expect)
    for _name, q_lens, k_lens in (("empty request", (100, 0, 60), (300, 50, 200)),
                                  ("request without keys", (100, 60), (300, 0)),
                                  ("empty workload", (0,), (500,)),
                                  ("ragged 5 requests", (1, 129, 0, 300, 7),
                                   (1, 1000, 128, 300, 5))):
        _add(f"build_k2q_csr: {_name}{_tag}", "build_k2q_csr", ["build_k2q_csr"],
             _csr_make(lambda p: None, _schedule, q_lens=q_lens, k_lens=k_lens), Same())
    _add(f"build_k2q_csr: rows past total_rows{_tag}", "build_k2q_csr", ["build_k2q_csr"],
         _csr_make(_set(total_rows=3, total_k=384), _schedule, q_lens=(50, 50),
                   k_lens=(192, 192)), Invalid("total_rows"))


# ---------------------------------------------------------------------------------------------
# sparse_atten_func
# ---------------------------------------------------------------------------------------------

ATTN = "sparse_atten_func"


def _attn_make(change=None, **problem):
    """change(p) -> argument overrides for the call (may also edit p first)."""
    def make(device, gen):
        p = sparse_problem(device, gen, **problem)
        overrides = change(p) if change is not None else {}
        return Made(p.call(**overrides), p.tensors())
    return make


def _paged_k(p, page=64):
    return dict(k=p.k[:, :, :page].contiguous(), v=p.v[:, :, :page].contiguous())


_ATTN_HOST_ERRORS = [
    ("q fp16", lambda p: dict(q=p.q.half()), TypeError, "q"),
    ("q fp32", lambda p: dict(q=p.q.float()), TypeError, "q"),
    ("q not a tensor", lambda p: dict(q=[1, 2]), TypeError, "q"),
    ("q rank 2", lambda p: dict(q=p.q[:, 0]), ValueError, "q"),
    ("q head dim 64", lambda p: dict(q=p.q[..., :64].contiguous()), NotImplementedError, "q"),
    ("q not contiguous", lambda p: dict(q=p.q.transpose(0, 1).contiguous().transpose(0, 1)),
     ValueError, "q"),
    ("k fp16", lambda p: dict(k=p.k.half(), v=p.v.half()), TypeError, "k"),
    ("v dtype differs", lambda p: dict(v=p.v.to(E4M3)), TypeError, "v"),
    ("fp8 q with bf16 kv", lambda p: dict(q=p.q.to(E4M3)), TypeError, "k"),
    ("k head dim 64", lambda p: dict(k=p.k[..., :64].contiguous(), v=p.v[..., :64].contiguous()),
     NotImplementedError, "k"),
    ("v shape differs", lambda p: dict(v=p.v[:400].contiguous()), ValueError, "v"),
    ("k rank 5", lambda p: dict(k=p.k[None, None], v=p.v[None, None]), ValueError, "k"),
    ("G = 3", lambda p: dict(q=torch.cat([p.q, p.q[:, :4]], 1)), NotImplementedError, "q"),
    ("G = 32", lambda p: dict(q=p.q.repeat(1, 8, 1)), NotImplementedError, "q"),
    ("Hq not a multiple", lambda p: dict(q=p.q[:, :5].contiguous()), ValueError, "q"),
    ("topK 12", lambda p: dict(topK=12), ValueError, "topK"),
    ("topK float", lambda p: dict(topK=4.0), TypeError, "topK"),
    ("topK larger than the CSR width", lambda p: dict(topK=8), ValueError, "k2q_q_indices"),
    ("k2q_q_indices int64", lambda p: dict(k2q_q_indices=p.q_idx.long()), TypeError,
     "k2q_q_indices"),
    ("k2q_q_indices rank 1", lambda p: dict(k2q_q_indices=p.q_idx.reshape(-1)), ValueError,
     "k2q_q_indices"),
    ("k2q_row_ptr wrong heads", lambda p: dict(k2q_row_ptr=p.row_ptr[:1].contiguous()),
     ValueError, "k2q_row_ptr"),
    ("k2q_row_ptr float", lambda p: dict(k2q_row_ptr=p.row_ptr.float()), TypeError,
     "k2q_row_ptr"),
    ("cu_seqlens_q int64", lambda p: dict(cu_seqlens_q=p.cu_q.long()), TypeError,
     "cu_seqlens_q"),
    ("cu_seqlens length mismatch", lambda p: dict(cu_seqlens_k=torch.cat([p.cu_k, p.cu_k[-1:]])),
     ValueError, "cu_seqlens_k"),
    ("cu_seqlens_q rank 2", lambda p: dict(cu_seqlens_q=p.cu_q.view(1, -1)), ValueError,
     "cu_seqlens_q"),
    ("blk_kv 64", lambda p: dict(blk_kv=64), ValueError, "blk_kv"),
    ("partial fp64", lambda p: dict(partial_dtype=torch.float64), TypeError, "partial_dtype"),
    ("partial not a dtype", lambda p: dict(partial_dtype="bf16"), TypeError, "partial_dtype"),
    ("temperature lse alone", lambda p: dict(return_softmax_lse=False,
                                             return_temperature_lse=True), ValueError,
     "return_temperature_lse"),
    ("temperature 0", lambda p: dict(lse_temperature_scale=0.0), ValueError,
     "lse_temperature_scale"),
    ("temperature inf", lambda p: dict(lse_temperature_scale=INF), ValueError,
     "lse_temperature_scale"),
    ("temperature nan", lambda p: dict(lse_temperature_scale=NAN), ValueError,
     "lse_temperature_scale"),
    ("softmax_scale negative", lambda p: dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("softmax_scale nan", lambda p: dict(softmax_scale=NAN), ValueError, "softmax_scale"),
    ("softmax_scale tensor", lambda p: dict(softmax_scale=torch.tensor(0.1)), TypeError,
     "softmax_scale"),
    ("qk_dtype mismatch", lambda p: dict(qk_dtype=E4M3), TypeError, "qk_dtype"),
    ("pv_dtype fp16", lambda p: dict(pv_dtype=torch.float16), TypeError, "pv_dtype"),
    ("seqused_k with dense k", lambda p: dict(seqused_k=_i32([1, 2], p.q.device)), ValueError,
     "seqused_k"),
    ("page_table with dense k", lambda p: dict(page_table=_i32([[0, 1], [2, 3]], p.q.device)),
     ValueError, "page_table"),
    ("max_seqlen_q negative", lambda p: dict(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    ("max_seqlen_k None", lambda p: dict(max_seqlen_k=None), TypeError, "max_seqlen_k"),
    ("usable_SM_count -2", lambda p: dict(usable_SM_count=-2), ValueError, "usable_SM_count"),
    ("incomplete schedule", lambda p: dict(
        schedule=msa.interface.SparseAttentionSchedule(True, None, None)), ValueError,
     "schedule"),
    ("hand-made schedule", lambda p: dict(schedule=msa.interface.SparseAttentionSchedule(
        True, torch.zeros(4, 6, dtype=torch.int32, device=p.q.device),
        torch.ones(1, dtype=torch.int32, device=p.q.device), p.q_idx.clone(),
        torch.zeros(p.q.shape[0], 2, dtype=torch.int32, device=p.q.device), 64)), ValueError,
     "schedule"),
    ("check_input_valid int", lambda p: dict(check_input_valid=1), TypeError,
     "check_input_valid"),
]
_PAGED_HOST_ERRORS = [
    ("paged without page_table", lambda p: dict(page_table=None), ValueError, "page_table"),
    ("page size 64", _paged_k, ValueError, "k"),
    ("page_table int64", lambda p: dict(page_table=p.page_table.long()), TypeError,
     "page_table"),
    ("page_table wrong batch", lambda p: dict(page_table=p.page_table[:1]), ValueError,
     "page_table"),
    ("page_table rank 1", lambda p: dict(page_table=p.page_table[0]), ValueError, "page_table"),
    ("seqused_k wrong length", lambda p: dict(seqused_k=p.seqused_k[:1]), ValueError,
     "seqused_k"),
    ("seqused_k int64", lambda p: dict(seqused_k=p.seqused_k.long()), TypeError, "seqused_k"),
]
for _name, _change, _cls, _arg in _ATTN_HOST_ERRORS:
    _add(f"{ATTN}: {_name}", ATTN, ["sparse_atten"], _attn_make(_change), Error(_cls, _arg))
for _name, _change, _cls, _arg in _PAGED_HOST_ERRORS:
    _add(f"{ATTN}: {_name}", ATTN, ["sparse_atten"], _attn_make(_change, paged=True),
         Error(_cls, _arg))


def _with_schedule(p, q2k=None, **build):
    """The CSR + schedule of p's selection (or of `q2k`), built by the public builder."""
    q2k = p.q2k.to(p.q.device) if q2k is None else q2k
    return msa.build_k2q_csr(q2k, p.cu_q, p.cu_k, 128, total_k=sum(p.k_lens),
                             max_seqlen_k=max(p.k_lens), max_seqlen_q=max(p.q_lens),
                             qhead_per_kv=p.q.shape[1] // p.k.shape[1], return_schedule=True,
                             **build)


def _schedule_mismatch(field):
    def change(p):
        row_ptr, q_idx, schedule = _with_schedule(p)
        if field == "total_q":
            return dict(q=p.q[:-1].contiguous(), schedule=schedule,
                        cu_seqlens_q=_i32([0, 100, 159], p.q.device),
                        k2q_q_indices=q_idx, k2q_row_ptr=row_ptr)
        if field == "rows":
            return dict(k2q_row_ptr=torch.cat([row_ptr, row_ptr[:, -1:]], 1), schedule=schedule,
                        k2q_q_indices=q_idx)
        return dict(schedule=schedule, k2q_row_ptr=row_ptr,
                    k2q_q_indices=torch.cat([q_idx, torch.full_like(q_idx, -1)], 1))
    return change


for _field, _arg in (("total_q", "schedule"), ("rows", "schedule"), ("width", "schedule")):
    _add(f"{ATTN}: schedule built for other {_field}", ATTN, ["build_k2q_csr", "sparse_atten"],
         _attn_make(_schedule_mismatch(_field)), Error(ValueError, _arg))


def _cu(name, values):
    return lambda p: {name: _i32(values, p.q.device)}


def _edit(field, edit):
    """Overrides with a clone of p.<field> edited in place (on the device)."""
    def change(p):
        t = getattr(p, field).clone()
        edit(t)
        arg = {"row_ptr": "k2q_row_ptr", "q_idx": "k2q_q_indices", "page_table": "page_table",
               "seqused_k": "seqused_k"}[field]
        return {arg: t}
    return change


def _other_csr_schedule(p):
    """A schedule built for another (valid) selection with the same CSR shapes."""
    other = p.q2k.clone()
    other[:, ::2] = -1                       # every other query selects nothing
    _, _, schedule = _with_schedule(p, q2k=other.to(p.q.device))
    return dict(schedule=schedule)


_ATTN_VALUES = [
    ("cu_seqlens_q starts at 5", _cu("cu_seqlens_q", [5, 100, 160]), Invalid("cu_seqlens_q")),
    ("cu_seqlens_q negative start", _cu("cu_seqlens_q", [-40, 100, 160]),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q ends past q", _cu("cu_seqlens_q", [0, 100, 170]), Invalid("cu_seqlens_q")),
    ("cu_seqlens_q shifted past q", _cu("cu_seqlens_q", [0, 110, 170]), Invalid("cu_seqlens_q")),
    ("cu_seqlens_q shifted by 5", _cu("cu_seqlens_q", [5, 105, 165]), Invalid("cu_seqlens_q")),
    ("cu_seqlens_q ends far past q", _cu("cu_seqlens_q", [0, 100, 1 << 30]),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q ends short", _cu("cu_seqlens_q", [0, 100, 150]), Invalid("cu_seqlens_q")),
    ("cu_seqlens_q decreasing", _cu("cu_seqlens_q", [0, 170, 160]), Invalid("cu_seqlens_q")),
    ("cu_seqlens_k starts at 7", _cu("cu_seqlens_k", [7, 300, 500]), Invalid("cu_seqlens_k")),
    ("cu_seqlens_k negative start", _cu("cu_seqlens_k", [-300, 300, 500]),
     Invalid("cu_seqlens_k")),
    ("cu_seqlens_k ends past k", _cu("cu_seqlens_k", [0, 300, 600]), Invalid("cu_seqlens_k")),
    ("cu_seqlens_k ends short", _cu("cu_seqlens_k", [0, 300, 400]), Invalid("cu_seqlens_k")),
    ("cu_seqlens_k decreasing", _cu("cu_seqlens_k", [0, 600, 500]), Invalid("cu_seqlens_k")),
    ("max_seqlen_q short", lambda p: dict(max_seqlen_q=10), Invalid("max_seqlen_q")),
    ("max_seqlen_k short", lambda p: dict(max_seqlen_k=100), Invalid("max_seqlen_k")),
    ("k2q_row_ptr start 5", _edit("row_ptr", lambda t: t[:, 0].fill_(5)), Invalid("k2q_row_ptr")),
    ("k2q_row_ptr decreasing", _edit("row_ptr", lambda t: t[0, 2].fill_(0)),
     Invalid("k2q_row_ptr")),
    ("k2q_row_ptr past the entries", _edit("row_ptr", lambda t: t[1, 3:].fill_(1 << 30)),
     Invalid("k2q_row_ptr")),
    ("k2q_row_ptr negative", _edit("row_ptr", lambda t: t[0, 1:].fill_(-(1 << 20))),
     Invalid("k2q_row_ptr")),
    ("k2q_row_ptr garbage", _edit("row_ptr", lambda t: t.copy_(_scattered_ints(t.shape, -999,
                                                                                 999))),
     Invalid("k2q_row_ptr")),
    ("k2q_row_ptr fewer rows than k's blocks", lambda p: dict(
        k2q_row_ptr=p.row_ptr[:, :3].contiguous()), Invalid("k2q_row_ptr")),
    ("schedule of another CSR", _other_csr_schedule, Invalid("schedule")),
    ("k2q_q_indices past the request", _edit("q_idx", lambda t: t[0, 0].fill_(1000)),
     Skip("k2q_q_indices")),
    ("k2q_q_indices negative", _edit("q_idx", lambda t: t[1, 3].fill_(-7)),
     Skip("k2q_q_indices")),
    ("k2q_q_indices INT32_MAX", _edit("q_idx", lambda t: t[0, 5].fill_((1 << 31) - 1)),
     Skip("k2q_q_indices")),
    ("k2q_q_indices unordered row", _edit("q_idx", lambda t: t[0, :2].copy_(t[0, :2].flip(0))),
     Skip("k2q_q_indices")),
    ("k2q_q_indices duplicate in a row", _edit("q_idx", lambda t: t[0, 1].copy_(t[0, 0])),
     Skip("k2q_q_indices")),
    ("valid", lambda p: {}, Same()),
    ("all slots -1", lambda p: dict(k2q_row_ptr=torch.zeros_like(p.row_ptr)), Same()),
    ("hints larger than the truth", lambda p: dict(max_seqlen_q=1 << 20, max_seqlen_k=1 << 22),
     Same()),
    ("wide k2q_q_indices buffer", lambda p: dict(k2q_q_indices=torch.cat(
        [p.q_idx, torch.full_like(p.q_idx, -1)], 1)), Same()),
    ("extra empty CSR rows", lambda p: dict(k2q_row_ptr=torch.cat(
        [p.row_ptr, p.row_ptr[:, -1:].expand(-1, 5)], 1).contiguous()), Same()),
    ("schedule from build_k2q_csr", lambda p: dict(zip(("k2q_row_ptr", "k2q_q_indices",
                                                        "schedule"), _with_schedule(p))),
     Same()),
    ("temperature LSE", lambda p: dict(lse_temperature_scale=2.0, return_temperature_lse=True),
     Same()),
    ("softmax_scale 1e-3", lambda p: dict(softmax_scale=1e-3), Same()),
    ("usable_SM_count 3", lambda p: dict(usable_SM_count=3), Same()),
]
for _paged in (False, True):
    _tag = " (paged)" if _paged else ""
    for _name, _change, _expect in _ATTN_VALUES:
        _ops = ["sparse_atten"] + (["build_k2q_csr"] if "schedule" in _name else [])
        if _name == "cu_seqlens_k ends short" or (_paged and _name == "cu_seqlens_k ends "
                                                                   "past k"):
            # K rows past the requests are allowed (a static cache), and paged K has no token
            # total: such a cu_seqlens_k only disagrees with the CSR's rows.
            _expect = Invalid("k2q_row_ptr")
        _add(f"{ATTN}: {_name}{_tag}", ATTN, _ops, _attn_make(_change, paged=_paged), _expect)

_PAGED_VALUES = [
    ("page id past the pool", _edit("page_table", lambda t: t[0, 1].fill_(1 << 24)),
     Invalid("page_table")),
    ("page id negative", _edit("page_table", lambda t: t[1, 0].fill_(-3)), Invalid("page_table")),
    ("seqused_k negative", _edit("seqused_k", lambda t: t[0].fill_(-5)), Invalid("seqused_k")),
    ("seqused_k past the page table", _edit("seqused_k", lambda t: t[1].fill_(1 << 20)),
     Invalid("seqused_k")),
    ("seqused_k INT32_MIN", _edit("seqused_k", lambda t: t[0].fill_(-(1 << 31))),
     Invalid("seqused_k")),
    ("seqused_k past max_seqlen_k", _edit("seqused_k", lambda t: t[1].fill_(380)),
     Invalid("max_seqlen_k")),
    ("seqused_k 0", _edit("seqused_k", lambda t: t[0].fill_(0)), Same()),
    ("seqused_k shorter than the CSR", _edit("seqused_k", lambda t: t.fill_(129)), Same()),
    ("page table entries past the keys", _edit("page_table", lambda t: t[:, -1].fill_(-(1 << 30))),
     Same()),
    ("no seqused_k (table width)", lambda p: dict(
        seqused_k=None, max_seqlen_k=1 << 12,
        page_table=torch.where((p.page_table >= 0) & (p.page_table < p.k.shape[0]),
                               p.page_table, torch.zeros_like(p.page_table))), Same()),
]
for _name, _change, _expect in _PAGED_VALUES:
    _add(f"{ATTN}: {_name} (paged)", ATTN, ["sparse_atten"], _attn_make(_change, paged=True),
         _expect)

_EDGE_PROBLEMS = [
    ("empty request", dict(q_lens=(100, 0, 60), k_lens=(300, 50, 200))),
    ("request without keys", dict(q_lens=(100, 60), k_lens=(300, 0))),
    ("early queries see nothing (causal)", dict(q_lens=(100, 60), k_lens=(50, 200))),
    ("non-causal", dict(causal=False)),
    ("G = 1", dict(group=1, hkv=4)),
    ("G = 16", dict(group=16, hkv=1)),
    ("one query", dict(q_lens=(1,), k_lens=(1000,))),
    ("topK 32", dict(topk=32, k_lens=(1200, 200))),
]
for _name, _problem in _EDGE_PROBLEMS:
    for _paged in (False, True):
        if _paged and "without keys" in _name:
            continue
        _add(f"{ATTN}: {_name}{' (paged)' if _paged else ''}", ATTN, ["sparse_atten"],
             _attn_make(None, paged=_paged, **_problem), Same())
for _dtype, _pv in ((E4M3, None), (E4M3, BF16)):
    for _partial in (BF16, torch.float16, E4M3):
        _add(f"{ATTN}: e4m3 pv {_pv} partial {_partial}", ATTN, ["sparse_atten"],
             _attn_make(lambda p, pv=_pv, pd=_partial: dict(pv_dtype=pv, partial_dtype=pd),
                        dtype=_dtype), Same())
_add(f"{ATTN}: bf16 q e4m3 kv", ATTN, ["sparse_atten"],
     _attn_make(lambda p: dict(k=p.k.to(E4M3), v=p.v.to(E4M3))), Same())
_add(f"{ATTN}: topK smaller than the CSR", ATTN, ["sparse_atten"],
     _attn_make(None, topk=4, csr_topk=8, k_lens=(1200, 700)), Invalid("topK"))
_add(f"{ATTN}: topK smaller than the CSR (schedule)", ATTN, ["build_k2q_csr", "sparse_atten"],
     _attn_make(lambda p: dict(zip(("k2q_row_ptr", "k2q_q_indices", "schedule"),
                                   _with_schedule(p))), topk=4, csr_topk=8, k_lens=(1200, 700)),
     Invalid("topK"))
_add(f"{ATTN}: static cache larger than the keys", ATTN, ["sparse_atten"],
     _attn_make(lambda p: dict(k=torch.cat([p.k] * 4), v=torch.cat([p.v] * 4))), Same())
_add(f"{ATTN}: CSR rows dropped at build", ATTN, ["sparse_atten"],
     _attn_make(None, q_lens=(50, 50), k_lens=(192, 192), total_rows=3), Invalid("k2q_row_ptr"))


def _bad_scores(s: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[T, Hq] rows whose visible scores hold a NaN or +inf (the IEEE rule: -inf = masked)."""
    return ((torch.isnan(s) | (s == INF)) & visible).any(-1)


def _nonfinite_make(which, value, *, b=0, j=150, row=30, head=1, channel=5, partial=BF16,
                    **problem):
    """NaN / Inf written into one element of q (query `row`, q head `head`) or of K / V (key j
    of request b, KV head `head`); affected / unaffected rows from the float64 oracle."""
    def make(device, gen):
        p = sparse_problem(device, gen, **problem)
        clean = p.call(partial_dtype=partial)
        total_q, hq = p.q.shape[:2]
        g = hq // p.k.shape[1]
        affected = torch.zeros(total_q, hq, dtype=torch.bool)
        unaffected = torch.ones_like(affected)
        channels = None
        if which == "q":
            q = p.q.clone()
            q[row, head, channel] = value
            s, visible, _ = scores_f64(p, q=q)
            affected[row, head] = bool(_bad_scores(s, visible)[row, head])
            unaffected[row, head] = False
            p.q = q
        else:
            poison_dense_and_paged(p, which, b, j, head, channel, value)
            s, visible, selected = scores_f64(p)
            rows = slice(sum(p.q_lens[:b]), sum(p.q_lens[:b + 1]))
            group = slice(head * g, (head + 1) * g)
            if which == "k":
                affected[rows, group] = _bad_scores(s, visible)[rows, group]
                unaffected[rows, group] = ~visible[rows, group, j]
            else:
                affected[rows, group] = visible[rows, group, j]
                unaffected[rows, group] = ~selected[rows, group, j]
                channels = [channel]
        return Made(p.call(partial_dtype=partial), p.tensors(), clean=clean, affected=affected,
                    unaffected=unaffected, channels=channels)
    return make


for _paged in (False, True):
    _tag = " (paged)" if _paged else ""
    for _which, _value in (("q", NAN), ("q", INF), ("q", -INF), ("k", NAN), ("k", INF),
                           ("k", -INF), ("v", NAN), ("v", INF)):
        _add(f"{ATTN}: {_value} in {_which}{_tag}", ATTN, ["sparse_atten"],
             _nonfinite_make(_which, _value, paged=_paged), NonFinite(lse_too=_which != "v"))
for _which in ("q", "k", "v"):
    _add(f"{ATTN}: nan in {_which} (e4m3)", ATTN, ["sparse_atten"],
         _nonfinite_make(_which, NAN, dtype=E4M3), NonFinite(lse_too=_which != "v"))
for _partial in (torch.float32, torch.float16, E4M3):
    _add(f"{ATTN}: nan in k (partial {_partial})", ATTN, ["sparse_atten"],
         _nonfinite_make("k", NAN, partial=_partial), NonFinite())
_add(f"{ATTN}: nan in k (G = 16)", ATTN, ["sparse_atten"],
     _nonfinite_make("k", NAN, head=0, hkv=1, group=16), NonFinite())
_add(f"{ATTN}: nan in q (non-causal)", ATTN, ["sparse_atten"],
     _nonfinite_make("q", NAN, causal=False), NonFinite())


# ---------------------------------------------------------------------------------------------
# sparse_atten_nvfp4_kv_func (reference only on sm90)
# ---------------------------------------------------------------------------------------------

NVFP4 = "sparse_atten_nvfp4_kv_func"


def _nvfp4_make(change=None, expect_nonfinite=None, **problem):
    problem.setdefault("k_lens", (304, 200))        # K rows (tokens x Hkv) a multiple of 16
    def make(device, gen):
        p = sparse_problem(device, gen, **problem)
        kq, vq = msa.quantize_kv_bf16_to_nvfp4_128x4(p.k, p.v)
        args = dict(q=p.q, k=kq.data, v=vq.data, k_scale_128x4=kq.scale_128x4,
                    v_scale_128x4=vq.scale_128x4, k_global_scale=kq.global_scale,
                    v_global_scale=vq.global_scale, k2q_row_ptr=p.row_ptr,
                    k2q_q_indices=p.q_idx, topK=p.topk)
        kw = p.kwargs()
        clean = (lambda a=dict(args), k=dict(kw): msa.sparse_atten_nvfp4_kv_func(**a, **k))
        made = Made(None, p.tensors() + [kq.data, vq.data, kq.scale_128x4, vq.scale_128x4])
        for name, value in (change(p, args) if change is not None else {}).items():
            (args if name in args else kw)[name] = value
        if expect_nonfinite is not None:
            made.clean = clean
            made.affected, made.unaffected = expect_nonfinite(p)
        made.call = lambda: msa.sparse_atten_nvfp4_kv_func(**args, **kw)
        return made
    return make


def _scale_nan(name, row):
    """The E4M3 NaN byte for block 0 of logical scale row `row` (128x4 tiled offset)."""
    def change(p, args):
        t = args[name].clone()
        t.view(-1)[(row % 32) * 16 + ((row % 128) // 32) * 4 + (row // 128) * 512 * 2] = 0x7F
        return {name: t}
    return change


def _nvfp4_k_nan_rows(p):
    """Token 5 of request 0, KV head 0 (scale row 5 * Hkv + 0) is NaN in K: every row that sees
    it is NaN; rows that do not see it are the clean call's."""
    _, visible, _ = scores_f64(p)
    g = p.q.shape[1] // p.k.shape[1]
    affected = torch.zeros(p.q.shape[:2], dtype=torch.bool)
    unaffected = torch.ones_like(affected)
    rows = slice(0, p.q_lens[0])
    affected[rows, :g] = visible[rows, :g, 5]
    unaffected[rows, :g] = ~visible[rows, :g, 5]
    return affected, unaffected


_NVFP4_HOST_ERRORS = [
    ("k int8", lambda p, a: dict(k=a["k"].view(torch.int8)), TypeError, "k"),
    ("k bf16", lambda p, a: dict(k=p.k, v=p.v), TypeError, "k"),
    ("q fp16", lambda p, a: dict(q=p.q.half()), TypeError, "q"),
    ("k_scale float", lambda p, a: dict(k_scale_128x4=a["k_scale_128x4"].float()), TypeError,
     "k_scale_128x4"),
    ("v_scale short", lambda p, a: dict(v_scale_128x4=a["v_scale_128x4"][:-128]), ValueError,
     "v_scale_128x4"),
    ("k_scale transposed", lambda p, a: dict(k_scale_128x4=a["k_scale_128x4"].t()), ValueError,
     "k_scale_128x4"),
    ("k_global_scale fp64", lambda p, a: dict(k_global_scale=a["k_global_scale"].double()),
     TypeError, "k_global_scale"),
    ("v_global_scale empty", lambda p, a: dict(v_global_scale=a["v_global_scale"][:0]),
     ValueError, "v_global_scale"),
    ("k unpacked width", lambda p, a: dict(k=torch.cat([a["k"], a["k"]], -1),
                                           v=torch.cat([a["v"], a["v"]], -1)), ValueError, "k"),
    ("topK 12", lambda p, a: dict(topK=12), ValueError, "topK"),
]
for _name, _change, _cls, _arg in _NVFP4_HOST_ERRORS:
    _add(f"{NVFP4}: {_name}", NVFP4, (), _nvfp4_make(_change), Error(_cls, _arg))
for _name, _change, _expect in [
        ("cu_seqlens_q ends past q", lambda p, a: _cu("cu_seqlens_q", [0, 100, 170])(p),
         Invalid("cu_seqlens_q")),
        ("cu_seqlens_k decreasing", lambda p, a: _cu("cu_seqlens_k", [0, 600, 504])(p),
         Invalid("cu_seqlens_k")),
        ("max_seqlen_k short", lambda p, a: dict(max_seqlen_k=10), Invalid("max_seqlen_k")),
        ("k2q_q_indices past the request", lambda p, a: _edit("q_idx", lambda t: t[0, 0].fill_(
            999))(p), Skip("k2q_q_indices")),
        ("valid", lambda p, a: {}, Same()),
        ("no global scales", lambda p, a: dict(k_global_scale=None, v_global_scale=None),
         Same())]:
    _add(f"{NVFP4}: {_name}", NVFP4, (), _nvfp4_make(_change), _expect)
_add(f"{NVFP4}: nan k block scale", NVFP4, (), _nvfp4_make(_scale_nan("k_scale_128x4", 5 * 2),
                                                            _nvfp4_k_nan_rows), NonFinite())


# ---------------------------------------------------------------------------------------------
# sparse_decode_atten_func / SparseDecodePagedAttentionWrapper
# ---------------------------------------------------------------------------------------------

DECODE = "sparse_decode_atten_func"
WRAPPER = "SparseDecodePagedAttentionWrapper"


@dataclasses.dataclass
class Decode:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q2k: Optional[torch.Tensor]
    page_table: torch.Tensor
    seqused_k: torch.Tensor
    lens: List[int]
    seqlen_q: int

    def kwargs(self, **change):
        kw = dict(page_table=self.page_table, seqused_k=self.seqused_k, seqlen_q=self.seqlen_q,
                  max_seqlen_k=max(self.lens), return_softmax_lse=True)
        kw.update(change)
        return kw

    def call(self, wrapper=False, **change):
        args = dict(q=self.q, k=self.k, v=self.v, q2k_indices=self.q2k)
        kw = self.kwargs()
        for name, value in change.items():
            (args if name in args else kw)[name] = value
        if not wrapper:
            return lambda: msa.sparse_decode_atten_func(**args, **kw)
        plan_kw = {n: kw.pop(n) for n in ("page_table", "seqused_k", "seqlen_q", "max_seqlen_k",
                                          "enable_cuda_graph", "fixed_split_size",
                                          "disable_split_kv", "num_qo_heads", "num_kv_heads",
                                          "check_input_valid") if n in kw}
        plan_kw.setdefault("num_qo_heads", args["q"].shape[1])
        plan_kw.setdefault("num_kv_heads", args["k"].shape[1])
        run_kw = {n: kw[n] for n in ("softmax_scale", "return_softmax_lse", "out", "lse")
                  if n in kw}
        return lambda: msa.SparseDecodePagedAttentionWrapper().plan(
            q2k_indices=args["q2k_indices"], **plan_kw).run(args["q"], args["k"], args["v"],
                                                            **run_kw)

    def tensors(self):
        return [t for t in (self.q, self.k, self.v, self.q2k, self.page_table, self.seqused_k)
                if t is not None]


def decode_problem(device, gen, *, lens=(300, 129, 1000), seqlen_q=2, hkv=2, group=4,
                   q_dtype=BF16, kv_dtype=BF16, sparse=False, topk=8) -> Decode:
    lens = list(lens)
    batch = len(lens)
    pages_b = [-(-n // BLOCK) for n in lens]
    width = max(max(pages_b), 1) + 1
    num_pages = sum(pages_b) + 3
    perm = torch.randperm(num_pages, generator=gen)
    # Entries past a request's pages are junk on purpose (never read).
    table = torch.randint(-(1 << 20), 1 << 20, (batch, width), generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_b):
        table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    k = _randn((num_pages, hkv, BLOCK, D), gen, kv_dtype)
    v = _randn((num_pages, hkv, BLOCK, D), gen, kv_dtype)
    q = _randn((batch * seqlen_q, hkv * group, D), gen, q_dtype)
    q2k = None
    if sparse:
        q2k = torch.full((hkv, batch * seqlen_q, topk), -1, dtype=torch.int32)
        for b, n in enumerate(pages_b):
            for i in range(seqlen_q):
                for h in range(hkv):
                    ids = torch.randperm(n, generator=gen)[:topk].to(torch.int32)
                    slots = torch.randperm(topk, generator=gen)[:ids.numel()]
                    q2k[h, b * seqlen_q + i, slots] = ids
    return to_device(Decode(q, k, v, q2k, table, torch.tensor(lens, dtype=torch.int32), lens,
                            seqlen_q), device)


def _decode_make(change=None, wrapper=False, **problem):
    def make(device, gen):
        p = decode_problem(device, gen, **problem)
        overrides = change(p) if change is not None else {}
        return Made(p.call(wrapper=wrapper, **overrides), p.tensors())
    return make


def _decode_visibility(p: Decode):
    """[T, Hq, Kmax] bool: key j of the row's request is visible (contract §1.4)."""
    total_q, hq = p.q.shape[:2]
    g = hq // p.k.shape[1]
    kmax = max(p.lens)
    vis = torch.zeros(total_q, hq, kmax, dtype=torch.bool)
    j = torch.arange(kmax)
    for b, n in enumerate(p.lens):
        for i in range(p.seqlen_q):
            t = b * p.seqlen_q + i
            row = (j < n) & (j <= i + n - p.seqlen_q)
            for h in range(p.k.shape[1]):
                sel = row
                if p.q2k is not None:
                    ids = [int(x) for x in p.q2k[h, t].cpu() if x >= 0]
                    sel = row & torch.isin(j // BLOCK, torch.tensor(ids, dtype=torch.int64))
                vis[t, h * g:(h + 1) * g] = sel
    return vis


def _decode_nonfinite_make(which, value, *, b=2, j=700, head=1, channel=9, wrapper=False,
                           run_kw=None, **problem):
    """NaN / Inf in q (row b*seqlen_q, q head `head`) or in K / V (key j of request b)."""
    def make(device, gen):
        p = decode_problem(device, gen, **problem)
        kw = dict(run_kw or {})
        total_q, hq = p.q.shape[:2]
        g = hq // p.k.shape[1]
        if which == "k" and math.isinf(value) and g * p.seqlen_q > 1:
            # An infinite key is +inf for rows whose q channel has the key's sign and -inf (the
            # key drops out) for the others: fix one row of each kind so the case always covers
            # both, whatever the seed.
            q = p.q.clone()
            first = b * p.seqlen_q
            second = first + 1 if p.seqlen_q > 1 else first
            heads = (head * g, head * g + (1 if p.seqlen_q == 1 else 0))
            magnitude = max(abs(float(q[first, heads[0], channel])), 0.25)
            q[first, heads[0], channel] = magnitude
            q[second, heads[1], channel] = -magnitude
            p.q = q
        clean = p.call(wrapper=wrapper, **kw)
        vis = _decode_visibility(p)
        affected = torch.zeros(total_q, hq, dtype=torch.bool)
        unaffected = torch.ones_like(affected)
        channels = None
        if which == "q":
            t = b * p.seqlen_q
            q = p.q.clone()
            q[t, head, channel] = value
            p.q = q
            affected[t, head] = bool(vis[t, head].any())
            unaffected[t, head] = False
        else:
            page = int(p.page_table[b, j // BLOCK])
            t = getattr(p, which).clone()
            t[page, head, j % BLOCK, channel] = value
            setattr(p, which, t)
            rows = slice(b * p.seqlen_q, (b + 1) * p.seqlen_q)
            group = slice(head * g, (head + 1) * g)
            sees = vis[rows, group, j]
            if which == "k":
                sign = p.q[rows, group, channel].cpu().double() * value        # score of key j
                affected[rows, group] = sees & (torch.isnan(sign) | (sign == INF))
                unaffected[rows, group] = ~sees
            else:
                affected[rows, group] = sees
                block = vis[rows, group, (j // BLOCK) * BLOCK:(j // BLOCK + 1) * BLOCK].any(-1)
                unaffected[rows, group] = ~block
                channels = [channel]
        return Made(p.call(wrapper=wrapper, **kw), p.tensors(), clean=clean, affected=affected,
                    unaffected=unaffected, channels=channels)
    return make


def _dedit(field, edit):
    def change(p):
        t = getattr(p, field).clone()
        edit(t)
        return {{"q2k": "q2k_indices"}.get(field, field): t}
    return change


_DECODE_HOST_ERRORS = [
    ("q fp16", lambda p: dict(q=p.q.half()), TypeError, "q"),
    ("q rank 4", lambda p: dict(q=p.q[None]), ValueError, "q"),
    ("fp8 q with bf16 kv", lambda p: dict(q=p.q.to(E4M3)), TypeError, "k"),
    ("k dense layout", lambda p: dict(k=p.k[:, :, 0].contiguous(), v=p.v[:, :, 0].contiguous()),
     ValueError, "k"),
    ("v dtype differs", lambda p: dict(v=p.v.to(E4M3)), TypeError, "v"),
    ("G = 3", lambda p: dict(q=p.q[:, :6].contiguous()), NotImplementedError, "q"),
    ("Hq not a multiple", lambda p: dict(q=p.q[:, :3].contiguous()), ValueError, "q"),
    ("causal False", lambda p: dict(causal=False), NotImplementedError, "causal"),
    ("blk_kv 64", lambda p: dict(blk_kv=64), ValueError, "blk_kv"),
    ("page size 64", lambda p: dict(k=p.k[:, :, :64].contiguous(),
                                    v=p.v[:, :, :64].contiguous()), ValueError, "k"),
    ("seqlen_q vs q rows", lambda p: dict(seqlen_q=3), ValueError, "q"),
    ("seqlen_q 17", lambda p: dict(seqlen_q=17), NotImplementedError, "seqlen_q"),
    ("seqlen_q 0", lambda p: dict(seqlen_q=0), ValueError, "seqlen_q"),
    ("seqlen_q float", lambda p: dict(seqlen_q=2.0), TypeError, "seqlen_q"),
    ("page_table int64", lambda p: dict(page_table=p.page_table.long()), TypeError,
     "page_table"),
    ("page_table rows", lambda p: dict(page_table=p.page_table[:1]), ValueError, "page_table"),
    ("seqused_k 2-D", lambda p: dict(seqused_k=p.seqused_k.view(1, -1)), ValueError,
     "seqused_k"),
    ("seqused_k empty", lambda p: dict(seqused_k=p.seqused_k[:0]), ValueError, "seqused_k"),
    ("max_seqlen_k 0", lambda p: dict(max_seqlen_k=0), ValueError, "max_seqlen_k"),
    ("softmax_scale 0", lambda p: dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    ("schedule type", lambda p: dict(schedule=object()), TypeError, "schedule"),
    ("O_partial dtype", lambda p: dict(O_partial=torch.zeros(4, 2, 8, D, dtype=BF16,
                                                             device=p.q.device)),
     TypeError, "O_partial"),
    ("check_input_valid None", lambda p: dict(check_input_valid=None), TypeError,
     "check_input_valid"),
]
_SPARSE_DECODE_HOST_ERRORS = [
    ("q2k shape", lambda p: dict(q2k_indices=p.q2k[:, :-1].contiguous()), ValueError,
     "q2k_indices"),
    ("q2k int64", lambda p: dict(q2k_indices=p.q2k.long()), TypeError, "q2k_indices"),
    ("q2k topK 5", lambda p: dict(q2k_indices=p.q2k[..., :5].contiguous()), ValueError,
     "q2k_indices"),
]
for _name, _change, _cls, _arg in _DECODE_HOST_ERRORS:
    _add(f"{DECODE}: {_name}", DECODE, ["sparse_decode_atten"], _decode_make(_change),
         Error(_cls, _arg))
for _name, _change, _cls, _arg in _SPARSE_DECODE_HOST_ERRORS:
    _add(f"{DECODE}: {_name}", DECODE, ["sparse_decode_atten"],
         _decode_make(_change, sparse=True), Error(_cls, _arg))

_WRAPPER_ERRORS = [
    ("plan G = 3", lambda p: dict(num_qo_heads=6, num_kv_heads=2), NotImplementedError,
     "num_qo_heads"),
    ("plan heads not a multiple", lambda p: dict(num_qo_heads=5, num_kv_heads=2), ValueError,
     "num_qo_heads"),
    ("plan G = 32", lambda p: dict(num_qo_heads=64, num_kv_heads=2), NotImplementedError,
     "num_qo_heads"),
    ("plan num_kv_heads 0", lambda p: dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    ("plan fixed split and no split", lambda p: dict(fixed_split_size=1, disable_split_kv=True),
     ValueError, "fixed_split_size"),
    ("run heads differ from the plan", lambda p: dict(num_qo_heads=4, num_kv_heads=1),
     ValueError, "q"),
    ("run out dtype", lambda p: dict(out=torch.empty(p.q.shape, device=p.q.device)), TypeError,
     "out"),
    ("run lse shape", lambda p: dict(lse=torch.empty(3, 3, device=p.q.device)), ValueError,
     "lse"),
    ("plan check_input_valid string", lambda p: dict(check_input_valid="on"), TypeError,
     "check_input_valid"),
]
for _name, _change, _cls, _arg in _WRAPPER_ERRORS:
    _add(f"{WRAPPER}: {_name}", WRAPPER, ["sparse_decode_atten"],
         _decode_make(_change, wrapper=True), Error(_cls, _arg))


def _run_before_plan(device, gen):
    p = decode_problem(device, gen)
    return Made(lambda: msa.SparseDecodePagedAttentionWrapper().run(p.q, p.k, p.v), p.tensors())


_add(f"{WRAPPER}: run before plan", WRAPPER, (), _run_before_plan, Error(RuntimeError, "run"))

_DECODE_VALUES = [
    ("page id past the pool", _dedit("page_table", lambda t: t[2, 3].fill_(1 << 24)),
     Invalid("page_table")),
    ("page id negative", _dedit("page_table", lambda t: t[0, 0].fill_(-1)), Invalid("page_table")),
    ("seqused_k negative", _dedit("seqused_k", lambda t: t[1].fill_(-5)), Invalid("seqused_k")),
    ("seqused_k past the page table", _dedit("seqused_k", lambda t: t[0].fill_(1 << 30)),
     Invalid("seqused_k")),
    ("seqused_k INT32_MIN", _dedit("seqused_k", lambda t: t[2].fill_(-(1 << 31))),
     Invalid("seqused_k")),
    ("max_seqlen_k short", lambda p: dict(max_seqlen_k=500), Invalid("max_seqlen_k")),
    ("seqused_k 0", _dedit("seqused_k", lambda t: t[1].fill_(0)), Same()),
    ("seqused_k below seqlen_q", _dedit("seqused_k", lambda t: t[1].fill_(1)), Same()),
    ("max_seqlen_k larger", lambda p: dict(max_seqlen_k=1 << 16), Same()),
    ("valid", lambda p: {}, Same()),
]
_SPARSE_DECODE_VALUES = [
    ("q2k id past the request", _dedit("q2k", lambda t: t[0, 0, 0].fill_(40)),
     Skip("q2k_indices")),
    ("q2k id -5", _dedit("q2k", lambda t: t[1, 3, 1].fill_(-5)), Skip("q2k_indices")),
    ("q2k id 2^30", _dedit("q2k", lambda t: t[1, 5, 7].fill_(1 << 30)), Skip("q2k_indices")),
    ("q2k duplicate ids", _dedit("q2k", lambda t: t[0, 4, :2].fill_(1)), Skip("q2k_indices")),
    ("q2k all -1", _dedit("q2k", lambda t: t.fill_(-1)), Same()),
]
for _wrapper in (False, True):
    _fn = WRAPPER if _wrapper else DECODE
    for _name, _change, _expect in _DECODE_VALUES:
        _add(f"{_fn}: {_name}", _fn, ["sparse_decode_atten"],
             _decode_make(_change, wrapper=_wrapper), _expect)
        if "seqused_k" in _name or "page id" in _name:
            # A shorter request turns the selection's ids past it into documented skips.
            _sparse_expect = Skip("q2k_indices") if isinstance(_expect, Same) else _expect
            _add(f"{_fn}: {_name} (sparse)", _fn, ["sparse_decode_atten"],
                 _decode_make(_change, wrapper=_wrapper, sparse=True), _sparse_expect)
    for _name, _change, _expect in _SPARSE_DECODE_VALUES:
        _add(f"{_fn}: {_name}", _fn, ["sparse_decode_atten"],
             _decode_make(_change, wrapper=_wrapper, sparse=True), _expect)
for _name, _problem in (("e4m3", dict(q_dtype=E4M3, kv_dtype=E4M3)),
                        ("bf16 q e4m3 kv", dict(kv_dtype=E4M3)), ("G = 16", dict(group=16)),
                        ("MTP 8", dict(seqlen_q=8)), ("one request", dict(lens=(5000,))),
                        ("sparse e4m3", dict(q_dtype=E4M3, kv_dtype=E4M3, sparse=True))):
    _add(f"{DECODE}: {_name}", DECODE, ["sparse_decode_atten"], _decode_make(None, **_problem),
         Same())
_add(f"{WRAPPER}: forced split", WRAPPER, ["sparse_decode_atten"],
     _decode_make(lambda p: dict(fixed_split_size=1), wrapper=True), Same())
_add(f"{WRAPPER}: cuda-graph plan", WRAPPER, ["sparse_decode_atten"],
     _decode_make(lambda p: dict(enable_cuda_graph=True, max_seqlen_k=4096), wrapper=True),
     Same())

for _which, _value in (("q", NAN), ("q", INF), ("k", NAN), ("k", INF), ("k", -INF), ("v", NAN),
                       ("v", INF)):
    _add(f"{DECODE}: {_value} in {_which}", DECODE, ["sparse_decode_atten"],
         _decode_nonfinite_make(_which, _value), NonFinite(lse_too=_which != "v"))
for _which in ("q", "k", "v"):
    _add(f"{DECODE}: nan in {_which} (sparse)", DECODE, ["sparse_decode_atten"],
         _decode_nonfinite_make(_which, NAN, sparse=True), NonFinite(lse_too=_which != "v"))
    _add(f"{DECODE}: nan in {_which} (e4m3)", DECODE, ["sparse_decode_atten"],
         _decode_nonfinite_make(_which, NAN, q_dtype=E4M3, kv_dtype=E4M3),
         NonFinite(lse_too=_which != "v"))
    _add(f"{WRAPPER}: nan in {_which} (forced split)", WRAPPER, ["sparse_decode_atten"],
         _decode_nonfinite_make(_which, NAN, wrapper=True, run_kw=dict(fixed_split_size=1)),
         NonFinite(lse_too=_which != "v"))
_add(f"{DECODE}: nan in k (G = 16, one token)", DECODE, ["sparse_decode_atten"],
     _decode_nonfinite_make("k", NAN, head=0, group=16, seqlen_q=1), NonFinite())


# ---------------------------------------------------------------------------------------------
# block_max_scores
# ---------------------------------------------------------------------------------------------

BMS = "block_max_scores"


def _bms_make(change=None, paged=False, q_lens=(100, 1, 60), k_lens=(300, 129, 200), heads=4,
              nonfinite=False):
    def make(device, gen):
        q = _randn((sum(q_lens), heads, D), gen)
        k = _randn((sum(k_lens), 1, D), gen)
        kw = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), scale=0.1, causal=True)
        args = dict(q_idx=q, k_idx=k, cu_seqlens_q=cu_seqlens(q_lens),
                    cu_seqlens_k=cu_seqlens(k_lens))
        if paged:
            kp, _, table, seqused = to_paged(k, k, k_lens, extra_pages=2, generator=gen)
            _junk_past_the_keys(table, k_lens, gen)
            args["k_idx"] = kp
            kw.update(page_table=table, seqused_k=seqused)
        args = {n: t.to(device) for n, t in args.items()}
        kw = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        clean = (lambda a=dict(args), k_=dict(kw): msa.block_max_scores(**a, **k_))
        for name, value in (change(args, kw) if change is not None else {}).items():
            (args if name in args else kw)[name] = value
        made = Made(lambda: msa.block_max_scores(**args, **kw),
                    [t for t in list(args.values()) + list(kw.values())
                     if isinstance(t, torch.Tensor)])
        if nonfinite:
            # NaN in query row 5, head 2: its scores are NaN (or, natively, -inf: the index
            # rows only rank blocks and top-k never picks either); the other rows are exact.
            made.clean = clean
        return made
    return make


def _bcu(name, values):
    return lambda a, k: {name: _i32(values, a["q_idx"].device)}


_BMS_HOST_ERRORS = [
    ("q_idx fp16", lambda a, k: dict(q_idx=a["q_idx"].half()), TypeError, "q_idx"),
    ("q_idx head dim 64", lambda a, k: dict(q_idx=a["q_idx"][..., :64].contiguous()),
     NotImplementedError, "q_idx"),
    ("q_idx heads not a multiple", lambda a, k: dict(k_idx=a["k_idx"].repeat(1, 3, 1)),
     ValueError, "q_idx"),
    ("paged k_idx without page_table", lambda a, k: dict(k_idx=a["k_idx"][:512].view(4, 1, 128,
                                                                                     128)),
     ValueError, "page_table"),
    ("seqused_k with dense k_idx", lambda a, k: dict(seqused_k=_i32([1, 1, 1],
                                                                    a["q_idx"].device)),
     ValueError, "seqused_k"),
    ("cu_seqlens_q int64", lambda a, k: dict(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError,
     "cu_seqlens_q"),
    ("cu_seqlens_k None (dense)", lambda a, k: dict(cu_seqlens_k=None), ValueError,
     "cu_seqlens_k"),
    ("scale 0", lambda a, k: dict(scale=0.0), ValueError, "scale"),
    ("qo_offset without causal", lambda a, k: dict(causal=False, qo_offset=3), ValueError,
     "qo_offset"),
    ("qo_offset wrong length", lambda a, k: dict(qo_offset=_i32([0, 0], a["q_idx"].device)),
     ValueError, "qo_offset"),
    ("qo_offset float", lambda a, k: dict(qo_offset=1.5), TypeError, "qo_offset"),
    ("max_seqlen_k 0", lambda a, k: dict(max_seqlen_k=0), ValueError, "max_seqlen_k"),
    ("max_k_tiles 0", lambda a, k: dict(max_k_tiles=0), ValueError, "max_k_tiles"),
    ("check_input_valid 1", lambda a, k: dict(check_input_valid=1), TypeError,
     "check_input_valid"),
]
for _name, _change, _cls, _arg in _BMS_HOST_ERRORS:
    _add(f"{BMS}: {_name}", BMS, ["block_max_scores"], _bms_make(_change), Error(_cls, _arg))
_BMS_VALUES = [
    ("cu_seqlens_q starts at 3", _bcu("cu_seqlens_q", [3, 100, 101, 161]),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q negative start", _bcu("cu_seqlens_q", [-50, 100, 101, 161]),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q ends past q", _bcu("cu_seqlens_q", [0, 100, 101, 1 << 20]),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q decreasing", _bcu("cu_seqlens_q", [0, 150, 101, 161]),
     Invalid("cu_seqlens_q")),
    ("max_seqlen_q short", lambda a, k: dict(max_seqlen_q=7), Invalid("max_seqlen_q")),
    ("max_seqlen_k short", lambda a, k: dict(max_seqlen_k=129), Invalid("max_seqlen_k")),
    ("valid", lambda a, k: {}, Same()),
    ("max_k_tiles wider", lambda a, k: dict(max_k_tiles=9), Same()),
    ("qo_offset huge", lambda a, k: dict(qo_offset=1 << 40), Same()),
    ("qo_offset negative tensor", lambda a, k: dict(qo_offset=_i32([-5, -(1 << 30), 7],
                                                                   a["q_idx"].device)), Same()),
]
for _paged in (False, True):
    for _name, _change, _expect in _BMS_VALUES:
        _add(f"{BMS}: {_name}{' (paged)' if _paged else ''}", BMS, ["block_max_scores"],
             _bms_make(_change, paged=_paged), _expect)
for _name, _change, _expect in [
        ("cu_seqlens_k starts at 9", _bcu("cu_seqlens_k", [9, 300, 429, 629]),
         Invalid("cu_seqlens_k")),
        ("cu_seqlens_k ends past k", _bcu("cu_seqlens_k", [0, 300, 429, 700]),
         Invalid("cu_seqlens_k")),
        ("cu_seqlens_k negative", _bcu("cu_seqlens_k", [0, -300, 429, 629]),
         Invalid("cu_seqlens_k")),
        ("empty request", None, Same())]:
    _add(f"{BMS}: {_name}", BMS, ["block_max_scores"],
         _bms_make(_change) if _change else _bms_make(q_lens=(100, 0, 60)), _expect)
for _name, _change, _expect in [
        ("page id past the pool", lambda a, k: dict(page_table=k["page_table"].clone().index_fill_(
            1, torch.tensor([0], device=a["q_idx"].device), 1 << 24)), Invalid("page_table")),
        ("seqused_k negative", lambda a, k: dict(seqused_k=k["seqused_k"].clone().fill_(-1)),
         Invalid("seqused_k")),
        ("seqused_k past the table", lambda a, k: dict(seqused_k=k["seqused_k"] * 100),
         Invalid("seqused_k"))]:
    _add(f"{BMS}: {_name} (paged)", BMS, ["block_max_scores"], _bms_make(_change, paged=True),
         _expect)


# ---------------------------------------------------------------------------------------------
# sparse_topk_select (every index value is clamped by definition: nothing to reject)
# ---------------------------------------------------------------------------------------------

TOPK = "sparse_topk_select"


def _topk_make(change=None, heads=4, tiles=40, tokens=33):
    def make(device, gen):
        scores = torch.randn(heads, tiles, tokens, generator=gen).to(device)
        args = dict(max_score=scores, topk=16)
        for name, value in (change(args) if change is not None else {}).items():
            args[name] = value
        return Made(lambda: msa.sparse_topk_select(**args),
                    [t for t in args.values() if isinstance(t, torch.Tensor)])
    return make


def _nan_scores(a):
    s = a["max_score"].clone()
    s[:, ::3, ::2] = NAN
    s[1, 5:9] = -INF
    return dict(max_score=s)


_TOPK_CASES = [
    ("max_score fp16", lambda a: dict(max_score=a["max_score"].half()), Error(TypeError,
                                                                               "max_score")),
    ("max_score rank 2", lambda a: dict(max_score=a["max_score"][0]), Error(ValueError,
                                                                            "max_score")),
    ("max_score not contiguous", lambda a: dict(max_score=a["max_score"].transpose(1, 2)
                                                .contiguous().transpose(1, 2)),
     Error(ValueError, "max_score")),
    ("topk 0", lambda a: dict(topk=0), Error(ValueError, "topk")),
    ("topk 65", lambda a: dict(topk=65), Error(ValueError, "topk")),
    ("topk float", lambda a: dict(topk=16.0), Error(TypeError, "topk")),
    ("num_valid_pages 0", lambda a: dict(num_valid_pages=0), Error(ValueError,
                                                                   "num_valid_pages")),
    ("num_valid_pages past K", lambda a: dict(num_valid_pages=41), Error(ValueError,
                                                                         "num_valid_pages")),
    ("num_valid_pages int64 tensor", lambda a: dict(num_valid_pages=torch.ones(
        33, dtype=torch.int64, device=a["max_score"].device)), Error(TypeError,
                                                                     "num_valid_pages")),
    ("force blocks past topk", lambda a: dict(force_begin_blocks=9, force_end_blocks=8),
     Error(ValueError, "force_begin_blocks")),
    ("force_end_blocks negative", lambda a: dict(force_end_blocks=-1), Error(ValueError,
                                                                             "force_end_blocks")),
    ("causal_end_block wrong length", lambda a: dict(causal_end_block=torch.zeros(
        7, dtype=torch.int32, device=a["max_score"].device)), Error(ValueError,
                                                                    "causal_end_block")),
    ("head_reduce mean", lambda a: dict(head_reduce="mean", num_out_heads=2),
     Error(ValueError, "head_reduce")),
    ("output int64", lambda a: dict(output=torch.empty(33, 4, 16, dtype=torch.int64,
                                                       device=a["max_score"].device)),
     Error(TypeError, "output")),
    ("valid", lambda a: {}, Same()),
    ("NaN and -inf scores", _nan_scores, Same()),
    ("all scores NaN", lambda a: dict(max_score=torch.full_like(a["max_score"], NAN)), Same()),
    ("num_valid_pages values outside [0, K]", lambda a: dict(num_valid_pages=_scattered_ints(
        (33,), -50, 90).to(a["max_score"].device)), Same()),
    ("causal_end_block garbage", lambda a: dict(causal_end_block=torch.tensor(
        [-(1 << 31), -1, (1 << 31) - 1] * 11, dtype=torch.int32).to(a["max_score"].device),
        force_end_blocks=2), Same()),
    ("head reduce with NaN", lambda a: {**_nan_scores(a), "head_reduce": "sum",
                                        "num_out_heads": 2}, Same()),
]
for _name, _change, _expect in _TOPK_CASES:
    _add(f"{TOPK}: {_name}", TOPK, ["sparse_topk_select"], _topk_make(_change), _expect)


# ---------------------------------------------------------------------------------------------
# fp4_indexer_block_scores (reference backend only)
# ---------------------------------------------------------------------------------------------

FP4 = "fp4_indexer_block_scores"


def _fp4_make(change=None, q_lens=(70, 1, 40), k_lens=(300, 129, 40), hq=4, hk=2):
    def make(device, gen):
        g = 8
        pages_b = [-(-n // BLOCK) for n in k_lens]
        n_pages = sum(pages_b) + 1
        total_q = sum(q_lens)
        scale = lambda shape: (torch.randint(110, 130, shape, generator=gen)     # noqa: E731
                               .to(torch.uint8).view(E4M3))
        args = dict(q_fp4=torch.randint(0, 256, (total_q, hq, 64), generator=gen,
                                        dtype=torch.uint8),
                    k_fp4=torch.randint(0, 256, (n_pages, hk, 128, 64), generator=gen,
                                        dtype=torch.uint8),
                    q_scale=scale((total_q, hq, g)), k_scale=scale((n_pages, hk, 128, g)),
                    cu_seqlens_q=cu_seqlens(q_lens), cu_seqlens_k=cu_seqlens(k_lens),
                    cu_page_offsets=cu_seqlens(pages_b))
        kw = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), fp4_format="nvfp4",
                  causal=True, scale_layout="public",
                  kv_indices=torch.randperm(n_pages, generator=gen)[:sum(pages_b)].to(
                      torch.int32))
        args = {n: t.to(device) for n, t in args.items()}
        kw["kv_indices"] = kw["kv_indices"].to(device)
        for name, value in (change(args, kw) if change is not None else {}).items():
            (args if name in args else kw)[name] = value
        return Made(lambda: msa.fp4_indexer_block_scores(**args, **kw),
                    [t for t in list(args.values()) + list(kw.values())
                     if isinstance(t, torch.Tensor)])
    return make


def _fcu(name, values):
    return lambda a, k: {name: _i32(values, a["q_fp4"].device)}


_FP4_CASES = [
    ("q_fp4 fp16", lambda a, k: dict(q_fp4=a["q_fp4"].half()), Error(TypeError, "q_fp4")),
    ("q_fp4 unpacked width", lambda a, k: dict(q_fp4=torch.cat([a["q_fp4"]] * 2, -1)),
     Error(ValueError, "q_fp4")),
    ("k_fp4 page 64", lambda a, k: dict(k_fp4=a["k_fp4"][:, :, :64].contiguous(),
                                        k_scale=a["k_scale"][:, :, :64].contiguous()),
     Error(ValueError, "k_fp4")),
    ("format fp8", lambda a, k: dict(fp4_format="fp8"), Error(ValueError, "fp4_format")),
    ("scale layout", lambda a, k: dict(scale_layout="nhd"), Error(ValueError, "scale_layout")),
    ("q_scale shape", lambda a, k: dict(q_scale=a["q_scale"][:, :, :4].contiguous()),
     Error(ValueError, "q_scale")),
    ("k_scale float", lambda a, k: dict(k_scale=a["k_scale"].float()), Error(TypeError,
                                                                             "k_scale")),
    ("cu_page_offsets length", lambda a, k: dict(cu_page_offsets=a["cu_page_offsets"][:-1]),
     Error(ValueError, "cu_page_offsets")),
    ("kv_indices None", lambda a, k: dict(kv_indices=None), Error(ValueError, "kv_indices")),
    ("qo_offset without causal", lambda a, k: dict(causal=False, qo_offset=_i32(
        [0, 0, 0], a["q_fp4"].device)), Error(ValueError, "qo_offset")),
    ("max_seqlen_k negative", lambda a, k: dict(max_seqlen_k=-1), Error(ValueError,
                                                                        "max_seqlen_k")),
    ("cu_seqlens_q starts at 2", _fcu("cu_seqlens_q", [2, 70, 71, 111]),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q ends past q", _fcu("cu_seqlens_q", [0, 70, 71, 200]),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_k decreasing", _fcu("cu_seqlens_k", [0, 300, 200, 469]),
     Invalid("cu_seqlens_k")),
    ("cu_page_offsets short", _fcu("cu_page_offsets", [0, 2, 4, 5]), Invalid("cu_page_offsets")),
    ("cu_page_offsets past kv_indices", _fcu("cu_page_offsets", [0, 3, 5, 60]),
     Invalid("cu_page_offsets")),
    ("kv_indices past the pool", lambda a, k: dict(kv_indices=k["kv_indices"] + 100),
     Invalid("kv_indices")),
    ("kv_indices negative", lambda a, k: dict(kv_indices=k["kv_indices"] - 100),
     Invalid("kv_indices")),
    ("max_seqlen_q short", lambda a, k: dict(max_seqlen_q=3), Invalid("max_seqlen_q")),
    ("max_seqlen_k short", lambda a, k: dict(max_seqlen_k=129), Invalid("max_seqlen_k")),
    ("valid", lambda a, k: {}, Same()),
    ("max_seqlen_k larger", lambda a, k: dict(max_seqlen_k=2000), Same()),
]
for _name, _change, _expect in _FP4_CASES:
    _add(f"{FP4}: {_name}", FP4, (), _fp4_make(_change), _expect)


# ---------------------------------------------------------------------------------------------
# msa_prefill (indexer -> top-k -> CSR -> attention)
# ---------------------------------------------------------------------------------------------

PREFILL = "msa_prefill"


def _prefill_make(change=None, q_lens=(140, 40), k_lens=(300, 40), nonfinite=False):
    def make(device, gen):
        t, s = sum(q_lens), sum(k_lens)
        args = dict(q=_randn((t, 8, D), gen), k=_randn((s, 2, D), gen),
                    v=_randn((s, 2, D), gen), q_idx=_randn((t, 2, D), gen),
                    k_idx=_randn((s, 1, D), gen), cu_seqlens_q=cu_seqlens(q_lens),
                    cu_seqlens_k=cu_seqlens(k_lens))
        args = {n: x.to(device) for n, x in args.items()}
        kw = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), topk=4)
        clean = (lambda a=dict(args): msa.msa_prefill(**a, **kw))
        for name, value in (change(args, kw) if change is not None else {}).items():
            (args if name in args else kw)[name] = value
        made = Made(lambda: msa.msa_prefill(**args, **kw),
                    [x for x in args.values() if isinstance(x, torch.Tensor)])
        if nonfinite:
            # Query 150 (request 1), head 3 holds a NaN; its own block is always selected, so
            # its row is NaN, and no other row reads it (the selection reads q_idx only).
            q = args["q"].clone()
            q[150, 3, 0] = NAN
            args["q"] = q
            made.clean = clean
            made.affected = torch.zeros(t, 8, dtype=torch.bool)
            made.affected[150, 3] = True
            made.unaffected = ~made.affected
        return made
    return make


_PREFILL_CASES = [
    ("topk 12", lambda a, k: dict(topk=12), Error(ValueError, "topk")),
    ("local_blocks 5", lambda a, k: dict(local_blocks=5), Error(ValueError, "local_blocks")),
    ("local_blocks -1", lambda a, k: dict(local_blocks=-1), Error(ValueError, "local_blocks")),
    ("q_idx heads", lambda a, k: dict(q_idx=a["q_idx"].repeat(1, 2, 1)), Error(ValueError,
                                                                               "q_idx")),
    ("q_idx tokens", lambda a, k: dict(q_idx=a["q_idx"][:-1].contiguous()), Error(ValueError,
                                                                                  "q_idx")),
    ("k_idx tokens", lambda a, k: dict(k_idx=a["k_idx"][:-1].contiguous()), Error(ValueError,
                                                                                  "k_idx")),
    ("G = 3", lambda a, k: dict(q=a["q"][:, :6].contiguous()), Error(NotImplementedError, "q")),
    ("cu_seqlens_k int64", lambda a, k: dict(cu_seqlens_k=a["cu_seqlens_k"].long()),
     Error(TypeError, "cu_seqlens_k")),
    ("check_input_valid string", lambda a, k: dict(check_input_valid="y"), Error(
        TypeError, "check_input_valid")),
    ("cu_seqlens_q starts at 4", lambda a, k: dict(cu_seqlens_q=_i32([4, 140, 180],
                                                                     a["q"].device)),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_q ends past q", lambda a, k: dict(cu_seqlens_q=_i32([0, 140, 400],
                                                                     a["q"].device)),
     Invalid("cu_seqlens_q")),
    ("cu_seqlens_k decreasing", lambda a, k: dict(cu_seqlens_k=_i32([0, 350, 340],
                                                                    a["q"].device)),
     Invalid("cu_seqlens_k")),
    ("max_seqlen_k short", lambda a, k: dict(max_seqlen_k=100), Invalid("max_seqlen_k")),
    ("max_seqlen_q short", lambda a, k: dict(max_seqlen_q=100), Invalid("max_seqlen_q")),
    ("valid", lambda a, k: {}, Same()),
    ("hints larger", lambda a, k: dict(max_seqlen_q=1 << 12, max_seqlen_k=1 << 14), Same()),
]
for _name, _change, _expect in _PREFILL_CASES:
    _add(f"{PREFILL}: {_name}", PREFILL,
         ["block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten"],
         _prefill_make(_change), _expect)
_add(f"{PREFILL}: nan in q", PREFILL,
     ["block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten"],
     _prefill_make(nonfinite=True), NonFinite())


# ---------------------------------------------------------------------------------------------
# fmha_sm100_plan / fmha_plan / fmha_sm100 / fmha / sparse_fmha_plan / sparse_fmha
# ---------------------------------------------------------------------------------------------

def _tokens_to_pages(k, v, kv_lens, gen):
    """Dense [T, Hkv, D] -> shuffled pages [P, Hkv, 128, D] + kv_indices [sum pages] int32."""
    kp, vp, table, _ = to_paged(k, v, kv_lens, extra_pages=2, generator=gen)
    flat = torch.cat([table[b, :-(-n // BLOCK)] for b, n in enumerate(kv_lens)])
    return kp, vp, flat


def _fmha_make(change=None, *, fn="fmha", paged=False, sparse=False, q_lens=(5, 40),
               kv_lens=(9, 300), hq=4, hkv=2, nonfinite=None):
    """A dense / paged / sparse (bridge: q_len > 32) fmha call; change(args, kw, plan_kw) edits
    the run and plan arguments (plan errors raise when the call builds its plan)."""
    def make(device, gen):
        q = _randn((sum(q_lens), hq, D), gen)
        k = _randn((sum(kv_lens), hkv, D), gen)
        v = _randn((sum(kv_lens), hkv, D), gen)
        args = dict(q=q, k=k, v=v)
        run_kw, plan_kw = {}, dict(num_kv_heads=hkv, device=device)
        if paged or sparse:
            kp, vp, kvi = _tokens_to_pages(k, v, kv_lens, gen)
            args.update(k=kp, v=vp)
            run_kw["kv_indices"] = kvi
            plan_kw["page_size"] = BLOCK
        if sparse:
            plan_kw["kv_block_num"] = 4
            sel = torch.full((sum(q_lens), hkv, 4), -1, dtype=torch.int32)
            row = 0
            for ql, kl in zip(q_lens, kv_lens):
                nblk = -(-kl // BLOCK)
                for i in range(ql):
                    last = min(nblk - 1, (i + kl - ql) // BLOCK)
                    ids = torch.arange(max(last + 1, 0))[-4:]
                    sel[row + i, :, :ids.numel()] = ids.to(torch.int32)
                row += ql
            run_kw["kv_block_indexes"] = sel
        args = {n: t.to(device) for n, t in args.items()}
        run_kw = {n: t.to(device) for n, t in run_kw.items()}
        lens = (torch.tensor(q_lens), torch.tensor(kv_lens))
        plan_fn = msa.sparse_fmha_plan if fn == "sparse_fmha" else msa.fmha_plan
        if fn == "sparse_fmha":
            plan_kw.pop("device")          # its plan takes the device of the lengths

        def run(a, rk, pk):
            plan = plan_fn(*lens, hq, **pk)
            if fn == "sparse_fmha":
                return msa.sparse_fmha(a["q"], a["k"], a["v"], plan, **rk)
            return getattr(msa, fn)(a["q"], a["k"], a["v"], plan, **rk)
        clean = (lambda a=dict(args), rk=dict(run_kw), pk=dict(plan_kw): run(a, rk, pk))
        for name, value in (change(args, run_kw, plan_kw) if change is not None else {}).items():
            (args if name in args else plan_kw if name.startswith("plan.") else run_kw)[
                name.replace("plan.", "")] = value
        made = Made(lambda: run(args, run_kw, plan_kw),
                    [t for t in list(args.values()) + list(run_kw.values())
                     if isinstance(t, torch.Tensor)])
        if nonfinite is not None:
            # NaN in q row `nonfinite` (request 1), head 1: that row is NaN, no other row reads it.
            q = args["q"].clone()
            q[nonfinite, 1, 3] = NAN
            args["q"] = q
            made.clean = clean
            made.affected = torch.zeros(sum(q_lens), hq, dtype=torch.bool)
            made.affected[nonfinite, 1] = True
            made.unaffected = ~made.affected
        return made
    return make


def _fmha_plan_make(plan_fn, *args, **kwargs):
    def make(device, gen):
        return Made(lambda: outputs_of_plan(plan_fn(*args, **kwargs)))
    return make


def outputs_of_plan(plan):
    """The tensors a plan carries (plans are dicts; tests compare only what a run reads)."""
    dicts = [p for p in plan if isinstance(p, dict)] if isinstance(plan, tuple) else [plan]
    return [t for d in dicts for t in d.values() if isinstance(t, torch.Tensor)]


_T = lambda *x: torch.tensor(x)          # noqa: E731
_PLAN_ERRORS = [
    ("float lengths", (_T(1.0), _T(2), 4), {}, TypeError, "qo_segment_lens"),
    ("length mismatch", (_T(1, 2), _T(2), 4), {}, ValueError, "kv_segment_lens"),
    ("negative length", (_T(1), _T(-2), 4), {}, ValueError, "kv_segment_lens"),
    ("lengths 2-D", (_T(1).view(1, 1), _T(2), 4), {}, ValueError, "qo_segment_lens"),
    ("heads not a multiple", (_T(1), _T(2), 6, 4), {}, ValueError, "num_qo_heads"),
    ("num_qo_heads 0", (_T(1), _T(2), 0), {}, ValueError, "num_qo_heads"),
    ("sparse without pages", (_T(1), _T(2), 4), dict(kv_block_num=16), ValueError,
     "page_size"),
    ("bad mode", (_T(1), _T(2), 4), dict(sparse_kernel_mode="fast"), ValueError,
     "sparse_kernel_mode"),
    ("offset count", (_T(1, 1), _T(2, 2), 4), dict(qo_offset=_T(1, 1, 1)), ValueError,
     "qo_offset"),
    ("offset float", (_T(1), _T(2), 4), dict(qo_offset=1.5), TypeError, "qo_offset"),
    ("causal string", (_T(1), _T(2), 4), dict(causal="yes"), TypeError, "causal"),
    ("usable_SM_count -3", (_T(1), _T(2), 4), dict(usable_SM_count=-3), ValueError,
     "usable_SM_count"),
]
for _name, _args, _kw, _cls, _arg in _PLAN_ERRORS:
    for _fn in ("fmha_sm100_plan", "fmha_plan"):
        _add(f"{_fn}: {_name}", _fn, (), _fmha_plan_make(getattr(msa, _fn), *_args,
                                                         device="cpu", **_kw),
             Error(_cls, _arg))
_SPARSE_PLAN_ERRORS = [
    ("topk 5", dict(page_size=128, kv_block_num=5), ValueError, "kv_block_num"),
    ("page size 0", dict(page_size=0, kv_block_num=4), ValueError, "page_size"),
    ("page size 64", dict(page_size=64, kv_block_num=4), NotImplementedError, "page_size"),
    ("max-score", dict(page_size=128, kv_block_num=4, output_maxscore=True),
     NotImplementedError, "output_maxscore"),
    ("non-causal", dict(page_size=128, kv_block_num=4, causal=False), NotImplementedError,
     "causal"),
    ("offset past kv", dict(page_size=128, kv_block_num=4, qo_offset=_T(250)), ValueError,
     "qo_offset"),
]
for _name, _kw, _cls, _arg in _SPARSE_PLAN_ERRORS:
    _add(f"sparse_fmha_plan: {_name}", "sparse_fmha_plan", (),
         _fmha_plan_make(msa.sparse_fmha_plan, _T(40), _T(256), 4, 4, **_kw), Error(_cls, _arg))
_add("sparse_fmha_plan: group 32", "sparse_fmha_plan", (),
     _fmha_plan_make(msa.sparse_fmha_plan, _T(40), _T(256), 32, 1, page_size=128,
                     kv_block_num=4), Error(NotImplementedError, "num_qo_heads"))
for _fn in ("fmha_sm100_plan", "fmha_plan", "sparse_fmha_plan"):
    _kw = dict(page_size=128, kv_block_num=4) if _fn == "sparse_fmha_plan" else {}
    _add(f"{_fn}: zero-length requests", _fn, (),
         _fmha_plan_make(getattr(msa, _fn), _T(0, 40, 1), _T(5, 0, 300), 4, 2, **_kw), Same())

_FMHA_RUN_ERRORS = [
    ("fp16 q", lambda a, r, p: dict(q=a["q"].half()), TypeError, "q"),
    ("fp8 q bf16 kv", lambda a, r, p: dict(q=a["q"].to(E4M3)), TypeError, "k"),
    ("head dim 64", lambda a, r, p: dict(q=a["q"][..., :64], k=a["k"][..., :64],
                                         v=a["v"][..., :64]), NotImplementedError, "q"),
    ("no outputs", lambda a, r, p: dict(output_o=False, output_maxscore=False), ValueError,
     "output_o"),
    ("page_table on a dense plan", lambda a, r, p: dict(page_table=_i32([[0]], a["q"].device)),
     ValueError, "page_table"),
    ("token count", lambda a, r, p: dict(q=a["q"][:-1]), ValueError, "q"),
    ("kv count", lambda a, r, p: dict(k=a["k"][:-1], v=a["v"][:-1]), ValueError, "k"),
    ("head count", lambda a, r, p: dict(q=a["q"][:, :2]), ValueError, "q"),
    ("kv_indices with dense k", lambda a, r, p: dict(kv_indices=_i32([0], a["q"].device)),
     ValueError, "kv_indices"),
    ("blocks on a dense plan", lambda a, r, p: dict(kv_block_indexes=torch.zeros(
        45, 2, 4, dtype=torch.int32, device=a["q"].device)), ValueError, "kv_block_indexes"),
    ("v_scale negative", lambda a, r, p: dict(v_scale=-1.0), ValueError, "v_scale"),
    ("sm_scale nan", lambda a, r, p: dict(sm_scale=NAN), ValueError, "sm_scale"),
    ("check_input_valid None", lambda a, r, p: dict(check_input_valid=None), TypeError,
     "check_input_valid"),
]
for _name, _change, _cls, _arg in _FMHA_RUN_ERRORS:
    for _fn in ("fmha", "fmha_sm100"):
        _add(f"{_fn}: {_name}", _fn, ["fmha_dense"], _fmha_make(_change, fn=_fn),
             Error(_cls, _arg))


def _kvi(edit):
    def change(a, r, p):
        t = r["kv_indices"].clone()
        edit(t)
        return dict(kv_indices=t)
    return change


for _fn in ("fmha", "fmha_sm100"):
    _add(f"{_fn}: kv_indices past the pool", _fn, ["fmha_dense"],
         _fmha_make(_kvi(lambda t: t[1].fill_(1 << 20)), fn=_fn, paged=True),
         Invalid("kv_indices"))
    _add(f"{_fn}: kv_indices negative", _fn, ["fmha_dense"],
         _fmha_make(_kvi(lambda t: t[0].fill_(-1)), fn=_fn, paged=True), Invalid("kv_indices"))
    for _paged in (False, True):
        _tag = " (paged)" if _paged else ""
        _add(f"{_fn}: valid{_tag}", _fn, ["fmha_dense"], _fmha_make(fn=_fn, paged=_paged),
             Same())
        _add(f"{_fn}: nan in q{_tag}", _fn, ["fmha_dense"],
             _fmha_make(fn=_fn, paged=_paged, nonfinite=20), NonFinite(lse_too=False))
        _add(f"{_fn}: offsets leaving rows empty{_tag}", _fn, ["fmha_dense"],
             _fmha_make(lambda a, r, p: dict(q_offset_override=_T(-3, -30)), fn=_fn,
                        paged=_paged), Same())
        _add(f"{_fn}: huge offset{_tag}", _fn, ["fmha_dense"],
             _fmha_make(lambda a, r, p: dict(q_offset_override=1 << 30), fn=_fn, paged=_paged),
             Same())

_SPARSE_RUN = [
    ("kv_block_indexes None", lambda a, r, p: dict(kv_block_indexes=None),
     Error(ValueError, "kv_block_indexes")),
    ("kv_block_indexes int64", lambda a, r, p: dict(kv_block_indexes=r["kv_block_indexes"]
                                                    .long()), Error(TypeError,
                                                                    "kv_block_indexes")),
    ("kv_block_indexes shape", lambda a, r, p: dict(kv_block_indexes=r["kv_block_indexes"]
                                                    [:, :, :2].contiguous()),
     Error(ValueError, "kv_block_indexes")),
    ("kv_indices short", lambda a, r, p: dict(kv_indices=r["kv_indices"][:2]),
     Error(ValueError, "kv_indices")),
    ("kv_indices past the pool", _kvi(lambda t: t[1].fill_(1 << 20)),
     Invalid("kv_indices", reference_arg="page_table")),
    ("page_table page past the pool", lambda a, r, p: dict(page_table=_i32(
        [[0, 0, 0], [1 << 20, 1, 2]], a["q"].device)), Invalid("page_table")),
    ("kv_block_indexes descending", lambda a, r, p: dict(
        kv_block_indexes=r["kv_block_indexes"].flip(-1).contiguous()),
     Skip("kv_block_indexes")),
    ("kv_block_indexes past the request", lambda a, r, p: dict(
        kv_block_indexes=r["kv_block_indexes"].clone().index_fill_(
            0, torch.tensor([30], device=a["q"].device), 9)), Skip("kv_block_indexes")),
    ("kv_block_indexes -2", lambda a, r, p: dict(
        kv_block_indexes=r["kv_block_indexes"].clone().index_fill_(
            0, torch.tensor([7], device=a["q"].device), -2)), Skip("kv_block_indexes")),
    ("valid", lambda a, r, p: {}, Same()),
]
for _fn in ("fmha", "sparse_fmha"):
    for _name, _change, _expect in _SPARSE_RUN:
        _add(f"{_fn}: sparse {_name}", _fn, ["build_k2q_csr", "sparse_atten"],
             _fmha_make(_change, fn=_fn, sparse=True, q_lens=(40, 60), kv_lens=(300, 250)),
             _expect)
_add("sparse_fmha: nan in q", "sparse_fmha", ["build_k2q_csr", "sparse_atten"],
     _fmha_make(fn="sparse_fmha", sparse=True, q_lens=(40, 60), kv_lens=(300, 250),
                nonfinite=70), NonFinite(lse_too=False))


# ---------------------------------------------------------------------------------------------
# NVFP4 helpers
# ---------------------------------------------------------------------------------------------

def _quant_make(call_of, *, shape=(32, 128), poison=()):
    """call_of(x) -> the call; poison: ((row, col, value), ...) written into x (row 0, col 0 is
    pinned to the tensor's max so the global scale does not depend on the poisoned elements)."""
    def make(device, gen):
        x = _randn(shape, gen).to(device)
        x.view(-1, x.shape[-1])[0, 0] = 8.0
        made = Made(None, [x])
        if poison:
            clean = x.clone()
            made.clean = call_of(clean)
            flat = x.clone()
            view = flat.view(-1, x.shape[-1])
            affected = torch.zeros(view.shape, dtype=torch.bool)
            for r, c, value in poison:
                view[r, c] = value
                affected[r, (c // 16) * 16:(c // 16 + 1) * 16] = True
            x = flat
            made.inputs = [x]
            made.affected = affected.view(shape)
            made.unaffected = ~made.affected
        made.call = call_of(x)
        return made
    return make


_dq = msa.dequantize_nvfp4_128x4_to_bf16
_QUANT = "quantize_bf16_to_nvfp4_128x4"
_KV_QUANT = "quantize_kv_bf16_to_nvfp4_128x4"
for _name, _call_of, _cls, _arg in [
        ("fp32 input", lambda x: lambda: msa.quantize_bf16_to_nvfp4_128x4(x.float()), TypeError,
         "x"),
        ("rank 1", lambda x: lambda: msa.quantize_bf16_to_nvfp4_128x4(x[0]), ValueError, "x"),
        ("D not a multiple of 16", lambda x: lambda: msa.quantize_bf16_to_nvfp4_128x4(
            x[:, :120]), ValueError, "x"),
        ("rows not a multiple of 16", lambda x: lambda: msa.quantize_bf16_to_nvfp4_128x4(
            x[:24]), ValueError, "x"),
        ("list input", lambda x: lambda: msa.quantize_bf16_to_nvfp4_128x4(x.tolist()),
         TypeError, "x")]:
    _add(f"{_QUANT}: {_name}", _QUANT, (), _quant_make(_call_of), Error(_cls, _arg))
for _name, _call_of, _cls, _arg in [
        ("v rows", lambda x: lambda: msa.quantize_kv_bf16_to_nvfp4_128x4(x, x[:8]), ValueError,
         "v"),
        ("k fp32", lambda x: lambda: msa.quantize_kv_bf16_to_nvfp4_128x4(x.float(), x),
         TypeError, "k")]:
    _add(f"{_KV_QUANT}: {_name}", _KV_QUANT, (), _quant_make(_call_of), Error(_cls, _arg))
for _name, _call_of, _cls, _arg in [
        ("not a quantized tensor", lambda x: lambda: _dq(x), TypeError, "qx"),
        ("scale too short", lambda x: lambda: _dq(dataclasses.replace(
            msa.quantize_bf16_to_nvfp4_128x4(x),
            scale_128x4=msa.quantize_bf16_to_nvfp4_128x4(x).scale_128x4[:64])), ValueError,
         "qx.scale_128x4")]:
    _add(f"dequantize_nvfp4_128x4_to_bf16: {_name}", "dequantize_nvfp4_128x4_to_bf16", (),
         _quant_make(_call_of), Error(_cls, _arg))
for _name, _call_of, _cls, _arg in [
        ("logical scale shape", lambda x: lambda: _dq(dataclasses.replace(
            msa.quantize_bf16_to_nvfp4_128x4(x), logical_scale_shape=(3, 8))), ValueError,
         "qx.logical_scale_shape"),
        ("data shape", lambda x: lambda: _dq(dataclasses.replace(
            msa.quantize_bf16_to_nvfp4_128x4(x), original_shape=(32, 256),
            logical_scale_shape=(32, 16))), ValueError, "qx.data"),
        ("global scale fp64", lambda x: lambda: _dq(dataclasses.replace(
            msa.quantize_bf16_to_nvfp4_128x4(x),
            global_scale=torch.ones(1, dtype=torch.float64, device=x.device))), TypeError,
         "qx.global_scale")]:
    _add(f"Nvfp4QuantizedTensor: {_name}", "Nvfp4QuantizedTensor", (), _quant_make(_call_of),
         Error(_cls, _arg))
for _name, _call_of, _cls, _arg in [
        ("size mismatch", lambda x: lambda: msa.swizzle_nvfp4_scale_to_128x4(
            torch.ones(10, 8, dtype=torch.uint8, device=x.device), rows=10, cols=4),
         ValueError, "scale"),
        ("fp32 scales", lambda x: lambda: msa.swizzle_nvfp4_scale_to_128x4(
            torch.ones(10, 8, device=x.device), rows=10, cols=8), TypeError, "scale"),
        ("rows 0", lambda x: lambda: msa.swizzle_nvfp4_scale_to_128x4(
            torch.ones(0, dtype=torch.uint8, device=x.device), rows=0, cols=8), ValueError,
         "rows")]:
    _add(f"swizzle_nvfp4_scale_to_128x4: {_name}", "swizzle_nvfp4_scale_to_128x4", (),
         _quant_make(_call_of), Error(_cls, _arg))
for _name, _call_of, _cls, _arg in [
        ("string", lambda x: lambda: msa.nvfp4_global_scale_from_amax("8"), TypeError, "amax"),
        ("bool tensor", lambda x: lambda: msa.nvfp4_global_scale_from_amax(x > 0), TypeError,
         "amax")]:
    _add(f"nvfp4_global_scale_from_amax: {_name}", "nvfp4_global_scale_from_amax", (),
         _quant_make(_call_of), Error(_cls, _arg))
_add("nvfp4_global_scale_from_amax: nan and inf", "nvfp4_global_scale_from_amax", (),
     _quant_make(lambda x: lambda: msa.nvfp4_global_scale_from_amax(
         torch.tensor([NAN, INF, 0.0, 6.0], device=x.device))), Same())
_add(f"{_QUANT}: all zeros", _QUANT, (),
     _quant_make(lambda x: lambda: _dq(msa.quantize_bf16_to_nvfp4_128x4(x * 0))), Same())
_add(f"{_QUANT}: valid 3-D", _QUANT, (),
     _quant_make(lambda x: lambda: _dq(msa.quantize_bf16_to_nvfp4_128x4(x)), shape=(4, 16, 128)),
     Same())
_add("swizzle_nvfp4_scale_to_128x4: valid", "swizzle_nvfp4_scale_to_128x4", (),
     _quant_make(lambda x: lambda: msa.swizzle_nvfp4_scale_to_128x4(
         (x[:10, :8] * 10).to(E4M3), rows=10, cols=8)), Same())
for _name, _poison in (("one nan", ((3, 17, NAN),)), ("one inf", ((20, 100, INF),)),
                       ("-inf and nan", ((5, 0, -INF), (31, 127, NAN))),
                       ("nan in the max block", ((0, 1, NAN),))):
    _add(f"{_QUANT}: {_name}", _QUANT, (),
         _quant_make(lambda x: lambda: _dq(msa.quantize_bf16_to_nvfp4_128x4(x)),
                     poison=_poison), NonFinite(lse_too=False))
    _add(f"{_KV_QUANT}: {_name}", _KV_QUANT, (),
         _quant_make(lambda x: lambda: _dq(msa.quantize_kv_bf16_to_nvfp4_128x4(x, x)[1]),
                     poison=_poison), NonFinite(lse_too=False))


# ---------------------------------------------------------------------------------------------
# MsaPrefillPagedWrapper (plan from host lengths, run over paged K/V and index-K caches)
# ---------------------------------------------------------------------------------------------

PAGED_PREFILL = "MsaPrefillPagedWrapper"
_PREFILL_STAGES = ("block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten")
_CTOR_ARGS = ("topk", "local_blocks", "causal", "partial_dtype", "workspace_bytes")
_PLAN_ARGS = ("qo_lens", "kv_lens", "page_table", "num_qo_heads", "num_kv_heads", "head_dim",
              "index_page_table", "max_chunk_tokens", "check_input_valid")


def page_table_for(lens, gen, *, spare=2, extra_width=1) -> Tuple[torch.Tensor, int]:
    """(page_table [B, max_pages + extra_width] int32, pool size): each request's pages at
    random distinct ids of a pool with `spare` unused pages; the entries past a request's pages
    are random junk (never read)."""
    pages_b = [-(-n // BLOCK) for n in lens]
    num_pages = sum(pages_b) + spare
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.randint(-(1 << 20), 1 << 20, (len(lens), max(max(pages_b), 1) + extra_width),
                          generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_b):
        table[b, :n] = perm[used:used + n]
        used += n
    return table, num_pages


def _paged_prefill_make(change=None, *, qo=(140, 40), kv=(700, 40), hq=8, hkv=2, dtype=BF16,
                        kv_dtype=None, separate_index=False, poison=None):
    """A valid MsaPrefillPagedWrapper(topk=4) plan + run (O, LSE); change(a) -> overrides of
    constructor, plan or run arguments (routed by name). poison: (argument, value) written into
    query row 30 (q, q_idx) or the last key of request 0 (k_cache, v_cache)."""
    def make(device, gen):
        table, num_pages = page_table_for(kv, gen)
        a = dict(qo_lens=list(qo), kv_lens=list(kv), page_table=table,
                 num_qo_heads=hq, num_kv_heads=hkv, topk=4,
                 q=_randn((sum(qo), hq, D), gen, dtype),
                 k_cache=_randn((num_pages, hkv, BLOCK, D), gen, kv_dtype or dtype),
                 v_cache=_randn((num_pages, hkv, BLOCK, D), gen, kv_dtype or dtype),
                 q_idx=_randn((sum(qo), hkv, D), gen, dtype),
                 k_idx_cache=_randn((num_pages, 1, BLOCK, D), gen, dtype), return_lse=True)
        if separate_index:
            a["index_page_table"], index_pages = page_table_for(kv, gen, spare=5)
            a["k_idx_cache"] = _randn((index_pages, 1, BLOCK, D), gen, dtype)
        a = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in a.items()}

        def call_of(a):
            def call():
                ctor = {n: a[n] for n in _CTOR_ARGS if n in a}
                plan = {n: a[n] for n in _PLAN_ARGS if n in a}
                run = {n: x for n, x in a.items() if n not in _CTOR_ARGS and n not in _PLAN_ARGS}
                return msa.MsaPrefillPagedWrapper(**ctor).plan(
                    plan.pop("qo_lens"), plan.pop("kv_lens"), plan.pop("page_table"),
                    **plan).run(**run)
            return call
        clean = call_of(dict(a))
        a.update(change(a) if change is not None else {})
        made = Made(None)
        if poison is not None:
            which, value = poison
            made.clean = clean
            t = a[which].clone()
            affected = torch.zeros(sum(qo), hq, dtype=torch.bool)
            unaffected = torch.ones_like(affected)
            group = slice(hkv // 2 * (hq // hkv), (hkv // 2 + 1) * (hq // hkv))  # KV head hkv//2
            if which in ("q", "q_idx"):
                t[30, 1, 3] = value
                if which == "q":
                    affected[30, 1] = True
                    unaffected[30, 1] = False
            else:
                # The last key of request 0: only its last query sees it (its own block, always
                # selected); queries whose own block is earlier never select that block.
                j = kv[0] - 1
                t[int(table[0, j // BLOCK]), hkv // 2, j % BLOCK, 5] = value
                last = qo[0] - 1
                affected[last, group] = True
                if which == "k_cache":
                    unaffected[last, group] = False
                else:
                    own_block_rows = torch.arange(qo[0]) + kv[0] - qo[0] >= j // BLOCK * BLOCK
                    unaffected[:qo[0], group] = ~own_block_rows.view(-1, 1)
                    made.channels = [5]
            a[which] = t
            if which != "q_idx":
                made.affected, made.unaffected = affected, unaffected
        made.call = call_of(a)
        made.inputs = _inputs(a)
        return made
    return make


def _inputs(a: Dict[str, Any]) -> List[torch.Tensor]:
    """The call's input tensors (not the preallocated outputs it writes)."""
    return [x for n, x in a.items() if isinstance(x, torch.Tensor) and n not in ("out", "lse")]


def _arg_edit(name, edit):
    """Overrides with a clone of argument `name` edited in place."""
    def change(a):
        t = a[name].clone()
        edit(t)
        return {name: t}
    return change


_PAGED_PREFILL_ERRORS = [
    ("topk 12", lambda a: dict(topk=12), ValueError, "topk"),
    ("topk float", lambda a: dict(topk=4.0), TypeError, "topk"),
    ("local_blocks past topk", lambda a: dict(local_blocks=5), ValueError, "local_blocks"),
    ("local_blocks -1", lambda a: dict(local_blocks=-1), ValueError, "local_blocks"),
    ("causal string", lambda a: dict(causal="yes"), TypeError, "causal"),
    ("partial fp64", lambda a: dict(partial_dtype=torch.float64), TypeError, "partial_dtype"),
    ("workspace_bytes 0", lambda a: dict(workspace_bytes=0), ValueError, "workspace_bytes"),
    ("plan qo_lens empty", lambda a: dict(qo_lens=[], kv_lens=[]), ValueError, "qo_lens"),
    ("plan kv_lens short", lambda a: dict(kv_lens=a["kv_lens"][:1]), ValueError, "kv_lens"),
    ("plan qo_lens negative", lambda a: dict(qo_lens=[140, -1]), ValueError, "qo_lens"),
    ("plan qo_lens float", lambda a: dict(qo_lens=[140.0, 40]), TypeError, "qo_lens"),
    ("plan kv_lens 2-D tensor", lambda a: dict(kv_lens=torch.tensor([[700, 40]])), ValueError,
     "kv_lens"),
    ("plan kv_lens not a sequence", lambda a: dict(kv_lens=700), TypeError, "kv_lens"),
    ("plan page_table int64", lambda a: dict(page_table=a["page_table"].long()), TypeError,
     "page_table"),
    ("plan page_table rows", lambda a: dict(page_table=a["page_table"][:1]), ValueError,
     "page_table"),
    ("plan page_table narrow", lambda a: dict(page_table=a["page_table"][:, :3]), ValueError,
     "page_table"),
    ("plan page_table a list", lambda a: dict(page_table=a["page_table"].tolist()), TypeError,
     "page_table"),
    ("plan index_page_table narrow", lambda a: dict(index_page_table=a["page_table"][:, :2]),
     ValueError, "index_page_table"),
    ("plan G = 3", lambda a: dict(num_qo_heads=6), NotImplementedError, "num_qo_heads"),
    ("plan heads not a multiple", lambda a: dict(num_qo_heads=5), ValueError, "num_qo_heads"),
    ("plan num_kv_heads 0", lambda a: dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    ("plan head_dim 64", lambda a: dict(head_dim=64), NotImplementedError, "head_dim"),
    ("plan max_chunk_tokens 0", lambda a: dict(max_chunk_tokens=0), ValueError,
     "max_chunk_tokens"),
    ("plan check_input_valid string", lambda a: dict(check_input_valid="yes"), TypeError,
     "check_input_valid"),
    ("run q fp16", lambda a: dict(q=a["q"].half()), TypeError, "q"),
    ("run q rows", lambda a: dict(q=a["q"][:-1]), ValueError, "q"),
    ("run q heads", lambda a: dict(q=a["q"][:, :4].contiguous()), ValueError, "q"),
    ("run q head dim 64", lambda a: dict(q=a["q"][..., :64].contiguous()), NotImplementedError,
     "q"),
    ("run q not contiguous", lambda a: dict(q=a["q"].transpose(0, 1).contiguous()
                                           .transpose(0, 1)), ValueError, "q"),
    ("run fp8 q with bf16 caches", lambda a: dict(q=a["q"].to(E4M3)), TypeError, "k_cache"),
    ("run v_cache dtype", lambda a: dict(v_cache=a["v_cache"].to(E4M3)), TypeError, "v_cache"),
    ("run v_cache pages", lambda a: dict(v_cache=a["v_cache"][:-1]), ValueError, "v_cache"),
    ("run k_cache heads", lambda a: dict(k_cache=a["k_cache"][:, :1].contiguous(),
                                         v_cache=a["v_cache"][:, :1].contiguous()), ValueError,
     "k_cache"),
    ("run k_cache page 64", lambda a: dict(k_cache=a["k_cache"][:, :, :64].contiguous(),
                                           v_cache=a["v_cache"][:, :, :64].contiguous()),
     ValueError, "k_cache"),
    ("run k_cache dense", lambda a: dict(k_cache=a["k_cache"][:, :, 0], v_cache=a["v_cache"]
                                         [:, :, 0]), ValueError, "k_cache"),
    ("run q_idx heads", lambda a: dict(q_idx=a["q_idx"][:, :1].contiguous()), ValueError,
     "q_idx"),
    ("run q_idx fp16", lambda a: dict(q_idx=a["q_idx"].half()), TypeError, "q_idx"),
    ("run k_idx_cache dtype", lambda a: dict(k_idx_cache=a["k_idx_cache"].to(E4M3)), TypeError,
     "k_idx_cache"),
    ("run k_idx_cache two heads", lambda a: dict(k_idx_cache=a["k_idx_cache"].repeat(
        1, 2, 1, 1)), ValueError, "k_idx_cache"),
    ("run softmax_scale negative", lambda a: dict(softmax_scale=-1.0), ValueError,
     "softmax_scale"),
    ("run index_scale 0", lambda a: dict(index_scale=0.0), ValueError, "index_scale"),
    ("run index_scale nan", lambda a: dict(index_scale=NAN), ValueError, "index_scale"),
    ("run out fp32", lambda a: dict(out=torch.empty(a["q"].shape, device=a["q"].device)),
     TypeError, "out"),
    ("run lse shape", lambda a: dict(lse=torch.empty(3, device=a["q"].device)), ValueError,
     "lse"),
]
for _name, _change, _cls, _arg in _PAGED_PREFILL_ERRORS:
    _add(f"{PAGED_PREFILL}: {_name}", PAGED_PREFILL, _PREFILL_STAGES,
         _paged_prefill_make(_change), Error(_cls, _arg))


def _paged_prefill_run_before_plan(device, gen):
    q = _randn((4, 8, D), gen).to(device)
    return Made(lambda: msa.MsaPrefillPagedWrapper().run(q, q, q, q, q), [q])


_add(f"{PAGED_PREFILL}: run before plan", PAGED_PREFILL, (), _paged_prefill_run_before_plan,
     Error(RuntimeError, "run"))

_PAGED_PREFILL_VALUES = [
    ("page id past the pool", _arg_edit("page_table", lambda t: t[0, 2].fill_(1 << 24)),
     Invalid("page_table"), {}),
    ("page id negative", _arg_edit("page_table", lambda t: t[1, 0].fill_(-3)),
     Invalid("page_table"), {}),
    ("index-K pool smaller than the shared table's ids", lambda a: dict(
        k_idx_cache=a["k_idx_cache"][:3].contiguous()), Invalid("page_table"), {}),
    ("index page id past the index pool", _arg_edit("index_page_table",
                                                  lambda t: t[0, 5].fill_(1 << 20)),
     Invalid("index_page_table"), dict(separate_index=True)),
    ("index page id INT32_MIN", _arg_edit("index_page_table", lambda t: t[1, 0].fill_(-(1 << 31))),
     Invalid("index_page_table"), dict(separate_index=True)),
    ("valid", None, Same(), {}),
    ("separate index page table", None, Same(), dict(separate_index=True)),
    ("query chunks of 64", lambda a: dict(max_chunk_tokens=64), Same(), {}),
    ("indexer key splits", None, Same(), dict(qo=(40,), kv=(1200,))),
    ("more queries than keys", None, Same(), dict(qo=(50, 10), kv=(20, 10))),
    ("request without queries", None, Same(), dict(qo=(140, 0, 40), kv=(700, 300, 40))),
    ("request without keys", None, Same(), dict(qo=(140, 0), kv=(700, 0))),
    ("e4m3", None, Same(), dict(dtype=E4M3)),
    ("bf16 q with e4m3 caches", None, Same(), dict(kv_dtype=E4M3)),
    ("partial fp32", lambda a: dict(partial_dtype=torch.float32), Same(), {}),
    ("topk 16, local_blocks 2", lambda a: dict(topk=16, local_blocks=2), Same(), {}),
    ("non-causal", lambda a: dict(causal=False), Same(), {}),
    ("G = 16", None, Same(), dict(hq=32)),
    ("G = 1", None, Same(), dict(hq=2)),
    ("scales", lambda a: dict(softmax_scale=0.05, index_scale=2.0), Same(), {}),
    ("preallocated out and lse", lambda a: dict(
        out=torch.empty(a["q"].shape, dtype=BF16, device=a["q"].device),
        lse=torch.empty(a["q"].shape[:2], device=a["q"].device)), Same(), {}),
]
for _name, _change, _expect, _problem in _PAGED_PREFILL_VALUES:
    _add(f"{PAGED_PREFILL}: {_name}", PAGED_PREFILL, _PREFILL_STAGES,
         _paged_prefill_make(_change, **_problem), _expect)
_add(f"{PAGED_PREFILL}: no queries at all", PAGED_PREFILL, (),           # no stage runs
     _paged_prefill_make(qo=(0, 0), kv=(700, 40)), Same())
for _which in ("q", "k", "v"):
    _add(f"{PAGED_PREFILL}: nan in {_which}", PAGED_PREFILL, _PREFILL_STAGES,
         _paged_prefill_make(poison=(_which if _which == "q" else f"{_which}_cache", NAN)),
         NonFinite(lse_too=_which != "v"))
# NaN index data only changes which blocks a row selects (never NaN ones): the same selection
# and output on every backend.
_add(f"{PAGED_PREFILL}: nan in q_idx", PAGED_PREFILL, _PREFILL_STAGES,
     _paged_prefill_make(poison=("q_idx", NAN)), Same())


# ---------------------------------------------------------------------------------------------
# decode_indexer_topk / make_decode_indexer_plan / DecodeIndexerPlan
# ---------------------------------------------------------------------------------------------

INDEXER = "decode_indexer_topk"
MAKE_PLAN = "make_decode_indexer_plan"
INDEXER_PLAN = "DecodeIndexerPlan"
_UPDATE_OP = "decode_indexer_plan_update"
_INDEXER_OPS = (_UPDATE_OP, INDEXER)
_INDEX_PLAN_ARGS = ("seqused_k", "seqlen_q", "num_index_heads", "max_seqlen_k", "topk",
                    "max_ctas")
# E4M3 bytes of the NVFP4 block scales 0.5, 1 and 2, and a NaN byte.
_E4M3_SCALES = torch.tensor([0x30, 0x38, 0x40], dtype=torch.uint8)
_E4M3_NAN = 0x7F
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def _integers(shape, gen, bound, dtype):
    """Integer-valued data in [-bound, bound]: every index score is exact in fp32 on every
    backend (the selection then cannot differ by rounding)."""
    return torch.randint(-bound, bound + 1, shape, generator=gen).to(dtype)


def index_data(num_pages, rows, heads, fmt, gen, layout="128x4") -> Dict[str, Any]:
    """q_idx [rows, heads, 128] and a one-head paged index-K cache of `num_pages` pages: bf16,
    e4m3, or NVFP4 (random E2M1 codes, block scales 0.5 / 1 / 2, global scale 2) with e4m3
    queries."""
    if fmt == "bf16":
        return dict(q_idx=_integers((rows, heads, D), gen, 64, BF16),
                    k_idx=_integers((num_pages, 1, BLOCK, D), gen, 64, BF16))
    data = dict(q_idx=_integers((rows, heads, D), gen, 16, E4M3))
    if fmt == "e4m3":
        data["k_idx"] = _integers((num_pages, 1, BLOCK, D), gen, 16, E4M3)
        return data
    scales = _E4M3_SCALES[torch.randint(0, 3, (num_pages * BLOCK * 8,), generator=gen)]
    data.update(k_idx=torch.randint(0, 256, (num_pages, 1, BLOCK, D // 2), generator=gen,
                                    dtype=torch.uint8),
                k_scale=scales.view(num_pages, 1, BLOCK, 8) if layout == "linear" else scales,
                k_global_scale=torch.tensor([2.0]), k_scale_layout=layout)
    return data


def _indexer_make(change=None, *, lens=(300, 129, 1000), seqlen_q=2, heads=2, fmt="bf16",
                  layout="128x4", topk=8, planned_lens=None, plan_only=False):
    """A valid make_decode_indexer_plan + decode_indexer_topk call returning (selection,
    scores); change(a) -> overrides (plan or indexer arguments, by name; "plan" replaces the
    plan). planned_lens: the plan is made (and updated) for these lengths, then its seqused_k
    takes the real ones without an update. plan_only: the call returns the plan."""
    def make(device, gen):
        table, num_pages = page_table_for(lens, gen)
        a = dict(seqused_k=torch.tensor(lens, dtype=torch.int32), seqlen_q=seqlen_q,
                 num_index_heads=heads, max_seqlen_k=max(max(lens), 1), topk=topk,
                 page_table=table, return_scores=True,
                 **index_data(num_pages, len(lens) * seqlen_q, heads, fmt, gen, layout))
        a = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in a.items()}
        a.update(change(a) if change is not None else {})

        def call():
            plan = a.get("plan")
            if plan is None:
                kw = {n: a[n] for n in _INDEX_PLAN_ARGS if n in a}
                lens_t = kw.pop("seqused_k")
                if planned_lens is None:
                    # The plan keeps its lengths: a copy, so the call does not write its input.
                    plan = msa.make_decode_indexer_plan(
                        lens_t.clone() if isinstance(lens_t, torch.Tensor) else lens_t, **kw)
                else:
                    plan = msa.make_decode_indexer_plan(_i32(planned_lens, lens_t.device), **kw)
                    plan.seqused_k.copy_(lens_t)
            if plan_only:
                return plan
            kw = {n: x for n, x in a.items() if n not in _INDEX_PLAN_ARGS and n != "plan"}
            return msa.decode_indexer_topk(plan=plan, **kw)
        return Made(call, _inputs(a))
    return make


_INDEXER_ERRORS = [
    ("plan not a plan", lambda a: dict(plan=object()), TypeError, "plan"),
    ("plan of another batch", lambda a: dict(plan=msa.make_decode_indexer_plan(
        a["seqused_k"][:2], seqlen_q=2, num_index_heads=2, max_seqlen_k=1000, topk=8)),
     ValueError, "q_idx"),
    ("q_idx fp16", lambda a: dict(q_idx=a["q_idx"].half()), TypeError, "q_idx"),
    ("q_idx rows", lambda a: dict(q_idx=a["q_idx"][:-1]), ValueError, "q_idx"),
    ("q_idx heads", lambda a: dict(q_idx=a["q_idx"][:, :1].contiguous()), ValueError, "q_idx"),
    ("q_idx head dim 64", lambda a: dict(q_idx=a["q_idx"][..., :64].contiguous()), ValueError,
     "q_idx"),
    ("q_idx not contiguous", lambda a: dict(q_idx=a["q_idx"].transpose(0, 1).contiguous()
                                            .transpose(0, 1)), ValueError, "q_idx"),
    ("k_idx two heads", lambda a: dict(k_idx=a["k_idx"].repeat(1, 2, 1, 1)), ValueError,
     "k_idx"),
    ("k_idx fp32", lambda a: dict(k_idx=a["k_idx"].float()), TypeError, "k_idx"),
    ("k_idx page 64", lambda a: dict(k_idx=a["k_idx"][:, :, :64].contiguous()), ValueError,
     "k_idx"),
    ("k_idx no pages", lambda a: dict(k_idx=a["k_idx"][:0]), ValueError, "k_idx"),
    ("k_idx rank 3", lambda a: dict(k_idx=a["k_idx"][:, 0]), ValueError, "k_idx"),
    ("k_scale_layout tiled", lambda a: dict(k_scale_layout="tiled"), ValueError,
     "k_scale_layout"),
    ("k_scale with bf16 keys", lambda a: dict(k_scale=torch.zeros(
        a["k_idx"].shape[0] * 1024, dtype=torch.uint8, device=a["k_idx"].device)), ValueError,
     "k_scale"),
    ("k_global_scale with bf16 keys", lambda a: dict(k_global_scale=torch.ones(
        1, device=a["k_idx"].device)), ValueError, "k_global_scale"),
    ("page_table int64", lambda a: dict(page_table=a["page_table"].long()), TypeError,
     "page_table"),
    ("page_table rows", lambda a: dict(page_table=a["page_table"][:1]), ValueError,
     "page_table"),
    ("page_table without columns", lambda a: dict(page_table=a["page_table"][:, :0]),
     ValueError, "page_table"),
    ("scale 0", lambda a: dict(scale=0.0), ValueError, "scale"),
    ("scale nan", lambda a: dict(scale=NAN), ValueError, "scale"),
    ("scale tensor", lambda a: dict(scale=torch.tensor(1.0)), TypeError, "scale"),
    ("out int64", lambda a: dict(out=torch.zeros(2, 6, 8, dtype=torch.int64,
                                                 device=a["q_idx"].device)), TypeError, "out"),
    ("out topk 4", lambda a: dict(out=torch.zeros(2, 6, 4, dtype=torch.int32,
                                                  device=a["q_idx"].device)), ValueError, "out"),
    ("out heads not a multiple", lambda a: dict(out=torch.zeros(
        3, 6, 8, dtype=torch.int32, device=a["q_idx"].device)), ValueError, "out"),
    ("check_input_valid string", lambda a: dict(check_input_valid="yes"), TypeError,
     "check_input_valid"),
]
for _name, _change, _cls, _arg in _INDEXER_ERRORS:
    _add(f"{INDEXER}: {_name}", INDEXER, _INDEXER_OPS, _indexer_make(_change),
         Error(_cls, _arg))
for _name, _change, _cls, _arg in [
        ("nvfp4 without k_scale", lambda a: dict(k_scale=None), ValueError, "k_scale"),
        ("k_scale short", lambda a: dict(k_scale=a["k_scale"][:-1]), ValueError, "k_scale"),
        ("k_scale fp32", lambda a: dict(k_scale=a["k_scale"].float()), TypeError, "k_scale"),
        ("k_global_scale fp64", lambda a: dict(k_global_scale=a["k_global_scale"].double()),
         TypeError, "k_global_scale"),
        ("k_global_scale empty", lambda a: dict(k_global_scale=a["k_global_scale"][:0]),
         ValueError, "k_global_scale")]:
    _add(f"{INDEXER}: {_name}", INDEXER, _INDEXER_OPS, _indexer_make(_change, fmt="nvfp4"),
         Error(_cls, _arg))

_MAKE_PLAN_ERRORS = [
    ("seqused_k int64", lambda a: dict(seqused_k=a["seqused_k"].long()), TypeError,
     "seqused_k"),
    ("seqused_k 2-D", lambda a: dict(seqused_k=a["seqused_k"].view(1, -1)), ValueError,
     "seqused_k"),
    ("seqused_k empty", lambda a: dict(seqused_k=a["seqused_k"][:0]), ValueError, "seqused_k"),
    ("seqused_k a list", lambda a: dict(seqused_k=[300, 129, 1000]), TypeError, "seqused_k"),
    ("seqlen_q 17", lambda a: dict(seqlen_q=17), NotImplementedError, "seqlen_q"),
    ("seqlen_q 0", lambda a: dict(seqlen_q=0), ValueError, "seqlen_q"),
    ("seqlen_q float", lambda a: dict(seqlen_q=2.0), TypeError, "seqlen_q"),
    ("num_index_heads 0", lambda a: dict(num_index_heads=0), ValueError, "num_index_heads"),
    ("rows past 128", lambda a: dict(seqlen_q=16, num_index_heads=16), NotImplementedError,
     "num_index_heads"),
    ("max_seqlen_k 0", lambda a: dict(max_seqlen_k=0), ValueError, "max_seqlen_k"),
    ("max_seqlen_k None", lambda a: dict(max_seqlen_k=None), TypeError, "max_seqlen_k"),
    ("topk 12", lambda a: dict(topk=12), ValueError, "topk"),
    ("topk bool", lambda a: dict(topk=True), TypeError, "topk"),
    ("max_ctas 0", lambda a: dict(max_ctas=0), ValueError, "max_ctas"),
    ("max_ctas float", lambda a: dict(max_ctas=1.5), TypeError, "max_ctas"),
]
for _name, _change, _cls, _arg in _MAKE_PLAN_ERRORS:
    _add(f"{MAKE_PLAN}: {_name}", MAKE_PLAN, (_UPDATE_OP,),
         _indexer_make(_change, plan_only=True), Error(_cls, _arg))


def _fill(index, value):
    return lambda t: t.__setitem__(index, value)


def _poison_key(value, *, block=1, slot=17, channel=3):
    """`value` into one key of request 2's history block `block` (bf16 / e4m3 keys)."""
    def change(a):
        k = a["k_idx"].clone()
        k[int(a["page_table"][2, block]), 0, slot, channel] = value
        return dict(k_idx=k)
    return change


def _poison_scale(a):
    """A NaN E4M3 block scale in request 2's history block 1 (16 channels of one key)."""
    s = a["k_scale"].clone()
    s.view(-1)[int(a["page_table"][2, 1]) * 1024 + 37] = _E4M3_NAN
    return dict(k_scale=s)


_INDEXER_VALUES = [
    ("history page id past the pool", _arg_edit("page_table", _fill((2, 3), 1 << 24)),
     Invalid("page_table"), {}),
    ("page id negative", _arg_edit("page_table", _fill((0, 0), -1)), Invalid("page_table"), {}),
    ("own block page id past the pool", _arg_edit("page_table", _fill((0, 2), 1 << 24)),
     Invalid("page_table"), {}),
    ("seqused_k negative", _arg_edit("seqused_k", _fill(1, -5)), Invalid("seqused_k"), {}),
    ("seqused_k past the page table", _arg_edit("seqused_k", _fill(0, 1 << 30)),
     Invalid("seqused_k"), {}),
    ("seqused_k INT32_MIN", _arg_edit("seqused_k", _fill(2, INT32_MIN)), Invalid("seqused_k"), {}),
    ("seqused_k past max_seqlen_k", _arg_edit("seqused_k", _fill(1, 1100)),
     Invalid("max_seqlen_k"), {}),
    ("valid", None, Same(), {}),
    ("seqused_k 0", _arg_edit("seqused_k", _fill(1, 0)), Same(), {}),
    ("seqused_k below seqlen_q", _arg_edit("seqused_k", _fill(1, 1)), Same(), {}),
    ("max_seqlen_k larger", lambda a: dict(max_seqlen_k=1 << 20), Same(), {}),
    ("topk 4", None, Same(), dict(topk=4)),
    ("topk 16", None, Same(), dict(topk=16)),
    ("topk 32", None, Same(), dict(topk=32, lens=(300, 129, 5000))),
    ("one query, 4 heads", None, Same(), dict(seqlen_q=1, heads=4)),
    ("MTP 16 x 8 heads", None, Same(), dict(seqlen_q=16, heads=8)),
    ("out shared by 2 heads", lambda a: dict(out=torch.full(
        (4, 6, 8), 7, dtype=torch.int32, device=a["q_idx"].device)), Same(), {}),
    ("scale 0.5", lambda a: dict(scale=0.5), Same(), {}),
    ("one CTA", lambda a: dict(max_ctas=1), Same(), {}),
    ("600 CTAs (a many-chunk merge)", lambda a: dict(max_ctas=600), Same(),
     dict(lens=(300, 129, 9000))),
    ("e4m3", None, Same(), dict(fmt="e4m3")),
    ("nvfp4", None, Same(), dict(fmt="nvfp4")),
    ("nvfp4 linear scales", None, Same(), dict(fmt="nvfp4", layout="linear")),
    ("nvfp4 without a global scale", lambda a: dict(k_global_scale=None), Same(),
     dict(fmt="nvfp4")),
    ("nan in q_idx", _arg_edit("q_idx", _fill((1, 0, 5), NAN)), Same(), {}),
    ("-inf in q_idx", _arg_edit("q_idx", _fill((4, 1, 9), -INF)), Same(), {}),
    ("nan in a key", _poison_key(NAN), Same(), {}),
    ("inf in a key", _poison_key(INF), Same(), {}),
    ("nan in every key of a block", lambda a: _poison_key(NAN, slot=slice(None),
                                                          channel=0)(a), Same(), {}),
    ("nan in an e4m3 key", _poison_key(NAN), Same(), dict(fmt="e4m3")),
    ("nan block scale", _poison_scale, Same(), dict(fmt="nvfp4")),
    ("nan global scale", lambda a: dict(k_global_scale=torch.full_like(a["k_global_scale"],
                                                                       NAN)), Same(),
     dict(fmt="nvfp4")),
]
for _name, _change, _expect, _problem in _INDEXER_VALUES:
    _add(f"{INDEXER}: {_name}", INDEXER, _INDEXER_OPS, _indexer_make(_change, **_problem),
         _expect)
# Pairs the kernel does not serve run the reference on every device.
_add(f"{INDEXER}: bf16 q with nvfp4 keys", INDEXER, (),
     _indexer_make(lambda a: dict(q_idx=a["q_idx"].to(BF16)), fmt="nvfp4"), Same())
_add(f"{INDEXER}: e4m3 q with bf16 keys", INDEXER, (),
     _indexer_make(lambda a: dict(q_idx=a["q_idx"].clamp(-16, 16).to(E4M3)), fmt="bf16"),
     Same())

# The plan: its work split (native update kernel vs the host split) for any lengths, and a plan
# that was not updated after the lengths changed (still a correct selection).
_add(f"{INDEXER_PLAN}: split of garbage lengths", INDEXER_PLAN, (_UPDATE_OP,),
     _indexer_make(lambda a: dict(seqused_k=_i32([-5, 1 << 30, 129, INT32_MIN, INT32_MAX],
                                                 a["q_idx"].device), max_ctas=7),
                   plan_only=True), Same())
_add(f"{INDEXER_PLAN}: split of 130 requests at INT32_MAX", INDEXER_PLAN, (_UPDATE_OP,),
     _indexer_make(lambda a: dict(seqused_k=torch.full((130,), INT32_MAX, dtype=torch.int32,
                                                       device=a["q_idx"].device), max_ctas=1),
                   plan_only=True), Same())


def _update_after(edit):
    def make(device, gen):
        lens = _i32([300, 129, 1000], device)

        def call():
            plan = msa.make_decode_indexer_plan(lens.clone(), seqlen_q=2, num_index_heads=2,
                                                max_seqlen_k=1 << 20, max_ctas=5)
            edit(plan.seqused_k)
            return plan.update()
        return Made(call, [lens])
    return make


_add(f"{INDEXER_PLAN}: update after the lengths grew", INDEXER_PLAN, (_UPDATE_OP,),
     _update_after(lambda t: t.add_(70000)), Same())
_add(f"{INDEXER_PLAN}: update after garbage lengths", INDEXER_PLAN, (_UPDATE_OP,),
     _update_after(lambda t: t.copy_(_i32([INT32_MIN, INT32_MAX, -1], t.device))), Same())
for _name, _planned in (("lengths grew", (100, 129, 130)), ("lengths shrank", (300, 0, 9000)),
                        ("garbage planned lengths", (INT32_MIN, INT32_MAX, -7))):
    _add(f"{INDEXER_PLAN}: not updated after the {_name}", INDEXER_PLAN, _INDEXER_OPS,
         _indexer_make(planned_lens=_planned), Same())


# ---------------------------------------------------------------------------------------------
# MSADecodeStepWrapper (decode indexer -> sparse paged decode attention)
# ---------------------------------------------------------------------------------------------

STEP = "MSADecodeStepWrapper"
_STEP_OPS = (_UPDATE_OP, INDEXER, "sparse_decode_atten")
_STEP_PLAN_ARGS = ("page_table", "seqused_k", "seqlen_q", "max_seqlen_k", "num_qo_heads",
                   "num_kv_heads", "num_index_heads", "topk", "max_ctas", "indexer_plan",
                   "check_input_valid")


def _step_make(change=None, *, lens=(300, 129, 1000), seqlen_q=2, hkv=2, group=4,
               index_heads=2, topk=8, dtype=BF16, fmt="bf16", stale=None, poison=None):
    """plan -> update -> run of a valid MSADecodeStepWrapper, returning (O, LSE, selection).
    change(a) -> plan or run argument overrides; stale(seqused_k) edits the planned lengths
    before the step; poison: (argument, value) in q (request 2's first query, head 1) or in
    K / V (request 2's last key, KV head 1)."""
    def make(device, gen):
        table, num_pages = page_table_for(lens, gen)
        batch, hq = len(lens), hkv * group
        index = index_data(num_pages, batch * seqlen_q, index_heads, fmt, gen)
        renamed = dict(k_scale="k_idx_scale", k_global_scale="k_idx_global_scale",
                       k_scale_layout="k_idx_scale_layout")
        a = dict(page_table=table, seqused_k=torch.tensor(lens, dtype=torch.int32),
                 seqlen_q=seqlen_q, max_seqlen_k=max(lens), num_qo_heads=hq, num_kv_heads=hkv,
                 num_index_heads=index_heads, topk=topk,
                 q=_randn((batch * seqlen_q, hq, D), gen, dtype),
                 k=_randn((num_pages, hkv, BLOCK, D), gen, dtype),
                 v=_randn((num_pages, hkv, BLOCK, D), gen, dtype), return_softmax_lse=True,
                 **{renamed.get(n, n): x for n, x in index.items()})
        a = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in a.items()}

        def call_of(a):
            def call():
                plan = {n: a[n] for n in _STEP_PLAN_ARGS if n in a}
                if "indexer_plan" not in plan:                    # the step keeps (and the
                    plan["seqused_k"] = plan["seqused_k"].clone()  # stale edit changes) it
                step = msa.MSADecodeStepWrapper().plan(**plan)
                if stale is not None:
                    stale(step.indexer_plan.seqused_k)
                run = {n: x for n, x in a.items() if n not in _STEP_PLAN_ARGS}
                out, lse = step.update().run(**run)
                return out, lse, step.q2k_indices
            return call
        made = Made(None)
        if poison is not None:
            made.clean = call_of(dict(a))
            which, value = poison
            t = a[which].clone()
            affected = torch.zeros(batch * seqlen_q, hq, dtype=torch.bool)
            unaffected = torch.ones_like(affected)
            first, last = 2 * seqlen_q, 3 * seqlen_q - 1
            group_1 = slice(group, 2 * group)
            if which == "q":
                t[first, 1, 4] = value
                affected[first, 1] = True
                unaffected[first, 1] = False
            else:
                # Only request 2's last query sees its last key (in its own block, always
                # selected); the queries whose own block is that block too may read it as P = 0.
                j = lens[2] - 1
                t[int(table[2, j // BLOCK]), 1, j % BLOCK, 9] = value
                affected[last, group_1] = True
                if which == "k":
                    unaffected[last, group_1] = False
                else:
                    own = (torch.arange(seqlen_q) + lens[2] - seqlen_q) // BLOCK == j // BLOCK
                    unaffected[first:last + 1, group_1] = ~own.view(-1, 1)
                    made.channels = [9]
            a[which] = t
            made.affected, made.unaffected = affected, unaffected
        a.update(change(a) if change is not None else {})
        made.call = call_of(a)
        made.inputs = _inputs(a)
        return made
    return make


_STEP_ERRORS = [
    ("plan num_kv_heads 0", lambda a: dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    ("plan G = 3", lambda a: dict(num_qo_heads=6), NotImplementedError, "num_qo_heads"),
    ("plan index heads do not divide", lambda a: dict(num_kv_heads=2, num_index_heads=3),
     ValueError, "num_index_heads"),
    ("plan topk 12", lambda a: dict(topk=12), ValueError, "topk"),
    ("plan seqused_k int64", lambda a: dict(seqused_k=a["seqused_k"].long()), TypeError,
     "seqused_k"),
    ("plan seqlen_q 17", lambda a: dict(seqlen_q=17), NotImplementedError, "seqlen_q"),
    ("plan seqlen_q 0", lambda a: dict(seqlen_q=0), ValueError, "seqlen_q"),
    ("plan max_seqlen_k 0", lambda a: dict(max_seqlen_k=0), ValueError, "max_seqlen_k"),
    ("plan page_table int64", lambda a: dict(page_table=a["page_table"].long()), TypeError,
     "page_table"),
    ("plan page_table rows", lambda a: dict(page_table=a["page_table"][:2]), ValueError,
     "page_table"),
    ("plan max_ctas 0", lambda a: dict(max_ctas=0), ValueError, "max_ctas"),
    ("plan indexer_plan not a plan", lambda a: dict(indexer_plan=object()), TypeError,
     "indexer_plan"),
    ("plan indexer_plan of another seqlen_q", lambda a: dict(
        indexer_plan=msa.make_decode_indexer_plan(a["seqused_k"], seqlen_q=1, num_index_heads=2,
                                                  max_seqlen_k=1000, topk=8)), ValueError,
     "indexer_plan"),
    ("plan check_input_valid string", lambda a: dict(check_input_valid="on"), TypeError,
     "check_input_valid"),
    ("run q heads", lambda a: dict(q=a["q"][:, :4].contiguous()), ValueError, "q"),
    ("run q rows", lambda a: dict(q=a["q"][:-1]), ValueError, "q"),
    ("run k fp16", lambda a: dict(k=a["k"].half(), v=a["v"].half()), TypeError, "k"),
    ("run v pages", lambda a: dict(v=a["v"][:-1]), ValueError, "v"),
    ("run q_idx heads", lambda a: dict(q_idx=a["q_idx"][:, :1].contiguous()), ValueError,
     "q_idx"),
    ("run q_idx fp16", lambda a: dict(q_idx=a["q_idx"].half()), TypeError, "q_idx"),
    ("run k_idx two heads", lambda a: dict(k_idx=a["k_idx"].repeat(1, 2, 1, 1)), ValueError,
     "k_idx"),
    ("run index_scale 0", lambda a: dict(index_scale=0.0), ValueError, "index_scale"),
    ("run softmax_scale 0", lambda a: dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    ("run k_idx_scale with bf16 keys", lambda a: dict(k_idx_scale=torch.zeros(
        1 << 16, dtype=torch.uint8, device=a["q"].device)), ValueError, "k_idx_scale"),
    ("run k_idx_scale_layout tiled", lambda a: dict(k_idx_scale_layout="tiled"), ValueError,
     "k_idx_scale_layout"),
    ("run out fp32", lambda a: dict(out=torch.empty(a["q"].shape, device=a["q"].device)),
     TypeError, "out"),
    ("run lse shape", lambda a: dict(lse=torch.empty(3, 3, device=a["q"].device)), ValueError,
     "lse"),
]
for _name, _change, _cls, _arg in _STEP_ERRORS:
    _add(f"{STEP}: {_name}", STEP, _STEP_OPS, _step_make(_change), Error(_cls, _arg))


def _step_run_before_plan(device, gen):
    q = _randn((4, 8, D), gen).to(device)
    return Made(lambda: msa.MSADecodeStepWrapper().run(q, q, q, q, q), [q])


_add(f"{STEP}: run before plan", STEP, (), _step_run_before_plan, Error(RuntimeError, "run"))


def _shared_plan(a):
    return dict(indexer_plan=msa.make_decode_indexer_plan(
        a["seqused_k"], seqlen_q=a["seqlen_q"], num_index_heads=a["num_index_heads"],
        max_seqlen_k=a["max_seqlen_k"], topk=a["topk"]))


_STEP_VALUES = [
    ("page id past the pool", _arg_edit("page_table", _fill((2, 3), 1 << 24)),
     Invalid("page_table"), {}),
    ("page id negative", _arg_edit("page_table", _fill((0, 0), -1)), Invalid("page_table"), {}),
    ("index-K pool smaller than the table's ids", lambda a: dict(
        k_idx=a["k_idx"][:3].contiguous()), Invalid("page_table"), {}),
    ("K/V pool smaller than the table's ids", lambda a: dict(
        k=a["k"][:3].contiguous(), v=a["v"][:3].contiguous()), Invalid("page_table"), {}),
    ("seqused_k negative", _arg_edit("seqused_k", _fill(1, -5)), Invalid("seqused_k"), {}),
    ("seqused_k past the page table", _arg_edit("seqused_k", _fill(0, 1 << 30)),
     Invalid("seqused_k"), {}),
    ("seqused_k past max_seqlen_k", _arg_edit("seqused_k", _fill(1, 1100)),
     Invalid("max_seqlen_k"), {}),
    ("valid", None, Same(), {}),
    ("one index head for two KV heads", None, Same(), dict(index_heads=1)),
    ("topk 4", None, Same(), dict(topk=4)),
    ("topk 16", None, Same(), dict(topk=16, lens=(300, 129, 3000))),
    ("MTP 8", None, Same(), dict(seqlen_q=8)),
    ("G = 16", None, Same(), dict(group=16)),
    ("e4m3", None, Same(), dict(dtype=E4M3, fmt="e4m3")),
    ("nvfp4 index keys", None, Same(), dict(fmt="nvfp4")),
    ("seqused_k 0", _arg_edit("seqused_k", _fill(1, 0)), Same(), {}),
    ("seqused_k below seqlen_q", _arg_edit("seqused_k", _fill(1, 1)), Same(), {}),
    ("lengths grew after the plan", lambda a: dict(max_seqlen_k=1200), Same(),
     dict(stale=lambda t: t.add_(_i32([80, 120, 24], t.device)))),
    ("shared indexer plan", _shared_plan, Same(), {}),
    ("max_ctas 1", lambda a: dict(max_ctas=1), Same(), {}),
    ("scales", lambda a: dict(index_scale=2.0, softmax_scale=0.05), Same(), {}),
    ("preallocated out and lse", lambda a: dict(
        out=torch.empty(a["q"].shape, dtype=BF16, device=a["q"].device),
        lse=torch.empty(a["q"].shape[:2], device=a["q"].device)), Same(), {}),
    ("nan in q_idx", _arg_edit("q_idx", _fill((4, 1, 7), NAN)), Same(), {}),
]
for _name, _change, _expect, _problem in _STEP_VALUES:
    _add(f"{STEP}: {_name}", STEP, _STEP_OPS, _step_make(_change, **_problem), _expect)
for _which in ("q", "k", "v"):
    _add(f"{STEP}: nan in {_which}", STEP, _STEP_OPS, _step_make(poison=(_which, NAN)),
         NonFinite(lse_too=_which != "v"))


# ---------------------------------------------------------------------------------------------
# layers: the M3 layer forwards (on host modules standing in for transformers' classes), their
# package calls (select_blocks, sparse_attention, dense_causal_attention) and the one-call swap
# ---------------------------------------------------------------------------------------------

_SPARSE_OPS = ("build_k2q_csr", "sparse_atten")
_SELECT_OPS = ("block_max_scores", "sparse_topk_select")
_HIDDEN = 64


def _init_weights(module: torch.nn.Module, gen: torch.Generator, dtype) -> torch.nn.Module:
    """Seeded weights (the table builds every call twice and compares): N(0, 0.2), norms
    around 1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
    return module.to(dtype).eval()


class MiniMaxM3VLIndexer(torch.nn.Module):
    """A stand-in for transformers' MiniMaxM3VLIndexer (same name and attributes): kernelize
    swaps msa.layers' forward into it; its own forward is the layer's (the stock semantics)."""

    def __init__(self, heads=2, topk_blocks=2, local_blocks=1):
        super().__init__()
        self.q_proj = torch.nn.Linear(_HIDDEN, heads * D, bias=False)
        self.k_proj = torch.nn.Linear(_HIDDEN, D, bias=False)
        self.q_norm, self.k_norm = torch.nn.RMSNorm(D), torch.nn.RMSNorm(D)
        self.head_dim, self.block_size = D, BLOCK
        self.topk_blocks, self.local_blocks, self.layer_idx = topk_blocks, local_blocks, 0

    def forward(self, hidden_states, position_embeddings, past_key_values, position_ids):
        return msa.layers.MiniMaxM3VLIndexer.forward(self, hidden_states, position_embeddings,
                                                     past_key_values, position_ids)


class MiniMaxM3VLAttention(torch.nn.Module):
    """A stand-in for transformers' MiniMaxM3VLAttention; its own forward is a dense causal
    SDPA (what the layer falls back to on dense layers it does not serve)."""

    def __init__(self, hq=8, hkv=2, sparse=True):
        super().__init__()
        self.q_proj = torch.nn.Linear(_HIDDEN, hq * D, bias=False)
        self.k_proj = torch.nn.Linear(_HIDDEN, hkv * D, bias=False)
        self.v_proj = torch.nn.Linear(_HIDDEN, hkv * D, bias=False)
        self.o_proj = torch.nn.Linear(hq * D, _HIDDEN, bias=False)
        self.q_norm, self.k_norm = torch.nn.RMSNorm(D), torch.nn.RMSNorm(D)
        self.indexer = MiniMaxM3VLIndexer(heads=hkv) if sparse else None
        self.head_dim, self.scaling, self.layer_idx = D, D ** -0.5, 0
        self.attention_dropout = 0.0

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        batch, q_len, _ = hidden_states.shape
        cos, sin = (x.unsqueeze(2) for x in position_embeddings)
        shape = (batch, q_len, -1, D)
        q = msa.layers._rotate(self.q_norm(self.q_proj(hidden_states).view(shape)), cos, sin)
        k = msa.layers._rotate(self.k_norm(self.k_proj(hidden_states).view(shape)), cos, sin)
        v = self.v_proj(hidden_states).view(shape)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            scale=self.scaling, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1)), None


def _rotary(positions: torch.Tensor, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=positions.device).float() / D))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _layer_make(which, change=None, *, batch=1, seq=300, sparse=True, dtype=BF16):
    """A forward of msa.layers' MiniMaxM3VLIndexer / MiniMaxM3VLAttention on a host module, or
    kernelize_minimax_m3 on a model of host modules then its attention's forward;
    change(host, a) edits the host module and returns argument overrides."""
    def make(device, gen):
        attention = _init_weights(MiniMaxM3VLAttention(sparse=sparse), gen, dtype).to(device)
        hidden = _randn((batch, seq, _HIDDEN), gen, dtype).to(device)
        positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
        a = dict(hidden_states=hidden, position_embeddings=_rotary(positions, dtype),
                 position_ids=positions)
        host = attention.indexer if which == "MiniMaxM3VLIndexer" else attention
        a.update(change(host, a) if change is not None else {})

        def call():
            if which == "MiniMaxM3VLIndexer":
                return msa.layers.MiniMaxM3VLIndexer.forward(
                    host, a["hidden_states"], a["position_embeddings"], None, a["position_ids"])
            if which == "kernelize_minimax_m3":
                model = torch.nn.ModuleDict(dict(attn=attention))
                msa.layers.kernelize_minimax_m3(model, device=device.type)
                module = model["attn"]
            else:
                module = None
            forward = (module.forward if module is not None else
                       lambda *args, **kw: msa.layers.MiniMaxM3VLAttention.forward(host, *args,
                                                                                   **kw))
            out, _ = forward(a["hidden_states"], a["position_embeddings"], None,
                             position_ids=a["position_ids"])
            return out
        return Made(call, [hidden, positions])
    return make


def _set_attr(**values):
    def change(host, a):
        for name, value in values.items():
            setattr(host, name, value)
        return {}
    return change


_LAYER_CASES = [
    ("MiniMaxM3VLIndexer", "valid", None, Same(), _SELECT_OPS, {}),
    ("MiniMaxM3VLIndexer", "two requests", None, Same(), _SELECT_OPS, dict(batch=2)),
    ("MiniMaxM3VLIndexer", "position_ids float", lambda h, a: dict(
        position_ids=a["position_ids"].float()), Error(TypeError, "position_ids"), _SELECT_OPS,
     {}),
    ("MiniMaxM3VLIndexer", "position_ids short", lambda h, a: dict(
        position_ids=a["position_ids"][:, :10]), Error(ValueError, "position_ids"), _SELECT_OPS,
     {}),
    ("MiniMaxM3VLIndexer", "index_block_size 64", _set_attr(block_size=64),
     Error(ValueError, "index_block_size"), _SELECT_OPS, {}),
    ("MiniMaxM3VLIndexer", "index_topk_blocks 0", _set_attr(topk_blocks=0),
     Error(ValueError, "index_topk_blocks"), _SELECT_OPS, {}),
    ("MiniMaxM3VLAttention", "sparse layer", None, Same(),
     _SELECT_OPS + _SPARSE_OPS, {}),
    ("MiniMaxM3VLAttention", "dropout while training", lambda h, a: (
        h.train(), setattr(h, "attention_dropout", 0.1), {})[-1],
     Error(ValueError, "attention_dropout"), _SELECT_OPS + _SPARSE_OPS, {}),
    ("kernelize_minimax_m3", "kernelized sparse layer", None, Same(),
     _SELECT_OPS + _SPARSE_OPS, {}),
]
for _layer, _name, _change, _expect, _ops, _problem in _LAYER_CASES:
    _add(f"layers.{_layer}: {_name}", f"layers.{_layer}", _ops,
         _layer_make(_layer, _change, **_problem), _expect)
# A dense layer: the dense FMHA on a GPU with a native one (reference or native backend), the
# host module's own forward elsewhere.
_add("layers.MiniMaxM3VLAttention: dense layer", "layers.MiniMaxM3VLAttention", ("fmha_dense",),
     _layer_make("MiniMaxM3VLAttention", sparse=False), Same())


def _model_without_indexer(device, gen):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    return Made(lambda: msa.layers.kernelize_minimax_m3(model))


_add("layers.kernelize_minimax_m3: a model without an indexer", "layers.kernelize_minimax_m3",
     (), _model_without_indexer, Error(ValueError, "model"))


def _select_make(change=None, *, batch=1, q_len=100, k_len=700, heads=2, dtype=BF16,
                 topk_blocks=4, local_blocks=1, nonfinite=False):
    """select_blocks over index queries of the last q_len positions of k_len keys."""
    def make(device, gen):
        a = dict(idx_q=_randn((batch, q_len, heads, D), gen, dtype),
                 idx_k=_randn((batch, 1, k_len, D), gen, dtype),
                 position_ids=torch.arange(k_len - q_len, k_len).unsqueeze(0).expand(batch, -1)
                 .contiguous(), topk_blocks=topk_blocks, local_blocks=local_blocks)
        a = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in a.items()}
        if nonfinite:
            a["idx_q"] = a["idx_q"].clone()
            a["idx_q"][0, 20, 1, 3] = NAN
        a.update(change(a) if change is not None else {})
        return Made(lambda: msa.layers.select_blocks(**a),
                    [x for x in a.values() if isinstance(x, torch.Tensor)])
    return make


SELECT = "layers.select_blocks"
_SELECT_CASES = [
    ("idx_q fp16", lambda a: dict(idx_q=a["idx_q"].half()), Error(TypeError, "idx_q")),
    ("idx_q rank 3", lambda a: dict(idx_q=a["idx_q"][0]), Error(ValueError, "idx_q")),
    ("idx_k dtype differs", lambda a: dict(idx_k=a["idx_k"].float()), Error(TypeError, "idx_k")),
    ("idx_k two heads", lambda a: dict(idx_k=a["idx_k"].repeat(1, 2, 1, 1)),
     Error(ValueError, "idx_k")),
    ("idx_k batch", lambda a: dict(idx_k=torch.cat([a["idx_k"]] * 2)), Error(ValueError,
                                                                             "idx_k")),
    ("head dim 64", lambda a: dict(idx_q=a["idx_q"][..., :64], idx_k=a["idx_k"][..., :64]),
     Error(ValueError, "index_head_dim")),
    ("block_size 64", lambda a: dict(block_size=64), Error(ValueError, "index_block_size")),
    ("topk_blocks 0", lambda a: dict(topk_blocks=0), Error(ValueError, "index_topk_blocks")),
    ("topk_blocks 65", lambda a: dict(topk_blocks=65), Error(ValueError, "index_topk_blocks")),
    ("topk_blocks float", lambda a: dict(topk_blocks=4.0), Error(TypeError,
                                                                 "index_topk_blocks")),
    ("local_blocks -1", lambda a: dict(local_blocks=-1), Error(ValueError,
                                                               "index_local_blocks")),
    ("position_ids float", lambda a: dict(position_ids=a["position_ids"].float()),
     Error(TypeError, "position_ids")),
    ("position_ids short", lambda a: dict(position_ids=a["position_ids"][:, :5]),
     Error(ValueError, "position_ids")),
    ("position_ids of 3 requests", lambda a: dict(position_ids=a["position_ids"].expand(3, -1)),
     Error(ValueError, "position_ids")),
    ("valid", None, Same()),
    ("local_blocks 0 (own block rescored)", lambda a: dict(local_blocks=0), Same()),
    ("local_blocks 2", lambda a: dict(local_blocks=2), Same()),
    ("topk_blocks past the blocks", lambda a: dict(topk_blocks=16), Same()),
    ("1-D position_ids", lambda a: dict(position_ids=a["position_ids"][0]), Same()),
    ("position_ids past the keys", lambda a: dict(position_ids=a["position_ids"] + 5000),
     Same()),
    ("position_ids negative", lambda a: dict(position_ids=a["position_ids"] - 5000), Same()),
]
for _name, _change, _expect in _SELECT_CASES:
    _add(f"{SELECT}: {_name}", SELECT, _SELECT_OPS, _select_make(_change), _expect)
_add(f"{SELECT}: two requests", SELECT, _SELECT_OPS, _select_make(batch=2), Same())
# NaN index queries only drop blocks from the row's selection (never NaN ones).
_add(f"{SELECT}: nan in idx_q", SELECT, _SELECT_OPS, _select_make(nonfinite=True), Same())
_add(f"{SELECT}: fp32 (reference)", SELECT, (), _select_make(dtype=torch.float32), Same())


def _attention_make(fn, change=None, *, batch=1, q_len=200, k_len=700, hq=8, hkv=2, width=3,
                    nonfinite=False):
    """layers.sparse_attention over a causal selection (own block + random earlier blocks,
    -1 slots) or layers.dense_causal_attention (k_len = q_len); NaN in query (0, 50, head 1)."""
    def make(device, gen):
        kl = k_len if fn == "sparse_attention" else q_len
        a = dict(query=_randn((batch, q_len, hq, D), gen), key=_randn((batch, hkv, kl, D), gen),
                 value=_randn((batch, hkv, kl, D), gen))
        if fn == "sparse_attention":
            sel = _selection([q_len] * batch, [kl] * batch, hkv, width, gen)   # [Hkv, B*S, n]
            a.update(block_indices=sel.view(hkv, batch, q_len, width).permute(1, 0, 2, 3)
                     .long().contiguous(),
                     position_ids=torch.arange(kl - q_len, kl).unsqueeze(0).expand(batch, -1)
                     .contiguous(), softmax_scale=0.1)
        else:
            a["softmax_scale"] = 0.1
        a = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in a.items()}
        made = Made(None)
        call_of = lambda a: lambda: getattr(msa.layers, fn)(**a)      # noqa: E731
        if nonfinite:
            made.clean = call_of(dict(a))
            a["query"] = a["query"].clone()
            a["query"][0, 50, 1, 7] = NAN
            made.affected = torch.zeros(batch, q_len, hq, dtype=torch.bool)
            made.affected[0, 50, 1] = True
            made.unaffected = ~made.affected
        a.update(change(a) if change is not None else {})
        made.call = call_of(a)
        made.inputs = [x for x in a.values() if isinstance(x, torch.Tensor)]
        return made
    return make


_ATTENTION_ERRORS = [
    ("query fp32", lambda a: dict(query=a["query"].float()), TypeError, "query"),
    ("query rank 3", lambda a: dict(query=a["query"][0]), ValueError, "query"),
    ("query head dim 64", lambda a: dict(query=a["query"][..., :64]), NotImplementedError,
     "query"),
    ("key fp16", lambda a: dict(key=a["key"].half()), TypeError, "key"),
    ("key batch", lambda a: dict(key=torch.cat([a["key"]] * 2), value=torch.cat(
        [a["value"]] * 2)), ValueError, "key"),
    ("value shape", lambda a: dict(value=a["value"][:, :, :-1]), ValueError, "value"),
]
for _fn in ("sparse_attention", "dense_causal_attention"):
    _ops = _SPARSE_OPS if _fn == "sparse_attention" else ("fmha_dense",)
    for _name, _change, _cls, _arg in _ATTENTION_ERRORS:
        _add(f"layers.{_fn}: {_name}", f"layers.{_fn}", _ops, _attention_make(_fn, _change),
             Error(_cls, _arg))
    _add(f"layers.{_fn}: valid", f"layers.{_fn}", _ops, _attention_make(_fn), Same())
    _add(f"layers.{_fn}: two requests", f"layers.{_fn}", _ops, _attention_make(_fn, batch=2),
         Same())
    _add(f"layers.{_fn}: nan in query", f"layers.{_fn}", _ops,
         _attention_make(_fn, nonfinite=True), NonFinite(lse_too=False))
for _name, _change, _expect in [
        ("block_indices float", lambda a: dict(block_indices=a["block_indices"].float()),
         Error(TypeError, "block_indices")),
        ("block_indices heads", lambda a: dict(block_indices=a["block_indices"][:, :1]),
         Error(ValueError, "index_n_heads")),
        ("block_indices queries", lambda a: dict(block_indices=a["block_indices"][:, :, :-1]),
         Error(ValueError, "block_indices")),
        ("40 blocks per query", lambda a: dict(block_indices=a["block_indices"].repeat(
            1, 1, 1, 14)[..., :40]), Error(ValueError, "index_topk_blocks")),
        ("position_ids float", lambda a: dict(position_ids=a["position_ids"].float()),
         Error(TypeError, "position_ids")),
        ("position_ids past the cache", lambda a: dict(position_ids=a["position_ids"] + 5000),
         Same()),
        ("1-D position_ids", lambda a: dict(position_ids=a["position_ids"][0]), Same())]:
    _add(f"layers.sparse_attention: {_name}", "layers.sparse_attention", _SPARSE_OPS,
         _attention_make("sparse_attention", _change), _expect)
_add("layers.dense_causal_attention: keys of another length", "layers.dense_causal_attention",
     ("fmha_dense",), _attention_make("dense_causal_attention", lambda a: dict(
         key=a["key"][:, :, :-1], value=a["value"][:, :, :-1])), Error(ValueError, "key"))



# ---------------------------------------------------------------------------------------------
# warmup (compiles CuTe kernels into the JIT cache: argument errors only, nothing compiles)
# ---------------------------------------------------------------------------------------------

for _name, _kw, _cls, _arg in [
        ("arch sm_100a", dict(arch="sm_100a"), ValueError, "arch"),
        ("arch an int", dict(arch=90), TypeError, "arch"),
        ("workers 0", dict(workers=0), ValueError, "workers"),
        ("workers float", dict(workers=2.0), TypeError, "workers"),
        ("only an int", dict(only=5), TypeError, "only"),
        ("only holds an int", dict(only=["fmha", 3]), TypeError, "only")]:
    _add(f"warmup: {_name}", "warmup", (),
         lambda device, gen, kw=_kw: Made(lambda: msa.warmup(progress=False, **kw)),
         Error(_cls, _arg))


# ---------------------------------------------------------------------------------------------
# Tensors on two devices (a GPU host only)
# ---------------------------------------------------------------------------------------------

_add(f"{ATTN}: cu_seqlens_q on the CPU", ATTN, ["sparse_atten"],
     _attn_make(lambda p: dict(cu_seqlens_q=p.cu_q.cpu(), cu_seqlens_k=p.cu_k.cpu())),
     Error(ValueError, "cu_seqlens_q"), gpu_only=True)
_add(f"{ATTN}: k2q_row_ptr on the CPU", ATTN, ["sparse_atten"],
     _attn_make(lambda p: dict(k2q_row_ptr=p.row_ptr.cpu())), Error(ValueError, "k2q_row_ptr"),
     gpu_only=True)
_add(f"{DECODE}: page_table on the CPU", DECODE, ["sparse_decode_atten"],
     _decode_make(lambda p: dict(page_table=p.page_table.cpu())), Error(ValueError,
                                                                         "page_table"),
     gpu_only=True)
_add("build_k2q_csr: q2k on the CPU", "build_k2q_csr", ["build_k2q_csr"],
     _csr_make(lambda p: p.update(q2k=p["q2k"].cpu()), False), Error(ValueError, "cu_seqlens_q"),
     gpu_only=True)
_add(f"{BMS}: k_idx on the CPU", BMS, ["block_max_scores"],
     _bms_make(lambda a, k: dict(k_idx=a["k_idx"].cpu())), Error(ValueError, "k_idx"),
     gpu_only=True)
_add(f"{PAGED_PREFILL}: page_table on the CPU", PAGED_PREFILL, _PREFILL_STAGES,
     _paged_prefill_make(lambda a: dict(page_table=a["page_table"].cpu())),
     Error(ValueError, "page_table"), gpu_only=True)
_add(f"{INDEXER}: page_table on the CPU", INDEXER, _INDEXER_OPS,
     _indexer_make(lambda a: dict(page_table=a["page_table"].cpu())),
     Error(ValueError, "page_table"), gpu_only=True)
_add(f"{STEP}: page_table on the CPU", STEP, _STEP_OPS,
     _step_make(lambda a: dict(page_table=a["page_table"].cpu())),
     Error(ValueError, "page_table"), gpu_only=True)
_add(f"{STEP}: q_idx on the CPU", STEP, _STEP_OPS,
     _step_make(lambda a: dict(q_idx=a["q_idx"].cpu())), Error(ValueError, "q_idx"),
     gpu_only=True)
