"""The one place that decides, per call, whether a native kernel or the PyTorch reference runs.

Native implementations register themselves with :func:`register_native` under an op name and a
GPU architecture family: "sm90" (Hopper: the CuTe-DSL and csrc kernels), "sm100" (Blackwell
datacenter) and "portable" (every other capability >= 8.0: the warp-MMA csrc kernels of
docs/design-portable.md, which also register for "sm100"). ``MSA_NATIVE_TIER=portable`` makes
every capability >= 8.0 the "portable" family (the H200 validates that tier this way). Each
registration carries a ``supports(**features)`` function that answers a short reason (a str) when the native side cannot serve the call (a dtype
it lacks, an artifact that is not built, ...), and otherwise either ``None`` or a
:class:`Served` naming the kernel it picked; the choice is made there, once per call, and
``run(call, kernel=...)`` receives it. A registration may also carry a ``device_check(device)``,
asked first: a reason when this build cannot run its kernels on the device at all (no image for
the device's arch among the build's ``cuda-capabilities``).

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
    arch: str                                  # "sm90", "sm100" or "portable"
    run: Callable
    supports: Callable[..., Verdict]           # a reason (str) when it cannot serve the call
    tier: Optional[str] = None                 # "portable" for the portable tier's kernels
    # A reason (str) when the device cannot run this build's kernels at all (the build has no
    # image for its arch), asked before supports().
    device_check: Optional[Callable[[torch.device], Optional[str]]] = None

    @functools.lru_cache(maxsize=None)
    def runner(self, kernel) -> Callable:
        """run with `kernel` bound (one partial per kernel, reused by every later call)."""
        return functools.partial(self.run, kernel=kernel)


_registry: Dict[Tuple[str, str], NativeImpl] = {}
_logged: set = set()
_lock = threading.Lock()
_last_backend: Dict[str, str] = {}


def register_native(op: str, arch: str, run: Callable,
                    supports: Callable[..., Verdict] = lambda **_: None,
                    tier: Optional[str] = None,
                    device_check: Optional[Callable[[torch.device], Optional[str]]] = None
                    ) -> None:
    _registry[(op, arch)] = NativeImpl(op, arch, run, supports, tier, device_check)


def refusal(verdict: Verdict) -> Optional[str]:
    """The reason in a supports() answer, None when it serves the call."""
    return verdict if isinstance(verdict, str) else None


_arch_of_index: Dict[int, Optional[str]] = {}

TIER_ENV = "MSA_NATIVE_TIER"
PORTABLE = "portable"
# Whether the portable tier's kernels passed their GPU tests and memcheck (by proxy on the
# H200, docs/design-portable.md); False gates them like any unvalidated kernel.
PORTABLE_VALIDATED = True
# Compute capabilities on which the portable tier's GPU tests have passed on that hardware
# itself (the README's matrix); elsewhere its log line says it was validated by proxy only.
PORTABLE_RUN_ON_HARDWARE: frozenset = frozenset()


def _tier() -> str:
    tier = os.environ.get(TIER_ENV, "auto").strip().lower()
    if tier not in ("auto", PORTABLE):
        raise ValueError(f"{TIER_ENV}: expected auto or portable, got {tier!r}")
    return tier


def arch_family(device: torch.device) -> Optional[str]:
    """'sm90' / 'sm100' / 'portable' for the device's compute capability (portable: every other
    capability >= 8.0, or any >= 8.0 under MSA_NATIVE_TIER=portable), else None (CPU, older
    GPUs). Cached per device index (asked on every call)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _arch_of_index.get(index, "")
    if arch == "":
        major, _minor = torch.cuda.get_device_capability(index)
        arch = _arch_of_index[index] = ({9: "sm90", 10: "sm100"}.get(major)
                                         or (PORTABLE if major >= 8 else None))
    if _tier() == PORTABLE and arch is not None:
        return PORTABLE
    return arch


def _capability(device: torch.device) -> str:
    return ".".join(map(str, torch.cuda.get_device_capability(device)))


def tier_note(impl: NativeImpl, device: torch.device) -> str:
    """The log reason of a native choice: which tier runs and, for the portable tier, whether
    its kernels have run on hardware of this compute capability."""
    if impl.tier != PORTABLE:
        return "native kernel"
    capability = _capability(device)
    if tuple(torch.cuda.get_device_capability(device)) in PORTABLE_RUN_ON_HARDWARE:
        status = "run on this hardware"
    elif PORTABLE_VALIDATED:
        status = "not run on hardware of this capability, validated by proxy on the H200"
    else:
        status = "not validated on hardware yet"
    return f"portable tier (warp-MMA csrc kernels) on compute capability {capability}: {status}"


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
    """Whether every op on `device` runs the reference (MSA_BACKEND=reference, no native
    kernel family for the device, or the portable family while its kernels are gated):
    composite calls then check index values up front, where the argument names are theirs."""
    arch = arch_family(device)
    return (_mode() == "reference" or arch is None
            or (arch == PORTABLE and unvalidated_reason("", PORTABLE_VALIDATED) is not None))


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
        reason = f"no native {op} kernel for compute capability {_capability(device)}"
        if arch == PORTABLE:
            reason += " in the portable tier"
    else:
        reason = impl.device_check(device) if impl.device_check is not None else None
        verdict = impl.supports(**call) if reason is None else reason
        reason = refusal(verdict)
        if reason is not None and impl.tier == PORTABLE:
            reason = f"portable tier on compute capability {_capability(device)}: {reason}"
        if reason is None:
            _log_once(op, arch, tier_note(impl, device), device)
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


def may_serve(validated: bool) -> bool:
    """Whether a kernel (or a form of one) may serve calls: validated on hardware, or
    unvalidated_ok()."""
    return validated or unvalidated_ok()


def unvalidated_reason(what: str, validated: bool) -> Optional[str]:
    """The gate every compiled-but-not-yet-hardware-validated kernel passes through: None when
    the kernel may serve calls (may_serve), else the reason it may not. A kernel is marked
    validated only after its GPU test passed on an H200."""
    if may_serve(validated):
        return None
    return (f"{what} is compiled but not validated on hardware yet "
            f"({UNVALIDATED_ENV}=1 serves it)")


def portable_supports(supports: Callable[..., Verdict], what: str) -> Callable[..., Verdict]:
    """`supports` of a kernel the Hopper family serves too, for its portable-tier registration:
    the same answers, then the tier's gate (PORTABLE_VALIDATED) on the calls it would serve."""
    def gated(**features) -> Verdict:
        verdict = supports(**features)
        if refusal(verdict) is not None:
            return verdict
        return unvalidated_reason(what, PORTABLE_VALIDATED) or verdict
    return gated


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
