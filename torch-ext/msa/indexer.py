"""The MSA indexer: per-block max scores.

``block_max_scores`` is the proxy pass of the engine flow (contract §2.2, the max-score output):
per query token, index head and 128-token KV tile, the max over the tile's causally visible keys
of ``scale * q_idx . k_idx``. :func:`msa.prefill.msa_prefill` chains it with
``sparse_topk_select``, ``build_k2q_csr`` and ``sparse_atten_func`` the way M3 prefill does.

Native kernels plug in through ``msa._backend`` under the op name ``"block_max_scores"``: a native
``run`` receives one validated :class:`BlockMaxScoreCall` and returns the [H, max_k_tiles,
total_q] fp32 tensor. The fmha max-score mode calls :func:`block_max_scores` too.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from . import _backend
from ._validation import (BLOCK_SIZE, FP8, check_block_max_values, check_cu_seqlens,
                          check_head_dim, check_page_table, check_positive_int,
                          check_same_device, check_scale, check_shape, check_tensor,
                          value_checks_requested)
from .reference.max_score import block_max_scores_reference

INDEX_DTYPES = (torch.bfloat16, FP8, torch.float32)


@dataclasses.dataclass
class BlockMaxScoreCall:
    """One validated ``block_max_scores`` call, as every backend receives it."""
    q_idx: torch.Tensor                      # [total_q, H, 128]
    k_idx: torch.Tensor                      # dense [total_k, Hk, 128] / paged [pages, Hk, 128, 128]
    cu_seqlens_q: torch.Tensor               # [B+1] int32
    cu_seqlens_k: Optional[torch.Tensor]     # [B+1] int32 (may be None when paged)
    max_seqlen_q: int
    max_seqlen_k: int
    max_k_tiles: int
    scale: float
    causal: bool
    qo_offset: Union[None, int, torch.Tensor]   # None, int, or [B] int32/int64
    page_table: Optional[torch.Tensor]       # [B, max_pages] int32
    seqused_k: Optional[torch.Tensor]        # [B] int32
    check_values: bool = False               # check_input_valid / MSA_CHECK_INPUTS=1
    # A plan's call (msa.prefill): its prefix sums are valid by construction, so the native
    # glue takes them as they are.
    planned_lengths: bool = False
    # A plan's [B] int32 bottom-right causal offsets (k_len - q_len per request, on the device):
    # the native glue takes them instead of deriving them (two launches a call). Same result.
    planned_offsets: Optional[torch.Tensor] = None
    # CTAs per query tile along the key tiles (msa.prefill's short chunks against long prefixes:
    # the same scores from more SMs); a native kernel's launch shape only.
    key_splits: int = 1

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    def features(self) -> dict:
        return dict(q_dtype=self.q_idx.dtype, k_dtype=self.k_idx.dtype, paged=self.paged,
                    causal=self.causal, num_heads=self.q_idx.shape[1],
                    num_k_heads=self.k_idx.shape[1], max_k_tiles=self.max_k_tiles,
                    qo_offset=self.qo_offset is not None, batch=self.cu_seqlens_q.numel() - 1)


def block_max_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: Optional[torch.Tensor], *, max_seqlen_q: int,
                     max_seqlen_k: int, scale: float = 1.0, causal: bool = True,
                     qo_offset: Union[None, int, torch.Tensor] = None,
                     page_table: Optional[torch.Tensor] = None,
                     seqused_k: Optional[torch.Tensor] = None,
                     max_k_tiles: Optional[int] = None,
                     check_input_valid: bool = False) -> torch.Tensor:
    """Per-128-token-block max of the index scores: the MSA indexer's pooled output.

    Args:
      q_idx: [total_q, H, 128] bf16, float8_e4m3fn or float32, contiguous (index queries; one
        head per KV group in M3).
      k_idx: dense [total_k, Hk, 128] or paged HND [pages, Hk, 128, 128], same dtype choices
        (q and k dtypes may differ, e.g. bf16 q with an e4m3 index-K cache), contiguous. H must
        be a multiple of Hk; query head h reads key head h // (H / Hk). M3 has Hk = 1 (one shared
        index key).
      cu_seqlens_q, cu_seqlens_k: [B+1] int32 prefix sums. In paged mode cu_seqlens_k is only
        shape-checked and may be None.
      max_seqlen_q, max_seqlen_k: host upper bounds (>= 1); max_seqlen_k may exceed the real max.
      scale: multiplies every dot product (> 0, so rankings never flip). M3's indexer uses 1.0;
        the paper uses 128**-0.5; the fmha max-score mode passes sm_scale * q_scale * k_scale.
      causal: key j of request b is visible to its query i iff j < k_len_b and, when causal,
        j <= i + offset_b, with offset_b = qo_offset (int, or [B] int32/int64 tensor) or, by
        default, k_len_b - q_len_b (bottom-right). qo_offset requires causal=True.
      page_table: [B, max_pages] int32 logical block -> page (paged mode); seqused_k: [B] int32
        key lengths (paged only). Paged without seqused_k takes k_len = max_pages * 128 (the
        upstream quirk; always pass seqused_k).
      max_k_tiles: width of the tile axis, default ceil(max_seqlen_k / 128). Tiles at or past it
        are not computed (pass enough).
      check_input_valid: also check the index values (one synchronization; ValueError naming
        the argument): cu_seqlens start at 0, rise and end at the tensors' lengths, seqused_k
        lies within the page table, every page holding keys is a page of k_idx, and
        max_seqlen_q / max_seqlen_k are at least the truth (a short max_seqlen_k leaves the
        tiles past it uncomputed). MSA_CHECK_INPUTS=1 turns it on for every call; the
        reference backend always checks. Unchecked native calls never read or write out of
        bounds (pages outside the pool count as invisible).

    Non-finite data: a NaN score makes its tile's max NaN in the reference; the native kernel's
    max may skip it (hardware fmax drops NaN operands). sparse_topk_select never selects a NaN
    or -inf tile either way; the attention itself propagates NaN (sparse_atten_func).

    Returns max_score [H, max_k_tiles, total_q] float32, contiguous:
      max_score[h, beta, t] = max over visible keys j of tile beta (keys 128*beta .. 128*beta+127
      of t's request) of scale * <q_idx[t, h], k_idx[j, h // G]>, accumulated in fp32; -inf where
      no key of the tile is visible, in particular for every tile at or past the request's
      ceil(k_len / 128) tiles.

    The reference backend works in query x key-tile chunks (no N x N matrix; a 32k-token
    sequence with H = 4 stays well under 1 GB of scratch) and synchronizes on the host.
    """
    call = check_block_max_args(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, scale, causal, qo_offset, page_table, seqused_k,
                                 max_k_tiles)
    call.check_values = value_checks_requested(check_input_valid)
    return run_block_max_scores(call)


def chunk_block_max_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int,
                           max_seqlen_k: int, scale: float = 1.0, causal: bool = True,
                           page_table=None, seqused_k=None, max_k_tiles: Optional[int] = None,
                           planned: bool = False, key_splits: int = 1,
                           planned_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """block_max_scores (the same checks and result) of one msa.prefill chunk, bottom-right
    causal. `planned`: cu_seqlens_q / cu_seqlens_k are prefix sums a plan made on the host,
    valid by construction, so the native glue takes them as they are instead of deriving them
    on the device (up to seven small launches a call); `planned_offsets` (with `planned` and
    causal): the plan's [B] int32 bottom-right offsets, k_len - q_len per request, likewise.
    `key_splits`: CTAs per query tile along its key tiles (>= 1), for a chunk whose query
    tiles alone leave SMs idle."""
    check_positive_int("key_splits", key_splits, minimum=1)
    call = check_block_max_args(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, scale, causal, None, page_table, seqused_k,
                                max_k_tiles)
    call.check_values = value_checks_requested(False)
    call.planned_lengths = bool(planned)
    if planned and causal and planned_offsets is not None:
        check_tensor("planned_offsets", planned_offsets, dtypes=(torch.int32,), ndim=1,
                     contiguous=True)
        check_shape("planned_offsets", planned_offsets, (cu_seqlens_q.numel() - 1,))
        check_same_device(q_idx=q_idx, planned_offsets=planned_offsets)
        call.planned_offsets = planned_offsets
    call.key_splits = int(key_splits)
    return run_block_max_scores(call)


def run_block_max_scores(call: BlockMaxScoreCall) -> torch.Tensor:
    """A validated call on the backend _backend chooses."""
    entry = _backend.compile_entry("block_max_scores")
    if entry is not None:
        return entry(call)
    _name, native = _backend.choose("block_max_scores", call.q_idx.device, **call.features())
    if call.check_values or native is None:
        check_block_max_values(call)
    if native is not None:
        return native(call)
    return block_max_scores_reference(
        call.q_idx, call.k_idx, call.cu_seqlens_q, call.cu_seqlens_k,
        max_k_tiles=call.max_k_tiles, scale=call.scale, causal=call.causal,
        qo_offset=call.qo_offset, page_table=call.page_table, seqused_k=call.seqused_k)


def check_block_max_args(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          scale, causal, qo_offset, page_table, seqused_k, max_k_tiles
                          ) -> BlockMaxScoreCall:
    check_tensor("q_idx", q_idx, dtypes=INDEX_DTYPES, ndim=3, contiguous=True)
    check_head_dim("q_idx", q_idx.shape[2])
    check_tensor("k_idx", k_idx, dtypes=INDEX_DTYPES, ndim=(3, 4), contiguous=True)
    check_head_dim("k_idx", k_idx.shape[-1])
    num_heads, num_k_heads = q_idx.shape[1], k_idx.shape[1]
    if num_heads < 1 or num_k_heads < 1 or num_heads % num_k_heads != 0:
        raise ValueError(f"q_idx: {num_heads} heads are not a multiple of the {num_k_heads} heads "
                         "of k_idx")
    paged = k_idx.dim() == 4
    if paged:
        if page_table is None:
            raise ValueError("page_table: paged k_idx [pages, Hk, 128, 128] needs a page_table")
        if k_idx.shape[2] != BLOCK_SIZE:
            raise ValueError(f"k_idx: page size {k_idx.shape[2]} is not supported; only "
                             f"{BLOCK_SIZE}")
        if cu_seqlens_k is None:
            cu_seqlens_k_checked = None
            check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1,
                         contiguous=True)
            if cu_seqlens_q.numel() < 2:
                raise ValueError(f"cu_seqlens_q: expected shape [B+1] with B >= 1, got "
                                 f"{list(cu_seqlens_q.shape)}")
            batch = cu_seqlens_q.numel() - 1
        else:
            batch = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
            cu_seqlens_k_checked = cu_seqlens_k
        check_page_table(page_table, batch, seqused_k=seqused_k)
    else:
        if cu_seqlens_k is None:
            raise ValueError("cu_seqlens_k: required with dense k_idx [total_k, Hk, 128]")
        batch = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
        cu_seqlens_k_checked = cu_seqlens_k
        if page_table is not None:
            raise ValueError("page_table: given with dense k_idx [total_k, Hk, 128]; paged k_idx "
                             "must be [pages, Hk, 128, 128]")
        if seqused_k is not None:
            raise ValueError("seqused_k: allowed only with paged k_idx (page_table)")
    check_positive_int("max_seqlen_q", max_seqlen_q, minimum=1)
    check_positive_int("max_seqlen_k", max_seqlen_k, minimum=1)
    if max_k_tiles is None:
        max_k_tiles = -(-max_seqlen_k // BLOCK_SIZE)
    check_positive_int("max_k_tiles", max_k_tiles, minimum=1)
    scale = check_scale("scale", scale, allow_none=False)
    if qo_offset is not None:
        if not causal:
            raise ValueError("qo_offset: allowed only with causal=True")
        if isinstance(qo_offset, torch.Tensor):
            check_tensor("qo_offset", qo_offset, dtypes=(torch.int32, torch.int64), ndim=1)
            check_shape("qo_offset", qo_offset, (batch,))
        elif isinstance(qo_offset, bool) or not isinstance(qo_offset, int):
            raise TypeError(f"qo_offset: expected an int or a [B] tensor, got "
                            f"{type(qo_offset).__name__}")
    check_same_device(q_idx=q_idx, k_idx=k_idx, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k_checked, page_table=page_table,
                      seqused_k=seqused_k,
                      qo_offset=qo_offset if isinstance(qo_offset, torch.Tensor) else None)
    return BlockMaxScoreCall(q_idx=q_idx, k_idx=k_idx, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k_checked, max_seqlen_q=int(max_seqlen_q),
                             max_seqlen_k=int(max_seqlen_k), max_k_tiles=int(max_k_tiles),
                             scale=scale, causal=bool(causal), qo_offset=qo_offset,
                             page_table=page_table if paged else None,
                             seqused_k=seqused_k if paged else None)


__all__ = ["block_max_scores", "BlockMaxScoreCall"]
