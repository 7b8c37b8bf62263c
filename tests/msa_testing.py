"""Shared test inputs and the independent dense-mask oracle (float64), written from the contract
(§0 visibility and math), not from the package's reference code."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

BLOCK = 128

# Contract §1: the package's __all__, exactly.
CONTRACT_ALL = [
    "sparse_atten_func", "sparse_atten_nvfp4_kv_func", "sparse_decode_atten_func",
    "SparseDecodePagedAttentionWrapper", "fp4_indexer_block_scores", "build_k2q_csr",
    "SparseK2qCsrBuilderSm100", "Nvfp4QuantizedTensor", "quantize_bf16_to_nvfp4_128x4",
    "quantize_kv_bf16_to_nvfp4_128x4", "dequantize_nvfp4_128x4_to_bf16",
    "swizzle_nvfp4_scale_to_128x4", "nvfp4_global_scale_from_amax",
]


def cu_seqlens(lengths: Sequence[int], device="cpu") -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


def random_q2k(q_lens: Sequence[int], k_lens: Sequence[int], hkv: int, topk: int, *,
               generator: Optional[torch.Generator] = None, fill: float = 0.8,
               pad_anywhere: bool = True, skip_block: Optional[int] = None,
               causal_visible_only: bool = False) -> torch.Tensor:
    """[Hkv, total_q, topK] int32: per (query, head) a random set of distinct in-range blocks,
    about `fill` of the slots used, -1 in the other slots (scattered if pad_anywhere)."""
    total_q = sum(q_lens)
    q2k = torch.full((hkv, total_q, topk), -1, dtype=torch.int32)
    row = 0
    for b, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        nblk = -(-kl // BLOCK)
        for i in range(ql):
            last = nblk if not causal_visible_only else (i + kl - ql) // BLOCK + 1
            choices = [x for x in range(max(last, 0)) if x != skip_block]
            for h in range(hkv):
                n = min(len(choices), max(1, int(round(topk * fill))))
                if not choices:
                    continue
                perm = torch.randperm(len(choices), generator=generator)[:n]
                sel = torch.tensor([choices[p] for p in perm], dtype=torch.int32)
                slots = (torch.randperm(topk, generator=generator)[:n] if pad_anywhere
                         else torch.arange(n))
                q2k[h, row + i, slots] = sel
        row += ql
    return q2k


def dense_oracle(q, k, v, q2k, q_lens, k_lens, *, causal: bool, scale: float,
                 temperature: float = 1.0, page_table=None, seqused_k=None):
    """float64 O [total_q, Hq, D], LSE and LSE_T [total_q, Hq] from an explicit token mask.

    k, v dense [total_k, Hkv, D] or paged [pages, Hkv, 128, D] (then page_table [B, P] and
    seqused_k [B] give the keys)."""
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64)
    lse_t = lse.clone()
    q0 = 0
    k0 = 0
    for b, (ql, kl_rows) in enumerate(zip(q_lens, k_lens)):
        if page_table is None:
            kl = kl_rows
            kb = k[k0:k0 + kl].double()
            vb = v[k0:k0 + kl].double()
        else:
            kl = int(seqused_k[b])
            pages = [int(p) for p in page_table[b]]
            kb = torch.cat([k[p].double().transpose(0, 1) for p in pages], 0)[:kl]
            vb = torch.cat([v[p].double().transpose(0, 1) for p in pages], 0)[:kl]
        j = torch.arange(kl)
        for i in range(ql):
            for h in range(hkv):
                sel = {int(x) for x in q2k[h, q0 + i] if x >= 0}
                vis = torch.isin(j // BLOCK, torch.tensor(sorted(sel), dtype=torch.int64))
                if causal:
                    vis &= j <= i + kl - ql
                if not vis.any():
                    continue
                for hh in range(h * g, (h + 1) * g):
                    s = (kb[vis, h] @ q[q0 + i, hh].double()) * scale
                    p = torch.softmax(s, 0)
                    out[q0 + i, hh] = p @ vb[vis, h]
                    lse[q0 + i, hh] = torch.logsumexp(s, 0)
                    lse_t[q0 + i, hh] = torch.logsumexp(s / temperature, 0)
        q0 += ql
        k0 += kl_rows
    return out, lse, lse_t


def to_paged(k: torch.Tensor, v: torch.Tensor, k_lens: List[int], *, extra_pages: int = 3,
             generator: Optional[torch.Generator] = None):
    """Scatter dense [total_k, Hkv, D] K/V into shuffled HND pages [pages, Hkv, 128, D]; returns
    (k_pages, v_pages, page_table [B, max_pages] int32, seqused_k [B] int32). Unused page slots
    and the spare pages hold random data, never zeros."""
    hkv, d = k.shape[1], k.shape[2]
    pages_b = [-(-n // BLOCK) for n in k_lens]
    n_pages = sum(pages_b) + extra_pages
    perm = torch.randperm(n_pages, generator=generator)
    kp = torch.randn(n_pages, hkv, BLOCK, d, generator=generator).to(k.dtype)
    vp = torch.randn(n_pages, hkv, BLOCK, d, generator=generator).to(v.dtype)
    table = torch.full((len(k_lens), max(pages_b) + 1), n_pages - 1, dtype=torch.int32)
    used = 0
    t0 = 0
    for b, n in enumerate(k_lens):
        for beta in range(pages_b[b]):
            p = int(perm[used])
            used += 1
            table[b, beta] = p
            lo, hi = t0 + beta * BLOCK, min(t0 + n, t0 + (beta + 1) * BLOCK)
            kp[p, :, : hi - lo] = k[lo:hi].transpose(0, 1)
            vp[p, :, : hi - lo] = v[lo:hi].transpose(0, 1)
        t0 += n
    return kp, vp, table, torch.tensor(k_lens, dtype=torch.int32)


def assert_same_attention(out_a, lse_a, out_b, lse_b) -> None:
    """Two runs of one call gave the same bits: O equal, the LSE equal where finite and -inf
    at the same places (an empty row's LSE)."""
    assert torch.equal(out_a, out_b)
    assert torch.equal(lse_a.isneginf(), lse_b.isneginf())
    assert torch.equal(lse_a[lse_a.isfinite()], lse_b[lse_b.isfinite()])


def nan_tensor(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A bf16 or e4m3 tensor whose every element is NaN, filled as bit patterns on the device
    (multi-GB pools are cheap): any read of it that should not happen turns an output into
    NaN."""
    bits = {torch.float8_e4m3fn: (torch.uint8, 0x7F), torch.bfloat16: (torch.int16, 0x7FC0)}
    int_dtype, nan = bits[dtype]
    return torch.full(shape, nan, dtype=int_dtype, device=device).view(dtype)


def compiled_variant_with(op: str):
    """The msa package of the built variant the GPU tests run against (MSA_TEST_PACKAGE_DIR),
    asserting its compiled op `op` is present; skips without a variant or a CUDA device."""
    import os

    import pytest
    if not os.environ.get("MSA_TEST_PACKAGE_DIR"):
        pytest.skip("set MSA_TEST_PACKAGE_DIR to a built variant (build/<variant>)")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import msa
    from msa._native import compiled_ops
    assert compiled_ops.missing_reason(op) is None, compiled_ops.missing_reason(op)
    return msa


# Native tiers a GPU test can run a kernel family on: the Hopper kernels (what SM90 serves) and
# the portable tier (docs/design-portable.md), forced on any GPU >= 8.0.
TIERS = ("hopper", "portable")


def use_tier(tier: str, monkeypatch) -> str:
    """Make the rest of the test dispatch to `tier` and return the _backend family it reports:
    "portable" forces MSA_NATIVE_TIER=portable and opens the gate of its not yet validated
    kernels (MSA_UNVALIDATED_KERNELS=1)."""
    if tier == "portable":
        monkeypatch.setenv("MSA_NATIVE_TIER", "portable")
        monkeypatch.setenv("MSA_UNVALIDATED_KERNELS", "1")
        return "portable"
    return "sm90"


def native_families() -> tuple:
    """The _backend families a native call may report in the running test: the portable tier
    under use_tier("portable"), else the Hopper / SM100 families."""
    import os
    if os.environ.get("MSA_NATIVE_TIER") == "portable":
        return ("portable",)
    return ("sm90", "sm100")
