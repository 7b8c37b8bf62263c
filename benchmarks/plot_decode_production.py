"""Plot a bench_decode_production.py TSV: latency and speedup over cuDNN per case, one column per
batch size, one line per implementation (needs matplotlib; writes a PNG, no display).

    python benchmarks/plot_decode_production.py benchmarks/results/decode_production_h200.tsv \
        [--commit SHA] [--gpu NAME] [--out decode_production.png]

By default the rows of the file's last (gpu, commit) pair are plotted; the figure's title names
them and the weighted aggregate speedups when the TSV has them.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path


def read_rows(path: Path):
    with path.open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


def select(rows, gpu=None, commit=None):
    """Rows of one (gpu, commit): the given ones, else the file's last pair."""
    if not rows:
        raise SystemExit("the TSV has no rows")
    last = rows[-1]
    gpu = gpu or last["gpu"]
    commit = commit or [r["commit"] for r in rows if r["gpu"] == gpu][-1]
    chosen = [r for r in rows if r["gpu"] == gpu and r["commit"] == commit]
    if not chosen:
        raise SystemExit(f"no rows for gpu {gpu!r} and commit {commit!r}")
    return gpu, commit, chosen


def series(rows, suite):
    """{batch: {impl: [(nominal_kv, latency_us, speedup or None)]}} of one suite."""
    out = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["suite"] != suite or not r["latency_us"]:
            continue
        speedup = float(r["speedup_vs_cudnn"]) if r["speedup_vs_cudnn"] else None
        out[int(r["batch"])][r["impl"]].append((int(r["nominal_kv"]), float(r["latency_us"]),
                                                speedup))
    for per_impl in out.values():
        for points in per_impl.values():
            points.sort()
    return out


def plot(rows, gpu, commit, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = [s for s in ("production", "low-latency", "tiny") if any(r["suite"] == s
                                                                       for r in rows)]
    impls = sorted({r["impl"] for r in rows})
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}   # one color per impl everywhere
    columns = max(len(series(rows, s)) for s in suites)
    fig, axes = plt.subplots(2 * len(suites), columns, figsize=(4.2 * columns, 6.4 * len(suites)),
                             squeeze=False)
    for si, suite in enumerate(suites):
        data = series(rows, suite)
        for col, batch in enumerate(sorted(data)):
            lat_ax, spd_ax = axes[2 * si][col], axes[2 * si + 1][col]
            for impl, points in sorted(data[batch].items()):
                xs = [p[0] for p in points]
                lat_ax.plot(xs, [p[1] for p in points], marker="o", label=impl,
                            color=colors[impl])
                if impl != "cudnn" and any(p[2] for p in points):
                    spd_ax.plot([p[0] for p in points if p[2]], [p[2] for p in points if p[2]],
                                marker="o", label=impl, color=colors[impl])
            lat_ax.set_title(f"{suite}: B = {batch}")
            for ax in (lat_ax, spd_ax):
                ax.set_xscale("log")
                ax.grid(True, which="both", alpha=0.3)
                ax.set_xlabel("nominal KV length")
            lat_ax.set_yscale("log")
            lat_ax.set_ylabel("latency per step (us)")
            spd_ax.axhline(1.0, color="black", linewidth=0.8)
            spd_ax.set_ylabel("speedup over cuDNN dense")
        for col in range(len(data), columns):
            axes[2 * si][col].axis("off")
            axes[2 * si + 1][col].axis("off")
    axes[0][0].legend(fontsize=8)
    aggregate = [f"{r['impl']} {float(r['speedup_vs_cudnn']):.2f}x" for r in rows
                 if r["suite"] == "aggregate" and r["speedup_vs_cudnn"]]
    title = f"decode, {gpu}, commit {commit}"
    if aggregate:
        title += "\nweighted speedup over cuDNN:"
        for i in range(0, len(aggregate), 3):
            title += "\n" + ", ".join(aggregate[i:i + 3])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tsv", type=Path)
    ap.add_argument("--gpu", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=Path, default=None, help="default: the TSV's name, .png")
    args = ap.parse_args(argv)
    gpu, commit, rows = select(read_rows(args.tsv), args.gpu, args.commit)
    out = args.out or args.tsv.with_suffix(".png")
    plot(rows, gpu, commit, out)
    print(f"wrote {out} ({len(rows)} rows of {gpu} @ {commit})")


if __name__ == "__main__":
    main()
