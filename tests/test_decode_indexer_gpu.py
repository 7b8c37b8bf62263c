"""GPU tests of the native fused decode indexer + top-k (csrc/decode_indexer.cu via
msa._native.decode_indexer_cuda) and of the decode step wrapper on it, against the float64
oracle of tests/test_decode_indexer.py (NVFP4 keys from the package's own quantizer).

Checks per call: the kernel's block scores (return_scores) match the oracle's; the kernel's
selection is exactly the ranking of its own scores (so ties and ordering are the contract's);
and the selection is the oracle's up to score differences below the fp32 tolerance. Outputs are
poisoned first. Needs a built variant (MSA_TEST_PACKAGE_DIR, set by tools/gpu_session.sh); runs
the gated kernel with MSA_UNVALIDATED_KERNELS=1 and MSA_BACKEND=native (no silent fallback).
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from msa_testing import (TIERS, assert_same_attention, compiled_variant_with, native_families,
                         use_tier)
from test_decode_indexer import P, check_selection, make_attention_inputs, make_index_batch

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]
OP_NAME = "decode_indexer_topk"
SCORE_TOL = 2e-4


@pytest.fixture(scope="module")
def msa_pkg():
    return compiled_variant_with("decode_indexer_topk")


@pytest.fixture
def native_only(monkeypatch):
    monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
    monkeypatch.setenv("MSA_BACKEND", "native")


@pytest.fixture(params=TIERS)
def tier(request, monkeypatch):
    """The Hopper family's registration, and the portable tier's forced (the same kernels,
    behind the tier's device image check)."""
    return use_tier(request.param, monkeypatch)


def _plan(msa, inputs, seqlen_q, heads, topk, **kw):
    return msa.make_decode_indexer_plan(inputs["seqused_k"], seqlen_q=seqlen_q,
                                        num_index_heads=heads, topk=topk,
                                        max_seqlen_k=int(inputs["seqused_k"].max()) + 1, **kw)


def _run(msa, inputs, plan, out_heads=None):
    heads = inputs["q_idx"].shape[1]
    out = torch.full((out_heads or heads, inputs["q_idx"].shape[0], plan.topk), -7,
                     dtype=torch.int32, device="cuda")
    args = {k: v for k, v in inputs.items() if k != "seqused_k"}
    out, scores = msa.decode_indexer_topk(plan=plan, out=out, return_scores=True, **args)
    assert msa._backend.last_backend(OP_NAME) in native_families()
    torch.cuda.synchronize()
    return out.cpu(), scores.cpu()


def _check(inputs, keys, seqlen_q, topk, out, scores):
    check_selection(inputs, keys, seqlen_q, topk, out, scores, score_tol=SCORE_TOL)


LENS = [1, 129, 1000, 256, 77, 40000, 128]


@pytest.mark.parametrize("fmt", ["bf16", "e4m3", "nvfp4"])
@pytest.mark.parametrize("seqlen_q,heads", [(1, 4), (8, 4), (16, 1), (3, 2), (16, 8)])
@pytest.mark.parametrize("topk", [16, 32, 4])
def test_native_indexer_matches_oracle(msa_pkg, native_only, seed, fmt, seqlen_q, heads, topk):
    inputs, keys = make_index_batch(LENS, seqlen_q, heads, fmt, device="cuda")
    plan = _plan(msa_pkg, inputs, seqlen_q, heads, topk)
    out, scores = _run(msa_pkg, inputs, plan)
    _check(inputs, keys, seqlen_q, topk, out, scores)


@pytest.mark.parametrize("fmt", ["bf16", "e4m3", "nvfp4"])
@pytest.mark.parametrize("seqlen_q,heads", [(1, 4), (3, 2), (16, 8)])
def test_portable_tier_indexer_matches_oracle(msa_pkg, native_only, seed, monkeypatch, fmt,
                                              seqlen_q, heads):
    """The portable tier's decode indexer and plan update (forced: MSA_NATIVE_TIER=portable)."""
    use_tier("portable", monkeypatch)
    inputs, keys = make_index_batch(LENS, seqlen_q, heads, fmt, device="cuda")
    plan = _plan(msa_pkg, inputs, seqlen_q, heads, 16)
    plan.update()
    assert msa_pkg._backend.last_backend("decode_indexer_plan_update") == "portable"
    out, scores = _run(msa_pkg, inputs, plan)
    assert msa_pkg._backend.last_backend(OP_NAME) == "portable"
    _check(inputs, keys, seqlen_q, 16, out, scores)


def _launched_indexers(fn):
    """The template arguments of every decode indexer kernel `fn` launches, as strings: (format
    (1: e4m3 pages by cp.async into padded rows, 3: e4m3 pages by TMA into swizzled stages),
    m-tiles, list capacity, offer warp)."""
    import re
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {tuple(a.strip() for a in m.group(1).split(",")) for n in names
            for m in [re.search(r"decode_indexer_topk_kernel<([^>]*)>", n)] if m}


def _check_forced_form(msa, fmt, seqlen_q, heads, topk, arg, expected):
    """One call under a forcing hook: every indexer launch has template argument `arg` (see
    _launched_indexers) equal to `expected`, the selection meets the oracle, and out-of-range
    page ids and lengths stay skipped (every id stays in the page table)."""
    inputs, keys = make_index_batch(LENS, seqlen_q, heads, fmt, device="cuda")
    plan = _plan(msa, inputs, seqlen_q, heads, topk)
    result = {}
    launched = _launched_indexers(lambda: result.update(zip(("out", "scores"),
                                                            _run(msa, inputs, plan))))
    assert {args[arg] for args in launched} == {expected}, launched
    _check(inputs, keys, seqlen_q, topk, result["out"], result["scores"])
    inputs["page_table"][0, 1] = 1 << 30
    inputs["page_table"][1, 3] = -5
    inputs["seqused_k"][2] = 1 << 30
    out, _ = _run(msa, inputs, _plan(msa, inputs, seqlen_q, heads, topk))
    width = inputs["page_table"].shape[1]
    assert ((out >= -1) & (out < width)).all()


@pytest.mark.parametrize("tma", [False, True], ids=["cp_async", "tma"])
@pytest.mark.parametrize("seqlen_q,heads,topk", [(1, 4, 16), (8, 4, 16), (16, 8, 32), (3, 2, 4)])
def test_native_indexer_e4m3_page_copies(msa_pkg, native_only, seed, native_hooks, tma, seqlen_q,
                                         heads, topk):
    """e4m3 index pages by every thread's cp.asyncs into padded rows, or (sm_90+) as one TMA
    copy each into 128-byte swizzled stages: the launch runs the form asked for, the selection
    meets the oracle either way, and out-of-range page ids and lengths stay skipped."""
    native_hooks.force(decode_indexer_tma=tma)
    _check_forced_form(msa_pkg, "e4m3", seqlen_q, heads, topk, 0, "3" if tma else "1")


@pytest.mark.parametrize("offer_warp", [False, True], ids=["warp0_offers", "offer_warp"])
@pytest.mark.parametrize("fmt", ["bf16", "e4m3", "nvfp4"])
@pytest.mark.parametrize("seqlen_q,heads,topk", [(8, 4, 16), (8, 4, 32), (5, 4, 16), (3, 8, 4)])
def test_native_indexer_offer_warp(msa_pkg, native_only, seed, native_hooks, offer_warp, fmt,
                                   seqlen_q, heads, topk):
    """Calls of 17-32 rows a request with the candidate lists in warp 0 (which also scores) or
    in a ninth warp that only offers: the launch runs the form asked for, the selection meets
    the oracle either way, and out-of-range page ids and lengths stay skipped."""
    native_hooks.force(decode_indexer_offer_warp=offer_warp)
    _check_forced_form(msa_pkg, fmt, seqlen_q, heads, topk, 3, "true" if offer_warp else "false")


def test_native_indexer_nvfp4_linear_scales(msa_pkg, native_only, seed):
    torch.manual_seed(seed)
    tiled, keys = make_index_batch(LENS, 8, 4, "nvfp4", device="cuda")
    torch.manual_seed(seed)
    linear, _ = make_index_batch(LENS, 8, 4, "nvfp4", device="cuda", layout="linear")
    plan = _plan(msa_pkg, tiled, 8, 4, 16)
    a, scores = _run(msa_pkg, tiled, plan)
    b, _ = _run(msa_pkg, linear, plan)
    assert torch.equal(a, b)
    _check(tiled, keys, 8, 16, a, scores)


MERGE_FORMS = {"rounds": False, "butterfly": True}


def _run_merge_form(msa, native_hooks, merge, inputs, plan):
    """One call with the chunk lists merged in `merge`'s form (MERGE_FORMS), which it checks
    the launch asked for."""
    decode_indexer_cuda = importlib.import_module(f"{msa.__name__}._native.decode_indexer_cuda")
    native_hooks.force(decode_indexer_butterfly_merge=MERGE_FORMS[merge])
    result = _run(msa, inputs, plan)
    assert decode_indexer_cuda.last_launch()["butterfly_merge"] == MERGE_FORMS[merge]
    return result


@pytest.mark.parametrize("merge", list(MERGE_FORMS))
@pytest.mark.parametrize("max_ctas", [1, 7, 600])
def test_native_indexer_any_split(msa_pkg, native_only, seed, tier, native_hooks, max_ctas,
                                  merge):
    """One CTA for everything, a few, and more CTAs than blocks (many one-chunk merges), with
    the chunk lists merged in rounds or as a butterfly."""
    lens = [100000, 3, 5000]
    inputs, keys = make_index_batch(lens, 8, 4, "e4m3", device="cuda")
    plan = _plan(msa_pkg, inputs, 8, 4, 16, max_ctas=max_ctas)
    out, scores = _run_merge_form(msa_pkg, native_hooks, merge, inputs, plan)
    _check(inputs, keys, 8, 16, out, scores)


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
@pytest.mark.parametrize("seqlen_q,heads,topk", [(8, 4, 16), (8, 4, 32), (1, 4, 16), (16, 8, 4)])
def test_native_indexer_merge_segments(msa_pkg, native_only, seed, native_hooks, fmt, seqlen_q,
                                       heads, topk):
    """The merge gives a row the narrowest segment of lanes that spreads the rows over the
    warps (one pass a warp), each lane pooling every seg-th chunk list: requests of 1, 2, 3, 5,
    9, 17, 33 and 40 chunks of 4 blocks, so at 128 rows segments of 2 lanes (up to 20 lists a
    lane), at 32 rows 8 (up to 5), at 4 rows 32 (2 lists on some lanes past 32 chunks, idle
    lanes below). The rounds and the butterfly pick the same blocks in the same order (one
    total order: higher score, then lower id), and meet the oracle."""
    from msa.decode_indexer import plan_work_split
    chunks = (1, 2, 3, 5, 9, 17, 33, 40)
    lens = [4 * n * 128 + 1 + 13 * i for i, n in enumerate(chunks)]   # 4 n history blocks
    max_ctas = 1000
    _, requests, chunk = plan_work_split(lens, max_ctas + len(lens))
    assert chunk == 4 and requests[:, 1].tolist() == list(chunks)
    inputs, keys = make_index_batch(lens, seqlen_q, heads, fmt, device="cuda")
    plan = _plan(msa_pkg, inputs, seqlen_q, heads, topk, max_ctas=max_ctas)
    rounds, scores = _run_merge_form(msa_pkg, native_hooks, "rounds", inputs, plan)
    butterfly, _ = _run_merge_form(msa_pkg, native_hooks, "butterfly", inputs, plan)
    assert torch.equal(rounds, butterfly)
    _check(inputs, keys, seqlen_q, topk, butterfly, scores)


def test_native_plan_update_matches_host_split(msa_pkg, native_only, tier):
    """The update kernel's split equals plan_work_split's: fixed shapes, ragged batches of the
    production grid's sizes, and more requests than the kernel keeps in shared memory (2048)."""
    from msa.decode_indexer import plan_work_split
    rng = random.Random(20261207)
    ragged = [([nominal + rng.randrange(-nominal // 4, nominal // 4) for _ in range(batch)], 264)
              for batch in (1, 8, 32, 128) for nominal in (4000, 10000, 100000)]
    ragged += [([rng.randrange(0, 2_000_000) for _ in range(rng.randrange(1, 40))],
                rng.randrange(1, 600)) for _ in range(12)]
    ragged.append(([rng.randrange(0, 300000) for _ in range(3000)], 264))
    for lens, ctas in [([1, 129, 100000, 0, 257], 40), ([200000], 264), ([4000] * 128, 264),
                       (list(range(0, 3000 * 70, 3000)), 9)] + ragged:
        seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
        plan = msa_pkg.make_decode_indexer_plan(seq, seqlen_q=1, num_index_heads=1,
                                                max_seqlen_k=max(lens) + 1, max_ctas=ctas)
        work, requests, chunk = plan_work_split(lens, plan.capacity)
        torch.cuda.synchronize()
        assert msa_pkg._backend.last_backend("decode_indexer_plan_update") == tier
        assert torch.equal(plan.work.cpu(), work)
        assert torch.equal(plan.requests.cpu(), requests)
        assert int(plan.chunk_pages) == chunk


def test_native_graph_replay_and_stale_plan(msa_pkg, native_only, seed, tier):
    """Capture update + indexer; new lengths, pages, keys and queries written into the same
    buffers replay to the eager (and oracle) result. Without update() (a stale split) the
    result still meets the contract."""
    seqlen_q, heads, topk = 8, 4, 16
    inputs, _ = make_index_batch([9500, 900, 9500], seqlen_q, heads, "e4m3", device="cuda")
    inputs["seqused_k"].copy_(torch.tensor([3000, 200, 9000], dtype=torch.int32))
    plan = _plan(msa_pkg, inputs, seqlen_q, heads, topk)
    args = {k: v for k, v in inputs.items() if k != "seqused_k"}
    out = torch.empty(heads, 3 * seqlen_q, topk, dtype=torch.int32, device="cuda")
    msa_pkg.decode_indexer_topk(plan=plan, out=out, **args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.update()
        msa_pkg.decode_indexer_topk(plan=plan, out=out, **args)

    inputs["seqused_k"].copy_(torch.tensor([9100, 1, 700], dtype=torch.int32))
    table = inputs["page_table"]
    valid = table >= 0
    table[valid] = table[valid][torch.randperm(int(valid.sum()), device="cuda")]
    inputs["k_idx"].copy_(torch.randn(inputs["k_idx"].shape, device="cuda").to(torch.float8_e4m3fn))
    inputs["q_idx"].copy_(torch.randn(inputs["q_idx"].shape, device="cuda").to(torch.float8_e4m3fn))
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.cpu().clone()
    keys = inputs["k_idx"].double().cpu()[:, 0]
    eager, scores = _run(msa_pkg, inputs, plan)
    assert torch.equal(replayed, eager)
    _check(inputs, keys, seqlen_q, topk, eager, scores)
    # A stale split (lengths grown again, no update): still every block, still the contract.
    inputs["seqused_k"].copy_(torch.tensor([9500, 900, 9400], dtype=torch.int32))
    stale, stale_scores = _run(msa_pkg, inputs, plan)
    _check(inputs, keys, seqlen_q, topk, stale, stale_scores)


def test_native_indexer_survives_garbage(msa_pkg, native_only, seed, tier):
    """Out-of-range page ids and lengths past the table never fault; every id emitted is a
    block of its request (< the table width) or -1."""
    inputs, _ = make_index_batch([1000, 5000], 4, 2, "bf16", device="cuda")
    inputs["page_table"][0, 1] = 1 << 30
    inputs["page_table"][1, 3] = -5
    inputs["seqused_k"][0] = 1 << 30
    plan = _plan(msa_pkg, inputs, 4, 2, 16)
    out, _ = _run(msa_pkg, inputs, plan)
    width = inputs["page_table"].shape[1]
    assert ((out >= -1) & (out < width)).all()


@pytest.mark.parametrize("fmt", ["bf16", "e4m3"])
def test_native_step_wrapper(msa_pkg, native_only, seed, fmt, monkeypatch, tier):
    """MSADecodeStepWrapper on the native indexer and attention: its selection is the
    oracle's (up to near-ties, checked via the kernel's own scores) and O is sparse decode
    attention over that selection."""
    from test_decode import check_against_oracle, oracle as attention_oracle
    monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
    lens, seqlen_q, hkv, group, topk = [9000, 129, 3000], 8, 4, 16, 16
    inputs, keys = make_index_batch(lens, seqlen_q, hkv, fmt, device="cuda")
    q, k, v = make_attention_inputs(inputs, seqlen_q, hkv, group)
    step = msa_pkg.MSADecodeStepWrapper().plan(
        page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=seqlen_q,
        max_seqlen_k=9000, num_qo_heads=hkv * group, num_kv_heads=hkv, topk=topk)
    out, lse = step.update().run(q, k, v, inputs["q_idx"], inputs["k_idx"],
                                 return_softmax_lse=True)
    torch.cuda.synchronize()
    assert msa_pkg._backend.last_backend("sparse_decode_atten") == tier
    plan = _plan(msa_pkg, inputs, seqlen_q, hkv, topk)
    sel, scores = _run(msa_pkg, inputs, plan)
    assert torch.equal(step.q2k_indices.cpu(), sel)
    _check(inputs, keys, seqlen_q, topk, sel, scores)
    ref_out, ref_lse = attention_oracle(q, k, v, inputs["page_table"], inputs["seqused_k"],
                                        seqlen_q, sel)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=fmt == "e4m3")


@pytest.mark.parametrize("fmt", ["bf16", "e4m3"])
def test_native_step_layers_in_a_graph(msa_pkg, native_only, seed, fmt):
    """Two layers sharing the step's plan, captured in one CUDA graph after its update, replay to
    what the eager layers write after new lengths and queries, with the plan's work list, the
    selection and O poisoned before each step (a replay that left any of them stale would show
    the poison: no work, block 7, NaN); O is sparse attention over the selection."""
    from test_decode import check_against_oracle, oracle as attention_oracle
    lens, seqlen_q, hkv, group, topk = [9000, 129, 3000, 4100], 8, 4, 16, 16
    inputs, _ = make_index_batch(lens, seqlen_q, hkv, fmt, device="cuda")
    q, k, v = make_attention_inputs(inputs, seqlen_q, hkv, group)
    step = msa_pkg.MSADecodeStepWrapper().plan(
        page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=seqlen_q,
        max_seqlen_k=9000, num_qo_heads=hkv * group, num_kv_heads=hkv, topk=topk,
        fixed_split_size=8)

    def poisoned():
        return (torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda"),
                torch.full(q.shape[:2], float("nan"), device="cuda"))

    def poison_chain():
        step.indexer_plan.work.fill_(-1)
        step.q2k_indices.fill_(7)

    def layer(queries, out, lse):
        step.run(queries, k, v, inputs["q_idx"], inputs["k_idx"], out=out, lse=lse,
                 return_softmax_lse=True)

    def same(a, b):
        (out_a, lse_a, sel_a), (out_b, lse_b, sel_b) = a, b
        assert torch.equal(sel_a, sel_b)
        assert_same_attention(out_a, lse_a, out_b, lse_b)

    out, lse = poisoned()
    poison_chain()
    step.update()
    layer(q, out, lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_oracle(q, k, v, inputs["page_table"], inputs["seqused_k"],
                                        seqlen_q, step.q2k_indices)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=fmt == "e4m3")

    queries = [q, make_attention_inputs(inputs, seqlen_q, hkv, group)[0]]
    outputs = [poisoned() for _ in queries]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.update()
        for queries_l, (out_l, lse_l) in zip(queries, outputs):
            layer(queries_l, out_l, lse_l)
    inputs["seqused_k"].copy_(torch.tensor([8000, 1, 2999, 4100], dtype=torch.int32))
    for queries_l in queries:
        queries_l.copy_(torch.randn(queries_l.shape, device="cuda").to(queries_l.dtype))
    for out_l, lse_l in outputs:
        out_l.fill_(float("nan"))
        lse_l.fill_(float("nan"))
    poison_chain()
    graph.replay()
    torch.cuda.synchronize()
    sel_last = step.q2k_indices.clone()
    step.update()
    for queries_l, (out_l, lse_l) in zip(queries, outputs):
        eager_out, eager_lse = poisoned()
        layer(queries_l, eager_out, eager_lse)
        torch.cuda.synchronize()
        same((out_l, lse_l, sel_last), (eager_out, eager_lse, step.q2k_indices.clone()))


@pytest.mark.parametrize("fmt", ["bf16", "e4m3"])
def test_native_step_wrapper_selects_every_block_of_short_requests(msa_pkg, native_only, seed,
                                                                   fmt, monkeypatch, tier):
    """Requests of at most topk blocks (MTP 8, G 16, top-16, up to 2048 keys): the step writes
    every visible block without scoring (on the side stream, joined before run returns) and
    attends densely; O is sparse decode attention over that selection, eager and replayed in a
    CUDA graph after the lengths grew. The selection is also read on the caller's stream right
    after run, before any synchronization."""
    from test_decode import check_against_oracle, oracle as attention_oracle
    monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
    grown, seqlen_q, hkv, group, topk = [2048, 700, 130, 1500], 8, 4, 16, 16
    inputs, _ = make_index_batch(grown, seqlen_q, hkv, fmt, device="cuda")
    inputs["seqused_k"].copy_(torch.tensor([2000, 129, 5, 1000], dtype=torch.int32))
    q, k, v = make_attention_inputs(inputs, seqlen_q, hkv, group)
    step = msa_pkg.MSADecodeStepWrapper().plan(
        page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=seqlen_q,
        max_seqlen_k=topk * P, num_qo_heads=hkv * group, num_kv_heads=hkv, topk=topk)
    assert step.selects_every_block

    def check(out, lse, sel_after_run):
        sel = step.q2k_indices.cpu()
        assert torch.equal(sel_after_run.cpu(), sel)
        for b, n in enumerate(inputs["seqused_k"].tolist()):
            for i in range(seqlen_q):
                own = (n - seqlen_q + i) // P if n - seqlen_q + i >= 0 else -1
                want = [j if j <= own else -1 for j in range(topk)]
                assert (sel[:, b * seqlen_q + i] == torch.tensor(want, dtype=torch.int32)).all()
        ref_out, ref_lse = attention_oracle(q, k, v, inputs["page_table"], inputs["seqused_k"],
                                            seqlen_q, sel.cuda())
        check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=fmt == "e4m3")

    out = torch.full_like(q, float("nan"), dtype=torch.bfloat16)
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    step.q2k_indices.fill_(7)
    step.update().run(q, k, v, inputs["q_idx"], inputs["k_idx"], out=out, lse=lse,
                      return_softmax_lse=True)
    sel_after_run = step.q2k_indices.clone()
    torch.cuda.synchronize()
    assert msa_pkg._backend.last_backend("sparse_decode_atten") == tier
    check(out, lse, sel_after_run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(q, k, v, inputs["q_idx"], inputs["k_idx"], out=out, lse=lse,
                 return_softmax_lse=True)
        sel_in_graph = step.q2k_indices.clone()
    inputs["seqused_k"].copy_(torch.tensor(grown, dtype=torch.int32))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    step.q2k_indices.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    check(out, lse, sel_in_graph)
