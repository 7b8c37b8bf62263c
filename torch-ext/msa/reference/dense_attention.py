"""Exact PyTorch reference of the fmha-style dense attention (contract §2.2), optionally
restricted to per-token KV block selections and fused with the per-tile max-score output.

For request b with q_len queries and kv_len keys, batch-local query i sees key j iff

    j < kv_len                      (always; causal=False clips here, contract D20)
    j <= i + qo_offset[b]           (if causal; bottom-right default qo_offset = kv_len - q_len)
    j // block in S(i, h)           (only with a selection: the ids >= 0 of
                                     selection[t, h, :], t = the query's global row)

Per query head hq (KV head h = hq // G): s_j = logit_scale * <q, k_j>, O = softmax(s) V times
output_scale; a row that sees no key gives O = 0, and a NaN or +inf score makes its row NaN. The max-score output is, per query head,
128-token KV tile and query, the max of s_j over the visible keys of the tile (-inf if none).

The work is tiled: a chunk of at most ``q_chunk`` queries meets the keys ``kv_step`` tokens at a
time and folds them into an online softmax (running max, normalizer and accumulator), so memory
stays bounded by one [Hkv, G, q_chunk, kv_step] score tile and the output; no N x N matrix is
ever formed. Compute runs in ``compute_dtype`` (float32, float64 in tests). With
``p_quant_dtype`` (e4m3 for FP8 V) the unnormalized probabilities exp(s - running_max) are
rounded to it before P.V, as an FP8 MMA does; the normalizer stays unrounded, or with
``sum_quantized_p`` sums the rounded P (as the e4m3 kernels that sum P on the tensor core do).

Lengths, offsets and page tables are read on the host (this is a reference; it synchronizes).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

TILE = 128


@dataclasses.dataclass
class TokenKV:
    """The keys and values of every request, addressed by token position.

    Dense: ``k``/``v`` [total_k, Hkv, D] and ``kv_starts[b]`` the first row of request b.
    Paged: ``k``/``v`` [pages, Hkv, page_size, D] and ``page_rows[b]`` the physical pages of
    request b in logical order (host int64), any page size.
    """
    k: torch.Tensor
    v: torch.Tensor
    kv_starts: Optional[List[int]] = None
    page_rows: Optional[List[torch.Tensor]] = None

    @property
    def paged(self) -> bool:
        return self.page_rows is not None

    def gather(self, b: int, j0: int, j1: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """K, V [j1 - j0, Hkv, D] of request b's tokens [j0, j1)."""
        if not self.paged:
            lo = self.kv_starts[b]
            return self.k[lo + j0:lo + j1], self.v[lo + j0:lo + j1]
        page_size = self.k.shape[2]
        pos = torch.arange(j0, j1)
        pages = self.page_rows[b][pos // page_size].to(self.k.device)
        slots = (pos % page_size).to(self.k.device)
        # Advanced indices on dims 0 and 2 around a slice: the result is [n, Hkv, D].
        return self.k[pages, :, slots], self.v[pages, :, slots]


def dense_token_kv(k: torch.Tensor, v: torch.Tensor, kv_lens: Sequence[int]) -> TokenKV:
    starts, acc = [], 0
    for n in kv_lens:
        starts.append(acc)
        acc += int(n)
    return TokenKV(k, v, kv_starts=starts)


def paged_token_kv(k: torch.Tensor, v: torch.Tensor, kv_lens: Sequence[int],
                   page_rows: Sequence[torch.Tensor]) -> TokenKV:
    """page_rows[b]: host int64 physical page ids of request b, at least ceil(kv_len/P) of them;
    every id must be a valid page (ValueError otherwise)."""
    page_size, num_pages = k.shape[2], k.shape[0]
    rows = []
    for b, (n, row) in enumerate(zip(kv_lens, page_rows)):
        need = -(-int(n) // page_size)
        row = row.to("cpu", torch.int64)[:need]
        if row.numel() < need:
            raise ValueError(f"kv_indices: request {b} needs {need} pages but only "
                             f"{row.numel()} are given")
        if row.numel() and (int(row.min()) < 0 or int(row.max()) >= num_pages):
            raise ValueError(f"kv_indices: request {b} maps to a page outside [0, {num_pages})")
        rows.append(row)
    return TokenKV(k, v, page_rows=rows)


def dense_attention_reference(q: torch.Tensor, kv: TokenKV, q_lens: Sequence[int],
                              kv_lens: Sequence[int], qo_offset: Sequence[int], *, causal: bool,
                              logit_scale: float, output_scale: float = 1.0,
                              want_o: bool = True, max_k_tiles: int = -1,
                              selection: Optional[torch.Tensor] = None,
                              selection_block: int = TILE,
                              p_quant_dtype: Optional[torch.dtype] = None,
                              sum_quantized_p: bool = False,
                              compute_dtype: torch.dtype = torch.float32,
                              q_chunk: int = 128, kv_step: int = 4 * TILE
                              ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Returns (O [total_q, Hq, Dv] in compute_dtype or None, max_score [Hq, max_k_tiles,
    total_q] fp32 (-inf filled) or None when max_k_tiles <= 0).

    q: [total_q, Hq, D] (any float dtype, upcast); kv: a :class:`TokenKV`; q_lens, kv_lens,
    qo_offset: host ints per request. selection: optional [total_q, Hkv, n] integer block ids
    (of ``selection_block`` tokens; -1 or out-of-range ids select nothing).
    """
    total_q, hq, d = q.shape
    hkv = kv.k.shape[1]
    dv = kv.v.shape[-1]
    g = hq // hkv
    device = q.device
    kv_step = max(TILE, kv_step // TILE * TILE)
    out = torch.zeros(total_q, hq, dv, dtype=compute_dtype, device=device) if want_o else None
    max_score = None
    if max_k_tiles > 0:
        max_score = torch.full((hq, max_k_tiles, total_q), float("-inf"), dtype=torch.float32,
                               device=device)
    if out is None and max_score is None:
        return None, None
    neg_inf = float("-inf")
    row0 = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        q_len, kv_len, off = int(q_len), int(kv_len), int(qo_offset[b])
        for i0 in range(0, q_len, q_chunk):
            i1 = min(q_len, i0 + q_chunk)
            last_key = kv_len - 1 if not causal else min(kv_len - 1, i1 - 1 + off)
            if last_key < 0:
                continue            # no visible key: O stays 0, max-score stays -inf
            rows = slice(row0 + i0, row0 + i1)
            n = i1 - i0
            qc = q[rows].to(compute_dtype).view(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv,G,n,D]
            query_pos = torch.arange(i0, i1, device=device).view(n, 1)
            sel = None
            if selection is not None:
                sel = selection[rows].to(device, torch.int64).permute(1, 0, 2)  # [Hkv, n, S]
            run_max = torch.full((hkv, g, n), neg_inf, dtype=compute_dtype, device=device)
            run_sum = torch.zeros(hkv, g, n, dtype=compute_dtype, device=device)
            acc = torch.zeros(hkv, g, n, dv, dtype=compute_dtype, device=device)
            for j0 in range(0, last_key + 1, kv_step):
                j1 = min(kv_len, j0 + kv_step)
                kb, vb = kv.gather(b, j0, j1)
                kb = kb.to(compute_dtype).permute(1, 0, 2)                       # [Hkv, m, D]
                s = torch.matmul(qc, kb.unsqueeze(1).transpose(-1, -2)) * logit_scale
                key_pos = torch.arange(j0, j1, device=device).view(1, -1)
                visible = torch.ones(1, n, j1 - j0, dtype=torch.bool, device=device)
                if causal:
                    visible = visible & (key_pos <= query_pos + off).unsqueeze(0)
                if sel is not None:
                    # Membership per block of this step, then spread to its keys.
                    key_block = key_pos.view(-1) // selection_block
                    first = int(key_block[0])
                    blocks = torch.arange(first, int(key_block[-1]) + 1, device=device)
                    hit = (sel.unsqueeze(-1) == blocks).any(-2)                   # [Hkv,n,nb]
                    visible = visible & hit[:, :, key_block - first]              # [Hkv,n,m]
                s = s.masked_fill(~visible.unsqueeze(1), neg_inf)                 # [Hkv,G,n,m]
                if max_score is not None:
                    _write_tile_max(max_score, s, j0, j1, rows, hq)
                if out is None:
                    continue
                new_max = torch.maximum(run_max, s.amax(-1))     # NaN / +inf propagate
                safe_max = torch.where(new_max == neg_inf, 0.0, new_max)
                rescale = torch.exp(run_max - safe_max)        # 0 while run_max is -inf
                p = torch.exp(s - safe_max.unsqueeze(-1))      # 0 on masked keys
                p_pv = p if p_quant_dtype is None else p.to(p_quant_dtype).to(compute_dtype)
                run_sum = run_sum * rescale + (p_pv if sum_quantized_p else p).sum(-1)
                acc = acc * rescale.unsqueeze(-1) + torch.matmul(
                    p_pv, vb.to(compute_dtype).permute(1, 0, 2).unsqueeze(1))
                run_max = new_max
            if out is not None:
                o = acc / run_sum.clamp_min(torch.finfo(compute_dtype).tiny).unsqueeze(-1)
                # Only a row that saw no key is 0; a NaN / +inf sum (non-finite data) stays.
                o = torch.where((run_sum == 0).unsqueeze(-1), 0.0, o) * output_scale
                out[rows] = o.permute(2, 0, 1, 3).reshape(n, hq, dv)
        row0 += q_len
    return out, max_score


def _write_tile_max(max_score: torch.Tensor, s: torch.Tensor, j0: int, j1: int, rows: slice,
                    hq: int) -> None:
    """Folds the [Hkv, G, n, j1-j0] masked scores into max_score[:, tiles, rows]."""
    first_tile = j0 // TILE
    tiles = min(-(-(j1 - j0) // TILE), max_score.shape[1] - first_tile)
    if tiles <= 0:
        return
    pad = tiles * TILE - (j1 - j0)
    if pad > 0:
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
    s = s[..., :tiles * TILE]
    n = s.shape[2]
    tile_max = s.reshape(hq, n, tiles, TILE).amax(-1)                 # [Hq, n, tiles]
    max_score[:, first_tile:first_tile + tiles, rows] = tile_max.transpose(1, 2).float()
