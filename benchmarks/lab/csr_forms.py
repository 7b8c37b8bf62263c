"""The k2q CSR + schedule build's two forms at short-chunk shapes (a GPU diagnostic for issue 23,
no TSV): the counting sort spread over several CTAs a KV head (csrc/build_k2q_csr.cu, small
calls) against the radix-sort build, each captured in a CUDA graph and replayed, then one replay under the profiler
for its kernels' times.

    MSA_PACKAGE_DIR=build/<variant> python3 benchmarks/lab/csr_forms.py [--replays 50]

msa._native.debug's csr_counting_sort hook picks the form (the counting sort only where the
sizes allow it). Selections are random block ids of each request, Hkv 4, top-16, G 16:
MiniMax-M3's short prefill chunks (upstream's representative cases) and larger ones up to the
counting sort's limits (a 16k-query chunk at 47.7k keys; 3584 queries at 140k keys).
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
from _common import load_msa  # noqa: E402

CASES = [([182], [17718]), ([171], [55339]), ([347], [131547]), ([170, 156], [13000, 27277]),
         ([140, 130, 136], [20000, 21000, 17723]), ([630], [32723]), ([1000], [60000]), ([2000], [40000]),
         ([3584], [140000]), ([16384], [47730])]


def make_call(msa, q_lens, k_lens, gen, hkv=4, topk=16):
    device = torch.device("cuda")

    def prefix(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                            device=device)
    q2k = torch.cat([torch.randint(0, -(-k // 128), (hkv, q, topk), dtype=torch.int32,
                                   generator=gen) for q, k in zip(q_lens, k_lens)], 1)
    return msa.interface._check_k2q_csr_args(
        q2k.to(device), prefix(q_lens), prefix(k_lens), 128, total_k=sum(k_lens),
        max_seqlen_k=max(k_lens), max_seqlen_q=max(q_lens), total_rows=None, qhead_per_kv=16,
        return_schedule=True)


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
    kernels = [(e.name.split("(")[0].split("::")[-1][:32], round(e.device_time, 1))
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return start.elapsed_time(end) / replays * 1e3, kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--max-queries", type=int, default=1 << 30,
                    help="only the cases of at most this many queries")
    args = ap.parse_args()
    msa = load_msa()
    csr_builder = import_module(f"{msa.__name__}._native.csr_builder")
    debug = import_module(f"{msa.__name__}._native.debug")
    gen = torch.Generator().manual_seed(1701)
    print(f"# {torch.cuda.get_device_name()}  msa from {msa.__file__}")
    for q_lens, k_lens in [c for c in CASES if sum(c[0]) <= args.max_queries]:
        call = make_call(msa, q_lens, k_lens, gen)
        for counting_sort in (True, False, True, False):        # forwards, then again
            with debug.forcing(csr_counting_sort=counting_sort):
                us, kernels = time_build(csr_builder, call, args.replays)
                form = debug.last_variant("build_k2q_csr")
            print(f"q {q_lens} kv {k_lens} {form}: {us:.1f} us a graph replay; kernels "
                  f"{kernels}", flush=True)

if __name__ == "__main__":
    main()
