"""Compile the CuTe-DSL kernels a GPU runs ahead of time, into the JIT cache.

A Hub build ships no precompiled CuTe kernels (they are platform binaries), so each kernel
variant is compiled the first time a call needs it (seconds each) and then kept in the JIT cache
(``msa._native.cute_runtime``: ``$MSA_CUTE_CACHE``, default ``~/.cache/msa/cute``). ``warmup()``
compiles them all beforehand, in parallel worker processes (the DSL compiler is CPU-bound and
single-threaded), with a progress line per kernel; no GPU is needed when ``arch`` is given.

    msa.warmup()                                   # every kernel this GPU can run
    python -m msa warmup [--only fmha] [--workers 8] [--arch sm_90a]    (msa importable)
    python tools/msa_warmup.py [...]               # from a checkout (build/ or the source tree)
    python -c "import kernels; kernels.get_kernel('MiniMaxAI/msa', version=0,
               trust_remote_code=True).warmup()"   # the Hub package
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ._native import cute_runtime

_PACKAGE = __package__                    # "msa" or the loader's unique module name
_PACKAGE_DIR = Path(__file__).resolve().parent
_RESULT_TAG = "msa-warmup-result "
# A worker process: imports this package from its directory under its module name (the Hub
# loader's name is not importable otherwise), then compiles the variants named on stdin.
_WORKER = """
import importlib, importlib.util, sys
path, name = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location(name, path + "/__init__.py",
                                              submodule_search_locations=[path])
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
importlib.import_module(name + "._warmup")._serve()
"""


def device_arch(device=None) -> Optional[str]:
    """The CuTe target this device runs (sm_90a for capability 9.0), None for any other device.
    Raises RuntimeError without a CUDA device (pass ``arch`` to warmup() instead)."""
    if not torch.cuda.is_available():
        raise RuntimeError("warmup: no CUDA device; pass arch='sm_90a' to compile the Hopper "
                           "kernels anyway (no GPU is needed to compile)")
    major, minor = torch.cuda.get_device_capability(device)
    return cute_runtime.TARGET_ARCH if (major, minor) == (9, 0) else None


def variant_names(only: Optional[Sequence[str]] = None) -> List[str]:
    """Every CuTe variant this package can launch, optionally those whose name contains one of
    `only`."""
    variants = importlib.import_module(f"{_PACKAGE}.cute_kernels.variants")
    names = [v.name for v in variants.shipped_variants()]
    if only:
        names = [n for n in names if any(part in n for part in only)]
    return names


def warmup(only: Optional[Sequence[str]] = None, *, arch: Optional[str] = None,
           workers: Optional[int] = None, force: bool = False,
           progress: bool = True) -> Dict[str, object]:
    """Compile every CuTe kernel variant the current GPU runs into the JIT cache.

    Args:
      only: compile only variants whose name contains one of these strings (or this string).
      arch: the target to compile for ("sm_90a"); default: the current CUDA device's (nothing
        to do on a GPU without native CuTe kernels).
      workers: parallel compile processes (default: one per CPU core, at most one per variant).
      force: recompile variants already in the cache or the shipped artifacts.
      progress: print a line per kernel to stderr.

    Returns a summary dict: ``compiled`` (list[str], the variants compiled now), ``cached``
    (list[str], already in the cache), ``shipped`` (list[str], served by usable precompiled
    artifacts), ``failed`` ({variant: error}), ``cache_dir`` and ``seconds``. Raises
    RuntimeError when nothing can be compiled here (no DSL installed, or the cache is off)
    and ValueError for an arch the kernels do not target.
    """
    only, workers = _check_warmup_args(only, arch, workers)
    start = time.perf_counter()
    target = arch if arch is not None else device_arch()
    summary: Dict[str, object] = {"compiled": [], "cached": [], "shipped": [], "failed": {},
                                  "cache_dir": None, "seconds": 0.0}
    say = (lambda text: print(f"msa.warmup: {text}", file=sys.stderr, flush=True)) \
        if progress else (lambda text: None)
    if target is None:
        say("this GPU runs no native CuTe kernel (they target sm_90a): nothing to compile")
        return summary
    if target != cute_runtime.TARGET_ARCH:
        raise ValueError(f"arch: the CuTe kernels target {cute_runtime.TARGET_ARCH}, got "
                         f"{target!r}")
    if not cute_runtime.dsl_installed():
        raise RuntimeError(f"warmup: {cute_runtime.DSL_DISTRIBUTION} is not installed, so no "
                           "kernel can be compiled here")
    directory = cache_dir_or_raise()
    summary["cache_dir"] = str(directory)
    todo = []
    for name in variant_names(only):
        if not force and cute_runtime.has_artifact(name):
            summary["shipped"].append(name)
        elif not force and cute_runtime.cached_file(name) is not None:
            summary["cached"].append(name)
        else:
            todo.append(name)
    say(f"{len(todo)} to compile into {directory} ({len(summary['cached'])} cached, "
        f"{len(summary['shipped'])} precompiled)")
    if todo:
        count = max(1, min(workers or os.cpu_count() or 1, len(todo)))
        _compile_in_workers(todo, count, summary, say)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    failed = summary["failed"]
    say(f"done in {summary['seconds']} s: {len(summary['compiled'])} compiled, "
        f"{len(failed)} failed" + (f" ({', '.join(sorted(failed))})" if failed else ""))
    return summary


def _check_warmup_args(only, arch, workers):
    """(only as a list of patterns or None, workers), or TypeError / ValueError naming the
    argument, before anything is compiled."""
    if isinstance(only, str):
        only = [only]
    if only is not None:
        if not isinstance(only, (list, tuple)) or not all(isinstance(p, str) for p in only):
            raise TypeError(f"only: expected a string or a sequence of strings, got {only!r}")
        only = list(only)
    if arch is not None and not isinstance(arch, str):
        raise TypeError(f"arch: expected a string such as {cute_runtime.TARGET_ARCH!r}, got "
                        f"{type(arch).__name__}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise TypeError(f"workers: expected an int, got {type(workers).__name__}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers: must be >= 1, got {workers}")
    return only, workers


def cache_dir_or_raise() -> Path:
    directory = cute_runtime.cache_dir()
    if directory is None:
        raise RuntimeError(f"warmup: the JIT cache is disabled ({cute_runtime.CACHE_ENV}="
                           f"{os.environ.get(cute_runtime.CACHE_ENV)!r}); nothing would be kept")
    return directory


def _compile_in_workers(todo: List[str], count: int, summary: dict, say) -> None:
    """Hand `todo` to `count` worker processes, one variant at a time per worker."""
    queue = collections.deque(todo)
    lock = threading.Lock()
    done = [0]

    def record(name: str, result: dict) -> None:
        with lock:
            done[0] += 1
            if result.get("ok"):
                summary["compiled"].append(name)
                say(f"[{done[0]}/{len(todo)}] {name} ({result['seconds']:.1f} s)")
            else:
                summary["failed"][name] = result.get("error", "unknown error")
                say(f"[{done[0]}/{len(todo)}] {name} FAILED: {summary['failed'][name]}")

    def drive() -> None:
        with tempfile.TemporaryFile(mode="w+") as errors:
            proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(_PACKAGE_DIR), _PACKAGE],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=errors, text=True)
            try:
                while True:
                    with lock:
                        if not queue:
                            break
                        name = queue.popleft()
                    proc.stdin.write(name + "\n")
                    proc.stdin.flush()
                    result = _read_result(proc)
                    if result is None:       # the worker died: report it with its stderr
                        errors.seek(0)
                        tail = errors.read()[-1500:].strip()
                        record(name, {"ok": False,
                                      "error": f"worker exited ({proc.poll()}): {tail}"})
                        return
                    record(name, result)
            finally:
                if proc.stdin:
                    proc.stdin.close()
                proc.wait()

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in queue:                        # left over when every worker died
        summary["failed"][name] = "no worker process left"


def _read_result(proc) -> Optional[dict]:
    """The worker's next result line (other output, e.g. DSL messages, is skipped)."""
    for line in proc.stdout:
        if line.startswith(_RESULT_TAG):
            return json.loads(line[len(_RESULT_TAG):])
    return None


def _serve() -> None:
    """Worker loop: compile each variant named on stdin into the cache, one result per line."""
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        start = time.perf_counter()
        try:
            entry, _compiled = cute_runtime.compile_into_cache(name)
            result = {"ok": entry is not None, "seconds": time.perf_counter() - start,
                      "file": None if entry is None else str(entry)}
            if entry is None:
                result["error"] = "not written to the JIT cache (see the msa log)"
        except Exception as exc:  # reported to the parent, which lists every failure
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:800]}
        print(_RESULT_TAG + json.dumps(result), flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m msa warmup", description="Compile the msa CuTe-DSL kernels into the JIT cache "
        f"({cute_runtime.CACHE_ENV}, default ~/.cache/msa/cute) ahead of time.")
    parser.add_argument("--only", action="append", default=[],
                        help="compile only variants whose name contains this (repeatable)")
    parser.add_argument("--arch", help="target (sm_90a); default: the current GPU's")
    parser.add_argument("--workers", type=int, help="parallel compile processes (default: CPUs)")
    parser.add_argument("--force", action="store_true", help="recompile cached variants too")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    try:
        summary = warmup(args.only or None, arch=args.arch, workers=args.workers,
                         force=args.force, progress=not args.quiet)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if summary["failed"] else 0
