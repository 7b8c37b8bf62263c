"""First-call latency of the CuTe kernels as a Hub user meets them (issue 25).

A Hub build ships no precompiled CuTe kernels, so each variant a call needs is compiled on first
use and kept in the JIT cache (msa._native.cute_runtime). Each phase below runs in a fresh
process (so nothing is loaded yet) with its own cache directory and no shipped artifacts:

  cold        empty cache: the first call of each case compiles its variants
  warm        the cache the cold phase filled, a second process: no compile
  warmup      msa.warmup() into an empty cache (every variant, --warmup-workers processes)
  after       a process after the warm-up: every first call loads from the cache
  artifacts   (when the variant ships _artifacts/) the precompiled binaries, for comparison

Cases: msa_prefill (bf16, the indexer, top-k, CSR and sparse attention), fmha bf16 causal and
fmha e4m3 causal (GPU), each timed on its first and second call; and "load", which asks the
runtime for --load-variants directly (compile or cache load, no launch; also on the CPU).
TSV rows: phase, case, first_ms, second_ms, compiled / cached / artifact variant counts.

    python benchmarks/bench_cute_cache.py --out cute_cache_h200.tsv [--warmup-workers 16]
    python benchmarks/bench_cute_cache.py --device cpu --tiny     # CPU smoke run (load case)

Needs nvidia-cutlass-dsl with its compiler importable (the cold and warmup phases compile).
On the H200 host, which has only the DSL's runtime, two device calls (the compiler bundle and
the session's own carries do not fit one call's 64 MiB):

    bash tools/dsl_compiler_bundle.sh                  # here, once: .dsl-compiler/ (~56 MB)
    call 1, carry [".dsl-compiler"]:  true
    call 2, carry [".gpu-runtime", ".whl"]:  mkdir -p /tmp/noart && MSA_EXTRA_TIMEOUT=480 \
      MSA_EXTRA='bash .dsl-compiler/setup.sh && MSA_PACKAGE_DIR=$PWD/$VARIANT python3 \
      benchmarks/bench_cute_cache.py --out $OUT/cute_cache_h200.tsv --warmup-workers 16' \
      bash tools/gpu_session.sh /tmp/noart none

(an empty artifacts directory: the variant ships no CuTe kernels, as a Hub build).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

from _common import TsvWriter, add_common_args, load_msa, parse_names, setup

RESULT_TAG = "bench-cute-cache "
GPU_CASES = ("msa_prefill_bf16", "fmha_bf16_causal", "fmha_e4m3_causal")
DEFAULT_LOAD = "sparse_combine_sm90_pf32,block_max_score_sm90_bfloat16_h4_dense"


# ---------------------------------------------------------------------------------------------
# The child process: one phase's first and second calls
# ---------------------------------------------------------------------------------------------

def _cu(lengths, device):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                        device=device)


def _gpu_case(msa, name: str, n: int, device):
    """A zero-argument callable running case `name` at n tokens."""
    def draw(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device).to(dtype)

    if name == "msa_prefill_bf16":
        hkv, group = 4, 16
        q, k, v = draw(n, hkv * group, 128), draw(n, hkv, 128), draw(n, hkv, 128)
        q_idx, k_idx, cu = draw(n, hkv, 128), draw(n, 1, 128), _cu([n], device)
        return lambda: msa.msa_prefill(q, k, v, q_idx, k_idx, cu, cu, max_seqlen_q=n,
                                       max_seqlen_k=n)
    dtype = torch.float8_e4m3fn if "e4m3" in name else torch.bfloat16
    hq, hkv = 64, 8
    q, k, v = draw(n, hq, 128, dtype=dtype), draw(n, hkv, 128, dtype=dtype), \
        draw(n, hkv, 128, dtype=dtype)
    plan = msa.fmha_plan(torch.tensor([n]), torch.tensor([n]), hq, hkv, causal=True,
                         device=device)
    return lambda: msa.fmha(q, k, v, plan)


def _timed(fn, device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def child(args) -> None:
    t0 = time.perf_counter()
    msa = load_msa()
    runtime = __import__(f"{msa.__name__}._native.cute_runtime", fromlist=["x"])
    import_ms = (time.perf_counter() - t0) * 1e3
    device = torch.device(args.device)
    results: List[Dict[str, object]] = []
    seen: Dict[str, str] = {}

    def record(case: str, first: float, second) -> None:
        new = {k: v for k, v in runtime.origins().items() if k not in seen}
        seen.update(new)
        counts = {o: sum(1 for v in new.values() if v == o)
                  for o in ("compiled", "cache", "artifact")}
        results.append({"case": case, "first_ms": first, "second_ms": second, **counts,
                        "variants": sorted(new)})

    results.append({"case": "import", "first_ms": import_ms, "second_ms": None, "compiled": 0,
                    "cache": 0, "artifact": 0, "variants": []})
    if device.type == "cuda":
        os.environ["MSA_BACKEND"] = "native"
        for case in parse_names(args.cases):
            fn = _gpu_case(msa, case, args.tokens, device)
            first = _timed(fn, device)
            record(case, first, _timed(fn, device))
    for name in parse_names(args.load_variants):
        start = time.perf_counter()
        runtime.get_function(name)
        record(f"load:{name}", (time.perf_counter() - start) * 1e3, None)
    print(RESULT_TAG + json.dumps(results), flush=True)


# ---------------------------------------------------------------------------------------------
# The parent: phases in fresh processes
# ---------------------------------------------------------------------------------------------

def run_phase(args, env: Dict[str, str]) -> List[Dict[str, object]]:
    cmd = [sys.executable, __file__, "--child", "--device", args.device, "--cases", args.cases,
           "--tokens", str(args.tokens), "--load-variants", args.load_variants]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"phase failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def run_warmup(args, env: Dict[str, str]) -> Dict[str, object]:
    code = ("import json, sys\n"
            f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
            "from _common import load_msa\n"
            "msa = load_msa()\n"
            f"s = msa.warmup({parse_names(args.warmup_only) or None!r}, arch='sm_90a', "
            f"workers={args.warmup_workers!r})\n"
            f"print({RESULT_TAG!r} + json.dumps(s))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"warm-up failed (exit {proc.returncode}):\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, rep_ms=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(GPU_CASES), help="GPU cases (comma list)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per GPU case")
    parser.add_argument("--load-variants", default=DEFAULT_LOAD,
                        help="variants the load case asks for (comma list; '' for none)")
    parser.add_argument("--phases", default="cold,warm,warmup,after,artifacts")
    parser.add_argument("--warmup-workers", type=int, default=None,
                        help="msa.warmup processes (default: one per CPU)")
    parser.add_argument("--warmup-only", default="",
                        help="warm up only variants containing one of these (comma list)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per phase")
    args = parser.parse_args(argv)
    if args.tiny:
        args.cases, args.load_variants = "", "sparse_combine_sm90_pf32"
        args.warmup_only = args.warmup_only or "sparse_combine_sm90_pf32"
    if args.child:
        child(args)
        return 0
    device = setup(args)
    if device.type != "cuda":
        args.cases = ""
    writer = TsvWriter(args.out, ["phase", "case", "first_ms", "second_ms", "compiled",
                                  "from_cache", "from_artifacts", "note"], device,
                       formats={"first_ms": ".1f", "second_ms": ".2f"})
    phases = parse_names(args.phases)
    msa = load_msa()
    shipped = Path(msa.__file__).resolve().parent / "_artifacts"
    with tempfile.TemporaryDirectory(prefix="msa-cute-cache-") as tmp:
        base = dict(os.environ, MSA_CUTE_ARTIFACTS=str(Path(tmp) / "no-artifacts"))
        (Path(tmp) / "no-artifacts").mkdir()
        envs = {"cold": dict(base, MSA_CUTE_CACHE=str(Path(tmp) / "a")),
                "warm": dict(base, MSA_CUTE_CACHE=str(Path(tmp) / "a")),
                "after": dict(base, MSA_CUTE_CACHE=str(Path(tmp) / "b")),
                "artifacts": dict(os.environ, MSA_CUTE_ARTIFACTS=str(shipped),
                                  MSA_CUTE_CACHE=str(Path(tmp) / "c"))}
        for phase in phases:
            if phase == "warmup":
                summary = run_warmup(args, dict(base, MSA_CUTE_CACHE=str(Path(tmp) / "b")))
                writer.write(phase=phase, case="msa.warmup", first_ms=summary["seconds"] * 1e3,
                           second_ms=None, compiled=len(summary["compiled"]), from_cache=0,
                           from_artifacts=len(summary["shipped"]),
                           note=f"workers={args.warmup_workers or os.cpu_count()} "
                                f"failed={len(summary['failed'])}")
                continue
            if phase == "artifacts" and not (shipped / "manifest.json").is_file():
                print(f"artifacts phase skipped: no {shipped}/manifest.json", flush=True)
                continue
            for r in run_phase(args, envs[phase]):
                writer.write(phase=phase, case=r["case"], first_ms=r["first_ms"],
                           second_ms=r["second_ms"], compiled=r["compiled"],
                           from_cache=r["cache"], from_artifacts=r["artifact"],
                           note=f"{len(r['variants'])} variants" if r["variants"] else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
