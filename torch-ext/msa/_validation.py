"""Argument checks shared by every public entry point.

The error classes follow the contract: dtype -> TypeError; shape or device -> ValueError;
unsupported feature -> NotImplementedError. Every message starts with the argument's name so a
caller can tell at once what to fix. All checks run on the host from metadata only (no device
synchronization), before any launch.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

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


def check_same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name}: is on {t.device} but {first} is on {device}; all tensors "
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


def check_qhead_per_kv(hq: int, hkv: int, allowed: Sequence[int] = SUPPORTED_QHEAD_PER_KV) -> int:
    if hkv <= 0 or hq % hkv != 0:
        raise ValueError(f"q: {hq} query heads are not a multiple of the {hkv} KV heads of k")
    g = hq // hkv
    if g not in allowed:
        raise NotImplementedError(f"q: {g} query heads per KV head is not supported; expected one "
                                  f"of {tuple(allowed)}")
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


def check_positive_int(name: str, value, *, allow_none: bool = False, minimum: int = 0):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


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
