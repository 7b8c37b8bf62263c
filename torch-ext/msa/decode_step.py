"""One MSA decode step of a layer as one plan / run: the fused decode indexer + top-k writes the
q2k selection, then block-sparse paged decode attention reads it (:class:`MSADecodeStepWrapper`).

``plan`` (outside CUDA-graph capture) builds the indexer's work split, a persistent q2k buffer
[Hkv, B * seqlen_q, topk] and a :class:`msa.SparseDecodePagedAttentionWrapper` planned on that
buffer (its sparse schedule depends only on topk, so it serves every length). Per decode step,
after writing new lengths into ``seqused_k``: ``update()`` once (the indexer's split of the live
blocks; several layers' wrappers may share one plan, see ``plan(indexer_plan=...)``), then
``run(...)`` for the layer. Everything run does is capturable: no host synchronization, fixed
buffers.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._validation import check_positive_int, check_tensor, check_topk
from .decode import SparseDecodePagedAttentionWrapper
from .decode_indexer import DecodeIndexerPlan, decode_indexer_topk, make_decode_indexer_plan


class MSADecodeStepWrapper:
    """Plan-once, run-many MSA decode step: index scores -> top-k blocks -> sparse attention.

    The selection of query row (request b, MTP query q) and KV head h is index head
    h // (Hkv / H_idx)'s topk - 1 best history blocks plus the row's own block
    (:func:`msa.decode_indexer_topk`); attention then sees exactly those blocks, causally
    (:func:`msa.sparse_decode_atten_func`).
    """

    def __init__(self):
        self.indexer_plan: Optional[DecodeIndexerPlan] = None
        self.attention: Optional[SparseDecodePagedAttentionWrapper] = None
        self.q2k_indices: Optional[torch.Tensor] = None
        self._page_table = None

    def plan(self, *, page_table, seqused_k, seqlen_q, max_seqlen_k, num_qo_heads, num_kv_heads,
             num_index_heads=None, topk=16, max_ctas=None,
             indexer_plan: Optional[DecodeIndexerPlan] = None):
        """Plan a batch; returns self.

        page_table [B, max_pages] int32 and seqused_k [B] int32 are kept by reference (write
        new lengths / pages into them before each step). seqlen_q: queries per request (1..16,
        MTP). num_index_heads: index heads H_idx of q_idx (default num_kv_heads; must divide
        it). topk in {4, 8, 16, 32}. max_ctas: the indexer's CTA budget (default two per SM).
        indexer_plan: a :class:`DecodeIndexerPlan` of this batch to share with other layers'
        wrappers (its seqlen_q, heads and topk must match); by default the wrapper makes one.
        """
        check_positive_int("num_kv_heads", num_kv_heads, minimum=1)
        if num_index_heads is None:
            num_index_heads = num_kv_heads
        check_positive_int("num_index_heads", num_index_heads, minimum=1)
        if num_kv_heads % num_index_heads:
            raise ValueError(f"num_index_heads: {num_index_heads} does not divide num_kv_heads "
                             f"{num_kv_heads}")
        check_topk("topk", topk)
        check_tensor("seqused_k", seqused_k, dtypes=(torch.int32,), ndim=1, contiguous=True)
        if indexer_plan is None:
            indexer_plan = make_decode_indexer_plan(
                seqused_k, seqlen_q=seqlen_q, num_index_heads=num_index_heads,
                max_seqlen_k=max_seqlen_k, topk=topk, max_ctas=max_ctas)
        elif not isinstance(indexer_plan, DecodeIndexerPlan):
            raise TypeError(f"indexer_plan: expected a DecodeIndexerPlan, got "
                            f"{type(indexer_plan).__name__}")
        elif (indexer_plan.seqused_k is not seqused_k or indexer_plan.seqlen_q != seqlen_q
              or indexer_plan.num_index_heads != num_index_heads or indexer_plan.topk != topk):
            raise ValueError("indexer_plan: was made for other lengths, seqlen_q, index heads or "
                             "topk than this plan call")
        batch = seqused_k.numel()
        q2k = torch.full((num_kv_heads, batch * seqlen_q, topk), -1, dtype=torch.int32,
                         device=seqused_k.device)
        attention = SparseDecodePagedAttentionWrapper().plan(
            page_table=page_table, seqused_k=seqused_k, seqlen_q=seqlen_q,
            max_seqlen_k=max_seqlen_k, q2k_indices=q2k, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, enable_cuda_graph=True)
        self.indexer_plan, self.attention, self.q2k_indices = indexer_plan, attention, q2k
        self._page_table = page_table
        return self

    def update(self) -> "MSADecodeStepWrapper":
        """Re-split the indexer's work from the live seqused_k (once per decode step)."""
        self._require_plan()
        self.indexer_plan.update()
        return self

    def run(self, q, k, v, q_idx, k_idx, *, k_idx_scale=None, k_idx_global_scale=None,
            k_idx_scale_layout="128x4", index_scale=1.0, softmax_scale=None,
            return_softmax_lse=False, out=None, lse=None):
        """One layer's decode step over the planned batch.

        q [B * seqlen_q, Hq, 128] and paged k, v [pages, Hkv, 128, 128] as in
        :func:`msa.sparse_decode_atten_func`; q_idx [B * seqlen_q, H_idx, 128] and the paged
        index-K cache k_idx (with k_idx_scale / k_idx_global_scale / k_idx_scale_layout for
        NVFP4) as in :func:`msa.decode_indexer_topk`; index_scale scales the index scores.
        out / lse: optional preallocated bf16 [B * seqlen_q, Hq, 128] / fp32 [B * seqlen_q, Hq].
        Returns O, or (O, LSE) with return_softmax_lse. The selection stays in
        ``self.q2k_indices`` [Hkv, B * seqlen_q, topk] until the next run.
        """
        self._require_plan()
        decode_indexer_topk(q_idx, k_idx, plan=self.indexer_plan, page_table=self._page_table,
                            scale=index_scale, k_scale=k_idx_scale,
                            k_global_scale=k_idx_global_scale,
                            k_scale_layout=k_idx_scale_layout, out=self.q2k_indices)
        return self.attention.run(q, k, v, softmax_scale=softmax_scale,
                                  return_softmax_lse=return_softmax_lse, out=out, lse=lse)

    def _require_plan(self):
        if self.attention is None:
            raise RuntimeError("run: called before plan(); call plan(...) first")


__all__ = ["MSADecodeStepWrapper"]
