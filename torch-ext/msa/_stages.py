"""Stage marks of multi-kernel pipelines, for timing breakdowns.

A pipeline calls ``mark(name)`` on the host where stage ``name`` begins (``"end"`` after its last
launch). Nothing happens unless a caller installed a recorder with :func:`recording`; a
benchmark's recorder typically records a CUDA event on the current stream at each mark (an
external event, so the marks also land inside a captured CUDA graph), and the time between two
consecutive marks is the first one's stage. Marks name stages, never devices or streams, and
add no launch of their own.

Stages of the MSA prefill pipeline (``msa.prefill``): ``indexer``, ``topk``, ``csr``,
``attention``, ``combine``, ``end``; a call that runs in several query chunks marks them once per
chunk. ``combine`` is marked by the native sparse attention between its two kernels; on the
reference backend the attention stage includes the combine.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional

import torch

_recorder: "contextvars.ContextVar[Optional[Callable[[str], None]]]" = contextvars.ContextVar(
    "msa_stage_recorder", default=None)


def mark(name: str) -> None:
    """Stage `name` begins here (a no-op without a recorder, and in code torch.compile traces:
    a compiled graph has no host-side stage boundaries)."""
    if torch.compiler.is_compiling():
        return
    recorder = _recorder.get()
    if recorder is not None:
        recorder(name)


@contextlib.contextmanager
def recording(recorder: Callable[[str], None]) -> Iterator[None]:
    """Call ``recorder(name)`` at every mark made inside the ``with`` block (this thread /
    context only)."""
    token = _recorder.set(recorder)
    try:
        yield
    finally:
        _recorder.reset(token)
