"""NVFP4 quantization helpers (contract §1.6), written in plain PyTorch.

NVFP4 stores a tensor as E2M1 codes (two per byte, the even element in the low nibble), one E4M3
scale per 16 consecutive elements of the last dimension, and one fp32 global scale:
``x ~= e2m1 * scale * global``. The scales are stored in the cuBLAS 128x4 tiled layout over the
logical scale matrix [rows, D/16], where rows are the tensor's leading dimensions flattened
(``t*Hkv + h`` for dense K/V, ``(p*Hkv + h)*128 + s`` for paged K/V), so a quantized K/V tensor
feeds :func:`msa.sparse_atten_nvfp4_kv_func` directly.

Upstream quantizes through Transformer Engine and raises without it; this package quantizes
itself (the same recipe: global scale amax/(448*6), block scales amax_block/6 relative to it in
E4M3, round-to-nearest-even onto the E2M1 grid), so it needs no extra dependency and runs on any
device.

Non-finite input, per 16-element block: E2M1 has no Inf or NaN and a block shares one scale, so
a block holding any NaN or +-Inf element is stored with the E4M3 NaN scale byte (0x7F) and
zero codes: all 16 of its elements dequantize to NaN (an Inf becomes NaN). The global scale and
every other block are computed from the finite elements only, so one bad element costs its own
block and nothing else (a tensor with no finite non-zero element keeps global scale 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

import torch

from ._validation import check_positive_int, check_tensor
from .reference.fp4 import (E2M1_MAX, E4M3_MAX, decode_e4m3_bytes, dequantize_nvfp4_rows,
                            e2m1_codes_from_scaled, pack_e2m1_codes, scale_128x4_padded_shape,
                            swizzle_scales_128x4)

NVFP4_BLOCK = 16
_INPUT_DTYPES = (torch.bfloat16, torch.float16)
E4M3_NAN_BYTE = 0x7F


@dataclasses.dataclass(frozen=True)
class Nvfp4QuantizedTensor:
    """An NVFP4 tensor.

    data: uint8 [*original_shape[:-1], D/2], two E2M1 codes per byte (even element low nibble).
    scale_128x4: uint8 [round_up(rows, 128), round_up(D/16, 4)], the E4M3 block scales in the
      128x4 tiled layout (the 2-D shape is a view of the flat tiled bytes; padding is 0).
    global_scale: fp32 [1]; x = e2m1 * scale * global_scale.
    logical_scale_shape: (rows, D/16) with rows = prod(original_shape[:-1]).
    original_shape: shape of the tensor that was quantized.
    """
    data: torch.Tensor
    scale_128x4: torch.Tensor
    global_scale: torch.Tensor
    logical_scale_shape: Tuple[int, int]
    original_shape: Tuple[int, ...]


def nvfp4_global_scale_from_amax(amax) -> torch.Tensor:
    """The NVFP4 global (decode) scale for a tensor whose max |x| is `amax`: amax / (448 * 6),
    as an fp32 tensor (a Python number gives a 0-d tensor; a tensor keeps its shape/device).
    448 is the E4M3 maximum and 6 the E2M1 maximum, so the largest block scale fits E4M3.
    A NaN / Inf amax gives a NaN / Inf scale (quantize_bf16_to_nvfp4_128x4 takes the amax of
    the finite elements only)."""
    if isinstance(amax, torch.Tensor):
        if amax.dtype == torch.bool or amax.is_complex():
            raise TypeError(f"amax: expected a real tensor, got dtype {amax.dtype}")
    elif isinstance(amax, bool) or not isinstance(amax, (int, float)):
        raise TypeError(f"amax: expected a number or a tensor, got {type(amax).__name__}")
    else:
        amax = torch.tensor(float(amax))
    return amax.to(torch.float32) / (E4M3_MAX * E2M1_MAX)


def swizzle_nvfp4_scale_to_128x4(scale: torch.Tensor, *, rows: int, cols: int) -> torch.Tensor:
    """Place logical block scales [rows, cols] (uint8 or float8_e4m3fn; any tensor with
    rows*cols elements, read row-major) into the 128x4 tiled layout.

    Returns [round_up(rows, 128), round_up(cols, 4)] of the input dtype; logical (r, c) sits at
    flat byte (r//128 * ceil(cols/4) + c//4) * 512 + (r%32) * 16 + ((r%128)//32) * 4 + c%4 and
    the padding is 0.
    """
    check_tensor("scale", scale, dtypes=(torch.uint8, torch.float8_e4m3fn))
    check_positive_int("rows", rows, minimum=1)
    check_positive_int("cols", cols, minimum=1)
    if scale.numel() != rows * cols:
        raise ValueError(f"scale: has {scale.numel()} elements, expected rows*cols = "
                         f"{rows}*{cols} = {rows * cols}")
    return swizzle_scales_128x4(scale.reshape(rows, cols))


def _check_quantize_input(name: str, x) -> Tuple[int, int]:
    check_tensor(name, x, dtypes=_INPUT_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"{name}: expected a tensor of rank >= 2, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    if d == 0 or d % NVFP4_BLOCK != 0:
        raise ValueError(f"{name}: the last dimension ({d}) must be a positive multiple of "
                         f"{NVFP4_BLOCK}")
    if rows == 0 or rows % NVFP4_BLOCK != 0:
        raise ValueError(f"{name}: the row count prod(shape[:-1]) = {rows} must be a positive "
                         f"multiple of {NVFP4_BLOCK}")
    return rows, d


def _quantize(name: str, x: torch.Tensor) -> Nvfp4QuantizedTensor:
    rows, d = _check_quantize_input(name, x)
    xf = x.reshape(rows, d // NVFP4_BLOCK, NVFP4_BLOCK).to(torch.float32)
    # Non-finite elements poison their own block only (module docstring); no host sync.
    finite = torch.isfinite(xf)
    block_finite = finite.all(dim=-1)                                   # [rows, D/16]
    magnitude = torch.where(finite, xf.abs(), torch.zeros_like(xf))
    amax = magnitude.amax()
    # A tensor without a finite non-zero element keeps global scale 1 (block scales are 0).
    global_scale = torch.where(amax > 0, nvfp4_global_scale_from_amax(amax),
                               torch.ones_like(amax))
    # Block decode scale amax_b / 6, stored relative to the global scale; it is <= 448 by
    # construction (clamp guards fp32 rounding).
    block_amax = magnitude.amax(dim=-1)
    scale_f32 = (block_amax / E2M1_MAX / global_scale).clamp(max=E4M3_MAX)
    scale_bytes = torch.where(block_finite, scale_f32.to(torch.float8_e4m3fn).view(torch.uint8),
                              torch.full_like(block_finite, E4M3_NAN_BYTE, dtype=torch.uint8))
    # Encode with the scale as stored (rounded), so decode(encode(x)) is the nearest grid point.
    decode_scale = decode_e4m3_bytes(scale_bytes) * global_scale
    usable = block_finite & (decode_scale > 0)
    safe = torch.where(usable, decode_scale, torch.ones_like(decode_scale))
    scaled = torch.where(usable.unsqueeze(-1), xf / safe.unsqueeze(-1), torch.zeros_like(xf))
    codes = e2m1_codes_from_scaled(scaled).reshape(rows, d)
    data = pack_e2m1_codes(codes).reshape(*x.shape[:-1], d // 2)
    return Nvfp4QuantizedTensor(
        data=data, scale_128x4=swizzle_scales_128x4(scale_bytes),
        global_scale=global_scale.reshape(1), logical_scale_shape=(rows, d // NVFP4_BLOCK),
        original_shape=tuple(x.shape))


def quantize_bf16_to_nvfp4_128x4(x: torch.Tensor) -> Nvfp4QuantizedTensor:
    """Quantize a bf16/fp16 tensor of rank >= 2 to NVFP4 with 128x4 tiled scales.

    x: [..., D] with D and prod(shape[:-1]) multiples of 16 (any device; no Transformer Engine).
    global = amax(|x|) / (448*6) over the finite elements (1 when none is non-zero); per
    16-element block, scale = e4m3(amax_block / 6 / global); codes = round-to-nearest-even of
    x / (scale*global) onto {0, .5, 1, 1.5, 2, 3, 4, 6} with sign, saturating at 6. A block
    with a NaN or +-Inf element gets the NaN scale byte 0x7F and zero codes (it dequantizes to
    NaN); the other blocks are unaffected. See :class:`Nvfp4QuantizedTensor` for the output
    layout.
    """
    return _quantize("x", x)


def quantize_kv_bf16_to_nvfp4_128x4(k: torch.Tensor, v: torch.Tensor
                                    ) -> Tuple[Nvfp4QuantizedTensor, Nvfp4QuantizedTensor]:
    """Quantize K and V separately (each with its own global scale); returns (k_q, v_q). Dense
    [total_k, Hkv, 128] or paged [pages, Hkv, 128, 128] inputs give exactly the tensors
    :func:`msa.sparse_atten_nvfp4_kv_func` takes (data, scale_128x4, global_scale)."""
    return _quantize("k", k), _quantize("v", v)


def dequantize_nvfp4_128x4_to_bf16(qx: Nvfp4QuantizedTensor, *,
                                   include_global_scale: bool = True) -> torch.Tensor:
    """The reference inverse of :func:`quantize_bf16_to_nvfp4_128x4`.

    qx.data [..., D/2] uint8 (two E2M1 values per byte, even element low), qx.scale_128x4 the
    swizzled E4M3 block scales of the logical [rows, D/16] grid, qx.global_scale fp32 [1].
    Returns a bf16 tensor of qx.original_shape [..., D] with x = e2m1 * scale
    (* global_scale when include_global_scale), computed in fp32 and rounded once to bf16."""
    if not isinstance(qx, Nvfp4QuantizedTensor):
        raise TypeError(f"qx: expected an Nvfp4QuantizedTensor, got {type(qx).__name__}")
    check_tensor("qx.data", qx.data, dtypes=(torch.uint8,))
    check_tensor("qx.scale_128x4", qx.scale_128x4, dtypes=(torch.uint8, torch.float8_e4m3fn))
    shape = tuple(qx.original_shape)
    rows, cols = qx.logical_scale_shape
    if len(shape) < 2 or (rows, cols) != (math.prod(shape[:-1]), shape[-1] // NVFP4_BLOCK):
        raise ValueError(f"qx.logical_scale_shape: {qx.logical_scale_shape} does not match "
                         f"original_shape {shape}")
    if tuple(qx.data.shape) != (*shape[:-1], shape[-1] // 2):
        raise ValueError(f"qx.data: shape {tuple(qx.data.shape)} does not match original_shape "
                         f"{shape} (expected the last dimension halved)")
    prow, pcol = scale_128x4_padded_shape(rows, cols)
    if qx.scale_128x4.numel() < prow * pcol:
        raise ValueError(f"qx.scale_128x4: has {qx.scale_128x4.numel()} bytes, needs "
                         f"{prow}x{pcol} for {rows} rows")
    global_scale = None
    if include_global_scale:
        check_tensor("qx.global_scale", qx.global_scale, dtypes=(torch.float32,))
        if qx.global_scale.numel() < 1:
            raise ValueError("qx.global_scale: must hold at least one element")
        global_scale = qx.global_scale
    x = dequantize_nvfp4_rows(qx.data, qx.scale_128x4, global_scale)
    return x.to(torch.bfloat16)
