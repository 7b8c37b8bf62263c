"""Host-side helpers shared by the public API modules and the native glue (``_native``).

This module sits below both: it imports only torch and the standard library, never a public API
module or a native module, and touches no CUDA at import. What lives here is what both sides
compute the same way: moving index tensors to the call's device, the SM count, the key length
of a request (the D11 quirk included), the request that owns a token and the clamped
per-request causal offsets.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Union

import torch

KV_BLOCK = 128                  # keys per KV block, tokens per page (MSA's one block size)
H200_SM_COUNT = 132             # the SM count assumed when planning for a CPU device
# Causal offsets are clamped to +-2^30: beyond that every key (or none) is visible anyway, and a
# kernel's position arithmetic (query + offset - key) stays far from int32 overflow.
OFFSET_LIMIT = 2 ** 30


def to_device(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """t on `device` (the same tensor when it is there already; None stays None)."""
    return t if t is None or t.device == device else t.to(device)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sm_count(device: torch.device, usable: int = -1) -> int:
    """The SM count of a CUDA device (cached per device), an H200's 132 for any other device;
    capped at `usable` when that is positive."""
    n = _cuda_sm_count(device) if device.type == "cuda" else H200_SM_COUNT
    return min(n, usable) if usable > 0 else n


def key_lengths(batch: int, device: torch.device, *, cu_seqlens_k: Optional[torch.Tensor],
                page_table: Optional[torch.Tensor],
                seqused_k: Optional[torch.Tensor]) -> torch.Tensor:
    """[B] int32 key length of every request, on `device`, without a host read: seqused_k when
    given; paged without it, the whole page table's width (upstream quirk D11); dense, the
    cu_seqlens_k differences."""
    if seqused_k is not None:
        return seqused_k.contiguous()
    if page_table is not None:
        return torch.full((batch,), page_table.shape[1] * KV_BLOCK, dtype=torch.int32,
                          device=device)
    return (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).contiguous()


def owning_segment(offsets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 index b of the segment [offsets[b], offsets[b+1]) that holds each position, clamped
    to [0, len(offsets) - 2]. The search runs over the whole prefix-sum tensor, not offsets[1:]:
    Inductor (torch 2.11) cannot lower a searchsorted whose boundaries are a slice view."""
    found = torch.searchsorted(offsets.to(torch.int64), positions, right=True) - 1
    return found.clamp(0, max(offsets.numel() - 2, 0))


def causal_offsets(offset: Union[None, int, torch.Tensor], q_lens: Optional[torch.Tensor],
                   k_lens: torch.Tensor, host: Optional[List[int]] = None) -> torch.Tensor:
    """[B] int32 causal offsets on k_lens' device, clamped to +-OFFSET_LIMIT: the given
    qo_offset (an int or a [B] / scalar tensor), or k_len - q_len (bottom-right) when it is
    None. `host`: the tensor's values when the caller knows them without a device read (a
    plan's); a [B] int32 tensor already within the clamp is then returned as is (three
    launches fewer per call)."""
    if offset is None:
        return (k_lens - q_lens).to(torch.int32)
    if (host is not None and isinstance(offset, torch.Tensor) and offset.dtype == torch.int32
            and offset.shape == k_lens.shape and offset.device == k_lens.device
            and offset.is_contiguous() and all(abs(x) <= OFFSET_LIMIT for x in host)):
        return offset
    if isinstance(offset, torch.Tensor):
        offset = offset.to(device=k_lens.device, dtype=torch.int64).reshape(-1)
        offset = offset.expand(k_lens.numel()).clamp(-OFFSET_LIMIT, OFFSET_LIMIT)
        return offset.to(torch.int32)
    return torch.full_like(k_lens, max(-OFFSET_LIMIT, min(OFFSET_LIMIT, int(offset))))
