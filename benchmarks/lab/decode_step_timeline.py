"""Where a decode step's time goes under a CUDA graph: each kernel's device time and the gap
before it, from torch.profiler's trace of graph replays.

Not a benchmark (bench_decode_production.py times and writes TSV). For each case this builds
bench_decode_production's input slots of one implementation (e.g. step-fp8: plan update,
indexer, attention and its merge), captures --calls calls rotating over the slots in one
graph, replays it under the profiler and prints, per kernel position in a call, the median
device time, the median gap from the previous kernel's end (the first kernel: from the
previous call's last kernel), and the median call period. The gaps are what launch latency,
tails and ramps cost between dependent kernels.

    python benchmarks/lab/decode_step_timeline.py --batches 8,32 --kv 4000 --impls step-fp8

--indexer-ctas sweeps the step indexer's CTA budget (MSADecodeStepWrapper.plan's max_ctas: the
grid its chunk length is chosen for), each value's rows named step-fp8[ctasN].
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
from _common import forcing, load_msa, parse_names  # noqa: E402
from bench_decode_production import ATTENTION_FORMS, Impl, ragged_lengths  # noqa: E402


def kernel_spans(graph, replays: int):
    """[(name, start us, end us)] of every kernel the replays ran, in start order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA and not e.name.startswith("Mem")]
    return sorted(spans, key=lambda s: s[1])


def split_calls(spans, first: str):
    """The spans cut into calls at each kernel named `first`; only complete calls of the most
    common length are kept."""
    calls, current = [], None
    for span in spans:
        if span[0] == first:
            if current:
                calls.append(current)
            current = [span]
        elif current is not None:
            current.append(span)
    lengths = [len(c) for c in calls]
    if not lengths:
        return []
    common = statistics.mode(lengths)
    return [c for c in calls if len(c) == common]


def report(case: str, name: str, calls):
    print(f"== {case} {name}: {len(calls)} calls of {len(calls[0])} kernels")
    periods = [b[0][1] - a[0][1] for a, b in zip(calls, calls[1:])]
    busy = []
    for i in range(len(calls[0])):
        durations = [c[i][2] - c[i][1] for c in calls]
        if i:
            gaps = [c[i][1] - c[i - 1][2] for c in calls]
        else:
            gaps = [b[0][1] - a[-1][2] for a, b in zip(calls, calls[1:])]
        gap = statistics.median(gaps) if gaps else float("nan")
        busy.append(statistics.median(durations))
        print(f"  {statistics.median(durations):8.2f} us  gap before {gap:6.2f} us  "
              f"{calls[0][i][0][:100]}")
    if periods:
        period = statistics.median(periods)
        print(f"  period {period:.2f} us, kernels {sum(busy):.2f} us, "
              f"gaps {period - sum(busy):.2f} us")


@contextlib.contextmanager
def indexer_ctas(msa, ctas):
    """MSADecodeStepWrapper.plan with max_ctas=ctas where the caller names none (None: as is)."""
    cls = msa.MSADecodeStepWrapper
    plan = cls.plan
    if ctas is not None:
        def plan_with_ctas(self, *args, **kwargs):
            kwargs.setdefault("max_ctas", ctas)
            return plan(self, *args, **kwargs)
        cls.plan = plan_with_ctas
    try:
        yield
    finally:
        cls.plan = plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--kv", default="4000")
    ap.add_argument("--impls", default="step-fp8")
    ap.add_argument("--attention-forms", default="served")
    ap.add_argument("--seqlen-q", type=int, default=8)
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--indexer-ctas", default="auto",
                    help="the step indexer's CTA budgets, comma-separated (auto: the plan's)")
    ap.add_argument("--slots", type=int, default=4, help="input copies the calls rotate over")
    ap.add_argument("--calls", type=int, default=40, help="calls per captured graph")
    ap.add_argument("--replays", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    msa = load_msa()
    for batch in map(int, parse_names(args.batches)):
        for nominal in map(int, parse_names(args.kv)):
            lens = ragged_lengths(batch, nominal, args.seqlen_q)
            case = f"b{batch}_s{nominal}_q{args.seqlen_q}"
            for base in parse_names(args.impls):
                runs = [(form, ctas) for form in parse_names(args.attention_forms)
                        for ctas in (parse_names(args.indexer_ctas)
                                     if base.startswith("step") else ["auto"])]
                for form, ctas in runs:
                    impl = Impl(base, msa, lens, nominal, args, device)
                    budget = None if ctas == "auto" else int(ctas)
                    with forcing(msa, **ATTENTION_FORMS[form]), indexer_ctas(msa, budget):
                        slots = [impl.make_slot() for _ in range(args.slots)]
                        stream = torch.cuda.Stream(device)
                        stream.wait_stream(torch.cuda.current_stream(device))
                        with torch.cuda.stream(stream):
                            for slot in slots:
                                slot.call()
                        torch.cuda.current_stream(device).wait_stream(stream)
                        torch.cuda.synchronize(device)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            for i in range(args.calls):
                                slots[i % len(slots)].call()
                        graph.replay()
                        torch.cuda.synchronize(device)
                        spans = kernel_spans(graph, args.replays)
                    if not spans:
                        print(f"== {case} {base}: the profiler saw no kernels")
                        continue
                    calls = split_calls(spans, spans[0][0])
                    labels = [x for x in (form if form != "served" else "",
                                          f"ctas{ctas}" if ctas != "auto" else "") if x]
                    name = f"{base}[{','.join(labels)}]" if labels else base
                    report(case, name, calls)
                    del graph, slots
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
