#!/usr/bin/env python3
"""Replay of the one-CTA k2q CSR + schedule build (csrc/build_k2q_csr.cu, one_cta_csr_kernel),
step by step as its threads run it, against the package's reference builder (no GPU needed).

The kernel's steps, mirrored here with the same formulas: the request of every query and the
(request, block) -> row table; pass 1 counts the entries per (head, row) key and writes the
split counts (each query's topk entries in aligned lanes); an exclusive scan over every key;
each head's entries cut into segments (one_cta_segments), pass 1 counts per (key, segment); an
exclusive scan over them, keys in order and a key's segments in entry order; pass 2, one warp per
(head, segment) in any order, places the segment's entries 32 lanes at a time
(kOneCtaScatterUnroll chunks a step): place = the (key, segment) cursor - the head's first place
+ the same-key entries in lower lanes, then the lowest such lane advances the cursor; the tail is
-1; row_ptr comes from the advanced cursors (a key's last segment now ends it); the schedule's
chunk counts in (row, head)
order, their inclusive scan, and each work item found by bisection, its owner by row_owner.

Cases: short production chunks (one request, and several), ragged requests with empty and
one-token ones, every topk the schedule takes, garbage ids with duplicates, a too-small
max_kv_blocks hint (direct row formula), too few total_rows, no queries. A mutation check
(the scatter placing entries without the lower-lane rank) must be caught.

    python tools/lab/model_k2q_one_cta.py      # needs torch and the package (torch-ext) importable
"""
from __future__ import annotations

import math
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "torch-ext"))
import msa  # noqa: E402

INT_MAX = 2**31 - 1
SLOT_SHIFT = 24
UNROLL = 4
KV_BLOCK = 128
ONE_CTA = dict(max_batch=64, max_heads=32, max_head_entries=8192, max_entries=65536,
               max_keys=16384, smem_ints=24576)


def row_table_blocks(batch, max_kv_blocks):
    return max(1, min(max(max_kv_blocks, 1), (1 << 24) // max(batch, 1)))


def segments_of(hkv, total_q, batch, total_rows, max_kv_blocks):
    """one_cta_segments: segments per head (0: the counts do not fit)."""
    tables = total_q + batch * row_table_blocks(batch, max_kv_blocks)
    segments = ONE_CTA["max_heads"] // max(hkv, 1)
    while segments >= 1:
        if tables + hkv * (total_rows + 1) * segments <= ONE_CTA["smem_ints"]:
            return segments
        segments //= 2
    return 0


def fits(hkv, total_q, topk, batch, total_rows, max_kv_blocks):
    per_head = total_q * topk
    return (batch <= ONE_CTA["max_batch"] and hkv <= ONE_CTA["max_heads"]
            and per_head <= ONE_CTA["max_head_entries"]
            and per_head * hkv <= ONE_CTA["max_entries"]
            and hkv * (total_rows + 1) <= ONE_CTA["max_keys"]
            and segments_of(hkv, total_q, batch, total_rows, max_kv_blocks) > 0)


def request_of_query(cu_q, batch, q):
    lo, hi = 0, batch - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if cu_q[mid] <= q:
            lo = mid
        else:
            hi = mid - 1
    return lo


def row_owner(rows, r):
    exact_rows, max_blocks = sum(rows), max(rows)
    if r >= exact_rows:
        return -1, -1
    lo, hi = 0, max_blocks - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if sum(min(x, mid) for x in rows) <= r:
            lo = mid
        else:
            hi = mid - 1
    rank = r - sum(min(x, lo) for x in rows)
    for b, x in enumerate(rows):
        if x > lo:
            if rank == 0:
                return b, lo
            rank -= 1
    return -1, lo


def exclusive_scan(a):
    out, run = np.zeros_like(a), 0
    for i, x in enumerate(a):
        out[i], run = run, run + x
    return out


def one_cta_build(q2k, cu_q, cu_k, *, total_rows, max_kv_blocks, schedule=None,
                  rank_lower_lanes=True):
    """(row_ptr, q_idx[, (metadata, work_count, qsplit, split_counts)]) as the kernel writes
    them; `schedule` = (target_q_per_cta, work_capacity)."""
    hkv, total_q, topk = q2k.shape
    batch = len(cu_q) - 1
    flat = q2k.reshape(-1)
    tb = row_table_blocks(batch, max_kv_blocks)
    rows = [max(0, min(INT_MAX, math.ceil(max(int(cu_k[b + 1]) - int(cu_k[b]), 0) / KV_BLOCK)))
            for b in range(batch)]
    table = np.full((batch, tb), -1, dtype=np.int64)
    for beta in range(tb):
        next_row = sum(min(x, beta) for x in rows)
        for b in range(batch):
            if rows[b] > beta:
                table[b, beta] = next_row
                next_row += 1
    request = []
    for q in range(total_q):
        b = request_of_query(cu_q, batch, q)
        request.append(b if cu_q[b] <= q < cu_q[b + 1] else -1)

    def row_of(b, beta):
        if beta < tb:
            return int(table[b, beta])
        return sum(min(x, beta) + (1 if (i < b and x > beta) else 0) for i, x in enumerate(rows))

    per_head = total_q * topk
    width = total_rows + 1

    def place(i):   # (valid, row, q_local)
        h, rem = divmod(i, per_head)
        q = rem // topk
        b = request[q]
        if b < 0:
            return False, 0, 0
        block = int(flat[i])
        if block >= 0 and cu_q[b] <= q < cu_q[b + 1] and block < rows[b]:
            r = row_of(b, block)
            if 0 <= r < total_rows:
                return True, r, q - int(cu_q[b])
        return False, 0, 0

    def slots(places):   # entry_slot over aligned groups of topk lanes
        out = []
        for g in range(0, len(places), topk):
            grp = places[g:g + topk]
            keys = [p[1] if p[0] else INT_MAX for p in grp]
            count = sum(k != INT_MAX for k in keys)
            for pos, k in enumerate(keys):
                s = sum(1 for o, ko in enumerate(keys)
                        if ko != INT_MAX and (ko < k or (ko == k and o < pos)))
                out.append((s, count))
        return out

    segments = segments_of(hkv, total_q, batch, total_rows, max_kv_blocks)
    seg_len = max(32, -(-(-(-per_head // segments)) // 32) * 32)
    counts = np.zeros(hkv * width * segments, dtype=np.int64)   # [key * segments + segment]
    split_counts = np.full((total_q, hkv), -7, dtype=np.int64)
    for i in range(hkv * per_head):
        valid, r, _ = place(i)
        if valid:
            h, e = divmod(i, per_head)
            counts[(h * width + r) * segments + e // seg_len] += 1
    if schedule is not None:
        for i0 in range(0, hkv * per_head, topk):
            grp = [place(i) for i in range(i0, i0 + topk)]
            h, rem = divmod(i0, per_head)
            split_counts[rem // topk, h] = slots(grp)[0][1]
    counts = exclusive_scan(counts)

    def head_base(h):
        return counts[(h * width - 1) * segments + segments - 1] if h > 0 else 0

    stride = per_head
    q_idx = np.full((hkv, stride), -7, dtype=np.int64)
    qsplit = np.full((hkv, stride), -7, dtype=np.int64)
    warps = [(h, seg) for h in range(hkv) for seg in range(segments)]
    rng_order = random.Random(len(warps)).sample(warps, len(warps))   # warps in any order
    for h, seg in rng_order:
        base = head_base(h)
        seg_end = min(per_head, (seg + 1) * seg_len)
        for e0 in range(seg * seg_len, seg_end, 32 * UNROLL):
            chunks = []
            for u in range(UNROLL):
                lanes = [e0 + u * 32 + lane for lane in range(32)]
                pl = [place(h * per_head + e) if e < seg_end else (False, 0, 0) for e in lanes]
                chunks.append((pl, slots(pl)))
            for pl, sl in chunks:
                idx = [(h * width + p[1]) * segments + seg if p[0] else -1 for p in pl]
                placed = []
                for lane, key in enumerate(idx):
                    if key < 0:
                        continue
                    rank = (sum(1 for o in range(lane) if idx[o] == key)
                            if rank_lower_lanes else 0)
                    at = counts[key] - base + rank
                    q_idx[h, at] = pl[lane][2]
                    qsplit[h, at] = pl[lane][2] | (sl[lane][0] << SLOT_SHIFT)
                    placed.append(key)
                for key in set(placed):
                    counts[key] += placed.count(key)

    def key_end(k):
        return counts[k * segments + segments - 1]

    def key_start(k):
        return key_end(k - 1) if k > 0 else 0

    for h in range(hkv):
        head_valid = key_end(h * width + total_rows) - head_base(h)
        q_idx[h, head_valid:] = -1
        qsplit[h, head_valid:] = -1
    row_ptr = np.array([key_start(k) - head_base(k // width) for k in range(hkv * width)],
                       dtype=np.int64).reshape(hkv, width)
    if schedule is None:
        return row_ptr, q_idx

    target, capacity = schedule
    n = total_rows * hkv
    chunks = np.zeros(n, dtype=np.int64)
    for idx in range(n):
        r, h = divmod(idx, hkv)
        k = h * width + r
        chunks[idx] = -(-max(key_end(k) - key_start(k), 0) // target)
    incl = np.cumsum(chunks)
    total_items = int(incl[-1]) if n > 0 else 0
    meta = np.zeros((capacity, 6), dtype=np.int64)
    for w in range(min(total_items, capacity)):
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi) >> 1
            if incl[mid] > w:
                hi = mid
            else:
                lo = mid + 1
        r, h = divmod(lo, hkv)
        chunk = w - (incl[lo - 1] if lo > 0 else 0)
        length = row_ptr[h, r + 1] - row_ptr[h, r]
        q_begin = chunk * target
        meta[w] = (h, r, q_begin, min(target, length - q_begin), *row_owner(rows, r))
    return row_ptr, q_idx, (meta, np.array([min(total_items, capacity)]), qsplit, split_counts)


def random_q2k(rng, q_lens, k_lens, hkv, topk, p_empty=0.15, garbage=False):
    parts = []
    for q_len, k_len in zip(q_lens, k_lens):
        n_blocks = math.ceil(k_len / KV_BLOCK)
        part = np.full((hkv, q_len, topk), -1, dtype=np.int64)
        for h in range(hkv):
            for q in range(q_len):
                pick = rng.permutation(n_blocks)[:topk] if n_blocks else np.array([], int)
                part[h, q, :len(pick)] = pick
                rng.shuffle(part[h, q])
        part[rng.random(part.shape) < p_empty] = -1
        parts.append(part)
    q2k = np.concatenate(parts, 1)
    if garbage:
        junk = rng.integers(-(1 << 31), (1 << 31) - 1, q2k.shape)
        small = rng.integers(-3, 45, q2k.shape)
        q2k = np.where(rng.random(q2k.shape) < 0.3, junk, np.where(rng.random(q2k.shape) < 0.3,
                                                                   small, q2k))
        q2k[:, :, 1] = q2k[:, :, 0]
    return torch.from_numpy(q2k.astype(np.int32)).contiguous()


def check(q_lens, k_lens, hkv, topk, rng, *, garbage=False, max_kv_blocks=None,
          total_rows=None, rank_lower_lanes=True):
    cu_q = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(k_lens)), dtype=torch.int32)
    q2k = random_q2k(rng, q_lens, k_lens, hkv, topk, garbage=garbage)
    call = msa.interface._check_k2q_csr_args(
        q2k, cu_q, cu_k, KV_BLOCK, total_k=int(sum(k_lens)), max_seqlen_k=max(max(k_lens), 1),
        max_seqlen_q=max(max(q_lens), 1), total_rows=total_rows, qhead_per_kv=16,
        return_schedule=True)
    if max_kv_blocks is not None:
        call.max_kv_blocks = max_kv_blocks
    assert fits(hkv, sum(q_lens), topk, len(q_lens), call.total_rows, call.max_kv_blocks), \
        "case outside the one-CTA bounds"
    ref_row_ptr, ref_q_idx, ref = msa.interface._build_k2q_csr_reference(call)
    row_ptr, q_idx, (meta, work_count, qsplit, split_counts) = one_cta_build(
        q2k.numpy(), cu_q.tolist(), cu_k.tolist(), total_rows=call.total_rows,
        max_kv_blocks=call.max_kv_blocks, schedule=(ref.target_q_per_cta,
                                                     ref.scheduler_metadata.shape[0]),
        rank_lower_lanes=rank_lower_lanes)
    for name, got, want in (("row_ptr", row_ptr, ref_row_ptr), ("q_indices", q_idx, ref_q_idx),
                            ("scheduler_metadata", meta, ref.scheduler_metadata),
                            ("work_count", work_count, ref.work_count),
                            ("qsplit_indices", qsplit, ref.qsplit_indices),
                            ("split_counts", split_counts, ref.split_counts)):
        want = want.numpy().astype(np.int64).reshape(got.shape)
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)[0]
            raise AssertionError(f"{name}: {int((got != want).sum())} mismatches, first at "
                                 f"{tuple(bad)}: {got[tuple(bad)]} != {want[tuple(bad)]}")


def main():
    rng = np.random.default_rng(20261205)
    cases = [
        dict(q_lens=[182], k_lens=[17718], hkv=4, topk=16),           # production short chunk
        dict(q_lens=[171], k_lens=[55339], hkv=4, topk=16),
        dict(q_lens=[170, 156], k_lens=[13000, 27277], hkv=4, topk=16),
        dict(q_lens=[40, 0, 9, 1], k_lens=[5000, 3000, 0, 1], hkv=3, topk=8),
        dict(q_lens=[300, 1, 200], k_lens=[5000, 130, 257], hkv=2, topk=16, garbage=True),
        dict(q_lens=[300, 1, 200], k_lens=[5000, 130, 257], hkv=2, topk=16, garbage=True,
             max_kv_blocks=1),
        dict(q_lens=[300, 1, 200], k_lens=[5000, 130, 257], hkv=2, topk=16, garbage=True,
             total_rows=20),
        dict(q_lens=[64, 64], k_lens=[2000, 700], hkv=1, topk=32),
        dict(q_lens=[100] * 5, k_lens=[900] * 5, hkv=5, topk=4),
        dict(q_lens=[3] * 64, k_lens=[300] * 64, hkv=2, topk=4),         # 64 requests
        dict(q_lens=[8], k_lens=[40000], hkv=32, topk=8),                # one warp per head
        dict(q_lens=[0], k_lens=[256], hkv=2, topk=8),                   # no queries
    ]
    for case in cases:
        check(rng=rng, **case)
        print(f"ok: {len(case['q_lens'])} requests, total_q {sum(case['q_lens'])}, "
              f"Hkv {case['hkv']}, topk {case['topk']}",
              " ".join(k for k in ("garbage", "max_kv_blocks", "total_rows") if k in case))
    try:
        check(q_lens=[182], k_lens=[17718], hkv=4, topk=16, rng=rng, rank_lower_lanes=False)
    except AssertionError as e:
        print("mutation caught:", e)
    else:
        raise SystemExit("the mutation (no lower-lane rank) was not caught")
    print("model_k2q_one_cta: all cases equal the reference")


if __name__ == "__main__":
    main()
