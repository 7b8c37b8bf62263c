"""Paged MSA decode (``SparseDecodePagedAttentionWrapper``) against cuDNN bf16 dense decode SDPA.

Grid: batch B x context x seqlen_q (1, or 4 for multi-token prediction) x K/V cache dtype (e4m3,
bf16; q has the cache's dtype) x mode, Hq=64, Hkv=4, D=128, pages of 128 tokens shuffled in the
page table, every request at the full context. Modes:

  dense   attention over the whole context (q2k_indices=None);
  sparse  attention over topK=16 blocks per (query, KV head): each request's KV heads pick 15
          random earlier blocks shared by its seqlen_q queries, plus each query's own block;
  step    a full MSA decode step: block_max_scores over a paged index-K cache (H_idx = Hkv index
          heads, one shared index-K head), sparse_topk_select with the query's own block forced,
          the selection written into the planned q2k buffer, then sparse attention.

Each is timed eager (wrapper.run, planned once with enable_cuda_graph=True, outside the timing)
and CUDA-graph replayed (the same run captured once, then graph.replay()). bytes_read = the bytes
the step must read: K+V of the visible keys (dense) or of the union of the blocks the request's
queries selected, per KV head (sparse), plus q, plus the index-K cache (step). tb_per_s =
bytes_read / time. The peer is cuDNN SDPA on bf16 K/V [B, Hkv, context, 128] with each KV head's G
x seqlen_q query rows folded into one head (no causal tail; at most 3 keys differ), measured in
the same run. Combinations whose memory would exceed --mem-limit-gb are skipped, and so are
large ones whose backend is the slow PyTorch reference; each skip prints a note.

--tiers hopper,portable times every point once per native tier: what the GPU's family serves,
and the portable tier (MSA_NATIVE_TIER=portable with its gate opened: the split-keys, direct
and row forms, never the warpgroup form); the backend column says which ran.

    python benchmarks/bench_decode.py --out benchmarks/results/decode_h200.tsv
"""

from __future__ import annotations

import argparse

import torch

from _common import (BLOCK, HEAD_DIM, add_common_args, apply_preset, dtype_of, fits, native_tier,
                     free_memory, load_msa, parse_names, parse_sizes,
                     probe_backend, random_fill, reference_too_slow, setup, synchronize,
                     time_dense_sdpa, time_ms, TsvWriter)

COLUMNS = ("batch", "context", "seqlen_q", "kv_dtype", "mode", "exec", "backend", "latency_us",
           "bytes_read", "tb_per_s", "speedup_vs_cudnn", "note")
DECODE_OP = "sparse_decode_atten"
class DecodeBatch:
    """One decode batch: B requests at `context` tokens, seqlen_q queries each.

    k, v [pages, Hkv, 128, 128]; page_table [B, pages_per_request] int32 (a random permutation
    of the pages); seqused_k [B] int32; q [B * seqlen_q, Hq, 128]; q2k [Hkv, B * seqlen_q, topK]
    int32 (the sparse selection, ascending, -1 tail)."""

    def __init__(self, batch, context, seqlen_q, kv_dtype, args, device, with_index=False):
        self.batch, self.context, self.args = batch, context, args
        self.device, self.kv_dtype, self.with_index = device, kv_dtype, with_index
        self.pages_per_request = -(-context // BLOCK)
        num_pages = batch * self.pages_per_request
        perm = torch.randperm(num_pages, device=device, dtype=torch.int64)
        self.page_table = perm.view(batch, -1).to(torch.int32).contiguous()
        self.seqused_k = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.k = random_fill([num_pages, args.hkv, BLOCK, HEAD_DIM], kv_dtype, device)
        self.v = random_fill([num_pages, args.hkv, BLOCK, HEAD_DIM], kv_dtype, device)
        if with_index:   # the step's paged index-K cache (one shared head)
            self.k_idx = random_fill([num_pages, 1, BLOCK, HEAD_DIM], kv_dtype, device)
        self.set_seqlen_q(seqlen_q)

    def set_seqlen_q(self, seqlen_q: int) -> None:
        """(Re)make the per-query tensors for seqlen_q queries per request; the caches stay."""
        batch, args, device = self.batch, self.args, self.device
        self.seqlen_q = seqlen_q
        self.q = random_fill([batch * seqlen_q, args.hq, HEAD_DIM], self.kv_dtype, device)
        self.out = torch.empty(self.q.shape, dtype=torch.bfloat16, device=device)
        # Query i of a request sits at key position context - seqlen_q + i: its own block.
        position = self.context - seqlen_q + torch.arange(seqlen_q, device=device)
        self.own_block = (position.clamp_min(0) // BLOCK).repeat(batch).to(torch.int32)
        self.q2k = self.random_selection()
        if self.with_index:
            self.q_idx = random_fill([batch * seqlen_q, args.hkv, HEAD_DIM], self.kv_dtype,
                                     device)
            self.cu_q = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * seqlen_q
            self.num_valid_pages = torch.full((batch * seqlen_q,), self.pages_per_request,
                                              dtype=torch.int32, device=device)

    def random_selection(self) -> torch.Tensor:
        hkv, topk, pages = self.args.hkv, self.args.topk, self.pages_per_request
        shared = torch.rand(hkv, self.batch, 1, pages, device=self.device)
        scores = shared.expand(-1, -1, self.seqlen_q, -1).reshape(hkv, -1, pages).clone()
        block = torch.arange(pages, device=self.device).view(1, 1, -1)
        own = self.own_block.long().view(1, -1, 1)
        scores.masked_fill_(block > own, float("-inf"))
        scores.scatter_(2, own.expand(hkv, -1, 1), float("inf"))
        k = min(topk, pages)
        val, idx = scores.topk(k, dim=-1)
        idx = torch.where(torch.isneginf(val), pages, idx).sort(-1).values
        idx = torch.where(idx == pages, -1, idx).to(torch.int32)
        return torch.nn.functional.pad(idx, (0, topk - k), value=-1).contiguous()

    def kv_bytes(self, sparse: bool) -> int:
        """K+V bytes the step must read: visible keys (dense) or the union of the selected
        blocks of each (request, KV head) (sparse)."""
        per_token = 2 * HEAD_DIM * self.k.element_size()
        if not sparse:
            return self.batch * self.args.hkv * self.context * per_token
        pages = self.pages_per_request
        sel = self.q2k.view(self.args.hkv, self.batch, -1).long()
        chosen = torch.zeros(self.args.hkv, self.batch, pages + 1, dtype=torch.bool,
                             device=self.device)
        chosen.scatter_(2, torch.where(sel >= 0, sel, pages), True)
        block = torch.arange(pages, device=self.device)
        tokens_in_block = (self.context - block * BLOCK).clamp(0, BLOCK)
        return int((chosen[..., :pages] * tokens_in_block).sum()) * per_token

    def plan(self, msa, sparse: bool):
        wrapper = msa.SparseDecodePagedAttentionWrapper()
        wrapper.plan(page_table=self.page_table, seqused_k=self.seqused_k,
                     seqlen_q=self.seqlen_q, max_seqlen_k=self.context,
                     q2k_indices=self.q2k if sparse else None, num_qo_heads=self.args.hq,
                     num_kv_heads=self.args.hkv, enable_cuda_graph=True)
        return wrapper

    def attention_fn(self, wrapper):
        return lambda: wrapper.run(self.q, self.k, self.v, out=self.out)

    def step_fn(self, msa, wrapper):
        """scores -> top-k (own block forced) -> selection into the planned q2k -> attention."""
        def step():
            scores = msa.block_max_scores(
                self.q_idx, self.k_idx, self.cu_q, None, max_seqlen_q=self.seqlen_q,
                max_seqlen_k=self.context, page_table=self.page_table, seqused_k=self.seqused_k,
                max_k_tiles=self.pages_per_request)
            selection = msa.sparse_topk_select(scores, self.args.topk, self.num_valid_pages,
                                               force_end_blocks=1,
                                               causal_end_block=self.own_block)
            self.q2k.copy_(selection.permute(1, 0, 2))
            return wrapper.run(self.q, self.k, self.v, out=self.out)
        return step


def cache_bytes(batch, context, args, elem: int, with_index: bool) -> int:
    """Device bytes of one DecodeBatch (K, V, index-K when needed), with 10% slack."""
    tokens = batch * -(-context // BLOCK) * BLOCK
    per_token = 2 * args.hkv * HEAD_DIM * elem + (HEAD_DIM * elem if with_index else 0)
    return int(1.1 * tokens * per_token)


def replayable(fn, backend: str, device: torch.device, what: str):
    """graph.replay of fn captured in a CUDA graph (after warm-up calls on a side stream), or
    None with a printed note where that cannot be done (CPU, the reference, a capture error)."""
    if device.type != "cuda":
        return None
    if "reference" in backend:
        print(f"skip graph {what}: the reference backend synchronizes (not capturable)",
              flush=True)
        return None
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        print(f"skip graph {what}: capture failed: {str(exc).splitlines()[0]}", flush=True)
        return None
    return graph.replay


def bench_cudnn(batch, context, seqlen_qs, args, device, tsv):
    """cuDNN bf16 dense decode on the same context: {seqlen_q: microseconds} (empty when it
    does not fit)."""
    kv_shape = [batch, args.hkv, context, HEAD_DIM]
    need = int(1.1 * 2 * batch * args.hkv * context * HEAD_DIM * 2)
    if not fits(need, args, f"cudnn decode B={batch} ctx={context}"):
        return {}
    k = random_fill(kv_shape, torch.bfloat16, device)
    v = random_fill(kv_shape, torch.bfloat16, device)
    kv = 2 * batch * args.hkv * context * HEAD_DIM * 2
    found = {}
    for seqlen_q in seqlen_qs:
        group_rows = args.hq // args.hkv * seqlen_q
        q = random_fill([batch, args.hkv, group_rows, HEAD_DIM], torch.bfloat16, device)
        ms, label = time_dense_sdpa([(q, k, v)], False, device, args.rep_ms)
        if ms is None:
            continue
        found[seqlen_q] = us = ms * 1e3
        bytes_read = kv + q.numel() * 2
        tsv.write(batch=batch, context=context, seqlen_q=seqlen_q, kv_dtype="bf16",
                  mode="dense", exec="eager", backend=label, latency_us=us,
                  bytes_read=bytes_read, tb_per_s=bytes_read / us / 1e6, speedup_vs_cudnn=1.0,
                  note="cudnn_sdpa (G x seqlen_q rows folded per KV head)")
    del k, v
    free_memory(device)
    return found


def probe_backends(msa, args, device, dtype_names, seqlen_qs):
    """{(dtype, seqlen_q, mode): {op: backend}} from small calls of the same shapes per head."""
    found = {}
    for dtype_name in dtype_names:
        for seqlen_q in seqlen_qs:
            small = DecodeBatch(1, 4 * BLOCK, seqlen_q, dtype_of(dtype_name), args, device,
                                with_index=True)
            for mode in parse_names(args.modes):
                wrapper = small.plan(msa, mode != "dense")
                fn = small.step_fn(msa, wrapper) if mode == "step" else small.attention_fn(wrapper)
                probe_backend(msa, DECODE_OP, fn)
                ops = [DECODE_OP] + (["block_max_scores", "sparse_topk_select"]
                                     if mode == "step" else [])
                found[dtype_name, seqlen_q, mode] = {op: msa._backend.last_backend(op)
                                                     for op in ops}
    print(f"backends: {found}", flush=True)
    return found


def bench_point(msa, batch, context, seqlen_qs, dtype_name, args, device, tsv, backends,
                cudnn_us):
    """Every mode and execution of one (batch, context, cache dtype), for each seqlen_q."""
    modes = parse_names(args.modes)
    dtype = dtype_of(dtype_name)
    with_index = "step" in modes
    if not fits(cache_bytes(batch, context, args, dtype.itemsize, with_index), args,
                f"msa decode B={batch} ctx={context} {dtype_name}"):
        return
    data = DecodeBatch(batch, context, seqlen_qs[0], dtype, args, device, with_index=with_index)
    for seqlen_q in seqlen_qs:
        data.set_seqlen_q(seqlen_q)
        for mode in modes:
            bench_mode(msa, data, mode, dtype_name, args, device, tsv,
                       backends[dtype_name, seqlen_q, mode], cudnn_us.get(seqlen_q))
    del data
    free_memory(device)


def bench_mode(msa, data: DecodeBatch, mode, dtype_name, args, device, tsv, used, cudnn_us):
    """Eager and graph-replayed timings of one mode; `used` = {op: probed backend}."""
    batch, context, seqlen_q = data.batch, data.context, data.seqlen_q
    what = f"{mode} decode B={batch} ctx={context} sq={seqlen_q} {dtype_name}"
    if any(reference_too_slow(b, batch * context, device, args, f"{what} ({op})")
           for op, b in used.items()):
        return
    wrapper = data.plan(msa, mode != "dense")
    fn = data.step_fn(msa, wrapper) if mode == "step" else data.attention_fn(wrapper)
    try:
        fn()
    except NotImplementedError as exc:          # a size the native kernel refuses: say so
        print(f"skip {what}: {exc}", flush=True)
        tsv.write(batch=batch, context=context, seqlen_q=seqlen_q, kv_dtype=dtype_name,
                  mode=mode, exec="eager", backend="unsupported", note=str(exc)[:160])
        return
    # step: "attention/indexer/top-k" backends, in the order of `used`.
    backend = "/".join(msa._backend.last_backend(op) for op in used)
    # After the step ran, q2k holds its own selection: the blocks attention read.
    bytes_read = data.kv_bytes(mode != "dense") + data.q.numel() * data.q.element_size()
    if mode == "step":
        bytes_read += data.k_idx.numel() * data.k_idx.element_size()
    for exec_kind in parse_names(args.execs):
        run = fn if exec_kind == "eager" else replayable(fn, backend, device, what)
        if run is None:
            continue
        us = time_ms(run, device, args.rep_ms) * 1e3
        tsv.write(batch=batch, context=context, seqlen_q=seqlen_q, kv_dtype=dtype_name,
                  mode=mode, exec=exec_kind, backend=backend, latency_us=us,
                  bytes_read=bytes_read, tb_per_s=bytes_read / us / 1e6,
                  speedup_vs_cudnn=cudnn_us / us if cudnn_us else None,
                  note=None)
    if mode == "step":
        data.q2k.copy_(data.random_selection())   # later modes see a random selection again


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="8k,32k,128k,512k")
    ap.add_argument("--seqlen-q", default="1,4", help="queries per request (MTP > 1)")
    ap.add_argument("--dtypes", default="fp8,bf16", help="K/V cache (and q) dtypes")
    ap.add_argument("--modes", default="dense,sparse,step")
    ap.add_argument("--execs", default="eager,graph")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4, help="KV heads (= index heads of the step)")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--peers", default="cudnn", help="'cudnn' or '' (no dense peer)")
    ap.add_argument("--tiers", default="hopper",
                    help="native tiers: hopper (what the GPU's family serves), portable")
    add_common_args(ap, rep_ms=100)
    args = ap.parse_args(argv)
    if args.tiny:
        apply_preset(args, ap, batches="2", contexts="300", seqlen_q="1,4", rep_ms=5)
    elif args.quick:
        apply_preset(args, ap, batches="1,32", contexts="8k,128k", seqlen_q="1")

    device = setup(args)
    msa = load_msa()
    tsv = TsvWriter(args.out, COLUMNS, device,
                    formats={"latency_us": ".2f", "tb_per_s": ".3f", "speedup_vs_cudnn": ".2f"})
    dtype_names = parse_names(args.dtypes)
    seqlen_qs = [int(s) for s in parse_names(args.seqlen_q)]
    tiers = parse_names(args.tiers)
    backends = {}
    for tier in tiers:
        with native_tier(tier):
            backends[tier] = probe_backends(msa, args, device, dtype_names, seqlen_qs)
    for context in parse_sizes(args.contexts):
        for batch in [int(b) for b in parse_names(args.batches)]:
            cudnn_us = {}
            if "cudnn" in args.peers:
                cudnn_us = bench_cudnn(batch, context, seqlen_qs, args, device, tsv)
            for dtype_name in dtype_names:
                for tier in tiers:
                    with native_tier(tier):
                        bench_point(msa, batch, context, seqlen_qs, dtype_name, args, device,
                                    tsv, backends[tier], cudnn_us)
    synchronize(device)
    print(f"{tsv.rows} rows", flush=True)


if __name__ == "__main__":
    main()
