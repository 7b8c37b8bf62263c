"""Exact PyTorch reference of MSA block-sparse attention (contract §0 and §1.2).

It walks the k2q CSR the way the native KV-outer kernels do: for every (KV head, CSR row) it takes
one 128-token KV block, gathers the queries that selected it (times the G query heads of the
group), computes that block's softmax, rounds the per-block output to ``partial_dtype``, and folds
it into a running log-sum-exp combine. Memory stays bounded by the output plus one block's
worth of queries at a time, so a 32k-token sequence runs on a CPU without any N x N matrix.

The combine is the contract's: L = logsumexp_s LSE_s and O = sum_s exp(LSE_s - L) O_s, computed
incrementally (the same value; only the summation order differs).

"Nothing visible" is exactly LSE = -inf. A NaN or +inf LSE (a NaN or +inf score: non-finite q
or k) is not that: it flows through the combine, so the row comes out NaN, never as the empty
row's O = 0, LSE = -inf.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ..sparse_index_utils import packed_row_owner, rows_per_request

BLOCK = 128


@dataclasses.dataclass
class KVSource:
    """Where the keys of (request b, block beta) live, and how many keys request b has."""
    k: torch.Tensor                       # dense [total_k, Hkv, D] or paged [pages, Hkv, P, D]
    v: torch.Tensor
    cu_seqlens_k: torch.Tensor            # host int64 [B+1]
    page_table: Optional[torch.Tensor]    # host int64 [B, max_pages] or None
    k_lens: torch.Tensor                  # host int64 [B]

    def block(self, b: int, beta: int, h: int) -> Optional[Tuple[torch.Tensor, torch.Tensor, int]]:
        """(K [n, D], V [n, D], first key position) of the block, or None if it has no keys."""
        start = beta * BLOCK
        n = min(BLOCK, int(self.k_lens[b]) - start)
        if n <= 0:
            return None
        if self.page_table is None:
            t0 = int(self.cu_seqlens_k[b]) + start
            return self.k[t0:t0 + n, h], self.v[t0:t0 + n, h], start
        if beta >= self.page_table.shape[1]:
            return None
        page = int(self.page_table[b, beta])
        if not 0 <= page < self.k.shape[0]:
            raise ValueError(f"page_table: entry [{b}, {beta}] = {page} is out of range for "
                             f"{self.k.shape[0]} pages")
        return self.k[page, h, :n], self.v[page, h, :n], start


def make_kv_source(k, v, cu_seqlens_k, page_table=None, seqused_k=None) -> KVSource:
    cu_k = cu_seqlens_k.to("cpu", torch.int64)
    if page_table is None:
        k_lens = cu_k[1:] - cu_k[:-1]
        table = None
    else:
        table = page_table.to("cpu", torch.int64)
        if seqused_k is not None:
            k_lens = seqused_k.to("cpu", torch.int64)
        else:  # upstream quirk (D11): the whole table width counts as the length
            k_lens = torch.full((table.shape[0],), table.shape[1] * k.shape[2], dtype=torch.int64)
        # Every page a request's keys live on must exist (entries past its length may be junk).
        used = torch.arange(table.shape[1]) < ((k_lens + k.shape[2] - 1) // k.shape[2]).view(-1, 1)
        bad = used & ((table < 0) | (table >= k.shape[0]))
        if bad.any():
            b, beta = [int(x) for x in torch.nonzero(bad)[0]]
            raise ValueError(f"page_table: entry [{b}, {beta}] = {int(table[b, beta])} is out "
                             f"of range for {k.shape[0]} pages")
    return KVSource(k, v, cu_k, table, k_lens)


def _round_partial(x: torch.Tensor, partial_dtype: torch.dtype) -> torch.Tensor:
    return x.to(partial_dtype).to(x.dtype) if partial_dtype != x.dtype else x


def sparse_attention_csr(q: torch.Tensor, kv: KVSource, k2q_row_ptr: torch.Tensor,
                         k2q_q_indices: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                         causal: bool, softmax_scale: float, kv_block_size: int = BLOCK,
                         partial_dtype: torch.dtype = torch.float32,
                         pv_quant_dtype: Optional[torch.dtype] = None,
                         lse_temperature_scale: float = 1.0,
                         compute_dtype: torch.dtype = torch.float32,
                         q_chunk: int = 2048
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (O [total_q, Hq, D], LSE [total_q, Hq], LSE_T [total_q, Hq]) in compute_dtype.

    pv_quant_dtype: when set (e4m3), the unnormalized probabilities exp(s - rowmax) are rounded
    to it before the P.V product, as an FP8 P.V MMA does; the normalizer stays unrounded.
    Queries in the CSR that are out of range for their request are skipped, never read.
    """
    total_q, hq, d = q.shape
    hkv = kv.k.shape[1]
    g = hq // hkv
    cu_q = cu_seqlens_q.to("cpu", torch.int64)
    q_lens = cu_q[1:] - cu_q[:-1]
    owners = packed_row_owner(rows_per_request(kv.cu_seqlens_k, kv_block_size))
    row_ptr = k2q_row_ptr.to("cpu", torch.int64)
    q_idx = k2q_q_indices.to("cpu", torch.int64)
    n_rows = min(row_ptr.shape[1] - 1, len(owners))
    inv_t = 1.0 / lse_temperature_scale

    qc = q.to(compute_dtype)
    out = torch.zeros(total_q, hq, d, dtype=compute_dtype, device=q.device)
    lse = torch.full((total_q, hq), float("-inf"), dtype=compute_dtype, device=q.device)
    lse_t = lse.clone()
    for h in range(hkv):
        heads = slice(h * g, (h + 1) * g)
        for r in range(n_rows):
            lo, hi = int(row_ptr[h, r]), int(row_ptr[h, r + 1])
            lo, hi = max(lo, 0), min(hi, q_idx.shape[1])
            if hi <= lo:
                continue
            b, beta = owners[r]
            blk = kv.block(b, beta, h)
            if blk is None:
                continue
            kb, vb, key0 = blk
            kb, vb = kb.to(compute_dtype), vb.to(compute_dtype)
            ql_all = q_idx[h, lo:hi]
            ql_all = ql_all[(ql_all >= 0) & (ql_all < q_lens[b])]
            # Duplicate ids (undefined by the contract) are applied once per occurrence.
            for ql in _occurrence_passes(ql_all):
                for c0 in range(0, ql.numel(), q_chunk):
                    qlc = ql[c0:c0 + q_chunk]
                    rows = (cu_q[b] + qlc).to(q.device)
                    s = torch.einsum("ngd,kd->ngk", qc[rows, heads], kb) * softmax_scale
                    if causal:
                        diag = int(kv.k_lens[b]) - int(q_lens[b])
                        key_pos = key0 + torch.arange(kb.shape[0], device=q.device)
                        limit = (qlc.to(q.device) + diag).view(-1, 1, 1)
                        s = s.masked_fill(key_pos.view(1, 1, -1) > limit, float("-inf"))
                    _fold_block(s, vb, rows, heads, out, lse, lse_t, inv_t, partial_dtype,
                                pv_quant_dtype)
    return out, lse, lse_t


def _occurrence_passes(ids: torch.Tensor):
    if ids.numel() == 0:
        return []
    ids, _ = torch.sort(ids)
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    if int(counts.max()) == 1:
        return [ids]
    rank = torch.arange(ids.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return [ids[rank == k] for k in range(int(counts.max()))]


def seen_nothing(lse: torch.Tensor) -> torch.Tensor:
    """Where a log-sum-exp says "no visible key": exactly -inf (NaN and +inf are data)."""
    return lse == float("-inf")


def lse_weight(lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """exp(lse - total), 0 where lse is -inf (also when total is -inf, where exp(-inf - -inf)
    would be NaN); NaN and +inf propagate."""
    return torch.where(seen_nothing(lse), 0.0,
                       torch.exp(lse - torch.where(seen_nothing(total), 0.0, total)))


def _fold_block(s, vb, rows, heads, out, lse, lse_t, inv_t, partial_dtype, pv_quant_dtype):
    """Softmax of one block for a set of queries, then the running combine."""
    blk_lse = torch.logsumexp(s, dim=-1)                       # [n, G], -inf if fully masked
    blk_lse_t = blk_lse if inv_t == 1.0 else torch.logsumexp(s * inv_t, dim=-1)
    empty = seen_nothing(blk_lse)
    if pv_quant_dtype is None:
        p = torch.exp(s - torch.where(empty, 0.0, blk_lse).unsqueeze(-1))
        o_blk = torch.einsum("ngk,kd->ngd", p, vb)
    else:
        m = torch.where(empty, 0.0, s.amax(-1)).unsqueeze(-1)
        p = torch.exp(s - m)
        p_q = p.to(pv_quant_dtype).to(p.dtype)
        o_blk = torch.einsum("ngk,kd->ngd", p_q, vb) / p.sum(-1, keepdim=True).clamp_min(1e-30)
    o_blk = _round_partial(torch.where(empty.unsqueeze(-1), 0.0, o_blk), partial_dtype)

    old_lse = lse[rows, heads]
    new_lse = torch.logaddexp(old_lse, blk_lse)
    w_old = lse_weight(old_lse, new_lse).unsqueeze(-1)
    w_blk = lse_weight(blk_lse, new_lse).unsqueeze(-1)
    out[rows, heads] = out[rows, heads] * w_old + o_blk * w_blk
    lse[rows, heads] = new_lse
    lse_t[rows, heads] = torch.logaddexp(lse_t[rows, heads], blk_lse_t)
