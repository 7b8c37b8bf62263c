"""CPU-only: the sm_90a CuTe-DSL sparse prefill kernels compile without register spills.

Compiles two bf16 attention variants (fp32 partials -> warp-level mma.sync kernel, G=16; bf16
partials -> warpgroup wgmma kernel, G=4), two FP8 variants of the wgmma kernel (all-e4m3 with
e4m3 P.V, G=4 dense; e4m3 QK^T with bf16 P.V, G=4 paged), three of the warp-specialized TMA
forms (bf16 G=16 dense ws, e4m3 G=8 paged ws3w with e4m3 partials, bf16 G=8 paged ws3w) and the
fp32 combine for sm_90a with fake tensors (no GPU needed) and runs ptxas -v on the kept PTX.
Skips when nvidia-cutlass-dsl or ptxas is missing. The full variant list is checked by
`python tools/compile_cute.py --check`; which variant serves which call, by test_serving.py.
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
                                  "sparse_prefill_sm90_bfloat16_g4_dense_pbf16",
                                  "sparse_prefill_sm90_e4m3_g4_dense_pbf16",
                                  "sparse_prefill_sm90_e4m3_pv_bf16_g4_paged_pbf16",
                                  "sparse_combine_sm90_pf32",
                                  "sparse_prefill_sm90_bfloat16_g16_dense_pf16_ws",
                                  "sparse_prefill_sm90_e4m3_g8_paged_pe4m3_ws3w",
                                  "sparse_prefill_sm90_bfloat16_g8_paged_pbf16_ws3w",
                                  "sparse_prefill_sm90_bfloat16_g16_paged_pbf16_wsp3w",
                                  "sparse_prefill_sm90_bfloat16_g16_dense_pbf16_wsp3w",
                                  "sparse_prefill_sm90_e4m3_g16_paged_pbf16_wsp3we"])
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
    if name.endswith(("_wsp3w", "_wsp3we")):
        # Persistent: the producer warpgroup's K/V loads arrive on the K/V ring's full barrier
        # as they land, and the CTAs fetch their next items from the item counter (a relaxed
        # gpu-scope atomic add; the grid stops at num_ctas).
        assert "cp.async.mbarrier.arrive.noinc.shared" in text
        assert "nctaid.x" in text
        assert re.search(r"atom(\.relaxed)?\.gpu\.global\.add\.[us]32|"
                         r"atom\.global(\.relaxed)?(\.gpu)?\.add\.[us]32", text)
    if name.endswith(("_ws", "_ws3w", "_wsp3w", "_wsp3we")):
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
    elif name.endswith("_pbf16"):
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
    at .dec plus the consumer warpgroups at .inc beyond it means .inc never returns (e.g.
    80 / 216 x 384 threads = 65536 > 168 x 384)."""
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


def test_word_transpose_of_v_lands_in_the_register_p_key_order():
    """fp8.transpose_v_words (the e4m3 FMHA's per-block V -> Vt): traced with identity
    tensors for every one of its 256 threads, the byte each word store writes, Vt(channel, c'),
    is the byte that thread loaded from V(pi^-1(c'), channel), where register_p_key_order maps a
    key c to its Vt column pi(c) = c'; and the 256 threads write every Vt byte exactly once."""
    _tools()
    import cutlass
    import cutlass.cute as cute
    sys.path.insert(0, str(ROOT / "torch-ext"))
    from msa.cute_kernels.fp8 import (register_p_key_order, register_p_row_order,
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
    for tidx in range(256):          # thread (c, w) loads rows 4w .. 4w + 3 of the permuted V
        for x in range(4):
            (r, _), _ = pairs[tidx * 64 + x * 16]
            assert r == 4 * (tidx % 32) + x
    assert all(key == back for key, back in inverse), "the row order inverts the key order"
    # The V transpose op of the e4m3 forms (csrc/fmha_transpose_v.cu) writes the same order.
    from msa._native.fmha_sm90 import vt_column_keys
    assert row_keys == vt_column_keys(), "Vt column keys differ from register_p_row_order"
    assert len(pairs) == 256 * 64
    assert all(loaded == written for loaded, written in pairs)
    assert len({written for _, written in pairs}) == 128 * 128


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
