"""The sparse prefill combine's forms at production call sizes (a GPU diagnostic for issue 23,
no TSV): the packaged combine against other builds of it, same process, same partials.

    MSA_PACKAGE_DIR=build/<variant> python3 benchmarks/lab/combine_forms.py \
        [--alt NAME=ARTIFACTS_DIR ...] [--partials bfloat16,e4m3]

An alternative is a tools/compile_cute.py output folder holding sparse_combine_sm90_p<dtype>
(e.g. the kernel of an earlier commit, or another UNROLL); it is loaded from its .so beside the
packaged one. Partials: Hq 64, Hkv 4, top-16 slots, every (query, KV head) with 16 entries,
random O rows and LSEs, so the combine reads topK x total_q x Hq x 128 partial values; each call
is timed after an L2 flush (the attention's partials of a production call do not stay in L2:
ncu put the combine's L2 hit rate at 9 % at 182 queries), median of do_bench. Each form's output
is checked against the packaged one's.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import import_module
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
from _common import load_msa, time_ms  # noqa: E402

QUERIES = (182, 347, 1000, 2000, 4096, 16384)
DTYPES = {"bfloat16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def load_alternative(cute_runtime, folder: Path, name: str):
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["variants"][name]
    return cute_runtime.load_binary(folder / entry["file"], entry.get("function", name))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alt", action="append", default=[], help="NAME=ARTIFACTS_DIR")
    ap.add_argument("--partials", default="bfloat16,e4m3")
    ap.add_argument("--queries", default=",".join(map(str, QUERIES)))
    ap.add_argument("--rep-ms", type=int, default=100)
    args = ap.parse_args()
    msa = load_msa()
    cute_runtime = import_module(f"{msa.__name__}._native.cute_runtime")
    variants = import_module(f"{msa.__name__}.cute_kernels.variants")
    device = torch.device("cuda")
    stream = lambda: torch.cuda.current_stream(device).cuda_stream  # noqa: E731
    gen = torch.Generator(device=device).manual_seed(1701)
    print(f"# {torch.cuda.get_device_name()}  msa from {msa.__file__}")
    hq, hkv, topk = 64, 4, 16
    for partial in args.partials.split(","):
        name = variants.CombineVariant(partial).name
        forms = {"packaged": cute_runtime.get_function(name)}
        for alt in args.alt:
            label, folder = alt.split("=", 1)
            forms[label] = load_alternative(cute_runtime, Path(folder), name)
        for total_q in map(int, args.queries.split(",")):
            o_partial = torch.randn(topk, total_q, hq, 128, generator=gen, device=device)
            o_partial = o_partial.to(DTYPES[partial])
            lse = torch.randn(topk, total_q, hq, generator=gen, device=device) * 3 + 5
            counts = torch.full((total_q, hkv), topk, dtype=torch.int32, device=device)
            outs = {}
            times = {label: [] for label in forms}
            for _ in range(2):                          # forms in turn, twice
                for label, fn in forms.items():
                    out = torch.full((total_q, hq, 128), float("nan"), dtype=torch.bfloat16,
                                     device=device)
                    out_lse = torch.empty(total_q, hq, device=device)
                    call = lambda: fn(o_partial, lse, lse, counts, out, out_lse,  # noqa: E731
                                      out_lse, 0, stream())
                    times[label].append(time_ms(call, device, rep_ms=args.rep_ms) * 1e3)
                    outs[label] = out
            gbytes = o_partial.numel() * o_partial.element_size() / 1e9
            ref = outs["packaged"].float()
            line = []
            for label in forms:
                us = min(times[label])
                diff = (outs[label].float() - ref).abs().max().item()
                line.append(f"{label} {us:.1f} us ({gbytes / us * 1e3:.2f} TB/s, "
                            f"max|d| {diff:.2g})")
            print(f"p{partial} q {total_q} ({gbytes * 1e3:.0f} MB): " + "; ".join(line),
                  flush=True)


if __name__ == "__main__":
    main()
