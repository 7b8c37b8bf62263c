"""The one place that decides, per call, whether a native kernel or the PyTorch reference runs.

Native implementations register themselves with :func:`register_native` under an op name and a
GPU architecture family ("sm90", "sm100"). Each registration carries a ``supports(**features)``
function that answers a short reason (a str) when the native side cannot serve the call (a dtype
it lacks, an artifact that is not built, ...), and otherwise either ``None`` or a
:class:`Served` naming the kernel it picked; the choice is made there, once per call, and
``run(call, kernel=...)`` receives it.

Kernels that are built but not yet proven on hardware stay refused (or passed by, for a kernel
form in a serving table) until their GPU test passes: :func:`unvalidated_reason` and
:func:`unvalidated_ok` are that gate (``MSA_UNVALIDATED_KERNELS=1`` opts in).

``MSA_BACKEND`` forces a choice: ``reference`` always runs the reference; ``native`` raises
instead of falling back (useful in GPU tests); ``auto`` (default) picks native when it can.

Every decision is logged once per (op, backend, reason) on the ``msa`` logger; a fallback to the
reference on a CUDA device logs at WARNING so it is never silent. Nothing here touches CUDA at
import time: the device capability is read only when a call arrives with a CUDA tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

logger = logging.getLogger("msa")

REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class Served:
    """What a native ``supports`` answers for a call it serves with a kernel of its choosing:
    ``kernel`` (hashable, usually cached per call shape) is handed to ``run`` as ``kernel=``."""
    kernel: Any


# A supports() answer: None (served), a str (refused, and why) or Served (served by a kernel).
Verdict = Union[None, str, Served]


@dataclasses.dataclass(frozen=True)
class NativeImpl:
    op: str
    arch: str                                  # "sm90" or "sm100"
    run: Callable
    supports: Callable[..., Verdict]           # a reason (str) when it cannot serve the call

    @functools.lru_cache(maxsize=None)
    def runner(self, kernel) -> Callable:
        """run with `kernel` bound (one partial per kernel, reused by every later call)."""
        return functools.partial(self.run, kernel=kernel)


_registry: Dict[Tuple[str, str], NativeImpl] = {}
_logged: set = set()
_lock = threading.Lock()
_last_backend: Dict[str, str] = {}


def register_native(op: str, arch: str, run: Callable,
                    supports: Callable[..., Verdict] = lambda **_: None) -> None:
    _registry[(op, arch)] = NativeImpl(op, arch, run, supports)


def refusal(verdict: Verdict) -> Optional[str]:
    """The reason in a supports() answer, None when it serves the call."""
    return verdict if isinstance(verdict, str) else None


_arch_of_index: Dict[int, Optional[str]] = {}


def arch_family(device: torch.device) -> Optional[str]:
    """'sm90' / 'sm100' for the device's compute capability, else None (CPU, other GPUs).
    Cached per device index (asked on every call)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _arch_of_index.get(index, "")
    if arch == "":
        major, _minor = torch.cuda.get_device_capability(index)
        arch = _arch_of_index[index] = {9: "sm90", 10: "sm100"}.get(major)
    return arch


def _mode() -> str:
    mode = os.environ.get("MSA_BACKEND", "auto").strip().lower()
    if mode not in ("auto", "reference", "native"):
        raise ValueError(f"MSA_BACKEND: expected auto, reference or native, got {mode!r}")
    return mode


def _log_once(op: str, backend: str, reason: str, device: torch.device) -> None:
    key = (op, backend, reason, str(device))
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    if backend == REFERENCE and device.type == "cuda":
        logger.warning("msa.%s: running the PyTorch reference on %s (%s)", op, device, reason)
    else:
        logger.info("msa.%s: backend %s on %s (%s)", op, backend, device, reason)


def reference_only(device: torch.device) -> bool:
    """Whether every op on `device` runs the reference (MSA_BACKEND=reference, or no native
    kernel family for the device): composite calls then check index values up front, where the
    argument names are theirs."""
    return _mode() == "reference" or arch_family(device) is None


def choose(op: str, device: torch.device, **call) -> Tuple[str, Optional[Callable]]:
    """Returns (backend name, native run function or None for the reference)."""
    mode = _mode()
    arch = arch_family(device)
    impl = _registry.get((op, arch)) if arch is not None else None
    if mode == "reference":
        reason = "MSA_BACKEND=reference"
    elif device.type != "cuda":
        reason = f"no native kernel for device type {device.type}"
    elif impl is None:
        reason = (f"no native {op} kernel for compute capability "
                  f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    else:
        verdict = impl.supports(**call)
        reason = refusal(verdict)
        if reason is None:
            _log_once(op, arch, "native kernel", device)
            _last_backend[op] = arch
            return arch, (impl.run if verdict is None else impl.runner(verdict.kernel))
    if mode == "native":
        raise NotImplementedError(f"msa.{op}: MSA_BACKEND=native but no native kernel can run "
                                  f"this call: {reason}")
    _log_once(op, REFERENCE, reason, device)
    _last_backend[op] = REFERENCE
    return REFERENCE, None


UNVALIDATED_ENV = "MSA_UNVALIDATED_KERNELS"


def unvalidated_ok() -> bool:
    """Whether kernels not yet validated on hardware may serve calls (MSA_UNVALIDATED_KERNELS=1,
    as the GPU tests that validate them set)."""
    return os.environ.get(UNVALIDATED_ENV) == "1"


def unvalidated_reason(what: str, validated: bool) -> Optional[str]:
    """The gate every compiled-but-not-yet-hardware-validated kernel passes through: None when
    the kernel may serve calls (validated, or unvalidated_ok()), else the reason it may not. A
    kernel is marked validated only after its GPU test passed on an H200."""
    if validated or unvalidated_ok():
        return None
    return (f"{what} is compiled but not validated on hardware yet "
            f"({UNVALIDATED_ENV}=1 serves it)")


# Under torch.compile a dispatcher hands its validated call to the op's torch custom op instead
# of choosing here (this module's logging and locks are not traceable, and the native kernels
# are opaque to the compiler): msa._compile_entries registers, per op, the function that does.
_compile_entries: Dict[str, Callable] = {}


def register_compile_entry(op: str, entry: Callable) -> None:
    _compile_entries[op] = entry


def compile_entry(op: str) -> Optional[Callable]:
    """While torch.compile traces: the function running `op`'s validated call through its
    custom op (None in eager mode, the hot path, and in a build without an op namespace)."""
    if torch.compiler.is_compiling():
        return _compile_entries.get(op)
    return None


def last_backend(op: str) -> Optional[str]:
    """The backend that ran the most recent call of `op` in this process (for tests and logs)."""
    return _last_backend.get(op)


def registered() -> List[Tuple[str, str]]:
    return sorted(_registry)
