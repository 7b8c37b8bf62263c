"""Finds, loads and launches the CuTe-DSL kernel variants (TVM-FFI functions), compiling a
variant just in time only when no usable binary exists.

Where a variant comes from, in order:

1. **Shipped artifacts**: ``$MSA_CUTE_ARTIFACTS`` or ``<package>/_artifacts/``, a
   ``manifest.json`` (tools/compile_cute.py) naming one ``<variant>.so`` per variant. They are
   used only when the manifest's target arch, host platform, nvidia-cutlass-dsl version and
   kernel sources digest match this package and host (a WARNING says once why they are not).
2. **The JIT cache**, a directory per (target arch, host platform, DSL version, kernel sources
   digest) under ``$MSA_CUTE_CACHE`` (default ``$XDG_CACHE_HOME/msa/cute``, else
   ``~/.cache/msa/cute``; ``MSA_CUTE_CACHE=off`` disables it). An entry is the variant's
   exported TVM-FFI object: ``<variant>.so`` when a C compiler links it, else ``<variant>.o``
   (loaded by the DSL's in-memory linker). Entries are written atomically, so processes may
   share a cache. :func:`msa.warmup` fills it ahead of time.
3. **A just-in-time compile** (nvidia-cutlass-dsl installed), logged at WARNING with the
   reason and then written to the cache, so each variant compiles once per cache.

Loading a binary needs the CuTe-DSL runtime library, preloaded globally with ctypes:
``$MSA_CUTE_RUNTIME`` (a path to libcute_dsl_runtime.so; the operator vouches that it matches
the artifacts) or the copy inside the installed nvidia-cutlass-dsl.

Everything is lazy: importing this module touches neither CUDA, cutlass nor tvm_ffi.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

logger = logging.getLogger("msa")

_PACKAGE = __name__.rsplit(".", 2)[0]           # "msa" or the loader's unique module name
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
# Every variant is compiled for this target (cute_kernels.build.TARGET_ARCH; a test checks).
TARGET_ARCH = "sm_90a"
ARTIFACTS_ENV = "MSA_CUTE_ARTIFACTS"
CACHE_ENV = "MSA_CUTE_CACHE"
RUNTIME_ENV = "MSA_CUTE_RUNTIME"
DSL_DISTRIBUTION = "nvidia-cutlass-dsl"
_lock = threading.RLock()
_functions: Dict[str, Callable] = {}
_origins: Dict[str, str] = {}                   # variant -> "artifact" | "cache" | "compiled"
_runtime_loaded = False
_manifest_cache: Dict[str, Optional[dict]] = {}
_artifacts_reason_cache: Dict[str, Optional[str]] = {}


# ---------------------------------------------------------------------------------------------
# Identity of a binary: target, host, DSL version, kernel sources
# ---------------------------------------------------------------------------------------------

def host_platform() -> str:
    """``x86_64-linux`` style: the binaries hold host code for this CPU and OS."""
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return f"{machine}-{platform.system().lower()}"


@functools.lru_cache(maxsize=None)
def dsl_version() -> Optional[str]:
    """The installed nvidia-cutlass-dsl version (package metadata, no import), or None."""
    try:
        return importlib.metadata.version(DSL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def kernel_sources_digest() -> str:
    """sha256 over the CuTe kernel sources (cute_kernels/*.py, names and bytes): binaries
    compiled from other sources are never loaded."""
    h = hashlib.sha256()
    for path in sorted((_PACKAGE_DIR / "cute_kernels").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def dsl_installed() -> bool:
    """True when nvidia-cutlass-dsl can be imported (JIT compiles possible). No import."""
    return importlib.util.find_spec("cutlass") is not None


# ---------------------------------------------------------------------------------------------
# Shipped artifacts
# ---------------------------------------------------------------------------------------------

def artifact_dir() -> Path:
    """Where precompiled kernels are looked up (env MSA_CUTE_ARTIFACTS wins)."""
    env = os.environ.get(ARTIFACTS_ENV)
    return Path(env) if env else _PACKAGE_DIR / "_artifacts"


def manifest() -> Optional[dict]:
    """The parsed manifest.json of artifact_dir(), or None if there is none."""
    directory = artifact_dir()
    key = str(directory)
    with _lock:
        if key not in _manifest_cache:
            path = directory / "manifest.json"
            data = None
            if path.is_file():
                try:
                    data = json.loads(path.read_text())
                except (OSError, ValueError) as exc:
                    logger.warning("msa: unreadable CuTe artifact manifest %s: %s", path, exc)
            _manifest_cache[key] = data
        return _manifest_cache[key]


def artifacts_mismatch(data: dict) -> Optional[str]:
    """None when the binaries a manifest describes can run here, else why not."""
    if data.get("arch") != TARGET_ARCH:
        return f"built for {data.get('arch')}, this package targets {TARGET_ARCH}"
    # Manifests without a platform entry were all built on x86_64 Linux.
    built_on = data.get("platform", "x86_64-linux")
    if built_on != host_platform():
        return f"built for {built_on}, this host is {host_platform()}"
    built_with, installed = data.get("cutlass_dsl_version"), dsl_version()
    if installed is None:
        if not os.environ.get(RUNTIME_ENV):
            return f"{DSL_DISTRIBUTION} (whose runtime loads them) is not installed"
    elif built_with != installed:
        return f"built with {DSL_DISTRIBUTION} {built_with}, {installed} is installed"
    digest = data.get("kernel_sources_digest")
    if digest is not None and digest != kernel_sources_digest():
        return "built from other kernel sources than this package's cute_kernels/"
    return None


def artifacts_unusable_reason() -> Optional[str]:
    """None when artifact_dir() holds artifacts this host may load, else why not (a WARNING
    is logged once per directory when a manifest exists but does not match)."""
    key = str(artifact_dir())
    with _lock:
        if key not in _artifacts_reason_cache:
            data = manifest()
            if data is None:
                reason = f"no manifest.json in {key}"
            else:
                reason = artifacts_mismatch(data)
                if reason is not None:
                    logger.warning("msa: not using the precompiled CuTe kernels in %s: %s", key,
                                   reason)
            _artifacts_reason_cache[key] = reason
        return _artifacts_reason_cache[key]


def has_artifact(name: str) -> bool:
    if artifacts_unusable_reason() is not None:
        return False
    entry = manifest().get("variants", {}).get(name)
    return entry is not None and (artifact_dir() / entry["file"]).is_file()


# ---------------------------------------------------------------------------------------------
# The JIT cache
# ---------------------------------------------------------------------------------------------

def cache_root() -> Optional[Path]:
    """The JIT cache root (MSA_CUTE_CACHE; "off", "0" or "" disable it), default
    $XDG_CACHE_HOME/msa/cute or ~/.cache/msa/cute."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        if env.strip().lower() in ("", "0", "off", "none"):
            return None
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "msa" / "cute"


def cache_dir() -> Optional[Path]:
    """This package's directory in the JIT cache, or None (cache disabled, or no DSL installed:
    the version that keys the entries is unknown)."""
    root, version = cache_root(), dsl_version()
    if root is None or version is None:
        return None
    return root / (f"{TARGET_ARCH}-{host_platform()}-cutlass-dsl-{version}-"
                   f"{kernel_sources_digest()[:16]}")


def cached_file(name: str) -> Optional[Path]:
    """The JIT cache entry of variant `name` (.so, else .o), or None."""
    directory = cache_dir()
    if directory is None:
        return None
    for suffix in (".so", ".o"):
        path = directory / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def export_variant(compiled, name: str, directory: Path, *, require_shared: bool) -> Path:
    """Write compiled variant `name` into `directory` as ``<name>.so`` (the exported object
    linked by the C compiler) or, without one and unless `require_shared`, ``<name>.o``.
    Atomic: a temporary file is renamed into place. Returns the path written."""
    preload_runtime()      # the export resolves CUDA runtime symbols of the DSL runtime
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    obj = stem.with_suffix(".o")
    try:
        compiled.export_to_c(str(obj), function_name=name)
        linker = shutil.which("cc") or shutil.which("gcc")
        if linker is None:
            if require_shared:
                raise FileNotFoundError("no C compiler (cc / gcc) to link the shared object")
            return _replace(obj, directory / f"{name}.o")
        import cutlass.cute as cute
        libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
        shared = stem.with_suffix(".so")
        subprocess.run([linker, "-shared", "-o", str(shared), str(obj), *libs], check=True,
                       capture_output=True)
        return _replace(shared, directory / f"{name}.so")
    finally:
        for leftover in (obj, stem.with_suffix(".so")):
            if leftover.exists():
                leftover.unlink()


def _replace(src: Path, dst: Path) -> Path:
    os.replace(src, dst)
    return dst


def compile_variant(name: str):
    """cute.compile variant `name` for TARGET_ARCH (needs nvidia-cutlass-dsl, no GPU)."""
    variants = importlib.import_module(f"{_PACKAGE}.cute_kernels.variants")
    build = importlib.import_module(f"{_PACKAGE}.cute_kernels.build")
    return build.compile_variant(variants.by_name(name))


def compile_into_cache(name: str):
    """Compile variant `name` and write it to the JIT cache. Returns (the cache entry or None
    when the cache is disabled or unwritable, the in-process compiled function)."""
    compiled = compile_variant(name)
    directory = cache_dir()
    if directory is None:
        return None, compiled
    try:
        return export_variant(compiled, name, directory, require_shared=False), compiled
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("msa: could not write CuTe kernel %s to the JIT cache %s: %s", name,
                       directory, exc)
        return None, compiled


# ---------------------------------------------------------------------------------------------
# Availability, loading, launching
# ---------------------------------------------------------------------------------------------

def unavailable_reason(*names: str) -> Optional[str]:
    """None when every named variant can be loaded or compiled here, else why not. (Asked on
    every call: a variant already loaded answers without touching the file system.)"""
    missing = [n for n in names
               if n not in _functions and not has_artifact(n) and cached_file(n) is None]
    if not missing:
        return None
    if importlib.util.find_spec("tvm_ffi") is None:
        return "apache-tvm-ffi is not installed"
    if dsl_installed():
        return None
    return (f"no usable precompiled CuTe kernel {missing[0]} ({artifacts_unusable_reason()}) "
            f"and {DSL_DISTRIBUTION} is not installed for a JIT compile")


INT32_MAX = 2 ** 31 - 1


def check_int32_count(name: str, value: int, what: str) -> None:
    """Contract-style NotImplementedError (argument first) when a count the CuTe kernels keep
    in 32-bit registers (tokens, 128-token tiles, rows) exceeds int32. Element offsets into
    q / k / v / outputs are computed in 64 bits (cute_kernels.copies.kv_row_iterator /
    row_iterator, or 64-bit dynamic strides), so tensor sizes alone are not limited."""
    if value > INT32_MAX:
        raise NotImplementedError(f"{name}: {what} = {value} does not fit int32; the sm90 "
                                  f"kernels count tokens, tiles and rows in 32 bits")


def preload_runtime() -> None:
    """Load libcute_dsl_runtime.so (and friends) with RTLD_GLOBAL, once."""
    global _runtime_loaded
    with _lock:
        if _runtime_loaded:
            return
        env = os.environ.get(RUNTIME_ENV)
        if env:
            paths = [env]
        else:
            import cutlass.cute as cute  # the runtime ships inside nvidia-cutlass-dsl
            paths = cute.runtime.find_runtime_libraries(enable_tvm_ffi=False)
        for path in paths:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded = True


def load_binary(path: Path, function: str) -> Callable:
    """The TVM-FFI function `function` of an exported variant: a shared object (tvm_ffi, no
    DSL needed) or an object file (the DSL's in-memory linker)."""
    preload_runtime()
    if path.suffix == ".so":
        import tvm_ffi
        return tvm_ffi.load_module(str(path))[function]
    import cutlass.cute as cute
    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), function)


def _load(name: str) -> Callable:
    if has_artifact(name):
        entry = manifest()["variants"][name]
        fn = load_binary(artifact_dir() / entry["file"], entry.get("function", name))
        _origins[name] = "artifact"
        logger.info("msa: loaded CuTe kernel %s from %s", name, artifact_dir())
        return fn
    cached = cached_file(name)
    if cached is not None:
        fn = load_binary(cached, name)
        _origins[name] = "cache"
        logger.info("msa: loaded CuTe kernel %s from the JIT cache %s", name, cached.parent)
        return fn
    directory = cache_dir()
    logger.warning("msa: compiling CuTe kernel %s for %s now, at run time (precompiled: %s; "
                   "JIT cache: %s); msa.warmup() compiles every kernel ahead of time", name,
                   TARGET_ARCH, artifacts_unusable_reason() or "not among them",
                   directory if directory is not None else f"disabled ({CACHE_ENV})")
    start = time.perf_counter()
    entry, compiled = compile_into_cache(name)
    fn = load_binary(entry, name) if entry is not None else compiled
    _origins[name] = "compiled"
    logger.info("msa: compiled CuTe kernel %s in %.1f s%s", name, time.perf_counter() - start,
                f" (cached as {entry})" if entry is not None else "")
    return fn


def get_function(name: str) -> Callable:
    """The callable of variant `name` (shipped artifact, else JIT cache, else compiled now),
    cached per process."""
    with _lock:
        fn = _functions.get(name)
        if fn is None:
            fn = _functions[name] = _load(name)
        return fn


def origins() -> Dict[str, str]:
    """Where each variant loaded in this process came from: "artifact", "cache" or
    "compiled" (tests and tools/measure_cute_cache.py read it)."""
    return dict(_origins)


def trailing_args(names, device: torch.device, *, item_counter=None) -> list:
    """Values of a kernel's trailing launch arguments (cute_kernels.variants.TRAILING_ARGS,
    in order): "item_counter" (`item_counter` when given, else a zeroed int32 allocated on
    the current stream: one per launch, so calls on other streams never share it) and
    "num_ctas" (the device's SM count; debug hook persistent_ctas)."""
    from .._common import sm_count
    from . import debug

    def counter():
        if item_counter is not None:
            return item_counter
        return torch.zeros(1, dtype=torch.int32, device=device)
    values = dict(item_counter=counter,
                  num_ctas=lambda: int(debug.forced("persistent_ctas") or sm_count(device)))
    return [values[name]() for name in names]


def launch(name: str, device: torch.device, *args) -> None:
    """Run kernel variant `name` on `device`'s current stream (passed as the last argument)."""
    fn = _functions.get(name) or get_function(name)
    stream = torch.cuda.current_stream(device).cuda_stream
    if device.index is None or device.index == torch.cuda.current_device():
        fn(*args, stream)
    else:       # the TVM-FFI call launches on the current device
        with torch.cuda.device(device):
            fn(*args, stream)
