"""Native SM90 indexer block max-scores: the CuTe-DSL warpgroup-MMA kernel of
cute_kernels/block_max_score_sm90.py.

``run(call)`` takes a validated :class:`msa.indexer.BlockMaxScoreCall` and launches one kernel on
q_idx's device and current stream, with no host synchronization (capturable in a CUDA graph):
per (query, index head, 128-key tile) the max of ``scale * q.k`` over the causally visible keys,
-inf where none is, into a fresh ``[H, max_k_tiles, total_q]`` fp32 tensor. Every element is
written by the kernel (computed tiles, -inf tiles and rows no request owns alike).

Served: bf16 or e4m3 q_idx and k_idx (the same dtype), H in {1, 2, 4, 8} index heads against ONE
shared index-key head (Hk = 1, as in MSA), dense or paged (page size 128) keys, causal or not, any
qo_offset. Everything else (mixed dtypes, Hk > 1, fp32) falls back to the reference through
``supports``. Sizes: q_idx, k_idx and the output may hold 2^31 elements or more (64-bit row
offsets in the kernel); ``run`` raises NotImplementedError only for counts that must fit int32
(:func:`check_launch_limits`).

Gated like every kernel not yet proven on hardware: ``supports`` refuses a dtype outside
``VALIDATED_DTYPES`` (bf16 and e4m3 passed on the H200)
unless ``MSA_UNVALIDATED_KERNELS=1`` (tests/test_block_max_score_gpu.py sets it). Add a dtype only
after its test cases pass on an H200.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from .._validation import device_prefix_sums
from . import cute_runtime

KEY_TILE = 128
TILE_ROWS = 256                 # (query, head) rows per CTA; must match the kernel's TILE_M
SUPPORTED_HEADS = (1, 2, 4, 8)
# tests/test_block_max_score_gpu.py passed on the H200 (2026-11-30): 19 bf16 cases, dense + paged.
VALIDATED = True
# q_idx/k_idx dtypes proven on the H200: e4m3 passed its 12 cases
# (test_block_max_scores_e4m3_native_matches_float64) on 2026-11-30 (session 3).
VALIDATED_DTYPES = {torch.bfloat16, torch.float8_e4m3fn}
# The decode variants (paged keys, <= 64 rows per request, K tiles split across CTAs) passed
# test_block_max_scores_decode_native_matches_float64 (18 cases, bf16 + e4m3) on the H200
# (2026-11-30, session 3).
VALIDATED_DECODE = True
DECODE_ROWS = 64                # rows per request the decode variant holds (one warpgroup)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "e4m3"}
# Causal offsets are clamped to +-2^30: beyond that every key (or none) is visible anyway, and
# the kernel's position arithmetic (query + offset - key) stays far from int32 overflow.
_OFFSET_LIMIT = 2 ** 30
# Tests set this to fill the output with NaN before the launch (catches unwritten elements).
POISON_BUFFERS_FOR_TESTS = False


def variant_name(num_heads: int, paged: bool, dtype: torch.dtype = torch.bfloat16,
                 decode: bool = False) -> str:
    """Artifact name of a variant; must match cute_kernels.variants.BlockMaxScoreVariant."""
    layout = "paged" if paged else "dense"
    suffix = "_decode" if decode else ""
    return f"block_max_score_sm90_{_DTYPE_NAMES[dtype]}_h{num_heads}_{layout}{suffix}"


def use_decode_variant(call, device) -> bool:
    """Paged keys and at most DECODE_ROWS (query, head) rows per request (host bounds only, no
    sync), the decode variant validated (or MSA_UNVALIDATED_KERNELS=1) and shipped."""
    num_heads = call.q_idx.shape[1]
    if not call.paged or call.max_seqlen_q * num_heads > DECODE_ROWS:
        return False
    if _backend.unvalidated_reason("the sm90 decode indexer", VALIDATED_DECODE) is not None:
        return False
    name = variant_name(num_heads, True, call.q_idx.dtype, decode=True)
    return cute_runtime.unavailable_reason(name) is None


def decode_key_splits(batch: int, max_k_tiles: int, sm_count: int) -> int:
    """CTAs per request for the decode variant: about two waves over the SMs, at least two K
    tiles (one pipeline's worth) per CTA."""
    return max(1, min(-(-2 * sm_count // max(batch, 1)), -(-max_k_tiles // 2)))


def supports(*, q_dtype=None, k_dtype=None, paged=False, causal=True, num_heads=None,
             num_k_heads=None, **_ignored) -> Optional[str]:
    """None if the native kernel serves a call with these features, else the reason."""
    gate = _backend.unvalidated_reason("the sm90 block max-score kernel", VALIDATED)
    if gate is not None:
        return gate
    if q_dtype != k_dtype or q_dtype not in _DTYPE_NAMES:
        return (f"q_idx/k_idx dtypes {q_dtype}/{k_dtype}: the sm90 kernel serves bf16/bf16 and "
                f"e4m3/e4m3")
    gate = _backend.unvalidated_reason(f"the sm90 block max-score kernel for {q_dtype}",
                                       q_dtype in VALIDATED_DTYPES)
    if gate is not None:
        return gate
    if num_k_heads != 1:
        return f"{num_k_heads} index-key heads: the sm90 kernel serves one shared key head"
    if num_heads not in SUPPORTED_HEADS:
        return f"{num_heads} index heads: the sm90 kernel serves {SUPPORTED_HEADS}"
    return cute_runtime.unavailable_reason(variant_name(num_heads, bool(paged), q_dtype))


def causal_offsets(offset, q_lens: Optional[torch.Tensor],
                   k_lens: torch.Tensor, host: Optional[list] = None) -> torch.Tensor:
    """[B] int32 causal offsets on k_lens' device, clamped to +-2^30: the given qo_offset (an
    int or a [B] / scalar tensor), or k_len - q_len (bottom-right) when it is None. `host`: the
    tensor's values when the caller knows them without a device read (a plan's); a [B] int32
    tensor already within the clamp is then returned as is (three launches fewer per call)."""
    if offset is None:
        return (k_lens - q_lens).to(torch.int32)
    if (host is not None and isinstance(offset, torch.Tensor) and offset.dtype == torch.int32
            and offset.shape == k_lens.shape and offset.device == k_lens.device
            and offset.is_contiguous() and all(abs(x) <= _OFFSET_LIMIT for x in host)):
        return offset
    if isinstance(offset, torch.Tensor):
        offset = offset.to(device=k_lens.device, dtype=torch.int64).reshape(-1)
        offset = offset.expand(k_lens.numel()).clamp(-_OFFSET_LIMIT, _OFFSET_LIMIT)
        return offset.to(torch.int32)
    return torch.full_like(k_lens, max(-_OFFSET_LIMIT, min(_OFFSET_LIMIT, int(offset))))


def check_launch_limits(call) -> None:
    """NotImplementedError for sizes the kernel cannot count in int32. q_idx, k_idx and the
    output may hold 2^31 elements or more (their row offsets are 64-bit: a decode batch of 32 x
    512k tokens has an index-K cache of exactly 2^31 e4m3 elements); what stays 32-bit is the
    -inf fill index of a CTA, up to max_k_tiles * 256 (rows per CTA), and the key length
    max_pages * 128 that a paged call without seqused_k implies."""
    cute_runtime.check_int32_count("max_k_tiles", call.max_k_tiles * TILE_ROWS,
                                   f"max_k_tiles * {TILE_ROWS} (the kernel's -inf fill index "
                                   f"over tiles x rows per CTA)")
    if call.paged and call.seqused_k is None:
        cute_runtime.check_int32_count("page_table", call.page_table.shape[1] * KEY_TILE,
                                       f"max_pages * {KEY_TILE} (the key length without "
                                       f"seqused_k)")


def run(call) -> torch.Tensor:
    """Returns max_score [H, max_k_tiles, total_q] fp32 (freshly allocated, every element
    written by the kernel)."""
    q, k = call.q_idx, call.k_idx
    device = q.device
    total_q, num_heads, _ = q.shape
    check_launch_limits(call)
    out = torch.empty(num_heads, call.max_k_tiles, total_q, dtype=torch.float32, device=device)
    if total_q == 0:
        return out
    # Prefix sums the kernel can trust whatever their values (unchanged when valid): a
    # negative start or a decreasing entry would otherwise address rows outside q / k.
    cu_q = device_prefix_sums(call.cu_seqlens_q, total_q)
    batch = cu_q.numel() - 1
    q_lens = cu_q[1:] - cu_q[:-1]
    if call.paged:
        page_table = call.page_table.contiguous()
        if call.seqused_k is not None:
            k_lens = call.seqused_k.contiguous()
        else:  # upstream quirk D11: the whole table width counts as the length
            k_lens = torch.full((batch,), page_table.shape[1] * KEY_TILE, dtype=torch.int32,
                                device=device)
        cu_k = cu_q                                  # unused by the paged variant
    else:
        cu_k = device_prefix_sums(call.cu_seqlens_k, k.shape[0])
        k_lens = (cu_k[1:] - cu_k[:-1]).contiguous()
        page_table = k_lens.view(batch, 1)           # unused by the dense variant
    offsets = causal_offsets(call.qo_offset, q_lens, k_lens).contiguous()
    decode = use_decode_variant(call, device)
    if decode:      # grid x: K-tile chunks per request
        grid_x = decode_key_splits(batch, call.max_k_tiles,
                                   torch.cuda.get_device_properties(device).multi_processor_count)
    else:           # grid x: strides over each request's query tiles
        grid_x = max(1, -(-call.max_seqlen_q // (TILE_ROWS // num_heads)))
    if POISON_BUFFERS_FOR_TESTS:
        out.fill_(float("nan"))
    cute_runtime.launch(variant_name(num_heads, call.paged, q.dtype, decode), device, q, k, cu_q,
                        cu_k, k_lens, offsets, page_table, out, float(call.scale),
                        int(call.causal), int(grid_x))
    return out


_backend.register_native("block_max_scores", "sm90", run, supports)
