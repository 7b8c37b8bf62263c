#!/usr/bin/env python3
"""Summarize ncu's per-SASS stall sampling of one kernel (no GPU needed).

    ncu --section SourceCounters ... -o R python3 benchmarks/lab/profile_fmha.py ...
    ncu --import R.ncu-rep --page source --print-source sass --csv > R_sass.csv
    python tools/lab/ncu_stalls.py R_sass.csv

    python tools/lab/ncu_stalls.py R_sass.csv --top 20   # also the 20 hottest instructions

Prints the stall reasons over all samples, then the opcodes holding the most samples with each
one's top three reasons (e.g. MUFU "wait": a fixed-latency dependency; WARPGROUP "barrier":
the DEPBAR waiting for the warp's own wgmmas; BRA "long_sb": mbarrier try-wait loops): the
e4m3 FMHA's critical path was read this way (docs/design-fmha.md).
"""

from __future__ import annotations

import collections
import csv
import re
import sys


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top_n = 0
    if len(argv) == 3 and argv[1] == "--top":
        top_n, argv = int(argv[2]), argv[:1]
    if len(argv) != 1:
        print(__doc__)
        return 2
    rows = list(csv.reader(open(argv[0])))
    if len(rows) < 2:
        print(f"{argv[0]}: not an ncu source page CSV (no header row)", file=sys.stderr)
        return 1
    header, data = rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    samples = collections.Counter()
    executed = collections.Counter()
    for row in data:
        if len(row) < len(header):
            continue
        # Opcode without predicate and modifiers ("@!P0 SYNCS.ARRIVE..." -> "SYNCS").
        op = re.sub(r"^@!?U?P\w+\s+", "", row[col["Source"]].strip()).split(" ")[0].split(".")[0]
        samples[op] += _num(row[col["Warp Stall Sampling (All Samples)"]])
        executed[op] += _num(row[col["Instructions Executed"]])
        for c in stall_cols:
            v = _num(row[col[c]])
            total[c] += v
            by_op[op][c] += v
    n = sum(samples.values()) or 1.0
    print("total samples", n)
    print("stall reasons:", ", ".join(f"{c[6:]} {v / n * 100:.1f}%"
                                      for c, v in total.most_common(10)))
    print("by opcode (samples %, top reasons):")
    for op, s in samples.most_common(16):
        top = ", ".join(f"{c[6:]} {v / s * 100:.0f}%" for c, v in by_op[op].most_common(3)) \
            if s else ""
        print(f"  {op:10s} {s / n * 100:5.1f}%  exec {executed[op]:.3g}  [{top}]")
    if top_n:
        # The hottest instructions with the two before each: which wait (a try-wait loop's
        # barrier address, a DEPBAR's group) or which dependency the samples sit on.
        rows_ok = [row for row in data if len(row) >= len(header)]
        order = sorted(range(len(rows_ok)), key=lambda i: -_num(
            rows_ok[i][col["Warp Stall Sampling (All Samples)"]]))
        print(f"hottest {top_n} instructions (index in the listing, samples %, top reasons):")
        for i in order[:top_n]:
            row = rows_ok[i]
            s = _num(row[col["Warp Stall Sampling (All Samples)"]])
            reasons = sorted(((_num(row[col[c]]), c[6:]) for c in stall_cols), reverse=True)[:2]
            print(f"  [{i}] {s / n * 100:4.1f}%  {row[col['Source']].strip()}  "
                  f"({', '.join(f'{r} {v / (s or 1) * 100:.0f}%' for v, r in reasons)})")
            for j in (i - 2, i - 1):
                if j >= 0:
                    print(f"        [{j}] {rows_ok[j][col['Source']].strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
