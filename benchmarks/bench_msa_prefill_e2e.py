"""End-to-end MSA prefill (``msa.msa_prefill``) against cuDNN dense causal SDPA, split per stage.

Configuration (MiniMax-M3): Hq=64, Hkv=4, D=128, H_idx=4 index heads against one shared index-K
head, topK=16 blocks of 128 tokens with the query's own block forced. Per case (single sequences
and a varlen batch) the TSV has one row per stage, each timed on its own with the inputs the
pipeline produces:

  block_max_scores    index scores [H_idx, tiles, N]
  sparse_topk_select  selection [N, Hkv, 16] (own block forced via causal_end_block)
  build_k2q_csr       the q2k transpose, the k2q CSR of the selection and the attention schedule
  sparse_atten_func   block-sparse attention over the selection
  stage_sum           the sum of the four (msa_prefill adds only the per-query block bounds)
  msa_prefill         the whole pipeline in one call
  cudnn_sdpa_causal   dense causal attention on the same q, k, v (bf16; KV heads expanded)

backend is ``msa._backend.last_backend(op)`` of each stage. A stage whose backend is the PyTorch
reference is skipped above --ref-max-tokens (the reference is slow); later stages then run on
torch-made stand-ins (random causal scores, a torch.topk selection) and say so in the note.
dense_equiv_tflops = 4 * D * Hq * sum(N^2 / 2) / time (the dense causal work the call replaces).

    python benchmarks/bench_msa_prefill_e2e.py --out benchmarks/results/msa_prefill_e2e_h200.tsv
"""

from __future__ import annotations

import argparse

import torch

from _common import (BLOCK, HEAD_DIM, add_common_args, apply_preset, cu_seqlens,
                     fits, free_memory, load_msa, parse_names, parse_sizes, random_fill,
                     reference_too_slow, setup, split_dtype_name, synchronize, time_dense_sdpa,
                     time_ms, TsvWriter)

COLUMNS = ("case", "lengths", "dtype", "impl", "backend", "latency_ms", "share_of_e2e",
           "dense_equiv_tflops", "speedup_vs_cudnn", "note")
STAGES = ("block_max_scores", "sparse_topk_select", "build_k2q_csr", "sparse_atten_func")
# The op name each stage dispatches under in msa._backend.
STAGE_OP = {"block_max_scores": "block_max_scores", "sparse_topk_select": "sparse_topk_select",
            "build_k2q_csr": "build_k2q_csr", "sparse_atten_func": "sparse_atten"}


class Pipeline:
    """Inputs of one prefill case and the four stages as separate calls.

    q [T, Hq, 128], k / v [T, Hkv, 128], q_idx [T, Hkv, 128], k_idx [T, 1, 128] (T = sum of the
    lengths, self-attention: q_len == k_len per request)."""

    def __init__(self, msa, lengths, dtype, args, device, partial_dtype=torch.bfloat16):
        self.msa, self.lengths, self.args = msa, list(lengths), args
        self.partial_dtype = partial_dtype
        total = sum(lengths)
        self.total, self.max_len = total, max(lengths)
        self.cu = cu_seqlens(lengths, device)
        self.q = random_fill([total, args.hq, HEAD_DIM], dtype, device)
        self.k = random_fill([total, args.hkv, HEAD_DIM], dtype, device)
        self.v = random_fill([total, args.hkv, HEAD_DIM], dtype, device)
        self.q_idx = random_fill([total, args.hkv, HEAD_DIM], dtype, device)
        self.k_idx = random_fill([total, 1, HEAD_DIM], dtype, device)
        # Per query: its request's tile count and its own block (q_len == k_len here).
        local = torch.cat([torch.arange(n, device=device) for n in lengths])
        tiles = torch.cat([torch.full((n,), -(-n // BLOCK), device=device) for n in lengths])
        self.num_valid_pages = tiles.to(torch.int32)
        self.own_block = (local // BLOCK).to(torch.int32)
        self.lens = dict(max_seqlen_q=self.max_len, max_seqlen_k=self.max_len)

    def scores(self):
        return self.msa.block_max_scores(self.q_idx, self.k_idx, self.cu, self.cu, causal=True,
                                         scale=self.args.index_scale, **self.lens)

    def select(self, scores):
        return self.msa.sparse_topk_select(scores, self.args.topk, self.num_valid_pages,
                                           force_end_blocks=1, causal_end_block=self.own_block)

    def csr(self, selection):
        q2k = selection.permute(1, 0, 2).contiguous()
        return self.msa.build_k2q_csr(q2k, self.cu, self.cu, BLOCK, total_k=self.total,
                                      qhead_per_kv=self.args.hq // self.args.hkv,
                                      return_schedule=True, **self.lens)

    def attention(self, csr):
        row_ptr, q_ids, schedule = csr
        return self.msa.sparse_atten_func(self.q, self.k, self.v, row_ptr, q_ids, self.args.topk,
                                          cu_seqlens_q=self.cu, cu_seqlens_k=self.cu,
                                          causal=True, partial_dtype=self.partial_dtype,
                                          schedule=schedule, **self.lens)

    def end_to_end(self):
        return self.msa.msa_prefill(self.q, self.k, self.v, self.q_idx, self.k_idx, self.cu,
                                    self.cu, topk=self.args.topk, index_scale=self.args.index_scale,
                                    partial_dtype=self.partial_dtype, **self.lens)

    # Stand-ins for a stage skipped because only its slow reference would run.
    def synthetic_scores(self):
        tiles = -(-self.max_len // BLOCK)
        scores = torch.randn(self.args.hkv, tiles, self.total, device=self.q.device)
        tile = torch.arange(tiles, device=self.q.device).view(1, -1, 1)
        return scores.masked_fill_(tile > self.own_block.view(1, 1, -1), float("-inf"))

    def torch_selection(self, scores):
        """[T, Hkv, topk] by torch.topk with the own block forced, ascending, -1 tail."""
        rows = scores.permute(2, 0, 1).clone()                     # [T, H, tiles]
        rows.scatter_(2, self.own_block.long().view(-1, 1, 1).expand(-1, rows.shape[1], 1),
                      float("inf"))
        k = min(self.args.topk, rows.shape[2])
        val, idx = rows.topk(k, dim=-1)
        idx = torch.where(torch.isneginf(val), torch.iinfo(torch.int32).max, idx)
        idx = idx.sort(-1).values
        idx = torch.where(idx == torch.iinfo(torch.int32).max, -1, idx).int()
        pad = self.args.topk - k
        return torch.nn.functional.pad(idx, (0, pad), value=-1).contiguous()


def estimate_bytes(total: int, max_len: int, args, elem: int) -> int:
    """Device bytes of one case: inputs, scores, selection, CSR, output (with 20% slack)."""
    per_token = (args.hq + 3 * args.hkv + 1) * HEAD_DIM * elem      # q, k, v, q_idx, k_idx
    per_token += args.hkv * (-(-max_len // BLOCK)) * 4 * 2           # scores (+ stand-in copy)
    per_token += args.hkv * args.topk * 4 * 3                        # selection, q2k, CSR ids
    per_token += args.hq * HEAD_DIM * 2                              # output
    return int(1.2 * total * per_token)


def cudnn_bytes(max_len: int, args) -> int:
    """Dense peer, one sequence at a time: q, expanded k / v and O in [1, Hq, N, 128] bf16."""
    return int(1.2 * 4 * args.hq * max_len * HEAD_DIM * 2)


def bench_cudnn(pipe: Pipeline, args, device):
    """Milliseconds of dense causal SDPA over every sequence of the case (same q, k, v)."""
    offsets = cu_seqlens(pipe.lengths, torch.device("cpu")).tolist()
    group = args.hq // args.hkv
    triples = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        def heads_first(t, repeat=1):
            t = t[a:b].to(torch.bfloat16).transpose(0, 1)
            return t.repeat_interleave(repeat, 0).unsqueeze(0).contiguous()
        triples.append((heads_first(pipe.q), heads_first(pipe.k, group),
                        heads_first(pipe.v, group)))
    return time_dense_sdpa(triples, True, device, args.rep_ms)


def time_stages(msa, pipe: Pipeline, too_slow, args, device):
    """Run each stage once (its output feeds the next), then time it alone on those inputs.

    A stage for which too_slow(stage) is true is not run: the scores and the selection are then
    made by torch stand-ins; without a CSR, attention is skipped. Returns ({stage: ms},
    {stage: backend}, {stage: note})."""
    stage_ms, stage_backend, notes = {}, {}, {}

    def timed(stage, fn):
        out = fn()
        stage_backend[stage] = msa._backend.last_backend(STAGE_OP[stage])
        stage_ms[stage] = time_ms(fn, device, args.rep_ms)
        return out

    if too_slow("block_max_scores"):
        scores, notes["sparse_topk_select"] = pipe.synthetic_scores(), "on random scores"
    else:
        scores = timed("block_max_scores", pipe.scores)
    if too_slow("sparse_topk_select"):
        selection = pipe.torch_selection(scores)
        notes["build_k2q_csr"] = notes["sparse_atten_func"] = "on a torch.topk selection"
    else:
        selection = timed("sparse_topk_select", lambda: pipe.select(scores))
    if too_slow("build_k2q_csr"):
        return stage_ms, stage_backend, notes
    csr = timed("build_k2q_csr", lambda: pipe.csr(selection))
    if not too_slow("sparse_atten_func"):
        timed("sparse_atten_func", lambda: pipe.attention(csr))
    return stage_ms, stage_backend, notes


def bench_case(msa, case, lengths, args, device, tsv: TsvWriter, backends, dtype_names):
    total, max_len = sum(lengths), max(lengths)
    dense_flops = 4 * HEAD_DIM * args.hq * sum(n * n / 2 for n in lengths)
    cudnn_ms = None
    for dtype_name in dtype_names:
        dtype, partial_dtype = split_dtype_name(dtype_name)
        if not fits(estimate_bytes(total, max_len, args, dtype.itemsize), args,
                    f"msa prefill {case} {lengths} {dtype_name}"):
            continue
        pipe = Pipeline(msa, lengths, dtype, args, device, partial_dtype)
        row = dict(case=case, lengths=lengths, dtype=dtype_name)
        if cudnn_ms is None and "cudnn" in args.peers and fits(
                cudnn_bytes(max_len, args), args, f"cudnn {case} {lengths}"):
            cudnn_ms, label = bench_cudnn(pipe, args, device)
            if cudnn_ms is not None:
                tsv.write(case=case, lengths=lengths, dtype="bf16", impl="cudnn_sdpa_causal",
                          backend=label, latency_ms=cudnn_ms,
                          dense_equiv_tflops=dense_flops / cudnn_ms / 1e9, speedup_vs_cudnn=1.0)
            free_memory(device)

        def too_slow(stage):
            return reference_too_slow(backends[dtype_name][stage], total, device, args,
                                      f"{stage} {case} {lengths} {dtype_name}")
        stage_ms, stage_backend, notes = time_stages(msa, pipe, too_slow, args, device)
        free_memory(device)

        e2e_ms = None
        if len(stage_ms) == len(STAGES):
            pipe.end_to_end()
            e2e_ms = time_ms(pipe.end_to_end, device, args.rep_ms)
        for stage in STAGES:
            if stage not in stage_ms:
                continue
            ms = stage_ms[stage]
            tsv.write(**row, impl=stage, backend=stage_backend[stage], latency_ms=ms,
                      share_of_e2e=ms / e2e_ms if e2e_ms else None, note=notes.get(stage))
        if e2e_ms is not None:
            summed = sum(stage_ms.values())
            kinds = "+".join(sorted(set(stage_backend.values())))
            for impl, ms in (("stage_sum", summed), ("msa_prefill", e2e_ms)):
                tsv.write(**row, impl=impl, backend=kinds, latency_ms=ms,
                          share_of_e2e=ms / e2e_ms, dense_equiv_tflops=dense_flops / ms / 1e9,
                          speedup_vs_cudnn=cudnn_ms / ms if cudnn_ms else None)
        else:
            print(f"skip msa_prefill {case} {lengths} {dtype_name}: a stage runs only its slow "
                  f"reference", flush=True)
        del pipe
        free_memory(device)


def probe_backends(msa, args, device, dtype_names):
    """{dtype: {stage: backend}} from one small pipeline run per dtype (two requests)."""
    found = {}
    for dtype_name in dtype_names:
        dtype, partial_dtype = split_dtype_name(dtype_name)
        pipe = Pipeline(msa, [4 * BLOCK, 2 * BLOCK + 5], dtype, args, device, partial_dtype)
        pipe.attention(pipe.csr(pipe.select(pipe.scores())))
        found[dtype_name] = {s: msa._backend.last_backend(STAGE_OP[s]) for s in STAGES}
        print(f"backends {dtype_name}: {found[dtype_name]}", flush=True)
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="32k,64k,128k", help="single-sequence lengths")
    ap.add_argument("--varlen", default="32768,16384,8269,4396",
                    help="lengths of the varlen batch ('' to skip)")
    ap.add_argument("--dtypes", default="bf16",
                    help="q/k/v and index dtypes: bf16, fp8; '_p<partial>' picks the sparse "
                         "attention's partial_dtype (e.g. fp8_pe4m3; default bf16 partials)")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4, help="KV heads = index heads (H_idx)")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--index-scale", type=float, default=1.0)
    ap.add_argument("--peers", default="cudnn", help="'cudnn' or '' (no dense peer)")
    add_common_args(ap, rep_ms=200)
    args = ap.parse_args(argv)
    if args.tiny:
        apply_preset(args, ap, seqs="256", varlen="200,72", rep_ms=5)
    elif args.quick:
        apply_preset(args, ap, seqs="32k", varlen="")

    device = setup(args)
    msa = load_msa()
    tsv = TsvWriter(args.out, COLUMNS, device,
                    formats={"share_of_e2e": ".3f", "dense_equiv_tflops": ".1f",
                             "speedup_vs_cudnn": ".2f"})
    dtype_names = parse_names(args.dtypes)
    backends = probe_backends(msa, args, device, dtype_names)
    cases = [("single", [n]) for n in parse_sizes(args.seqs)]
    if args.varlen:
        cases.append(("varlen", parse_sizes(args.varlen)))
    for case, lengths in cases:
        bench_case(msa, case, lengths, args, device, tsv, backends, dtype_names)
    synchronize(device)
    print(f"{tsv.rows} rows", flush=True)


if __name__ == "__main__":
    main()
