"""Would the dense FMHA kernel serve multi-token-prediction decode at the HBM limit? (GPU
diagnostic, no TSV.)

Decode with 8 queries per request at G = 16 gives each KV head 8 x 16 = 128 query rows: the
shape of one FMHA query tile. This script folds them that way (row t * G + g of KV head h is
token t's query head h * G + g, so "head" h of the folded q has 128 rows and G = 1) and times,
on the same paged K/V bytes in one process:

  decode    SparseDecodePagedAttentionWrapper (dense, its served form for tiles of > 16 rows:
            the warpgroup form for bf16; --decode-form warpgroup forces it for e4m3 too)
  fmha      msa.fmha on the folded q: non-causal over every key (the upper bound of a decode
            path built on the FMHA kernel: the last seqlen_q keys' causal mask is left out),
            paged K/V through kv_indices, the planner's KV splits
  cudnn     SDPA's cuDNN backend on the same folded q against dense [B, Hkv, L, D] K/V (the
            decode benchmarks' peer; bf16 only)

Each is one CUDA graph of back-to-back calls over input slots that rotate more than 2x the L2
(the decode wrapper's and the FMHA's K/V pools are one pool, read through each slot's own page
table). Prints microseconds per call and TB/s over the K/V bytes (+ q).

    python benchmarks/lab/mtp_decode_via_fmha.py --batches 8,32,128 --kv 4000,50000,100000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/_common.py
from _common import (forcing, free_memory, graph_us, load_msa, parse_names,  # noqa: E402
                     random_fill)

D, PAGE = 128, 128


def lengths(batch: int, nominal: int, seqlen_q: int, gen: torch.Generator):
    """Ragged lengths averaging `nominal` (pairs nominal +- d, d up to nominal / 4)."""
    deltas = torch.randint(0, max(nominal // 4, 1) + 1, (batch // 2,), generator=gen).tolist()
    lens = [nominal - d for d in deltas] + [nominal + d for d in deltas] + [nominal] * (batch % 2)
    return [max(n, seqlen_q) for n in lens]


class Slot:
    """One copy of a step's inputs: its own pages of the pool, page table, q (token-major and
    folded)."""

    def __init__(self, lens, args, dtype, device):
        self.lens = lens
        pages = [-(-n // PAGE) for n in lens]
        total = sum(pages)
        self.k = random_fill([total, args.hkv, PAGE, D], dtype, device)
        self.v = random_fill([total, args.hkv, PAGE, D], dtype, device)
        perm = torch.randperm(total, device=device).to(torch.int32)
        self.kv_indices = perm                                   # request after request
        self.page_table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=device)
        start = 0
        for b, n in enumerate(pages):
            self.page_table[b, :n] = perm[start:start + n]
            start += n
        self.seqused_k = torch.tensor(lens, dtype=torch.int32, device=device)
        hq, sq, group = args.hq, args.seqlen_q, args.hq // args.hkv
        self.q = random_fill([len(lens) * sq, hq, D], dtype, device)
        # Folded: [B * sq * G, Hkv, D], row (b, t, g) of head h = token t's head h * G + g.
        self.q_folded = (self.q.view(len(lens), sq, args.hkv, group, D).permute(0, 1, 3, 2, 4)
                         .reshape(len(lens) * sq * group, args.hkv, D).contiguous())
        self.out = torch.empty(self.q.shape, dtype=torch.bfloat16, device=device)
        self.out_folded = torch.empty(self.q_folded.shape, dtype=torch.bfloat16, device=device)
        self.kv_bytes = 2 * sum(lens) * args.hkv * D * dtype.itemsize
        self.q_bytes = self.q.numel() * dtype.itemsize


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--kv", default="4000,50000,100000")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--seqlen-q", type=int, default=8)
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--mem-gb", type=float, default=60.0, help="K/V bytes of all slots")
    ap.add_argument("--decode-form", default="served", choices=("served", "warpgroup"))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    msa = load_msa()
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    gen = torch.Generator().manual_seed(1234)
    print("dtype\tB\tkv\tslots\tdecode_us\tdecode_TB/s\tfmha_us\tfmha_TB/s\tcudnn_us\t"
          "cudnn_TB/s\tfmha/decode\tfmha/cudnn", flush=True)
    for dtype_name in parse_names(args.dtypes):
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float8_e4m3fn
        for batch in map(int, parse_names(args.batches)):
            for nominal in map(int, parse_names(args.kv)):
                lens = lengths(batch, nominal, args.seqlen_q, gen)
                kv_bytes = 2 * sum(lens) * args.hkv * D * dtype.itemsize
                want = 1 if kv_bytes > 2 * l2 else 2 * l2 // kv_bytes + 2
                fit = max(1, int(args.mem_gb * 1e9 // kv_bytes))
                if kv_bytes > args.mem_gb * 1e9:
                    print(f"{dtype_name}\t{batch}\t{nominal}\tskipped: {kv_bytes / 1e9:.1f} GB")
                    continue
                slots = [Slot(lens, args, dtype, device) for _ in range(min(want, fit))]
                row = [dtype_name, batch, nominal, len(slots)]
                bytes_per_call = slots[0].kv_bytes + slots[0].q_bytes

                wrappers = [msa.SparseDecodePagedAttentionWrapper().plan(
                    page_table=s.page_table, seqused_k=s.seqused_k, seqlen_q=args.seqlen_q,
                    max_seqlen_k=max(lens), num_qo_heads=args.hq, num_kv_heads=args.hkv,
                    enable_cuda_graph=True) for s in slots]
                decode_calls = [lambda s=s, w=w: w.run(s.q, s.k, s.v, out=s.out)
                                for s, w in zip(slots, wrappers)]
                hooks = {} if args.decode_form == "served" else {"decode_warpgroup": True}
                with forcing(msa, **hooks):
                    decode = graph_us(decode_calls, device, args.replays)

                plan = msa.fmha_plan(torch.tensor([args.seqlen_q * args.hq // args.hkv] * batch),
                                     torch.tensor(lens), args.hkv, args.hkv, causal=False,
                                     page_size=PAGE, device=device)
                fmha_calls = [lambda s=s: msa.fmha(s.q_folded, s.k, s.v, plan,
                                                   kv_indices=s.kv_indices, out=s.out_folded)
                              for s in slots]
                fmha = graph_us(fmha_calls, device, args.replays)

                cudnn = None
                if dtype == torch.bfloat16 and 2 * batch * args.hkv * nominal * D * 2 * 1.3 * \
                        len(slots) < args.mem_gb * 1e9:
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    group = args.hq // args.hkv
                    dense = []
                    for s in slots:
                        k = torch.randn(batch, args.hkv, nominal, D, device=device, dtype=dtype)
                        v = torch.randn_like(k)
                        q = s.q_folded.view(batch, args.seqlen_q * group, args.hkv, D) \
                            .transpose(1, 2).contiguous()
                        dense.append((q, k, v))

                    def sdpa(q, k, v):
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
                    try:
                        cudnn = graph_us([lambda t=t: sdpa(*t) for t in dense], device,
                                         args.replays)
                    except RuntimeError as exc:
                        print(f"cudnn: {str(exc).splitlines()[0]}", file=sys.stderr)
                    del dense
                tbs = lambda us: bytes_per_call / us / 1e6  # noqa: E731
                row += [f"{decode:.1f}", f"{tbs(decode):.2f}", f"{fmha:.1f}", f"{tbs(fmha):.2f}",
                        "" if cudnn is None else f"{cudnn:.1f}",
                        "" if cudnn is None else f"{tbs(cudnn):.2f}",
                        f"{decode / fmha:.2f}", "" if cudnn is None else f"{cudnn / fmha:.2f}"]
                print("\t".join(map(str, row)), flush=True)
                del slots, wrappers, decode_calls, fmha_calls
                free_memory(device)


if __name__ == "__main__":
    main()
