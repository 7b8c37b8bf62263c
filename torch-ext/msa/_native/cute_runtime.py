"""Loads precompiled CuTe-DSL kernels (TVM-FFI shared objects) and launches them.

Artifacts are looked up in ``$MSA_CUTE_ARTIFACTS`` or else ``<package>/_artifacts/``: a
``manifest.json`` (written by tools/compile_cute.py) naming one ``<variant>.so`` per kernel
variant. Loading one needs the CuTe-DSL runtime library, preloaded globally with ctypes:
``$MSA_CUTE_RUNTIME`` (a path to libcute_dsl_runtime.so) or the copy inside an installed
nvidia-cutlass-dsl. When no artifact holds a variant and the DSL is installed, the variant is
compiled just in time from ``msa.cute_kernels`` instead (slow the first time, then cached).

Everything is lazy: importing this module touches neither CUDA, cutlass nor tvm_ffi.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

logger = logging.getLogger("msa")

_PACKAGE = __name__.rsplit(".", 2)[0]           # "msa" or the loader's unique module name
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_lock = threading.RLock()
_functions: Dict[str, Callable] = {}
_runtime_loaded = False
_manifest_cache: Dict[str, Optional[dict]] = {}


def artifact_dir() -> Path:
    """Where precompiled kernels are looked up (env MSA_CUTE_ARTIFACTS wins)."""
    env = os.environ.get("MSA_CUTE_ARTIFACTS")
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


def dsl_installed() -> bool:
    """True when nvidia-cutlass-dsl can be imported (JIT fallback possible). No import."""
    return importlib.util.find_spec("cutlass") is not None


def has_artifact(name: str) -> bool:
    data = manifest()
    if not data or name not in data.get("variants", {}):
        return False
    return (artifact_dir() / data["variants"][name]["file"]).is_file()


def unavailable_reason(*names: str) -> Optional[str]:
    """None when every named variant can be loaded or compiled here, else why not. (Asked on
    every call: a variant already loaded answers without touching the file system.)"""
    missing = [n for n in names if n not in _functions and not has_artifact(n)]
    if not missing:
        return None
    if importlib.util.find_spec("tvm_ffi") is None:
        return "apache-tvm-ffi is not installed"
    if dsl_installed():
        return None
    return (f"no precompiled CuTe kernel {missing[0]} in {artifact_dir()} and "
            "nvidia-cutlass-dsl is not installed for a JIT compile")


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
        env = os.environ.get("MSA_CUTE_RUNTIME")
        if env:
            paths = [env]
        else:
            import cutlass.cute as cute  # the runtime ships inside nvidia-cutlass-dsl
            paths = cute.runtime.find_runtime_libraries(enable_tvm_ffi=False)
        for path in paths:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded = True


def _load_artifact(name: str) -> Callable:
    import tvm_ffi
    entry = manifest()["variants"][name]
    preload_runtime()
    module = tvm_ffi.load_module(str(artifact_dir() / entry["file"]))
    logger.info("msa: loaded CuTe kernel %s from %s", name, artifact_dir())
    return module[entry.get("function", name)]


def _jit_compile(name: str) -> Callable:
    variants = importlib.import_module(f"{_PACKAGE}.cute_kernels.variants")
    build = importlib.import_module(f"{_PACKAGE}.cute_kernels.build")
    logger.warning("msa: no precompiled CuTe kernel %s; compiling it now (JIT)", name)
    return build.compile_variant(variants.by_name(name))


def get_function(name: str) -> Callable:
    """The callable of variant `name` (artifact first, else JIT), cached per process."""
    with _lock:
        fn = _functions.get(name)
        if fn is None:
            fn = _load_artifact(name) if has_artifact(name) else _jit_compile(name)
            _functions[name] = fn
        return fn


def launch(name: str, device: torch.device, *args) -> None:
    """Run kernel variant `name` on `device`'s current stream (passed as the last argument)."""
    fn = _functions.get(name) or get_function(name)
    stream = torch.cuda.current_stream(device).cuda_stream
    if device.index is None or device.index == torch.cuda.current_device():
        fn(*args, stream)
    else:       # the TVM-FFI call launches on the current device
        with torch.cuda.device(device):
            fn(*args, stream)
