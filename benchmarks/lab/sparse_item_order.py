"""Does the order of the KV-outer attention's work items decide its speed? (GPU diagnostic for
issue 23, no TSV.)

A 16k-query production chunk runs its sparse attention as ~1.5k work items, one CTA each in
blockIdx order, which the builders make (KV head, CSR row): each item TMA-gathers the G query
heads of every query that selected its block (4 KB a query in bf16). With the random selections
of the production benchmark a block's ~660 queries lie all over the chunk, so items in flight
that span the KV heads would touch the whole Q of all four (268 MB bf16), which the 50 MB L2
cannot hold, beside the ~4.3 GB of partials the items write.

Items are independent (a query's partial rows do not depend on its tile-mates, slots are the
rank of a row among its query's rows), so any order or split of the items gives the same bits.
This script times the attention + combine of one chunk with the served schedule against
msa.schedules.sparse.split_items_by_query_window's orders:
  window:W     items split at query windows of W queries and ordered (KV head, window, row): the
               items in flight gather from one head's W queries (W x 4 KB in bf16), so Q should
               come from L2; each window re-reads the K/V blocks it selects (rows x 64 KB a head)
and checks that every order's O equals the served one bit for bit.

    python benchmarks/lab/sparse_item_order.py
    python benchmarks/lab/sparse_item_order.py --shapes 16384:47744,16384:84480 --windows 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import import_module
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
from _common import load_msa  # noqa: E402

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
E4M3 = torch.float8_e4m3fn
Q_COUNT = 3                # scheduler_metadata's query-count column
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a smoke run of the script


def chunk_selection(q_len: int, k_len: int, gen: torch.Generator) -> torch.Tensor:
    """[Hkv, q_len, TOPK] block ids of a chunk at the end of k_len keys: each query's own block
    and 15 uniformly random earlier ones (the production benchmark's indexer on random data)."""
    blocks = -(-k_len // BLOCK)
    own = (torch.arange(q_len, device=DEVICE) + k_len - q_len) // BLOCK
    score = torch.rand(HKV, q_len, blocks, generator=gen, device=DEVICE, dtype=torch.float16)
    ids = torch.arange(blocks, device=DEVICE)
    score.masked_fill_(ids.view(1, 1, -1) > own.view(1, -1, 1), float("-inf"))
    score.scatter_(2, own.view(1, -1, 1).expand(HKV, q_len, 1), float("inf"))
    return score.topk(TOPK, dim=-1).indices.int().contiguous()


def median_ms(fn, rep_ms: int) -> float:
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
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
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"# {name}  msa from {msa.__file__}")
    print("shape\tdtype\torder\titems\tq_per_item\tms\tx_served\tequal")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for shape in args.shapes.split(","):
        q_len, k_len = (int(x) for x in shape.split(":"))
        q2k = chunk_selection(q_len, k_len, gen)
        cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, k_len], dtype=torch.int32, device=DEVICE)
        row_ptr, q_idx, schedule = msa.build_k2q_csr(
            q2k, cu_q, cu_k, BLOCK, total_k=k_len, max_seqlen_q=q_len, max_seqlen_k=k_len,
            qhead_per_kv=HQ // HKV, return_schedule=True)
        q = torch.randn(q_len, HQ, D, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(k_len, HKV, D, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn(k_len, HKV, D, device=DEVICE, dtype=torch.bfloat16)
        split = import_module(f"{msa.__name__}.schedules.sparse").split_items_by_query_window
        orders = [("served", schedule)] + [
            (f"window:{w}", split(schedule, q_idx, cu_q, int(w)))
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
