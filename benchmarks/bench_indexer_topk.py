"""The MSA indexer (``msa.block_max_scores``) and ``msa.sparse_topk_select`` against naive torch.

indexer  H_idx=4 index-query heads x 128 against one shared index-K head (M3), causal, N tokens
         per sequence (single sequences and a varlen batch). TFLOP/s = 2 * H_idx * 128 *
         (causally visible query-key pairs) / time. Peer: the naive torch indexer (einsum into a
         [H_idx, N, N] score matrix, causal mask, 128-block max), run only where its estimated
         memory fits (--mem-limit-gb; a note says when it is skipped).
topk     rows = H_idx * N, cols = N/128 fp32 scores (-inf past each query's own block), topk 16
         with the query's own block forced (force_end_blocks=1 through causal_end_block), against
         torch.topk over the same values laid out contiguous as [H_idx * N, N/128].

--tiers hopper,portable times the package's kernels once per native tier: what the GPU's family
serves, and the portable tier (csrc warp-MMA kernels, MSA_NATIVE_TIER=portable, its gate
opened) where it serves the call; the backend column says which ran.

Peers are measured in the same run. Timing: triton.testing.do_bench median on CUDA,
time.perf_counter on the CPU (--device cpu --tiny is the CI smoke mode).

    python benchmarks/bench_indexer_topk.py --out benchmarks/results/indexer_topk_h200.tsv
"""

from __future__ import annotations

import argparse

import torch

from _common import (BLOCK, HEAD_DIM, add_common_args, apply_preset, cu_seqlens, dtype_of, fits,
                     free_memory, load_msa, native_tier, parse_names, parse_sizes,
                     random_fill, reference_too_slow, setup, synchronize, tier_backend, time_ms,
                     TsvWriter)

COLUMNS = ("op", "case", "lengths", "dtype", "impl", "backend", "latency_ms", "tflops",
           "speedup_vs_torch", "note")


def visible_pairs(lengths) -> int:
    """Causal (query, key) pairs of self-attention sequences: n (n + 1) / 2 each."""
    return sum(n * (n + 1) // 2 for n in lengths)


def naive_indexer_bytes(n: int, num_heads: int) -> int:
    """Peak bytes of naive_indexer on one sequence: the bf16 score matrix, the bool mask, the
    fp32 output (with 10% slack)."""
    tiles = -(-n // BLOCK)
    scores = num_heads * n * tiles * BLOCK * 2
    mask = n * tiles * BLOCK
    out = 2 * num_heads * tiles * n * 4
    return int(1.1 * (scores + mask + out))


def naive_indexer(q_idx: torch.Tensor, k_idx: torch.Tensor, scale: float) -> torch.Tensor:
    """The textbook indexer for one sequence: q_idx [n, H, 128], k_idx [n, 1, 128] ->
    [H, ceil(n/128), n] fp32 block max of scale * q.k over causally visible keys (-inf where
    none). Materializes the [H, n, n] score matrix (bf16), which is why it runs out of memory."""
    n, num_heads, _ = q_idx.shape
    tiles = -(-n // BLOCK)
    keys = torch.nn.functional.pad(k_idx[:, 0], (0, 0, 0, tiles * BLOCK - n))
    # Scale the queries, not the scores: one [H, n, n] matrix alive at a time.
    queries = q_idx * scale if scale != 1.0 else q_idx
    scores = torch.einsum("qhd,kd->hqk", queries, keys)
    pos = torch.arange(tiles * BLOCK, device=q_idx.device)
    scores.masked_fill_(pos.view(1, 1, -1) > pos[:n].view(1, -1, 1), float("-inf"))
    return scores.view(num_heads, n, tiles, BLOCK).amax(-1).float().transpose(1, 2)


def bench_indexer(msa, args, device, tsv: TsvWriter, cases):
    """Per case: the naive torch indexer (bf16 inputs, where it fits), then msa per dtype."""
    def block_max(q_idx, k_idx, lens, cu):
        return msa.block_max_scores(q_idx, k_idx, cu, cu, max_seqlen_q=max(lens),
                                    max_seqlen_k=max(lens), scale=args.scale, causal=True)

    backends = {}
    runs = []          # (dtype, tier) pairs whose tier serves the dtype
    for dtype_name in parse_names(args.dtypes):
        small = [4 * BLOCK]
        q_small, k_small = (random_fill([small[0], heads, HEAD_DIM], dtype_of(dtype_name), device)
                            for heads in (args.h_idx, 1))
        for tier in parse_names(args.tiers):
            backend = tier_backend(msa, "block_max_scores",
                                   lambda: block_max(q_small, k_small, small,
                                                     cu_seqlens(small, device)),
                                   tier, f"msa indexer {dtype_name}")
            if backend is not None:
                backends[dtype_name, tier] = backend
                runs.append((dtype_name, tier))
    for case, lens in cases:
        row = dict(op="indexer", case=case, lengths=lens)
        cu = cu_seqlens(lens, device)   # made once: no host-to-device copy inside the timing
        flops = 2 * args.h_idx * HEAD_DIM * visible_pairs(lens)
        q_idx = random_fill([sum(lens), args.h_idx, HEAD_DIM], torch.bfloat16, device)
        k_idx = random_fill([sum(lens), 1, HEAD_DIM], torch.bfloat16, device)
        naive_ms, check = None, None
        if "torch" in args.peers:
            naive_ms, check = _bench_naive(q_idx, k_idx, lens, flops, row, args, device, tsv)
        for dtype_name, tier in runs:
            if reference_too_slow(backends[dtype_name, tier], sum(lens), device, args,
                                  f"msa indexer {case} {lens} {dtype_name}"):
                continue
            dtype = dtype_of(dtype_name)
            q_cast, k_cast = q_idx.to(dtype), k_idx.to(dtype)
            with native_tier(tier):
                scores = block_max(q_cast, k_cast, lens, cu)
                backend = msa._backend.last_backend("block_max_scores")
                # Sanity check against the naive scores (bf16 inputs only: fp8 rounds them).
                note = check(scores) if check is not None and dtype == torch.bfloat16 else None
                del scores
                ms = time_ms(lambda: block_max(q_cast, k_cast, lens, cu), device, args.rep_ms)
            tsv.write(**row, dtype=dtype_name, impl="msa.block_max_scores", backend=backend,
                      latency_ms=ms, tflops=flops / ms / 1e9,
                      speedup_vs_torch=naive_ms / ms if naive_ms else None, note=note)
        del q_idx, k_idx, check
        free_memory(device)


def _bench_naive(q_idx, k_idx, lens, flops, row, args, device, tsv):
    """Time the naive indexer over every sequence of the case; returns (ms, check) where
    check(scores) compares msa's scores with the naive ones, or (None, None) when it would not
    fit in memory."""
    need = naive_indexer_bytes(max(lens), args.h_idx)
    if not fits(need, args, f"naive torch indexer {row['case']} {lens}"):
        tsv.write(**row, dtype="bf16", impl="torch_naive_indexer", backend="torch",
                  note=f"skipped: needs ~{need / 1e9:.1f} GB")
        return None, None
    offsets = cu_seqlens(lens, torch.device("cpu")).tolist()

    def naive():
        return [naive_indexer(q_idx[a:b], k_idx[a:b], args.scale)
                for a, b in zip(offsets[:-1], offsets[1:])]
    reference = naive()
    ms = time_ms(naive, device, args.rep_ms)
    free_memory(device)
    tsv.write(**row, dtype="bf16", impl="torch_naive_indexer", backend="torch", latency_ms=ms,
              tflops=flops / ms / 1e9, speedup_vs_torch=1.0, note=f"peak ~{need / 1e9:.1f} GB")
    return ms, lambda scores: _compare_indexer(scores, reference, offsets)


def _compare_indexer(scores: torch.Tensor, naive_out, offsets) -> str:
    """'max_rel_err=...' of msa's scores against the naive ones on the visible tiles (a sanity
    check that the timed kernel computes the right thing, not a correctness test)."""
    worst = 0.0
    for (a, b), ref in zip(zip(offsets[:-1], offsets[1:]), naive_out):
        got = scores[:, :ref.shape[1], a:b]
        finite = torch.isfinite(ref)
        if not torch.equal(finite, torch.isfinite(got)):
            return "MISMATCH: -inf pattern differs from the naive indexer"
        err = (got[finite] - ref[finite]).abs().max() / ref[finite].abs().max().clamp_min(1e-6)
        worst = max(worst, float(err))
    return f"max_rel_err={worst:.2e}"


def topk_scores(n: int, num_heads: int, device) -> tuple:
    """([H, ceil(n/128), n] fp32 random scores, -inf past each query's own block; own block
    [n] int32)."""
    tiles = -(-n // BLOCK)
    own = (torch.arange(n, device=device) // BLOCK).to(torch.int32)
    scores = torch.randn(num_heads, tiles, n, device=device)
    tile = torch.arange(tiles, device=device)
    scores.masked_fill_(tile.view(1, -1, 1) > own.view(1, 1, -1), float("-inf"))
    return scores, own


def bench_topk(msa, args, device, tsv: TsvWriter, sizes):
    def select(scores, own):
        return msa.sparse_topk_select(scores, args.topk, scores.shape[1], force_end_blocks=1,
                                      causal_end_block=own)
    small_scores, small_own = topk_scores(4 * BLOCK, args.h_idx, device)
    backends = {}
    for tier in parse_names(args.tiers):
        backend = tier_backend(msa, "sparse_topk_select", lambda: select(small_scores, small_own),
                               tier, "msa top-k")
        if backend is not None:
            backends[tier] = backend
    for n in sizes:
        _bench_topk_size(msa, n, select, backends, args, device, tsv)
        free_memory(device)


def _bench_topk_size(msa, n, select, backends, args, device, tsv):
    scores, own = topk_scores(n, args.h_idx, device)
    tiles = scores.shape[1]
    row = dict(op="topk", case="single", lengths=[n], dtype="fp32")
    torch_ms = None
    if "torch" in args.peers:
        # torch.topk's best case: the same values as contiguous [H_idx * N, tiles] rows.
        rows = scores.permute(0, 2, 1).reshape(args.h_idx * n, tiles).contiguous()
        k = min(args.topk, tiles)
        torch_ms = time_ms(lambda: torch.topk(rows, k, dim=-1), device, args.rep_ms)
        tsv.write(**row, impl="torch.topk", backend="torch", latency_ms=torch_ms,
                  speedup_vs_torch=1.0, note=f"[{args.h_idx * n}, {tiles}] contiguous, k={k}")
    for tier, backend in backends.items():
        if reference_too_slow(backend, n, device, args, f"msa top-k {n}"):
            continue
        with native_tier(tier):
            select(scores, own)
            ms = time_ms(lambda: select(scores, own), device, args.rep_ms)
            backend = msa._backend.last_backend("sparse_topk_select")
        tsv.write(**row, impl="msa.sparse_topk_select", backend=backend, latency_ms=ms,
                  speedup_vs_torch=torch_ms / ms if torch_ms else None,
                  note=f"[{args.h_idx}, {tiles}, {n}], own block forced")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="indexer,topk")
    ap.add_argument("--seqs", default="32k,64k,128k", help="single-sequence lengths")
    ap.add_argument("--varlen", default="32768,16384,8269,4396",
                    help="lengths of the varlen indexer batch ('' to skip)")
    ap.add_argument("--topk-seqs", default="32k,64k,128k", help="N of the top-k benchmark")
    ap.add_argument("--dtypes", default="bf16,fp8", help="index q/k dtypes: bf16, fp8")
    ap.add_argument("--h-idx", type=int, default=4, help="index heads (one shared index-K head)")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--scale", type=float, default=1.0, help="index score scale (M3: 1.0)")
    ap.add_argument("--peers", default="torch", help="'torch' or '' (no naive peers)")
    ap.add_argument("--tiers", default="hopper",
                    help="native tiers: hopper (what the GPU's family serves), portable")
    add_common_args(ap, rep_ms=200)
    args = ap.parse_args(argv)
    if args.tiny:
        apply_preset(args, ap, seqs="256", varlen="200,72", topk_seqs="512", rep_ms=5)
    elif args.quick:
        apply_preset(args, ap, seqs="32k", varlen="", topk_seqs="32k")

    device = setup(args)
    msa = load_msa()
    tsv = TsvWriter(args.out, COLUMNS, device, formats={"tflops": ".1f",
                                                         "speedup_vs_torch": ".2f"})
    ops = parse_names(args.ops)
    if "indexer" in ops:
        cases = [("single", [n]) for n in parse_sizes(args.seqs)]
        if args.varlen:
            cases.append(("varlen", parse_sizes(args.varlen)))
        bench_indexer(msa, args, device, tsv, cases)
    if "topk" in ops:
        bench_topk(msa, args, device, tsv, parse_sizes(args.topk_seqs))
    synchronize(device)
    print(f"{tsv.rows} rows", flush=True)


if __name__ == "__main__":
    main()
