"""GPU tests of the native paged decode kernel (csrc/decode_attention.cu via
msa._native.decode_cuda) against the independent float64 oracle of tests/test_decode.py.

They need a built variant: ``MSA_TEST_PACKAGE_DIR=$PWD/build/<variant> python -m pytest -q
tests/test_decode_gpu.py`` (tools/gpu_session.sh sets it). Every call runs with
MSA_BACKEND=native (no silent fallback).
Outputs, LSE and split workspaces are poisoned with NaN before each run.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from msa_testing import assert_same_attention, compiled_variant_with, native_families, use_tier
from test_decode import DTYPES, FP8, P, check_against_oracle, make_batch, oracle, random_q2k

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

OP_NAME = "sparse_decode_atten"
BF16 = torch.bfloat16
HKV = 2


@pytest.fixture(scope="module")
def msa_pkg():
    return compiled_variant_with("sparse_decode_attention")


@pytest.fixture
def native_only(monkeypatch):
    """Make dispatch pick the native kernel (MSA_BACKEND=native raises instead of falling back
    to the reference)."""
    monkeypatch.setenv("MSA_BACKEND", "native")
    from msa._native import decode_cuda
    assert decode_cuda.supports(seqlen_q=1, qhead_per_kv=1) is None, decode_cuda.supports()


def _batch(lens, seqlen_q, group, dtypes, sparse, topk=8):
    q_dtype, kv_dtype = DTYPES[dtypes]
    q, k, v, table, seqused_k = make_batch(lens, seqlen_q, HKV, group, q_dtype, kv_dtype,
                                           device="cuda")
    q2k = random_q2k(lens, seqlen_q, HKV, topk).cuda() if sparse else None
    return q, k, v, table, seqused_k, q2k


def _poisoned_outputs(q):
    out = torch.full(q.shape, float("nan"), dtype=BF16, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    return out, lse


def _plan(msa, table, seqused_k, seqlen_q, hq, q2k, **kw):
    wrapper = msa.SparseDecodePagedAttentionWrapper()
    wrapper.plan(page_table=table, seqused_k=seqused_k, seqlen_q=seqlen_q,
                 max_seqlen_k=kw.pop("max_seqlen_k", int(seqused_k.max()) + 1),
                 q2k_indices=q2k, num_qo_heads=hq, num_kv_heads=HKV, **kw)
    for workspace in (wrapper.O_partial, wrapper.LSE_partial, wrapper.query_tile_O_partial,
                      wrapper.query_tile_LSE_partial):
        if workspace is not None:
            workspace.fill_(float("nan"))
    return wrapper


def _run_native(msa, wrapper, q, k, v):
    out, lse = _poisoned_outputs(q)
    wrapper.run(q, k, v, return_softmax_lse=True, out=out, lse=lse)
    assert msa._backend.last_backend(OP_NAME) in native_families()
    torch.cuda.synchronize()
    return out, lse


def _capture_run(wrapper, q, k, v):
    """(graph, out, lse): run() once eagerly (warm-up), then captured into poisoned out / lse."""
    out, lse = _poisoned_outputs(q)
    wrapper.run(q, k, v, return_softmax_lse=True, out=out, lse=lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, k, v, return_softmax_lse=True, out=out, lse=lse)
    return graph, out, lse


def _assert_replay_equals_eager(graph, wrapper, q, k, v, out, lse):
    """Replays a captured run() into its NaN-poisoned out / lse and checks them against an
    eager run on the buffers' current contents: O equal, LSE equal where finite, -inf alike."""
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = _poisoned_outputs(q)
    wrapper.run(q, k, v, return_softmax_lse=True, out=eager_out, lse=eager_lse)
    torch.cuda.synchronize()
    assert_same_attention(out, lse, eager_out, eager_lse)


def _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k):
    ref_out, ref_lse = oracle(q, k, v, table, seqused_k, seqlen_q, q2k)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=q.dtype == FP8)


# Ragged lengths: 1, non-multiples of 128, an exact multiple, and a multi-page one.
LENS = [1, 129, 1000, 256, 77]


@pytest.mark.parametrize("keys", ["rows", "split", "direct", "warpgroup", "pingpong",
                                  "pingpong_pv8"])
@pytest.mark.parametrize("split", ["forced", "unsplit"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("seqlen_q", [1, 4, 8])
def test_native_decode_matches_oracle(msa_pkg, native_only, seed, seqlen_q, group, dtypes,
                                      sparse, split, keys, native_hooks):
    """keys="split": the kernel form where the warps split each page's keys (tiles of <= 16
    rows; for larger tiles the kernel keeps the row form, so those cases repeat "rows").
    keys="direct": the split form's direct e4m3 variant (e4m3 q and K/V only, two pages per
    step). keys="warpgroup": the wgmma form (q and K/V of one dtype), forced on every tile;
    keys="pingpong": its producer / two-consumer form (q and K/V of one dtype; e4m3 V widened
    by the producer), forced on every tile; keys="pingpong_pv8": its e4m3 P.V form (e4m3 only;
    V transposed by the producer)."""
    _force_form(native_hooks, keys, dtypes)
    q, k, v, table, seqused_k, q2k = _batch(LENS, seqlen_q, group, dtypes, sparse)
    kw = dict(fixed_split_size=1) if split == "forced" else dict(disable_split_kv=True)
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k, **kw)
    assert wrapper.decode_schedule.split_kv == (split == "forced")
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)
    assert _ran_pv_fp8(msa_pkg) == (keys == "pingpong_pv8")
    if dtypes == "fp8":
        _check_against_quantized_model(out, q, k, v, table, seqused_k, seqlen_q, q2k, msa_pkg)


def _force_form(native_hooks, keys, dtypes):
    """keys: "rows" (one warp per 16 rows), "split" (warps split each page's keys, bf16
    staging), "direct" (split, e4m3 fragments read straight from the raw pages, two pages per
    step; e4m3 q and K/V only), "warpgroup" (wgmma, q and K/V of one dtype; forced, so it
    also runs tiles of <= 16 rows; its two-stage form), "pingpong" (the warpgroup form's
    producer / two-consumer variant, q and K/V of one dtype; forced on any tile; the plan's work
    items) or "persistent" (the ping-pong form's persistent variant, where the plan has it:
    dense calls of tiles of > 64 rows); "pingpong_pv8" / "persistent_pv8": those two with P.V
    on e4m3 wgmma (e4m3 q and K/V only); cases a form does not serve are skipped."""
    pv8 = keys.endswith("_pv8")
    keys = keys.removesuffix("_pv8")
    if (keys == "direct" or pv8) and dtypes != "fp8":
        pytest.skip(f"the {keys} form{' (e4m3 P.V)' if pv8 else ''} serves e4m3 q and K/V only")
    if keys in ("warpgroup", "pingpong", "persistent") and dtypes == "bf16q_fp8kv":
        pytest.skip(f"the {keys} form serves q and K/V of one dtype")
    wgmma = keys in ("warpgroup", "pingpong", "persistent")
    native_hooks.force(decode_split_keys=keys in ("split", "direct"),
                       decode_direct_fp8=keys == "direct", decode_warpgroup=wgmma,
                       decode_pingpong=keys in ("pingpong", "persistent"),
                       decode_persistent=keys == "persistent", decode_pv_fp8=pv8)


def _ran_persistent(msa) -> bool:
    decode_cuda = importlib.import_module(f"{msa.__name__}._native.decode_cuda")
    return decode_cuda.last_launch()["persistent"]


def _ran_pv_fp8(msa) -> bool:
    decode_cuda = importlib.import_module(f"{msa.__name__}._native.decode_cuda")
    return decode_cuda.last_launch()["pv_fp8"]


def _check_against_quantized_model(out, q, k, v, table, seqused_k, seqlen_q, q2k, msa):
    """e4m3 q and K/V: the contract's tolerance (checked by _check) is loose next to what a
    correct kernel does, so also compare with the reference backend, which models the same
    rounding (P rounded to e4m3 against each page's max). Each output row (query, head) should
    match within two bf16 ulps (+1e-4); an fp32 difference can flip one P value at an e4m3
    rounding midpoint, which moves that whole row by one e4m3 ulp of p / sum(p) times a V row,
    so up to 2 % of the rows (at least 2) may only meet the contract. A layout or permutation
    error moves every row. The ping-pong form's S comes from e4m3 wgmma, whose accumulator
    keeps ~13 mantissa bits: S moves by ~1e-4 of its size, which flips P's rounding in a third
    of the rows or more (tools/lab/model_decode_e4m3.py; half of them with one query at G 1);
    each flip moves its row by one e4m3 ulp of that p / sum(p) times a V row, so there the
    whole output must stay within 2 % of the model (relative Frobenius norm), which a layout
    error exceeds many times over."""
    from test_decode import fp32_reference
    ref, _ = fp32_reference(q.cpu(), k.cpu(), v.cpu(), None if q2k is None else q2k.cpu(),
                            table.cpu(), seqused_k.cpu(), seqlen_q)
    ref = ref.double()
    err = (out.double().cpu() - ref).abs()
    decode_cuda = importlib.import_module(f"{msa.__name__}._native.decode_cuda")
    launched = decode_cuda.last_launch()
    if launched["pingpong"] and not launched["token_warps"]:   # S on e4m3 wgmma
        relative = (err.norm() / ref.norm()).item()
        assert relative <= 2e-2, relative
        return
    ulp = torch.finfo(BF16).eps * ref.abs().clamp_min(1e-30)
    loose_rows = (err > 2 * ulp + 1e-4).any(dim=-1)
    allowed = max(2, int(0.02 * loose_rows.numel()))
    assert int(loose_rows.sum()) <= allowed, (int(loose_rows.sum()), allowed, err.max().item())


@pytest.mark.parametrize("keys", ["rows", "split", "direct", "warpgroup"])
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("seqlen_q,group", [(1, 16), (4, 4), (8, 16), (16, 16)])
def test_portable_tier_decode_matches_oracle(msa_pkg, native_only, seed, monkeypatch,
                                             native_hooks, seqlen_q, group, dtypes, keys):
    """The portable tier's decode (forced: MSA_NATIVE_TIER=portable): the split-keys, direct
    e4m3 and row forms, dense and sparse, split and unsplit, one and two qo tiles. The
    warpgroup hook does not reach it: its tiles of > 16 rows take the row form."""
    use_tier("portable", monkeypatch)
    _force_form(native_hooks, keys, dtypes)
    for sparse in (False, True):
        q, k, v, table, seqused_k, q2k = _batch(LENS, seqlen_q, group, dtypes, sparse)
        for kw in (dict(fixed_split_size=1), dict(disable_split_kv=True)):
            wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k, **kw)
            out, lse = _run_native(msa_pkg, wrapper, q, k, v)
            assert msa_pkg._backend.last_backend(OP_NAME) == "portable"
            _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)


@pytest.mark.parametrize("keys", ["rows", "split", "direct"])
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_native_decode_ignores_nan_bytes_past_the_keys(msa_pkg, native_only, seed, sparse,
                                                      dtypes, keys, native_hooks):
    """Every form zero-fills key rows past a request's end when it loads the page, so NaN
    bytes there (an uninitialized cache pool) cannot reach O through 0 x NaN: the direct e4m3
    form, the split-keys and row forms (bf16 staging; the warpgroup forms in
    test_native_decode_warpgroup_mtp)."""
    _force_form(native_hooks, keys, dtypes)
    lens, seqlen_q, group = [1, 129, 1000, 77, 300], 1, 16
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, dtypes, sparse)
    nan_byte = 0x7F if k.dtype == FP8 else 0xFF
    for b, n in enumerate(lens):
        if n % P:
            page = int(table[b, (n - 1) // P])
            k.view(torch.uint8)[page, :, n % P:, :] = nan_byte
            v.view(torch.uint8)[page, :, n % P:, :] = nan_byte
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k)
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)


@pytest.mark.parametrize("form,dtypes", [("warpgroup", "bf16"), ("warpgroup", "fp8"),
                                         ("pingpong", "bf16"), ("pingpong", "fp8"),
                                         ("pingpong_pv8", "fp8"), ("persistent", "bf16"),
                                         ("persistent", "fp8"), ("persistent_pv8", "fp8")])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_native_decode_warpgroup_mtp(msa_pkg, native_only, seed, sparse, form, dtypes,
                                     native_hooks):
    """The warpgroup form at the production shape (8 queries x G = 16: two full warpgroups),
    with 32-row tiles (one warpgroup idle), two qo tiles (16 x 16), one query (16 rows), a
    long request split over many chunks, NaN bytes past each request's keys (zero-filled on
    load), and pages shared by every token."""
    for seqlen_q, group, poison in ((8, 16, False), (8, 4, True), (16, 16, False), (1, 16, False)):
        _force_form(native_hooks, form, dtypes)
        lens = [70001, 129, 3, 4096, 1000]
        q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, dtypes, sparse, topk=16)
        for b, n in enumerate(lens):
            if poison and n % P:
                page = int(table[b, (n - 1) // P])
                k.view(torch.uint8)[page, :, n % P:, :] = 0x7F if dtypes == "fp8" else 0xFF
                v.view(torch.uint8)[page, :, n % P:, :] = 0x7F if dtypes == "fp8" else 0xFF
        # The persistent form serves dense calls of tiles of > 64 rows (planned here wherever
        # it can run: these few requests are too short for it to pay).
        persistent = form.startswith("persistent") and not sparse and seqlen_q * group > 64
        wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k,
                        qo_tile_rows=128,        # one warpgroup tile, not the query tiles
                        persistent=True if persistent else None)
        out, lse = _run_native(msa_pkg, wrapper, q, k, v)
        assert _ran_persistent(msa_pkg) == persistent
        # The ping-pong form serves tiles of > 64 rows (forced: every tile).
        assert _ran_pv_fp8(msa_pkg) == form.endswith("_pv8")
        _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)
        if dtypes == "fp8" and not poison:   # the fp32 model multiplies the NaN rows by P = 0
            _check_against_quantized_model(out, q, k, v, table, seqused_k, seqlen_q, q2k, msa_pkg)


# Batches of the persistent form: many ragged requests with empty ones among them (a share
# boundary inside most sequences), one request cut by every CTA, fewer pages than CTAs, only
# empty requests, 80-row tiles (the second consumer holds 16 rows), two qo tiles a head.
PERSISTENT_BATCHES = [
    ("ragged", lambda g: [int(x) for x in torch.randint(0, 3000, (150,), generator=g)]
     + [0, 0, 1, 128, 129], 8, 16),
    ("one_long", lambda g: [200003, 5, 0, 1000], 8, 16),
    ("few_pages", lambda g: [5], 8, 16),
    ("all_empty", lambda g: [0, 0, 0], 8, 16),
    ("rows_80", lambda g: [3000, 17, 70001], 5, 16),
    ("two_tiles", lambda g: [4097, 0, 12000, 255], 16, 16),
]


@pytest.mark.parametrize("dtypes", ["bf16", "fp8", "fp8_pv8"])
@pytest.mark.parametrize("batch", [b[0] for b in PERSISTENT_BATCHES])
def test_native_persistent_decode(msa_pkg, native_only, seed, dtypes, batch, native_hooks):
    """The persistent form against the oracle: equal page shares of all (request, KV head,
    tile) sequences from the live lengths, pieces written directly or as partials merged
    after; NaN bytes past each request's keys (fp8_pv8: its e4m3 P.V form)."""
    pv8 = dtypes == "fp8_pv8"
    dtypes = "fp8" if pv8 else dtypes
    _force_form(native_hooks, "persistent_pv8" if pv8 else "persistent", dtypes)
    _, make_lens, seqlen_q, group = next(b for b in PERSISTENT_BATCHES if b[0] == batch)
    lens = make_lens(torch.Generator().manual_seed(seed))
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, dtypes, False)
    for b, n in enumerate(lens):
        if n % P:
            page = int(table[b, (n - 1) // P])
            k.view(torch.uint8)[page, :, n % P:, :] = 0x7F if dtypes == "fp8" else 0xFF
            v.view(torch.uint8)[page, :, n % P:, :] = 0x7F if dtypes == "fp8" else 0xFF
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, None, persistent=True)
    assert wrapper.decode_schedule.persistent_ctas > 0
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    assert _ran_persistent(msa_pkg) and _ran_pv_fp8(msa_pkg) == pv8
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, None)


def test_native_persistent_decode_graph_follows_lengths(msa_pkg, native_only, seed,
                                                        native_hooks):
    """A captured run of the persistent form re-cuts its shares from the lengths written
    before each replay (longer, shorter, empty), equal to the eager run and the oracle."""
    _force_form(native_hooks, "persistent", "bf16")
    lens, seqlen_q, group, max_len = [700, 1, 2000, 0, 5000], 8, 16, 40000
    q, k, v, table, seqused_k, _ = _batch(lens, seqlen_q, group, "bf16", False)
    width = -(-max_len // P)
    k = torch.randn(len(lens) * width + 3, HKV, P, 128, device="cuda").to(BF16)
    v = torch.randn_like(k)
    table = torch.randperm(k.shape[0], device="cuda")[: len(lens) * width].view(
        len(lens), width).to(torch.int32).contiguous()
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, None,
                    max_seqlen_k=max_len, enable_cuda_graph=True, persistent=True)
    assert wrapper.decode_schedule.persistent_ctas > 0
    graph, out, lse = _capture_run(wrapper, q, k, v)
    for new_lens in ([39999, 0, 129, 2, 40000], [1, 1, 1, 1, 1], [0, 7000, 0, 0, 0]):
        seqused_k.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(BF16))
        _assert_replay_equals_eager(graph, wrapper, q, k, v, out, lse)
        assert _ran_persistent(msa_pkg)
        _check(out, lse, q, k, v, table, seqused_k, seqlen_q, None)


@pytest.mark.parametrize("qo_tile_rows", [16, 24, 64])
@pytest.mark.parametrize("dtypes", list(DTYPES))
def test_native_sparse_mtp_query_tiles(msa_pkg, native_only, seed, dtypes, qo_tile_rows):
    """Sparse multi-token decode in query tiles smaller than the request's rows: 16 rows (one
    token at G = 16: the split-keys and direct e4m3 forms), 24 (a tile boundary inside a
    token's heads), 64 (four tokens on the warpgroup form's one warpgroup); a long request split
    over chunks, a tiny one, NaN bytes past each request's keys (G = 4); each tile streams the
    union of its own tokens' selections only."""
    for seqlen_q, group, poison in ((8, 16, False), (8, 4, True), (16, 16, False)):
        lens = [70001, 129, 3, 4096, 1000]
        q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, dtypes, True, topk=16)
        for b, n in enumerate(lens):
            if poison and n % P:
                page = int(table[b, (n - 1) // P])
                k.view(torch.uint8)[page, :, n % P:, :] = 0x7F if k.dtype == FP8 else 0xFF
                v.view(torch.uint8)[page, :, n % P:, :] = 0x7F if k.dtype == FP8 else 0xFF
        wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k,
                        qo_tile_rows=qo_tile_rows)
        assert wrapper.decode_schedule.num_qo_tiles == -(-seqlen_q * group // qo_tile_rows)
        out, lse = _run_native(msa_pkg, wrapper, q, k, v)
        _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)
        if dtypes == "fp8" and not poison:
            _check_against_quantized_model(out, q, k, v, table, seqused_k, seqlen_q, q2k, msa_pkg)


# (seqlen_q, G) of the token-warps form: eight warps of one token each, two qo tiles, 80 rows
# (three warps without rows), two tokens a warp (each row's own selection), four tokens a warp.
TOKEN_WARP_SHAPES = [(8, 16), (16, 16), (5, 16), (8, 8), (16, 4)]


TOKEN_WARP_FORMS = ["per_warp"]


def _ran_token_warps(msa, form) -> bool:
    decode_cuda = importlib.import_module(f"{msa.__name__}._native.decode_cuda")
    return decode_cuda.last_launch()["token_warps"] == decode_cuda.TOKEN_WARPS_FORMS[form]


@pytest.mark.parametrize("split", ["auto", "forced"])
@pytest.mark.parametrize("topk", [16, 32])
@pytest.mark.parametrize("seqlen_q,group", TOKEN_WARP_SHAPES)
@pytest.mark.parametrize("form", TOKEN_WARP_FORMS)
def test_native_token_warps_form(msa_pkg, native_only, seed, native_hooks, form, seqlen_q, group,
                                 topk, split):
    """The token-warps form (sparse e4m3 tiles of > 16 rows; forced): each warp computes its 16
    rows against only the union pages its rows' tokens selected, the pages copied once by TMA
    and widened in each warp's registers. Requests of 70001 / 0 / 129 / 3 / 4096 / 1000 keys
    with NaN bytes past each one's keys (the copies bring the pool's rows as they are: their
    scores are masked, their V rows read as zeros), top-16 and top-32 (one tile of 256
    candidates a batch at MTP 8), the plan's chunks and forced page-range chunks of 3 pages
    writing partials. Against the oracle and the quantized model."""
    native_hooks.force(decode_token_warps=form)
    lens = [70001, 0, 129, 3, 4096, 1000]
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, "fp8", True, topk=topk)
    for b, n in enumerate(lens):
        if n % P:
            page = int(table[b, (n - 1) // P])
            k.view(torch.uint8)[page, :, n % P:, :] = 0x7F
            v.view(torch.uint8)[page, :, n % P:, :] = 0x7F
    kw = dict(fixed_split_size=3) if split == "forced" else {}
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k, qo_tile_rows=128,
                    **kw)
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    assert _ran_token_warps(msa_pkg, form)
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)
    # The model multiplies the NaN rows by P = 0: compare it on clean pages.
    for b, n in enumerate(lens):
        if n % P:
            page = int(table[b, (n - 1) // P])
            k.view(torch.uint8)[page, :, n % P:, :] = 0
            v.view(torch.uint8)[page, :, n % P:, :] = 0
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    _check_against_quantized_model(out, q, k, v, table, seqused_k, seqlen_q, q2k, msa_pkg)


@pytest.mark.parametrize("form", TOKEN_WARP_FORMS)
def test_native_token_warps_tile_ranges(msa_pkg, native_only, seed, native_hooks, form):
    """The token-warps form over many tiles: 300 requests of 1-3000 keys x MTP 8 x G 16 x 2 KV
    heads (600 tiles: CTAs of 4-5 tiles, lists made in batches of 4 at top-16, the rings'
    positions carried across tiles and batches), some q2k ids out of range. Eager and captured
    runs match the oracle and each other."""
    native_hooks.force(decode_token_warps=form)
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3001, (300,), generator=gen).tolist()
    lens[:3] = [1, 128, 129]
    q, k, v, table, seqused_k, q2k = _batch(lens, 8, 16, "fp8", True, topk=16)
    wrapper = _plan(msa_pkg, table, seqused_k, 8, HKV * 16, q2k, qo_tile_rows=128)
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    assert _ran_token_warps(msa_pkg, form)
    _check(out, lse, q, k, v, table, seqused_k, 8, q2k)
    _check_against_quantized_model(out, q, k, v, table, seqused_k, 8, q2k, msa_pkg)
    graph, graph_out, graph_lse = _capture_run(wrapper, q, k, v)
    _assert_replay_equals_eager(graph, wrapper, q, k, v, graph_out, graph_lse)


def test_native_sparse_tile_form_follows_union_density(msa_pkg, native_only, seed):
    """The served form of sparse e4m3 128-row tiles that fill the SMs (40 requests x 2 KV heads,
    MTP 8, G 16, top-16; nothing forced): the ping-pong union while the tile's 128 selections
    make at least 3 a block of the planned context (4000 keys: 32 blocks), the token-warps form
    past that (8000 keys: 63 blocks). Both against the oracle."""
    decode_cuda = importlib.import_module(f"{msa_pkg.__name__}._native.decode_cuda")
    token_warps_code = decode_cuda.TOKEN_WARPS_FORMS[decode_cuda.TOKEN_WARPS_FORM]
    gen = torch.Generator().manual_seed(seed)
    for longest, token_warps in ((4000, 0), (8000, token_warps_code)):
        lens = torch.randint(longest // 2, longest + 1, (40,), generator=gen).tolist()
        lens[0] = longest
        q, k, v, table, seqused_k, q2k = _batch(lens, 8, 16, "fp8", True, topk=16)
        wrapper = _plan(msa_pkg, table, seqused_k, 8, HKV * 16, q2k)
        out, lse = _run_native(msa_pkg, wrapper, q, k, v)
        launched = decode_cuda.last_launch()
        # The binding runs the token-warps form wherever it is asked for (the ping-pong flag
        # then only names the fallback where the caches' tensor maps cannot be made).
        assert launched["token_warps"] == token_warps, longest
        assert launched["pingpong"] or token_warps != 0, longest
        _check(out, lse, q, k, v, table, seqused_k, 8, q2k)


@pytest.mark.parametrize("split", ["auto", "forced"])
@pytest.mark.parametrize("group", [16, 4])
def test_native_direct_form_tile_ranges(msa_pkg, native_only, seed, group, split):
    """The direct e4m3 form over many sparse query tiles: a CTA streams a range of tiles (one
    CTA per SM), the next tile's pages in flight while a tile finishes, its tiles' page lists
    made in batches (at most 32 tiles, at most 512 candidates). 300 requests of 1-3000 keys
    (tiles of 0-16 pages, some ids out of range) x MTP 8 x 2 KV heads: 4800 one-token tiles at
    G = 16 (two batches a CTA), 2400 four-token tiles at G = 4 (64 candidates each: batches cut
    by candidates); forced split: chunks of 3 slots or pages, each a tile writing a partial.
    Eager and captured runs match the oracle and each other."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3001, (300,), generator=gen).tolist()
    lens[:3] = [1, 128, 129]
    seqlen_q = 8
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, "fp8", True, topk=16)
    kw = dict(fixed_split_size=3) if split == "forced" else {}
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k, qo_tile_rows=16, **kw)
    assert wrapper.decode_schedule.split_kv == (split == "forced")
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)
    _check_against_quantized_model(out, q, k, v, table, seqused_k, seqlen_q, q2k, msa_pkg)
    graph, graph_out, graph_lse = _capture_run(wrapper, q, k, v)
    _assert_replay_equals_eager(graph, wrapper, q, k, v, graph_out, graph_lse)


@pytest.mark.parametrize("dtypes", list(DTYPES))
def test_native_sparse_mtp_plan_picks_query_tiles_for_e4m3(msa_pkg, native_only, seed, dtypes):
    """The plan's default against a long context: e4m3 q and K/V run the 16-row query-tile
    plan (a CUDA graph of the step replays it), other dtypes the 128-row one; both match the
    oracle."""
    lens, seqlen_q, group = [70001, 9000, 3], 8, 16
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, dtypes, True, topk=16)
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k)
    assert wrapper.query_tile_schedule.qo_tile_rows == 16
    assert wrapper.decode_schedule.qo_tile_rows == 128
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    call = SimpleNamespace(q=q, k=k)
    want = 16 if dtypes == "fp8" else 128
    assert wrapper.plan_for(call)[0].qo_tile_rows == want
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)
    graph_out = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, k, v, out=graph_out)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_out, out, rtol=0, atol=0)


@pytest.mark.parametrize("keys", ["rows", "split", "direct", "pingpong"])
@pytest.mark.parametrize("dtypes", ["bf16", "fp8"])
def test_native_decode_512k_context(msa_pkg, native_only, seed, dtypes, keys, native_hooks):
    """A 512k-token request next to tiny and odd-length ones (G = 16, one query token, the
    M3 decode shape), dense and sparse, pages shuffled, the planner's own split."""
    _force_form(native_hooks, keys, dtypes)
    lens, seqlen_q, group = [524288, 3, 70001], 1, 16
    for sparse in (False, True):
        q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, dtypes, sparse, topk=16)
        wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k)
        out, lse = _run_native(msa_pkg, wrapper, q, k, v)
        _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtypes", ["bf16", "fp8"])
def test_native_decode_two_qo_tiles_and_auto_split(msa_pkg, native_only, seed, dtypes, sparse):
    """seqlen_q * G = 256 rows (two 128-row qo tiles), a long request, the planner's own split,
    and an empty request (seqused_k = 0)."""
    lens, seqlen_q, group = [9000, 3, 0, 640], 16, 16
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, dtypes, sparse, topk=32)
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k)
    assert wrapper.decode_schedule.num_qo_tiles == 2
    out, lse = _run_native(msa_pkg, wrapper, q, k, v)
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)


@pytest.mark.parametrize("dtypes", list(DTYPES))
def test_native_function_path(msa_pkg, native_only, seed, dtypes):
    """sparse_decode_atten_func with its default (cached, max_seqlen_k-sized) schedule."""
    lens, seqlen_q, group = [300, 5000, 1], 2, 8
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, dtypes, sparse=False)
    out, lse = msa_pkg.sparse_decode_atten_func(q, k, v, page_table=table, seqused_k=seqused_k,
                                                seqlen_q=seqlen_q, max_seqlen_k=5000,
                                                return_softmax_lse=True)
    assert msa_pkg._backend.last_backend(OP_NAME) in native_families()
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, None)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_native_cuda_graph_replay_equals_eager(msa_pkg, native_only, seed, sparse):
    """Capture run() once; new lengths, page table, selections and K/V contents written into the
    same buffers before replay give exactly the eager result (and match the oracle)."""
    lens, seqlen_q, group, max_len = [700, 1, 2000], 4, 4, 4096
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, "bf16", sparse)
    # A table wide enough for max_len, pages drawn from a larger pool.
    width = -(-max_len // P)
    pool = k.shape[0]
    k = torch.randn(pool + len(lens) * width, HKV, P, 128, device="cuda").to(BF16)
    v = torch.randn_like(k)
    table = torch.randperm(k.shape[0], device="cuda")[: len(lens) * width].view(
        len(lens), width).to(torch.int32).contiguous()
    wrapper = _plan(msa_pkg, table, seqused_k, seqlen_q, HKV * group, q2k,
                    max_seqlen_k=max_len, enable_cuda_graph=True)
    graph, out, lse = _capture_run(wrapper, q, k, v)

    new_lens = [3000, 129, 1]
    seqused_k.copy_(torch.tensor(new_lens, dtype=torch.int32))
    table.copy_(torch.randperm(k.shape[0], device="cuda")[: table.numel()].view_as(table))
    k.copy_(torch.randn_like(k, dtype=torch.float32).to(BF16))
    v.copy_(torch.randn_like(v, dtype=torch.float32).to(BF16))
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(BF16))
    if sparse:
        q2k.copy_(random_q2k(new_lens, seqlen_q, HKV, q2k.shape[2]).cuda())
    _assert_replay_equals_eager(graph, wrapper, q, k, v, out, lse)
    _check(out, lse, q, k, v, table, seqused_k, seqlen_q, q2k)


@pytest.mark.parametrize("tier", ["hopper", "portable"])
def test_native_decode_survives_garbage_indices(msa_pkg, native_only, seed, monkeypatch, tier):
    """Out-of-range page ids, q2k ids and lengths past the table never fault (they are skipped);
    rows that only see valid pages still match the oracle on the valid part."""
    use_tier(tier, monkeypatch)
    lens, seqlen_q, group = [1000, 500], 2, 4
    q, k, v, table, seqused_k, q2k = _batch(lens, seqlen_q, group, "bf16", sparse=True)
    q2k[0, 0, 0] = 1 << 30
    q2k[1, 1, 1] = -7
    bad_table = table.clone()
    bad_table[0, 1] = 1 << 30
    bad_table[1, 0] = -3
    bad_lens = torch.tensor([1 << 30, 500], dtype=torch.int32, device="cuda")
    for sparse_ids in (None, q2k):
        wrapper = _plan(msa_pkg, bad_table, bad_lens, seqlen_q, HKV * group, sparse_ids,
                        max_seqlen_k=4096, enable_cuda_graph=True)
        out, lse = _run_native(msa_pkg, wrapper, q, k, v)
        assert torch.isfinite(out.float()).all()
        assert not torch.isnan(lse).any()
