"""Where a production prefill call's time goes, kernel by kernel (GPU diagnostic for issue 23, no
TSV; bench_prefill_production.py times the calls and writes the TSV).

Builds one input slot of each named case as bench_prefill_production.py does (paged caches,
random page table, the wrapper planned outside), runs the call once to warm up, then --iters
calls under torch.profiler and prints each kernel's mean device time per call, largest first,
with the call's mean wall time between CUDA events (profiler off). The short production chunks
(171-406 queries on 17.7k-140k keys) are launch- and latency-bound: this says which of the
indexer (with its key splits), the top-k, the CSR + schedule build, the attention and the
combine holds the time.

    python benchmarks/lab/profile_prefill.py                                  # the 3 slowest
    python benchmarks/lab/profile_prefill.py --cases prefill_092e2734 --dtypes bf16 --iters 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_msa, parse_names, split_dtype_name  # noqa: E402
from bench_prefill_production import SLOTS  # noqa: E402
from prefill_cases import load_cases, select_cases  # noqa: E402
from profiling import kernel_times, wall_ms  # noqa: E402

# The cases furthest below 4x dense at 5392cda (bf16 and e4m3): 182 / 17.7k, 2 x ~163 / 27k,
# 171 / 55k.
SLOWEST = "prefill_092e2734,prefill_9e55a33e,prefill_4469427d"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=SLOWEST)
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--impl", default="paged", help="a bench_prefill_production --impls name")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--top", type=int, default=25, help="kernels printed per call")
    args = ap.parse_args(argv)
    msa = load_msa()
    device = torch.device("cuda")
    slot_type = SLOTS.get(args.impl)
    if slot_type is None:
        raise SystemExit(f"--impl: unknown {args.impl!r}; known {sorted(SLOTS)}")
    for case in select_cases(load_cases(), args.cases):
        for dtype_name in parse_names(args.dtypes):
            dtype, partial_dtype = split_dtype_name(dtype_name)
            slot = slot_type(msa, case, args, dtype, partial_dtype, device)
            print(f"== {case.case_id} ({case.batch} requests, {case.total_q} queries, "
                  f"{case.max_kv} keys) {dtype_name} {args.impl}: chunks {slot.num_chunks}, "
                  f"index splits {slot.index_splits}")
            print(f"   {wall_ms(slot.run, args.iters) * 1e3:.1f} us a call (eager)")
            for us, count, name in kernel_times(slot.run, args.iters)[:args.top]:
                print(f"   {us:8.1f} us  x{count:<3d} {name[:100]}")
            del slot
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
