"""Shared helpers of the benchmark scripts: loading msa, timing, TSV output, sizes and guards.

Every benchmark writes one TSV row per measurement with the GPU name, the commit and the date in
front, appends to ``--out`` (header only when the file is new) and flushes after each row, so a
run that times out still leaves its finished rows behind. ``--device cpu --tiny`` runs a minimal
configuration on the CPU (timed with ``time.perf_counter``) so CI exercises every code path.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128          # MSA KV block / page size (tokens)
HEAD_DIM = 128
GIB = 1 << 30


def load_msa():
    """Import msa the way every script and test does (built variant, else the source tree)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from msa_loading import load_msa as load
    return load()


def native_module(msa, name: str):
    """msa's native-kernel module `name` (e.g. "fmha_sm90": its VALIDATED flags and test hooks),
    or None in a build without native kernels."""
    from importlib import import_module
    try:
        return import_module(f"{msa.__name__}._native.{name}")
    except ImportError:
        return None


def forcing(msa, **hooks):
    """msa._native.debug.forcing(**hooks): e.g. forcing(msa, fmha_form="wsu") makes msa.fmha
    run that form where it is built; a value "served" sets no hook (the serving tables pick);
    a build without native kernels gets a no-op context."""
    debug = native_module(msa, "debug")
    hooks = {name: None if value == "served" else value for name, value in hooks.items()}
    return debug.forcing(**hooks) if debug is not None else contextlib.nullcontext()


@contextlib.contextmanager
def native_tier(tier: str):
    """Dispatch to `tier` for the block (the benchmarks' --tiers): "portable" sets
    MSA_NATIVE_TIER=portable and opens the gate of its not yet validated kernels; "hopper"
    changes nothing."""
    if tier not in ("hopper", "portable"):
        raise SystemExit(f"--tiers: expected hopper or portable, got {tier!r}")
    saved = {name: os.environ.get(name) for name in ("MSA_NATIVE_TIER",
                                                      "MSA_UNVALIDATED_KERNELS")}
    if tier == "portable":
        os.environ.update(MSA_NATIVE_TIER="portable", MSA_UNVALIDATED_KERNELS="1")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def tier_backend(msa, op: str, probe: Callable[[], object], tier: str, what: str
                 ) -> Optional[str]:
    """The backend `tier` runs `op` on (probe(): a small call of it), or None, with a printed
    skip, when a tier other than hopper does not serve it."""
    with native_tier(tier):
        backend = probe_backend(msa, op, probe)
    if tier != "hopper" and backend != tier:
        print(f"skip {what} [{tier}]: the tier does not serve it (ran: {backend})", flush=True)
        return None
    return backend


def ran_form(msa, op: str) -> Optional[str]:
    """The serving-table form of the last native launch of `op` ("fmha_dense",
    "sparse_atten", ...), None when none ran (a reference call, or no native kernels)."""
    debug = native_module(msa, "debug")
    name = debug.last_variant(op) if debug is not None else None
    if name is None:
        return None
    from importlib import import_module
    return import_module(f"{msa.__name__}.cute_kernels.variants").form_of(name)


def git_commit() -> str:
    """MSA_COMMIT when set (the device machine has no .git), else the checkout's short HEAD."""
    if os.environ.get("MSA_COMMIT"):
        return os.environ["MSA_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_sizes(text: str) -> List[int]:
    """'32k,64k,131072' -> [32768, 65536, 131072] ('k' = 1024, 'm' = 1048576); '' -> []."""
    sizes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        mult = {"k": 1 << 10, "m": 1 << 20}.get(item[-1], 1)
        sizes.append(int(item[:-1] if mult > 1 else item) * mult)
    return sizes


def parse_names(text: str) -> List[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_common_args(parser: argparse.ArgumentParser, rep_ms: int, steady_ms: int = 0) -> None:
    """The flags every benchmark shares (output, subsets, device, timing, guards)."""
    parser.add_argument("--out", default=None,
                        help="TSV path (appended; the header is written when the file is new)")
    parser.add_argument("--quick", action="store_true", help="a small, fast subset")
    parser.add_argument("--tiny", action="store_true",
                        help="minimal shapes (with --device cpu: a CI smoke run in seconds)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--rep-ms", type=int, default=rep_ms,
                        help="timing budget per measurement (do_bench rep)")
    parser.add_argument("--steady-ms", type=int, default=steady_ms,
                        help="before each CUDA measurement, run the call back to back (L2 "
                             "flushed, as timed) this long, so it is timed at the clock its own "
                             "sustained power draw settles to, not at the previous case's "
                             f"(default {steady_ms}; see time_ms)")
    parser.add_argument("--seed", type=int, default=None, help="default: fresh per run")
    parser.add_argument("--mem-limit-gb", type=float, default=100.0,
                        help="skip configurations whose estimated device memory exceeds this")
    parser.add_argument("--ref-max-tokens", type=int, default=None,
                        help="skip sizes above this many tokens when an op would run its "
                             "PyTorch reference, which is slow (default: 8192 on CUDA, no "
                             "limit on the CPU)")


def apply_preset(args, parser: argparse.ArgumentParser, **values) -> None:
    """Set the --tiny / --quick sizes, but only for flags the user left at their default."""
    for name, value in values.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


def setup(args) -> torch.device:
    """Resolve --device, seed torch, and return the device."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --tiny)")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"seed={seed} device={device_name(device)}", flush=True)
    return device


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def time_ms(fn: Callable[[], object], device: torch.device, rep_ms: int = 200,
            warmup_ms: int = 25, steady_ms: int = 0) -> float:
    """Median milliseconds of one fn() call.

    CUDA: ``triton.testing.do_bench`` (warm-up, L2 flush between calls, median), or CUDA events
    when Triton is missing; with steady_ms, first steady_ms of back-to-back flushed calls. Why:
    the H200 caps its power at 700 W, and a bf16 FMHA at 4k drawing ~690 W drops from 1.98 to
    1.80-1.87 GHz within ~100 ms of back-to-back calls (450 -> 505 us per call), while an e4m3
    one at ~610-690 W keeps 1.97-1.98 GHz (docs/design-fmha.md); do_bench's own
    warm-up (25 ms) then times a case partly at the clock the previous case left. CPU:
    ``time.perf_counter`` around each call, 3 to 20 calls within rep_ms after one warm-up call.
    """
    if device.type == "cuda":
        if steady_ms > 0:
            _run_flushed_for(fn, steady_ms)
        try:
            import triton.testing
        except ImportError:
            return _time_cuda_events(fn, rep_ms, warmup_ms)
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    samples: List[float] = []
    budget_end = time.perf_counter() + rep_ms / 1e3
    while len(samples) < 3 or (len(samples) < 20 and time.perf_counter() < budget_end):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


_FLUSH_BUFFER: Optional[torch.Tensor] = None


def flush_l2() -> None:
    """Evict the L2 as do_bench does before each call: zero a 256 MB buffer (allocated once)."""
    global _FLUSH_BUFFER
    if _FLUSH_BUFFER is None:
        _FLUSH_BUFFER = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int, device="cuda")
    _FLUSH_BUFFER.zero_()


def _run_flushed_for(fn, ms: int) -> None:
    """fn() back to back for about ms milliseconds, each call after an L2 flush."""
    fn()                          # a first call's setup (a cuDNN plan, a compile) is not load
    torch.cuda.synchronize()
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        for _ in range(8):
            flush_l2()
            fn()
        torch.cuda.synchronize()


class ClockSampler:
    """GPU 0's SM clock and power sampled by nvidia-smi every 50 ms while the block runs;
    .note() is then 'sm=<median MHz>MHz <median W>W' over the samples drawing at least half the
    block's peak power (the host-bound moments, a first call's setup, read as an idle GPU and
    would pull the median down to ~120 W), or '' without nvidia-smi or samples."""

    def __enter__(self):
        self._proc = None
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--id=0", "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", "50"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        self._rows = []
        if self._proc is not None:
            self._proc.terminate()
            for line in self._proc.communicate()[0].splitlines():
                try:
                    self._rows.append(tuple(float(x) for x in line.split(",")))
                except ValueError:
                    pass
        return False

    def note(self) -> str:
        if not self._rows:
            return ""
        peak = max(r[1] for r in self._rows)
        busy = [r for r in self._rows if r[1] >= 0.5 * peak]
        mhz = statistics.median(r[0] for r in busy)
        watts = statistics.median(r[1] for r in busy)
        return f"sm={mhz:.0f}MHz {watts:.0f}W"


def _time_cuda_events(fn, rep_ms: int, warmup_ms: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(1, int(warmup_ms / once))):
        fn()
    samples = []
    for _ in range(max(3, min(1000, int(rep_ms / once)))):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def graph_replays(calls, device, replays: int, *, target_us: float = 2000.0,
                  max_calls: Optional[int] = None, warmup: int = 1):
    """Times the calls (each once, eagerly and on a side stream first, as capture wants) as one
    CUDA graph that repeats them in turn to ~target_us (a whole number of rounds, at most
    max_calls calls); returns (median us per call, coefficient of variation, calls per graph)
    over `replays` replays after `warmup` ones."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    torch.cuda.synchronize(device)
    once_us = max(start.elapsed_time(end) * 1e3 / len(calls), 1.0)
    total = int(target_us / once_us)
    if max_calls is not None:
        total = min(max_calls, total)
    total = max(len(calls), -(-max(1, total) // len(calls)) * len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(total):
            calls[i % len(calls)]()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / total)
    del graph
    mean = statistics.fmean(samples)
    cv = statistics.pstdev(samples) / mean if mean > 0 else None
    return statistics.median(samples), cv, total


def graph_us(calls, device, replays: int) -> float:
    """Median microseconds per call of a CUDA graph of the calls, repeated to ~2 ms."""
    return graph_replays(calls, device, replays)[0]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back. Collects first: a slot whose call is a
    lambda bound to the slot itself is a reference cycle, freed only by the cyclic GC."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Guards: memory estimates and the slow reference backend
# ---------------------------------------------------------------------------------------------

def fits(estimated_bytes: float, args, what: str) -> bool:
    """True when the estimate is within --mem-limit-gb; otherwise prints a skip note."""
    limit = args.mem_limit_gb * 1e9
    if estimated_bytes <= limit:
        return True
    print(f"skip {what}: needs ~{estimated_bytes / 1e9:.1f} GB > --mem-limit-gb "
          f"{args.mem_limit_gb:g}", flush=True)
    return False


def reference_too_slow(backend: Optional[str], tokens: int, device: torch.device, args,
                       what: str) -> bool:
    """True (and a printed note) when `backend` is the PyTorch reference and the size is above
    --ref-max-tokens (default 8192 on CUDA, unlimited on the CPU): a reference run at a large
    size could take minutes."""
    limit = args.ref_max_tokens
    if limit is None:
        limit = 8192 if device.type == "cuda" else float("inf")
    if backend != "reference" or tokens <= limit:
        return False
    print(f"skip {what}: the backend is the PyTorch reference, which is slow at {tokens} tokens "
          f"(> --ref-max-tokens {limit})", flush=True)
    return True


def random_fill(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                chunk_bytes: int = GIB) -> torch.Tensor:
    """Random normal tensor of any dtype (e4m3 included), filled in chunks along dim 0 so a
    tens-of-GB cache never needs a second full-size float copy."""
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(shape[0], -1) if out.numel() else out
    per_row = max(1, flat.shape[1] * 4) if out.numel() else 1
    rows = max(1, chunk_bytes // per_row)
    for start in range(0, shape[0], rows):
        part = flat[start:start + rows]
        part.copy_(torch.randn(part.shape, device=device, dtype=torch.float32).to(dtype))
    return out


def cu_seqlens(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """[B+1] int32 prefix sums of the lengths."""
    total = [0]
    for n in lengths:
        total.append(total[-1] + int(n))
    return torch.tensor(total, dtype=torch.int32, device=device)


def dtype_of(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}[name]


def split_dtype_name(name: str):
    """(q/k/v and index dtype, partial_dtype) of a --dtypes entry: "bf16", "fp8", or either with
    "_p<partial>" (e.g. fp8_pe4m3: e4m3 partials; default bf16 partials)."""
    base, _, partial = name.partition("_p")
    partials = {"": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp32": torch.float32, "e4m3": torch.float8_e4m3fn}
    return dtype_of(base), partials[partial]


def time_dense_sdpa(triples, causal: bool, device: torch.device, rep_ms: int):
    """(median ms, backend label) of dense SDPA over a list of (q, k, v) triples, one call each
    per timed run: cuDNN only on CUDA (None ms, with a printed note, when cuDNN cannot run the
    shape), the math SDPA on the CPU.

    q [B, H, Lq, D], k / v [B, H, Lk, D] contiguous (GQA already expanded or folded)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        return [sdpa(qq, kk, vv, is_causal=causal) for qq, kk, vv in triples]
    if device.type != "cuda":
        return time_ms(run, device, rep_ms), "math"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    # Enter the backend selection once, outside the timed calls (it costs host time per call).
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        try:
            return time_ms(run, device, rep_ms), "cudnn"
        except RuntimeError as exc:
            print(f"skip cudnn sdpa {list(triples[0][0].shape)} x {list(triples[0][1].shape)}: "
                  f"{str(exc).splitlines()[0]}", flush=True)
            return None, "cudnn"


# ---------------------------------------------------------------------------------------------
# TSV output
# ---------------------------------------------------------------------------------------------

class TsvWriter:
    """Rows of ``gpu, commit, date, *columns``: printed, and appended to `path` (if given) one
    row at a time. Floats are written with the precision given per column in `formats`."""

    def __init__(self, path: Optional[str], columns: Sequence[str], device: torch.device,
                 formats: Optional[Dict[str, str]] = None):
        self.columns = list(columns)
        self.formats = formats or {}
        self.prefix = [device_name(device), git_commit(), datetime.date.today().isoformat()]
        self.path = Path(path) if path else None
        self.rows = 0
        header = "\t".join(["gpu", "commit", "date"] + self.columns)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists() or self.path.stat().st_size == 0:
                self.path.write_text(header + "\n")
            else:
                with open(self.path) as f:
                    existing = f.readline().rstrip("\n")
                if existing != header:
                    # Appending would misalign every new row under the old columns.
                    raise SystemExit(f"--out {self.path}: its columns differ from this "
                                     f"benchmark's ({existing!r} vs {header!r}); write to a "
                                     "new file")
        print(header, flush=True)

    def _cell(self, column: str, value) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return format(value, self.formats.get(column, ".3f"))
        if isinstance(value, (list, tuple)):
            return "+".join(map(str, value))
        return str(value)

    def write(self, **values) -> None:
        unknown = set(values) - set(self.columns)
        if unknown:
            raise KeyError(f"unknown TSV columns {sorted(unknown)}")
        line = "\t".join(self.prefix + [self._cell(c, values.get(c)) for c in self.columns])
        print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")
        self.rows += 1


def probe_backend(msa, op: str, fn: Callable[[], object]) -> Optional[str]:
    """Run fn (a small call of `op`, same dtypes and heads as the real one) and return the
    backend it took, so a slow reference can be skipped before a large call is ever made."""
    fn()
    return msa._backend.last_backend(op)
