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


def assert_raises(made, cls, *args):
    """The call raises `cls` with a message that starts with one of `args`."""
    with pytest.raises(cls) as info:
        made.call()
    assert str(info.value).startswith(tuple(a for a in args if a)), str(info.value)


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
    if isinstance(expect, Error):
        assert_raises(made, expect.cls, expect.arg)
    elif isinstance(expect, Invalid):
        assert_raises(made, expect.cls, expect.arg,
                      None if checked else expect.reference_arg)
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


def public_callables(module) -> list:
    """The public functions and classes a module defines itself (not the names it imports)."""
    return sorted(name for name, value in vars(module).items()
                  if not name.startswith("_") and callable(value)
                  and getattr(value, "__module__", None) == module.__name__)


def test_table_covers_every_public_function():
    """Every public function and class has cases under its name; a public module (``layers``)
    has cases for each public callable it defines, as "module.name"."""
    import types
    import msa
    covered = {c.fn for c in CASES}
    missing = []
    for name in sorted(set(msa.__all__) | set(msa.__all_additive__)):
        value = getattr(msa, name)
        if isinstance(value, types.ModuleType):
            own = public_callables(value)
            assert own, f"{name}: a public module without public callables"
            missing += [f"{name}.{n}" for n in own if f"{name}.{n}" not in covered]
        elif name not in covered:
            missing.append(name)
    assert not missing, f"no bad-input case for {missing}"
    assert len(CASES) >= 300, len(CASES)


# ---------------------------------------------------------------------------------------------
# The native sparse prefill's host glue on the CPU: whatever the index values, what it hands the
# kernels stays within their buffers (the invariants the CuTe kernels index by).
# ---------------------------------------------------------------------------------------------

def _check_launch_invariants(call):
    """Replays sparse_prefill_sm90.run's preparation on the CPU and checks every index the
    kernels read from it: an out-of-range torch gather raises IndexError here, where the GPU
    raised a device-side assert."""
    from msa.schedules.sparse import INT32_MAX, build_schedule_on_device
    from msa._validation import device_prefix_sums
    total_q = call.q.shape[0]
    cu_q = device_prefix_sums(call.cu_seqlens_q, total_q)
    cu_k = device_prefix_sums(call.cu_seqlens_k, INT32_MAX if call.paged else call.k.shape[0])
    for cu, total in ((cu_q, total_q), (cu_k, INT32_MAX if call.paged else call.k.shape[0])):
        assert int(cu.min()) >= 0 and int(cu.max()) <= total and bool((cu[1:] >= cu[:-1]).all())
    schedule = call.schedule if call.schedule is not None else \
        build_schedule_on_device(call, cu_q, cu_k)
    slots = max(call.topk, schedule.topk)
    row_ptr = schedule.k2q_row_ptr.long()
    qsplit = schedule.qsplit_indices.long()
    hkv, width = qsplit.shape
    rows = row_ptr.shape[1] - 1
    batch = cu_q.numel() - 1
    assert bool((row_ptr >= 0).all()) and int(row_ptr.max()) <= width
    assert bool((row_ptr[:, 1:] >= row_ptr[:, :-1]).all())
    n_work = int(schedule.work_count[0])
    meta = schedule.scheduler_metadata[:n_work].long()
    assert n_work <= schedule.work_capacity
    if n_work:
        h, r, q0, qn, b, _blk = meta.unbind(1)
        assert bool(((h >= 0) & (h < hkv) & (r >= 0) & (r < rows) & (b >= 0) & (b < batch)
                     & (q0 >= 0) & (qn >= 0)).all())
        end = row_ptr[h, r] + q0 + qn
        assert bool((end <= width).all()), "a work item reads past k2q_q_indices"
        q_len = (cu_q[1:] - cu_q[:-1]).long()
        for w in range(n_work):
            entries = qsplit[int(h[w]), int(row_ptr[h[w], r[w]] + q0[w]):int(end[w])]
            entries = entries[entries >= 0]
            local, slot = entries & ((1 << 24) - 1), entries >> 24
            inside = local < q_len[b[w]]          # the kernels write only these rows
            assert bool((slot[inside] < slots).all()), "a slot past o_partial"
            assert bool((cu_q[b[w]] + local[inside] < total_q).all()), "a row past q"
    assert tuple(schedule.split_counts.shape) == (total_q, hkv)
    assert bool((schedule.split_counts >= 0).all())


SPARSE_NATIVE_CASES = [c for c in CPU_CASES if "sparse_atten" in c.ops
                       and not isinstance(c.expect, Error)]


@pytest.mark.parametrize("case", SPARSE_NATIVE_CASES, ids=[c.id for c in SPARSE_NATIVE_CASES])
def test_native_sparse_glue_stays_in_bounds(case, seed, monkeypatch):
    """Every non-Error table case that reaches the native sparse attention, with a CPU stand-in
    for the kernels that checks what the glue hands them (unchecked: nothing stops bad values
    before it)."""
    from msa import _backend
    real_choose = _backend.choose
    seen = []

    def fake_native(call):
        _check_launch_invariants(call)
        seen.append(call)
        out = torch.zeros(call.q.shape, dtype=torch.bfloat16)
        lse = torch.zeros(call.q.shape[:2])
        return out, lse, lse

    def choose(op, device, **features):
        if op == "sparse_atten":
            return "sm90", fake_native
        return real_choose(op, device, **features)

    monkeypatch.setattr(_backend, "choose", choose)
    monkeypatch.setenv("MSA_CHECK_INPUTS", "0")
    made = case.make(CPU, torch.Generator().manual_seed(seed))
    try:
        made.call()
    except ValueError:
        # A pipeline's reference stages before the attention (or its own checks of what they
        # read) reject invalid values first.
        assert isinstance(case.expect, Invalid) and case.ops.index("sparse_atten") > 0
        return
    assert seen, "the call never reached the native glue"


def test_device_mismatch_names_the_tensor_off_the_shared_device():
    """The tensor on another device than the rest is the one named, wherever it comes in the
    argument list; with two tensors, the later one."""
    from msa._validation import check_same_device
    cpu, meta = torch.empty(1), torch.empty(1, device="meta")
    with pytest.raises(ValueError, match=r"^a: is on meta but b, c are on cpu"):
        check_same_device(a=meta, b=cpu, c=cpu)
    with pytest.raises(ValueError, match=r"^c: is on meta but a, b are on cpu"):
        check_same_device(a=cpu, b=cpu, c=meta)
    with pytest.raises(ValueError, match=r"^b: is on meta but a is on cpu"):
        check_same_device(a=cpu, b=meta, c=None)
    assert check_same_device(a=cpu, b=None, c=cpu) == torch.device("cpu")
    assert check_same_device(a=None) is None


def test_step_names_the_index_query_on_another_device():
    """The decode step with q_idx alone on another device names q_idx (the meta device stands
    in for the GPU-only case 'MSADecodeStepWrapper: q_idx on the CPU')."""
    import bad_input_table as table
    make = table._step_make(lambda a: dict(q_idx=a["q_idx"].to("meta")))
    made = make(torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^q_idx: is on meta but k_idx, page_table"):
        made.call()
