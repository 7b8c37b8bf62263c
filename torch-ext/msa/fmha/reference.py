"""The reference backends of the fmha ops: exact attention and max-score over an
:class:`~msa.fmha.call.FmhaDenseCall` (:mod:`msa.reference.dense_attention` does the math;
the max-score-only pass is :func:`msa.block_max_scores` with the call's logit scale)."""

from __future__ import annotations

import torch

from .._common import to_device as _to
from .._validation import FP8
from ..indexer import block_max_scores
from ..reference.dense_attention import (dense_attention_reference, dense_token_kv,
                                         paged_token_kv)
from .call import FmhaDenseCall
from .validation import BF16, TILE


def fmha_dense_reference(call: FmhaDenseCall, compute_dtype=torch.float32):
    """The reference backend of "fmha_dense": (O [total_q, Hq, 128] out_dtype or None,
    max_score [Hq, max_k_tiles, total_q] fp32 or None)."""
    plan = call.plan
    host_offset = call.host_qo_offset
    if host_offset is None:
        host_offset = [int(x) for x in call.qo_offset.tolist()]
    kv = _token_kv(call)
    p_quant = FP8 if call.v.dtype == FP8 else None
    o, ms = dense_attention_reference(
        call.q, kv, plan["host_qo_lens"], plan["host_kv_lens"], host_offset,
        causal=plan["causal"], logit_scale=call.logit_scale, output_scale=call.output_scale,
        want_o=call.want_o, max_k_tiles=call.max_k_tiles, selection=call.kv_block_indexes,
        selection_block=call.k.shape[2] if call.paged else TILE, p_quant_dtype=p_quant,
        compute_dtype=compute_dtype)
    return (None if o is None else o.to(call.out_dtype)), ms


def _token_kv(call: FmhaDenseCall):
    plan = call.plan
    if not call.paged:
        return dense_token_kv(call.k, call.v, plan["host_kv_lens"])
    table = call.page_table.to("cpu", torch.int64)
    return paged_token_kv(call.k, call.v, plan["host_kv_lens"], list(table))


def max_score_reference(call: FmhaDenseCall) -> torch.Tensor:
    """Max-score-only reference: msa.block_max_scores with scale sm_scale*q_scale*k_scale.

    FP8 inputs are widened to bf16 (exact for e4m3). Paged K whose page size is not 128 is
    gathered into dense rows first, since block_max_scores pages by 128-token blocks.
    """
    plan = call.plan
    device = call.q.device
    q_idx = call.q if call.q.dtype == BF16 else call.q.to(BF16)
    k_idx = call.k if call.k.dtype == BF16 else call.k.to(BF16)
    cu_q = _to(plan["cu_seqlens_q"], device)
    cu_k = _to(plan["cu_seqlens_k"], device)
    kwargs = dict(max_seqlen_q=plan["max_seqlen_q"], max_seqlen_k=max(plan["max_seqlen_k"], 1),
                  scale=call.logit_scale, causal=plan["causal"],
                  qo_offset=call.qo_offset if plan["causal"] else None,
                  max_k_tiles=call.max_k_tiles)
    if call.paged and call.k.shape[2] == TILE:
        kwargs.update(page_table=call.page_table,
                      seqused_k=_to(plan["kv_segment_lens"], device))
    elif call.paged:
        kv = _token_kv(call)
        rows = [kv.gather(b, 0, n)[0] for b, n in enumerate(plan["host_kv_lens"])]
        k_idx = torch.cat(rows, 0).to(BF16)
    return block_max_scores(q_idx, k_idx, cu_q, cu_k, **kwargs)
