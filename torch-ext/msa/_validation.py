"""Argument checks shared by every public entry point.

The error classes follow the contract: dtype -> TypeError; shape or device -> ValueError;
unsupported feature -> NotImplementedError. Every message starts with the argument's name so a
caller can tell at once what to fix.

Two tiers:

* shape / dtype / device / host-int checks run on every call, from metadata only (no device
  synchronization), before any launch;
* value checks (prefix sums that start at 0, rise and end at the tensor's length; ids in range
  and unique; page ids; seqused_k; host hints at least the truth) read index tensors, so they
  synchronize once. They run on every reference call (the reference reads those values anyway)
  and on native calls only when asked: ``check_input_valid=True`` on the public function, or
  ``MSA_CHECK_INPUTS=1`` in the environment for a whole run (a debugging mode: the sync is not
  allowed inside CUDA-graph capture). Unchecked native calls never read
  or write out of bounds whatever the values say (see :func:`device_prefix_sums`), but their
  output for invalid metadata is unspecified.
"""

from __future__ import annotations

import collections
import os
from typing import Dict, Iterable, Optional, Sequence

import torch

from .schedules.csr_rows import packed_row_owner

HEAD_DIM = 128
BLOCK_SIZE = 128
SUPPORTED_TOPK = (4, 8, 16, 32)
SUPPORTED_QHEAD_PER_KV = (1, 2, 4, 8, 16)
FP8 = torch.float8_e4m3fn
PARTIAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes: Optional[Sequence[torch.dtype]] = None, ndim=None,
                 contiguous: bool = False, last_dim_contiguous: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected one of "
                        f"{_dtype_names(dtypes)}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name}: expected a tensor of rank {' or '.join(map(str, allowed))}, "
                             f"got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (got strides {tuple(t.stride())})")
    if last_dim_contiguous and t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {t.stride(-1)})")
    return t


def check_same_device(**tensors: Optional[torch.Tensor]) -> Optional[torch.device]:
    """The one device of the given tensors (None skipped). Otherwise the error names a tensor off
    the device most of them share (the later one on a tie): the argument the caller moved."""
    present = {name: t.device for name, t in tensors.items() if t is not None}
    counts = collections.Counter(present.values())
    if len(counts) <= 1:
        return next(iter(counts), None)
    # Most tensors' device; on a tie the first tensor's (so the later one is blamed).
    first = next(iter(present.values()))
    device = max(counts, key=lambda d: (counts[d], d == first))
    for name, d in present.items():
        if d != device:
            on = [n for n, other in present.items() if other == device]
            where = on[0] if len(on) == 1 else ", ".join(on[:3]) + (" ..." if len(on) > 3 else "")
            verb = "is" if len(on) == 1 else "are"
            raise ValueError(f"{name}: is on {d} but {where} {verb} on {device}; all tensors "
                             "must be on one device")
    return device


def check_shape(name: str, t: torch.Tensor, expected: Sequence[Optional[int]]) -> None:
    """`expected` may hold None for a free dimension."""
    if t.dim() != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")


def check_topk(name: str, topk, allowed: Sequence[int] = SUPPORTED_TOPK) -> int:
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"{name}: expected an int, got {type(topk).__name__}")
    if topk not in allowed:
        raise ValueError(f"{name}: {topk} is not supported; expected one of {tuple(allowed)}")
    return topk


def check_head_dim(name: str, d: int) -> None:
    if d != HEAD_DIM:
        raise NotImplementedError(f"{name}: head dimension {d} is not supported; only {HEAD_DIM}")


def check_qhead_per_kv(hq: int, hkv: int, allowed: Sequence[int] = SUPPORTED_QHEAD_PER_KV,
                       *, name: str = "q", kv_name: str = "KV heads of k") -> int:
    """G = hq / hkv, checked. `name` / `kv_name` say where the head counts came from (plan()
    takes them as num_qo_heads / num_kv_heads, not from tensors)."""
    if hkv <= 0 or hq % hkv != 0:
        raise ValueError(f"{name}: {hq} query heads are not a multiple of the {hkv} {kv_name}")
    g = hq // hkv
    if g not in allowed:
        raise NotImplementedError(f"{name}: {g} query heads per KV head is not supported; "
                                  f"expected one of {tuple(allowed)}")
    return g


def check_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> int:
    """Returns the batch size."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, t, dtypes=(torch.int32,), ndim=1, contiguous=True)
        if t.numel() < 2:
            raise ValueError(f"{name}: expected shape [B+1] with B >= 1, got {list(t.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_k: shape {list(cu_seqlens_k.shape)} does not match "
                         f"cu_seqlens_q {list(cu_seqlens_q.shape)}")
    check_same_device(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return cu_seqlens_q.numel() - 1


def check_page_table(page_table: torch.Tensor, batch: int, *, seqused_k=None,
                     min_pages: int = 0) -> None:
    """page_table [B, >= min_pages] int32 with contiguous rows; seqused_k, if given, [B] int32."""
    check_tensor("page_table", page_table, dtypes=(torch.int32,), ndim=2, last_dim_contiguous=True)
    if page_table.shape[0] != batch or page_table.shape[1] < min_pages:
        raise ValueError(f"page_table: expected shape [{batch}, >= {min_pages}] (one row per "
                         f"request), got {list(page_table.shape)}")
    if seqused_k is not None:
        check_tensor("seqused_k", seqused_k, dtypes=(torch.int32,), ndim=1, contiguous=True)
        check_shape("seqused_k", seqused_k, (batch,))


def check_partial_dtype(partial_dtype) -> None:
    if not isinstance(partial_dtype, torch.dtype) or partial_dtype not in PARTIAL_DTYPES:
        raise TypeError(f"partial_dtype: {partial_dtype} is not supported; expected float32, "
                        "bfloat16, float16 or float8_e4m3fn")


def check_positive_int(name: str, value, *, allow_none: bool = False, minimum: int = 0):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def check_planned(name: str, got: int, what: str, planned_as: str, planned: int) -> None:
    """A wrapper's run() argument against what plan() was given: ValueError naming both."""
    if got != planned:
        raise ValueError(f"{name}: has {got} {what} but plan() got {planned_as}={planned}")


def check_scale(name: str, value, *, allow_none: bool = True) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a Python float, got a tensor")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}") from None
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"{name}: must be finite and > 0, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# Value checks (read device values: one synchronization per call)
# ---------------------------------------------------------------------------------------------

CHECK_INPUTS_ENV = "MSA_CHECK_INPUTS"


def value_checks_requested(check_input_valid) -> bool:
    """Whether a call validates the values of its index tensors: check_input_valid=True, or
    MSA_CHECK_INPUTS=1 in the environment (a whole run)."""
    if not isinstance(check_input_valid, bool):
        raise TypeError(f"check_input_valid: expected a bool, got "
                        f"{type(check_input_valid).__name__}")
    return check_input_valid or os.environ.get(CHECK_INPUTS_ENV, "") == "1"


def host_int64(**tensors: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """CPU int64 copies of the given index tensors with a single synchronization: device
    tensors are copied asynchronously into pinned memory, then the stream is waited on once."""
    out, devices = {}, set()
    for name, t in tensors.items():
        if t is None:
            out[name] = None
        elif t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out[name] = host
            devices.add(t.device)
        else:
            out[name] = t
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return {name: None if t is None else t.to(torch.int64) for name, t in out.items()}


def check_prefix_sums(name: str, cu: torch.Tensor, total: Optional[int] = None,
                      total_what: str = "", exact: bool = True) -> torch.Tensor:
    """Host int64 [B+1] prefix sums: cu[0] == 0, non-decreasing, and cu[-1] == total when the
    total is known (total_what names it, e.g. "q.shape[0]"), or cu[-1] <= total with
    exact=False (K rows past the last request are never read: a static KV cache may be larger
    than its used part). Returns the lengths [B]."""
    if int(cu[0]) != 0:
        raise ValueError(f"{name}: must start at 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    bad = torch.nonzero(lengths < 0).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"{name}: must be non-decreasing, but entry {b + 1} = {int(cu[b + 1])} "
                         f"< entry {b} = {int(cu[b])}")
    if total is not None and (int(cu[-1]) != total if exact else int(cu[-1]) > total):
        relation = "!=" if exact else ">"
        raise ValueError(f"{name}: last entry {int(cu[-1])} {relation} {total_what} = {total}")
    return lengths


def check_hint(name: str, hint: Optional[int], truth: int, what: str) -> None:
    """A host hint (an upper bound the caller promises) must be >= the truth."""
    if hint is not None and hint < truth:
        raise ValueError(f"{name}: {hint} is smaller than {what} ({truth})")


def check_lengths_range(name: str, lengths: torch.Tensor, capacity: int, what: str) -> None:
    """Host [B] lengths within [0, capacity]."""
    bad = torch.nonzero((lengths < 0) | (lengths > capacity)).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"{name}: request {b} has {int(lengths[b])} tokens, outside "
                         f"[0, {capacity}] ({what})")


def paged_key_lengths(table: torch.Tensor, seqused_k: Optional[torch.Tensor],
                      page_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Host key length of every request of a paged call: seqused_k, or the table width without
    it (upstream quirk, contract D11), checked to lie within [0, width * page_size]."""
    capacity = table.shape[1] * page_size
    k_lens = seqused_k if seqused_k is not None else \
        torch.full((table.shape[0],), capacity, dtype=torch.int64)
    check_lengths_range("seqused_k", k_lens, capacity,
                        f"page_table holds {table.shape[1]} pages of {page_size}")
    return k_lens


def check_page_ids(name: str, table: torch.Tensor, k_lens: torch.Tensor, page_size: int,
                   num_pages: int) -> None:
    """Host [B, max_pages] page table: every page that holds keys of its request (logical page
    < ceil(k_len / page_size)) is a page of the pool; entries past that may be anything."""
    used = (torch.arange(table.shape[1]).view(1, -1)
            < ((k_lens.clamp_min(0) + page_size - 1) // page_size).view(-1, 1))
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, beta = [int(x) for x in torch.nonzero(bad)[0]]
        raise ValueError(f"{name}: entry [{b}, {beta}] = {int(table[b, beta])} is out of range "
                         f"for {num_pages} pages")


def check_block_ids(name: str, ids: torch.Tensor, limit: torch.Tensor) -> None:
    """Host [H, T, K] selected block ids: each is -1 (empty slot, anywhere in a row) or in
    [0, limit[t]), and the ids >= 0 of a row are distinct (duplicates would be counted twice)."""
    valid = ids >= 0
    bad = (ids < -1) | (valid & (ids >= limit.view(1, -1, 1)))
    if bad.any():
        h, t, s = [int(x) for x in torch.nonzero(bad)[0]]
        raise ValueError(f"{name}: entry [{h}, {t}, {s}] = {int(ids[h, t, s])} is out of range: "
                         f"expected -1 or a block id in [0, {int(limit[t])}) of its request")
    if ids.shape[-1] > 1:
        ordered = torch.sort(torch.where(valid, ids, -1 - torch.arange(ids.shape[-1])), -1)[0]
        dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
        if dup.any():
            h, t, s = [int(x) for x in torch.nonzero(dup)[0]]
            raise ValueError(f"{name}: row [{h}, {t}] selects block {int(ordered[h, t, s])} "
                             "twice (duplicates are double-weighted)")


def check_k2q_csr_values(row_ptr: torch.Tensor, q_idx: torch.Tensor, q_lens: torch.Tensor,
                         rows_b: torch.Tensor, topk: int, strict: bool) -> None:
    """Host k2q CSR against the requests it covers (contract §1.1).

    Always: row_ptr [Hkv, rows+1] starts at 0, rises, ends within q_idx, has a row for every
    (request, 128-key block) and nothing past them; no (query, KV head) sits in more than topK
    rows. strict (check_input_valid): also every query id of a row lies in [0, q_len_b) and the
    ids of a row ascend strictly (out-of-range ids are otherwise skipped, contract D4)."""
    hkv, width = row_ptr.shape[0], q_idx.shape[1]
    exact_rows = int(rows_b.sum())
    if row_ptr.shape[1] - 1 < exact_rows:
        raise ValueError(f"k2q_row_ptr: has {row_ptr.shape[1] - 1} rows but cu_seqlens_k needs "
                         f"{exact_rows} (one per request and 128-key block): rows were dropped "
                         "(total_k or total_rows too small when the CSR was built)")
    if bool((row_ptr[:, 0] != 0).any()):
        raise ValueError("k2q_row_ptr: every head's row pointer must start at 0")
    steps = row_ptr[:, 1:] - row_ptr[:, :-1]
    if bool((steps < 0).any()):
        h, r = [int(x) for x in torch.nonzero(steps < 0)[0]]
        raise ValueError(f"k2q_row_ptr: must be non-decreasing (head {h}, row {r + 1})")
    if int(row_ptr[:, -1].max()) > width:
        raise ValueError(f"k2q_row_ptr: ends at {int(row_ptr[:, -1].max())}, past the "
                         f"{width} entries of k2q_q_indices")
    if bool((row_ptr[:, -1] != row_ptr[:, exact_rows]).any()):
        raise ValueError(f"k2q_row_ptr: rows past the {exact_rows} that cu_seqlens_k defines "
                         "must be empty")
    batch_of_row = torch.tensor([b for b, _ in packed_row_owner(rows_b.tolist())],
                                dtype=torch.int64)
    total_q = int(q_lens.sum())
    q_start = torch.zeros(q_lens.numel() + 1, dtype=torch.int64)
    q_start[1:] = torch.cumsum(q_lens, 0)
    per_query = torch.zeros(hkv, total_q + 1, dtype=torch.int64)
    for h in range(hkv):
        n = int(row_ptr[h, exact_rows])
        if n == 0:
            continue
        row_of_entry = torch.repeat_interleave(torch.arange(exact_rows), steps[h, :exact_rows])
        b = batch_of_row[row_of_entry]
        ids = q_idx[h, :n]
        ok = (ids >= 0) & (ids < q_lens[b])
        if strict:
            if not bool(ok.all()):
                e = int(torch.nonzero(~ok)[0])
                raise ValueError(f"k2q_q_indices: entry [{h}, {e}] = {int(ids[e])} is not a query "
                                 f"of request {int(b[e])} (q_len {int(q_lens[b[e]])})")
            unordered = (row_of_entry[1:] == row_of_entry[:-1]) & (ids[1:] <= ids[:-1])
            if bool(unordered.any()):
                e = int(torch.nonzero(unordered)[0]) + 1
                raise ValueError(f"k2q_q_indices: query ids must ascend strictly within a row "
                                 f"(head {h}, entry {e})")
        target = torch.where(ok, q_start[b] + ids, torch.full_like(ids, total_q))
        per_query[h].scatter_add_(0, target, torch.ones_like(ids))
    counts = per_query[:, :total_q]
    if counts.numel() and int(counts.max()) > topk:
        h, t = [int(x) for x in torch.nonzero(counts > topk)[0]]
        raise ValueError(f"topK: query {t} of KV head {h} is in {int(counts[h, t])} CSR rows, "
                         f"more than topK = {topk} (the CSR was built for a larger topK)")


def _rows_per_request(k_lens: torch.Tensor, block: int = BLOCK_SIZE) -> torch.Tensor:
    return (k_lens.clamp_min(0) + block - 1) // block


def _max(t: torch.Tensor) -> int:
    return int(t.max()) if t.numel() else 0


def check_k2q_build_values(call, strict: bool) -> None:
    """build_k2q_csr (a K2qCsrCall). Always: cu_seqlens_q starts at 0, rises and ends at
    q2k_indices.shape[1]; cu_seqlens_k starts at 0 and rises to at most total_k; the given
    max_seqlen_q / max_seqlen_k and total_rows are at least the truth. strict: every q2k id is
    -1 or a block of its request, without duplicates in a row."""
    host = host_int64(q2k=call.q2k_indices if strict else None, cu_q=call.cu_seqlens_q,
                      cu_k=call.cu_seqlens_k)
    total_q = call.q2k_indices.shape[1]
    q_lens = check_prefix_sums("cu_seqlens_q", host["cu_q"], total_q,
                               "q2k_indices.shape[1] (total_q)")
    k_lens = check_prefix_sums("cu_seqlens_k", host["cu_k"])
    check_hint("total_k", call.total_k, int(host["cu_k"][-1]), "cu_seqlens_k[-1]")
    check_hint("max_seqlen_q", call.max_seqlen_q, _max(q_lens), "the longest request's queries")
    check_hint("max_seqlen_k", call.max_seqlen_k, _max(k_lens), "the longest request's keys")
    rows_b = _rows_per_request(k_lens)
    check_hint("total_rows", call.total_rows, int(rows_b.sum()),
               "the CSR rows cu_seqlens_k needs (one per request and 128-key block)")
    if strict:
        limit = torch.repeat_interleave(rows_b, q_lens)
        check_block_ids("q2k_indices", host["q2k"], limit)


def check_sparse_attention_values(call, strict: bool) -> None:
    """sparse_atten_func / sparse_atten_nvfp4_kv_func (a SparseAttentionCall). Always: the
    prefix sums (cu_seqlens_q ends at q.shape[0]; dense cu_seqlens_k within k), seqused_k
    within the page table, the page ids of every page that holds keys, the max_seqlen hints,
    the CSR's structure and topK (check_k2q_csr_values), and a schedule built for exactly this
    k2q_row_ptr (its values: the kernels read the schedule's own copy). strict: also the CSR's
    query ids."""
    schedule = call.schedule
    host = host_int64(cu_q=call.cu_seqlens_q, cu_k=call.cu_seqlens_k, row_ptr=call.k2q_row_ptr,
                      q_idx=call.k2q_q_indices, page_table=call.page_table,
                      seqused_k=call.seqused_k,
                      schedule_row_ptr=None if schedule is None else schedule.k2q_row_ptr)
    total_q = call.q.shape[0]
    q_lens = check_prefix_sums("cu_seqlens_q", host["cu_q"], total_q, "q.shape[0]")
    if call.paged:
        csr_k_lens = check_prefix_sums("cu_seqlens_k", host["cu_k"])
        k_lens = paged_key_lengths(host["page_table"], host["seqused_k"])
    else:
        k_lens = csr_k_lens = check_prefix_sums("cu_seqlens_k", host["cu_k"], call.k.shape[0],
                                                "k.shape[0]", exact=False)
    check_hint("max_seqlen_q", call.max_seqlen_q, _max(q_lens), "the longest request's queries")
    check_hint("max_seqlen_k", call.max_seqlen_k, _max(k_lens), "the longest request's keys")
    if call.paged:
        check_page_ids("page_table", host["page_table"], k_lens, BLOCK_SIZE, call.k.shape[0])
    check_k2q_csr_values(host["row_ptr"], host["q_idx"], q_lens, _rows_per_request(csr_k_lens),
                         call.topk, strict)
    if host["schedule_row_ptr"] is not None and not torch.equal(host["schedule_row_ptr"],
                                                                host["row_ptr"]):
        raise ValueError("schedule: was built for a different k2q_row_ptr")


def check_paged_cache_values(table: torch.Tensor, seqused_k: torch.Tensor, max_seqlen_k: int,
                             num_pages: int, page_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Host page_table [B, max_pages] and seqused_k [B] of a paged cache: seqused_k within the
    table and at most max_seqlen_k, the page ids of every page that holds keys in the pool of
    num_pages. Returns the lengths."""
    lens = paged_key_lengths(table, seqused_k, page_size)
    check_hint("max_seqlen_k", max_seqlen_k, _max(lens), "the longest request's keys")
    check_page_ids("page_table", table, lens, page_size, num_pages)
    return lens


def check_decode_values(call, strict: bool) -> None:
    """sparse_decode_atten_func / the wrapper (a DecodeCall). Always: seqused_k within the page
    table and at most max_seqlen_k, the page ids of every page that holds keys. strict: every
    q2k id is -1 or a block of its request, without duplicates in a row."""
    host = host_int64(page_table=call.page_table, seqused_k=call.seqused_k,
                      q2k=call.q2k_indices if strict else None)
    page_size = call.k.shape[2]
    lens = check_paged_cache_values(host["page_table"], host["seqused_k"], call.max_seqlen_k,
                                    call.k.shape[0], page_size)
    if host["q2k"] is not None:
        limit = torch.repeat_interleave(_rows_per_request(lens, page_size), call.seqlen_q)
        check_block_ids("q2k_indices", host["q2k"], limit)


def check_decode_indexer_values(call) -> None:
    """decode_indexer_topk (a DecodeIndexerCall): the plan's seqused_k within the page table and
    at most the plan's max_seqlen_k, the page ids of every page that holds keys within k_idx."""
    host = host_int64(page_table=call.page_table, seqused_k=call.plan.seqused_k)
    check_paged_cache_values(host["page_table"], host["seqused_k"], call.plan.max_seqlen_k,
                             call.k_idx.shape[0])


def check_block_max_values(call) -> None:
    """block_max_scores (a BlockMaxScoreCall): cu_seqlens_q ends at q_idx.shape[0]; dense
    cu_seqlens_k ends within k_idx; paged seqused_k within the page table and its page
    ids; max_seqlen_q / max_seqlen_k at least the truth (a short max_seqlen_k would leave the
    tiles past it uncomputed)."""
    host = host_int64(cu_q=call.cu_seqlens_q, cu_k=call.cu_seqlens_k,
                      page_table=call.page_table, seqused_k=call.seqused_k)
    q_lens = check_prefix_sums("cu_seqlens_q", host["cu_q"], call.q_idx.shape[0],
                               "q_idx.shape[0]")
    if call.paged:
        if host["cu_k"] is not None:
            check_prefix_sums("cu_seqlens_k", host["cu_k"])
        k_lens = paged_key_lengths(host["page_table"], host["seqused_k"])
        check_page_ids("page_table", host["page_table"], k_lens, BLOCK_SIZE,
                       call.k_idx.shape[0])
    else:
        k_lens = check_prefix_sums("cu_seqlens_k", host["cu_k"], call.k_idx.shape[0],
                                   "k_idx.shape[0]", exact=False)
    check_hint("max_seqlen_q", call.max_seqlen_q, _max(q_lens), "the longest request's queries")
    check_hint("max_seqlen_k", call.max_seqlen_k, _max(k_lens), "the longest request's keys")


def check_fp4_indexer_values(call) -> None:
    """fp4_indexer_block_scores (an Fp4IndexerCall): cu_seqlens_q ends at q_fp4.shape[0],
    cu_seqlens_k and cu_page_offsets rise from 0 (the page offsets within kv_indices), every
    request lists the pages its keys need and they are pages of k_fp4, and the max_seqlen
    hints are at least the truth."""
    host = host_int64(cu_q=call.cu_seqlens_q, cu_k=call.cu_seqlens_k,
                      cu_p=call.cu_page_offsets, kv_indices=call.kv_indices)
    q_lens = check_prefix_sums("cu_seqlens_q", host["cu_q"], call.q_fp4.shape[0],
                               "q_fp4.shape[0]")
    k_lens = check_prefix_sums("cu_seqlens_k", host["cu_k"])
    pages = check_prefix_sums("cu_page_offsets", host["cu_p"])
    check_hint("max_seqlen_q", call.max_seqlen_q, _max(q_lens), "the longest request's queries")
    check_hint("max_seqlen_k", call.max_seqlen_k, _max(k_lens), "the longest request's keys")
    if int(host["cu_p"][-1]) > host["kv_indices"].numel():
        raise ValueError(f"cu_page_offsets: ends at {int(host['cu_p'][-1])}, past the "
                         f"{host['kv_indices'].numel()} entries of kv_indices")
    need = _rows_per_request(k_lens)
    short = torch.nonzero(pages < need).flatten()
    if short.numel():
        b = int(short[0])
        raise ValueError(f"cu_page_offsets: request {b} lists {int(pages[b])} pages but its "
                         f"{int(k_lens[b])} keys need {int(need[b])}")
    table = torch.full((need.numel(), _max(need)), 0, dtype=torch.int64)
    for b in range(need.numel()):
        first = int(host["cu_p"][b])
        table[b, :int(need[b])] = host["kv_indices"][first:first + int(need[b])]
    check_page_ids("kv_indices", table, k_lens, BLOCK_SIZE, call.k_fp4.shape[0])


def device_prefix_sums(cu: torch.Tensor, total: int) -> torch.Tensor:
    """A [B+1] int32 copy of prefix sums that native kernels can trust whatever the caller
    passed: clamped to [0, total] and made non-decreasing, on the device, without a sync.
    Valid prefix sums come back unchanged; for invalid ones the kernels stay in bounds (their
    output is then unspecified; the value checks report the error)."""
    return torch.cummax(cu.clamp(0, total), dim=0).values.to(torch.int32)
