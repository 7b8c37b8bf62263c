"""CPU-only: the sm_90a CuTe-DSL sparse prefill kernel compiles without register spills.

Compiles two bf16 attention variants (G=16, dense: fp32 partials -> warp-level mma.sync kernel,
bf16 partials -> warpgroup wgmma kernel), two FP8 variants (all-e4m3 with e4m3 P.V, G=16 dense;
e4m3 QK^T with bf16 P.V, G=4 paged), two of the warp-specialized TMA form (bf16 G=16 dense,
e4m3 G=8 paged with e4m3 partials) and the fp32 combine for sm_90a with fake tensors (no GPU
needed) and runs ptxas -v on the kept PTX. Skips when nvidia-cutlass-dsl or ptxas is missing.
The full variant list is checked by `python tools/compile_cute.py --check`. Also checks, without
CUDA, that supports() gates the FP8 modes until they are validated.
"""

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                                reason="nvidia-cutlass-dsl is not installed")


def _tools():
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    import compile_cute
    return compile_cute


@pytest.mark.parametrize("name", ["sparse_prefill_sm90_bfloat16_g16_dense_pf32",
                                  "sparse_prefill_sm90_bfloat16_g16_dense_pbf16",
                                  "sparse_prefill_sm90_e4m3_g16_dense_pbf16",
                                  "sparse_prefill_sm90_e4m3_pv_bf16_g4_paged_pbf16",
                                  "sparse_combine_sm90_pf32",
                                  "sparse_prefill_sm90_bfloat16_g16_dense_pbf16_ws",
                                  "sparse_prefill_sm90_e4m3_g8_paged_pe4m3_ws",
                                  "sparse_prefill_sm90_bfloat16_g8_paged_pf16_ws3w"])
def test_variant_compiles_for_sm90a_without_spills(name, tmp_path):
    tools = _tools()
    try:
        tools.find_ptxas()
    except FileNotFoundError:
        pytest.skip("ptxas is not available")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cute_kernels.build import compile_variant
    from cute_kernels.variants import by_name
    compile_variant(by_name(name), dump_dir=str(tmp_path))
    ptx = sorted(tmp_path.glob("*.ptx"))
    assert ptx, "the DSL kept no PTX"
    text = ptx[0].read_text()
    assert ".target sm_90a" in text
    if name.endswith(("_ws", "_ws3w")):
        # Warp-specialized: the producer warpgroup gives registers to the consumers; per tile
        # each query's Q rows arrive by TMA (G x 128 bytes per box: 64 / G queries x 2 boxes
        # for bf16, 1 for e4m3) and its partial rows leave by TMA; S and P.V are issued once.
        g = int(re.search(r"_g(\d+)_", name).group(1))
        boxes_per_query = 2 if "_bfloat16_" in name else 1
        loads = "cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes"
        assert text.count(loads) == 64 // g * boxes_per_query
        assert "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group" in text
        assert "setmaxnreg.dec.sync.aligned.u32" in text
        assert "setmaxnreg.inc.sync.aligned.u32" in text
        mma = ("m64n128k16.f32.bf16.bf16" if boxes_per_query == 2
               else "m64n128k32.f32.e4m3.e4m3")
        k_steps = 8 if boxes_per_query == 2 else 4
        assert text.count(f"wgmma.mma_async.sync.aligned.{mma}") == 2 * k_steps
    elif "_e4m3_g" in name:
        # e4m3 S = QK^T (SS) and e4m3 O = PV (RS: P rounded to e4m3 and kept in registers, V^T
        # K-major and key-permuted): 4 k-steps each of m64n128k32; P rounded with cvt e4m3x2.
        # S is issued at two sites (tile 0 before the loop, tile t+1 inside it: the software
        # pipeline).
        assert text.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 12
        assert len(re.findall(r"m64n128k32\.f32\.e4m3\.e4m3 \{[^}]*\}, \{", text)) == 4
        assert "cvt.rn.satfinite.e4m3x2.f32" in text
        assert "fence.proxy.async.shared::cta" in text
    elif "_e4m3_pv_bf16_" in name:
        # e4m3 QK^T (4 k-steps of k32, two issue sites), V converted to bf16, bf16 RS P.V
        # (8 k-steps of k16).
        assert text.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 8
        assert text.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 8
    elif name.endswith("_pbf16") and os.environ.get("MSA_CUTE_MMA", "wgmma") != "warp":
        # S = QK^T (SS, two issue sites) and O = PV (RS, V^T MN-major): 8 k-steps each of
        # m64n128k16.
        assert text.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 24
        assert "fence.proxy.async.shared::cta" in text
    report = tools.ptxas_report(ptx[0])
    assert report["spill_bytes"] == 0, report
    assert 0 < report["registers"] <= 255
    assert report["register_split_excess"] == 0, report


def test_setmaxnreg_split_must_fit_the_launch_registers():
    """setmaxnreg only moves registers within the CTA's launch allocation: a producer warpgroup
    at .dec plus the consumer warpgroups at .inc beyond it means .inc never returns (the e4m3
    FMHA ws forms hung so: 80 / 216 x 384 threads = 65536 > 168 x 384)."""
    tools = _tools()

    def ptx(dec, inc, threads=384):
        return (f".entry k()\n.reqntid {threads}, 1, 1\n.minnctapersm 1\n{{\n"
                f"setmaxnreg.dec.sync.aligned.u32 \t{dec};\n"
                f"setmaxnreg.inc.sync.aligned.u32 \t{inc};\n}}")
    assert tools.register_split_excess(ptx(80, 216), 168) == 1024
    assert tools.register_split_excess(ptx(72, 216), 168) == 0
    assert tools.register_split_excess(ptx(24, 240), 168) == 0
    assert tools.register_split_excess(ptx(24, 248), 168) == 2048
    assert tools.register_split_excess(ptx(40, 232, threads=384), 160) > 0
    assert tools.register_split_excess(".entry k()\n.reqntid 256, 1, 1\n{}", 168) == 0


def test_shipped_variant_names_match_the_runtime():
    """The loader names artifacts without importing cutlass; both sides must agree."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    from cute_kernels.variants import FP8_MODES, shipped_variants
    from msa._native.sparse_prefill_sm90 import _variant_names, attention_mode
    import torch
    names = {v.name for v in shipped_variants()}
    partials = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    for g in (1, 2, 4, 8, 16):
        for paged in (False, True):
            for partial in partials:   # every contract partial_dtype
                assert set(_variant_names(g, paged, partial)) <= names
                if partial != torch.float32:   # FP8 modes: every partial but fp32
                    for mode in FP8_MODES:
                        assert set(_variant_names(g, paged, partial, mode)) <= names
    # The warp-specialized form wherever it applies (forced on; the gate is tested below).
    from msa._native import sparse_prefill_sm90 as native
    forced = native.WARP_SPECIALIZED_FOR_TESTS
    try:
        for form in native.WS_FORMS:
            native.WARP_SPECIALIZED_FOR_TESTS = form
            for g in (8, 16):
                for paged in (False, True):
                    for partial in partials[1:]:
                        for mode in native.WS_MODES:
                            attention, _ = _variant_names(g, paged, partial, mode)
                            assert native.variant_form(attention) == form
                            assert attention in names
            assert native.variant_form(_variant_names(4, False, torch.bfloat16)[0]) == "wgmma"
            assert native.variant_form(_variant_names(16, False, torch.float32)[0]) == "wgmma"
    finally:
        native.WARP_SPECIALIZED_FOR_TESTS = forced
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    # Every compiled FP8 family serves a dtype mode.
    served = {attention_mode(bf16, e4m3, e4m3, None), attention_mode(e4m3, e4m3, e4m3, bf16),
              attention_mode(e4m3, e4m3, e4m3, None)}
    assert served == set(FP8_MODES)


def test_fp8_modes_are_gated_until_validated(monkeypatch):
    """supports() refuses an FP8 mode unless it is in VALIDATED_FP8_MODES or
    MSA_UNVALIDATED_KERNELS=1 (no CUDA needed: the gate comes before any artifact lookup)."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    import torch
    from msa._native import sparse_prefill_sm90 as native
    e4m3 = torch.float8_e4m3fn
    features = dict(q_dtype=e4m3, k_dtype=e4m3, v_dtype=e4m3, pv_dtype=e4m3, paged=False,
                    qhead_per_kv=16, topk=16, partial_dtype=torch.bfloat16)
    monkeypatch.delenv(native.UNVALIDATED_ENV, raising=False)
    monkeypatch.setattr(native, "VALIDATED_FP8_MODES", set())
    reason = native.supports(**features)
    assert reason is not None and "not validated" in reason
    monkeypatch.setenv(native.UNVALIDATED_ENV, "1")
    reason = native.supports(**features)
    assert reason is None or "not validated" not in reason
    reason = native.supports(**dict(features, partial_dtype=torch.float32))
    assert reason is not None and "partial" in reason


def test_new_partial_dtypes_are_gated_until_validated(monkeypatch):
    """fp16 / e4m3 partials run natively only once in VALIDATED_PARTIAL_DTYPES, or with
    MSA_UNVALIDATED_KERNELS=1; bf16 / fp32 partials are validated. No CUDA needed."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    import torch
    from msa._native import sparse_prefill_sm90 as native
    bf16 = torch.bfloat16
    features = dict(q_dtype=bf16, k_dtype=bf16, v_dtype=bf16, pv_dtype=None, paged=True,
                    qhead_per_kv=8, topk=16)
    monkeypatch.delenv(native.UNVALIDATED_ENV, raising=False)
    monkeypatch.setattr(native, "VALIDATED_PARTIAL_DTYPES", {torch.float32, bf16})
    for partial in (torch.float16, torch.float8_e4m3fn):
        reason = native.supports(**features, partial_dtype=partial)
        assert reason is not None and "not validated" in reason and str(partial) in reason
    for partial in (torch.float32, bf16):
        reason = native.supports(**features, partial_dtype=partial)
        assert reason is None or "not validated" not in reason
    monkeypatch.setenv(native.UNVALIDATED_ENV, "1")
    reason = native.supports(**features, partial_dtype=torch.float8_e4m3fn)
    assert reason is None or "not validated" not in reason


def test_gated_kernel_forms_follow_their_flags(monkeypatch):
    """A kernel form (the direct e4m3 decode form) runs only when validated, forced by a test
    hook, or opted into with MSA_UNVALIDATED_KERNELS=1; otherwise its validated counterpart
    runs. No CUDA needed."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    from msa import _backend
    from msa._native import decode_cuda
    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    monkeypatch.setattr(decode_cuda, "VALIDATED_DIRECT_FP8", False)
    monkeypatch.setattr(decode_cuda, "DIRECT_FP8_FOR_TESTS", None)
    assert not decode_cuda._direct_fp8()
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert decode_cuda._direct_fp8()
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    monkeypatch.setattr(decode_cuda, "VALIDATED_DIRECT_FP8", True)
    assert decode_cuda._direct_fp8()
    monkeypatch.setattr(decode_cuda, "DIRECT_FP8_FOR_TESTS", False)
    assert not decode_cuda._direct_fp8()


def test_warp_specialized_sparse_form_follows_its_flag(monkeypatch):
    """The warp-specialized sparse attention serves G 8 / 16 bf16 or all-e4m3 calls with 16-bit
    or e4m3 partials only when validated, forced, or with MSA_UNVALIDATED_KERNELS=1; never
    elsewhere. No CUDA needed."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    import torch
    from msa import _backend
    from msa._native import sparse_prefill_sm90 as native
    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", None)
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED", False)
    bf16 = torch.bfloat16
    assert not native.warp_specialized(16, bf16, "bfloat16")
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert native.warp_specialized(16, bf16, "bfloat16")
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED", True)
    assert native.warp_specialized(8, torch.float8_e4m3fn, "e4m3")
    for g, partial, mode in ((4, bf16, "bfloat16"), (16, torch.float32, "bfloat16"),
                             (16, bf16, "e4m3_pv_bf16"), (16, bf16, "bf16_kv_e4m3")):
        assert not native.warp_specialized(g, partial, mode)
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", False)
    assert not native.warp_specialized(16, bf16, "bfloat16")


def test_three_warpgroup_sparse_form_follows_its_flag(monkeypatch):
    """Where the warp-specialized form runs, "ws3w" replaces "ws" only for the (dtype mode,
    partial dtype) pairs in VALIDATED_WS3W, with MSA_UNVALIDATED_KERNELS=1, or named by
    WARP_SPECIALIZED_FOR_TESTS (a name pins that form; an unknown name is an error). Every
    chosen name is a shipped variant. No CUDA needed."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    import torch
    from msa import _backend
    from msa._native import sparse_prefill_sm90 as native
    from cute_kernels.variants import shipped_variants
    names = {v.name for v in shipped_variants()}
    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED", True)
    monkeypatch.setattr(native, "VALIDATED_WS3W", set())
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", None)

    def served(g=16, partial=torch.bfloat16, mode="bfloat16"):
        attention, combine = native._variant_names(g, True, partial, mode)
        assert attention in names and combine in names
        return native.variant_form(attention)
    assert served() == "ws"
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert served() == "ws3w" and served(8, torch.float8_e4m3fn, "e4m3") == "ws3w"
    assert served(4) == "wgmma"
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", "ws")
    assert served() == "ws"
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", "ws3w")
    assert served(8, torch.float16, "e4m3") == "ws3w"
    assert served(16, torch.float32) == "wgmma"
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", None)
    monkeypatch.setattr(native, "VALIDATED_WS3W", {("bfloat16", torch.bfloat16)})
    assert served() == "ws3w"
    assert served(16, torch.float8_e4m3fn) == "ws"
    assert served(8, torch.bfloat16, "e4m3") == "ws"
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", "bogus")
    with pytest.raises(ValueError, match="warp-specialized forms"):
        served()
    # form_validated (what benchmarks label "-unvalidated") follows the same per-pair gate.
    assert native.form_validated("ws3w", "bfloat16", torch.bfloat16)
    assert not native.form_validated("ws3w", "bfloat16", torch.float8_e4m3fn)
    assert native.form_validated("ws", "bfloat16", torch.float8_e4m3fn)
    assert native.form_validated("wgmma", "e4m3", torch.float16)
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED", False)
    assert not native.form_validated("ws", "bfloat16", torch.bfloat16)
    assert not native.form_validated("ws3w", "bfloat16", torch.bfloat16)


def test_word_transpose_of_v_lands_in_the_register_p_key_order():
    """tile_utils.transpose_v_words (the e4m3 FMHA's per-block V -> Vt): traced with identity
    tensors for every one of its 256 threads, the byte each word store writes, Vt(channel, c'),
    is the byte that thread loaded from V(pi^-1(c'), channel), where register_p_key_order maps a
    key c to its Vt column pi(c) = c'; and the 256 threads write every Vt byte exactly once."""
    _tools()
    import cutlass
    import cutlass.cute as cute
    sys.path.insert(0, str(ROOT / "torch-ext"))
    from msa.cute_kernels.tile_utils import (register_p_key_order, register_p_row_order,
                                             transpose_v_copies)
    pairs, inverse, row_keys = [], [], []

    @cute.jit
    def trace():   # records only: asserts and comparisons inside a traced function are staged
        load, store = transpose_v_copies(cutlass.Float8E4M3FN)
        rows = register_p_row_order()
        key_order = register_p_key_order()
        for key in cutlass.range_constexpr(128):
            inverse.append((key, int(rows((key_order((key, 0)) // 128, 0)))))
            row_keys.append(int(rows((key, 0))))          # row `key` of V holds this key
        for tidx in cutlass.range_constexpr(256):
            src = load.get_slice(tidx).partition_S(cute.make_identity_tensor((128, 128)))
            dst = store.get_slice(tidx).partition_D(cute.make_identity_tensor((128, 128)))
            for x in cutlass.range_constexpr(4):   # word 4m + i = channel byte i of rows x
                for ch in cutlass.range_constexpr(16):
                    r, c_src = src[x * 16 + ch]
                    c_dst, r_dst = dst[ch * 4 + x]
                    pairs.append(((int(r), int(c_src)), (int(r_dst), int(c_dst))))
    trace()
    # The masked transpose (the e4m3 ws form) zeroes the rows of keys register_p_row_key(w, x).
    from msa.cute_kernels.tile_utils import register_p_row_key
    for tidx in range(256):
        for x in range(4):
            (r, _), _ = pairs[tidx * 64 + x * 16]
            assert r == 4 * (tidx % 32) + x
            assert row_keys[r] == register_p_row_key(tidx % 32, x)
    assert all(key == back for key, back in inverse), "the row order inverts the key order"
    # The V transpose op of the wsut form (csrc/fmha_transpose_v.cu) writes the same order.
    from msa._native.fmha_sm90 import vt_column_keys
    assert row_keys == vt_column_keys(), "Vt column keys differ from register_p_row_order"
    assert len(pairs) == 256 * 64
    assert all(loaded == written for loaded, written in pairs)
    assert len({written for _, written in pairs}) == 128 * 128


def test_warp_specialized_fmha_form_follows_its_flag(monkeypatch):
    """O-only FMHA calls run on the ws variants only when validated for their dtype
    (VALIDATED_WARP_SPECIALIZED bf16, VALIDATED_WARP_SPECIALIZED_FP8 e4m3), forced by
    WARP_SPECIALIZED_FOR_TESTS (True: ws; a form name: that form), or opted into with
    MSA_UNVALIDATED_KERNELS=1; mode 1 never does. Every chosen name is a shipped variant. No
    CUDA needed."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    import pytest
    import torch
    from msa import _backend
    from msa._native import fmha_sm90 as native
    from cute_kernels.variants import WS_FORMS, WS_FP8_FORMS, shipped_variants
    names = {v.name for v in shipped_variants()}
    e4m3 = torch.float8_e4m3fn
    assert native.WS_FORMS == {"bfloat16": WS_FORMS, "e4m3": WS_FP8_FORMS}
    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED", False)
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED_FP8", False)
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", None)
    o, o_score = native.MODE_O_ONLY, native.MODE_O_AND_SCORE
    assert native._variant_for(False, o) == "fmha_sm90_bfloat16_dense"
    assert native._variant_for(False, o, e4m3) == "fmha_sm90_e4m3_dense"
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    served = {(torch.bfloat16, False): "_wsu", (torch.bfloat16, True): "_wsup",
              (e4m3, False): "_wsutps", (e4m3, True): "_wsutps"}
    long_call = native.PERSISTENT_MAX_ITEMS + 1      # more work items: non-persistent forms
    for paged in (False, True):
        for (dtype, causal), suffix in served.items():
            for items in (None, 1, native.PERSISTENT_MAX_ITEMS):
                name = native._variant_for(paged, o, dtype, causal, items)
                assert name.endswith(suffix) and name in names
            name = native._variant_for(paged, o, dtype, causal, long_call)
            assert name.endswith("_wsu" if dtype == torch.bfloat16 else "_wsuts")
            assert name in names
        assert not native._variant_for(paged, o_score).endswith("_ws")
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", False)
    assert native._variant_for(True, o) == "fmha_sm90_bfloat16_paged"
    assert native._variant_for(True, o, e4m3) == "fmha_sm90_e4m3_paged"
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    for dtype, forms in ((torch.bfloat16, WS_FORMS), (e4m3, WS_FP8_FORMS)):
        for form in forms:
            monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", form)
            for paged in (False, True):
                name = native._variant_for(paged, o, dtype)
                assert name.endswith("_" + form) and name in names
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", "bogus")
    with pytest.raises(ValueError, match="e4m3 warp-specialized forms"):
        native._variant_for(False, o, e4m3)
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", "ws")
    assert native._variant_for(False, o_score) == "fmha_sm90_bfloat16_dense_maxscore"
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", None)
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED", True)
    assert native._variant_for(True, o) == "fmha_sm90_bfloat16_paged_wsu"
    assert native._variant_for(True, o, e4m3) == "fmha_sm90_e4m3_paged"
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED_FP8", True)
    assert native._variant_for(True, o, e4m3) == "fmha_sm90_e4m3_paged_wsutps"
    monkeypatch.setattr(native, "WARP_SPECIALIZED_FOR_TESTS", True)
    assert native._variant_for(True, o, e4m3) == "fmha_sm90_e4m3_paged_ws"
    # variant_form inverts variant_name (bench_fmha labels rows by the form that ran).
    for dtype, forms in ((torch.bfloat16, WS_FORMS), (e4m3, WS_FP8_FORMS)):
        for form in (*forms, "split", "plain"):
            assert native.variant_form(native.variant_name(True, dtype, form=form)) == form
    assert native.variant_form(native.variant_name(False, max_score=True)) == "plain"
    # The served forms are validated ones; form_validated is the one gate (dispatch, benches).
    for served_forms in (native.SERVED_WS_FORM, native.SERVED_WS_FORM_CAUSAL,
                         native.SERVED_WS_FORM_LONG):
        for name, form in served_forms.items():
            assert form in native.VALIDATED_WS_FORMS[name] and form in native.WS_FORMS[name]
    assert native.form_validated("wsf", e4m3) and native.form_validated("plain", e4m3)
    monkeypatch.setattr(native, "VALIDATED_WARP_SPECIALIZED_FP8", False)
    assert not native.form_validated("wsf", e4m3) and native.form_validated("ws")
    monkeypatch.setattr(native, "VALIDATED_WS_FORMS", {"bfloat16": ("ws",), "e4m3": ()})
    assert not native.form_validated("wsf") and native.form_validated("ws")


def test_split_kv_fmha_form_follows_its_flag(monkeypatch):
    """Plans with num_kv_splits > 1 run the split-KV variants (shipped, both dtypes and
    layouts) only when VALIDATED_SPLIT_KV, forced by SPLIT_KV_FOR_TESTS, or opted into with
    MSA_UNVALIDATED_KERNELS=1, and never with the max-score output. No CUDA needed."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    import torch
    from cute_kernels.variants import shipped_variants
    from msa import _backend
    from msa._native import fmha_sm90 as native
    names = {v.name for v in shipped_variants()}
    for paged in (False, True):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            assert native.variant_name(paged, dtype, form="split") in names
    assert native.SPLIT_COMBINE in names
    monkeypatch.setattr(native.cute_runtime, "unavailable_reason", lambda *names: None)
    monkeypatch.delenv(_backend.UNVALIDATED_ENV, raising=False)
    monkeypatch.setattr(native, "VALIDATED_SPLIT_KV", False)
    monkeypatch.setattr(native, "SPLIT_KV_FOR_TESTS", None)
    plan = {"num_kv_splits": 4}
    assert native.split_kv_count(plan, False) == 1
    monkeypatch.setenv(_backend.UNVALIDATED_ENV, "1")
    assert native.split_kv_count(plan, False) == 4
    assert native.split_kv_count(plan, True) == 1            # max-score output: unsplit
    assert native.split_kv_count({"num_kv_splits": 1}, False) == 1
    monkeypatch.setattr(native, "SPLIT_KV_FOR_TESTS", False)
    assert native.split_kv_count(plan, False) == 1
    monkeypatch.setattr(native, "SPLIT_KV_FOR_TESTS", None)
    monkeypatch.delenv(_backend.UNVALIDATED_ENV)
    monkeypatch.setattr(native, "VALIDATED_SPLIT_KV", True)
    assert native.split_kv_count(plan, False) == 4


def test_compile_update_merges_into_the_existing_manifest(tmp_path):
    """tools/compile_cute.py --only X --update adds X's artifact to the manifest already in
    --out and keeps the other entries; without --only it refuses; the sources digest is only
    written when the manifest then holds every shipped variant."""
    tools = _tools()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    out = str(tmp_path)
    assert tools.main(["--only", "sparse_combine_sm90_pf32", "--out", out]) == 0
    assert tools.main(["--only", "sparse_combine_sm90_pbf16", "--update", "--out", out]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest["variants"]) == {"sparse_combine_sm90_pf32", "sparse_combine_sm90_pbf16"}
    assert all((tmp_path / entry["file"]).is_file() for entry in manifest["variants"].values())
    assert "sources_digest" not in manifest
    assert tools.main(["--update", "--out", out]) == 1
