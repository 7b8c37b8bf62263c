"""``sparse_topk_select``: per-query top-k KV block selection from block max scores (contract §2.3).

This is the middle step of the engine flow: indexer max scores (``block_max_scores`` or the fmha
max-score pass) -> ``sparse_topk_select`` -> q2k selection -> k2q CSR -> sparse attention.

Native kernels plug in through ``msa._backend`` under the op name ``"sparse_topk_select"``. A
native ``run`` receives one :class:`TopkSelectCall` (already validated, ``output`` allocated) and
must fill ``call.output`` exactly as the reference does (same ids, same order) and return it. The
``supports(**features)`` predicate sees the keywords listed in :meth:`TopkSelectCall.features`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from . import _backend
from ._validation import check_positive_int, check_same_device, check_shape, check_tensor
from .reference.topk import MAX_TILES, sparse_topk_select_reference

MAX_TOPK = 64
HEAD_REDUCE_MODES = ("max", "sum")
# Upstream asserts max_k_tiles < 12288 (its insertion-sort path). We accept more; a native kernel
# that has the same limit says so in its supports() and the call falls back to the reference.
UPSTREAM_MAX_TILES = 12288


@dataclasses.dataclass
class TopkSelectCall:
    """One validated ``sparse_topk_select`` call, as every backend receives it."""
    max_score: torch.Tensor                         # [H, K, T] fp32 contiguous
    topk: int                                       # 1..64
    num_valid_pages: Union[int, torch.Tensor]       # int in [1, K] or [T] int32
    output: torch.Tensor                            # [T, H_out, topk] int32, rows contiguous
    force_begin_blocks: int
    force_end_blocks: int
    causal_end_block: Optional[torch.Tensor]        # [T] int32 or None
    head_reduce: Optional[str]                      # None, "max" or "sum"
    num_out_heads: int                              # H_out (== H without head_reduce)

    @property
    def num_tiles(self) -> int:
        return self.max_score.shape[1]

    def features(self) -> dict:
        return dict(topk=self.topk, num_heads=self.max_score.shape[0], num_tiles=self.num_tiles,
                    num_out_heads=self.num_out_heads, head_reduce=self.head_reduce,
                    per_query_valid_pages=isinstance(self.num_valid_pages, torch.Tensor),
                    causal_end_block=self.causal_end_block is not None,
                    force_begin_blocks=self.force_begin_blocks,
                    force_end_blocks=self.force_end_blocks)


def sparse_topk_select(max_score: torch.Tensor, topk: int, num_valid_pages=None, output=None,
                       force_begin_blocks: int = 0, force_end_blocks: int = 0, *,
                       causal_end_block: Optional[torch.Tensor] = None,
                       head_reduce: Optional[str] = None,
                       num_out_heads: Optional[int] = None) -> torch.Tensor:
    """Pick, per query token and head, the top-k KV blocks by max score (upstream fmha_sm100 API).

    Args:
      max_score: [H, K, T] float32, contiguous: block max scores per head, KV tile (block id) and
        query token, e.g. from ``block_max_scores`` or the fmha max-score pass. -inf = nothing
        visible in that tile.
      topk: slots per row, 1..64 (upstream accepts only 16; M3 uses 16).
      num_valid_pages: block ids >= it are never emitted. None (= K); an int in [1, K] (upstream
        semantics, one bound for every query); or, as an extension, a [T] int32 tensor with one
        bound per query (values are clamped to [0, K]; 0 gives an all -1 row).
      output: optional preallocated [T, H_out, topk] int32 buffer, filled and returned:
        contiguous, or ``q2k.permute(1, 0, 2)`` for a contiguous [H_out, T, topk] ``q2k`` (the
        selection lands in the layout ``build_k2q_csr`` takes, without a transposing copy).
      force_begin_blocks (fb), force_end_blocks (fe): ints >= 0 with fb + fe <= topk.
      causal_end_block: optional [T] int32 (fork extension): the last block query t may select,
        normally its own block (i + k_len - q_len) // 128. Ids > causal_end_block[t] are never
        emitted, and the force_end window ends there.
      head_reduce: None (each of the H rows selects independently), "max" or "sum" (fork
        extension): first reduce each group of H / num_out_heads consecutive heads, by max or by
        an fp32 sum in ascending head order, then select once per group.
      num_out_heads: H_out, required with head_reduce (a divisor of H); None or H otherwise.

    Semantics, per row (token t, output head h), with end = min(nvp_t, causal_end_block[t] + 1)
    clamped to [0, K] (end = nvp_t without causal_end_block):
      * eligible ids are 0 .. end-1;
      * forced ids F = ({0 .. fb-1} ∪ {end-fe .. end-1}) ∩ [0, end) are always emitted, whatever
        their score (with causal_end_block and fe = 1 that is the query's own block);
      * the other topk - |F| slots take the eligible non-forced ids with the largest scores, ties
        to the lower id; ids whose score is -inf (or NaN) are never filled in: they would add no
        visible key, so such a row simply ends earlier;
      * the row lists the chosen ids ascending, then -1 up to topk: -1 only at the tail, no
        duplicates.

    Returns [T, H_out, topk] int32 (``output`` itself when given). Its transpose [H_out, T,
    topk] is the q2k selection that ``build_k2q_csr`` takes when H_out is the KV head count;
    ``output=q2k.permute(1, 0, 2)`` writes it there directly.

    Errors: upstream raises AssertionError; we raise the contract classes instead: TypeError for a
    wrong dtype or a non-int argument, ValueError for shapes, devices and out-of-range values
    (topk, num_valid_pages, fb/fe, head_reduce / num_out_heads). The reference handles any K below
    2^24; native kernels may decline very large K (upstream's bound is K < 12288).
    """
    call = _check_topk_args(max_score, topk, num_valid_pages, output, force_begin_blocks,
                            force_end_blocks, causal_end_block, head_reduce, num_out_heads)
    return run_topk_select(call)


def run_topk_select(call: TopkSelectCall) -> torch.Tensor:
    """A validated call on the backend _backend chooses; fills and returns call.output."""
    entry = _backend.compile_entry("sparse_topk_select")
    if entry is not None:
        return entry(call)
    _name, native = _backend.choose("sparse_topk_select", call.max_score.device,
                                    **call.features())
    if native is not None:
        return native(call)
    return sparse_topk_select_reference(
        call.max_score, call.topk, num_valid_pages=call.num_valid_pages,
        force_begin_blocks=call.force_begin_blocks, force_end_blocks=call.force_end_blocks,
        causal_end_block=call.causal_end_block, head_reduce=call.head_reduce,
        num_out_heads=call.num_out_heads, out=call.output)


def _check_topk_args(max_score, topk, num_valid_pages, output, force_begin_blocks,
                     force_end_blocks, causal_end_block, head_reduce, num_out_heads
                     ) -> TopkSelectCall:
    check_tensor("max_score", max_score, dtypes=(torch.float32,), ndim=3, contiguous=True)
    num_heads, num_tiles, total_q = max_score.shape
    if num_heads < 1 or num_tiles < 1:
        raise ValueError(f"max_score: expected [H, K, T] with H >= 1 and K >= 1, got "
                         f"{list(max_score.shape)}")
    if num_tiles >= MAX_TILES:
        raise ValueError(f"max_score: {num_tiles} KV tiles; at most {MAX_TILES - 1} are supported")
    check_positive_int("topk", topk, minimum=1)
    if topk > MAX_TOPK:
        raise ValueError(f"topk: must be in [1, {MAX_TOPK}], got {topk}")
    fb = check_positive_int("force_begin_blocks", force_begin_blocks)
    fe = check_positive_int("force_end_blocks", force_end_blocks)
    if fb + fe > topk:
        raise ValueError(f"force_begin_blocks: force_begin_blocks + force_end_blocks = {fb + fe} "
                         f"exceeds topk = {topk}")

    if num_valid_pages is None:
        nvp = num_tiles
    elif isinstance(num_valid_pages, torch.Tensor):
        check_tensor("num_valid_pages", num_valid_pages, dtypes=(torch.int32,), ndim=1,
                     contiguous=True)
        check_shape("num_valid_pages", num_valid_pages, (total_q,))
        nvp = num_valid_pages
    else:
        nvp = check_positive_int("num_valid_pages", num_valid_pages, minimum=1)
        if nvp > num_tiles:
            raise ValueError(f"num_valid_pages: must be in [1, K = {num_tiles}], got {nvp}")

    if causal_end_block is not None:
        check_tensor("causal_end_block", causal_end_block, dtypes=(torch.int32,), ndim=1,
                     contiguous=True)
        check_shape("causal_end_block", causal_end_block, (total_q,))

    if head_reduce is None:
        if num_out_heads is not None and num_out_heads != num_heads:
            raise ValueError(f"num_out_heads: {num_out_heads} needs head_reduce; without it the "
                             f"output has the {num_heads} heads of max_score")
        out_heads = num_heads
    else:
        if head_reduce not in HEAD_REDUCE_MODES:
            raise ValueError(f"head_reduce: expected None, 'max' or 'sum', got {head_reduce!r}")
        if num_out_heads is None:
            raise ValueError("num_out_heads: required when head_reduce is given")
        out_heads = check_positive_int("num_out_heads", num_out_heads, minimum=1)
        if num_heads % out_heads != 0:
            raise ValueError(f"num_out_heads: {out_heads} does not divide the {num_heads} heads "
                             "of max_score")

    if output is None:
        output = torch.empty(total_q, out_heads, topk, dtype=torch.int32,
                             device=max_score.device)
    else:
        check_tensor("output", output, dtypes=(torch.int32,), ndim=3)
        check_shape("output", output, (total_q, out_heads, topk))
        if not (output.is_contiguous() or output.permute(1, 0, 2).is_contiguous()):
            raise ValueError("output: must be a contiguous [T, H_out, topk] tensor or the "
                             "permute(1, 0, 2) view of a contiguous [H_out, T, topk] one (the "
                             f"q2k layout), got strides {tuple(output.stride())}")
    check_same_device(max_score=max_score, output=output,
                      num_valid_pages=nvp if isinstance(nvp, torch.Tensor) else None,
                      causal_end_block=causal_end_block)
    return TopkSelectCall(max_score=max_score, topk=int(topk), num_valid_pages=nvp, output=output,
                          force_begin_blocks=fb, force_end_blocks=fe,
                          causal_end_block=causal_end_block, head_reduce=head_reduce,
                          num_out_heads=out_heads)
