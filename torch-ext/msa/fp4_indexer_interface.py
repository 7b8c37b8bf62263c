"""``fp4_indexer_block_scores``: FP4 q.k block scores for the MSA indexer (contract §1.5).

For every query head, KV page (128 keys) and query, the score is the max over the page's visible
keys of the raw dequantized q.k. Top-k selection stays with the caller.

Scales come in one of two layouts:

* ``"public"``: Q [total_q, Hq, G] and K [pages, Hk, 128, G], one scale per group of
  128/G elements along D.
* ``"preordered_mma"``: the block-scaled MMA storage, contiguous
  ``(L, ceil(mn/128), ceil(G/4), 32, 4, 4)`` with (mn, L) = (total_q, Hq) for Q and
  (128, pages*Hk) for K. Scale (m, g) of slice l sits at
  ``[l, m//128, g//4, m%32, (m//32)%4, g%4]`` (the 128x4 tile pattern); padding is ignored.
  :func:`fp4_indexer_reorder_scales_for_mma_cute` converts public scales to it.

G is 8 for ``"nvfp4"`` (E4M3 scales, 16 elements each) and 4 for ``"mxfp4"`` (E8M0 scales,
32 elements each).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from . import _backend
from ._validation import (check_fp4_indexer_values, check_positive_int, check_same_device,
                          check_tensor, value_checks_requested)
from .reference.fp4 import fp4_block_scores_reference
from ._fp4_format import (FP4_PACKED_D_BYTES, PAGE_SIZE, Fp4FormatSpec, ceil_div,
                          normalize_fp4_format)

PUBLIC_SCALE_LAYOUT = "public"
PREORDERED_MMA_SCALE_LAYOUT = "preordered_mma"
_ALIGNMENT = 128   # bytes; native kernels load Q/K with TMA


def _packed_fp4_dtypes() -> Tuple[torch.dtype, ...]:
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    return (torch.uint8, torch.int8) + ((fp4x2,) if fp4x2 is not None else ())


def normalize_scale_layout(scale_layout) -> str:
    """"public" or "preordered_mma"; anything else raises ValueError naming scale_layout."""
    if scale_layout not in (PUBLIC_SCALE_LAYOUT, PREORDERED_MMA_SCALE_LAYOUT):
        raise ValueError(f"scale_layout: expected 'public' or 'preordered_mma', got "
                         f"{scale_layout!r}")
    return scale_layout


# ---------------------------------------------------------------------------------------------
# Preordered MMA scale layout
# ---------------------------------------------------------------------------------------------

def _rest(mn: int, spec: Fp4FormatSpec) -> Tuple[int, int]:
    return ceil_div(mn, 128), ceil_div(spec.scale_groups, 4)


def fp4_indexer_mma_scale_shape(mn: int, l: int, *, fp4_format: str) -> Tuple[int, ...]:
    """Shape of the semantic MMA scale view: (32, 4, ceil(mn/128), 4, ceil(G/4), l), indexed
    [m%32, (m//32)%4, m//128, g%4, g//4, l]."""
    spec = normalize_fp4_format(fp4_format)
    rest_m, rest_g = _rest(mn, spec)
    return (32, 4, rest_m, 4, rest_g, int(l))


def fp4_indexer_mma_scale_stride(mn: int, l: int, *, fp4_format: str) -> Tuple[int, ...]:
    """Element strides of the semantic view over the contiguous storage layout."""
    spec = normalize_fp4_format(fp4_format)
    rest_m, rest_g = _rest(mn, spec)
    return (16, 4, 512 * rest_g, 1, 512, 512 * rest_m * rest_g)


def fp4_indexer_mma_scale_storage_shape(mn: int, l: int, *, fp4_format: str) -> Tuple[int, ...]:
    """Contiguous storage shape (l, ceil(mn/128), ceil(G/4), 32, 4, 4) that
    scale_layout="preordered_mma" takes."""
    spec = normalize_fp4_format(fp4_format)
    rest_m, rest_g = _rest(mn, spec)
    return (int(l), rest_m, rest_g, 32, 4, 4)


def fp4_indexer_mma_scale_storage_stride(mn: int, l: int, *, fp4_format: str
                                         ) -> Tuple[int, ...]:
    """Row-major strides of :func:`fp4_indexer_mma_scale_storage_shape`."""
    spec = normalize_fp4_format(fp4_format)
    rest_m, rest_g = _rest(mn, spec)
    return (512 * rest_m * rest_g, 512 * rest_g, 512, 16, 4, 1)


def _public_to_storage(scale: torch.Tensor, mn: int, groups: int) -> torch.Tensor:
    """[mn, L, G] scales -> contiguous storage (L, restM, restG, 32, 4, 4); padding 0."""
    _, l, _ = scale.shape
    rest_m, rest_g = ceil_div(mn, 128), ceil_div(groups, 4)
    padded = torch.zeros(l, rest_m * 128, rest_g * 4, dtype=torch.uint8, device=scale.device)
    padded[:, :mn, :groups] = scale.view(torch.uint8).permute(1, 0, 2)
    # m = rm*128 + m1*32 + m0 and g = rg*4 + g0 -> [l, rm, rg, m0, m1, g0]
    tiles = padded.view(l, rest_m, 4, 32, rest_g, 4).permute(0, 1, 4, 3, 2, 5)
    return tiles.contiguous().view(scale.dtype)


def _storage_to_public(storage: torch.Tensor, mn: int, groups: int) -> torch.Tensor:
    """Inverse of :func:`_public_to_storage`: storage -> [mn, L, G]."""
    l, rest_m, rest_g = storage.shape[:3]
    raw = storage.view(torch.uint8) if storage.dtype != torch.uint8 else storage
    padded = raw.permute(0, 1, 4, 3, 2, 5).reshape(l, rest_m * 128, rest_g * 4)
    return padded[:, :mn, :groups].permute(1, 0, 2).view(storage.dtype)


def fp4_indexer_reorder_scales_for_mma_cute(q_scale: torch.Tensor, k_scale: torch.Tensor, *,
                                            fp4_format: str
                                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reorder public Q/K scales to the block-scaled MMA layout (any device; pure PyTorch).

    q_scale [total_q, Hq, G], k_scale [pages, Hk, 128, G], dtype float8_e4m3fn (nvfp4) or
    float8_e8m0fnu (mxfp4), or raw uint8 bytes. Returns (q_scale_mma, k_scale_mma) as the
    semantic views of :func:`fp4_indexer_mma_scale_shape` / ``_stride`` (mn, L) =
    (total_q, Hq) and (128, pages*Hk). ``view.permute(5, 2, 4, 0, 1, 3)`` is the contiguous
    storage that ``fp4_indexer_block_scores(..., scale_layout="preordered_mma")`` takes.
    Padding entries are 0.
    """
    spec = normalize_fp4_format(fp4_format)
    _check_scale_dtype("q_scale", q_scale, spec)
    _check_scale_dtype("k_scale", k_scale, spec)
    check_tensor("q_scale", q_scale, ndim=3)
    check_tensor("k_scale", k_scale, ndim=4)
    check_same_device(q_scale=q_scale, k_scale=k_scale)
    g = spec.scale_groups
    if q_scale.shape[2] != g:
        raise ValueError(f"q_scale: expected shape [total_q, Hq, {g}], got {list(q_scale.shape)}")
    if k_scale.shape[2] != PAGE_SIZE or k_scale.shape[3] != g:
        raise ValueError(f"k_scale: expected shape [pages, Hk, {PAGE_SIZE}, {g}], got "
                         f"{list(k_scale.shape)}")
    total_q = q_scale.shape[0]
    pages, hk = k_scale.shape[:2]
    q_storage = _public_to_storage(q_scale, total_q, g)
    k_public = k_scale.reshape(pages * hk, PAGE_SIZE, g).permute(1, 0, 2)
    k_storage = _public_to_storage(k_public, PAGE_SIZE, g)
    semantic = (3, 4, 1, 5, 2, 0)   # storage [l, rm, rg, m0, m1, g0] -> [m0, m1, rm, g0, rg, l]
    return q_storage.permute(*semantic), k_storage.permute(*semantic)


# ---------------------------------------------------------------------------------------------
# Block scores
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Fp4IndexerCall:
    """One validated call, as every backend receives it (packed data as uint8 views)."""
    q_fp4: torch.Tensor            # [total_q, Hq, 64] uint8
    k_fp4: torch.Tensor            # [pages, Hk, 128, 64] uint8
    q_scale: torch.Tensor          # as given (layout per scale_layout)
    k_scale: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    cu_page_offsets: torch.Tensor
    kv_indices: torch.Tensor
    qo_offset: Optional[torch.Tensor]
    spec: Fp4FormatSpec
    causal: bool
    scale_layout: str
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_tiles(self) -> int:
        return ceil_div(self.max_seqlen_k, PAGE_SIZE)

    def features(self) -> dict:
        aligned = all(t.data_ptr() % _ALIGNMENT == 0 for t in (self.q_fp4, self.k_fp4))
        return dict(fp4_format=self.spec.name, causal=self.causal,
                    scale_layout=self.scale_layout, has_qo_offset=self.qo_offset is not None,
                    qhead_per_kv=self.q_fp4.shape[1] // self.k_fp4.shape[1], aligned=aligned)

    def public_scales(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(q_scale [total_q, Hq, G], k_scale [pages, Hk, 128, G]) in the public layout."""
        if self.scale_layout == PUBLIC_SCALE_LAYOUT:
            return self.q_scale, self.k_scale
        total_q, hq = self.q_fp4.shape[:2]
        pages, hk = self.k_fp4.shape[:2]
        g = self.spec.scale_groups
        q_public = _storage_to_public(self.q_scale, total_q, g)
        k_public = _storage_to_public(self.k_scale, PAGE_SIZE, g)     # [128, pages*Hk, G]
        k_public = k_public.permute(1, 0, 2).reshape(pages, hk, PAGE_SIZE, g)
        return q_public, k_public


def fp4_indexer_block_scores(q_fp4, k_fp4, q_scale, k_scale, cu_seqlens_q, cu_seqlens_k,
                             cu_page_offsets, *, max_seqlen_q, max_seqlen_k, kv_indices,
                             fp4_format, causal=False, qo_offset=None,
                             scale_layout=PREORDERED_MMA_SCALE_LAYOUT, check_input_valid=False):
    """FP4 indexer scores: the max of raw q.k over each 128-key page (contract §1.5).

    Args:
      q_fp4: [total_q, Hq, 64] packed FP4 (uint8, int8 or float4_e2m1fn_x2), D = 128, the
        even element in each byte's low nibble.
      k_fp4: [pages, Hk, 128, 64] packed FP4 pages (HND); Hq must be a multiple of Hk and query
        head hq reads key head hq // (Hq / Hk).
      q_scale, k_scale: block scales of `fp4_format` ("nvfp4": float8_e4m3fn, G = 8 groups of
        16; "mxfp4": float8_e8m0fnu, G = 4 groups of 32; raw uint8 bytes are also accepted), in
        `scale_layout` "public" (Q [total_q, Hq, G], K [pages, Hk, 128, G]) or
        "preordered_mma" (contiguous fp4_indexer_mma_scale_storage_shape(total_q, Hq) for Q and
        (128, pages*Hk) for K).
      cu_seqlens_q, cu_seqlens_k, cu_page_offsets: [B+1] int32 prefix sums of query lengths, key
        lengths and page counts. Page t of request b is kv_indices[cu_page_offsets[b] + t]
        (kv_indices [sum pages] int32) and holds its keys [128t, 128t + 128).
      max_seqlen_q, max_seqlen_k: host upper bounds; the output has ceil(max_seqlen_k/128) tiles.
      causal: key j is visible to query i (batch-local) iff j <= i + offset, offset =
        qo_offset[b] ([B] int32, only with causal) or k_len - q_len.

      check_input_valid: also check the index values (one synchronization; ValueError naming
        the argument): the prefix sums start at 0, rise and cu_seqlens_q ends at total_q; each
        request lists the pages its keys need, within kv_indices and the pool of k_fp4; the
        max_seqlen hints are at least the truth. MSA_CHECK_INPUTS=1 turns it on for every
        call; the reference backend always checks.

    Returns scores [Hq, ceil(max_seqlen_k/128), total_q] fp32: max over visible keys of the
    dequantized q.k (no softmax or global scale), -inf where no key of the page is visible or
    the page is past the request's keys.
    """
    call = _check_block_scores_args(
        q_fp4, k_fp4, q_scale, k_scale, cu_seqlens_q, cu_seqlens_k, cu_page_offsets,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, kv_indices=kv_indices,
        fp4_format=fp4_format, causal=causal, qo_offset=qo_offset, scale_layout=scale_layout)
    _name, native = _backend.choose("fp4_indexer_block_scores", call.q_fp4.device,
                                    **call.features())
    if value_checks_requested(check_input_valid) or native is None:
        check_fp4_indexer_values(call)
    if native is not None:
        return native(call)
    return fp4_indexer_block_scores_reference(call)


def fp4_indexer_block_scores_reference(call: Fp4IndexerCall,
                                       compute_dtype: torch.dtype = torch.float32
                                       ) -> torch.Tensor:
    """The reference backend (tiled; may synchronize)."""
    q_scale, k_scale = call.public_scales()
    return fp4_block_scores_reference(
        call.q_fp4, call.k_fp4, q_scale, k_scale, call.cu_seqlens_q, call.cu_seqlens_k,
        call.cu_page_offsets, kv_indices=call.kv_indices, fmt=call.spec.name,
        block=call.spec.sf_vec_size, num_tiles=call.num_tiles, causal=call.causal,
        qo_offset=call.qo_offset, compute_dtype=compute_dtype)


def _check_scale_dtype(name: str, scale, spec: Fp4FormatSpec) -> None:
    check_tensor(name, scale, dtypes=(spec.torch_scale_dtype, torch.uint8))


def _check_packed(name: str, t, shape_hint: str, ndim: int) -> torch.Tensor:
    check_tensor(name, t, dtypes=_packed_fp4_dtypes(), ndim=ndim, contiguous=True)
    if t.shape[-1] != FP4_PACKED_D_BYTES:
        raise ValueError(f"{name}: expected shape {shape_hint} (64 packed bytes for D = 128), "
                         f"got {list(t.shape)}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _check_index_vector(name: str, t, length: Optional[int] = None) -> None:
    check_tensor(name, t, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if length is not None and t.numel() != length:
        raise ValueError(f"{name}: expected shape [{length}], got {list(t.shape)}")


def _check_block_scores_args(q_fp4, k_fp4, q_scale, k_scale, cu_seqlens_q, cu_seqlens_k,
                             cu_page_offsets, *, max_seqlen_q, max_seqlen_k, kv_indices,
                             fp4_format, causal, qo_offset, scale_layout) -> Fp4IndexerCall:
    spec = normalize_fp4_format(fp4_format)
    scale_layout = normalize_scale_layout(scale_layout)
    q_bytes = _check_packed("q_fp4", q_fp4, "[total_q, Hq, 64]", 3)
    k_bytes = _check_packed("k_fp4", k_fp4, "[pages, Hk, 128, 64]", 4)
    if k_fp4.shape[2] != PAGE_SIZE:
        raise ValueError(f"k_fp4: page size (dim 2) must be {PAGE_SIZE}, got {k_fp4.shape[2]}")
    total_q, hq = q_fp4.shape[:2]
    pages, hk = k_fp4.shape[:2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q_fp4: {hq} query heads are not a multiple of the {hk} key heads of "
                         "k_fp4")

    _check_index_vector("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.numel() < 2:
        raise ValueError(f"cu_seqlens_q: expected shape [B+1] with B >= 1, got "
                         f"{list(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.numel() - 1
    _check_index_vector("cu_seqlens_k", cu_seqlens_k, batch + 1)
    _check_index_vector("cu_page_offsets", cu_page_offsets, batch + 1)
    if kv_indices is None:
        raise ValueError("kv_indices: is required ([sum pages] int32 physical page ids)")
    _check_index_vector("kv_indices", kv_indices)
    if qo_offset is not None:
        if not causal:
            raise ValueError("qo_offset: is only valid with causal=True")
        _check_index_vector("qo_offset", qo_offset, batch)
    check_positive_int("max_seqlen_q", max_seqlen_q)
    check_positive_int("max_seqlen_k", max_seqlen_k)

    g = spec.scale_groups
    _check_scale_dtype("q_scale", q_scale, spec)
    _check_scale_dtype("k_scale", k_scale, spec)
    if scale_layout == PUBLIC_SCALE_LAYOUT:
        want_q, want_k = (total_q, hq, g), (pages, hk, PAGE_SIZE, g)
    else:
        want_q = fp4_indexer_mma_scale_storage_shape(total_q, hq, fp4_format=spec.name)
        want_k = fp4_indexer_mma_scale_storage_shape(PAGE_SIZE, pages * hk, fp4_format=spec.name)
    for name, scale, want in (("q_scale", q_scale, want_q), ("k_scale", k_scale, want_k)):
        if tuple(scale.shape) != tuple(want):
            raise ValueError(f"{name}: expected shape {list(want)} for scale_layout="
                             f"{scale_layout!r} and fp4_format={spec.name!r}, got "
                             f"{list(scale.shape)}")
        if not scale.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (got strides {tuple(scale.stride())})")
    check_same_device(q_fp4=q_fp4, k_fp4=k_fp4, q_scale=q_scale, k_scale=k_scale,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      cu_page_offsets=cu_page_offsets, kv_indices=kv_indices,
                      qo_offset=qo_offset)
    return Fp4IndexerCall(
        q_fp4=q_bytes, k_fp4=k_bytes, q_scale=q_scale, k_scale=k_scale,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, cu_page_offsets=cu_page_offsets,
        kv_indices=kv_indices, qo_offset=qo_offset, spec=spec, causal=bool(causal),
        scale_layout=scale_layout, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k))
