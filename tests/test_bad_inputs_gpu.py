"""The shared bad-input table (tests/bad_input_table.py) on an SM90 GPU, native backends asserted.

For every case whose function has native kernels (Case.ops), the call runs with
MSA_BACKEND=native (a silent fallback would raise) and:

* Error: the same class and argument as on the CPU, checked or not;
* Invalid: with MSA_CHECK_INPUTS=1 the same error as the reference; unchecked, the native call
  returns, the stream completes and the CUDA context keeps working (no device assert, no
  illegal address, no hang), and the kernels of Case.ops really ran;
* Skip: checked, the error; unchecked, the same output as the reference backend on the same
  device and bytes;
* Same: the same output as the reference backend, checked or not;
* NonFinite: the affected rows non-finite (never the empty row), the unaffected rows exactly the
  clean native call's.

Functions without native kernels (the NVFP4 attention, the FP4 indexer, the NVFP4 helpers, the
plans) run the same expectations on CUDA tensors through the reference. Cases that reach a
kernel still gated by its VALIDATED flag (the fused decode indexer) open the gate.

  MSA_GPU_TESTS="tests/test_bad_inputs_gpu.py" bash tools/gpu_session.sh .artifacts tests
"""

import pytest
import torch

from bad_input_table import (CASES, Error, Invalid, NonFinite, Same, Skip, outputs_of)
from test_bad_inputs import assert_nonfinite, assert_raises, assert_unmutated

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _env(monkeypatch, backend: str, checked: bool):
    monkeypatch.setenv("MSA_BACKEND", backend)
    monkeypatch.setenv("MSA_CHECK_INPUTS", "1" if checked else "0")


def _open_gates(case, monkeypatch):
    """Kernels compiled but still gated (_backend.unvalidated_reason) serve the cases that
    reach them: this table is part of their hardware validation, as their own GPU tests are."""
    from msa._native import decode_indexer_cuda
    if not decode_indexer_cuda.VALIDATED and {"decode_indexer_topk",
                                              "decode_indexer_plan_update"} & set(case.ops):
        monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")


def _made(case, seed):
    """The case built afresh (same seed -> the same bytes for every backend)."""
    made = case.make(_device(), torch.Generator().manual_seed(seed))
    return made, [t.clone() for t in made.inputs]


def assert_context_alive():
    """The call finished and the CUDA context still works (a device assert or an illegal
    address would surface here and poison every later CUDA call)."""
    torch.cuda.synchronize()
    assert int(torch.arange(4, device=_device()).sum()) == 6


def assert_ran_natively(case):
    from msa import _backend
    for op in case.ops:
        assert _backend.last_backend(op) == "sm90", f"{op} ran on {_backend.last_backend(op)}"


def _tolerance(made) -> float:
    fp8 = any(t.dtype == torch.float8_e4m3fn for t in made.inputs)
    return 0.5 if fp8 else 3e-2


def assert_same_outputs(native, reference, tol):
    assert len(native) == len(reference)
    for a, b in zip(native, reference):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if not a.is_floating_point():
            assert torch.equal(a.cpu(), b.cpu())
            continue
        a, b = a.float().cpu(), b.float().cpu()
        assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN positions differ"
        assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a[torch.isinf(a)],
                                                                           b[torch.isinf(b)])
        finite = torch.isfinite(a)
        assert torch.allclose(a[finite], b[finite], atol=tol, rtol=2e-2), \
            float((a[finite] - b[finite]).abs().max())


def _reference_outputs(case, seed, monkeypatch):
    _env(monkeypatch, "reference", False)
    made, _ = _made(case, seed)
    return outputs_of(made.call())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_table_native(case, seed, monkeypatch):
    backend = "native" if case.ops else "auto"
    _open_gates(case, monkeypatch)
    expect = case.expect
    if isinstance(expect, Error):
        for checked in (False, True):
            _env(monkeypatch, backend, checked)
            made, before = _made(case, seed)
            assert_raises(made, expect.cls, expect.arg)
            assert_unmutated(made, before)
    elif isinstance(expect, Invalid):
        _env(monkeypatch, backend, True)
        made, _ = _made(case, seed)
        assert_raises(made, expect.cls, expect.arg)
        _env(monkeypatch, backend, False)
        made, before = _made(case, seed)
        if case.ops:
            made.call()
            assert_context_alive()
            assert_ran_natively(case)
        else:          # reference only: it always checks
            assert_raises(made, expect.cls, expect.arg, expect.reference_arg)
        assert_unmutated(made, before)
    elif isinstance(expect, (Skip, Same)):
        reference = _reference_outputs(case, seed, monkeypatch)
        _env(monkeypatch, backend, False)
        made, before = _made(case, seed)
        native = outputs_of(made.call())
        assert_context_alive()
        if case.ops:
            assert_ran_natively(case)
        assert_same_outputs(native, reference, _tolerance(made))
        assert_unmutated(made, before)
        _env(monkeypatch, backend, True)
        made, _ = _made(case, seed)
        if isinstance(expect, Skip):
            assert_raises(made, ValueError, expect.arg)
        else:
            made.call()
    elif isinstance(expect, NonFinite):
        _env(monkeypatch, backend, False)
        made, before = _made(case, seed)
        outs = outputs_of(made.call())
        clean = outputs_of(made.clean())
        assert_context_alive()
        if case.ops:
            assert_ran_natively(case)
        made.lse_too = expect.lse_too
        assert_nonfinite(made, [o.cpu() for o in outs], [c.cpu() for c in clean])
        assert_unmutated(made, before)
    else:
        raise AssertionError(f"unknown outcome {expect!r}")
