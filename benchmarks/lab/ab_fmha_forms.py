"""Side-by-side timing of dense FMHA kernel forms in one process (a GPU diagnostic, no TSV).

bench_fmha.py times each call with a flushed L2 and writes TSV rows; this script answers the
quicker question "is form B faster than form A": for each problem, every form is timed over
--calls back-to-back calls (CUDA events), and the list of forms is timed forwards and then
backwards, so a drift in clocks shows up as a difference between the two numbers of one form
instead of as a difference between forms.

    python benchmarks/lab/ab_fmha_forms.py --forms wsutps,wsuts \\
        --problems 4096:32:8:1:fp8,8192:64:4:0:fp8

A problem is tokens:Hq:Hkv:causal:dtype (one request, q = kv; dtype bf16 or fp8). A form is
`served` or a name of cute_kernels.variants.FMHA_FORMS, run through the fmha_form debug hook
(forms the problem's dtype lacks are skipped; forms not yet validated run: the script opens
MSA_UNVALIDATED_KERNELS). Prints one line per problem: each form (the form that ran) and its
microseconds per call, forwards / backwards.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/_common.py
from _common import forcing, load_msa, ran_form  # noqa: E402

D = 128


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", required=True,
                    help="comma-separated: served or FMHA_FORMS names")
    ap.add_argument("--problems", required=True, help="tokens:Hq:Hkv:causal:dtype, comma-separated")
    ap.add_argument("--calls", type=int, default=40, help="back-to-back calls per timing")
    args = ap.parse_args(argv)
    os.environ.setdefault("MSA_UNVALIDATED_KERNELS", "1")
    msa = load_msa()
    table = import_module(f"{msa.__name__}.cute_kernels.variants").FMHA_FORMS
    forms = args.forms.split(",")
    dev = torch.device("cuda")
    for spec in args.problems.split(","):
        n, hq, hkv, causal, dtype = spec.split(":")
        n, hq, hkv, causal = int(n), int(hq), int(hkv), bool(int(causal))
        q = torch.randn(n, hq, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(n, hkv, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(n, hkv, D, device=dev, dtype=torch.bfloat16)
        if dtype == "fp8":
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        plan = msa.fmha_plan(torch.tensor([n]), torch.tensor([n]), hq, hkv, causal=causal,
                             device=dev)
        dtype_name = "e4m3" if dtype == "fp8" else "bfloat16"
        mine = [f for f in forms if f == "served" or (f in table and dtype_name in
                                                         table[f].dtypes)]
        times = {}
        for form in mine + mine[::-1]:
            with forcing(msa, fmha_form=form):
                msa.fmha(q, k, v, plan, output_maxscore=False)          # warm-up
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.calls):
                    msa.fmha(q, k, v, plan, output_maxscore=False)
                end.record()
                torch.cuda.synchronize()
            ran = ran_form(msa, "fmha_dense")
            times.setdefault(f"{form}[{ran}]", []).append(start.elapsed_time(end) / args.calls
                                                          * 1e3)
        cells = "  ".join(f"{name} {' / '.join(f'{t:.1f}' for t in ts)} us"
                          for name, ts in times.items())
        print(f"n={n} {hq}x{hkv} causal={int(causal)} {dtype}: {cells}", flush=True)


if __name__ == "__main__":
    main()
