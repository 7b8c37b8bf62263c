"""One dense FMHA call of a chosen form, repeated, for a profiler (ncu, nsys).

Not a benchmark (bench_fmha.py times and writes TSV); this only launches the kernel so that a
profiler wrapped around it can sample it. One warm-up call, then --iters calls, so
`ncu --launch-skip 1 --launch-count 1 -k regex:fmha` profiles a warm launch.

    ncu --set full -k regex:fmha --launch-skip 1 --launch-count 1 -o R \\
        python benchmarks/lab/profile_fmha.py --dtype fp8 --form wsuts --n 8192 --causal 0
    ncu --import R.ncu-rep --page source --print-source sass --csv   # stall samples per SASS
    python benchmarks/lab/profile_fmha.py --dtype fp8 --n 4k --heads 32x8 --causal 1 --iters 20 \
        --breakdown

Prints the variant and the mean time of the calls (profiler overhead included when wrapped).
With --breakdown it also prints each kernel's mean device time per call (torch.profiler: the
V transpose op, the FMHA, any torch launch of the call) and the host time per call (Python and
launches, measured with the GPU running behind), which shows when a short call is
host-bound. With --graph it times the call as bench_fmha does (triton's do_bench: L2 flushed before
each call, median) eagerly and as a CUDA-graph replay of one captured call: the difference is
what host work and launch gaps add to bench_fmha's number. With --timeline it prints, for calls
made after an L2 flush as bench_fmha makes them, each kernel's median start gap and cold-L2
duration (torch.profiler device timestamps).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/_common.py
from _common import flush_l2, forcing, load_msa, parse_sizes  # noqa: E402

D = 128


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--form", default="served",
                    help="served, or a form of cute_kernels.variants.FMHA_FORMS (the fmha_form "
                         "debug hook)")
    ap.add_argument("--n", default="8k", help="tokens (one request, q = kv)")
    ap.add_argument("--heads", default="64x4", help="Hq x Hkv")
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--breakdown", action="store_true",
                    help="also print per-kernel device time and host time per call")
    ap.add_argument("--graph", action="store_true",
                    help="also time the call eagerly and as a CUDA-graph replay (L2 flushed)")
    ap.add_argument("--timeline", action="store_true",
                    help="also print the device timeline of L2-flushed calls (gaps, kernels)")
    args = ap.parse_args(argv)
    os.environ.setdefault("MSA_UNVALIDATED_KERNELS", "1")   # unvalidated forms may be profiled
    msa = load_msa()
    if not hasattr(msa, "_native"):
        raise SystemExit("profile_fmha: this build has no native kernels")
    with forcing(msa, fmha_form=args.form):
        profile(msa, args)


def profile(msa, args):
    """The runs main() asks for, with the form hook set."""
    n = parse_sizes(args.n)[0]
    hq, hkv = (int(x) for x in args.heads.split("x"))
    dev = torch.device("cuda")
    q = torch.randn(n, hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(n, hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n, hkv, D, device=dev, dtype=torch.bfloat16)
    kw = {}
    if args.paged:
        pages = -(-n // 128)
        pad = pages * 128 - n
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)).view(pages, 128, hkv, D)
                .transpose(1, 2).contiguous() for t in (k, v))
        kw["kv_indices"] = torch.arange(pages, device=dev, dtype=torch.int32)
    if args.dtype == "fp8":
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    plan = msa.fmha_plan(torch.tensor([n]), torch.tensor([n]), hq, hkv, causal=bool(args.causal),
                         page_size=128 if args.paged else -1, device=dev)
    msa.fmha(q, k, v, plan, output_maxscore=False, **kw)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        msa.fmha(q, k, v, plan, output_maxscore=False, **kw)
    end.record()
    torch.cuda.synchronize()
    print(f"profile_fmha: {msa._native.debug.last_variant('fmha_dense')} "
          f"backend {msa._backend.last_backend('fmha_dense')}"
          f" n={n} heads={hq}x{hkv} causal={args.causal} paged={args.paged}: "
          f"{start.elapsed_time(end) / args.iters:.3f} ms per call")
    if args.breakdown:
        breakdown(lambda: msa.fmha(q, k, v, plan, output_maxscore=False, **kw), args.iters)
    if args.graph:
        eager_vs_graph(lambda: msa.fmha(q, k, v, plan, output_maxscore=False, **kw))
    if args.timeline:
        timeline(lambda: msa.fmha(q, k, v, plan, output_maxscore=False, **kw), args.iters)


def breakdown(call, iters: int) -> None:
    """Host microseconds per call, then each kernel's mean device microseconds per call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    host_us = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:70]] += event.device_time_total
    print(f"host {host_us:.1f} us per call (Python and launches: the calls are not waited for, "
          "so the GPU's time does not count while its launch queue has room)")
    for name, total in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"  {total / iters:9.1f} us per call  {name}")


def eager_vs_graph(call) -> None:
    """bench_fmha's timing (do_bench: L2 flushed before each call, median) of the call, then of
    a CUDA-graph replay of one captured call (no host work between the kernels)."""
    import triton.testing
    eager = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()                                   # warm-up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replay = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    print(f"flushed: eager {eager * 1e3:.1f} us, graph replay {replay * 1e3:.1f} us "
          f"(host and launch gaps {(eager - replay) * 1e3:.1f} us)")


def timeline(call, iters: int) -> None:
    """The device timeline of calls made as bench_fmha makes them (an L2 flush, then the call):
    per kernel of the call, the median gap from the end of the kernel before it (the flush for
    the first) to its start, and its median duration in a cold L2 (torch.profiler; us)."""
    for _ in range(3):
        flush_l2()
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush_l2()
            call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    # Split the stream into calls at each flush (the fill kernel's name has "fill" / "zero").
    calls, current = [], None
    for e in kernels:
        if "fill" in e.name.lower() or "zero" in e.name.lower():
            current = [e]
            calls.append(current)
        elif current is not None:
            current.append(e)
    rows = collections.defaultdict(lambda: ([], []))
    for seq in calls:
        for before, e in zip(seq, seq[1:]):
            gaps, durs = rows[e.name[:70]]
            gaps.append(e.time_range.start - before.time_range.end)
            durs.append(e.time_range.end - e.time_range.start)
    print(f"timeline of {len(calls)} L2-flushed calls (median us: gap before the kernel, "
          "duration)")
    for name, (gaps, durs) in rows.items():
        print(f"  gap {statistics.median(gaps):6.1f}  dur {statistics.median(durs):8.1f}  {name}")


if __name__ == "__main__":
    main()
