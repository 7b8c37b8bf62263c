"""Does the order of the KV-outer attention's work items decide its speed? (GPU diagnostic for
issue 23, no TSV.)

A 16k-query production chunk runs its sparse attention as ~1.5k work items, one CTA each in
blockIdx order, ordered (CSR row, KV head): each item TMA-gathers the G query heads of every
query that selected its block (4 KB a query in bf16). With the random selections of the
production benchmark a block's ~660 queries lie all over the chunk, so the ~264 items in flight
touch the whole Q of all four KV heads (268 MB bf16) and most gathers miss the 50 MB L2: ~4.3 GB
of Q beside the ~4.3 GB of partials the items write (the attention runs at ~3.6 TB/s, bytes-bound).

Items are independent (a query's partial rows do not depend on its tile-mates, slots are the
rank of a row among its query's rows), so any order or split of the items gives the same bits.
This script times the attention + combine of one chunk with the served schedule against:
  head_major   the same items ordered (KV head, row): the items in flight share one KV head's Q
  window:W     items split at query windows of W queries and ordered (KV head, window, row): the
               items in flight gather from one head's W queries (W x 4 KB in bf16), so Q should
               come from L2; each window re-reads the K/V blocks it selects (rows x 64 KB a head)
and checks that every order's O equals the served one bit for bit.

    python benchmarks/lab/sparse_item_order.py
    python benchmarks/lab/sparse_item_order.py --shapes 16384:47744,16384:84480 --windows 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
from _common import load_msa  # noqa: E402

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
E4M3 = torch.float8_e4m3fn
HEAD, ROW, Q_BEGIN, Q_COUNT, BATCH = 0, 1, 2, 3, 4


def chunk_selection(q_len: int, k_len: int, gen: torch.Generator) -> torch.Tensor:
    """[Hkv, q_len, TOPK] block ids of a chunk at the end of k_len keys: each query's own block
    and 15 uniformly random earlier ones (the production benchmark's indexer on random data)."""
    blocks = -(-k_len // BLOCK)
    own = (torch.arange(q_len, device="cuda") + k_len - q_len) // BLOCK
    score = torch.rand(HKV, q_len, blocks, generator=gen, device="cuda", dtype=torch.float16)
    ids = torch.arange(blocks, device="cuda")
    score.masked_fill_(ids.view(1, 1, -1) > own.view(1, -1, 1), float("-inf"))
    score.scatter_(2, own.view(1, -1, 1).expand(HKV, q_len, 1), float("inf"))
    return score.topk(TOPK, dim=-1).indices.int().contiguous()


def reordered(schedule, row_ptr: torch.Tensor, q_idx: torch.Tensor, cu_q: torch.Tensor,
              window: int):
    """The schedule's items ordered (KV head, query window, row), split at windows of `window`
    queries (0: no split, (KV head, row) order)."""
    meta = schedule.scheduler_metadata[:int(schedule.work_count[0])].cpu().long()
    row_ptr, q_idx, cu_q = row_ptr.cpu().long(), q_idx.cpu().long(), cu_q.cpu().long()
    items = []
    for item in meta.tolist():
        h, r, begin, count, b = item[HEAD], item[ROW], item[Q_BEGIN], item[Q_COUNT], item[BATCH]
        first = int(row_ptr[h, r]) + begin
        queries = cu_q[b] + q_idx[h, first:first + count]
        if window <= 0:
            items.append(((h, 0, r, begin), item))
            continue
        windows = torch.div(queries, window, rounding_mode="floor")
        cuts = [0] + (torch.nonzero(windows[1:] != windows[:-1]).flatten() + 1).tolist() + [count]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            piece = list(item)
            piece[Q_BEGIN], piece[Q_COUNT] = begin + lo, hi - lo
            items.append(((h, int(windows[lo]), r, begin + lo), piece))
    items.sort(key=lambda pair: pair[0])
    new_meta = torch.tensor([piece for _, piece in items], dtype=torch.int32)
    return dataclasses.replace(
        schedule, scheduler_metadata=new_meta.to(schedule.scheduler_metadata.device),
        work_count=torch.tensor([len(items)], dtype=torch.int32,
                                device=schedule.work_count.device))


def median_ms(fn, rep_ms: int) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="16384:47744,16384:84480,16384:27136",
                    help="q_len:k_len chunks (the production table's heaviest)")
    ap.add_argument("--windows", default="1024,2048,4096,8192")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--rep-ms", type=int, default=300)
    args = ap.parse_args()
    msa = load_msa()
    print(f"# {torch.cuda.get_device_name()}  msa from {msa.__file__}")
    print("shape\tdtype\torder\titems\tq_per_item\tms\tx_served\tequal")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        q_len, k_len = (int(x) for x in shape.split(":"))
        q2k = chunk_selection(q_len, k_len, gen)
        cu_q = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, k_len], dtype=torch.int32, device="cuda")
        row_ptr, q_idx, schedule = msa.build_k2q_csr(
            q2k, cu_q, cu_k, BLOCK, total_k=k_len, max_seqlen_q=q_len, max_seqlen_k=k_len,
            qhead_per_kv=HQ // HKV, return_schedule=True)
        q = torch.randn(q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(k_len, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(k_len, HKV, D, device="cuda", dtype=torch.bfloat16)
        orders = [("served", schedule), ("head_major", reordered(schedule, row_ptr, q_idx,
                                                                  cu_q, 0))]
        orders += [(f"window:{w}", reordered(schedule, row_ptr, q_idx, cu_q, int(w)))
                   for w in args.windows.split(",") if w]
        for dtype in args.dtypes.split(","):
            qq, kk, vv = (q, k, v) if dtype == "bf16" else (q.to(E4M3), k.to(E4M3), v.to(E4M3))

            def attend(sched):
                return msa.sparse_atten_func(
                    qq, kk, vv, row_ptr, q_idx, TOPK, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=q_len, max_seqlen_k=k_len, causal=True, schedule=sched)

            served_o = attend(schedule).clone()
            served_ms = None
            for name, sched in orders:
                out = attend(sched)
                equal = bool(torch.equal(out, served_o))
                ms = median_ms(lambda: attend(sched), args.rep_ms)
                served_ms = served_ms or ms
                n = int(sched.work_count[0])
                per_item = int(sched.scheduler_metadata[:n, Q_COUNT].float().mean())
                print(f"{shape}\t{dtype}\t{name}\t{n}\t{per_item}\t{ms:.4f}\t"
                      f"{served_ms / ms:.3f}\t{equal}", flush=True)
            del served_o
        del q, k, v, orders, schedule, q_idx, row_ptr
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
