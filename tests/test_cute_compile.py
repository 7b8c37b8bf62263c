"""CPU-only: the sm_90a CuTe-DSL sparse prefill kernel compiles without register spills.

Compiles two attention variants (G=16, bf16, dense: fp32 partials -> warp-level mma.sync
kernel, bf16 partials -> warpgroup wgmma kernel) and the fp32 combine for sm_90a with fake tensors (no GPU needed) and runs ptxas -v on the kept PTX. Skips when
nvidia-cutlass-dsl or ptxas is missing. The full variant list is checked by
`python tools/compile_cute.py --check`.
"""

import importlib.util
import os
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
                                  "sparse_combine_sm90_pf32"])
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
    if name.endswith("_pbf16") and os.environ.get("MSA_CUTE_MMA", "wgmma") != "warp":
        # S = QK^T (SS) and O = PV (RS, V^T MN-major): 8 k-steps each of m64n128k16.
        assert text.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 16
        assert "fence.proxy.async.shared::cta" in text
    report = tools.ptxas_report(ptx[0])
    assert report["spill_bytes"] == 0, report
    assert 0 < report["registers"] <= 255


def test_shipped_variant_names_match_the_runtime():
    """The loader names artifacts without importing cutlass; both sides must agree."""
    sys.path.insert(0, str(ROOT / "torch-ext"))
    from cute_kernels.variants import shipped_variants
    from msa._native.sparse_prefill_sm90 import _variant_names
    import torch
    names = {v.name for v in shipped_variants()}
    for g in (1, 2, 4, 8, 16):
        for paged in (False, True):
            for partial in (torch.float32, torch.bfloat16):
                assert set(_variant_names(g, paged, partial)) <= names
