"""MSA prefill on MiniMax-M3's production chunked-prefill cases, upstream's protocol (issue 23).

The cases: upstream's 66 representative production calls (benchmarks/prefill_cases.py: per
request a cached prefix and a new chunk, weights = production call counts). Per case and dtype:

* the pipeline: ``msa.MsaPrefillPagedWrapper`` over a paged cache (K/V and index-K in 128-token
  pages, disjoint random page tables, one scratch page), planned outside the timing (impl
  ``paged``, its default ``attention_route="auto"``; ``--impls paged-sparse`` /
  ``paged-decode`` add the same with every chunk on the sparse / decode route, ``--impls
  dense`` ``msa.msa_prefill`` on packed K/V; ``--sparse-forms ws3w,wsp3w`` repeats each impl
  with that sparse attention form forced wherever it is built, impl ``<impl>[<form>]``);
  the whole call
  captured in one CUDA graph over S input slots (each its own q, caches, page table and
  plan), S chosen so the bytes of S - 1 slots exceed twice the L2 (upstream's rule: no call
  finds its data in L2); after 5 warm-up replays, the median of >= 20 timed replays / S
  (retried up to 3 times while the replays' CV exceeds 3 %). The graph's outputs must equal
  the eager run's, bit for bit (column ``graph``).
* the stage breakdown: the same run captured again with a CUDA event at each stage mark
  (``msa._stages``: indexer, top-k, CSR + schedule, attention, combine), median over replays.
* dense SDPA with a lower-right causal mask per request (bf16, KV heads expanded), in the same
  process, its own CUDA graph: the dense alternative an engine would run.

FLOPs = 4 * 128 * Hq * (visible selected keys), upstream's count; the benchmark checks the
count against the selection the pipeline made on slot 0 (``note``, with the median SM clock
and power during the replays). eff_tflops = FLOPs /
latency; attention_tflops = FLOPs / (attention + combine). The ``weighted`` row per impl and
dtype:
sum(w * FLOPs) / sum(w * latency), the weighted speed-up sum(w * dense) / sum(w * latency), the
weighted means of the stages and the smallest per-case speed-up.

    python benchmarks/bench_prefill_production.py --out benchmarks/results/prefill_production_h200.tsv
    python benchmarks/bench_prefill_production.py --quick           # 7 cases spanning the shapes
    python benchmarks/bench_prefill_production.py --device cpu --tiny   # CPU smoke run
    python benchmarks/plot_prefill_production.py benchmarks/results/prefill_production_h200.tsv
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional

import torch

from _common import (ClockSampler, add_common_args, apply_preset, cu_seqlens, free_memory,
                     load_msa, parse_names, random_fill, setup, split_dtype_name, synchronize,
                     TsvWriter)
from prefill_cases import (QUICK_CASES, PrefillCase, attention_flops, load_cases, select_cases,
                           tiny_cases)

BLOCK = 128
HEAD_DIM = 128
STAGES = ("indexer", "topk", "csr", "attention", "combine")
MAX_CV = 0.03
MAX_ATTEMPTS = 3
COLUMNS = ("case", "batch", "total_q", "max_kv", "weight", "lengths", "dtype", "impl",
           "latency_ms", "cv", "gflop", "eff_tflops", "dense_ms", "speedup") + tuple(
    f"{s}_ms" for s in STAGES) + ("attention_tflops", "chunks", "index_splits", "slots",
                                  "peak_gb", "graph", "note")
FORMATS = {"latency_ms": ".4f", "dense_ms": ".4f", "cv": ".3f", "gflop": ".2f",
           "eff_tflops": ".1f", "attention_tflops": ".1f", "speedup": ".2f", "peak_gb": ".1f",
           **{f"{s}_ms": ".4f" for s in STAGES}}


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

class PagedSlot:
    """One set of inputs of a case for the paged wrapper: its own caches (K/V and index-K in
    128-token pages, a disjoint random page table plus one scratch page) and plan."""
    impl = "msa_prefill_paged"
    attention_route = "auto"

    def __init__(self, msa, case: PrefillCase, args, dtype, partial_dtype, device):
        pages = [-(-n // BLOCK) for n in case.kv_lens]
        n_pages = sum(pages) + 1
        perm = torch.randperm(n_pages, device=device).to(torch.int32)
        table = perm[-1:].repeat(case.batch, max(pages)).contiguous()
        start = 0
        for b, count in enumerate(pages):
            table[b, :count] = perm[start:start + count]
            start += count
        self.page_table = table
        self.k_cache = random_fill([n_pages, args.hkv, BLOCK, HEAD_DIM], dtype, device)
        self.v_cache = random_fill([n_pages, args.hkv, BLOCK, HEAD_DIM], dtype, device)
        self.k_idx_cache = random_fill([n_pages, 1, BLOCK, HEAD_DIM], dtype, device)
        self.q = random_fill([case.total_q, args.hq, HEAD_DIM], dtype, device)
        self.q_idx = random_fill([case.total_q, args.hkv, HEAD_DIM], dtype, device)
        self.wrapper = msa.MsaPrefillPagedWrapper(topk=args.topk, partial_dtype=partial_dtype,
                                                  attention_route=self.attention_route)
        self.wrapper.plan(list(case.query_lens), list(case.kv_lens), self.page_table,
                          num_qo_heads=args.hq, num_kv_heads=args.hkv)
        self.num_chunks, self.index_splits = self.wrapper.num_chunks, self.wrapper.index_splits

    def run(self, **kwargs):
        return self.wrapper.run(self.q, self.k_cache, self.v_cache, self.q_idx, self.k_idx_cache,
                                **kwargs)


class PagedSparseRouteSlot(PagedSlot):
    """The paged wrapper with every chunk on the sparse route (CSR + sparse attention +
    combine): the A/B of "auto"'s decode route for short e4m3 chunks."""
    impl = "msa_prefill_paged[sparse]"
    attention_route = "sparse"


class PagedDecodeRouteSlot(PagedSlot):
    """The paged wrapper with every chunk on the decode route (the paged decode kernel, one
    request per query, in any dtype): the other side of that A/B."""
    impl = "msa_prefill_paged[decode]"
    attention_route = "decode"


class DenseSlot:
    """One set of inputs of a case for msa.msa_prefill: dense K/V / index-K per request
    (prefix + chunk, packed), lengths on the device; the call plans its chunks itself."""
    impl = "msa_prefill_dense"

    def __init__(self, msa, case: PrefillCase, args, dtype, partial_dtype, device):
        total_k = sum(case.kv_lens)
        self.msa, self.topk, self.partial_dtype = msa, args.topk, partial_dtype
        self.k = random_fill([total_k, args.hkv, HEAD_DIM], dtype, device)
        self.v = random_fill([total_k, args.hkv, HEAD_DIM], dtype, device)
        self.k_idx = random_fill([total_k, 1, HEAD_DIM], dtype, device)
        self.q = random_fill([case.total_q, args.hq, HEAD_DIM], dtype, device)
        self.q_idx = random_fill([case.total_q, args.hkv, HEAD_DIM], dtype, device)
        self.cu_q = cu_seqlens(case.query_lens, device)
        self.cu_k = cu_seqlens(case.kv_lens, device)
        self.lens = dict(max_seqlen_q=max(case.query_lens), max_seqlen_k=case.max_kv)
        opts = msa.prefill.PrefillOptions(args.topk, 1, True, partial_dtype, None, 1.0,
                                          args.hq // args.hkv)
        chunks = msa.prefill.plan_dense_chunks(
            self.cu_q, self.cu_k, total_q=case.total_q, total_k=total_k, num_qo_heads=args.hq,
            num_kv_heads=args.hkv, opts=opts, **self.lens)
        self.num_chunks = len(chunks)
        self.index_splits = [c.index_splits for c in chunks]

    def run(self, return_selection=False):
        return self.msa.msa_prefill(self.q, self.k, self.v, self.q_idx, self.k_idx, self.cu_q,
                                    self.cu_k, topk=self.topk, partial_dtype=self.partial_dtype,
                                    return_selection=return_selection, **self.lens)


SLOTS = {"paged": PagedSlot, "paged-sparse": PagedSparseRouteSlot,
         "paged-decode": PagedDecodeRouteSlot, "dense": DenseSlot}


def slot_bytes(case: PrefillCase, args, elem: int) -> int:
    """Bytes one call touches: q, q_idx, the index-K of every page, K/V of the selected blocks
    (at most every page), O."""
    pages = sum(-(-n // BLOCK) for n in case.kv_lens)
    selected = min(pages, case.total_q * args.topk)
    return (case.total_q * (args.hq + args.hkv) * HEAD_DIM * elem
            + pages * BLOCK * HEAD_DIM * elem
            + selected * args.hkv * BLOCK * HEAD_DIM * 2 * elem
            + case.total_q * args.hq * HEAD_DIM * 2)


def slot_count(case: PrefillCase, args, elem: int, device) -> int:
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    want = 2 * l2 // max(slot_bytes(case, args, elem), 1) + 2
    return int(min(max(want, 2), args.max_slots))


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def replay_ms(graph, calls: int, args) -> (float, float):
    """(median ms per call, CV) of graph replays, upstream's way (CUDA events around each
    replay, retried while the CV exceeds 3 %)."""
    cv = float("inf")
    for _attempt in range(MAX_ATTEMPTS):
        for _ in range(args.warmup):
            graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(args.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        mean = statistics.fmean(samples)
        cv = statistics.pstdev(samples) / mean
        if cv <= MAX_CV:
            break
    return statistics.median(samples), cv


def cpu_ms(fn, args) -> (float, float):
    fn()
    samples = []
    for _ in range(max(3, min(args.replays, 5))):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples), statistics.pstdev(samples) / statistics.fmean(samples)


class StageClock:
    """Recorder for msa._stages: a timing point (an external CUDA event, or perf_counter on the
    CPU) at each mark; durations() folds consecutive marks into {stage: ms}."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def __call__(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True, external=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def durations(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for (name, a), (_next, b) in zip(self.marks, self.marks[1:]):
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            key = "copy" if name == "end" else name
            out[key] = out.get(key, 0.0) + ms
        return out


def stage_breakdown(msa, slots: list, args, device) -> Dict[str, float]:
    """Median over replays of each stage's ms per call (mean over the slots)."""
    cuda = device.type == "cuda"
    clocks = [StageClock(cuda) for _ in slots]
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for slot, clock in zip(slots, clocks):
                with msa._stages.recording(clock):
                    slot.run()
    per_stage: Dict[str, List[float]] = {}
    for _ in range(args.warmup if cuda else 0):
        graph.replay()
    for _ in range(max(args.replays // 2, 3) if cuda else 3):
        if cuda:
            graph.replay()
            torch.cuda.synchronize()
        else:
            for slot, clock in zip(slots, clocks):
                clock.marks.clear()
                with msa._stages.recording(clock):
                    slot.run()
        total: Dict[str, float] = {}
        for clock in clocks:
            for name, ms in clock.durations().items():
                total[name] = total.get(name, 0.0) + ms / len(slots)
        for name, ms in total.items():
            per_stage.setdefault(name, []).append(ms)
    return {name: statistics.median(v) for name, v in per_stage.items()}


def measured_keys(case: PrefillCase, q2k: torch.Tensor) -> int:
    """Visible selected keys of a selection [Hkv, T, topk] (bottom-right causal), summed over
    the queries and averaged over the KV heads (the analytic count is per head)."""
    device = q2k.device
    pos, kv = [], []
    for q_len, prefix in zip(case.query_lens, case.prefix_lens):
        pos.append(torch.arange(prefix, prefix + q_len, device=device))
        kv.append(torch.full((q_len,), prefix + q_len, device=device))
    pos = torch.cat(pos).view(1, -1, 1)
    kv = torch.cat(kv).view(1, -1, 1)
    block = q2k.long()
    start = block * BLOCK
    visible = (torch.minimum(pos + 1, kv) - start).clamp(0, BLOCK)
    visible = torch.where(block >= 0, visible, torch.zeros_like(visible))
    return int(visible.sum()) // q2k.shape[0]


def dense_sdpa_ms(case: PrefillCase, args, device) -> Optional[float]:
    """Dense SDPA, lower-right causal per request, bf16, KV heads expanded; one graph over the
    requests (eager events if capture fails)."""
    from torch.nn.attention.bias import causal_lower_right
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []
    for q_len, kv_len in zip(case.query_lens, case.kv_lens):
        q = random_fill([1, args.hq, q_len, HEAD_DIM], torch.bfloat16, device)
        k = random_fill([1, args.hq, kv_len, HEAD_DIM], torch.bfloat16, device)
        v = random_fill([1, args.hq, kv_len, HEAD_DIM], torch.bfloat16, device)
        calls.append((q, k, v, causal_lower_right(q_len, kv_len)))

    def run():
        return [sdpa(q, k, v, attn_mask=mask) for q, k, v, mask in calls]
    if device.type != "cuda":
        return cpu_ms(run, args)[0]
    run()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return replay_ms(graph, 1, args)[0]
    except RuntimeError as exc:
        print(f"dense {case.case_id}: graph capture failed ({str(exc).splitlines()[0]}); "
              "timing eager calls", flush=True)
        from _common import time_ms
        return time_ms(run, device, args.rep_ms)


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------

def bench_case(msa, case: PrefillCase, impl: str, dtype_name: str, args, device, dense_ms,
               sparse_form: str = "served"):
    """One row; sparse_form other than "served" forces that sparse attention form (the debug
    hook) for the eager runs, the capture and the breakdown alike."""
    if sparse_form == "served":
        return _bench_case(msa, case, impl, dtype_name, args, device, dense_ms)
    from msa._native import debug
    with debug.forcing(sparse_form=sparse_form):
        row = _bench_case(msa, case, impl, dtype_name, args, device, dense_ms)
    row["impl"] = f"{row['impl']}[{sparse_form}]"
    return row


def _bench_case(msa, case: PrefillCase, impl: str, dtype_name: str, args, device, dense_ms):
    dtype, partial_dtype = split_dtype_name(dtype_name)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    n_slots = slot_count(case, args, dtype.itemsize, device)
    slots = [SLOTS[impl](msa, case, args, dtype, partial_dtype, device)
             for _ in range(n_slots)]
    flops = attention_flops(case.selected_keys(args.topk), args.hq)
    notes = []

    eager = []
    for i, slot in enumerate(slots):
        out, q2k = slot.run(return_selection=True)
        if i == 0:
            keys = measured_keys(case, q2k)
            if keys != case.selected_keys(args.topk):
                notes.append(f"selection_keys={keys}!=analytic{case.selected_keys(args.topk)}")
        eager.append(out.clone())
        del out, q2k
    synchronize(device)
    if not all(bool(torch.isfinite(o.float()).all()) for o in eager):
        notes.append("non-finite output")

    graph_ok = ""
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_outs = [slot.run() for slot in slots]
        graph.replay()
        torch.cuda.synchronize()
        graph_ok = "equal" if all(torch.equal(a, b) for a, b in zip(graph_outs, eager)) \
            else "DIFFERS"
        with ClockSampler() as clocks:
            latency, cv = replay_ms(graph, len(slots), args)
        notes.append(clocks.note())
        del graph, graph_outs
    else:
        latency, cv = cpu_ms(slots[0].run, args)
    stages = {}
    if args.breakdown:
        try:
            stages = stage_breakdown(msa, slots, args, device)
        except RuntimeError as exc:       # e.g. timing events refused inside a graph
            notes.append(f"no breakdown ({str(exc).splitlines()[0][:80]})")
            synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None
    row = dict(case=case.case_id, batch=case.batch, total_q=case.total_q, max_kv=case.max_kv,
               weight=case.weight, lengths=case.source, dtype=dtype_name,
               impl=slots[0].impl, latency_ms=latency, cv=cv, gflop=flops / 1e9,
               eff_tflops=flops / latency / 1e9, dense_ms=dense_ms,
               speedup=dense_ms / latency if dense_ms else None,
               chunks=slots[0].num_chunks,
               index_splits="+".join(map(str, slots[0].index_splits)), slots=n_slots,
               peak_gb=peak, graph=graph_ok, note=" ".join(n for n in notes if n) or None)
    for s in STAGES:
        row[f"{s}_ms"] = stages.get(s)
    attn = sum(stages.get(s, 0.0) for s in ("attention", "combine"))
    if attn > 0:
        row["attention_tflops"] = flops / attn / 1e9
    del slots, eager
    free_memory(device)
    return row


def weighted_row(rows, dtype_name: str) -> dict:
    """Upstream's aggregate over the cases of one (impl, dtype) measured in this run."""
    w = [r["weight"] for r in rows]
    total_w = sum(w)
    lat = sum(x * r["latency_ms"] for x, r in zip(w, rows))
    flops = sum(x * r["gflop"] * 1e9 for x, r in zip(w, rows))
    row = dict(case="weighted", batch=len(rows), weight=total_w, dtype=dtype_name,
               impl=rows[0]["impl"], latency_ms=lat / total_w, gflop=flops / total_w / 1e9,
               eff_tflops=flops / lat / 1e9)
    dense = [r for r in rows if r.get("dense_ms")]
    if len(dense) == len(rows):
        row["dense_ms"] = sum(x * r["dense_ms"] for x, r in zip(w, rows)) / total_w
        row["speedup"] = row["dense_ms"] * total_w / lat
        worst = min(rows, key=lambda r: r["speedup"])
        below = sum(1 for r in rows if r["speedup"] < 4.0)
        row["note"] = (f"min_speedup={worst['speedup']:.2f}@{worst['case']} "
                       f"cases_below_4x={below}")
    for s in STAGES:
        if all(r.get(f"{s}_ms") is not None for r in rows):
            row[f"{s}_ms"] = sum(x * r[f"{s}_ms"] for x, r in zip(w, rows)) / total_w
    attn = [(r.get("attention_ms") or 0) + (r.get("combine_ms") or 0) for r in rows]
    if all(a > 0 for a in attn):
        row["attention_tflops"] = flops / sum(x * a for x, a in zip(w, attn)) / 1e9
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="case ids, id prefixes or table indices "
                                                "(default: all 66)")
    ap.add_argument("--dtypes", default="bf16,fp8,fp8_pe4m3",
                    help="bf16, fp8 (e4m3 q/k/v and index), with _p<partial> for the partial "
                         "dtype (fp8_pe4m3: the contract's e4m3 partials, half the partial "
                         "bytes); default bf16 partials")
    ap.add_argument("--impls", default="paged",
                    help="paged (MsaPrefillPagedWrapper, the engine layout), paged-sparse / "
                         "paged-decode (the same with attention_route='sparse' / 'decode') "
                         "and/or dense "
                         "(msa_prefill on packed K/V)")
    ap.add_argument("--sparse-forms", default="served",
                    help="sparse attention forms to force (cute_kernels.variants.SPARSE_FORMS "
                         "names, e.g. ws3w,wsp3w), each a run of every impl; served: the "
                         "serving table's pick")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4, help="KV heads = index heads")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--no-dense", dest="dense", action="store_false")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    add_common_args(ap, rep_ms=100)
    args = ap.parse_args(argv)
    if args.replays < 20 and not args.tiny:
        ap.error("--replays: the protocol times at least 20 replays")
    if args.tiny:
        apply_preset(args, ap, hq=8, hkv=2, dtypes="bf16", replays=3, warmup=1)
    elif args.quick:
        apply_preset(args, ap, cases=QUICK_CASES)

    device = setup(args)
    msa = load_msa()
    cases = tiny_cases() if args.tiny else select_cases(load_cases(), args.cases)
    tsv = TsvWriter(args.out, COLUMNS, device, formats=FORMATS)
    runs = [(impl, d, form) for impl in parse_names(args.impls)
            for form in parse_names(args.sparse_forms) for d in parse_names(args.dtypes)]
    unknown = sorted({impl for impl, _, _ in runs} - set(SLOTS))
    if unknown:
        ap.error(f"--impls: unknown {unknown}; known {sorted(SLOTS)}")
    from msa.cute_kernels.variants import SPARSE_FORMS
    known_forms = {"served"} | set(SPARSE_FORMS)
    unknown = sorted({form for _, _, form in runs} - known_forms)
    if unknown:
        ap.error(f"--sparse-forms: unknown {unknown}; known {sorted(known_forms)}")
    results: Dict[tuple, List[dict]] = {run: [] for run in runs}
    for case in cases:
        dense_ms = dense_sdpa_ms(case, args, device) if args.dense else None
        free_memory(device)
        for impl, dtype_name, form in runs:
            row = bench_case(msa, case, impl, dtype_name, args, device, dense_ms, form)
            tsv.write(**row)
            results[(impl, dtype_name, form)].append(row)
    for (_impl, dtype_name, _form), rows in results.items():
        if rows:
            tsv.write(**weighted_row(rows, dtype_name))
    synchronize(device)
    print(f"{tsv.rows} rows", flush=True)


if __name__ == "__main__":
    main()
