"""Production decode suite (upstream MSA's decode protocol): dense and MSA decode steps against
cuDNN dense decode, 8 queries per request (1 + 7 multi-token-prediction drafts), whole calls in
CUDA graphs, inputs rotated out of L2.

Cases: the production grid B in {8, 32, 64, 128} x nominal KV in {1K, 4K, 5K, 10K, 50K, 100K,
200K} (28 cases with upstream's traffic weights, summing to 10000) and the low-latency grid
B in {1, 2, 4} x {1K, 4K, 8K, 32K} (weight 0); suite "acceptance" (not run by default) is
B 32 at 128k, the one-query step's bar (--seqlen-q 1). Lengths are ragged: pairs L = nominal +- d with
d uniform in [nominal / 20, nominal / 4] (one request at the nominal length when B is odd), so
the batch holds exactly B x nominal keys; seeded per case, identical for every implementation.

Implementations (--impls), Hq = 64, Hkv = 4, D = 128, pages of 128 tokens shuffled over a pool:
  cudnn            torch SDPA, cuDNN backend, bf16 K/V [B, Hkv, nominal, 128] (the same number
                   of key bytes as the ragged batch), each KV head's G x seqlen_q query rows
                   folded into one non-causal sequence;
  dense-bf16/fp8   SparseDecodePagedAttentionWrapper without a selection (q of the cache dtype);
  step-bf16        MSADecodeStepWrapper: update() + the fused indexer over a bf16 index-K cache
                   (bf16 index queries, Hkv index heads, topk 16, own block forced) + sparse
                   attention over bf16 K/V;
  step-fp8         the same with e4m3 q / K / V, e4m3 index queries and keys;
  step-fp8-nvfp4   e4m3 q / K / V with NVFP4 index keys (msa.quantize, 128x4 scales).

Timing: each implementation's call is captured once per input slot in one CUDA graph (calls per
graph: enough for ~2 ms, a multiple of the slot count); slots are disjoint copies of every input
(caches, tables, queries, plans) so the same bytes come back only after > 2x the L2 size;
5 warm-up replays, then --replays timed replays (CUDA events), the median per call is reported
with its coefficient of variation. bytes_read = bytes the call must read: K+V of every key
(dense, cudnn), the index-K history blocks plus K+V of the union of each (request, KV head)'s
selected blocks (step), plus the queries. Rows go to --out (TSV: gpu, commit, date first); the
last rows per implementation are weighted aggregates over the production cases
(sum w * latency, and the weighted speedup sum w * t_cudnn / sum w * t). attention_us (step
rows): the step's sparse attention alone, replayed the same way over the selection the step
left in its q2k buffer; latency_us - attention_us is the plan update, indexer and top-k. The
note holds the median SM clock and power nvidia-smi sampled during the replays (ClockSampler).

    python benchmarks/bench_decode_production.py --out benchmarks/results/decode_production_h200.tsv
    python benchmarks/bench_decode_production.py --quick        # a few cases, a smoke test
    python benchmarks/plot_decode_production.py benchmarks/results/decode_production_h200.tsv
"""

from __future__ import annotations

import argparse
from importlib import import_module
from typing import Dict, List, Optional

import torch

from _common import (BLOCK, HEAD_DIM, ClockSampler, add_common_args, apply_preset, fits,
                     forcing, free_memory, graph_replays, load_msa, parse_names, random_fill,
                     setup, synchronize, time_ms, TsvWriter)

COLUMNS = ("suite", "case", "batch", "nominal_kv", "seqlen_q", "weight", "impl", "kv_dtype",
           "index_dtype", "backend", "latency_us", "attention_us", "bytes_read", "tb_per_s",
           "speedup_vs_cudnn", "slots", "calls", "cv", "note")
PRODUCTION_BATCHES = (8, 32, 64, 128)
PRODUCTION_KV = (1000, 4000, 5000, 10000, 50000, 100000, 200000)
# Upstream's traffic weights per (nominal KV, batch index); they sum to 10000.
PRODUCTION_WEIGHTS = {1000: (30, 90, 180, 300), 4000: (40, 120, 240, 400),
                      5000: (50, 150, 300, 500), 10000: (140, 350, 490, 420),
                      50000: (500, 800, 500, 200), 100000: (1260, 980, 420, 140),
                      200000: (910, 350, 112, 28)}
LOW_LATENCY_BATCHES = (1, 2, 4)
LOW_LATENCY_KV = (1000, 4000, 8000, 32000)
IMPLS = ("cudnn", "dense-bf16", "dense-fp8", "step-bf16", "step-fp8", "step-fp8-nvfp4")
CASE_SEED = 1701
# --attention-forms: the decode debug hooks of each (forced forms run whatever the gates say;
# the warpgroup forms turn the token-warps form off, which would take sparse e4m3 tiles).
_WARPGROUP = dict(decode_warpgroup=True, decode_token_warps=False)
ATTENTION_FORMS = {"served": {}, "rows": dict(decode_warpgroup=False),
                   "warpgroup": dict(_WARPGROUP, decode_pingpong=False),
                   "pingpong": dict(_WARPGROUP, decode_pingpong=True, decode_persistent=False,
                                    decode_pv_fp8=False),
                   "persistent": dict(_WARPGROUP, decode_pingpong=True, decode_persistent=True,
                                      decode_pv_fp8=False),
                   "pingpong_pv8": dict(_WARPGROUP, decode_pingpong=True,
                                        decode_persistent=False, decode_pv_fp8=True),
                   "persistent_pv8": dict(_WARPGROUP, decode_pingpong=True,
                                          decode_persistent=True, decode_pv_fp8=True),
                   "token_warps": dict(decode_token_warps=True),
                   "token_warps_per_warp": dict(decode_token_warps="per_warp")}
# The dense plans of the forms that force decode_persistent: a persistent form plans the
# persistent form wherever the call can take it (not only where schedules.decode.persistent_pays),
# a ping-pong form never.
PLAN_PERSISTENT = {name: hooks["decode_persistent"] for name, hooks in ATTENTION_FORMS.items()
                   if "decode_persistent" in hooks}
WARMUP_REPLAYS = 5
GRAPH_TARGET_US = 2000.0
MAX_CALLS = 120


def production_cases():
    """(suite, batch, nominal, weight) of the 28 production and 12 low-latency cases, and the
    acceptance case of issue 24's one-query step (B 32 at 128k; run it with --seqlen-q 1)."""
    cases = [("production", b, kv, PRODUCTION_WEIGHTS[kv][i]) for kv in PRODUCTION_KV
             for i, b in enumerate(PRODUCTION_BATCHES)]
    assert len(cases) == 28 and sum(c[3] for c in cases) == 10000
    cases += [("low-latency", b, kv, 0) for kv in LOW_LATENCY_KV for b in LOW_LATENCY_BATCHES]
    cases += [("acceptance", 32, 131072, 0)]
    return cases


def ragged_lengths(batch: int, nominal: int, seqlen_q: int) -> List[int]:
    """B lengths averaging exactly `nominal`: pairs nominal +- d, d ~ U[nominal/20, nominal/4]."""
    gen = torch.Generator().manual_seed(CASE_SEED * 7919 + batch * 131 + nominal)
    lo = max(1, nominal // 20)
    hi = max(lo, nominal // 4)
    deltas = torch.randint(lo, hi + 1, (batch // 2,), generator=gen).tolist()
    lens = [nominal - d for d in deltas] + [nominal + d for d in deltas]
    if batch % 2:
        lens.append(nominal)
    order = torch.randperm(batch, generator=gen).tolist()
    lens = [max(lens[i], seqlen_q) for i in order]
    return lens


class Slot:
    """One disjoint copy of a call's inputs: its own pages of the pool, page table, queries."""

    def __init__(self, lens, args, device, kv_dtype, index_format, with_kv=True):
        self.lens = lens
        pages_each = [-(-n // BLOCK) for n in lens]
        self.width = max(pages_each)
        num_pages = sum(pages_each)
        batch, sq = len(lens), args.seqlen_q
        perm = torch.randperm(num_pages, device=device, dtype=torch.int64).to(torch.int32)
        self.page_table = torch.zeros(batch, self.width, dtype=torch.int32, device=device)
        start = 0
        for b, n in enumerate(pages_each):
            self.page_table[b, :n] = perm[start:start + n]
            start += n
        self.seqused_k = torch.tensor(lens, dtype=torch.int32, device=device)
        self.q = random_fill([batch * sq, args.hq, HEAD_DIM], kv_dtype, device)
        self.out = torch.empty(self.q.shape, dtype=torch.bfloat16, device=device)
        if with_kv:
            self.k = random_fill([num_pages, args.hkv, BLOCK, HEAD_DIM], kv_dtype, device)
            self.v = random_fill([num_pages, args.hkv, BLOCK, HEAD_DIM], kv_dtype, device)
        self.index_format = index_format
        self.k_scale = self.k_global = None
        if index_format is not None:
            q_dtype = torch.bfloat16 if index_format == "bf16" else torch.float8_e4m3fn
            self.q_idx = random_fill([batch * sq, args.hkv, HEAD_DIM], q_dtype, device)
            if index_format == "nvfp4":
                self.k_idx, self.k_scale, self.k_global = _nvfp4_cache(num_pages, device)
            else:
                self.k_idx = random_fill([num_pages, 1, BLOCK, HEAD_DIM], q_dtype, device)


def _nvfp4_cache(num_pages, device):
    """A random NVFP4 index-K cache (data, 128x4 scales, global scale), quantized in chunks."""
    import msa
    data = torch.empty(num_pages, 1, BLOCK, HEAD_DIM // 2, dtype=torch.uint8, device=device)
    scale = torch.empty(num_pages * BLOCK * 8, dtype=torch.uint8, device=device)
    global_scale = None
    chunk = 4096                                  # pages per quantizer call (bounded scratch)
    for p0 in range(0, num_pages, chunk):
        n = min(chunk, num_pages - p0)
        quant = msa.quantize_bf16_to_nvfp4_128x4(
            torch.randn(n, 1, BLOCK, HEAD_DIM, device=device).to(torch.bfloat16))
        data[p0:p0 + n] = quant.data
        scale[p0 * BLOCK * 8:(p0 + n) * BLOCK * 8] = quant.scale_128x4.reshape(-1)
        global_scale = quant.global_scale if global_scale is None else global_scale
    return data, scale, global_scale


def kv_bytes_per_token(args, elem: int) -> int:
    return 2 * args.hkv * HEAD_DIM * elem


def index_page_bytes(index_format: str) -> int:
    return {"bf16": BLOCK * HEAD_DIM * 2, "e4m3": BLOCK * HEAD_DIM,
            "nvfp4": BLOCK * HEAD_DIM // 2 + BLOCK * 8}[index_format]


class Impl:
    """One implementation on one case: builds slots, a call per slot, the bytes it reads."""

    def __init__(self, name, msa, lens, nominal, args, device, qo_tile_rows=None,
                 persistent=None, split_pages=None):
        self.name, self.msa, self.lens, self.nominal = name, msa, lens, nominal
        self.args, self.device = args, device
        self.qo_tile_rows = qo_tile_rows              # None: the plan chooses
        self.split_pages = split_pages                # None: the plan chooses
        self.persistent = persistent                  # dense plans: None, the plan chooses
        kind, _, rest = name.partition("-")
        self.kind = kind
        self.kv_dtype = torch.bfloat16 if kind == "cudnn" or rest.startswith("bf16") else \
            torch.float8_e4m3fn
        self.index_format = None
        if kind == "step":
            self.index_format = "nvfp4" if rest.endswith("nvfp4") else (
                "bf16" if rest == "bf16" else "e4m3")

    @property
    def kv_name(self):
        return "bf16" if self.kv_dtype == torch.bfloat16 else "fp8"

    def footprint(self) -> int:
        """Device bytes of one slot (10 % slack)."""
        tokens = sum(-(-n // BLOCK) * BLOCK for n in self.lens)
        elem = self.kv_dtype.itemsize
        total = tokens * kv_bytes_per_token(self.args, elem)
        if self.kind == "cudnn":
            total = len(self.lens) * self.nominal * kv_bytes_per_token(self.args, 2)
        if self.index_format is not None:
            total += tokens // BLOCK * index_page_bytes(self.index_format)
        return int(1.1 * total)

    def make_slot(self):
        args, device = self.args, self.device
        if self.kind == "cudnn":
            return _CudnnSlot(len(self.lens), self.nominal, args, device)
        slot = Slot(self.lens, args, device, self.kv_dtype, self.index_format)
        if self.kind == "dense":
            schedules = import_module(f"{self.msa.__name__}.schedules.decode")
            can_persist = schedules.persistent_can_run(
                len(self.lens), args.seqlen_q, args.hq // args.hkv,
                self.qo_tile_rows or schedules.QO_TILE_ROWS)
            slot.wrapper = self.msa.SparseDecodePagedAttentionWrapper().plan(
                page_table=slot.page_table, seqused_k=slot.seqused_k, seqlen_q=args.seqlen_q,
                max_seqlen_k=max(self.lens), num_qo_heads=args.hq, num_kv_heads=args.hkv,
                enable_cuda_graph=True, qo_tile_rows=self.qo_tile_rows,
                fixed_split_size=self.split_pages,
                persistent=self.persistent if can_persist and self.split_pages is None
                else None)
            slot.call = lambda s=slot: s.wrapper.run(s.q, s.k, s.v, out=s.out)
        else:
            slot.wrapper = self.msa.MSADecodeStepWrapper().plan(
                page_table=slot.page_table, seqused_k=slot.seqused_k, seqlen_q=args.seqlen_q,
                max_seqlen_k=max(self.lens), num_qo_heads=args.hq, num_kv_heads=args.hkv,
                topk=args.topk, qo_tile_rows=self.qo_tile_rows,
                fixed_split_size=self.split_pages)

            def step(s=slot):
                s.wrapper.update()
                return s.wrapper.run(s.q, s.k, s.v, s.q_idx, s.k_idx, k_idx_scale=s.k_scale,
                                     k_idx_global_scale=s.k_global, out=s.out)
            slot.call = step
        return slot

    def bytes_read(self, slot) -> int:
        args = self.args
        q_bytes = slot.q.numel() * slot.q.element_size()
        if self.kind == "cudnn":
            return slot.kv_bytes + q_bytes
        per_token = kv_bytes_per_token(args, self.kv_dtype.itemsize)
        if self.kind == "dense":
            return sum(self.lens) * per_token + q_bytes
        history = sum(max(n - 1, 0) // BLOCK for n in self.lens)
        index = history * index_page_bytes(self.index_format)
        index += slot.q_idx.numel() * slot.q_idx.element_size()
        return index + _selected_kv_bytes(slot, args, per_token // args.hkv) + q_bytes


class _CudnnSlot:
    def __init__(self, batch, nominal, args, device):
        shape = [batch, args.hkv, nominal, HEAD_DIM]
        self.k = random_fill(shape, torch.bfloat16, device)
        self.v = random_fill(shape, torch.bfloat16, device)
        rows = args.hq // args.hkv * args.seqlen_q
        self.q = random_fill([batch, args.hkv, rows, HEAD_DIM], torch.bfloat16, device)
        self.kv_bytes = 2 * self.k.numel() * 2
        self.call = self.cudnn if device.type == "cuda" else self.math

    def cudnn(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):   # cuDNN only: fail rather than swap
            return torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v)

    def math(self):
        return torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v)


def _selected_kv_bytes(slot, args, per_token_head: int) -> int:
    """K+V bytes of the union of the blocks each (request, KV head) selected (last run)."""
    sel = slot.wrapper.q2k_indices.view(args.hkv, len(slot.lens), args.seqlen_q, -1).cpu()
    total = 0
    for b, n in enumerate(slot.lens):
        for h in range(args.hkv):
            ids = torch.unique(sel[h, b])
            ids = ids[(ids >= 0) & (ids * BLOCK < n)]
            total += int(sum(min(BLOCK, n - int(i) * BLOCK) for i in ids)) * per_token_head
    return total


def time_slots(slots, device, args):
    """(median us per call, coefficient of variation, calls per graph) of the slots' calls."""
    if device.type != "cuda":
        calls = [s.call for s in slots]
        ms = time_ms(lambda: [c() for c in calls], device, args.rep_ms) / len(calls)
        return ms * 1e3, None, len(calls)
    return graph_replays([s.call for s in slots], device, args.replays,
                         target_us=GRAPH_TARGET_US, max_calls=MAX_CALLS, warmup=WARMUP_REPLAYS)


def slot_count(bytes_per_call: int, device, args) -> int:
    """Slots so that the same bytes return only after > 2x L2 (1 when a call alone exceeds it)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    # The other slots' bytes lie between two reads of a slot: (S - 1) * bytes > 2 * L2.
    return 1 if bytes_per_call > 2 * l2 else 2 * l2 // max(bytes_per_call, 1) + 2


def run_impl(impl: Impl, args, device) -> Optional[Dict]:
    """Build the slots of one implementation and time it; None (with a note) when it does not
    fit the memory limit or cannot run."""
    probe = None
    try:
        probe = impl.make_slot()
        probe.call()
    except torch.cuda.OutOfMemoryError as exc:
        probe = None
        free_memory(device)
        print(f"skip {impl.name}: out of memory", flush=True)
        return dict(note=f"out of memory: {str(exc).splitlines()[0][:120]}")
    except (NotImplementedError, RuntimeError) as exc:   # a size a kernel refuses, no cuDNN
        print(f"skip {impl.name}: {str(exc).splitlines()[0]}", flush=True)
        return None
    synchronize(device)
    bytes_read = impl.bytes_read(probe)
    backend = _backend_of(impl)
    slots_wanted = slot_count(bytes_read, device, args)
    limit = int(args.mem_limit_gb * 1e9 // max(impl.footprint(), 1))
    slots = [probe]
    note = None
    try:
        while len(slots) < min(slots_wanted, limit):
            slots.append(impl.make_slot())
    except torch.cuda.OutOfMemoryError:
        free_memory(device)                   # time the slots that fit
    if len(slots) < slots_wanted:
        note = f"only {len(slots)} of {slots_wanted} L2-rotation slots fit in memory"
    # The SM clock and power during the replays: a peer (cuDNN) and ours compare only at the
    # same clock, and the H200's power cap moves it between runs.
    with ClockSampler() as clocks:
        us, cv, calls = time_slots(slots, device, args)
    note = " ".join(x for x in (note, clocks.note()) if x) or None
    attention_us = None
    if impl.kind == "step":
        # The sparse attention alone, over the selection the step just wrote.
        attention = [_AttentionOnly(s) for s in slots]
        attention_us = time_slots(attention, device, args)[0]
        del attention
    num_slots = len(slots)
    del slots, probe
    free_memory(device)
    return dict(latency_us=us, attention_us=attention_us, bytes_read=bytes_read,
                tb_per_s=bytes_read / us / 1e6, backend=backend, slots=num_slots, calls=calls,
                cv=cv, note=note)


class _AttentionOnly:
    """A step slot's attention stage as a slot of its own (time_slots calls .call())."""

    def __init__(self, slot):
        self.slot = slot

    def call(self):
        s = self.slot
        return s.wrapper.attention.run(s.q, s.k, s.v, out=s.out)


def _backend_of(impl: Impl) -> str:
    backend = impl.msa._backend.last_backend
    if impl.kind == "cudnn":
        return "cudnn" if impl.device.type == "cuda" else "math"
    if impl.kind == "dense":
        return backend("sparse_decode_atten") or "?"
    return f"{backend('sparse_decode_atten')}/{backend('decode_indexer_topk')}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", default="production,low-latency")
    ap.add_argument("--batches", default="", help="keep only these batch sizes")
    ap.add_argument("--kv", default="", help="keep only these nominal KV lengths")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--seqlen-q", type=int, default=8, help="queries per request (1 + MTP)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4, help="KV heads (= index heads of the step)")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--attention-forms", default="served",
                    help="decode attention forms for tiles of > 16 rows, each timed in turn "
                         "(comma-separated): served (what the gates serve), rows, warpgroup "
                         "(two-stage), pingpong (producer + two consumer warpgroups, the "
                         "plan's work items), persistent (its persistent form, planned "
                         "wherever it can run), pingpong_pv8 / persistent_pv8 (those with "
                         "e4m3 P.V: e4m3 K/V only), token_warps (sparse e4m3 tiles: a warp "
                         "per 16 rows, only its tokens' pages; with --qo-tile-rows 128 from "
                         "10k keys, where the plan would take query tiles) and its forms "
                         "token_warps_per_warp; a forced form's rows name it in impl, e.g. "
                         "dense-bf16[rows]")
    ap.add_argument("--qo-tile-rows", default="auto",
                    help="query rows per attention CTA, each timed in turn (comma-separated): "
                         "auto (what the plan picks) or 1..128; a fixed value names it in "
                         "impl, e.g. step-fp8[q16]")
    ap.add_argument("--split-pages", default="auto",
                    help="the attention plan's KV chunk, each timed in turn (comma-separated): "
                         "auto (what the plan picks) or a page count (fixed_split_size: "
                         "split-KV with chunks of that many pages; slots for one-token tiles), "
                         "named in impl, e.g. step-fp8[split16]")
    add_common_args(ap, rep_ms=50)
    args = ap.parse_args(argv)
    if args.tiny:
        apply_preset(args, ap, suites="tiny", seqlen_q=2, hq=8, hkv=2, replays=3, rep_ms=5)
    elif args.quick:
        apply_preset(args, ap, batches="8,32", kv="4000,100000", suites="production")

    device = setup(args)
    msa = load_msa()
    forms = parse_names(args.attention_forms)
    unknown = set(forms) - set(ATTENTION_FORMS)
    if unknown:
        raise SystemExit(f"--attention-forms: unknown {sorted(unknown)}; known "
                         f"{list(ATTENTION_FORMS)}")
    tiles = parse_names(args.qo_tile_rows)
    if any(t != "auto" and not (t.isdigit() and 1 <= int(t) <= 128) for t in tiles):
        raise SystemExit(f"--qo-tile-rows: auto or 1..128, got {args.qo_tile_rows}")
    splits = parse_names(args.split_pages)
    if any(x != "auto" and not (x.isdigit() and int(x) >= 1) for x in splits):
        raise SystemExit(f"--split-pages: auto or a positive page count, got {args.split_pages}")
    tsv = TsvWriter(args.out, COLUMNS, device,
                    formats={"latency_us": ".2f", "attention_us": ".2f", "tb_per_s": ".3f",
                             "speedup_vs_cudnn": ".2f", "cv": ".3f"})
    suites = parse_names(args.suites)
    cases = [("tiny", 2, 300, 1)] if "tiny" in suites else [
        c for c in production_cases() if c[0] in suites]
    if args.batches:
        cases = [c for c in cases if str(c[1]) in parse_names(args.batches)]
    if args.kv:
        cases = [c for c in cases if str(c[2]) in parse_names(args.kv)]
    impls = parse_names(args.impls)
    totals: Dict[str, List[float]] = {}
    for suite, batch, nominal, weight in cases:
        lens = ragged_lengths(batch, nominal, args.seqlen_q)
        case = f"b{batch}_s{nominal}_q{args.seqlen_q}"
        cudnn_us = None
        runs = [(name, form, tile, split) for name in impls
                for form in (["served"] if name == "cudnn" else forms)
                for tile in (["auto"] if name == "cudnn" else tiles)
                for split in (["auto"] if name == "cudnn" else splits)]
        for base, form, tile, split in runs:
            labels = [x for x in (form if form != "served" else "",
                                  f"q{tile}" if tile != "auto" else "",
                                  f"split{split}" if split != "auto" else "") if x]
            name = f"{base}[{','.join(labels)}]" if labels else base
            impl = Impl(base, msa, lens, nominal, args, device,
                        qo_tile_rows=None if tile == "auto" else int(tile),
                        persistent=PLAN_PERSISTENT.get(form),
                        split_pages=None if split == "auto" else int(split))
            if not fits(impl.footprint(), args, f"{name} {case}"):
                continue
            with forcing(msa, **ATTENTION_FORMS[form]):
                result = run_impl(impl, args, device)
            if result is None:
                continue
            if "latency_us" not in result:         # out of memory: a row that says so
                tsv.write(suite=suite, case=case, batch=batch, nominal_kv=nominal,
                          seqlen_q=args.seqlen_q, weight=weight, impl=name,
                          kv_dtype=impl.kv_name, index_dtype=impl.index_format, **result)
                continue
            if name == "cudnn":
                cudnn_us = result["latency_us"]
            tsv.write(suite=suite, case=case, batch=batch, nominal_kv=nominal,
                      seqlen_q=args.seqlen_q, weight=weight, impl=name, kv_dtype=impl.kv_name,
                      index_dtype=impl.index_format,
                      speedup_vs_cudnn=cudnn_us / result["latency_us"] if cudnn_us else None,
                      **result)
            if weight and cudnn_us:
                acc = totals.setdefault(name, [0.0, 0.0, 0])
                acc[0] += weight * result["latency_us"]
                acc[1] += weight * cudnn_us
                acc[2] += weight
    for name, (weighted_us, weighted_cudnn, weights) in totals.items():
        tsv.write(suite="aggregate", case="weighted", seqlen_q=args.seqlen_q, weight=weights,
                  impl=name, latency_us=weighted_us / weights,
                  speedup_vs_cudnn=weighted_cudnn / weighted_us,
                  note="sum w * latency / sum w over the cases that ran with cudnn")
    synchronize(device)
    print(f"{tsv.rows} rows", flush=True)


if __name__ == "__main__":
    main()
