"""CPU: the serving tables (msa.cute_kernels.variants) decide which kernel form serves a call,
and every shipped variant is one the dispatch serves. No CUDA and no cutlass needed: the tables
and the native ``supports`` functions are plain Python (artifact lookups answer "available"
here, as with the DSL installed for a JIT compile)."""

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from msa import _backend
from msa._native import (block_max_score_sm90, compiled_ops, csr_builder, debug, decode_cuda,
                         fmha_sm90, serving, sparse_prefill_sm90)
from msa.cute_kernels import variants

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
TORCH_DTYPES = {"bfloat16": BF16, "e4m3": E4M3}
MAX_ITEMS = variants.PERSISTENT_MAX_ITEMS


@pytest.fixture(autouse=True)
def every_artifact_available(monkeypatch):
    """Artifact lookups say yes (the tables are under test, not this machine's files)."""
    monkeypatch.setattr(serving.cute_runtime, "unavailable_reason", lambda *names: None)
    # ... and so do the compiled csrc ops (the FMHA's V transpose, the CSR builder, decode).
    monkeypatch.setattr(compiled_ops, "has", lambda name: True)
    monkeypatch.setattr(compiled_ops, "missing_reason", lambda *names: None)
    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)


def _fmha_kernel(dtype="bfloat16", mode=3, paged=False, causal=True, work_items=8,
                 kv_splits=1):
    verdict = fmha_sm90.supports(q_dtype=TORCH_DTYPES[dtype], k_dtype=TORCH_DTYPES[dtype],
                                 paged=paged, page_size=128 if paged else -1, causal=causal,
                                 mode=mode, work_items=work_items, kv_splits=kv_splits)
    assert isinstance(verdict, _backend.Served), verdict
    return verdict.kernel


def _sparse_kernel(mode="bfloat16", g=16, partial=BF16, paged=False, total_q=5000):
    q, kv, pv = {"bfloat16": (BF16, BF16, None), "bf16_kv_e4m3": (BF16, E4M3, None),
                 "e4m3_pv_bf16": (E4M3, E4M3, BF16), "e4m3": (E4M3, E4M3, None)}[mode]
    verdict = sparse_prefill_sm90.supports(q_dtype=q, k_dtype=kv, v_dtype=kv, pv_dtype=pv,
                                           paged=paged, qhead_per_kv=g, topk=16,
                                           partial_dtype=partial, total_q=total_q)
    assert isinstance(verdict, _backend.Served), verdict
    return verdict.kernel


def _indexer_form(dtype="bfloat16", paged=True, rows=1):
    return variants.serving_form(variants.INDEXER_FORMS, dtype,
                                 layout="paged" if paged else "dense",
                                 rows_per_request=rows).name


def test_shipped_variants_are_exactly_what_dispatch_serves(monkeypatch):
    """Every shipped variant is chosen by the dispatch for some call (a form not yet validated:
    with MSA_UNVALIDATED_KERNELS=1), and every choice is a shipped variant: the build ships no
    form the dispatch cannot serve."""
    shipped = {v.name for v in variants.shipped_variants()}
    served = set()
    for dtype, paged, causal, items, splits in itertools.product(
            ("bfloat16", "e4m3"), (False, True), (False, True), (1, MAX_ITEMS, MAX_ITEMS + 1),
            (1, 3)):
        for mode in (3, 1) if dtype == "bfloat16" else (3,):
            kernel = _fmha_kernel(dtype, mode, paged, causal, items, splits)
            served.update(kernel.artifacts)
    for unvalidated in (False, True):
        if unvalidated:
            monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
        for mode, g, partial, paged, total_q in itertools.product(
                ("bfloat16",) + variants.FP8_MODES, variants.QHEAD_PER_KV,
                (torch.float32, BF16, torch.float16, E4M3), (False, True),
                (variants.FEW_CALL_QUERIES, variants.FEW_CALL_QUERIES + 1)):
            if mode != "bfloat16" and partial == torch.float32:
                continue
            kernel = _sparse_kernel(mode, g, partial, paged, total_q)
            served.update((kernel.attention, kernel.combine))
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    for dtype, heads, paged, rows in itertools.product(
            variants.INDEX_DTYPES, variants.INDEX_HEADS, (False, True),
            (1, variants.INDEXER_DECODE_ROWS, variants.INDEXER_DECODE_ROWS + 1)):
        served.add(block_max_score_sm90.variant_name(heads, paged, TORCH_DTYPES[dtype],
                                                     _indexer_form(dtype, paged, rows)))
    assert served == shipped, (sorted(shipped - served), sorted(served - shipped))
    assert len(shipped) == len(variants.shipped_variants())


def test_fmha_serving_table_rules():
    """bf16 O: wsup for causal calls of at most PERSISTENT_MAX_ITEMS work items, wsu otherwise;
    e4m3 O: wsutps up to PERSISTENT_MAX_ITEMS items, wsuts past it; mode 1 (bf16 only): the
    max-score form; plans split by the planner: the split form (O only), its combine too."""
    assert _fmha_kernel("bfloat16", causal=True, work_items=MAX_ITEMS).form == "wsup"
    assert _fmha_kernel("bfloat16", causal=True, work_items=MAX_ITEMS + 1).form == "wsu"
    assert _fmha_kernel("bfloat16", causal=False, work_items=1).form == "wsu"
    for causal in (False, True):
        assert _fmha_kernel("e4m3", causal=causal, work_items=MAX_ITEMS).form == "wsutps"
        assert _fmha_kernel("e4m3", causal=causal, work_items=MAX_ITEMS + 1).form == "wsuts"
    kernel = _fmha_kernel("bfloat16", mode=1, paged=True, kv_splits=4)
    assert (kernel.form, kernel.variant, kernel.with_score) == \
        ("maxscore", "fmha_sm90_bfloat16_paged_maxscore", True)
    kernel = _fmha_kernel("e4m3", kv_splits=4)
    assert kernel.split and kernel.artifacts == ("fmha_sm90_e4m3_dense_split",
                                                 "sparse_combine_sm90_pf32")
    kernel = _fmha_kernel("e4m3", paged=True)
    assert kernel.v_transposed and kernel.trailing_args == ("num_ctas",) and not kernel.split
    assert kernel.form in fmha_sm90.V_TRANSPOSED_FORMS and \
        kernel.form in fmha_sm90.ROW_SUM_ON_MMA_FORMS
    # The choice is cached: the same call shape gets the same kernel object back.
    assert _fmha_kernel("bfloat16") is _fmha_kernel("bfloat16")


def test_fmha_passes_a_form_whose_artifact_is_missing(monkeypatch):
    """A split plan whose split artifact (or combine) cannot be loaded runs unsplit; a call
    with no loadable form is refused with the loader's reason (the reference then runs)."""
    missing = {"fmha_sm90_bfloat16_dense_split"}

    def unavailable(*names):
        gone = [n for n in names if n in missing]
        return f"no precompiled CuTe kernel {gone[0]}" if gone else None
    monkeypatch.setattr(serving.cute_runtime, "unavailable_reason", unavailable)
    assert _fmha_kernel("bfloat16", causal=False, kv_splits=4).form == "wsu"
    missing.add("fmha_sm90_bfloat16_dense_wsu")
    reason = fmha_sm90.supports(q_dtype=BF16, k_dtype=BF16, paged=False, causal=False, mode=3,
                                work_items=8, kv_splits=4)
    assert isinstance(reason, str) and "fmha_sm90_bfloat16_dense_wsu" in reason


def test_sparse_serving_table_rules():
    """fp32 partials: the warp-MMA form; G 8 / 16 with bf16 or all-e4m3 q/k/v and 16-bit or
    e4m3 partials: the persistent forms where built (test_sparse_call_size_rules), else ws3w
    for the WS3W_PAIRS, ws otherwise; every other call: wgmma."""
    assert _sparse_kernel("bfloat16", 16, torch.float32).form == "mma"
    assert _sparse_kernel("bfloat16", 16, BF16).form == "ws3w"
    assert _sparse_kernel("bfloat16", 8, torch.float16).form == "ws"
    assert _sparse_kernel("bfloat16", 8, E4M3).form == "ws"
    assert _sparse_kernel("e4m3", 16, BF16).form == "wsp3we"
    assert _sparse_kernel("e4m3", 8, BF16).form == "ws3w"
    assert _sparse_kernel("e4m3", 8, E4M3).form == "ws3w"
    assert _sparse_kernel("e4m3", 16, torch.float16).form == "ws"
    assert _sparse_kernel("bfloat16", 4, BF16).form == "wgmma"
    assert _sparse_kernel("bf16_kv_e4m3", 16, BF16).form == "wgmma"
    kernel = _sparse_kernel("e4m3_pv_bf16", 2, torch.float16, paged=True)
    assert (kernel.attention, kernel.combine) == (
        "sparse_prefill_sm90_e4m3_pv_bf16_g2_paged_pf16", "sparse_combine_sm90_pf16")
    reason = sparse_prefill_sm90.supports(q_dtype=E4M3, k_dtype=E4M3, v_dtype=E4M3,
                                          pv_dtype=None, qhead_per_kv=16, topk=16,
                                          partial_dtype=torch.float32)
    assert "partial_dtype torch.float32" in reason


def test_sparse_call_size_rules():
    """G 16 with bf16 partials: bf16 calls of at most FEW_CALL_QUERIES queries take the
    persistent wsp3w, longer ones ws3w; e4m3 calls take the persistent wsp3we at every size.
    Other groups and partial dtypes keep ws3w / ws."""
    for total_q in (1, variants.FEW_CALL_QUERIES):
        assert _sparse_kernel("bfloat16", 16, BF16, total_q=total_q).form == "wsp3w"
    assert _sparse_kernel("bfloat16", 16, BF16, total_q=variants.FEW_CALL_QUERIES + 1).form \
        == "ws3w"
    for total_q in (1, variants.FEW_CALL_QUERIES, variants.FEW_CALL_QUERIES + 1):
        assert _sparse_kernel("e4m3", 16, BF16, total_q=total_q).form == "wsp3we"
    assert _sparse_kernel("bfloat16", 8, BF16, total_q=64).form == "ws3w"
    assert _sparse_kernel("e4m3", 8, BF16, total_q=64).form == "ws3w"
    assert _sparse_kernel("e4m3", 16, E4M3, total_q=64).form == "ws3w"


def test_indexer_serving_table_rules():
    """Paged keys with at most INDEXER_DECODE_ROWS (query, head) rows per request: the decode
    form; everything else the prefill form."""
    rows = variants.INDEXER_DECODE_ROWS
    assert _indexer_form(paged=True, rows=rows) == "decode"
    assert _indexer_form(paged=True, rows=rows + 1) == "prefill"
    assert _indexer_form(paged=False, rows=1) == "prefill"
    assert block_max_score_sm90.variant_name(4, True, E4M3, "decode") == \
        "block_max_score_sm90_e4m3_h4_paged_decode"


def test_debug_hooks_force_forms_only_inside_their_block():
    """debug.forcing pins a form for the calls it is built for (others keep their served
    form), only inside the block; unknown hooks and forms are errors."""
    with debug.forcing(fmha_form="wsu", sparse_form="ws"):
        assert _fmha_kernel("bfloat16", causal=True).form == "wsu"
        assert _fmha_kernel("e4m3").form == "wsutps"            # wsu is not built for e4m3
        assert _fmha_kernel("bfloat16", kv_splits=4).form == "wsu"      # forced beats split
        assert _fmha_kernel("bfloat16", mode=1).form == "maxscore"      # O-only calls only
        assert _sparse_kernel("bfloat16", 16, BF16).form == "ws"
        assert _sparse_kernel("bfloat16", 4, BF16).form == "wgmma"
        assert _sparse_kernel("bfloat16", 16, torch.float32).form == "mma"
    assert _fmha_kernel("bfloat16", causal=True).form == "wsup"
    assert _sparse_kernel("bfloat16", 16, BF16).form == "ws3w"
    with debug.forcing(fmha_split_kv=False):
        assert _fmha_kernel("e4m3", kv_splits=4).form == "wsutps"
    with debug.forcing(sparse_form="wgmma"):
        assert _sparse_kernel("e4m3", 16, E4M3).form == "wgmma"
    with debug.forcing(fmha_form="bogus"), pytest.raises(ValueError, match="forced form"):
        _fmha_kernel()
    with debug.forcing(fmha_form="maxscore"), pytest.raises(ValueError, match="O-only"):
        _fmha_kernel()
    with pytest.raises(TypeError, match="unknown hooks"):
        with debug.forcing(warp_specialized=True):
            pass
    assert debug.forced("fmha_form") is None and not debug.poison()
    with debug.poisoned_outputs():
        assert debug.poison()
    assert not debug.poison()


def test_decode_forms_follow_their_hooks():
    """The decode kernel splits page keys across warps and reads e4m3 directly unless a
    debug hook turns either off."""
    assert decode_cuda._split_keys() and decode_cuda._direct_fp8()
    with debug.forcing(decode_split_keys=False, decode_direct_fp8=False):
        assert not decode_cuda._split_keys() and not decode_cuda._direct_fp8()
    assert decode_cuda._split_keys() and decode_cuda._direct_fp8()


def test_decode_warpgroup_form_is_served_per_validated_dtype(monkeypatch):
    """The warpgroup decode form serves tiles of > 16 rows (multi-token prediction) of the
    dtypes in VALIDATED_WARPGROUP ("bf16": bf16 q and K/V; "e4m3": e4m3 q and K/V), every dtype
    with MSA_UNVALIDATED_KERNELS=1, never tiles of <= 16 rows; the decode_warpgroup hook forces
    it on or off."""
    def call(seqlen_q, group, e4m3):
        return SimpleNamespace(seqlen_q=seqlen_q, qhead_per_kv=group,
                               pv_quant_dtype=E4M3 if e4m3 else None)

    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    monkeypatch.setattr(decode_cuda, "VALIDATED_WARPGROUP", frozenset({"bf16"}))
    assert decode_cuda._warpgroup(call(8, 16, e4m3=False))
    assert not decode_cuda._warpgroup(call(8, 16, e4m3=True))
    assert not decode_cuda._warpgroup(call(1, 16, e4m3=False))     # 16 rows: split-keys forms
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert decode_cuda._warpgroup(call(8, 16, e4m3=True))
    assert not decode_cuda._warpgroup(call(4, 4, e4m3=True))
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    monkeypatch.setattr(decode_cuda, "VALIDATED_WARPGROUP", frozenset({"bf16", "e4m3"}))
    assert decode_cuda._warpgroup(call(2, 16, e4m3=True))
    with debug.forcing(decode_warpgroup=False):
        assert not decode_cuda._warpgroup(call(8, 16, e4m3=False))
    with debug.forcing(decode_warpgroup=True):
        assert decode_cuda._warpgroup(call(1, 1, e4m3=True))


def test_decode_pingpong_form_serves_validated_dtypes_on_tiles_of_two_warpgroups(monkeypatch):
    """The warpgroup form's ping-pong variant serves tiles of > 64 rows (both consumer
    warpgroups busy) for the dtypes VALIDATED_PINGPONG lists (bf16 and e4m3), a dtype taken off
    that list only with MSA_UNVALIDATED_KERNELS=1; the decode_pingpong hook forces it on or
    off."""
    def call(seqlen_q, group, e4m3=False):
        return SimpleNamespace(seqlen_q=seqlen_q, qhead_per_kv=group,
                               pv_quant_dtype=E4M3 if e4m3 else None)

    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    assert decode_cuda.VALIDATED_PINGPONG == frozenset({"bf16", "e4m3"})
    for e4m3 in (False, True):
        assert decode_cuda._pingpong(call(8, 16, e4m3))
        assert decode_cuda._pingpong(call(16, 16, e4m3))
        assert not decode_cuda._pingpong(call(4, 16, e4m3))     # 64 rows: one warpgroup
    monkeypatch.setattr(decode_cuda, "VALIDATED_PINGPONG", frozenset({"bf16"}))
    assert decode_cuda._pingpong(call(8, 16))
    assert not decode_cuda._pingpong(call(8, 16, e4m3=True))
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert decode_cuda._pingpong(call(8, 16, e4m3=True))
    assert not decode_cuda._pingpong(call(4, 16, e4m3=True))
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    monkeypatch.setattr(decode_cuda, "VALIDATED_PINGPONG", frozenset())
    assert not decode_cuda._pingpong(call(8, 16))
    with debug.forcing(decode_pingpong=False):
        assert not decode_cuda._pingpong(call(8, 16))
    with debug.forcing(decode_pingpong=True):
        assert decode_cuda._pingpong(call(1, 1))


def test_decode_persistent_gate(monkeypatch):
    """Dense ping-pong calls take the persistent form where their plan has it and their dtype
    is in VALIDATED_PERSISTENT; e4m3 calls only where the plan's requests average >= 64 pages
    (shorter ones run the work items); sparse calls never; the decode_persistent hook forces
    it either way on calls whose plan has it."""
    def call(e4m3=True, sparse=False, pages=(64, 64), ctas=132):
        return SimpleNamespace(pv_quant_dtype=E4M3 if e4m3 else None,
                               q2k_indices=object() if sparse else None,
                               schedule=SimpleNamespace(persistent_ctas=ctas,
                                                        planned_units=list(pages)))

    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    assert decode_cuda.VALIDATED_PERSISTENT == frozenset({"bf16", "e4m3"})
    assert decode_cuda._persistent(call())
    assert decode_cuda._persistent(call(pages=(100, 28)))           # a mean of 64 pages
    assert not decode_cuda._persistent(call(pages=(100, 27)))       # 4k-5k keys: work items
    assert decode_cuda._persistent(call(e4m3=False, pages=(40, 40)))
    assert not decode_cuda._persistent(call(ctas=0))                # not planned
    assert not decode_cuda._persistent(call(sparse=True))
    with debug.forcing(decode_persistent=True):
        assert decode_cuda._persistent(call(pages=(5,)))
        assert not decode_cuda._persistent(call(ctas=0))
    with debug.forcing(decode_persistent=False):
        assert not decode_cuda._persistent(call(e4m3=False))
    monkeypatch.setattr(decode_cuda, "VALIDATED_PERSISTENT", frozenset({"e4m3"}))
    assert not decode_cuda._persistent(call(e4m3=False))
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert decode_cuda._persistent(call(e4m3=False))
    assert not decode_cuda._persistent(call(pages=(40, 40)))        # unvalidated is not faster


def test_decode_e4m3_pv_serves_every_pingpong_form(monkeypatch):
    """P.V on e4m3 wgmma serves e4m3 ping-pong calls of the forms VALIDATED_PV_FP8 lists (the
    persistent form, sparse tiles, dense work items), never bf16; a form taken off the list
    only with MSA_UNVALIDATED_KERNELS=1; the decode_pv_fp8 hook forces it either way."""
    def call(e4m3=True, sparse=False):
        return SimpleNamespace(pv_quant_dtype=E4M3 if e4m3 else None,
                               q2k_indices=object() if sparse else None)

    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    assert decode_cuda.VALIDATED_PV_FP8 == frozenset({"persistent", "sparse", "dense"})
    assert decode_cuda._pv_fp8(call(), persistent=True)
    assert decode_cuda._pv_fp8(call(sparse=True), persistent=False)
    assert decode_cuda._pv_fp8(call(), persistent=False)              # dense work items
    assert not decode_cuda._pv_fp8(call(e4m3=False), persistent=True)
    monkeypatch.setattr(decode_cuda, "VALIDATED_PV_FP8", frozenset({"persistent", "sparse"}))
    assert not decode_cuda._pv_fp8(call(), persistent=False)
    monkeypatch.setattr(decode_cuda, "VALIDATED_PV_FP8", frozenset())
    assert not decode_cuda._pv_fp8(call(), persistent=True)
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert decode_cuda._pv_fp8(call(), persistent=False)
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    with debug.forcing(decode_pv_fp8=True):
        assert decode_cuda._pv_fp8(call(), persistent=False)
        assert not decode_cuda._pv_fp8(call(e4m3=False), persistent=False)
    with debug.forcing(decode_pv_fp8=False):
        assert not decode_cuda._pv_fp8(call(sparse=True), persistent=True)


def test_decode_token_warps_gate(monkeypatch):
    """The token-warps form is offered only to sparse calls of e4m3 q and K/V whose tiles
    have more than 16 rows; served validated ("per_warp"), unvalidated only with
    MSA_UNVALIDATED_KERNELS=1 or the decode_token_warps hook (True: the served form; or a
    form's name), which also turns them off. Unforced, calls whose tiles are fewer than half
    the SMs, or whose ping-pong tiles' selections make >= 2.5 a planned block (a dense union),
    leave them to the ping-pong form. The binding's code: 0 none, 1 per_warp, 2 once."""
    served = decode_cuda.TOKEN_WARPS_FORMS[decode_cuda.TOKEN_WARPS_FORM]
    def call(e4m3=True, sparse=True, seqlen_q=8, group=16, tile_rows=128, batch=32, blocks=100):
        return SimpleNamespace(pv_quant_dtype=E4M3 if e4m3 else None,
                               q2k_indices=object() if sparse else None, seqlen_q=seqlen_q,
                               qhead_per_kv=group, batch_size=batch,
                               k=SimpleNamespace(shape=(1, 4)),
                               schedule=SimpleNamespace(
                                   qo_tile_rows=tile_rows, max_grid_size=132,
                                   num_qo_tiles=-(-seqlen_q * group // tile_rows),
                                   sparse_topk=16, slot_chunks=False,
                                   planned_units=[blocks // 2] * (batch - 1) + [blocks]))

    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    assert decode_cuda.VALIDATED_TOKEN_WARPS is True
    assert decode_cuda.TOKEN_WARPS_FORM == "per_warp"
    assert decode_cuda.TOKEN_WARPS_FORMS == {"per_warp": 1}
    monkeypatch.setattr(decode_cuda, "VALIDATED_TOKEN_WARPS", False)
    assert decode_cuda._token_warps(call()) == 0
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert decode_cuda._token_warps(call()) == served
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    monkeypatch.setattr(decode_cuda, "VALIDATED_TOKEN_WARPS", True)
    assert decode_cuda._token_warps(call()) == served
    assert decode_cuda._token_warps(call(seqlen_q=2, group=16)) == served   # 32 rows
    assert decode_cuda._token_warps(call(batch=17)) == served    # 68 tiles at Hkv 4
    assert decode_cuda._token_warps(call(batch=16)) == 0         # 64 tiles < 132 / 2
    assert decode_cuda._token_warps(call(blocks=52)) == served   # 128 selections, 52 blocks
    assert decode_cuda._token_warps(call(blocks=51)) == 0        # >= 2.5 a block: ping-pong
    assert decode_cuda._token_warps(call(seqlen_q=5, blocks=33)) == served   # 80 selections
    assert decode_cuda._token_warps(call(seqlen_q=5, blocks=32)) == 0
    # Tiles of <= 64 rows do not take the ping-pong form: dense unions keep the token warps.
    assert decode_cuda._token_warps(call(seqlen_q=4, blocks=25)) == served
    assert decode_cuda._token_warps(call(seqlen_q=2, blocks=10)) == served
    with debug.forcing(decode_pingpong=False):
        assert decode_cuda._token_warps(call(blocks=51)) == served
    for other in (call(e4m3=False), call(sparse=False), call(seqlen_q=1), call(tile_rows=16)):
        assert decode_cuda._token_warps(other) == 0
    with debug.forcing(decode_token_warps=False):
        assert decode_cuda._token_warps(call()) == 0
    monkeypatch.setattr(decode_cuda, "VALIDATED_TOKEN_WARPS", False)
    with debug.forcing(decode_token_warps=True):
        assert decode_cuda._token_warps(call()) == served
        assert decode_cuda._token_warps(call(batch=1)) == served
        assert decode_cuda._token_warps(call(blocks=10)) == served
        assert decode_cuda._token_warps(call(e4m3=False)) == 0
    for name, code in decode_cuda.TOKEN_WARPS_FORMS.items():
        with debug.forcing(decode_token_warps=name):
            assert decode_cuda._token_warps(call()) == code
    with debug.forcing(decode_token_warps="twice"), pytest.raises(ValueError, match="twice"):
        decode_cuda._token_warps(call())


def test_topk_staged_bounds_are_the_launchers():
    """topk_cuda's record of which kernel ran uses the launcher's bounds (csrc constants) of
    the staged kernel, which serves validated."""
    import re
    from msa._native import topk_cuda
    source = (Path(__file__).resolve().parents[1] / "csrc" / "sparse_topk_select.cu").read_text()

    def constant(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", source).group(1))
    assert topk_cuda.STAGED_MIN_QUERIES == constant("kStagedMinQueries")
    assert topk_cuda.STAGED_TILES[0] == constant("kStagedMinTiles")
    assert topk_cuda.STAGED_FLOATS == constant("kStagedFloats")
    assert topk_cuda.STAGED_MAX_WIDTH == constant("kStagedMaxWidth")
    assert topk_cuda.VALIDATED_STAGED is True

    def call(tiles=373, total_q=16384, topk=16):
        return SimpleNamespace(max_score=torch.empty(4, tiles, total_q, device="meta"),
                               topk=topk, num_out_heads=4)
    assert topk_cuda.staged_applies(call())
    for other in (call(tiles=63), call(tiles=769), call(total_q=63), call(topk=17)):
        assert not topk_cuda.staged_applies(other)
    assert topk_cuda.staged_applies(call(tiles=64, topk=32)) is False
    assert topk_cuda.staged_applies(call(tiles=768, topk=64)) is False
    # Narrow CTAs (a meta tensor counts an H200's 132 SMs) leave room for more blocks: 8
    # queries a CTA at 347 queries x 4 heads, 16 at 1000.
    assert topk_cuda.staged_queries_per_cta(347, 4, 132) == 8
    assert topk_cuda.staged_queries_per_cta(1000, 4, 132) == 16
    assert topk_cuda.staged_queries_per_cta(16384, 4, 132) == 32
    assert topk_cuda.staged_applies(call(tiles=2816, total_q=347))
    assert not topk_cuda.staged_applies(call(tiles=2817, total_q=347))
    assert topk_cuda.staged_applies(call(tiles=1490, total_q=1000))
    assert not topk_cuda.staged_applies(call(tiles=1491, total_q=1000))


def test_unvalidated_forms_are_passed_by_until_opted_in(monkeypatch):
    """A table form marked validated=False is passed by for the next form unless
    MSA_UNVALIDATED_KERNELS=1 (the GPU tests that validate it set it); a forced form runs
    regardless."""
    new = variants.Form("new", "FmhaSm90Ws", ("bfloat16",), "a candidate", validated=False)
    table = {"new": new, "wsu": variants.FMHA_FORMS["wsu"]}
    pick = dict(with_score=False, kv_splits=1, causal=True, work_items=1)
    assert variants.serving_form(table, "bfloat16", **pick).name == "wsu"
    assert variants.serving_form(table, "bfloat16", unvalidated_ok=True, **pick) is new
    assert variants.serving_form(table, "bfloat16", forced="new", **pick) is new
    assert not _backend.unvalidated_ok()
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert _backend.unvalidated_ok() and _backend.unvalidated_reason("x", False) is None
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    assert "not validated" in _backend.unvalidated_reason("x", False)


def test_backend_hands_the_chosen_kernel_to_run():
    """A supports() that answers Served(kernel) gets run(call, kernel=kernel) through one
    cached partial per kernel."""
    calls = []
    impl = _backend.NativeImpl("op", "sm90", lambda call, kernel: calls.append((call, kernel)),
                               lambda **_: _backend.Served("k1"))
    runner = impl.runner("k1")
    assert runner is impl.runner("k1")
    runner("call")
    assert calls == [("call", "k1")]
    assert _backend.refusal(_backend.Served("k1")) is None
    assert _backend.refusal(None) is None and _backend.refusal("why") == "why"


def test_csr_schedule_past_24_bit_query_ids_is_refused_for_the_reference(monkeypatch):
    """The native schedule build packs local query ids in 24 bits: a call with that many
    queries is refused by supports() (so _backend logs the fallback and the reference runs)
    instead of the native run calling the reference itself."""
    assert csr_builder.supports(return_schedule=True, total_q=1000) is None
    big = csr_builder.MAX_SCHEDULE_QUERIES
    assert "24 bits" in csr_builder.supports(return_schedule=True, total_q=big)
    assert csr_builder.supports(return_schedule=False, total_q=big) is None
