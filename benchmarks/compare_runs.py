"""Compare a benchmark run with the rows before it: is every case within noise of its last row?

Each benchmark appends rows (GPU, commit, date, the case's settings, its timings) to one TSV in
benchmarks/results/. A case is identified by its settings: every column except the run's
identity (commit, date), the measured figures (times, throughputs, ratios, bytes, memory) and
the note. For each case of the new run this prints the last earlier time of the same case and
the ratio, and flags the cases slower than that by more than --tolerance.

    python benchmarks/compare_runs.py benchmarks/results/fmha_h200.tsv
        the file's newest run (by date, then commit time) against the rows before it
    python benchmarks/compare_runs.py NEW.tsv --baseline benchmarks/results/fmha_h200.tsv
        every row of NEW.tsv (e.g. a device run's $OUT copy) against the baseline file

Exit status 1 when a case is slower than its last row beyond the tolerance, else 0 (cases with
no earlier row are listed as new).
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# Columns that are measurements or bookkeeping, never part of a case's identity.
MEASURED = re.compile(r"(^commit$|^date$|^note$|^cv$|^slots$|^calls$|_ms$|_us$|tflops|tb_per_s|"
                      r"speedup|share|ratio|peak|bytes|gflop|visible_pairs|_gib$|_gb$|"
                      r"^chunks$|^index_splits$|^graph$)")
TIME_COLUMNS = ("latency_ms", "latency_us")
ROOT = Path(__file__).resolve().parents[1]


def read_rows(path: Path) -> Tuple[List[str], List[Dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f, delimiter="\t")
        return list(reader.fieldnames or []), [row for row in reader]


def time_column(columns: Sequence[str]) -> str:
    for name in TIME_COLUMNS:
        if name in columns:
            return name
    raise SystemExit(f"no time column ({' or '.join(TIME_COLUMNS)}) in {list(columns)}")


def key_columns(columns: Sequence[str]) -> List[str]:
    return [c for c in columns if not MEASURED.search(c)]


def as_time(value: Optional[str]) -> Optional[float]:
    try:
        t = float(value)
    except (TypeError, ValueError):
        return None
    return t if t > 0 else None


def commit_order(rows: List[Dict[str, str]]) -> Dict[str, tuple]:
    """A sort key per commit: its rows' date, then its commit time when this checkout's git
    knows it (runs are not always appended in commit order), then its first row in the file."""
    order: Dict[str, tuple] = {}
    for index, row in enumerate(rows):
        commit = row["commit"]
        if commit not in order:
            order[commit] = (row["date"], _commit_time(commit), index)
    return order


def _commit_time(commit: str) -> int:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", commit], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else 0


def compare(new_rows: List[Dict[str, str]], baseline: List[Dict[str, str]], keys: List[str],
            time: str, tolerance: float) -> Tuple[List[tuple], int]:
    """(report lines, number of regressions): each new row against the last baseline row of
    the same key that has a time (by commit order)."""
    order = commit_order(baseline)
    last: Dict[tuple, Dict[str, str]] = {}
    for row in sorted(baseline, key=lambda r: order[r["commit"]]):
        if as_time(row.get(time)) is not None:
            last[tuple(row.get(k, "") for k in keys)] = row
    lines, slower = [], 0
    for row in new_rows:
        key = tuple(row.get(k, "") for k in keys)
        new_t = as_time(row.get(time))
        if new_t is None:
            continue
        old = last.get(key)
        if old is None:
            lines.append((key, None, new_t, None, "new"))
            continue
        old_t = as_time(old[time])
        ratio = new_t / old_t
        verdict = "slower" if ratio > 1 + tolerance else (
            "faster" if ratio < 1 - tolerance else "within")
        slower += verdict == "slower"
        lines.append((key, old_t, new_t, ratio, f"{verdict} (vs {old['commit']})"))
    return lines, slower


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tsv", type=Path)
    ap.add_argument("--baseline", type=Path, help="rows to compare against (default: the rows "
                    "of TSV before its newest run)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="relative slow-down still counted as noise (default 0.05)")
    args = ap.parse_args(argv)

    columns, rows = read_rows(args.tsv)
    if args.baseline is not None:
        base_columns, baseline = read_rows(args.baseline)
        if base_columns != columns:
            raise SystemExit(f"{args.tsv} and {args.baseline} have different columns")
        new_rows = rows
    else:
        if not rows:
            raise SystemExit(f"{args.tsv}: no rows")
        order = commit_order(rows)
        newest = max(order, key=order.get)
        new_rows = [r for r in rows if r["commit"] == newest]
        baseline = [r for r in rows if order[r["commit"]] < order[newest]]
    keys = key_columns(columns)
    time = time_column(columns)
    lines, slower = compare(new_rows, baseline, keys, time, args.tolerance)
    shown = [k for k in keys if k != "gpu"]
    print("\t".join(shown + [f"last {time}", f"new {time}", "new / last", "verdict"]))
    for key, old_t, new_t, ratio, verdict in lines:
        settings = [v for k, v in zip(keys, key) if k != "gpu"]
        print("\t".join(settings + ["" if old_t is None else f"{old_t:g}", f"{new_t:g}",
                                    "" if ratio is None else f"{ratio:.3f}", verdict]))
    compared = sum(1 for line in lines if line[1] is not None)
    print(f"{compared} cases compared, {slower} slower than their last row by more than "
          f"{args.tolerance:.0%}, {len(lines) - compared} new", file=sys.stderr)
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
