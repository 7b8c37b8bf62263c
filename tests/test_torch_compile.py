"""torch.compile of the public entry points, through the package's custom ops (CPU).

A built variant (tools/build_variant.py --no-compile, loaded with the `kernels` loader, as users
get it) defines one custom op per native call family under its own op namespace
(msa._custom_ops). ``torch.compile(fullgraph=True)`` of sparse_atten_func, msa_prefill, fmha and
the decode wrapper's run must trace without a graph break and give exactly the eager result
(on the CPU both run the reference); torch.library.opcheck checks each op's schema, fake
implementation and dynamic-shape tracing against real calls. The native path is compiled on the
H200 by tests/test_hub_variant_gpu.py.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from msa_testing import cu_seqlens, random_q2k  # noqa: E402
from op_recording import OpCallRecording  # noqa: E402
from test_decode import make_batch, random_q2k as decode_q2k  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "torch-ext" / "msa"
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """The package as get_local_kernel loads a fresh local build (unique op namespace)."""
    import kernels

    repo = tmp_path_factory.mktemp("msa-compile-repo")
    build_id = "c" + uuid.uuid4().hex[:10]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "build_variant.py"),
                           "--out", str(repo / "build"), "--no-compile", "--id", build_id],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return kernels.get_local_kernel(repo)


def _sub(module, name):
    return importlib.import_module(f"{module.__name__}.{name}")


@pytest.fixture
def recorded(variant, monkeypatch):
    return OpCallRecording(variant, monkeypatch)


def _same(a, b):
    """Exactly equal results (tensors, None, or tuples of them; NaN equal to NaN)."""
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif a is None:
        assert b is None
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _compiled_matches_eager(fn, *args, backend="aot_eager"):
    """fullgraph: any graph break fails. "aot_eager" traces through AOT autograd with fake
    tensors like the default backend but skips Inductor's C++ code generation (minutes on a
    2-core CI machine); one test uses Inductor itself."""
    torch._dynamo.reset()
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    _same(compiled, eager)
    return eager


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

Q_LENS, K_LENS, HKV, GROUP, TOPK = (300, 200), (300, 400), 2, 4, 4


def _prefill_inputs(seed, dtype=BF16, q_lens=Q_LENS, k_lens=K_LENS):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    tq, tk = sum(q_lens), sum(k_lens)
    return dict(q=draw(tq, HKV * GROUP, 128), k=draw(tk, HKV, 128), v=draw(tk, HKV, 128),
                q_idx=draw(tq, HKV, 128), k_idx=draw(tk, 1, 128),
                cu_q=cu_seqlens(q_lens), cu_k=cu_seqlens(k_lens))


def _sparse_call(variant, x, schedule: bool):
    q2k = random_q2k(Q_LENS, K_LENS, HKV, TOPK, causal_visible_only=True)
    lens = dict(max_seqlen_q=max(Q_LENS), max_seqlen_k=max(K_LENS))
    csr = variant.build_k2q_csr(q2k, x["cu_q"], x["cu_k"], 128, total_k=sum(K_LENS),
                                qhead_per_kv=GROUP, return_schedule=schedule, **lens)

    def run(q, k, v):
        return variant.sparse_atten_func(
            q, k, v, csr[0], csr[1], TOPK, cu_seqlens_q=x["cu_q"], cu_seqlens_k=x["cu_k"],
            causal=True, return_softmax_lse=True, return_temperature_lse=True,
            lse_temperature_scale=2.0, schedule=csr[2] if schedule else None, **lens)
    return q2k, run


# ---------------------------------------------------------------------------------------------
# fullgraph compile == eager
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", [False, True], ids=["no-schedule", "schedule"])
def test_sparse_atten_func_compiles_fullgraph(variant, seed, schedule):
    x = _prefill_inputs(seed)
    _q2k, run = _sparse_call(variant, x, schedule)
    out, lse, lse_t = _compiled_matches_eager(run, x["q"], x["k"], x["v"],
                                              backend="inductor" if schedule else "aot_eager")
    assert out.dtype == BF16 and torch.isfinite(lse).any() and not torch.equal(lse, lse_t)


@pytest.mark.parametrize("dtype", [BF16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_msa_prefill_compiles_fullgraph(variant, seed, dtype):
    x = _prefill_inputs(seed, dtype)

    def run(q, k, v, q_idx, k_idx):
        return variant.msa_prefill(q, k, v, q_idx, k_idx, x["cu_q"], x["cu_k"],
                                   max_seqlen_q=max(Q_LENS), max_seqlen_k=max(K_LENS),
                                   topk=TOPK, return_selection=True)

    out, q2k = _compiled_matches_eager(run, x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"])
    assert q2k.shape == (HKV, sum(Q_LENS), TOPK) and (q2k >= 0).any()


@pytest.mark.parametrize("mode", ["o", "o+max-score", "max-score", "paged"])
def test_fmha_compiles_fullgraph(variant, seed, mode):
    x = _prefill_inputs(seed)
    plan = variant.fmha_plan(torch.tensor(Q_LENS), torch.tensor(K_LENS), HKV * GROUP, HKV,
                             causal=True, output_maxscore=mode in ("o+max-score", "max-score"),
                             page_size=128 if mode == "paged" else -1)
    k, v, kwargs = x["k"], x["v"], {}
    if mode == "paged":   # each request's keys on whole 128-token pages, pages in order
        pages = [-(-n // 128) for n in K_LENS]
        k = torch.zeros(sum(pages), HKV, 128, 128, dtype=BF16)
        v = torch.zeros_like(k)
        start, page = 0, 0
        for n, count in zip(K_LENS, pages):
            for p in range(count):
                rows = slice(start + 128 * p, start + min(128 * (p + 1), n))
                width = rows.stop - rows.start
                k[page, :, :width] = x["k"][rows].transpose(0, 1)
                v[page, :, :width] = x["v"][rows].transpose(0, 1)
                page += 1
            start += n
        kwargs["kv_indices"] = torch.arange(sum(pages), dtype=torch.int32)
    if mode == "max-score":
        kwargs["output_o"] = False

    def run(q, k, v):
        return variant.fmha(q, k, v, plan, **kwargs)

    o, max_score = _compiled_matches_eager(run, x["q"], k, v)
    assert (o is None) == (mode == "max-score")
    assert (max_score is None) == (mode in ("o", "paged"))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_decode_run_compiles_fullgraph(variant, sparse):
    lens, hkv, group = [129, 1000, 77], 2, 8
    q, k, v, table, seqused_k = make_batch(lens, 1, hkv, group)
    q2k = decode_q2k(lens, 1, hkv, 8) if sparse else None
    wrapper = variant.SparseDecodePagedAttentionWrapper()
    wrapper.plan(page_table=table, seqused_k=seqused_k, seqlen_q=1, max_seqlen_k=max(lens),
                 q2k_indices=q2k, num_qo_heads=hkv * group, num_kv_heads=hkv,
                 fixed_split_size=2)
    assert wrapper.decode_schedule.split_kv
    out_buffer = torch.full(q.shape, float("nan"), dtype=BF16)

    def run(q, k, v):
        return wrapper.run(q, k, v, return_softmax_lse=True, out=out_buffer)

    out, lse = _compiled_matches_eager(run, q, k, v)
    assert out.data_ptr() == out_buffer.data_ptr() and not torch.isnan(out).any()

    def function(q, k, v):
        return variant.sparse_decode_atten_func(q, k, v, q2k, page_table=table,
                                                seqused_k=seqused_k, seqlen_q=1,
                                                max_seqlen_k=max(lens))

    unsplit = _compiled_matches_eager(function, q, k, v)
    torch.testing.assert_close(unsplit.float(), out.float(), atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# The ops themselves
# ---------------------------------------------------------------------------------------------

def test_opcheck_every_custom_op(variant, recorded, seed):
    """Each op, on arguments recorded from real calls: schema (declared mutations only),
    fake implementation vs the real one, and AOT tracing with dynamic shapes."""
    q_lens, k_lens = (100, 60), (100, 150)       # small: opcheck runs each op many times
    x = _prefill_inputs(seed, q_lens=q_lens, k_lens=k_lens)
    lens = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))
    variant.msa_prefill(x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], x["cu_q"], x["cu_k"],
                        topk=TOPK, **lens)
    variant.block_max_scores(x["q_idx"], x["k_idx"], x["cu_q"], x["cu_k"],
                             qo_offset=torch.tensor([0, 90], dtype=torch.int32), **lens)
    plan = variant.fmha_plan(torch.tensor(q_lens), torch.tensor(k_lens), HKV * GROUP, HKV,
                             causal=True, output_maxscore=True)
    variant.fmha(x["q"], x["k"], x["v"], plan)
    lens = [129, 300, 77]
    q, k, v, table, seqused_k = make_batch(lens, 2, 2, 4)
    wrapper = variant.SparseDecodePagedAttentionWrapper().plan(
        page_table=table, seqused_k=seqused_k, seqlen_q=2, max_seqlen_k=max(lens),
        q2k_indices=decode_q2k(lens, 2, 2, 8), num_qo_heads=8, num_kv_heads=2,
        fixed_split_size=1)
    wrapper.run(q, k, v, return_softmax_lse=True)
    recorded.check()


def test_custom_ops_live_in_the_variants_namespace(variant):
    ops_module = _sub(variant, "_ops")
    entries = _sub(variant, "_compile_entries")
    compiled_ops = _sub(variant, "_native.compiled_ops")
    for name in entries.CUSTOM_OPS.values():
        assert name not in compiled_ops.CSRC_OPS     # csrc's names are taken in a cuda build
        assert hasattr(ops_module.ops, name), name
    assert ops_module.ops.name == variant.__name__


def test_a_second_copy_of_the_build_reuses_the_ops(variant, seed):
    """The same variant imported again under another module name (e.g. once by a test harness,
    once by the kernels loader) defines nothing twice and compiles through the same ops."""
    path = Path(variant.__file__).parent
    name = f"{variant.__name__}_again"
    spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    again = importlib.util.module_from_spec(spec)
    sys.modules[name] = again
    spec.loader.exec_module(again)
    x = _prefill_inputs(seed)
    _q2k, run = _sparse_call(again, x, False)
    _compiled_matches_eager(run, x["q"], x["k"], x["v"])


def test_eager_calls_bypass_the_custom_ops(variant):
    backend = _sub(variant, "_backend")
    assert backend.compile_entry("sparse_atten") is None
    assert set(backend._compile_entries) == set(_sub(variant, "_compile_entries").CUSTOM_OPS)


def _plan_keys_read(path: Path, functions=None):
    """Keys read as plan["k"] / plan.get("k") / call.plan["k"] in `path` (or its `functions`)."""
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if functions is None
             or (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in functions)]
    keys = set()
    for root in nodes:
        for node in ast.walk(root):
            target = key = None
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                target, key = node.value, node.slice.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "get" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                target, key = node.func.value, node.args[0].value
            if target is not None and ast.unparse(target) in ("plan", "call.plan", "self.plan"):
                keys.add(key)
    return keys


def test_fmha_op_carries_every_plan_entry_the_backends_read(variant):
    """The fmha op rebuilds the plan from FMHA_PLAN_TENSORS / FMHA_PLAN_VALUES only: the
    native backend and the reference may read nothing else from a call's plan."""
    entries = _sub(variant, "_compile_entries")
    carried = set(entries.FMHA_PLAN_TENSORS) | set(entries.FMHA_PLAN_VALUES)
    native = _plan_keys_read(PACKAGE_DIR / "_native" / "fmha_sm90.py")
    fmha = PACKAGE_DIR / "fmha"
    reference = (_plan_keys_read(fmha / "call.py") | _plan_keys_read(fmha / "reference.py")
                 | _plan_keys_read(fmha / "run.py", {"run_fmha_dense"}))
    assert native and reference
    assert (native | reference) <= carried, (native | reference) - carried
