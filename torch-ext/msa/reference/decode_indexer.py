"""Exact PyTorch reference of the fused decode indexer + top-k (``msa.decode_indexer_topk``).

Per request b (KV length L = seqused_k[b], seqlen_q = Q queries) and index head h, query q sits
at key position pos = L - Q + q; its own (local) block is pos // 128 (none when pos < 0). Its
candidates are the history blocks p < own block: every key of such a block lies before the
query, so the block score is the max over the block's 128 keys of
``scale * <q_idx[row, h], k_idx[key]>`` (fp32 accumulation), passing over keys whose score is
NaN as the kernel's hardware max does (a block of NaN scores only scores NaN). The selection
(upstream msa_v1 contract: local block forced, last among the valid entries):

  * the ``topk - 1`` best candidates by score, ties to the lower block id (non-finite-low scores,
    -inf and NaN, are never taken), in that rank order;
  * then the own block;
  * then -1 up to ``topk``.

The public function checks the lengths and page ids first; lengths are clamped to the page
table here as in the kernel (``seqused_k[b] <= max_pages * 128``).

Index keys: bf16 or e4m3 [pages, 1, 128, 128], or NVFP4 [pages, 1, 128, 64] uint8 (two E2M1
codes per byte, even element in the low nibble) with one E4M3 scale per 16 elements, in the
package's 128x4 tiled layout (``msa.quantize``) or a linear [pages, 1, 128, 8] layout, times an
optional fp32 global scale. The reference dequantizes exactly (fp32 or float64).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .fp4 import decode_e4m3_bytes, unpack_e2m1
from .topk import order_preserving_code

PAGE = 128
HEAD_DIM = 128
NVFP4_GROUP = 16
# Pages scored per reference tile (bounds the scratch: rows x pages x 128 scores).
_PAGES_PER_TILE = 64


def nvfp4_scale_offsets(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """Byte offsets [n, 8] of the 8 block scales of the given index-K rows (row = page * 128 +
    slot for one key head): the 128x4 tiled layout (2 tiles of 512 bytes per 128 rows) or the
    linear [rows, 8] one."""
    col = torch.arange(HEAD_DIM // NVFP4_GROUP, device=rows.device, dtype=torch.int64)
    r = rows.to(torch.int64).view(-1, 1)
    if layout == "linear":
        return r * 8 + col
    return ((r // 128) * 2 + col // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + col % 4


def dequantize_index_pages(k_idx: torch.Tensor, pages: torch.Tensor, *, k_scale=None,
                           k_global_scale=None, scale_layout: str = "128x4",
                           compute_dtype=torch.float32) -> torch.Tensor:
    """The keys of the given physical pages of a one-head index-K cache: [n, 128, 128]."""
    if k_idx.dtype != torch.uint8:
        return k_idx[pages.to(k_idx.device).long(), 0].to(compute_dtype)
    data = k_idx[pages.long(), 0]                                         # [n, 128, 64]
    values = unpack_e2m1(data, compute_dtype)                             # [n, 128, 128]
    rows = (pages.long().view(-1, 1) * PAGE + torch.arange(PAGE, device=pages.device)).view(-1)
    offsets = nvfp4_scale_offsets(rows.to(k_scale.device), scale_layout)
    scales = decode_e4m3_bytes(k_scale.reshape(-1)[offsets], compute_dtype)
    values = values * scales.view(-1, PAGE, HEAD_DIM // NVFP4_GROUP).repeat_interleave(
        NVFP4_GROUP, dim=-1)
    if k_global_scale is not None:
        values = values * k_global_scale.reshape(-1)[0].to(compute_dtype)
    return values


def block_max(key_scores: torch.Tensor) -> torch.Tensor:
    """Max over the last dimension (a block's keys) passing over NaN, as the hardware max does:
    NaN only when every key's score is NaN."""
    nan = torch.isnan(key_scores)
    best = key_scores.masked_fill(nan, float("-inf")).amax(-1)
    return torch.where(nan.all(-1), torch.full_like(best, float("nan")), best)


def _rank_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 rank keys of [rows, n] scores (larger = better; ties to the lower column); -inf and
    NaN get -1 (never taken)."""
    ids = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    key = (order_preserving_code(scores.float()) << 24) | ((1 << 24) - 1 - ids)
    taken = ~(torch.isnan(scores) | torch.isneginf(scores))
    return torch.where(taken, key, torch.full_like(key, -1))


def decode_indexer_reference(q_idx: torch.Tensor, k_idx: torch.Tensor, page_table: torch.Tensor,
                             seqused_k: torch.Tensor, seqlen_q: int, topk: int, *,
                             scale: float = 1.0, k_scale=None, k_global_scale=None,
                             scale_layout: str = "128x4", out_head_repeat: int = 1,
                             compute_dtype=torch.float32
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(selection [H * out_head_repeat, B * Q, topk] int32, scores [H, B * Q, max_pages] fp32).

    scores holds the block score of every (row, candidate block) and -inf elsewhere. Reads the
    device tensors on the host (a reference). Invalid page ids of candidate blocks raise."""
    total_q, heads, _ = q_idx.shape
    batch, width = page_table.shape
    device = q_idx.device
    lens = seqused_k.to("cpu", torch.int64).clamp_min(0).tolist()
    table = page_table.to("cpu", torch.int64)
    scores = torch.full((heads, total_q, width), float("-inf"), dtype=torch.float32,
                        device=device)
    selection = torch.full((heads, total_q, topk), -1, dtype=torch.int32, device=device)
    for b, length in enumerate(lens):
        length = min(length, width * PAGE)      # a request cannot outgrow its page table row
        rows = slice(b * seqlen_q, (b + 1) * seqlen_q)
        positions = length - seqlen_q + torch.arange(seqlen_q)
        own = torch.where(positions >= 0, positions // PAGE, torch.full_like(positions, -1))
        history = max((length - 1) // PAGE, 0)
        q = q_idx[rows].to(compute_dtype)                                  # [Q, H, 128]
        for p0 in range(0, history, _PAGES_PER_TILE):
            ids = table[b, p0:min(history, p0 + _PAGES_PER_TILE)]
            bad = torch.nonzero((ids < 0) | (ids >= k_idx.shape[0])).flatten()
            if bad.numel():
                raise ValueError(f"page_table: entry [{b}, {p0 + int(bad[0])}] is out of range "
                                 f"for {k_idx.shape[0]} index-K pages")
            keys = dequantize_index_pages(k_idx, ids.to(device), k_scale=k_scale,
                                          k_global_scale=k_global_scale,
                                          scale_layout=scale_layout, compute_dtype=compute_dtype)
            s = block_max(torch.einsum("qhd,pkd->hqpk", q, keys)) * scale     # [H, Q, n]
            scores[:, rows, p0:p0 + ids.numel()] = s.float()
        block = torch.arange(width, device=device).view(1, 1, -1)
        eligible = block < own.to(device).view(1, -1, 1)
        scores[:, rows] = torch.where(eligible, scores[:, rows],
                                      torch.full_like(scores[:, rows], float("-inf")))
        keys = _rank_keys(scores[:, rows].reshape(heads * seqlen_q, width))
        count = min(topk - 1, width)
        best = keys.topk(count, dim=-1).values if count > 0 else keys[:, :0]
        best_ids = torch.where(best >= 0, (1 << 24) - 1 - (best & ((1 << 24) - 1)),
                               torch.full_like(best, -1)).view(heads, seqlen_q, count)
        for q_i in range(seqlen_q):
            for h in range(heads):
                chosen = [int(i) for i in best_ids[h, q_i].tolist() if i >= 0]
                if int(own[q_i]) >= 0:
                    chosen.append(int(own[q_i]))
                row = torch.full((topk,), -1, dtype=torch.int32)
                row[:len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
                selection[h, b * seqlen_q + q_i] = row.to(device)
    if out_head_repeat > 1:
        selection = selection.repeat_interleave(out_head_repeat, dim=0)
    return selection, scores


__all__ = ["decode_indexer_reference", "dequantize_index_pages", "nvfp4_scale_offsets"]
