"""Exact PyTorch reference of paged decode attention (contract §1.4, with sparse decode per D6).

Layouts: q [B * seqlen_q, Hq, D] (request b owns rows b*seqlen_q .. b*seqlen_q + seqlen_q - 1);
paged K/V HND [pages, Hkv, P, D] with page_table [B, max_pages] (logical page -> physical page)
and seqused_k [B] (KV length of each request). Query i of request b sees key j iff
j < seqused_k[b] and j <= i + seqused_k[b] - seqlen_q (bottom-right causal), and, for sparse
decode, block j // P is among the entries >= 0 of q2k[h, row, :].

Both paths compute per-page (per-block) partials exactly like the sparse prefill reference: the
page's softmax, its normalized output and its log-sum-exp, folded with the log-sum-exp combine.
With an e4m3 P.V product, exp(s - page_max) is rounded to e4m3 before P.V (the normalizer stays
unrounded), so dense decode equals sparse decode with every block selected, up to fp32 rounding.

* dense: a direct tiled loop over requests and tiles of pages; memory stays bounded by one tile
  (a 512k-token context is 4096 pages, never materialized as one score matrix);
* sparse: the k2q CSR of the selection (round-robin row layout over cu_seqlens_k = prefix sums
  of seqused_k) walked by :func:`sparse_attention_csr`.

The split-KV variant computes one (O, LSE) partial per (request, chunk) of a
:class:`~msa.schedules.decode.DecodeSchedule`, stores it in the fp32 workspaces and
merges them, exactly as the native split-KV kernel plus merge pass would. These functions read
device tensors on the host (they are references).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..sparse_index_utils import build_k2q_csr_torch_reference
from .sparse_attention import lse_weight, make_kv_source, seen_nothing, sparse_attention_csr

# Score elements per dense tile (bounds the reference's memory, ~16 MB in fp32).
_TILE_SCORE_ELEMENTS = 1 << 22


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_lengths_fit(seqused_k: torch.Tensor, page_table: torch.Tensor, page_size: int
                      ) -> torch.Tensor:
    """Host copy of seqused_k (int64) after checking 0 <= seqused_k[b] <= table width * P."""
    lens = seqused_k.to("cpu", torch.int64)
    capacity = page_table.shape[1] * page_size
    bad = torch.nonzero((lens < 0) | (lens > capacity)).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"seqused_k: request {b} has {int(lens[b])} tokens, outside "
                         f"[0, {capacity}] (page_table holds {page_table.shape[1]} pages of "
                         f"{page_size})")
    return lens


def _physical_pages(page_table_host: torch.Tensor, b: int, begin: int, end: int,
                    num_pages: int) -> torch.Tensor:
    pages = page_table_host[b, begin:end]
    bad = torch.nonzero((pages < 0) | (pages >= num_pages)).flatten()
    if bad.numel():
        beta = begin + int(bad[0])
        raise ValueError(f"page_table: entry [{b}, {beta}] = {int(page_table_host[b, beta])} is "
                         f"out of range for {num_pages} pages")
    return pages


def _fold(acc_o, acc_lse, o, lse):
    """Log-sum-exp combine of two normalized partials; -inf LSE means 'no keys' (O ignored),
    a NaN / +inf LSE propagates."""
    new_lse = torch.logaddexp(acc_lse, lse)
    out = (acc_o * lse_weight(acc_lse, new_lse).unsqueeze(-1)
           + o * lse_weight(lse, new_lse).unsqueeze(-1))
    return out, new_lse


def dense_request_attention(q_b: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            pages: torch.Tensor, first_page: int, k_len: int, *,
                            softmax_scale: float, pv_quant_dtype: Optional[torch.dtype],
                            compute_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request's queries over a run of its logical pages.

    q_b [seqlen_q, Hq, D]; pages: physical ids of logical pages first_page, first_page+1, ...;
    k_len = seqused_k[b]. Returns (O [seqlen_q, Hq, D], LSE [seqlen_q, Hq]) in compute_dtype,
    O = 0 and LSE = -inf for rows that see no key in these pages.
    """
    seqlen_q, hq, d = q_b.shape
    hkv, page_size = k.shape[1], k.shape[2]
    g = hq // hkv
    device = q_b.device
    qg = q_b.to(compute_dtype).view(seqlen_q, hkv, g, d)
    acc_o = torch.zeros(seqlen_q, hkv, g, d, dtype=compute_dtype, device=device)
    acc_lse = torch.full((seqlen_q, hkv, g), float("-inf"), dtype=compute_dtype, device=device)
    diag = k_len - seqlen_q            # query i sees keys j <= i + diag
    tile = max(1, _TILE_SCORE_ELEMENTS // (seqlen_q * hq * page_size))
    query_pos = torch.arange(seqlen_q, device=device).view(-1, 1, 1)
    for t0 in range(0, pages.numel(), tile):
        ids = pages[t0:t0 + tile].to(device)
        n = ids.numel()
        kt = k[ids].to(compute_dtype)                                   # [n, Hkv, P, D]
        vt = v[ids].to(compute_dtype)
        key_pos = ((first_page + t0 + torch.arange(n, device=device)).view(-1, 1) * page_size
                   + torch.arange(page_size, device=device).view(1, -1))  # [n, P]
        visible = (key_pos < k_len) & (key_pos <= query_pos + diag)     # [sq, n, P]
        s = torch.einsum("qhgd,thkd->qhgtk", qg, kt) * softmax_scale
        s = s.masked_fill(~visible.view(seqlen_q, 1, 1, n, page_size), float("-inf"))
        page_lse = torch.logsumexp(s, dim=-1)                           # [sq, Hkv, G, n]
        empty = seen_nothing(page_lse)
        if pv_quant_dtype is None:
            p = torch.exp(s - torch.where(empty, 0.0, page_lse).unsqueeze(-1))
            o_page = torch.einsum("qhgtk,thkd->qhgtd", p, vt)
        else:
            # FP8 P.V: unnormalized probabilities against the page max, rounded to e4m3.
            p = torch.exp(s - torch.where(empty, 0.0, s.amax(-1)).unsqueeze(-1))
            p_q = p.to(pv_quant_dtype).to(p.dtype)
            o_page = (torch.einsum("qhgtk,thkd->qhgtd", p_q, vt)
                      / p.sum(-1, keepdim=True).clamp_min(1e-30))
        o_page = torch.where(empty.unsqueeze(-1), 0.0, o_page)
        tile_lse = torch.logsumexp(page_lse, dim=-1)
        w = lse_weight(page_lse, tile_lse.unsqueeze(-1))
        tile_o = torch.einsum("qhgt,qhgtd->qhgd", w, o_page)
        acc_o, acc_lse = _fold(acc_o, acc_lse, tile_o, tile_lse)
    return acc_o.view(seqlen_q, hq, d), acc_lse.view(seqlen_q, hq)


def dense_decode_reference(q, k, v, page_table, seqused_k, seqlen_q, *, softmax_scale,
                           pv_quant_dtype=None, compute_dtype=torch.float32):
    """Dense paged decode: (O [total_q, Hq, D], LSE [total_q, Hq]) in compute_dtype."""
    page_size = k.shape[2]
    lens = check_lengths_fit(seqused_k, page_table, page_size)
    table = page_table.to("cpu", torch.int64)
    out = torch.empty(q.shape, dtype=compute_dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=compute_dtype, device=q.device)
    for b in range(lens.numel()):
        k_len = int(lens[b])
        pages = _physical_pages(table, b, 0, _ceil_div(k_len, page_size), k.shape[0])
        rows = slice(b * seqlen_q, (b + 1) * seqlen_q)
        out[rows], lse[rows] = dense_request_attention(
            q[rows], k, v, pages, 0, k_len, softmax_scale=softmax_scale,
            pv_quant_dtype=pv_quant_dtype, compute_dtype=compute_dtype)
    return out, lse


def drop_out_of_range_blocks(q2k: torch.Tensor, seqused_k: torch.Tensor, seqlen_q: int,
                             page_size: int) -> torch.Tensor:
    """Runtime semantics (contract D4): ids >= ceil(seqused_k[b] / P) act like -1."""
    blocks = (seqused_k.to(q2k.device, torch.int64) + page_size - 1) // page_size
    limit = blocks.repeat_interleave(seqlen_q).view(1, -1, 1)
    return torch.where(q2k < limit, q2k, torch.full_like(q2k, -1))


def sparse_decode_reference(q, k, v, q2k, page_table, seqused_k, seqlen_q, *, softmax_scale,
                            pv_quant_dtype=None, compute_dtype=torch.float32):
    """Sparse paged decode through the k2q CSR reference: (O, LSE) in compute_dtype.

    q2k [Hkv, total_q, topK] int32; ids >= the request's block count are dropped, -1 skipped.
    """
    page_size = k.shape[2]
    lens = check_lengths_fit(seqused_k, page_table, page_size)
    batch = lens.numel()
    device = q.device
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=device)
    cu_k = torch.zeros(batch + 1, dtype=torch.int64)
    cu_k[1:] = torch.cumsum(lens, 0)
    cu_k = cu_k.to(device, torch.int32)
    q2k = drop_out_of_range_blocks(q2k, seqused_k, seqlen_q, page_size)
    row_ptr, q_idx = build_k2q_csr_torch_reference(q2k, cu_q, cu_k, page_size)
    kv = make_kv_source(k, v, cu_k, page_table, seqused_k)
    # partial_dtype = compute dtype: decode partials are not rounded (fp32 workspaces).
    out, lse, _ = sparse_attention_csr(q, kv, row_ptr, q_idx, cu_seqlens_q=cu_q, causal=True,
                                       softmax_scale=softmax_scale, kv_block_size=page_size,
                                       partial_dtype=compute_dtype,
                                       pv_quant_dtype=pv_quant_dtype,
                                       compute_dtype=compute_dtype)
    return out, lse


def decode_reference(q, k, v, q2k, page_table, seqused_k, seqlen_q, *, softmax_scale,
                     pv_quant_dtype=None, compute_dtype=torch.float32):
    """Unsplit decode reference; q2k None = dense. Returns (O, LSE) in compute_dtype."""
    fn = dense_decode_reference if q2k is None else sparse_decode_reference
    args = (q, k, v, page_table, seqused_k, seqlen_q) if q2k is None else (
        q, k, v, q2k, page_table, seqused_k, seqlen_q)
    return fn(*args, softmax_scale=softmax_scale, pv_quant_dtype=pv_quant_dtype,
              compute_dtype=compute_dtype)


def merge_partials(o_parts: torch.Tensor, lse_parts: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combine n normalized partials: o_parts [n, ..., D], lse_parts [n, ...].

    L = logsumexp_s LSE_s, O = sum_s exp(LSE_s - L) O_s; all-empty rows give O = 0, LSE = -inf;
    a NaN / +inf partial LSE makes the row NaN.
    """
    lse = torch.logsumexp(lse_parts, dim=0)
    w = lse_weight(lse_parts, lse.unsqueeze(0))
    out = (w.unsqueeze(-1) * o_parts).sum(0)
    return out, lse


def split_decode_reference(q, k, v, q2k, page_table, seqused_k, seqlen_q, schedule, *,
                           softmax_scale, pv_quant_dtype=None, o_partial=None, lse_partial=None,
                           compute_dtype=torch.float32):
    """Decode through a split-KV schedule: per-chunk partials, then the merge.

    Without split-KV (``schedule.split_kv`` False) every request is one chunk and this is
    :func:`decode_reference`. Otherwise partial p = merge_indptr[b] + chunk of request b goes to
    o_partial[p] [seqlen_q, Hq, D] / lse_partial[p] [seqlen_q, Hq] (fp32 workspaces, allocated
    here when None), then the partials of each request are merged.
    Returns (O [total_q, Hq, D], LSE [total_q, Hq]) in compute_dtype.
    """
    if not schedule.split_kv:
        return decode_reference(q, k, v, q2k, page_table, seqused_k, seqlen_q,
                                softmax_scale=softmax_scale, pv_quant_dtype=pv_quant_dtype,
                                compute_dtype=compute_dtype)
    page_size = k.shape[2]
    lens = check_lengths_fit(seqused_k, page_table, page_size)
    batch, (total_q, hq, d) = lens.numel(), q.shape
    o_shape, lse_shape = schedule.workspace_shapes()
    if o_partial is None:
        o_partial = torch.empty(o_shape, dtype=torch.float32, device=q.device)
    if lse_partial is None:
        lse_partial = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    merge_indptr = schedule.merge_indptr_host.tolist()

    if q2k is None:
        table = page_table.to("cpu", torch.int64)
        for b in range(batch):
            k_len = int(lens[b])
            pages_now = _ceil_div(k_len, page_size)
            rows = slice(b * seqlen_q, (b + 1) * seqlen_q)
            for chunk in range(int(schedule.num_splits_host[b])):
                begin, end = schedule.chunk_range(b, chunk, pages_now)
                pages = _physical_pages(table, b, begin, end, k.shape[0])
                o, lse = dense_request_attention(q[rows], k, v, pages, begin, k_len,
                                                 softmax_scale=softmax_scale,
                                                 pv_quant_dtype=pv_quant_dtype,
                                                 compute_dtype=compute_dtype)
                o_partial[merge_indptr[b] + chunk] = o
                lse_partial[merge_indptr[b] + chunk] = lse
    else:
        topk = q2k.shape[2]
        slots = torch.arange(topk, device=q2k.device).view(1, 1, topk)
        max_chunks = int(schedule.num_splits_host.max())
        for chunk in range(max_chunks):
            # One pass per chunk index: every request keeps only this chunk's slots (slot chunks)
            # or the selected blocks in this chunk's page range (page chunks).
            lo = torch.zeros(batch, dtype=torch.int64)
            hi = torch.zeros(batch, dtype=torch.int64)
            for b in range(batch):
                if chunk < int(schedule.num_splits_host[b]):
                    units = topk if schedule.slot_chunks else _ceil_div(int(lens[b]), page_size)
                    lo[b], hi[b] = schedule.chunk_range(b, chunk, units)
            lo_q = lo.repeat_interleave(seqlen_q).to(q2k.device).view(1, -1, 1)
            hi_q = hi.repeat_interleave(seqlen_q).to(q2k.device).view(1, -1, 1)
            unit = slots if schedule.slot_chunks else q2k
            q2k_chunk = torch.where((unit >= lo_q) & (unit < hi_q), q2k,
                                    torch.full_like(q2k, -1))
            o, lse = sparse_decode_reference(q, k, v, q2k_chunk, page_table, seqused_k,
                                             seqlen_q, softmax_scale=softmax_scale,
                                             pv_quant_dtype=pv_quant_dtype,
                                             compute_dtype=compute_dtype)
            o = o.view(batch, seqlen_q, hq, d)
            lse = lse.view(batch, seqlen_q, hq)
            for b in range(batch):
                if chunk < int(schedule.num_splits_host[b]):
                    o_partial[merge_indptr[b] + chunk] = o[b]
                    lse_partial[merge_indptr[b] + chunk] = lse[b]

    out = torch.empty(total_q, hq, d, dtype=compute_dtype, device=q.device)
    lse_out = torch.empty(total_q, hq, dtype=compute_dtype, device=q.device)
    for b in range(batch):
        parts = slice(merge_indptr[b], merge_indptr[b + 1])
        o, lse = merge_partials(o_partial[parts].to(compute_dtype),
                                lse_partial[parts].to(compute_dtype))
        rows = slice(b * seqlen_q, (b + 1) * seqlen_q)
        out[rows], lse_out[rows] = o, lse
    return out, lse_out
