"""sparse_topk_select (contract §2.3, §5.3 smoke cases, fork extensions) against an independent
brute-force selection built from a stable float64 sort."""

import pytest
import torch

import msa
from msa import _backend
from msa.reference import topk as topk_reference

NEG_INF = float("-inf")
WORST_FINITE = -1e10


# ----------------------------------------------------------------------------------------------
# Independent oracle
# ----------------------------------------------------------------------------------------------

def brute_select(max_score, topk, nvp=None, fb=0, fe=0, causal_end_block=None,
                 head_reduce=None, num_out_heads=None):
    """Stable descending sort per row (ties keep the lower id first) in float64; the first
    topk - |forced| fillable ids join the forced ids; ascending, -1 tail."""
    scores = max_score
    if head_reduce is not None:
        h, k, t = scores.shape
        grouped = scores.view(num_out_heads, h // num_out_heads, k, t)
        if head_reduce == "max":
            scores = grouped.amax(1)
        else:  # the documented fp32 sum, ascending head order
            scores = grouped[:, 0].clone()
            for g in range(1, grouped.shape[1]):
                scores = scores + grouped[:, g]
    h, k, t = scores.shape
    rows = scores.permute(2, 0, 1).double()                              # [T, H, K]
    ids = torch.arange(k)
    if nvp is None:
        end = torch.full((t,), k)
    elif isinstance(nvp, torch.Tensor):
        end = nvp.long()
    else:
        end = torch.full((t,), nvp)
    if causal_end_block is not None:
        end = torch.minimum(end, causal_end_block.long() + 1)
    end = end.clamp(0, k).view(t, 1, 1)
    eligible = (ids < end).expand(rows.shape)
    forced = eligible & ((ids < fb) | (ids >= end - fe))
    fillable = eligible & ~forced & (rows > NEG_INF) & ~torch.isnan(rows)
    key = torch.where(fillable, rows, torch.full_like(rows, NEG_INF))
    sorted_key, order = torch.sort(key, dim=-1, descending=True, stable=True)
    budget = topk - forced.sum(-1, keepdim=True)
    pos = torch.arange(k)
    take = (pos < budget) & (sorted_key > NEG_INF)
    chosen = torch.zeros(rows.shape, dtype=torch.bool)
    chosen.scatter_(-1, order, take)
    chosen |= forced
    out = torch.full((t, h, topk), -1, dtype=torch.int32)
    for ti in range(t):
        for hi in range(h):
            sel = torch.nonzero(chosen[ti, hi]).flatten()
            assert sel.numel() <= topk
            out[ti, hi, :sel.numel()] = sel.to(torch.int32)
    return out


def smoke_scores(h, k, t, nvp):
    """The upstream smoke-test input: random scores, -inf beyond nvp."""
    s = torch.randn(h, k, t)
    s[:, nvp:, :] = NEG_INF
    return s.contiguous()


def assert_well_formed(sel, nvp_limit=None):
    """Ascending, no duplicates, -1 only at the tail, ids below the limit."""
    valid = sel >= 0
    n_valid = valid.sum(-1, keepdim=True)
    slot = torch.arange(sel.shape[-1])
    assert torch.equal(valid, slot < n_valid), "-1 inside the valid prefix"
    big = torch.where(valid, sel.long(), 1 << 40)
    assert bool((big[..., 1:] > big[..., :-1]).logical_or(~valid[..., 1:]).all()), \
        "valid ids not strictly ascending"
    if nvp_limit is not None:
        assert bool((sel < nvp_limit).all())


# ----------------------------------------------------------------------------------------------
# Upstream smoke cases (contract §5.3)
# ----------------------------------------------------------------------------------------------

def test_force_zero_is_identical_to_defaults(seed):
    s = smoke_scores(4, 256, 64, 200)
    a = msa.sparse_topk_select(s, 16, 200)
    b = msa.sparse_topk_select(s, 16, 200, None, 0, 0)
    assert torch.equal(a, b)
    assert torch.equal(a, brute_select(s, 16, 200))
    assert _backend.last_backend("sparse_topk_select") == "reference"


@pytest.mark.parametrize("fb,fe", [(3, 2), (1, 0), (0, 5), (8, 8)])
def test_forced_membership(seed, fb, fe):
    k, nvp, t = 256, 200, 48
    s = smoke_scores(4, k, t, nvp)
    forced = list(range(fb)) + list(range(nvp - fe, nvp))
    s[:, forced, :] = WORST_FINITE          # the worst finite scores: only forcing selects them
    sel = msa.sparse_topk_select(s, 16, nvp, None, fb, fe)
    assert sel.shape == (t, 4, 16) and sel.dtype == torch.int32
    for f in forced:
        assert bool((sel == f).any(-1).all()), f"forced block {f} missing"
    assert_well_formed(sel, nvp)
    assert bool((sel >= 0).all())            # 200 finite candidates fill all 16 slots
    assert torch.equal(sel, brute_select(s, 16, nvp, fb, fe))


def test_ascending_order_k512(seed):
    s = smoke_scores(4, 512, 40, 400)
    sel = msa.sparse_topk_select(s, 16, 400, None, 1, 1)
    assert_well_formed(sel, 400)
    assert bool((sel[..., 1:] > sel[..., :-1]).all())
    assert torch.equal(sel, brute_select(s, 16, 400, 1, 1))


def test_t32_k256(seed):
    s = smoke_scores(4, 256, 32, 256)
    sel = msa.sparse_topk_select(s, 16)
    assert torch.equal(sel, brute_select(s, 16))


def test_k4096_nvp4000(seed):
    s = smoke_scores(4, 4096, 24, 4000)
    sel = msa.sparse_topk_select(s, 16, 4000, None, 1, 1)
    assert_well_formed(sel, 4000)
    assert torch.equal(sel, brute_select(s, 16, 4000, 1, 1))


# ----------------------------------------------------------------------------------------------
# Semantics the contract leaves to us: ties, -inf, -1 tail
# ----------------------------------------------------------------------------------------------

def test_ties_go_to_the_lower_id(seed):
    # Few distinct values: nearly every row has ties straddling the cut.
    s = torch.randint(0, 4, (3, 300, 40)).float()
    sel = msa.sparse_topk_select(s, 16, 280, None, 2, 1)
    assert torch.equal(sel, brute_select(s, 16, 280, 2, 1))
    # All equal: the 16 lowest ids win.
    flat = torch.full((2, 100, 5), 0.5)
    assert torch.equal(msa.sparse_topk_select(flat, 16)[0, 0], torch.arange(16, dtype=torch.int32))
    # -0.0 ties +0.0
    z = torch.zeros(1, 40, 1)
    z[0, ::2, 0] = -0.0
    assert torch.equal(msa.sparse_topk_select(z, 4)[0, 0], torch.arange(4, dtype=torch.int32))


def test_ties_at_the_candidate_list_edge(seed):
    # Ties that extend past the short candidate list force the exact full-row path.
    s = torch.randn(2, 600, 30)
    s[:, 100:400, :] = 7.0            # 300 tied maxima, the cut lands inside them
    sel = msa.sparse_topk_select(s, 16, None, None, 0, 1)
    assert torch.equal(sel, brute_select(s, 16, None, 0, 1))
    assert bool((sel[..., :15] == torch.arange(100, 115, dtype=torch.int32)).all())


def test_neg_inf_tiles_are_not_emitted_and_tail_is_minus_one(seed):
    k, t = 64, 30
    s = torch.randn(4, k, t)
    keep = torch.rand(4, k, t) < 0.1                    # ~6 finite tiles per row
    keep[0, :, 0] = False                               # a row with nothing finite
    s = torch.where(keep, s, torch.full_like(s, NEG_INF))
    sel = msa.sparse_topk_select(s, 16)
    assert_well_formed(sel)
    assert torch.equal(sel, brute_select(s, 16))
    assert bool((sel[0, 0] == -1).all())
    n_finite = keep.permute(2, 0, 1).sum(-1).clamp_max(16)
    assert torch.equal((sel >= 0).sum(-1), n_finite)
    # Forced tiles are emitted even at -inf.
    forced_sel = msa.sparse_topk_select(s, 16, None, None, 1, 0)
    assert bool((forced_sel[..., 0] == 0).all())


def test_nan_scores_are_never_filled(seed):
    s = torch.randn(2, 80, 12)
    s[:, ::3, :] = float("nan")
    sel = msa.sparse_topk_select(s, 16)
    assert torch.equal(sel, brute_select(s, 16))
    assert bool(((sel % 3 != 0) | (sel < 0)).all())


def test_small_k_pads_with_minus_one(seed):
    s = torch.randn(2, 5, 7)
    sel = msa.sparse_topk_select(s, 16)
    assert torch.equal(sel[..., :5], torch.arange(5, dtype=torch.int32).expand(7, 2, 5))
    assert bool((sel[..., 5:] == -1).all())


# ----------------------------------------------------------------------------------------------
# Extensions: per-query nvp, causal_end_block, head_reduce, topk range, output buffer
# ----------------------------------------------------------------------------------------------

def test_per_query_num_valid_pages(seed):
    k, t = 96, 50
    s = torch.randn(4, k, t)
    nvp = torch.randint(0, k + 1, (t,), dtype=torch.int32)
    sel = msa.sparse_topk_select(s, 8, nvp, None, 1, 2)
    assert torch.equal(sel, brute_select(s, 8, nvp, 1, 2))
    assert bool((sel < nvp.view(-1, 1, 1)).all())
    assert bool((sel[nvp == 0] == -1).all())


def test_causal_end_block(seed):
    k, t = 40, 64
    s = torch.randn(4, k, t)
    nvp = torch.randint(1, k + 1, (t,), dtype=torch.int32)
    ceb = torch.randint(-2, k + 3, (t,), dtype=torch.int32)     # includes < 0 and >= nvp
    for fb, fe in [(0, 1), (1, 1), (0, 3), (2, 4)]:
        sel = msa.sparse_topk_select(s, 8, nvp, None, fb, fe, causal_end_block=ceb)
        assert torch.equal(sel, brute_select(s, 8, nvp, fb, fe, ceb))
        end = torch.minimum(nvp, ceb + 1).clamp(0, k)
        assert bool((sel < end.view(-1, 1, 1)).all())
        # the window {end-fe .. end-1} is present (the own block when ceb < nvp and fe = 1)
        for ti in range(t):
            e = int(end[ti])
            for blk in range(max(e - fe, 0), e):
                assert bool((sel[ti] == blk).any(-1).all())


@pytest.mark.parametrize("mode", ["max", "sum"])
def test_head_reduce(seed, mode):
    h, k, t = 8, 128, 20
    s = torch.randn(h, k, t)
    s[:, 100:, :] = NEG_INF
    sel = msa.sparse_topk_select(s, 16, 100, None, 0, 1, head_reduce=mode, num_out_heads=2)
    assert sel.shape == (t, 2, 16)
    assert torch.equal(sel, brute_select(s, 16, 100, 0, 1, head_reduce=mode, num_out_heads=2))
    if mode == "max":
        # Reducing to 8 heads with max over groups of 1 is the plain selection.
        same = msa.sparse_topk_select(s, 16, 100, None, 0, 1, head_reduce="max", num_out_heads=8)
        assert torch.equal(same, msa.sparse_topk_select(s, 16, 100, None, 0, 1))


@pytest.mark.parametrize("topk", [1, 3, 16, 33, 64])
def test_topk_range(seed, topk):
    s = torch.randn(2, 200, 16)
    fe = 1 if topk > 1 else 0
    sel = msa.sparse_topk_select(s, topk, 180, None, 0, fe)
    assert sel.shape == (16, 2, topk)
    assert torch.equal(sel, brute_select(s, topk, 180, 0, fe))


def test_output_buffer_is_filled_and_returned(seed):
    s = torch.randn(4, 64, 10)
    buf = torch.full((10, 4, 16), 12345, dtype=torch.int32)
    got = msa.sparse_topk_select(s, 16, 60, buf, 1, 1)
    assert got is buf
    assert torch.equal(buf, brute_select(s, 16, 60, 1, 1))


def test_output_in_the_q2k_layout(seed, monkeypatch):
    """output=q2k.permute(1, 0, 2) fills q2k [H, T, topk] with the selection's transpose, in one
    chunk and in several."""
    s = torch.randn(4, 90, 21)
    want = brute_select(s, 16, 80, 1, 1).permute(1, 0, 2)
    for chunk_elements in (None, 4 * 90 * 5):
        if chunk_elements is not None:
            monkeypatch.setattr(topk_reference, "_CHUNK_ELEMENTS", chunk_elements)
        q2k = torch.full((4, 21, 16), 12345, dtype=torch.int32)
        got = msa.sparse_topk_select(s, 16, 80, q2k.permute(1, 0, 2), 1, 1)
        assert got.data_ptr() == q2k.data_ptr()
        assert torch.equal(q2k, want)


def test_chunked_path_matches_single_chunk(seed, monkeypatch):
    s = torch.randn(4, 300, 70)
    s[torch.rand_like(s) < 0.2] = 1.0            # scattered ties
    whole = msa.sparse_topk_select(s, 16, 290, None, 1, 1)
    monkeypatch.setattr(topk_reference, "_CHUNK_ELEMENTS", 4 * 300 * 3)   # 3 tokens per chunk
    assert torch.equal(msa.sparse_topk_select(s, 16, 290, None, 1, 1), whole)
    assert torch.equal(whole, brute_select(s, 16, 290, 1, 1))


def test_empty_token_axis():
    sel = msa.sparse_topk_select(torch.randn(2, 8, 0), 4)
    assert sel.shape == (0, 2, 4)


# ----------------------------------------------------------------------------------------------
# Bad inputs: contract error classes, argument named first
# ----------------------------------------------------------------------------------------------

def _ok_scores():
    return torch.randn(4, 32, 6)


@pytest.mark.parametrize("kwargs,err,name", [
    (dict(max_score=torch.randn(4, 32, 6, dtype=torch.float16)), TypeError, "max_score"),
    (dict(max_score=torch.randn(32, 6)), ValueError, "max_score"),
    (dict(max_score=torch.randn(4, 6, 32).transpose(1, 2)), ValueError, "max_score"),
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=65), ValueError, "topk"),
    (dict(topk=16.0), TypeError, "topk"),
    (dict(num_valid_pages=0), ValueError, "num_valid_pages"),
    (dict(num_valid_pages=33), ValueError, "num_valid_pages"),
    (dict(num_valid_pages=torch.ones(5, dtype=torch.int32)), ValueError, "num_valid_pages"),
    (dict(num_valid_pages=torch.ones(6, dtype=torch.int64)), TypeError, "num_valid_pages"),
    (dict(force_begin_blocks=9, force_end_blocks=8), ValueError, "force_begin_blocks"),
    (dict(force_end_blocks=-1), ValueError, "force_end_blocks"),
    (dict(causal_end_block=torch.zeros(7, dtype=torch.int32)), ValueError, "causal_end_block"),
    (dict(head_reduce="mean", num_out_heads=2), ValueError, "head_reduce"),
    (dict(head_reduce="max"), ValueError, "num_out_heads"),
    (dict(head_reduce="sum", num_out_heads=3), ValueError, "num_out_heads"),
    (dict(num_out_heads=2), ValueError, "num_out_heads"),
    (dict(output=torch.empty(6, 4, 8, dtype=torch.int32)), ValueError, "output"),
    (dict(output=torch.empty(6, 4, 16, dtype=torch.int64)), TypeError, "output"),
    (dict(output=torch.empty(16, 6, 4, dtype=torch.int32).permute(1, 2, 0)), ValueError,
     "output"),
])
def test_bad_inputs(kwargs, err, name):
    args = dict(max_score=_ok_scores(), topk=16)
    args.update(kwargs)
    with pytest.raises(err, match=f"^{name}"):
        msa.sparse_topk_select(**args)
