"""The sparse prefill combine (the attention's second kernel) against a float64 merge.

For each (query, query head) with n = split_counts[query, head // G] entries and topK slots:
L = logsumexp over the first min(n, topK) slot LSEs, O = sum_s exp(LSE_s - L) O_s (LSE_T
likewise); a row with no slot or only -inf slots gives O = 0 and L = -inf; a NaN slot LSE, or
n > topK (entries the slots could not hold), gives NaN in O and L: never a silently short row.

The partials are crafted rather than produced by an attention call, so every rule is hit in
one launch: LSEs spread from -200 to +60 (an exponent taken against the wrong base overflows),
-inf slots among finite ones, empty rows, all -inf rows, NaN slots, rows past their slots, topK
of 16 (one step of the Hopper combine's loads) and 20 (two). Slots at or past a row's count
hold NaN, so a read of an unwritten slot shows; every output is poisoned with NaN first.
Both tiers: the Hopper CuTe-DSL combine (per partial dtype) and the portable csrc one.
"""

from __future__ import annotations

import pytest
import torch

from msa_testing import compiled_variant_with

HEAD_DIM = 128
PARTIALS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "e4m3": torch.float8_e4m3fn}


def _crafted_partials(total_q, hq, hkv, topk, partial_dtype, gen):
    """(o_partial, lse_partial, lse_t_partial, split_counts) on the CPU, and the row kinds."""
    counts = torch.randint(0, topk + 1, (total_q, hkv), generator=gen, dtype=torch.int32)
    kinds = torch.randint(0, 10, (total_q, hkv), generator=gen)
    counts[kinds == 0] = topk + 3                    # more entries than slots: NaN
    counts[kinds == 1] = 0                           # no slot: O = 0, L = -inf
    counts[kinds == 2] = topk                        # every slot used
    base = torch.empty(total_q, hq, dtype=torch.float64).uniform_(-200.0, 60.0, generator=gen)
    lse = base[None] + 4.0 * torch.randn(topk, total_q, hq, generator=gen, dtype=torch.float64)
    lse[torch.rand(lse.shape, generator=gen) < 0.15] = -float("inf")
    g = hq // hkv
    all_inf = (kinds == 3).repeat_interleave(g, dim=1)          # [total_q, hq]
    lse[:, all_inf] = -float("inf")
    nan_row = (kinds == 4).repeat_interleave(g, dim=1) & (torch.rand(total_q, hq, generator=gen)
                                                          < 0.5)
    lse[0, nan_row] = float("nan")
    lse_t = lse * 0.7 + torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    o = torch.randn(topk, total_q, hq, HEAD_DIM, generator=gen, dtype=torch.float64)
    o = o.to(PARTIALS[partial_dtype])
    # Unwritten slots (at or past the row's count) hold NaN.
    used = torch.arange(topk)[:, None, None] < counts.repeat_interleave(g, dim=1)[None]
    lse = lse.float().masked_fill(~used, float("nan"))
    lse_t = lse_t.float().masked_fill(~used, float("nan"))
    o = o.float().masked_fill(~used[..., None], float("nan")).to(PARTIALS[partial_dtype])
    return o, lse, lse_t, counts


def _float64_merge(o, lse, counts, hq):
    """The contract's O [total_q, hq, 128] and L [total_q, hq] (float64) and the NaN rows."""
    topk, total_q = lse.shape[:2]
    n = counts.repeat_interleave(hq // counts.shape[1], dim=1).long()            # [q, hq]
    used = torch.arange(topk)[:, None, None] < n.clamp(max=topk)[None]
    lse64 = lse.double().masked_fill(~used, -float("inf"))
    nan_rows = (n > topk) | (torch.isnan(lse64).any(0))
    lse64 = lse64.masked_fill(torch.isnan(lse64), -float("inf"))
    merged = torch.logsumexp(lse64, dim=0)                                       # [q, hq]
    weights = torch.exp(lse64 - merged[None])
    weights = weights.masked_fill(torch.isnan(weights), 0.0)                    # -inf rows: 0
    o64 = o.double().masked_fill(~used[..., None], 0.0)
    out = (weights[..., None] * o64).sum(0)
    return out, merged, nan_rows


def _check(name, got_o, got_lse, want_o, want_lse, nan_rows):
    got_o, got_lse = got_o.double().cpu(), got_lse.double().cpu()
    assert torch.isnan(got_o[nan_rows]).all(), f"{name}: a NaN row's O is not NaN"
    assert torch.isnan(got_lse[nan_rows]).all(), f"{name}: a NaN row's LSE is not NaN"
    ok = ~nan_rows
    assert not torch.isnan(got_o[ok]).any(), f"{name}: NaN in O (an unwritten slot read?)"
    assert not torch.isnan(got_lse[ok]).any(), f"{name}: NaN in LSE"
    assert torch.equal(torch.isinf(got_lse[ok]), torch.isinf(want_lse[ok])), \
        f"{name}: -inf pattern differs"
    empty = ok & torch.isinf(want_lse)
    assert (got_o[empty] == 0).all(), f"{name}: an empty row's O is not 0"
    err = (got_o[ok] - want_o[ok]).abs() - (1e-3 + 8e-3 * want_o[ok].abs())
    assert err.max() <= 0, f"{name}: O off by {err.max().item():.3g} past the tolerance"
    finite = ok & ~torch.isinf(want_lse)
    lse_err = (got_lse[finite] - want_lse[finite]).abs() - (1e-3 + 1e-5 * want_lse[finite].abs())
    assert lse_err.max() <= 0, f"{name}: LSE off by {lse_err.max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("tier", [pytest.param("hopper", marks=pytest.mark.sm90), "portable"])
@pytest.mark.parametrize("topk", [16, 20])
@pytest.mark.parametrize("partial_dtype", list(PARTIALS))
def test_combine_matches_float64(partial_dtype, topk, tier, seed):
    compiled_variant_with("sparse_combine_portable")     # skips without a built variant
    from msa._native import cute_runtime
    from msa._native.compiled_ops import ops
    from msa.cute_kernels import variants
    gen = torch.Generator().manual_seed(seed)
    total_q, hq, hkv = 45, 32, 2
    o, lse, lse_t, counts = _crafted_partials(total_q, hq, hkv, topk, partial_dtype, gen)
    device = torch.device("cuda")
    d_o, d_lse, d_lse_t, d_counts = (t.to(device) for t in (o, lse, lse_t, counts))
    out = torch.full((total_q, hq, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device=device)
    out_lse = torch.full((total_q, hq), float("nan"), device=device)
    out_lse_t = torch.full((total_q, hq), float("nan"), device=device)
    if tier == "hopper":
        cute_runtime.launch(variants.CombineVariant(partial_dtype).name, device, d_o, d_lse,
                            d_lse_t, d_counts, out, out_lse, out_lse_t, 1)
    else:
        ops.sparse_combine_portable(d_o, d_lse, d_lse_t, d_counts, out, out_lse, out_lse_t)
    torch.cuda.synchronize()
    want_o, want_lse, nan_rows = _float64_merge(o, lse, counts, hq)
    _check(f"{tier} p{partial_dtype} topK {topk}", out, out_lse, want_o, want_lse, nan_rows)
    _, want_lse_t, nan_rows_t = _float64_merge(o, lse_t, counts, hq)
    got_t = out_lse_t.double().cpu()
    assert torch.isnan(got_t[nan_rows_t]).all(), "LSE_T of a NaN row is not NaN"
    ok = ~nan_rows_t
    assert torch.equal(torch.isinf(got_t[ok]), torch.isinf(want_lse_t[ok])), \
        "LSE_T: -inf pattern differs"
    finite = ok & ~torch.isinf(want_lse_t)
    assert ((got_t[finite] - want_lse_t[finite]).abs()
            <= 1e-3 + 1e-5 * want_lse_t[finite].abs()).all(), "LSE_T off"
