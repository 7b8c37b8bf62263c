"""Bad input and bad data on the CPU reference backend: the shared table of
tests/bad_input_table.py (every public function), unchecked and with MSA_CHECK_INPUTS=1.

Error -> the contract's class, the message starting with the argument's name, checked or not.
Invalid -> the reference always raises it (it reads the values anyway).
Skip -> runs unchecked (the documented skip), raises with the value checks.
Same -> runs, deterministic, checked or not.
NonFinite -> the rows that meet NaN / Inf are non-finite, never the empty row; the others are
exactly the clean call's.
No case mutates its inputs.
"""

import pytest
import torch

from bad_input_table import (CASES, Error, Invalid, NonFinite, Same, Skip, outputs_of)

CPU = torch.device("cpu")
CPU_CASES = [c for c in CASES if not c.gpu_only]


def run_case(case, gen_seed, monkeypatch, checked):
    monkeypatch.setenv("MSA_CHECK_INPUTS", "1" if checked else "0")
    made = case.make(CPU, torch.Generator().manual_seed(gen_seed))
    before = [t.clone() for t in made.inputs]
    return made, before


def assert_raises(made, cls, arg):
    with pytest.raises(cls) as info:
        made.call()
    assert str(info.value).startswith(arg), str(info.value)


def _bytes(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_unmutated(made, before):
    for t, b in zip(made.inputs, before):
        assert torch.equal(_bytes(t), _bytes(b)), "an input was modified"


def assert_nonfinite(made, outs, clean):
    """Affected rows non-finite in O (and LSE when it reads the bad data: NaN or +inf, never
    -inf); unaffected rows identical to the clean call."""
    case_out = outs[0].float()
    mask = made.affected
    assert mask is not None and bool(mask.any()), "the case affects no row"
    shape = mask.shape + (1,) * (case_out.dim() - mask.dim())
    sel = case_out[mask.view(shape).expand_as(case_out)].view(-1, *case_out.shape[mask.dim():])
    if made.channels is not None:
        sel = sel[..., list(made.channels)]
    assert not bool(torch.isfinite(sel).any()), "a row that met NaN/Inf came back finite"
    clean_out = clean[0].float()
    keep = made.unaffected.view(shape).expand_as(case_out)
    assert torch.equal(case_out[keep], clean_out[keep]), "an unaffected row changed"
    if made.lse_too and len(outs) > 1:
        lse = outs[1]
        assert not bool(torch.isfinite(lse[mask]).any())
        assert not bool(torch.isneginf(lse[mask]).any()), "NaN data reported as an empty row"
        assert torch.equal(lse[made.unaffected], clean[1][made.unaffected])


@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("case", CPU_CASES, ids=[c.id for c in CPU_CASES])
def test_bad_input_table_reference(case, checked, seed, monkeypatch):
    made, before = run_case(case, seed, monkeypatch, checked)
    expect = case.expect
    if isinstance(expect, (Error, Invalid)):
        assert_raises(made, expect.cls, expect.arg)
    elif isinstance(expect, Skip):
        if checked:
            assert_raises(made, ValueError, expect.arg)
        else:
            made.call()
    elif isinstance(expect, Same):
        first = outputs_of(made.call())
        again = outputs_of(made.call())
        assert all(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(
            a.float(), b.float(), equal_nan=True, atol=0, rtol=0)) for a, b in zip(first, again))
    elif isinstance(expect, NonFinite):
        outs = outputs_of(made.call())
        clean = outputs_of(made.clean())
        made.lse_too = expect.lse_too
        assert_nonfinite(made, outs, clean)
    else:
        raise AssertionError(f"unknown outcome {expect!r}")
    assert_unmutated(made, before)


def test_table_covers_every_public_function():
    import msa
    covered = {c.fn for c in CASES}
    public = set(msa.__all__) | set(msa.__all_additive__)
    missing = sorted(public - covered)
    assert not missing, f"no bad-input case for {missing}"
    assert len(CASES) >= 300, len(CASES)
