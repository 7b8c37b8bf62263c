"""The main job: one MSA prefill on a synthetic long sequence, on the best backend available.

indexer (block max-scores) -> top-k with the own block forced -> k2q CSR -> block-sparse attention,
through ``msa.msa_prefill``. Prints the backend of every stage, the shapes, the time, the error
against dense causal attention (MSA is an approximation: on random data attention is diffuse, so
this error is large by nature) and the error against dense attention restricted to the selected
blocks (the kernels' exactness: bf16 rounding only).

    python tools/msa_prefill_demo.py             # CUDA if present (M3 shapes, 32k), else CPU
    python tools/msa_prefill_demo.py --n 4096 --hq 16 --hkv 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_msa():
    sys.path.insert(0, str(ROOT / "tools"))
    from msa_loading import load_msa as load
    return load()


def dense_reference(q, k, v, rows, *, scale, selection=None):
    """float32 causal attention for the query positions `rows` of one sequence; with
    `selection` [Hkv, N, topK], only keys in the selected blocks are visible."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kk = k.float().repeat_interleave(g, 1).transpose(0, 1)            # [Hq, N, D]
    vv = v.float().repeat_interleave(g, 1).transpose(0, 1)
    s = torch.einsum("rhd,hnd->hrn", q[rows].float(), kk) * scale     # [Hq, R, N]
    keys = torch.arange(n, device=q.device)
    mask = keys.view(1, 1, -1) <= rows.view(1, -1, 1)
    if selection is not None:
        nblk = -(-n // 128)
        sel = torch.zeros(hkv, rows.numel(), nblk + 1, dtype=torch.bool, device=q.device)
        picked = selection[:, rows].long()
        sel.scatter_(2, torch.where(picked >= 0, picked, nblk), True)
        mask = mask & sel[:, :, keys // 128].repeat_interleave(g, 0)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hrn,hnd->rhd", torch.softmax(s, -1), vv)


def main():
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=32768 if cuda else 4096, help="sequence length")
    ap.add_argument("--hq", type=int, default=64 if cuda else 16)
    ap.add_argument("--hkv", type=int, default=4 if cuda else 2)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--check-rows", type=int, default=256, help="queries compared to dense")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    args = ap.parse_args()

    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    msa = load_msa()
    dev = torch.device(args.device)
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    n, hq, hkv, d = args.n, args.hq, args.hkv, 128
    g = hq // hkv
    q = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(n, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n, hkv, d, device=dev, dtype=torch.bfloat16)
    # Index branch: one index head per KV group, one shared index key (as in MiniMax-M3).
    q_idx = q.view(n, hkv, g, d).float().mean(2).bfloat16().contiguous()
    k_idx = k.float().mean(1, keepdim=True).bfloat16().contiguous()
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    scale = d ** -0.5

    def run():
        return msa.msa_prefill(q, k, v, q_idx, k_idx, cu, cu, max_seqlen_q=n, max_seqlen_k=n,
                               topk=args.topk, softmax_scale=scale, index_scale=scale,
                               return_selection=True)

    run()                                     # warm-up: loads kernels, logs backends
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, selection = run()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    rows = torch.linspace(0, n - 1, min(args.check_rows, n), device=dev).long()
    dense = dense_reference(q, k, v, rows, scale=scale)
    restricted = dense_reference(q, k, v, rows, scale=scale, selection=selection)
    o = out[rows].float()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    stages = ["block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten"]
    print(f"device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}")
    print("backends: " + ", ".join(f"{s}={msa._backend.last_backend(s)}" for s in stages))
    print(f"shapes: q [{n}, {hq}, {d}], k/v [{n}, {hkv}, {d}], q_idx [{n}, {hkv}, {d}], "
          f"k_idx [{n}, 1, {d}], topK {args.topk}, selection {list(selection.shape)}")
    print(f"time: {elapsed * 1e3:.1f} ms for the whole prefill")
    print(f"relative error vs dense causal attention (sparsity approximation): {rel(o, dense):.3f}")
    print(f"relative error vs dense attention over the selected blocks (exactness): "
          f"{rel(o, restricted):.2e}")
    if rel(o, restricted) > 2e-2:
        raise SystemExit("FAILED: the sparse output does not match attention over its selection")


if __name__ == "__main__":
    main()
