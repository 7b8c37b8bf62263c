#!/usr/bin/env python3
"""Byte and FLOP floors of MSA prefill attention on upstream's 66 production cases (no GPU).

What it answers: how fast the attention stage (attention + combine) can be under each design,
in upstream's effective TFLOP/s (4 D Hq per selected, visible query-key pair), when the
selections are those the benchmark's random inputs produce: every query's own block plus 15
earlier blocks spread over the whole prefix. Per (query, KV head, selected block) "entry":

  KV-outer + combine (msa today): the CTA of a (KV head, block) gathers each selecting query's
      G heads of Q (G D q_bytes), writes a partial row per head (D partial_bytes + 4 for the
      LSE) that the combine reads back; K/V once per touched (KV head, block); O written once.
  KV-outer + combine, items by query window (schedules.sparse.split_items_by_query_window):
      the same, with the items in flight on one KV head's window of W queries, so Q comes from
      HBM once (its gathers hit L2) and each window reads the K/V blocks it touches again (all
      of the request's, with random selections: an upper bound).
  KV-outer, combine fused: the same without the partial round trip (what a fused combine would
      need: an exact row max first, or atomics; neither exists).
  KV-outer, two passes: pass 1 computes each row's exact LSE (Q K^T only, no V, no partials),
      pass 2 recomputes S, takes P = exp(S - LSE) and adds P V into an fp32 O with reductions,
      kept in L2 by running the call in query chunks whose fp32 O fits --l2-budget-mb (each
      chunk reads the K/V it touches again): Q gathered twice, K twice, 1.5x the FLOPs; the
      reductions themselves are taken as free, which the H200 has to confirm.
  Q-outer over a query tile's union: Q, K/V of the union, O once, but every row of a 64-row MMA
      tile (64 / G queries at G = 16) computes against the union of its queries' blocks: with
      random selections ~(1 + 15 q) blocks for q queries, a compute inflation of ~q.

Each design's time is max(bytes / HBM, FLOPs / tensor peak) per case (no launch or tail cost),
summed with the production weights: the weighted effective TFLOP/s is a ceiling, not a
prediction. The measured column is the pipeline's attention + combine from
benchmarks/results/prefill_production_h200.tsv (the latest commit there).

    python tools/lab/model_prefill_bytes.py [--hbm-tbs 4.26] [--bf16-tflops 806] [--l2-budget-mb 30]
        [--window 2048]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from prefill_cases import BLOCK, TOPK, attention_flops, load_cases  # noqa: E402

HQ, HKV, D = 64, 4, 128
G = HQ // HKV
TILE_ROWS = 64
# (q / K / V bytes, partial bytes, tensor peak key) per dtype of the benchmark's rows
DTYPES = {"bf16": (2, 2, "bf16"), "fp8": (1, 2, "fp8")}


def entries(case) -> int:
    """(query, KV head, selected block) triples: the own block and min(topk, own + 1) - 1
    earlier ones per query."""
    total = 0
    for q_len, prefix in zip(case.query_lens, case.prefix_lens):
        for i in range(q_len):
            total += min(TOPK, (prefix + i) // BLOCK + 1)
    return total * HKV


def touched_blocks(case) -> int:
    """(KV head, block) pairs some query selects: with random selections and thousands of
    queries, nearly every block of every request (an upper bound)."""
    return HKV * sum(-(-kv // BLOCK) for kv in case.kv_lens)


def floors(case, dtype, hbm, peaks, l2_budget, window):
    qb, pb, peak_key = DTYPES[dtype]
    flops = attention_flops(case.selected_keys(), HQ, D)
    e = entries(case)
    q_gather = e * G * D * qb
    partials = 2 * e * G * (D * pb + 4)
    kv = touched_blocks(case) * 2 * BLOCK * D * qb
    out = case.total_q * HQ * D * 2
    peak = peaks[peak_key]
    kv_outer = max((q_gather + partials + kv + out) / hbm, flops / peak)
    windows = -(-case.total_q // window)
    windowed = max((case.total_q * HQ * D * qb + partials + kv * windows + out) / hbm,
                   flops / peak)
    fused = max((q_gather + kv + out) / hbm, flops / peak)
    chunk_queries = max(1, int(l2_budget // (HQ * D * 4)))
    chunks = -(-case.total_q // chunk_queries)
    two_pass = max((2 * q_gather + 1.5 * kv * chunks + out) / hbm, 1.5 * flops / peak)
    queries_per_tile = max(1, TILE_ROWS // G)
    inflation = min(queries_per_tile * (TOPK - 1) + 1, TOPK * queries_per_tile) / TOPK
    q_outer = max((case.total_q * HQ * D * qb + kv + out) / hbm, flops * inflation / peak)
    return flops, kv_outer, windowed, fused, two_pass, q_outer


def measured(path: Path):
    """{(case, dtype): (commit, attention + combine seconds)} of the TSV's latest commit."""
    rows = list(csv.DictReader(path.open(), delimiter="\t"))
    commit = [r["commit"] for r in rows if r["case"].startswith("prefill_")][-1]
    out = {}
    for r in rows:
        if r["commit"] == commit and r["attention_ms"]:
            combine = float(r["combine_ms"] or 0)
            out[r["case"], r["dtype"]] = float(r["attention_ms"]) * 1e-3 + combine * 1e-3
    return commit, out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hbm-tbs", type=float, default=4.26, help="H200 device copy rate")
    ap.add_argument("--bf16-tflops", type=float, default=806.0, help="bf16 GEMM rate")
    ap.add_argument("--fp8-tflops", type=float, default=1600.0, help="e4m3 GEMM rate")
    ap.add_argument("--l2-budget-mb", type=float, default=30.0,
                    help="L2 for the two-pass design's fp32 O of a query chunk")
    ap.add_argument("--window", type=int, default=2048,
                    help="queries of a window of the query-window item order")
    ap.add_argument("--tsv", default=str(ROOT / "benchmarks/results/prefill_production_h200.tsv"))
    args = ap.parse_args(argv)
    hbm = args.hbm_tbs * 1e12
    peaks = {"bf16": args.bf16_tflops * 1e12, "fp8": args.fp8_tflops * 1e12}
    commit, seen = measured(Path(args.tsv))
    cases = load_cases()
    print(f"# measured: attention + combine at {commit}; floors: HBM {args.hbm_tbs} TB/s, "
          f"bf16 {args.bf16_tflops:.0f} / e4m3 {args.fp8_tflops:.0f} TFLOP/s")
    print("dtype\tdesign\tweighted_eff_tflops\tmin_case\tmax_case")
    for dtype in DTYPES:
        sums = {k: [0.0, 0.0, float("inf"), 0.0] for k in
                ("measured", "kv_outer+combine", "kv_outer+combine_windows", "kv_outer_fused",
                 "kv_outer_two_pass", "q_outer_union")}
        for case in cases:
            flops, kv_outer, windowed, fused, two_pass, q_outer = floors(
                case, dtype, hbm, peaks, args.l2_budget_mb * 2**20, args.window)
            times = {"kv_outer+combine": kv_outer, "kv_outer+combine_windows": windowed,
                     "kv_outer_fused": fused,
                     "kv_outer_two_pass": two_pass, "q_outer_union": q_outer}
            if (case.case_id, dtype) in seen:
                times["measured"] = seen[case.case_id, dtype]
            for key, t in times.items():
                s = sums[key]
                s[0] += case.weight * flops
                s[1] += case.weight * t
                s[2] = min(s[2], flops / t / 1e12)
                s[3] = max(s[3], flops / t / 1e12)
        for key, (wf, wt, lo, hi) in sums.items():
            if wt:
                print(f"{dtype}\t{key}\t{wf / wt / 1e12:.0f}\t{lo:.0f}\t{hi:.0f}")


if __name__ == "__main__":
    main()
