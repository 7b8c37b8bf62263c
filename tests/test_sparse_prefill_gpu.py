"""Native SM90 sparse prefill (CuTe-DSL kernel + combine) against a float64 reference.

Tolerance (contract §5.1): with O64 the float64 reference (exact per-block partials), the
native O must satisfy
    max|O_native - O64| <= 2 * max|O_torchbf16 - O64| + 2e-3
where O_torchbf16 is the PyTorch reference computed the way a bf16 attention kernel does it:
fp32 math, unnormalized probabilities rounded to bf16 before P.V (pv_quant_dtype=bf16),
partials rounded to partial_dtype, output rounded to bf16; 2e-3 is the rounding term (two bf16
half-ulps at |O| < 0.5). LSE / LSE_T: equal -inf pattern, |diff| <= 1e-3 + 1e-3 |LSE64|.
e4m3 partials (contract: 0.5 with fp8 partials): max|O_native - O64| <= 0.5, and the bound above
for all but 1e-4 of the elements: a partial within float32 rounding of an e4m3 midpoint rounds
one e4m3 ulp (2^-4 relative) apart in kernel and model, the P flips of the FP8 test below.
Every buffer the kernels write is poisoned with NaN first (the kernel allocates; the
msa._native.debug poisoned_outputs hook fills them). Each case runs on the form the serving table
(cute_kernels.variants.SPARSE_FORMS) picks for it, and checks that this form ran.

FP8 (test_sparse_prefill_fp8_native_matches_reference, on the Hopper kernels and on the portable
tier, whose P enters P.V as f16 in mode e4m3_pv_bf16: within the bf16 model bound): the three
compiled FP8 modes (bf16 q + e4m3 k/v; e4m3 q/k/v with pv_dtype bf16; e4m3 q/k/v with pv_dtype
e4m3), every G, dense and paged, bf16 partials; fp16 and e4m3 partials on G = 2 and 16 (with e4m3 partials the contract
bound is 0.5 and the model bound holds for all but 1e-4 of the elements); the all-e4m3 mode
on G 8 / 16 with every partial dtype (the warp-specialized forms). Tolerance (contract §5.1,
fp8):
max|O - O_ref| <= max(0.125, 4 * bf16_floor), O_ref the reference backend (MSA_BACKEND=reference)
on the same fp8 inputs, bf16_floor = max|bf16(O64) - O64| for the float64 model O64 (same P
rounding); LSE / LSE_T within 2e-3 (abs + rel) of the reference backend's. Because 0.125 is
loose (a mis-laid-out V tile can stay under it), the test also checks the modeled error, as the
bf16 test does: max|O - O64| <= 2 * max|O_model - O64| + 4e-3, O_model the fp32 reference with P
rounded to the kernel's P.V dtype (bf16, or e4m3), bf16 partials, bf16 output. In mode e4m3 the
model bound must hold for all but 1e-4 of the elements: P values within float32 rounding of an
e4m3 midpoint round one e4m3 ulp apart in kernel and model (diagnosed on the H200: the kernel
equals the quantized model, and cuBLAS's FP8 product, except for such isolated rows).

The schedule test at the bottom runs on CPU: the device-side schedule builder must equal the
reference builder exactly.

Benchmark mode (GPU): python tests/test_sparse_prefill_gpu.py --bench
"""

import math
import os
import sys
import time

import pytest
import torch

if __name__ == "__main__":   # benchmark mode: import the package from the source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "torch-ext"))
import msa
from msa import _backend
from msa.interface import check_sparse_atten_args
from msa.reference.sparse_attention import make_kv_source, sparse_attention_csr
from msa.schedules.sparse import build_schedule_on_device, split_items_by_query_window
from msa_testing import compiled_variant_with, nan_tensor, use_tier

BLOCK = 128
HKV = 2


def _native_module():
    from msa._native import sparse_prefill_sm90
    return sparse_prefill_sm90


def _random_lengths(batch, gen, causal):
    """k_len not a multiple of 128; q_len <= k_len (prefill / append; causal: the first
    request is decode-like, 1-2 new tokens, half of the time)."""
    k_lens, q_lens = [], []
    for _ in range(batch):
        k = int(torch.randint(700, 4200, (1,), generator=gen))
        if k % BLOCK == 0:
            k += 37
        q = int(torch.randint(1, k + 1, (1,), generator=gen)) if causal else \
            int(torch.randint(1, 1500, (1,), generator=gen))
        if causal and len(q_lens) == 0 and int(torch.randint(0, 2, (1,), generator=gen)):
            q = int(torch.randint(1, 3, (1,), generator=gen))   # decode-like: 1-2 new tokens
        k_lens.append(k)
        q_lens.append(q)
    return q_lens, k_lens


def _random_q2k(q_lens, k_lens, topk, causal, gen, unselected_block=1):
    """[HKV, total_q, topK]: per (query, head) up to topK distinct visible blocks, sorted, -1
    padded (sometimes a -1 in the middle); block `unselected_block` is never selected."""
    rows = []
    for ql, kl in zip(q_lens, k_lens):
        n_blocks = -(-kl // BLOCK)
        for i in range(ql):
            last = (i + kl - ql) // BLOCK if causal else n_blocks - 1
            for _h in range(HKV):
                cand = torch.randperm(last + 1, generator=gen)
                cand = cand[cand != unselected_block][:topk]
                sel = torch.full((topk,), -1, dtype=torch.int32)
                sel[: cand.numel()] = torch.sort(cand).values.to(torch.int32)
                if cand.numel() >= 3 and int(torch.randint(0, 4, (1,), generator=gen)) == 0:
                    sel = torch.cat([sel[:1], torch.tensor([-1], dtype=torch.int32),
                                     sel[1:-1]])           # a -1 inside the row
                rows.append(sel)
    q2k = torch.stack(rows).view(-1, HKV, topk).permute(1, 0, 2).contiguous()
    return q2k


def _make_problem(g, topk, paged, causal, gen, device):
    q_lens, k_lens = _random_lengths(3, gen, causal)
    hq = g * HKV
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0)), dtype=torch.int32)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, hq, 128, generator=gen).to(torch.bfloat16)
    k = torch.randn(total_k, HKV, 128, generator=gen).to(torch.bfloat16)
    v = torch.randn(total_k, HKV, 128, generator=gen).to(torch.bfloat16)
    q2k = _random_q2k(q_lens, k_lens, topk, causal, gen)
    extra = dict(page_table=None, seqused_k=None)
    if paged:
        n_pages = [-(-kl // BLOCK) for kl in k_lens]
        width = max(n_pages) + 1
        perm = torch.randperm(sum(n_pages) + 3, generator=gen)    # shuffled, spare pages
        pages_k = torch.randn(perm.numel(), HKV, BLOCK, 128, generator=gen).to(torch.bfloat16)
        pages_v = torch.randn(perm.numel(), HKV, BLOCK, 128, generator=gen).to(torch.bfloat16)
        table = torch.full((3, width), -1, dtype=torch.int32)
        used = 0
        for b, (kl, npg) in enumerate(zip(k_lens, n_pages)):
            for beta in range(npg):
                page = int(perm[used]); used += 1
                table[b, beta] = page
                n = min(BLOCK, kl - beta * BLOCK)
                t0 = int(cu_k[b]) + beta * BLOCK
                pages_k[page, :, :n] = k[t0:t0 + n].transpose(0, 1)
                pages_v[page, :, :n] = v[t0:t0 + n].transpose(0, 1)
        k, v = pages_k, pages_v
        extra = dict(page_table=table.to(device),
                     seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device))
    to = lambda t: t.to(device)
    return dict(q=to(q), k=to(k), v=to(v), q2k=to(q2k), cu_q=to(cu_q), cu_k=to(cu_k),
                max_q=max(q_lens), max_k=max(k_lens), total_k=total_k, **extra)


def _float64_reference(p, row_ptr, q_idx, causal, scale, temperature):
    kv = make_kv_source(p["k"], p["v"], p["cu_k"], p["page_table"], p["seqused_k"])
    return sparse_attention_csr(p["q"], kv, row_ptr, q_idx, cu_seqlens_q=p["cu_q"],
                                causal=causal, softmax_scale=scale,
                                partial_dtype=torch.float64,
                                lse_temperature_scale=temperature, compute_dtype=torch.float64)


def _check_lse(name, got, want):
    want = want.to(got.device)
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    assert torch.equal(inf_got, inf_want), f"{name}: -inf pattern differs"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    fin = ~inf_want
    diff = (got[fin].double() - want[fin]).abs()
    bound = 1e-3 + 1e-3 * want[fin].abs()
    assert bool((diff <= bound).all()), f"{name}: max diff {diff.max().item():.3e}"


def _case_id(value):
    """Readable test ids: dtypes by name (float16, float8_e4m3fn), the rest as pytest does."""
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else None


CASES = [(g, paged, causal, partial)
         for g in (1, 2, 4, 8, 16) for paged in (False, True) for causal in (False, True)
         for partial in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)]


_PARTIAL_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                  torch.float16: "float16", torch.float8_e4m3fn: "e4m3"}


def _served_attention(mode, g, paged, partial_dtype, total_q):
    """(form, attention artifact) the serving table picks for a call of these properties."""
    from msa.cute_kernels import variants
    partial = _PARTIAL_NAMES[partial_dtype]
    features = _native_module().call_features(total_q)
    form = variants.serving_form(variants.SPARSE_FORMS, mode, group=g, partial=partial,
                                 **features).name
    return form, _native_module().sparse_kernel(mode, g, paged, partial, form).attention


def _check_served_form_ran(native_hooks, mode, g, paged, partial_dtype, q):
    """The call of q [total_q, Hq, 128] ran its served form."""
    form, want = _served_attention(mode, g, paged, partial_dtype, q.shape[0])
    ran = native_hooks.last_variant("sparse_atten")
    assert ran == want, f"expected {want} (form {form}), ran {ran}"


# The Hopper kernels on SM90; the portable tier (csrc warp-MMA kernel + combine) on any GPU,
# forced on SM90 (MSA_NATIVE_TIER=portable), where it is validated by proxy.
TIER_PARAMS = [pytest.param("hopper", marks=pytest.mark.sm90), "portable"]


@pytest.mark.gpu
@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("case", CASES, ids=lambda v: "-".join(str(_case_id(x) or x) for x in v))
def test_sparse_prefill_native_matches_float64(case, tier, seed, monkeypatch, native_hooks):
    g, paged, causal, partial_dtype = case
    if tier == "portable":
        compiled_variant_with("sparse_prefill_portable")
    family = use_tier(tier, monkeypatch)
    native_hooks.poison()
    case = CASES.index((g, paged, causal, partial_dtype))
    topk = (4, 8, 16, 32)[case % 4]
    temperature = 2.0 if case % 3 else 1.0
    with_schedule = case % 2 == 0
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    p = _make_problem(g, topk, paged, causal, gen, device)
    built = msa.build_k2q_csr(p["q2k"], p["cu_q"], p["cu_k"], BLOCK, total_k=p["total_k"],
                              max_seqlen_k=p["max_k"], max_seqlen_q=p["max_q"],
                              qhead_per_kv=g, return_schedule=with_schedule)
    row_ptr, q_idx = built[0], built[1]
    schedule = built[2] if with_schedule else None
    scale = 0.9 / math.sqrt(128)
    monkeypatch.setenv("MSA_BACKEND", "native")       # raise instead of falling back
    out, lse, lse_t = msa.sparse_atten_func(
        p["q"], p["k"], p["v"], row_ptr, q_idx, topk, cu_seqlens_q=p["cu_q"],
        cu_seqlens_k=p["cu_k"], max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"],
        causal=causal, softmax_scale=scale, lse_temperature_scale=temperature,
        return_temperature_lse=True, partial_dtype=partial_dtype, return_softmax_lse=True,
        page_table=p["page_table"], seqused_k=p["seqused_k"], schedule=schedule)
    torch.cuda.synchronize()
    monkeypatch.delenv("MSA_BACKEND")
    assert _backend.last_backend("sparse_atten") == family
    if tier == "portable":
        assert native_hooks.last_variant("sparse_atten") == "sparse_prefill_portable"
    else:
        _check_served_form_ran(native_hooks, "bfloat16", g, paged, partial_dtype, p["q"])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    if temperature == 1.0:
        assert lse_t is lse

    o64, lse64, lse_t64 = _float64_reference(p, row_ptr, q_idx, causal, scale, temperature)
    kv = make_kv_source(p["k"], p["v"], p["cu_k"], p["page_table"], p["seqused_k"])
    ref_out, _, _ = sparse_attention_csr(p["q"], kv, row_ptr, q_idx, cu_seqlens_q=p["cu_q"],
                                         causal=causal, softmax_scale=scale,
                                         partial_dtype=partial_dtype,
                                         pv_quant_dtype=torch.bfloat16)
    ref_err = (ref_out.to(torch.bfloat16).double() - o64).abs().max().item()
    assert not torch.isnan(out).any(), "O has NaN (unwritten or empty rows)"
    err = (out.double() - o64).abs().max().item()
    print(f"G={g} paged={paged} causal={causal} partial={partial_dtype} topK={topk} "
          f"T={temperature} schedule={with_schedule}: max|O-O64|={err:.3e} "
          f"reference bf16 {ref_err:.3e}")
    bound = 2 * ref_err + 2e-3
    if partial_dtype == torch.float8_e4m3fn:
        beyond = ((out.double() - o64).abs() > bound).double().mean().item()
        print(f"  e4m3 partials: fraction of O beyond the model bound {beyond:.2e}")
        assert err <= 0.5 and beyond <= 1e-4
    else:
        assert err <= bound
    empty = torch.isinf(lse64)
    if empty.any():
        assert (out[empty.to(out.device)] == 0).all(), "empty rows must give O = 0"
    _check_lse("LSE", lse, lse64)
    _check_lse("LSE_T", lse_t, lse_t64)


FP8_MODES = ("bf16_kv_e4m3", "e4m3_pv_bf16", "e4m3")
# bf16 partials everywhere; fp16 and e4m3 partials on two head groups per mode.
FP8_CASES = ([(mode, g, paged, torch.bfloat16) for mode in FP8_MODES for g in (1, 2, 4, 8, 16)
              for paged in (False, True)]
             + [(mode, g, g == 16, partial) for mode in FP8_MODES for g in (2, 16)
                for partial in (torch.float16, torch.float8_e4m3fn)])


def _check_lse_fp8(name, got, want):
    """Equal -inf pattern, no NaN, |diff| <= 2e-3 + 2e-3 |want| (contract §5.1, fp8)."""
    want = want.to(got.device)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{name}: -inf pattern differs"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    fin = ~torch.isinf(want)
    diff = (got[fin].double() - want[fin].double()).abs()
    bound = 2e-3 + 2e-3 * want[fin].double().abs()
    assert bool((diff <= bound).all()), f"{name}: max diff {diff.max().item():.3e}"


# The all-e4m3 mode on the warp-specialized forms: both layouts, every partial dtype, G 8 / 16.
FP8_WS_CASES = [("e4m3", g, paged, partial) for g in (8, 16) for paged in (False, True)
                for partial in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)]
ALL_FP8_CASES = FP8_CASES + [c for c in FP8_WS_CASES if c not in FP8_CASES]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("mode", ["bfloat16", "e4m3"])
@pytest.mark.parametrize("paged,causal", [(False, True), (True, True), (True, False)])
def test_sparse_prefill_persistent_forms_give_the_same_bits(mode, paged, causal, seed,
                                                           monkeypatch, native_hooks):
    """The persistent forms, wsp3w (bf16) and wsp3we (e4m3: O tiles, V transposed by the
    producer warpgroup) (CTAs take work items from a queue, the producer warpgroup loads the
    next item's K/V, three consumers), on 3 CTAs (each then takes many items from the queue)
    and on the SM count's, run the same tiles with the same arithmetic: O, LSE and LSE_T equal
    bit for bit (outputs poisoned first), with and without a schedule, those of ws3w in bf16
    (e4m3 at G 16 with bf16 partials builds no other form: 3 CTAs against the SM count's)."""
    native_hooks.poison()
    gen = torch.Generator().manual_seed(seed)
    p = _make_problem(16, 16, paged, causal, gen, torch.device("cuda"))
    e4m3 = torch.float8_e4m3fn
    pv_dtype = None
    if mode == "e4m3":
        p["q"], p["k"], p["v"] = p["q"].to(e4m3), p["k"].to(e4m3), p["v"].to(e4m3)
        pv_dtype = e4m3
    built = msa.build_k2q_csr(p["q2k"], p["cu_q"], p["cu_k"], BLOCK, total_k=p["total_k"],
                              max_seqlen_k=p["max_k"], max_seqlen_q=p["max_q"],
                              qhead_per_kv=16, return_schedule=True)
    monkeypatch.setenv("MSA_BACKEND", "native")
    runs = {}
    # (form, persistent CTAs: None = the SM count); the last run is the reference.
    forms = (("wsp3w", 3), ("wsp3w", None), ("ws3w", None)) if mode == "bfloat16" else \
        (("wsp3we", 3), ("wsp3we", None))
    for form, ctas in forms:
        for schedule in (built[2], None):
            native_hooks.force(sparse_form=form, persistent_ctas=ctas)
            runs[form, ctas, schedule is None] = msa.sparse_atten_func(
                p["q"], p["k"], p["v"], built[0], built[1], 16, cu_seqlens_q=p["cu_q"],
                cu_seqlens_k=p["cu_k"], max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"],
                causal=causal, softmax_scale=0.9 / math.sqrt(128), lse_temperature_scale=2.0,
                return_temperature_lse=True, partial_dtype=torch.bfloat16,
                return_softmax_lse=True, page_table=p["page_table"],
                seqused_k=p["seqused_k"], schedule=schedule, pv_dtype=pv_dtype)
            torch.cuda.synchronize()
            ran = native_hooks.last_variant("sparse_atten")
            assert ran.endswith("_" + form), (form, ran)
    for form, ctas in forms[:-1]:
        for unscheduled in (False, True):
            for got, want in zip(runs[form, ctas, unscheduled],
                                 runs[forms[-1] + (unscheduled,)]):
                assert not torch.isnan(got).any()
                assert torch.equal(got, want), (form, ctas)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("case", ALL_FP8_CASES,
                         ids=lambda v: "-".join(str(_case_id(x) or x) for x in v))
def test_sparse_prefill_fp8_native_matches_reference(case, tier, seed, monkeypatch,
                                                     native_hooks):
    mode, g, paged, partial_dtype = case
    native_module = _native_module()
    if tier == "portable":
        compiled_variant_with("sparse_prefill_portable")
    family = use_tier(tier, monkeypatch)
    native_hooks.poison()
    case = ALL_FP8_CASES.index((mode, g, paged, partial_dtype))
    topk = (4, 8, 16, 32)[case % 4]
    causal = case % 3 != 1
    temperature = 2.0 if case % 2 else 1.0
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    p = _make_problem(g, topk, paged, causal, gen, device)
    e4m3 = torch.float8_e4m3fn
    p["k"], p["v"] = p["k"].to(e4m3), p["v"].to(e4m3)
    pv_dtype = None
    if mode != "bf16_kv_e4m3":
        p["q"] = p["q"].to(e4m3)
        pv_dtype = torch.bfloat16 if mode == "e4m3_pv_bf16" else e4m3
    assert native_module.attention_mode(p["q"].dtype, p["k"].dtype, p["v"].dtype,
                                        pv_dtype) == mode
    row_ptr, q_idx = msa.build_k2q_csr(p["q2k"], p["cu_q"], p["cu_k"], BLOCK,
                                       total_k=p["total_k"], max_seqlen_k=p["max_k"],
                                       max_seqlen_q=p["max_q"], qhead_per_kv=g)
    scale = 0.9 / math.sqrt(128)

    def call(backend):
        monkeypatch.setenv("MSA_BACKEND", backend)
        result = msa.sparse_atten_func(
            p["q"], p["k"], p["v"], row_ptr, q_idx, topk, cu_seqlens_q=p["cu_q"],
            cu_seqlens_k=p["cu_k"], max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"],
            causal=causal, softmax_scale=scale, lse_temperature_scale=temperature,
            return_temperature_lse=True, partial_dtype=partial_dtype,
            return_softmax_lse=True, page_table=p["page_table"], seqused_k=p["seqused_k"],
            pv_dtype=pv_dtype)
        torch.cuda.synchronize()
        monkeypatch.delenv("MSA_BACKEND")
        return result

    out, lse, lse_t = call("native")                   # raises instead of falling back
    assert _backend.last_backend("sparse_atten") == family
    if tier == "portable":
        assert native_hooks.last_variant("sparse_atten") == "sparse_prefill_portable"
    else:
        _check_served_form_ran(native_hooks, mode, g, paged, partial_dtype, p["q"])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse, ref_lse_t = call("reference")
    assert _backend.last_backend("sparse_atten") != family

    # float64 model of the same computation (P rounded to e4m3 before P.V in mode e4m3) for
    # the bf16 output floor.
    kv = make_kv_source(p["k"], p["v"], p["cu_k"], p["page_table"], p["seqused_k"])
    o64, _, _ = sparse_attention_csr(
        p["q"], kv, row_ptr, q_idx, cu_seqlens_q=p["cu_q"], causal=causal, softmax_scale=scale,
        partial_dtype=torch.float64, pv_quant_dtype=e4m3 if mode == "e4m3" else None,
        compute_dtype=torch.float64)
    bf16_floor = (o64.to(torch.bfloat16).double() - o64).abs().max().item()
    model, _, _ = sparse_attention_csr(
        p["q"], kv, row_ptr, q_idx, cu_seqlens_q=p["cu_q"], causal=causal, softmax_scale=scale,
        partial_dtype=partial_dtype,
        pv_quant_dtype=e4m3 if mode == "e4m3" else torch.bfloat16)
    model_err = (model.to(torch.bfloat16).double() - o64).abs().max().item()
    assert not torch.isnan(out).any(), "O has NaN (unwritten or empty rows)"
    err = (out.double() - ref_out.double()).abs().max().item()
    err64 = (out.double() - o64).abs().max().item()
    e4m3_partials = partial_dtype == e4m3
    bound = 0.5 if e4m3_partials else max(0.125, 4 * bf16_floor)
    print(f"{mode} G={g} paged={paged} causal={causal} topK={topk} T={temperature} "
          f"partial={partial_dtype}: "
          f"max|O-O_ref|={err:.3e} max|O-O64|={err64:.3e} model {model_err:.3e} "
          f"bf16 floor {bf16_floor:.3e} (bound {bound:.3e})")
    assert err <= bound
    model_bound = 2 * model_err + 4e-3
    if mode == "e4m3" or e4m3_partials:
        # P (or a partial) rounded to e4m3: where exp(s - m) lies within float32 rounding of an
        # e4m3 midpoint, the kernel and the float64 model round it to neighbouring e4m3 values,
        # one e4m3 ulp (2^-4 relative) apart, which moves that row's O by up to
        # 2^-4 * p|v| / sum(p) (~1e-2). Such flips are rare (~1e-6 of the P elements); a
        # layout or pipeline bug touches most elements. So: the contract bound above on the
        # max, the model bound on all but 1e-4.
        beyond = ((out.double() - o64).abs() > model_bound).double().mean().item()
        print(f"  e4m3 P: fraction of O beyond the model bound {beyond:.2e}")
        assert beyond <= 1e-4, "beyond the modeled rounding error (more than rare P flips)"
    else:
        assert err64 <= model_bound, "beyond the modeled rounding error"
    empty = torch.isinf(ref_lse.to(out.device))
    if empty.any():
        assert (out[empty] == 0).all(), "empty rows must give O = 0"
    _check_lse_fp8("LSE", lse, ref_lse)
    _check_lse_fp8("LSE_T", lse_t, ref_lse_t)


LARGE_POOL_CASES = [pytest.param(partial, kv, tier, marks=marks)
                    for partial, kv, tier, marks in (
                        (torch.float32, torch.bfloat16, "hopper", pytest.mark.sm90),
                        (torch.bfloat16, torch.bfloat16, "hopper", pytest.mark.sm90),
                        (torch.bfloat16, torch.float8_e4m3fn, "hopper", pytest.mark.sm90),
                        (torch.float32, torch.bfloat16, "portable", ()),
                        (torch.bfloat16, torch.bfloat16, "portable", ()),
                        (torch.bfloat16, torch.float8_e4m3fn, "portable", ()))]


@pytest.mark.gpu
@pytest.mark.parametrize("partial_dtype,kv_dtype,tier", LARGE_POOL_CASES)
def test_sparse_prefill_paged_pool_past_2_31_elements(partial_dtype, kv_dtype, tier, seed,
                                                      monkeypatch, native_hooks):
    """Paged K/V pools of more than 2^31 elements each (2^16 pages of [2, 128, 128] below the
    boundary, NaN; ~4.3 GB apiece in bf16) whose used pages all lie past the 2^31-element
    boundary: every K/V row address of the attention kernels must be 64-bit. Cases: bf16 K/V
    with fp32 partials (warp-MMA kernel) and bf16 partials (wgmma kernel), and e4m3 K/V (mode
    bf16_kv_e4m3: rows loaded through registers and converted). The output must equal the same
    kernels' output on a compact pool of the used pages exactly, and the float64 reference
    within the bound of the bf16 test (e4m3: the modeled-error bound of the FP8 test). The
    portable tier runs the bf16 cases and the e4m3 K/V case (bf16 partials)."""
    if tier == "portable":
        compiled_variant_with("sparse_prefill_portable")
    family = use_tier(tier, monkeypatch)
    native_hooks.poison()
    g, topk, causal = 4, 8, True
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    p = _make_problem(g, topk, True, causal, gen, device)
    p["k"], p["v"] = p["k"].to(kv_dtype), p["v"].to(kv_dtype)
    row_ptr, q_idx = msa.build_k2q_csr(p["q2k"], p["cu_q"], p["cu_k"], BLOCK,
                                       total_k=p["total_k"], max_seqlen_k=p["max_k"],
                                       max_seqlen_q=p["max_q"], qhead_per_kv=g)
    scale = 0.9 / math.sqrt(128)

    def native_call(k, v, page_table):
        monkeypatch.setenv("MSA_BACKEND", "native")       # raise instead of falling back
        result = msa.sparse_atten_func(
            p["q"], k, v, row_ptr, q_idx, topk, cu_seqlens_q=p["cu_q"], cu_seqlens_k=p["cu_k"],
            max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"], causal=causal,
            softmax_scale=scale, partial_dtype=partial_dtype, return_softmax_lse=True,
            page_table=page_table, seqused_k=p["seqused_k"])
        torch.cuda.synchronize()
        monkeypatch.delenv("MSA_BACKEND")
        assert _backend.last_backend("sparse_atten") == family
        return result[0], result[1]

    boundary = 2 ** 31 // (HKV * BLOCK * 128)                # first page at element 2^31
    pools = []
    for used in (p["k"], p["v"]):
        pool = nan_tensor((boundary + used.shape[0],) + tuple(used.shape[1:]), kv_dtype,
                           device)
        pool[boundary:] = used
        assert pool.numel() > 2 ** 31
        pools.append(pool)
    table = p["page_table"]
    out, lse = native_call(pools[0], pools[1], torch.where(table >= 0, table + boundary, table))
    del pools
    torch.cuda.empty_cache()
    out_compact, lse_compact = native_call(p["k"], p["v"], table)
    assert not torch.isnan(out).any(), "O has NaN (a read of a wrong page, or unwritten rows)"
    assert torch.equal(out, out_compact) and torch.equal(lse, lse_compact), \
        "the pool past 2^31 elements changes the result"

    kv = make_kv_source(p["k"], p["v"], p["cu_k"], table, p["seqused_k"])
    o64, lse64, _ = sparse_attention_csr(p["q"], kv, row_ptr, q_idx, cu_seqlens_q=p["cu_q"],
                                         causal=causal, softmax_scale=scale,
                                         partial_dtype=torch.float64,
                                         compute_dtype=torch.float64)
    model, _, _ = sparse_attention_csr(p["q"], kv, row_ptr, q_idx, cu_seqlens_q=p["cu_q"],
                                       causal=causal, softmax_scale=scale,
                                       partial_dtype=partial_dtype,
                                       pv_quant_dtype=torch.bfloat16)
    model_err = (model.to(torch.bfloat16).double() - o64).abs().max().item()
    err = (out.double() - o64).abs().max().item()
    print(f"pool past 2^31: partial={partial_dtype} kv={kv_dtype}: max|O-O64|={err:.3e} "
          f"model {model_err:.3e}")
    if kv_dtype == torch.bfloat16:
        assert err <= 2 * model_err + 2e-3
        _check_lse("LSE", lse, lse64)
    else:
        assert err <= 2 * model_err + 4e-3
        _check_lse_fp8("LSE", lse, lse64)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("mode", ["bf16", "e4m3"])
@pytest.mark.parametrize("paged", [False, True])
def test_query_window_items_give_the_same_bits(mode, paged, seed, native_hooks):
    """The served schedule's items cut at query windows and reordered (split_items_by_query_
    window) give the same O and LSE bit for bit: items are independent and slots unchanged."""
    gen = torch.Generator().manual_seed(seed)
    p = _make_problem(16, 16, paged, True, gen, torch.device("cuda"))
    if mode == "e4m3":
        p.update({name: p[name].to(torch.float8_e4m3fn) for name in ("q", "k", "v")})
    row_ptr, q_idx, served = msa.build_k2q_csr(
        p["q2k"], p["cu_q"], p["cu_k"], BLOCK, total_k=p["total_k"], max_seqlen_k=p["max_k"],
        max_seqlen_q=p["max_q"], qhead_per_kv=16, return_schedule=True)

    native_hooks.poison()

    def attend(schedule):
        return msa.sparse_atten_func(
            p["q"], p["k"], p["v"], row_ptr, q_idx, 16, cu_seqlens_q=p["cu_q"],
            cu_seqlens_k=p["cu_k"], max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"],
            causal=True, return_softmax_lse=True, page_table=p["page_table"],
            seqused_k=p["seqused_k"], schedule=schedule)

    want_o, want_lse = (t.clone() for t in attend(served))
    assert not torch.isnan(want_o).any()
    for window in (64, 1000, int(p["cu_q"][-1])):
        split = split_items_by_query_window(served, q_idx, p["cu_q"], window)
        assert int(split.work_count[0]) >= int(served.work_count[0])
        o, lse = attend(split)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse), f"window {window}"


def test_device_schedule_matches_reference_builder(seed):
    """CPU: build_schedule_on_device == prepare_sparse_fwd_schedule_and_split (exactly)."""
    gen = torch.Generator().manual_seed(seed)
    for g, topk, causal in ((16, 8, True), (1, 4, False)):
        p = _make_problem(g, topk, False, causal, gen, torch.device("cpu"))
        row_ptr, q_idx, ref = msa.build_k2q_csr(
            p["q2k"], p["cu_q"], p["cu_k"], BLOCK, total_k=p["total_k"],
            max_seqlen_k=p["max_k"], max_seqlen_q=p["max_q"], qhead_per_kv=g,
            return_schedule=True)
        call = check_sparse_atten_args(
            p["q"], p["k"], p["v"], row_ptr, q_idx, topk, cu_seqlens_q=p["cu_q"],
            cu_seqlens_k=p["cu_k"], max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"],
            blk_kv=BLOCK, causal=causal, softmax_scale=None, lse_temperature_scale=1.0,
            return_temperature_lse=False, partial_dtype=torch.float32,
            return_softmax_lse=False, page_table=None, seqused_k=None, schedule=None,
            usable_SM_count=-1, qk_dtype=None, pv_dtype=None, kv_dtypes=(torch.bfloat16,),
            kv_last_dim=128)
        mine = build_schedule_on_device(call)
        n = int(ref.work_count[0])
        assert int(mine.work_count[0]) == n
        assert mine.target_q_per_cta == ref.target_q_per_cta
        assert torch.equal(mine.scheduler_metadata[:n], ref.scheduler_metadata[:n])
        assert torch.equal(mine.split_counts, ref.split_counts)
        used = int(row_ptr[:, -1].max())
        for h in range(HKV):
            end = int(row_ptr[h, -1])
            assert torch.equal(mine.qsplit_indices[h, :end], ref.qsplit_indices[h, :end])
        assert used > 0


def test_launch_limits_refuse_int32_counts(seed):
    """CPU: run() refuses, before any launch and naming the argument, what the kernels count in
    int32: total_q * Hq combine rows, and max_pages * 128 as the key length of a paged call
    without seqused_k. K/V pools of 2^31 elements or more are served (64-bit row offsets)."""
    import dataclasses
    gen = torch.Generator().manual_seed(seed)
    p = _make_problem(2, 4, True, True, gen, torch.device("cpu"))
    row_ptr, q_idx = msa.build_k2q_csr(p["q2k"], p["cu_q"], p["cu_k"], BLOCK,
                                       total_k=p["total_k"], max_seqlen_k=p["max_k"],
                                       max_seqlen_q=p["max_q"], qhead_per_kv=2)
    call = check_sparse_atten_args(
        p["q"], p["k"], p["v"], row_ptr, q_idx, 4, cu_seqlens_q=p["cu_q"],
        cu_seqlens_k=p["cu_k"], max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"], blk_kv=BLOCK,
        causal=True, softmax_scale=None, lse_temperature_scale=1.0,
        return_temperature_lse=False, partial_dtype=torch.float32, return_softmax_lse=False,
        page_table=p["page_table"], seqused_k=p["seqused_k"], schedule=None,
        usable_SM_count=-1, qk_dtype=None, pv_dtype=None, kv_dtypes=(torch.bfloat16,),
        kv_last_dim=128)
    native = _native_module()
    # 2^24 queries x 256 heads without the memory (a broadcast view; run() refuses first).
    huge_q = p["q"][:1, :1].expand(2 ** 24, 256, 128)
    with pytest.raises(NotImplementedError, match=r"^q: total_q \* Hq .* = 4294967296"):
        native.run(dataclasses.replace(call, q=huge_q), kernel=None)
    wide = torch.randint(0, 8, (call.page_table.shape[0], 2 ** 24), dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"^page_table: .* = 2147483648 does not fit"):
        native.run(dataclasses.replace(call, page_table=wide, seqused_k=None), kernel=None)
    # A pool of 2^31 elements or more is no limit, nor is a wide table with seqused_k.
    big_k = p["k"][:1].expand(2 ** 16 + 1, HKV, BLOCK, 128)
    assert big_k.numel() > 2 ** 31
    native.check_launch_limits(dataclasses.replace(call, k=big_k, v=big_k, page_table=wide))


def _bench(seq=32768, hq=64, hkv=4, topk=16, iters=10):
    """Times native sparse prefill (M3 shape, causal, one request) and prints the floors."""
    device = torch.device("cuda")
    g = hq // hkv
    torch.manual_seed(0)
    q = torch.randn(seq, hq, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(seq, hkv, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qb = torch.arange(seq, device=device) // BLOCK
    # Own block + the (topK-1) most recent earlier blocks (ascending; -1 where absent).
    offs = torch.arange(topk, device=device)
    sel = qb.view(-1, 1) - offs.flip(0).view(1, -1)
    sel = torch.where(sel >= 0, sel, torch.full_like(sel, -1)).to(torch.int32)
    q2k = sel.view(1, seq, topk).expand(hkv, -1, -1).contiguous()
    cu = torch.tensor([0, seq], dtype=torch.int32, device=device)
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu, cu, BLOCK, total_k=seq, max_seqlen_k=seq,
                                       max_seqlen_q=seq, qhead_per_kv=g)
    sched = None

    def call(partial):
        return msa.sparse_atten_func(q, k, v, row_ptr, q_idx, topk, cu_seqlens_q=cu,
                                     cu_seqlens_k=cu, max_seqlen_q=seq, max_seqlen_k=seq,
                                     causal=True, partial_dtype=partial, schedule=sched)
    t0 = time.time()
    call(torch.bfloat16)
    torch.cuda.synchronize()
    print(f"N={seq}: first call (schedule built on device, kernel load) {time.time() - t0:.2f} s")
    from msa.interface import check_sparse_atten_args as _check
    full = _check(q, k, v, row_ptr, q_idx, topk, cu_seqlens_q=cu, cu_seqlens_k=cu,
                  max_seqlen_q=seq, max_seqlen_k=seq, blk_kv=BLOCK, causal=True,
                  softmax_scale=None, lse_temperature_scale=1.0, return_temperature_lse=False,
                  partial_dtype=torch.bfloat16, return_softmax_lse=False, page_table=None,
                  seqused_k=None, schedule=None, usable_SM_count=-1, qk_dtype=None,
                  pv_dtype=None, kv_dtypes=(torch.bfloat16,), kv_last_dim=128)
    torch.cuda.synchronize()
    t0 = time.time()
    sched = build_schedule_on_device(full)
    torch.cuda.synchronize()
    print(f"N={seq}: device schedule build {1e3 * (time.time() - t0):.2f} ms")
    pairs = int((q2k[0] >= 0).sum()) * BLOCK - seq * (BLOCK - 1) // 2   # approx visible pairs
    flops = 4 * 128 * hq * pairs
    runtime = _native_module().cute_runtime
    plain_launch = runtime.launch
    kernel_ms = {}

    def timed_launch(name, device, *args):
        """Event-timed launch: per-kernel split of the total (attention vs combine)."""
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        plain_launch(name, device, *args)
        stop.record()
        kernel_ms.setdefault(name.split("_sm90")[0], []).append((start, stop))

    for partial in (torch.bfloat16, torch.float32):
        call(partial); torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(iters):
            call(partial)
        torch.cuda.synchronize()
        ms = (time.time() - t0) / iters * 1e3
        runtime.launch = timed_launch
        kernel_ms.clear()
        for _ in range(iters):
            call(partial)
        torch.cuda.synchronize()
        runtime.launch = plain_launch
        split = ", ".join(f"{k} {sorted(a.elapsed_time(b) for a, b in v)[len(v) // 2]:.2f} ms"
                          for k, v in kernel_ms.items())
        print(f"N={seq} partial={partial}: {ms:.2f} ms, {flops / ms / 1e9:.1f} TFLOP/s "
              f"[{split}] (backend {_backend.last_backend('sparse_atten')})", flush=True)


if __name__ == "__main__" and "--bench" in sys.argv:
    for n in (8192, 32768, 65536, 131072):
        _bench(seq=n)
