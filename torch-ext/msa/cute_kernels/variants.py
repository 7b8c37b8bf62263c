"""Names of the precompiled CuTe-DSL kernel variants (pure Python: no cutlass import).

Shared by tools/compile_cute.py (which builds one TVM-FFI shared object per variant), the runtime
loader (msa._native.cute_runtime, which finds them by name in a manifest) and the JIT fallback.
Every dynamic size (tokens, pages, work items, batch) is a runtime value, so a variant is fixed
only by what changes the generated code: head group G, KV layout, element dtypes.
"""

from __future__ import annotations

import dataclasses
from typing import List

HEAD_DIM = 128
KV_BLOCK = 128
QHEAD_PER_KV = (1, 2, 4, 8, 16)
PARTIAL_DTYPES = ("float32", "bfloat16", "float16", "e4m3")   # contract §1.2, all native
# Partial dtypes of the wgmma kernel (every dtype mode); fp32 partials use the warp-MMA kernel
# and exist for bf16 Q/K/V only.
WGMMA_PARTIAL_DTYPES = ("bfloat16", "float16", "e4m3")
INPUT_DTYPES = ("bfloat16",)                 # Q/K/V element types compiled so far
# FP8 attention modes (wgmma kernel: bf16, fp16 or e4m3 partials; no scale factors, contract
# §1.2):
#   bf16_kv_e4m3  bf16 q, e4m3 k/v (staged to bf16 in shared memory), bf16 P.V
#   e4m3_pv_bf16  e4m3 q/k/v, e4m3 QK^T, V staged to bf16, bf16 P.V (pv_dtype=bf16)
#   e4m3          e4m3 q/k/v, e4m3 QK^T, P rounded to e4m3 in registers, e4m3 P.V
#                 (pv_dtype=e4m3)
# They are compiled and shipped, but msa._native.sparse_prefill_sm90 serves a mode only once it
# is listed in its VALIDATED_FP8_MODES (proven on an H200).
FP8_MODES = ("bf16_kv_e4m3", "e4m3_pv_bf16", "e4m3")
# The warp-specialized sparse attention form (AttentionVariant.form "ws"): head groups whose
# query rows fill whole 1 KB swizzle atoms, bf16 or all-e4m3 Q/K/V.
WS_GROUPS = (8, 16)
WS_DTYPES = ("bfloat16", "e4m3")
SPARSE_WS_FORMS = ("ws", "ws3w")
INDEX_HEADS = (1, 2, 4, 8)                   # index query heads H of block_max_scores
INDEX_DTYPES = ("bfloat16", "e4m3")          # q_idx / k_idx element types (same for both)
FMHA_DTYPES = ("bfloat16", "e4m3")          # dense FMHA q/k/v element types (output O)


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    """One compiled attention kernel: S = QK^T, single-block softmax, P.V per work item.
    dtype is "bfloat16" (bf16 q/k/v) or one of FP8_MODES (which also fixes pv_dtype)."""
    qhead_per_kv: int
    paged: bool
    partial_dtype: str = "float32"
    dtype: str = "bfloat16"
    # "" (the wgmma / warp-MMA kernels), "ws" (cute_kernels.sparse_prefill_sm90_ws: TMA Q
    # gathers and partial stores, warp-specialized; WS_GROUPS x WS_DTYPES, wgmma partials) or
    # "ws3w" (the same with three consumer warpgroups)
    form: str = ""

    @property
    def name(self) -> str:
        layout = "paged" if self.paged else "dense"
        suffix = f"_{self.form}" if self.form else ""
        return (f"sparse_prefill_sm90_{self.dtype}_g{self.qhead_per_kv}_{layout}"
                f"_p{_short(self.partial_dtype)}{suffix}")


@dataclasses.dataclass(frozen=True)
class CombineVariant:
    """One compiled combine kernel: log-sum-exp merge of the per-block partial outputs."""
    partial_dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"sparse_combine_sm90_p{_short(self.partial_dtype)}"


@dataclasses.dataclass(frozen=True)
class BlockMaxScoreVariant:
    """One compiled indexer kernel: per (query, index head, 128-key tile) max of scale * q.k,
    H index heads against one shared index-key head (Hk = 1), dense or paged index keys."""
    num_heads: int
    paged: bool
    dtype: str = "bfloat16"
    decode: bool = False     # 1-16 query rows per request, K tiles split across CTAs

    @property
    def name(self) -> str:
        layout = "paged" if self.paged else "dense"
        suffix = "_decode" if self.decode else ""
        return f"block_max_score_sm90_{self.dtype}_h{self.num_heads}_{layout}{suffix}"


# Warp-specialized FMHA forms (the variant name's suffix) -> (q/k/v dtypes it is built for,
# cute_kernels.fmha_sm90_ws.FmhaSm90Ws options): the one table the kernel module, the build,
# the native dispatch (msa._native.fmha_sm90) and the benchmarks read. Which form serves a call
# is msa._native.fmha_sm90.served_ws_form's choice (bf16 wsup / wsu, e4m3 wsutps / wsuts),
# among the forms its VALIDATED_WS_FORMS lists. Earlier 3-stage, overlapped, tree-softmax,
# chained-item, wide-block and static-diagonal forms were measured slower or even and removed
# (docs/design-fmha.md).
#   ws      the base: TMA producer warp, two ping-pong consumer warpgroups
#   wsf     FlashAttention-3's intra-warpgroup order (O rescaled under S(j), the softmax of
#           block j under the own P(j-1) V(j-1))
#   wsu     `uniform`: static K/V stages and Q tile, so the wgmma descriptors stay in uniform
#           registers (serves bf16 non-causal and long calls)
#   wsut    wsu reading V transposed ahead of the kernel (the fmha_transpose_v_e4m3 CUDA op)
#           instead of transposing it in the producer warpgroup
#   wsup / wsutp    wsu / wsut on persistent CTAs (up to PERSISTENT_MAX_ITEMS work items)
#   wsuts / wsutps  wsut / wsutp with the softmax's row sums on the tensor core (serve e4m3)
FMHA_WS_FORMS = {
    "ws": (FMHA_DTYPES, {}),
    "wsf": (FMHA_DTYPES, dict(overlap=True)),
    "wsu": (FMHA_DTYPES, dict(uniform=True)),
    "wsut": (("e4m3",), dict(uniform=True, v_transposed=True)),
    "wsup": (("bfloat16",), dict(uniform=True, persistent=True)),
    "wsutp": (("e4m3",), dict(uniform=True, v_transposed=True, persistent=True)),
    "wsuts": (("e4m3",), dict(uniform=True, v_transposed=True, mma_row_sum=True)),
    "wsutps": (("e4m3",), dict(uniform=True, v_transposed=True, persistent=True,
                               mma_row_sum=True)),
}


def fmha_ws_forms(dtype: str) -> tuple:
    """The warp-specialized FMHA forms built for q/k/v `dtype` ("bfloat16" or "e4m3")."""
    return tuple(name for name, (dtypes, _) in FMHA_WS_FORMS.items() if dtype in dtypes)


def fmha_ws_forms_with(option: str) -> tuple:
    """The warp-specialized FMHA forms whose FmhaSm90Ws `option` is set (e.g. "v_transposed":
    the forms whose v argument is Vt, written ahead of the kernel)."""
    return tuple(name for name, (_, options) in FMHA_WS_FORMS.items() if options.get(option))


WS_FORMS = fmha_ws_forms("bfloat16")
WS_FP8_FORMS = fmha_ws_forms("e4m3")


@dataclasses.dataclass(frozen=True)
class FmhaVariant:
    """One compiled dense FMHA forward kernel (the native fmha_dense backend): any GQA group and
    causality at run time, dense or paged (page size 128) K/V."""
    paged: bool
    dtype: str = "bfloat16"
    max_score: bool = False      # also writes the max-score output (mode 1)
    # "plain" (cute_kernels.fmha_sm90), a warp-specialized form of cute_kernels.fmha_sm90_ws
    # (TMA producer warp, ping-pong consumer warpgroups; O only): WS_FORMS for bf16,
    # WS_FP8_FORMS for e4m3; or "split" (fmha_sm90.FmhaSm90Split: the plain loop over one of
    # num_splits key ranges, fp32 partial rows + LSE; O only)
    form: str = "plain"

    @property
    def name(self) -> str:
        suffix = "_maxscore" if self.max_score else ""
        if self.form != "plain":
            suffix += f"_{self.form}"
        return f"fmha_sm90_{self.dtype}_{'paged' if self.paged else 'dense'}{suffix}"


def _short(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype, dtype)


def shipped_variants() -> List[object]:
    """Every variant a build ships (tools/compile_cute.py compiles exactly this list)."""
    out: List[object] = []
    for dtype in INPUT_DTYPES:
        for paged in (False, True):
            for g in QHEAD_PER_KV:
                for partial in PARTIAL_DTYPES:
                    out.append(AttentionVariant(g, paged, partial, dtype))
    for mode in FP8_MODES:
        for paged in (False, True):
            for g in QHEAD_PER_KV:
                for partial in WGMMA_PARTIAL_DTYPES:
                    out.append(AttentionVariant(g, paged, partial, mode))
    for form in SPARSE_WS_FORMS:
        for dtype in WS_DTYPES:
            for paged in (False, True):
                for g in WS_GROUPS:
                    for partial in WGMMA_PARTIAL_DTYPES:
                        out.append(AttentionVariant(g, paged, partial, dtype, form=form))
    out.extend(CombineVariant(p) for p in PARTIAL_DTYPES)
    for dtype in INDEX_DTYPES:
        for paged in (False, True):
            out.extend(BlockMaxScoreVariant(h, paged, dtype) for h in INDEX_HEADS)
        # The decode indexer reads a paged index-K cache.
        out.extend(BlockMaxScoreVariant(h, True, dtype, decode=True) for h in INDEX_HEADS)
    for paged in (False, True):
        out.extend(FmhaVariant(paged, dtype) for dtype in FMHA_DTYPES)
        # The O + max-score output exists for bf16 only.
        out.append(FmhaVariant(paged, "bfloat16", max_score=True))
        # The warp-specialized forms (O only).
        out.extend(FmhaVariant(paged, "bfloat16", form=f) for f in WS_FORMS)
        out.extend(FmhaVariant(paged, "e4m3", form=f) for f in WS_FP8_FORMS)
        # Split-KV for decode-like plans (O only).
        out.extend(FmhaVariant(paged, dtype, form="split") for dtype in FMHA_DTYPES)
    return out


def by_name(name: str):
    for variant in shipped_variants():
        if variant.name == name:
            return variant
    raise KeyError(name)
