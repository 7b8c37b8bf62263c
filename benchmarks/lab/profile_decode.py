"""One dense paged decode call (8 queries per request by default), or with ``--op indexer`` one
fused decode indexer + top-k call over an e4m3 / bf16 index-K cache, repeated, for a profiler.

Not a benchmark (bench_decode_production.py times and writes TSV): this builds one input slot
as benchmarks/lab/mtp_decode_via_fmha.py does (ragged lengths averaging --kv, shuffled pages)
and calls SparseDecodePagedAttentionWrapper.run once to warm up, then --iters times, so

    ncu --set full -k regex:decode_attention --launch-skip 1 --launch-count 1 -o R \\
        python benchmarks/lab/profile_decode.py --dtype bf16 --batch 32 --kv 100000
    ncu --import R.ncu-rep --page source --print-source sass --csv > R_sass.csv
    python tools/lab/ncu_stalls.py R_sass.csv

profiles a warm launch (``-k regex:decode_indexer`` for the indexer). Prints the mean time per call (profiler overhead included when wrapped).
``--kernels`` also prints each kernel's device time under torch.profiler (which of the plan
update, the indexer and its merge, or the attention and its combine a short call spends on).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/_common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_msa, random_fill  # noqa: E402
from mtp_decode_via_fmha import D, Slot, lengths  # noqa: E402
from profiling import kernel_times, wall_ms  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kv", type=int, default=100000)
    ap.add_argument("--seqlen-q", type=int, default=8)
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--op", choices=("attention", "indexer"), default="attention")
    ap.add_argument("--index-format", choices=("dtype", "nvfp4"), default="dtype",
                    help="--op indexer: index keys of --dtype, or NVFP4 (e4m3 index queries; "
                         "random E2M1 codes, E4M3 scales in [0.5, 2), linear scale layout)")
    ap.add_argument("--persistent", choices=("plan", "on", "off"), default="plan",
                    help="--op attention: the dense plan's persistent form as the plan "
                         "chooses, forced on, or off")
    ap.add_argument("--kernels", action="store_true",
                    help="print each kernel's mean device time (torch.profiler)")
    args = ap.parse_args(argv)
    msa = load_msa()
    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float8_e4m3fn
    lens = lengths(args.batch, args.kv, args.seqlen_q, torch.Generator().manual_seed(1234))
    if args.op == "indexer":
        return profile_indexer(msa, args, lens, dtype, device)
    slot = Slot(lens, args, dtype, device)
    wrapper = msa.SparseDecodePagedAttentionWrapper().plan(
        page_table=slot.page_table, seqused_k=slot.seqused_k, seqlen_q=args.seqlen_q,
        max_seqlen_k=max(lens), num_qo_heads=args.hq, num_kv_heads=args.hkv,
        persistent={"plan": None, "on": True, "off": False}[args.persistent])
    ms = time_calls(lambda: wrapper.run(slot.q, slot.k, slot.v, out=slot.out), args)
    print(f"profile_decode: {args.dtype} B={args.batch} kv~{args.kv} seqlen_q={args.seqlen_q} "
          f"heads={args.hq}x{args.hkv}: {ms:.3f} ms per call, "
          f"{slot.kv_bytes / ms / 1e9:.2f} TB/s over K/V")


def profile_indexer(msa, args, lens, dtype, device):
    """The step's indexer: Hkv index heads per query against one shared index-K head."""
    slot = Slot(lens, args, dtype, device)        # its page table; K/V unused
    pages = int(slot.k.shape[0])
    q_idx = random_fill([len(lens) * args.seqlen_q, args.hkv, D], dtype, device)
    nvfp4 = args.index_format == "nvfp4"
    k_scale = None
    if nvfp4:
        if dtype != torch.float8_e4m3fn:
            raise SystemExit("--index-format nvfp4 takes --dtype fp8 (e4m3 index queries)")
        k_idx = torch.randint(0, 256, (pages, 1, 128, D // 2), dtype=torch.uint8, device=device)
        # E4M3 codes 0x30 .. 0x3F: 0.5 .. 1.875 (finite, nonzero).
        k_scale = torch.randint(0x30, 0x40, (pages, 1, 128, D // 16), dtype=torch.uint8,
                                device=device)
    else:
        k_idx = random_fill([pages, 1, 128, D], dtype, device)
    plan = msa.make_decode_indexer_plan(slot.seqused_k, seqlen_q=args.seqlen_q,
                                        num_index_heads=args.hkv, max_seqlen_k=max(lens))

    def call():
        plan.update()
        msa.decode_indexer_topk(q_idx, k_idx, plan=plan, page_table=slot.page_table,
                                k_scale=k_scale, k_scale_layout="linear")

    ms = time_calls(call, args)
    index_bytes = sum(lens) * (D // 2 + D // 16 if nvfp4 else D * dtype.itemsize)
    print(f"profile_decode indexer: {'nvfp4' if nvfp4 else args.dtype} B={args.batch} kv~{args.kv} "
          f"seqlen_q={args.seqlen_q} index heads={args.hkv}: {ms * 1e3:.1f} us per call "
          f"(plan update included), {index_bytes / ms / 1e9:.2f} TB/s over the index keys")


def time_calls(call, args):
    """Mean ms per call over --iters calls after one warm-up; with --kernels, then the mean
    device time of each kernel over another --iters calls."""
    ms = wall_ms(call, args.iters)
    if args.kernels:
        for us, count, name in kernel_times(call, args.iters):
            print(f"  kernel {us:9.1f} us per call  x{count}  {name[:90]}")
    return ms


if __name__ == "__main__":
    main()
