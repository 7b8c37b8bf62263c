#!/usr/bin/env python3
"""Makespan model of dense MTP decode schedules on upstream's ragged production grid (no GPU).

What it answers: how much of the gap between our dense decode and cuDNN (which the protocol
gives uniform lengths of the same total) is the schedule, and what a persistent form over a
balanced page partition would recover. Time is counted in page-times (one KV head's page
streamed by one SM at the HBM rate; 64 KB bf16, ~1.9 us on the H200) plus fixed costs:

  current: CUDA-graph plans of schedules/decode.py (chunks sized from max_seqlen_k: one wave,
           or GRAPH_SPLIT_WAVES waves of >= MIN_BALANCE_CHUNK_PAGES pages), one CTA per
           (request, chunk, KV head), handed to SMs in launch order as they free up (greedy list
           scheduling); each CTA pays `item_cost` (launch, Q load, pipeline fill, the output or
           partial write), and chunks past a shorter request's end `empty_cost`;
  persistent: one CTA per SM over the concatenated (request, KV head) page sequences, cut into
           equal page ranges from the live lengths (a device plan kernel); each CTA pays
           `item_cost` once and `switch_cost` per sequence it starts (its finalize and the next
           Q, overlapped with the page stream except the partial write).

    python tools/lab/model_decode_balance.py [--item-cost 2] [--switch-cost 1]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "torch-ext"))

from bench_decode_production import PRODUCTION_BATCHES, PRODUCTION_KV, ragged_lengths  # noqa: E402
from msa.schedules import decode as plans  # noqa: E402

PAGE = 128
HKV = 4
SMS = 132
SEQLEN_Q = 8


def greedy_makespan(costs, machines):
    """List scheduling in launch order: each item starts on the first machine to free up."""
    free = [0.0] * machines
    heapq.heapify(free)
    for cost in costs:
        start = heapq.heappop(free)
        heapq.heappush(free, start + cost)
    return max(free)


def current_makespan(lens, item_cost, empty_cost):
    """The CUDA-graph plan of schedules/decode.py as launched (grid = items x KV heads)."""
    import torch
    seqused = torch.tensor(lens, dtype=torch.int32)
    s = plans.build_decode_schedule(seqused, PAGE, SEQLEN_Q, 16 * HKV, HKV, 128, max(lens),
                                    enable_cuda_graph=True, max_grid_size=SMS)
    pages = [-(-n // PAGE) for n in lens]
    costs = []
    for _head in range(HKV):                       # blockIdx.y outer, blockIdx.x inner
        for b, c in zip(s.request_indices_host.tolist(), s.kv_tile_indices_host.tolist()):
            begin = c * s.kv_chunk_size
            last = c == int(s.num_splits_host[b]) - 1
            end = pages[b] if last else min(begin + s.kv_chunk_size, pages[b])
            work = max(0, end - begin)
            costs.append(work + item_cost if work else empty_cost)
    return greedy_makespan(costs, SMS)


def persistent_partition(lens, ctas):
    """Equal page ranges over the (request, KV head) sequences: [(cta, seq, begin, end)]."""
    pages = [-(-n // PAGE) for n in lens for _head in range(HKV)]
    total = sum(pages)
    cuts = [total * j // ctas for j in range(ctas + 1)]
    segments, seq, offset = [], 0, 0
    for cta in range(ctas):
        at = cuts[cta]
        while at < cuts[cta + 1]:
            while offset + pages[seq] <= at:
                offset += pages[seq]
                seq += 1
            end = min(cuts[cta + 1], offset + pages[seq])
            segments.append((cta, seq, at - offset, end - offset))
            at = end
    covered = {}
    for _cta, sq, b, e in segments:
        covered.setdefault(sq, []).append((b, e))
    for sq, ranges in covered.items():           # every page of every sequence exactly once
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == pages[sq]
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
    return segments


def persistent_makespan(lens, item_cost, switch_cost):
    per_cta = [float(item_cost)] * SMS
    for cta, _seq, b, e in persistent_partition(lens, SMS):
        per_cta[cta] += (e - b) + switch_cost
    return max(per_cta)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--item-cost", type=float, default=2.0,
                    help="page-times a CTA (or a chunk) pays besides its pages")
    ap.add_argument("--empty-cost", type=float, default=0.3,
                    help="page-times of a CTA whose chunk lies past its request's end")
    ap.add_argument("--switch-cost", type=float, default=1.0,
                    help="page-times a persistent CTA pays per sequence it starts")
    args = ap.parse_args(argv)
    print("batch\tnominal\tideal\tcurrent\tpersistent\tcurrent/ideal\tpersistent/ideal\tgain")
    for nominal in PRODUCTION_KV:
        for batch in PRODUCTION_BATCHES:
            lens = ragged_lengths(batch, nominal, SEQLEN_Q)
            ideal = sum(-(-n // PAGE) for n in lens) * HKV / SMS
            cur = current_makespan(lens, args.item_cost, args.empty_cost)
            per = persistent_makespan(lens, args.item_cost, args.switch_cost)
            print(f"{batch}\t{nominal}\t{ideal:.1f}\t{cur:.1f}\t{per:.1f}\t{cur / ideal:.2f}\t"
                  f"{per / ideal:.2f}\t{cur / per:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
