"""FP4 decode helpers and the FP4 indexer block-score reference (contract §1.3, §1.5, §1.6).

Shared by the NVFP4 quantizer, the NVFP4-K/V attention entry point and the FP4 indexer:

* E2M1 (FP4) element codes: 1 sign bit, 2 exponent bits, 1 mantissa bit. The 16 codes decode
  to +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; code c >= 8 is the negative of code c - 8. Two codes share a
  byte, the even element in the low nibble.
* Block scales: E4M3 bytes (NVFP4, one per 16 elements) or E8M0 bytes (MXFP4, one per 32
  elements, value 2**(byte - 127), 0xFF = NaN).
* The cuBLAS "128x4" tiled scale layout: a logical [rows, cols] scale matrix is cut into
  128-row x 4-column tiles of 512 bytes; inside a tile, row r and column c live at
  (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4.

Everything here is plain PyTorch and runs on any device.
"""

from __future__ import annotations

from typing import Optional

import torch

PAGE_SIZE = 128          # keys per KV page (FP4 indexer) and per attention block
HEAD_DIM = 128           # logical head dimension
PACKED_HEAD_BYTES = 64   # HEAD_DIM FP4 codes, two per byte
SCALE_TILE_ROWS = 128    # the 128x4 tiled scale layout
SCALE_TILE_COLS = 4
SCALE_TILE_BYTES = SCALE_TILE_ROWS * SCALE_TILE_COLS

E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Decoded value of every 4-bit E2M1 code (index = code).
_E2M1_CODE_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_lut(device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[16] decoded E2M1 values indexed by code."""
    return torch.tensor(_E2M1_CODE_VALUES, dtype=dtype, device=device)


def round_up(x: int, multiple: int) -> int:
    return -(-int(x) // multiple) * multiple


def ceil_div(x: int, y: int) -> int:
    return -(-int(x) // int(y))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same storage viewed as uint8 (packed FP4 in int8 / float4_e2m1fn_x2, or FP8 scales)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Element codes
# ---------------------------------------------------------------------------------------------

def unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode packed FP4 [..., n] bytes to [..., 2n] values: element 2i is the low nibble of
    byte i, element 2i+1 its high nibble."""
    lut = e2m1_lut(packed.device, dtype)
    byte = torch.arange(256, device=packed.device)
    pair_lut = torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)   # [256, 2]
    return pair_lut[as_bytes(packed).to(torch.int64)].flatten(-2)


def e2m1_codes_from_scaled(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to the nearest E2M1 code (ties to the even code), saturating
    at +-6. Returns uint8 codes in [0, 16).

    Between two neighbouring magnitudes the tie goes to the one with an even code (an even
    mantissa bit), e.g. 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    """
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    # One step per midpoint between consecutive magnitudes; a tie steps up only when the upper
    # neighbour's code is even.
    for midpoint, tie_up in ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                             (2.5, False), (3.5, True), (5.0, False)):
        code += (a >= midpoint) if tie_up else (a > midpoint)
    negative = (x < 0) & (code > 0)   # keep zero as +0 so quantization is deterministic
    return code + negative.to(torch.uint8) * 8


def pack_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] uint8, the even element in the low nibble."""
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Scale bytes
# ---------------------------------------------------------------------------------------------

def decode_e4m3_bytes(raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3 (float8_e4m3fn) bytes -> values (0x7F / 0xFF decode to NaN)."""
    return as_bytes(raw).contiguous().view(torch.float8_e4m3fn).to(dtype)


def decode_e8m0_bytes(raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 (float8_e8m0fnu) bytes -> 2**(byte - 127); 0xFF decodes to NaN."""
    b = as_bytes(raw).to(torch.float64)
    out = torch.exp2(b - 127.0)
    return torch.where(b == 255.0, torch.full_like(out, float("nan")), out).to(dtype)


def decode_scale_bytes(raw: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32
                       ) -> torch.Tensor:
    """Decode block-scale bytes of format "nvfp4" (E4M3) or "mxfp4" (E8M0)."""
    if fmt == "nvfp4":
        return decode_e4m3_bytes(raw, dtype)
    if fmt == "mxfp4":
        return decode_e8m0_bytes(raw, dtype)
    raise ValueError(f"fmt: expected 'nvfp4' or 'mxfp4', got {fmt!r}")


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, block: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [..., D/2] FP4 bytes and decoded scales [..., D/block] -> values [..., D]."""
    values = unpack_e2m1(packed, dtype)
    return values * scales.to(dtype).repeat_interleave(block, dim=-1)[..., :values.shape[-1]]


# ---------------------------------------------------------------------------------------------
# 128x4 tiled scale layout
# ---------------------------------------------------------------------------------------------

def scale_128x4_padded_shape(rows: int, cols: int) -> tuple:
    """(rows, cols) rounded up to whole 128 x 4 tiles."""
    return round_up(rows, SCALE_TILE_ROWS), round_up(cols, SCALE_TILE_COLS)


def scale_128x4_offsets(rows: int, cols: int, device=None) -> torch.Tensor:
    """int64 [rows, cols]: byte offset of logical scale (row, col) in the tiled buffer,
    (row//128 * tiles_n + col//4) * 512 + (row%32) * 16 + ((row%128)//32) * 4 + col%4 with
    tiles_n = ceil(cols / 4)."""
    tiles_n = ceil_div(cols, SCALE_TILE_COLS)
    r = torch.arange(rows, dtype=torch.int64, device=device).view(-1, 1)
    c = torch.arange(cols, dtype=torch.int64, device=device).view(1, -1)
    tile = (r // SCALE_TILE_ROWS) * tiles_n + c // SCALE_TILE_COLS
    return tile * SCALE_TILE_BYTES + (r % 32) * 16 + ((r % SCALE_TILE_ROWS) // 32) * 4 + c % 4


def swizzle_scales_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Logical [rows, cols] scales -> tiled buffer [round_up(rows,128), round_up(cols,4)] of the
    same dtype; padding bytes are 0. The 2-D shape is only a view of the flat tiled bytes."""
    rows, cols = scale.shape
    prow, pcol = scale_128x4_padded_shape(rows, cols)
    raw = as_bytes(scale.contiguous())
    flat = torch.zeros(prow * pcol, dtype=torch.uint8, device=scale.device)
    flat[scale_128x4_offsets(rows, cols, scale.device).reshape(-1)] = raw.reshape(-1)
    flat = flat.view(prow, pcol)
    return flat if scale.dtype == torch.uint8 else flat.view(scale.dtype)


def unswizzle_scales_128x4(tiled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Tiled scale buffer (any shape, >= the padded size in bytes) -> logical [rows, cols]
    uint8 bytes."""
    flat = as_bytes(tiled.contiguous()).reshape(-1)
    return flat[scale_128x4_offsets(rows, cols, tiled.device).reshape(-1)].view(rows, cols)


def dequantize_nvfp4_rows(packed: torch.Tensor, scale_128x4: torch.Tensor,
                          global_scale: Optional[torch.Tensor],
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 with tiled scales: packed [..., D/2] -> [..., D] in `dtype`.

    Logical scale row r is the r-th row of `packed` flattened over its leading dimensions
    (t*Hkv + h for dense K/V, (p*Hkv + h)*128 + s for paged), column j covers elements
    [16j, 16j+16). x = e2m1 * scale (* global_scale[0] when given).
    """
    d = packed.shape[-1] * 2
    rows = packed.numel() // packed.shape[-1]
    scales = decode_e4m3_bytes(unswizzle_scales_128x4(scale_128x4, rows, d // 16), dtype)
    x = dequantize_fp4(packed.reshape(rows, -1), scales, 16, dtype)
    if global_scale is not None:
        x = x * global_scale.reshape(-1)[0].to(dtype)
    return x.reshape(*packed.shape[:-1], d)


# ---------------------------------------------------------------------------------------------
# FP4 indexer: per-page max of raw q.k
# ---------------------------------------------------------------------------------------------

def fp4_block_scores_reference(q_fp4: torch.Tensor, k_fp4: torch.Tensor, q_scale: torch.Tensor,
                               k_scale: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, cu_page_offsets: torch.Tensor, *,
                               kv_indices: torch.Tensor, fmt: str, block: int, num_tiles: int,
                               causal: bool, qo_offset: Optional[torch.Tensor] = None,
                               compute_dtype: torch.dtype = torch.float32,
                               q_chunk: int = 1024) -> torch.Tensor:
    """scores [Hq, num_tiles, total_q] fp32 (contract §1.5), tiled over (request, page, query
    chunk); memory stays at one page times one query chunk.

    q_fp4 [total_q, Hq, 64] and k_fp4 [pages, Hk, 128, 64] packed FP4; q_scale [total_q, Hq, G]
    and k_scale [pages, Hk, 128, G] are the public-layout scale bytes of format `fmt`
    (G = 128 / block). Page t of request b is k_fp4[kv_indices[cu_page_offsets[b] + t]] and holds
    its keys [128t, 128t + 128). Query head hq reads key head hq // (Hq / Hk).
    scores[hq, t, q] = max over visible keys of dequant(q) . dequant(k) (no softmax or global
    scale); a key j is visible when j < k_len and, if causal, j <= q_local + offset with
    offset = qo_offset[b] (default k_len - q_len). -inf where no key is visible.
    """
    total_q, hq, _ = q_fp4.shape
    pages, hk = k_fp4.shape[0], k_fp4.shape[1]
    group = hq // hk
    device = q_fp4.device
    cu_q = cu_seqlens_q.to("cpu", torch.int64)
    cu_k = cu_seqlens_k.to("cpu", torch.int64)
    cu_p = cu_page_offsets.to("cpu", torch.int64)
    page_ids = kv_indices.to("cpu", torch.int64)
    offsets = None if qo_offset is None else qo_offset.to("cpu", torch.int64)
    scores = torch.full((hq, num_tiles, total_q), float("-inf"), dtype=torch.float32,
                        device=device)
    for b in range(cu_q.numel() - 1):
        q0, q_len = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        k_len = int(cu_k[b + 1] - cu_k[b])
        n_tiles = ceil_div(max(k_len, 0), PAGE_SIZE)
        if q_len <= 0 or n_tiles == 0:
            continue
        if n_tiles > num_tiles:
            raise ValueError(f"max_seqlen_k: request {b} has {k_len} keys, more than the "
                             f"{num_tiles * PAGE_SIZE} that max_seqlen_k allows")
        first_page, page_count = int(cu_p[b]), int(cu_p[b + 1] - cu_p[b])
        if page_count < n_tiles or first_page + n_tiles > page_ids.numel():
            raise ValueError(f"cu_page_offsets: request {b} lists {page_count} pages but its "
                             f"{k_len} keys need {n_tiles}")
        offset = (k_len - q_len) if offsets is None else int(offsets[b])
        for c0 in range(0, q_len, q_chunk):
            rows = slice(q0 + c0, q0 + min(c0 + q_chunk, q_len))
            q_local = torch.arange(c0, min(c0 + q_chunk, q_len), device=device)
            q_scales = decode_scale_bytes(q_scale[rows], fmt, compute_dtype)
            qv = dequantize_fp4(q_fp4[rows], q_scales, block, compute_dtype)   # [n, Hq, D]
            qv = qv.view(qv.shape[0], hk, group, -1)
            for t in range(n_tiles):
                page = int(page_ids[first_page + t])
                if not 0 <= page < pages:
                    raise ValueError(f"kv_indices: entry {first_page + t} = {page} is out of "
                                     f"range for {pages} pages")
                n_keys = min(PAGE_SIZE, k_len - t * PAGE_SIZE)
                k_scales = decode_scale_bytes(k_scale[page, :, :n_keys], fmt, compute_dtype)
                kv = dequantize_fp4(k_fp4[page, :, :n_keys], k_scales, block, compute_dtype)
                logits = torch.einsum("nhgd,hkd->hgnk", qv, kv)                 # [Hk, G, n, keys]
                if causal:
                    key_pos = t * PAGE_SIZE + torch.arange(n_keys, device=device)
                    hidden = key_pos.view(1, -1) > (q_local + offset).view(-1, 1)
                    logits = logits.masked_fill(hidden, float("-inf"))
                best = logits.amax(dim=-1).reshape(hq, -1)                      # [Hq, n]
                scores[:, t, rows] = best.to(torch.float32)
    return scores
