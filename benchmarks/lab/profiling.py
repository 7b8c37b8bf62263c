"""Timing helpers of the lab's profiling scripts (profile_decode.py, profile_prefill.py)."""

from __future__ import annotations

import torch


def wall_ms(call, iters: int) -> float:
    """Mean ms per call over `iters` calls after one warm-up, between CUDA events."""
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_times(call, iters: int):
    """[(mean device us per call, launches per call, kernel name)] over `iters` calls under
    torch.profiler, largest first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        device_us = getattr(evt, "device_time_total", None)
        if device_us is None:
            device_us = evt.cuda_time_total
        if device_us > 0:
            rows.append((device_us / iters, evt.count // iters, evt.key))
    return sorted(rows, reverse=True)
