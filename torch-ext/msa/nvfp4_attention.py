"""``sparse_atten_nvfp4_kv_func``: block-sparse attention over an NVFP4 K/V cache (contract §1.3).

Everything but the K/V storage is :func:`msa.sparse_atten_func`: same CSR selection, visibility,
math, split/combine and return values. K/V hold packed E2M1 codes with E4M3 block scales in the
128x4 tiled layout and optional fp32 global scales; the K global scale acts on the logits, the V
global scale is applied once, in the combine.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._validation import check_same_device, check_tensor
from .interface import check_sparse_atten_args, run_sparse_attention
from .reference.fp4 import PACKED_HEAD_BYTES, dequantize_nvfp4_rows, scale_128x4_padded_shape

SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn)   # raw E4M3 bytes, or the same bytes typed


def sparse_atten_nvfp4_kv_func(q, k, v, k_scale_128x4, v_scale_128x4, k_global_scale,
                               v_global_scale, k2q_row_ptr, k2q_q_indices, topK, *, cu_seqlens_q,
                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, blk_kv=128, causal=False,
                               softmax_scale=None, lse_temperature_scale=1.0,
                               return_temperature_lse=False, partial_dtype=torch.bfloat16,
                               return_softmax_lse=False, page_table=None, seqused_k=None,
                               schedule=None, check_input_valid=False):
    """Block-sparse varlen attention with NVFP4 K/V (contract §1.3; otherwise as §1.2).

    Shapes: q [total_q, Hq, 128] bf16 or float8_e4m3fn. k, v uint8, dense [total_k, Hkv, 64] or
    paged [pages, Hkv, 128, 64] (with page_table [B, max_pages] int32 and optional seqused_k
    [B] int32); each byte holds two E2M1 codes, the even element in the low nibble.
    k_scale_128x4 / v_scale_128x4: uint8 (or float8_e4m3fn) E4M3 scales, one per 16 elements
    of D (8 columns), in the 128x4 tiled layout over logical rows t*Hkv + h (dense) or
    (p*Hkv + h)*128 + s (paged); at least round_up(rows, 128) * 8 bytes, contiguous.
    k_global_scale / v_global_scale: None or fp32 tensors with >= 1 element (element 0 is used).
    The selection (k2q_row_ptr, k2q_q_indices, topK), lengths, causal rule, temperature LSE,
    partial_dtype, schedule, check_input_valid and return values are those of
    :func:`msa.sparse_atten_func`; a block scale byte that decodes to NaN (0x7F / 0xFF, see
    :func:`msa.quantize_bf16_to_nvfp4_128x4`) makes the rows that read it NaN.

    Dequantization: K = e2m1 * scale * k_global; V = e2m1 * scale, with v_global multiplying
    the combined output. No Transformer Engine or other dependency is needed.

    Returns O [total_q, Hq, 128] bf16; with return_softmax_lse (O, LSE [total_q, Hq] fp32);
    with return_temperature_lse as well (O, LSE, LSE_T).
    """
    call = check_sparse_atten_args(
        q, k, v, k2q_row_ptr, k2q_q_indices, topK, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        blk_kv=blk_kv, causal=causal, softmax_scale=softmax_scale,
        lse_temperature_scale=lse_temperature_scale,
        return_temperature_lse=return_temperature_lse, partial_dtype=partial_dtype,
        return_softmax_lse=return_softmax_lse, page_table=page_table, seqused_k=seqused_k,
        schedule=schedule, usable_SM_count=-1, qk_dtype=None, pv_dtype=None,
        kv_dtypes=(torch.uint8,), kv_last_dim=PACKED_HEAD_BYTES,
        check_input_valid=check_input_valid)
    rows = k.numel() // PACKED_HEAD_BYTES   # total_k*Hkv (dense) or pages*Hkv*128 (paged)
    _check_scale_128x4("k_scale_128x4", k_scale_128x4, rows)
    _check_scale_128x4("v_scale_128x4", v_scale_128x4, rows)
    _check_global_scale("k_global_scale", k_global_scale)
    _check_global_scale("v_global_scale", v_global_scale)
    check_same_device(q=q, k_scale_128x4=k_scale_128x4, v_scale_128x4=v_scale_128x4,
                      k_global_scale=k_global_scale, v_global_scale=v_global_scale)

    # The reference (and any backend that stages to bf16) dequantizes through these; native
    # kernels read the packed tensors and scales from the call object instead.
    call.k_dequant = lambda packed: dequantize_nvfp4_rows(packed, k_scale_128x4, k_global_scale)
    call.v_dequant = lambda packed: dequantize_nvfp4_rows(packed, v_scale_128x4, None)
    call.v_global_scale = v_global_scale
    call.k_scale_128x4 = k_scale_128x4
    call.v_scale_128x4 = v_scale_128x4
    call.k_global_scale = k_global_scale
    return run_sparse_attention(call)


def _check_scale_128x4(name: str, scale, rows: int) -> None:
    check_tensor(name, scale, dtypes=SCALE_DTYPES, contiguous=True)
    prow, pcol = scale_128x4_padded_shape(rows, PACKED_HEAD_BYTES * 2 // 16)
    if scale.numel() < prow * pcol:
        raise ValueError(f"{name}: has {scale.numel()} bytes; {rows} logical rows need at least "
                         f"round_up(rows, 128) x round_up(8, 4) = {prow} x {pcol} = "
                         f"{prow * pcol}")


def _check_global_scale(name: str, scale: Optional[torch.Tensor]) -> None:
    if scale is None:
        return
    check_tensor(name, scale, dtypes=(torch.float32,))
    if scale.numel() < 1:
        raise ValueError(f"{name}: must hold at least one element, got shape "
                         f"{list(scale.shape)}")
