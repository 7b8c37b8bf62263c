#!/usr/bin/env python3
"""Byte floors of the MSA decode step on upstream's production grid, from a benchmark TSV (no GPU).

What it answers: which of issue 24's step bars (never slower than cuDNN dense; >= 8x faster from
100K keys) a kernel that reads each byte the step must read exactly once can reach at all. A
step must read its index keys for every history block and K+V of the union of each (request, KV
head)'s selected blocks: `bench_decode_production.py` records exactly those bytes per case
(`bytes_read`, the selection the step made). The floor is bytes / rate (default 4.26 TB/s, the
H200's device copy); against the cuDNN row of the same run it gives the best speed-up any step
could show, and the share of the rate a step must sustain to meet the bar:

    python tools/lab/decode_step_floors.py benchmarks/results/decode_production_h200.tsv \
        [--commit SHA] [--rate-tbps 4.26]

Per case and step implementation: cuDNN and step latency (us), the step's speed-up, the floor
(us) and its speed-up, and `need`: the bar's time over the floor's (below 1.0 the bar needs
more than the rate: out of reach on these bytes).
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from typing import Dict, List, Tuple

# Issue 24: never slower than cuDNN on upstream's grid; >= 8x faster from 100K keys.
FAST_FROM_KEYS = 100_000
FAST_FACTOR = 8.0


def bar_speedup(nominal_kv: int) -> float:
    return FAST_FACTOR if nominal_kv >= FAST_FROM_KEYS else 1.0


def load_rows(path: str, commit: str) -> Tuple[str, List[dict]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    commit = commit or rows[-1]["commit"]
    picked = [r for r in rows if r["commit"].startswith(commit) and r["case"] != "weighted"]
    if not picked:
        raise SystemExit(f"{path}: no rows of commit {commit}")
    return commit, picked


def floors(rows: List[dict], rate_tbps: float):
    """[(case, impl, batch, nominal, cudnn_us, step_us, floor_us)] for every step row whose case
    has a cuDNN row in the same run (the last row of each case and impl counts)."""
    by_case: Dict[str, Dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_case[r["case"]][r["impl"]] = r
    out = []
    for case, impls in by_case.items():
        cudnn = impls.get("cudnn")
        if cudnn is None:
            continue
        for impl, r in sorted(impls.items()):
            if not impl.startswith("step") or not r["bytes_read"]:
                continue
            floor_us = float(r["bytes_read"]) / (rate_tbps * 1e6)
            out.append((case, impl, int(r["batch"]), int(r["nominal_kv"]),
                        float(cudnn["latency_us"]), float(r["latency_us"]), floor_us))
    return sorted(out, key=lambda x: (x[3], x[2], x[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tsv")
    ap.add_argument("--commit", default="", help="rows of this commit (default: the last row's)")
    ap.add_argument("--rate-tbps", type=float, default=4.26)
    args = ap.parse_args()
    commit, rows = load_rows(args.tsv, args.commit)
    print(f"# {args.tsv} at {commit}, floors at {args.rate_tbps} TB/s")
    print("case\timpl\tcudnn_us\tstep_us\tstep_x\tfloor_us\tfloor_x\tbar_x\tneed")
    for case, impl, _batch, nominal, cudnn_us, step_us, floor_us in floors(rows, args.rate_tbps):
        bar = bar_speedup(nominal)
        need = (cudnn_us / bar) / floor_us
        print(f"{case}\t{impl}\t{cudnn_us:.1f}\t{step_us:.1f}\t{cudnn_us / step_us:.2f}\t"
              f"{floor_us:.1f}\t{cudnn_us / floor_us:.2f}\t{bar:g}\t{need:.2f}")


if __name__ == "__main__":
    main()
