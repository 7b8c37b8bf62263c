"""A/B of the k2q CSR + schedule builds at production short-chunk shapes (a GPU diagnostic, no
TSV): the multi-kernel build against the one-CTA build (csrc/build_k2q_csr.cu), each captured in
a CUDA graph and replayed, then one replay under the profiler for its kernels' times.

    MSA_PACKAGE_DIR=build/<variant> python3 benchmarks/lab/ab_csr_build.py [--replays 50]

Selections are random block ids of each request (every block may be picked), Hkv 4, top-16,
G 16: the shapes of MiniMax-M3's short prefill chunks (upstream's representative cases).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/_common.py
from _common import load_msa  # noqa: E402

CASES = [([182], [17718]), ([171], [55339]), ([347], [131547]), ([170, 156], [13000, 27277]),
         ([140, 130, 136], [20000, 21000, 17723])]


def make_call(msa, q_lens, k_lens, hkv=4, topk=16, gen=None):
    device = torch.device("cuda")

    def prefix(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                            device=device)
    blocks = max(k_lens) // 128 + 1
    q2k = torch.randint(0, blocks, (hkv, sum(q_lens), topk), dtype=torch.int32,
                        generator=gen).to(device)
    return msa.interface._check_k2q_csr_args(
        q2k, prefix(q_lens), prefix(k_lens), 128, total_k=sum(k_lens), max_seqlen_k=max(k_lens),
        max_seqlen_q=max(q_lens), qhead_per_kv=16, return_schedule=True)


def time_build(csr_builder, call, replays):
    for _ in range(3):
        csr_builder.run(call)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        csr_builder.run(call)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.name.split("(")[0].split("::")[-1][:40], round(e.device_time, 1))
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return start.elapsed_time(end) / replays * 1e3, kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    msa = load_msa()
    csr_builder = import_module(f"{msa.__name__}._native.csr_builder")
    gen = torch.Generator().manual_seed(1701)
    for q_lens, k_lens in CASES:
        call = make_call(msa, q_lens, k_lens, gen=gen)
        for one_cta in (False, True, False, True):   # forwards, then again
            csr_builder.ONE_CTA_VALIDATED = one_cta
            os.environ["MSA_UNVALIDATED_KERNELS"] = "1" if one_cta else "0"
            us, kernels = time_build(csr_builder, call, args.replays)
            print(f"q {q_lens} kv {k_lens} {'one-CTA' if one_cta else 'multi-kernel'}: "
                  f"{us:.1f} us a graph replay; kernels {kernels}")


if __name__ == "__main__":
    main()
