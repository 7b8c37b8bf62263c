"""sparse_topk_select's lane-list kernels against the staged kernel (a warp per row; past 768
blocks too, where its CTAs are narrow) on the prefill chunks' shapes, the same bytes, the same
process (GPU diagnostic for issue 23, no TSV).

Per shape [4 heads, blocks, queries] of random fp32 scores with the prefill pipeline's bounds
(each query's own block forced last, the blocks past it ineligible): the median time of each
kernel (L2 flushed between calls), the bytes' floor at 4.26 TB/s, and whether the two outputs
are equal.

    python benchmarks/lab/topk_forms.py
    python benchmarks/lab/topk_forms.py --shapes 373:16384,1360:16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
from _common import forcing, load_msa  # noqa: E402

HEADS, TOPK = 4, 16


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes",
                    default="373:16384,660:16384,1360:16384,140:182,433:171,1028:347,1094:327,"
                            "212:8897",
                    help="blocks:queries (16k chunks on 47.7k / 84k / 174k keys, short chunks; "
                         "the staged side past 768 blocks where its CTAs are narrow)")
    ap.add_argument("--rep-ms", type=int, default=200)
    args = ap.parse_args(argv)
    import triton.testing
    msa = load_msa()
    print(f"# {torch.cuda.get_device_name()}")
    print("blocks\tqueries\tunstaged_us\tstaged_us\tfloor_us\tequal")
    for shape in args.shapes.split(","):
        blocks, queries = (int(x) for x in shape.split(":"))
        scores = torch.randn(HEADS, blocks, queries, device="cuda")
        own = (torch.arange(queries, device="cuda") + blocks * 128 - queries) // 128
        own = own.clamp(0, blocks - 1).to(torch.int32)
        pages = torch.full((queries,), blocks, dtype=torch.int32, device="cuda")

        def select():
            return msa.sparse_topk_select(scores, TOPK, pages, force_end_blocks=1,
                                          causal_end_block=own)
        times, outs = {}, {}
        for staged in (False, True):
            with forcing(msa, topk_staged=staged, topk_staged_wide=staged):
                outs[staged] = select().clone()
                times[staged] = triton.testing.do_bench(select, warmup=10, rep=args.rep_ms,
                                                        return_mode="median") * 1e3
        floor = scores.numel() * 4 / 4.26e12 * 1e6
        print(f"{blocks}\t{queries}\t{times[False]:.1f}\t{times[True]:.1f}\t{floor:.1f}\t"
              f"{bool(torch.equal(outs[False], outs[True]))}", flush=True)


if __name__ == "__main__":
    main()
