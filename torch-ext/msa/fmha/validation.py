"""Argument checks and conversions shared by the fmha plan, run and bridge modules.

Host length and offset lists, the int32 tensors of a plan, q/k/v and output buffers, the scale
factors, causal offset overrides, page tables and block selections. Each check raises the
contract's error class with the argument's name first, before any launch.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from .._common import to_device as _to
from .._validation import (FP8, HEAD_DIM, check_head_dim, check_page_ids, check_page_table,
                           check_same_device, check_scale, check_shape, check_tensor,
                           host_int64)

BF16 = torch.bfloat16
TILE = 128                         # max-score tile and sparse-bridge block size

IntOrTensor = Union[int, torch.Tensor, None]


def host_lengths(name: str, lengths) -> List[int]:
    """[B] integer tensor (any device) or sequence of ints -> host list of ints >= 0."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or \
                lengths.dtype == torch.bool:
            raise TypeError(f"{name}: dtype {lengths.dtype} is not supported; expected an "
                            "integer tensor (int32 or int64)")
        if lengths.dim() != 1:
            raise ValueError(f"{name}: expected shape [B], got {list(lengths.shape)}")
        values = [int(x) for x in lengths.tolist()]
    elif isinstance(lengths, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in lengths):
            raise TypeError(f"{name}: expected ints")
        values = list(lengths)
    else:
        raise TypeError(f"{name}: expected a [B] integer tensor, got {type(lengths).__name__}")
    if not values:
        raise ValueError(f"{name}: expected at least one request")
    if min(values) < 0:
        raise ValueError(f"{name}: lengths must be >= 0, got {min(values)}")
    return values


def host_offsets(name: str, qo_offset, batch: int, default: List[int]) -> List[int]:
    """None -> default; int -> broadcast; [B] (or [1]) integer tensor / sequence -> host list."""
    if qo_offset is None:
        return list(default)
    if isinstance(qo_offset, bool):
        raise TypeError(f"{name}: expected an int or a [B] integer tensor, got bool")
    if isinstance(qo_offset, int):
        return [qo_offset] * batch
    if isinstance(qo_offset, torch.Tensor):
        if qo_offset.dtype.is_floating_point or qo_offset.dtype == torch.bool:
            raise TypeError(f"{name}: dtype {qo_offset.dtype} is not supported; expected an "
                            "integer tensor")
        values = [int(x) for x in qo_offset.reshape(-1).tolist()]
    elif isinstance(qo_offset, (list, tuple)):
        values = [int(x) for x in qo_offset]
    else:
        raise TypeError(f"{name}: expected an int or a [B] integer tensor, got "
                        f"{type(qo_offset).__name__}")
    if len(values) == 1 and batch > 1:
        values = values * batch
    if len(values) != batch:
        raise ValueError(f"{name}: expected {batch} offsets (one per request), got {len(values)}")
    return values


def prefix_sums(values: Sequence[int]) -> List[int]:
    out = [0]
    for x in values:
        out.append(out[-1] + int(x))
    return out


def int32_tensor(values: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def check_int(name: str, value, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def check_heads(num_qo_heads, num_kv_heads) -> Tuple[int, int]:
    """num_kv_heads -1 means "take Hkv from k at run time"."""
    check_int("num_qo_heads", num_qo_heads, minimum=1)
    check_int("num_kv_heads", num_kv_heads)
    if num_kv_heads == 0 or num_kv_heads < -1:
        raise ValueError(f"num_kv_heads: must be -1 or >= 1, got {num_kv_heads}")
    if num_kv_heads > 0 and num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    return num_qo_heads, num_kv_heads


def check_plan_dict(name, plan):
    if not isinstance(plan, dict) or "MM-SA-Nv" not in plan or "host_qo_lens" not in plan:
        raise TypeError(f"{name}: expected a plan from fmha_sm100_plan or sparse_fmha_plan")


def check_qkv(q, k, v):
    check_tensor("q", q, dtypes=(BF16, FP8), ndim=3)
    check_head_dim("q", q.shape[2])
    check_tensor("k", k, dtypes=(BF16, FP8), ndim=(3, 4))
    check_tensor("v", v, dtypes=(BF16, FP8), ndim=(3, 4))
    if v.dtype != k.dtype:
        raise TypeError(f"v: dtype {v.dtype} differs from k's {k.dtype}")
    if q.dtype == FP8 and k.dtype != FP8:
        raise TypeError("k: e4m3 q needs e4m3 K/V (bf16 q may use bf16 or e4m3 K/V)")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {list(v.shape)} differs from k's {list(k.shape)}")
    check_head_dim("k", k.shape[-1])
    check_same_device(q=q, k=k, v=v)


def check_out(out, q, out_dtype):
    check_tensor("out", out, dtypes=(out_dtype,), ndim=3)
    check_shape("out", out, (q.shape[0], q.shape[1], HEAD_DIM))
    check_same_device(q=q, out=out)


def call_scales(opts) -> Tuple[float, float]:
    sm_scale = check_scale("sm_scale", opts["sm_scale"])
    sm_scale = HEAD_DIM ** -0.5 if sm_scale is None else sm_scale
    factors = [check_scale(n, opts[n]) for n in ("q_scale", "k_scale", "v_scale", "o_scale")]
    q_scale, k_scale, v_scale, o_scale = [1.0 if f is None else f for f in factors]
    return sm_scale * q_scale * k_scale, v_scale * o_scale


def override_offsets(plan, q_offset_override, device
                     ) -> Tuple[torch.Tensor, Optional[List[int]]]:
    """(device [B] int32 offsets, host list when known without a device read)."""
    batch = plan["batch"]
    if q_offset_override is None:
        return _to(plan["qo_offset"], device), plan["host_qo_offset"]
    if isinstance(q_offset_override, bool):
        raise TypeError("q_offset_override: expected an int or a [B] integer tensor")
    if isinstance(q_offset_override, int):
        host = [q_offset_override] * batch
        return int32_tensor(host, device), host
    check_tensor("q_offset_override", q_offset_override,
                 dtypes=(torch.int32, torch.int64), ndim=1)
    if q_offset_override.numel() not in (1, batch):
        raise ValueError(f"q_offset_override: expected shape [{batch}], got "
                         f"{list(q_offset_override.shape)}")
    t = q_offset_override.to(device, torch.int32).expand(batch).contiguous()
    return t, None


def page_table_from_indices(kv_indices, plan, page_size, num_pages, device,
                            check_input_valid) -> torch.Tensor:
    """Flat kv_indices (request after request) -> [B, max_pages] int32 page table on device.
    Unused slots hold 0 (never read: they lie past the request's length)."""
    if kv_indices is None:
        raise ValueError("kv_indices: paged K/V need kv_indices (or a page_table on "
                         "sparse-prefill plans)")
    check_tensor("kv_indices", kv_indices, dtypes=(torch.int32,), ndim=1)
    pages = [-(-n // page_size) for n in plan["host_kv_lens"]]
    need = sum(pages)
    if kv_indices.shape[0] < need:
        raise ValueError(f"kv_indices: has {kv_indices.shape[0]} entries but the requests need "
                         f"{need} pages")
    if check_input_valid and need:
        host = kv_indices[:need].to("cpu", torch.int64)
        if int(host.min()) < 0 or int(host.max()) >= num_pages:
            raise ValueError(f"kv_indices: values must lie in [0, {num_pages})")
    table = torch.zeros(plan["batch"], max(max(pages), 1), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = kv_indices[start:start + n].to(device)
        start += n
    return table


def check_plan_page_table(page_table, plan, page_size, device, num_pages, check_input_valid):
    need = max(-(-n // page_size) for n in plan["host_kv_lens"])
    check_page_table(page_table, plan["batch"], min_pages=need)
    if page_table.device != device:
        raise ValueError(f"page_table: is on {page_table.device} but q is on {device}")
    if check_input_valid:
        check_page_ids("page_table", host_int64(t=page_table)["t"],
                       torch.tensor(plan["host_kv_lens"], dtype=torch.int64), page_size,
                       num_pages)


def kv_head_block_indexes(kv_block_indexes, plan, total_q, hq, hkv, device) -> torch.Tensor:
    """[T, Hkv | Hq, n] -> [T, Hkv, n] (with Hq rows, every G-th head row is used)."""
    check_tensor("kv_block_indexes", kv_block_indexes, dtypes=(torch.int32,), ndim=3)
    if kv_block_indexes.device != device:
        raise ValueError(f"kv_block_indexes: is on {kv_block_indexes.device} but q is on "
                         f"{device}")
    t, h, n = kv_block_indexes.shape
    if t != total_q or n != plan["kv_block_num"] or h not in (hkv, hq):
        raise ValueError(f"kv_block_indexes: expected shape [{total_q}, {hkv} or {hq}, "
                         f"{plan['kv_block_num']}], got {list(kv_block_indexes.shape)}")
    if h == hkv:
        return kv_block_indexes
    return kv_block_indexes[:, ::hq // hkv]


def check_block_index_values(kv_block_indexes, q_lens, kv_lens, page_size) -> None:
    """check_input_valid: ids >= 0 strictly ascending, -1 only at the tail, ids below the
    request's page count (ceil(kv_len / page_size))."""
    sel = kv_block_indexes.to("cpu", torch.int64)
    if sel.numel() == 0:
        return
    valid = sel != -1
    if bool((sel < -1).any()):
        raise ValueError("kv_block_indexes: entries must be block ids >= 0 or -1")
    if bool((valid[..., 1:] & ~valid[..., :-1]).any()):
        raise ValueError("kv_block_indexes: -1 padding must sit at the tail of each row")
    both = valid[..., 1:] & valid[..., :-1]
    if bool((both & (sel[..., 1:] <= sel[..., :-1])).any()):
        raise ValueError("kv_block_indexes: valid entries must be strictly ascending")
    pages = torch.tensor([-(-n // page_size) for n in kv_lens], dtype=torch.int64)
    limit = torch.repeat_interleave(pages, torch.tensor(q_lens, dtype=torch.int64))
    if bool((valid & (sel >= limit.view(-1, 1, 1))).any()):
        raise ValueError("kv_block_indexes: an id is out of range for its request's page count")
