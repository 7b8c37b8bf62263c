"""Plot bench_prefill_production.py's TSV: per case, the pipeline's speed-up over dense SDPA
against the chunk's queries (total_q) and against its KV length, one series per impl and dtype,
marker area by production weight, the 4x line and each series' weighted speed-up in the legend.

    python benchmarks/plot_prefill_production.py benchmarks/results/prefill_production_h200.tsv \
        [--out PNG] [--commit SHA[:DTYPE] ...]

Rows of one run are plotted: the given commit, else the last (commit, date) in the file; with
several --commit SHA:DTYPE, each run's rows of that dtype (e.g. the newest bf16 and e4m3 runs).
matplotlib is needed only to draw (imported when drawing).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def load_run(path: Path, commit: Optional[str] = None,
             dtype: Optional[str] = None) -> Tuple[str, List[dict], Dict[str, dict]]:
    """(run label, per-case rows with a speed-up, {series: weighted row}) of one run (its
    rows of `dtype` only when given)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    if commit is None:
        commit = rows[-1]["commit"]
    date = next((r["date"] for r in reversed(rows) if r["commit"] == commit), None)
    if date is None:
        raise SystemExit(f"{path}: no rows of commit {commit}")
    run = [r for r in rows if r["commit"] == commit and r["date"] == date
           and (dtype is None or r["dtype"] == dtype)]
    # A case measured twice in one run (a quick suite before the full one) counts once: the
    # last row, as the last weighted row of a series is the one drawn.
    cases = list({(r["case"], series_name(r)): r for r in run
                  if r["case"] != "weighted" and r["speedup"]}.values())
    weighted = {series_name(r): r for r in run if r["case"] == "weighted"}
    gpu = run[-1]["gpu"]
    return f"{gpu}, {commit}{f' {dtype}' if dtype else ''}, {date}", cases, weighted


def series_name(row: dict) -> str:
    """A series per implementation and dtype: "paged bf16", "dense fp8", ..."""
    return f"{row['impl'].replace('msa_prefill_', '')} {row['dtype']}"


def series(cases: List[dict]) -> Dict[str, Dict[str, list]]:
    """{series: {total_q, max_kv, speedup, weight}} lists in row order."""
    out: Dict[str, Dict[str, list]] = {}
    for r in cases:
        s = out.setdefault(series_name(r), {"total_q": [], "max_kv": [], "speedup": [],
                                            "weight": []})
        s["total_q"].append(int(r["total_q"]))
        s["max_kv"].append(int(r["max_kv"]))
        s["speedup"].append(float(r["speedup"]))
        s["weight"].append(int(r["weight"]))
    return out


def draw(label: str, cases: List[dict], weighted: Dict[str, dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(cases)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, key, xlabel in ((axes[0], "total_q", "queries of the call (total_q)"),
                            (axes[1], "max_kv", "KV length (max over requests)")):
        for name, s in data.items():
            w = weighted.get(name, {})
            if w.get("speedup"):
                name += f" (weighted {float(w['speedup']):.1f}x)"
            sizes = [12 + 120 * (x / max(s["weight"])) ** 0.5 for x in s["weight"]]
            ax.scatter(s[key], s["speedup"], s=sizes, alpha=0.6, label=name)
        ax.axhline(4.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speed-up over dense SDPA (lower-right causal)")
    axes[0].legend(title="marker area ~ production weight", fontsize=8)
    n_cases = len({r["case"] for r in cases})
    fig.suptitle(f"MSA prefill vs dense on {n_cases} production cases\n{label}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tsv", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="PNG (default: next to the TSV)")
    ap.add_argument("--commit", action="append", default=None,
                    help="SHA or SHA:DTYPE (repeatable: one run's rows of a dtype each)")
    args = ap.parse_args(argv)
    labels, cases, weighted = [], [], {}
    for spec in args.commit or [None]:
        commit, _, dtype = (spec or "").partition(":")
        label, run_cases, run_weighted = load_run(args.tsv, commit or None, dtype or None)
        labels.append(label)
        cases += run_cases
        weighted.update(run_weighted)
    label = "\n".join(labels)
    if not cases:
        raise SystemExit(f"{args.tsv}: the run has no case with a dense speed-up")
    draw(label, cases, weighted, args.out or args.tsv.with_suffix(".png"))


if __name__ == "__main__":
    main()
