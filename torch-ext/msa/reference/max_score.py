"""Exact PyTorch reference of the indexer's per-block max scores (contract §2.2, §1.5).

For query t of request b (batch-local position i), query head h and KV tile (block) beta:

    max_score[h, beta, t] = max over visible keys j in [128*beta, 128*beta + 128) of
                            scale * <q[t, h], k[j, h // (H / Hk)]>

accumulated in ``compute_dtype`` (fp32 by default), and -inf when no key of the tile is visible.
Key j is visible when j < k_len_b and, if causal, j <= i + offset_b (bottom-right alignment by
default, offset_b = k_len_b - q_len_b).

The work is tiled over query chunks and groups of key tiles, and causal chunks stop at the last
visible tile, so memory stays bounded (an [H, q_chunk, key_chunk] score tile at a time) and no
N x N matrix is ever formed. This reference reads ``cu_seqlens``/``page_table`` on the host, so it
synchronizes; it is the oracle and the fallback, not the fast path.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

BLOCK = 128
# Elements of one fp32 score tile [H, q_chunk, key_chunk] (16 MiB): large enough for efficient
# matmuls on a CPU, small enough that a 1M-token sequence stays far below 1 GB of scratch.
_SCORE_TILE_ELEMENTS = 1 << 22


def _host_int64(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", torch.int64)


def block_max_scores_reference(q_idx: torch.Tensor, k_idx: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor],
                               *, max_k_tiles: int, scale: float = 1.0, causal: bool = True,
                               qo_offset: Union[None, int, torch.Tensor] = None,
                               page_table: Optional[torch.Tensor] = None,
                               seqused_k: Optional[torch.Tensor] = None,
                               compute_dtype: torch.dtype = torch.float32,
                               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Returns max_score [H, max_k_tiles, total_q] (fp32, or compute_dtype when that is wider).

    Args:
      q_idx: [total_q, H, D] index queries (any float dtype; upcast to compute_dtype).
      k_idx: dense [total_k, Hk, D] or paged [pages, Hk, 128, D]; H % Hk == 0.
      cu_seqlens_q: [B+1] prefix sums of the query lengths.
      cu_seqlens_k: [B+1] prefix sums of the key lengths (dense); in paged mode it is ignored
        and may be None (k_len_b = seqused_k[b], or page_table width * 128 without seqused_k).
      max_k_tiles: width of the tile axis; tiles at or past it are not computed.
      scale: multiplies every dot product.
      causal, qo_offset: the visibility rule above; qo_offset is an int or a [B] tensor.
      page_table: [B, max_pages] logical block -> physical page (paged mode).
      seqused_k: [B] key lengths (paged mode).
      out: optional preallocated [H, max_k_tiles, total_q] buffer; it is overwritten (-inf first).
    Every tile that no query row reaches stays -inf. Raises ValueError for a request that
    needs a page id out of range or lengths that exceed the given tensors.
    """
    total_q, num_heads, head_dim = q_idx.shape
    paged = page_table is not None
    num_k_heads = k_idx.shape[1]
    group = num_heads // num_k_heads
    device = q_idx.device
    out_dtype = torch.promote_types(torch.float32, compute_dtype)
    if out is None:
        out = torch.empty(num_heads, max_k_tiles, total_q, dtype=out_dtype, device=device)
    out.fill_(float("-inf"))

    cu_q = _host_int64(cu_seqlens_q)
    batch = cu_q.numel() - 1
    q_lens = cu_q[1:] - cu_q[:-1]
    if paged:
        table = _host_int64(page_table)
        if seqused_k is not None:
            k_lens = _host_int64(seqused_k)
        else:  # upstream quirk (contract D11): the whole table width is the length
            k_lens = torch.full((batch,), table.shape[1] * BLOCK, dtype=torch.int64)
        cu_k = None
    else:
        cu_k = _host_int64(cu_seqlens_k)
        k_lens = cu_k[1:] - cu_k[:-1]
        if int(cu_k[-1]) > k_idx.shape[0]:
            raise ValueError(f"cu_seqlens_k: ends at {int(cu_k[-1])} but k_idx holds only "
                             f"{k_idx.shape[0]} tokens")
    if int(cu_q[-1]) > total_q:
        raise ValueError(f"cu_seqlens_q: ends at {int(cu_q[-1])} but q_idx holds only {total_q} "
                         "tokens")
    if qo_offset is None:
        offsets = k_lens - q_lens
    elif isinstance(qo_offset, torch.Tensor):
        offsets = _host_int64(qo_offset).reshape(-1).expand(batch) if qo_offset.numel() == 1 \
            else _host_int64(qo_offset)
    else:
        offsets = torch.full((batch,), int(qo_offset), dtype=torch.int64)

    for b in range(batch):
        q_len, k_len = int(q_lens[b]), int(k_lens[b])
        if q_len <= 0 or k_len <= 0:
            continue
        n_tiles = min(-(-k_len // BLOCK), max_k_tiles)
        if paged and n_tiles > table.shape[1]:
            raise ValueError(f"page_table: request {b} needs {n_tiles} pages but the table has "
                             f"{table.shape[1]} columns")
        q_start = int(cu_q[b])
        offset = int(offsets[b])
        keys = _KeyReader(k_idx, None if paged else int(cu_k[b]),
                          table[b] if paged else None, b, compute_dtype)
        # Chunk sizes: up to 16 tiles of keys; queries sized to the score-tile budget.
        key_chunk = min(n_tiles, 16) * BLOCK
        q_chunk = max(1, min(q_len, _SCORE_TILE_ELEMENTS // (num_heads * key_chunk)))
        for i0 in range(0, q_len, q_chunk):
            i1 = min(q_len, i0 + q_chunk)
            last_key = k_len - 1
            if causal:
                last_key = min(last_key, i1 - 1 + offset)
                if last_key < 0:
                    continue
            tiles_needed = min(n_tiles, last_key // BLOCK + 1)
            # [Hk, G, n, D]: one matmul per KV head covers its G query heads.
            q_chunk_t = q_idx[q_start + i0:q_start + i1].to(compute_dtype)
            q_chunk_t = q_chunk_t.view(i1 - i0, num_k_heads, group, head_dim).permute(1, 2, 0, 3)
            query_pos = torch.arange(i0, i1, device=device).view(-1, 1)
            for t0 in range(0, tiles_needed, key_chunk // BLOCK):
                t1 = min(tiles_needed, t0 + key_chunk // BLOCK)
                k_tiles = keys.tiles(t0, t1)                      # [Hk, (t1-t0)*128, D]
                s = torch.matmul(q_chunk_t, k_tiles.unsqueeze(1).transpose(-1, -2))
                s = s * scale                                      # [Hk, G, n, keys]
                key_pos = torch.arange(t0 * BLOCK, t1 * BLOCK, device=device).view(1, -1)
                # Masking only where the chunk meets the key end or the causal diagonal.
                needs_mask = t1 * BLOCK > k_len or (causal and t1 * BLOCK - 1 > i0 + offset)
                if needs_mask:
                    hidden = key_pos >= k_len
                    if causal:
                        hidden = hidden | (key_pos > query_pos + offset)
                    s = s.masked_fill(hidden, float("-inf"))
                tile_max = s.reshape(num_heads, i1 - i0, t1 - t0, BLOCK).amax(-1)
                out[:, t0:t1, q_start + i0:q_start + i1] = tile_max.transpose(1, 2).to(out.dtype)
    return out


class _KeyReader:
    """Hands out the keys of tiles [t0, t1) of one request as [Hk, (t1-t0)*128, D]; keys past
    the stored data (the tail of the last tile) come back as zeros and are masked by callers."""

    def __init__(self, k_idx, key_start, page_row, request, compute_dtype):
        self.k_idx = k_idx
        self.key_start = key_start
        self.page_row = page_row
        self.request = request
        self.compute_dtype = compute_dtype

    def tiles(self, t0: int, t1: int) -> torch.Tensor:
        k = self.k_idx
        if self.page_row is None:  # dense [total_k, Hk, D]
            lo = self.key_start + t0 * BLOCK
            hi = self.key_start + t1 * BLOCK
            chunk = k[lo:min(hi, k.shape[0])].to(self.compute_dtype)
            if chunk.shape[0] < hi - lo:
                pad = chunk.new_zeros(hi - lo - chunk.shape[0], *chunk.shape[1:])
                chunk = torch.cat([chunk, pad])
            return chunk.transpose(0, 1)
        pages = self.page_row[t0:t1]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= k.shape[0]):
            bad = int(pages[(pages < 0) | (pages >= k.shape[0])][0])
            raise ValueError(f"page_table: request {self.request} maps a block to page {bad}, "
                             f"out of range for {k.shape[0]} pages")
        gathered = k[pages.to(k.device)].to(self.compute_dtype)  # [n, Hk, 128, D]
        return gathered.permute(1, 0, 2, 3).reshape(k.shape[1], -1, k.shape[3])
