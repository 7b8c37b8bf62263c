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

The kernel form of a call (cute_kernels.variants.INDEXER_FORMS: the decode form for paged keys
and few rows per request, else the prefill form) is picked once, in ``max_scores``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from .. import _backend
from .._common import causal_offsets, key_lengths, sm_count
from .._validation import device_prefix_sums
from ..cute_kernels import variants
from . import cute_runtime, debug, serving

KEY_TILE = variants.KV_BLOCK
TILE_ROWS = 256                 # (query, head) rows per CTA; must match the kernel's TILE_M
SUPPORTED_HEADS = variants.INDEX_HEADS
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "e4m3"}


def variant_name(num_heads: int, paged: bool, dtype: torch.dtype = torch.bfloat16,
                 form: str = "prefill") -> str:
    """Artifact name of an indexer variant (a form of variants.INDEXER_FORMS)."""
    return variants.BlockMaxScoreVariant(num_heads, paged, _DTYPE_NAMES[dtype], form).name


def decode_key_splits(batch: int, max_k_tiles: int, num_sms: int) -> int:
    """CTAs per request for the decode form: about two waves over the SMs, at least two K
    tiles (one pipeline's worth) per CTA."""
    return max(1, min(-(-2 * num_sms // max(batch, 1)), -(-max_k_tiles // 2)))


def launch_key_splits(key_splits: int, max_k_tiles: int) -> int:
    """The grid z of a call asking for key_splits CTAs per query tile: at most one a key tile
    and the grid's limit (65535)."""
    return max(1, min(int(key_splits), max_k_tiles, 65535))


def supports(*, q_dtype=None, k_dtype=None, paged=False, causal=True, num_heads=None,
             num_k_heads=None, **_ignored) -> Optional[str]:
    """None if the native kernel serves a call with these features, else the reason."""
    if q_dtype != k_dtype or q_dtype not in _DTYPE_NAMES:
        return (f"q_idx/k_idx dtypes {q_dtype}/{k_dtype}: the sm90 kernel serves bf16/bf16 and "
                f"e4m3/e4m3")
    if num_k_heads != 1:
        return f"{num_k_heads} index-key heads: the sm90 kernel serves one shared key head"
    if num_heads not in SUPPORTED_HEADS:
        return f"{num_heads} index heads: the sm90 kernel serves {SUPPORTED_HEADS}"
    return cute_runtime.unavailable_reason(variant_name(num_heads, bool(paged), q_dtype))


def check_launch_limits(max_k_tiles: int, page_table: Optional[torch.Tensor],
                        seqused_k: Optional[torch.Tensor]) -> None:
    """NotImplementedError for sizes the kernel cannot count in int32. q_idx, k_idx and the
    output may hold 2^31 elements or more (their row offsets are 64-bit: a decode batch of 32 x
    512k tokens has an index-K cache of exactly 2^31 e4m3 elements); what stays 32-bit is the
    -inf fill index of a CTA, up to max_k_tiles * 256 (rows per CTA), and the key length
    max_pages * 128 that a paged call without seqused_k implies."""
    cute_runtime.check_int32_count("max_k_tiles", max_k_tiles * TILE_ROWS,
                                   f"max_k_tiles * {TILE_ROWS} (the kernel's -inf fill index "
                                   f"over tiles x rows per CTA)")
    if page_table is not None and seqused_k is None:
        cute_runtime.check_int32_count("page_table", page_table.shape[1] * KEY_TILE,
                                       f"max_pages * {KEY_TILE} (the key length without "
                                       f"seqused_k)")


def run(call) -> torch.Tensor:
    """Returns max_score [H, max_k_tiles, total_q] fp32 for a validated
    :class:`msa.indexer.BlockMaxScoreCall` (freshly allocated, every element written by the
    kernel)."""
    return max_scores(call.q_idx, call.k_idx, call.cu_seqlens_q, call.cu_seqlens_k,
                      max_seqlen_q=call.max_seqlen_q, max_k_tiles=call.max_k_tiles,
                      scale=call.scale, causal=call.causal, qo_offset=call.qo_offset,
                      page_table=call.page_table, seqused_k=call.seqused_k,
                      planned=call.planned_lengths, key_splits=call.key_splits,
                      planned_offsets=call.planned_offsets)


@dataclasses.dataclass(frozen=True)
class KernelInputs:
    """What an indexer kernel reads besides q, k and out, safe whatever the index values say."""
    batch: int
    cu_q: torch.Tensor                   # [B+1] int32, monotone within total_q
    cu_k: Optional[torch.Tensor]         # [B+1] int32, monotone within k (dense; else None)
    k_lens: torch.Tensor                 # [B] int32
    offsets: torch.Tensor                # [B] int32 causal offsets (contiguous)
    page_table: Optional[torch.Tensor]   # contiguous (paged; else None)


def kernel_inputs(q, k, cu_seqlens_q, cu_seqlens_k, qo_offset, page_table, seqused_k, *,
                  planned: bool = False,
                  planned_offsets: Optional[torch.Tensor] = None) -> KernelInputs:
    """Prefix sums the kernels can trust whatever their values (unchanged when valid: a negative
    start or a decreasing entry would otherwise address rows outside q / k), key lengths and
    causal offsets; no host synchronization (every native tier's indexer shares this).
    `planned`: the prefix sums are a plan's own (valid by construction), taken as they are
    (saving the launches that would derive them); `planned_offsets`: the plan's bottom-right
    offsets (BlockMaxScoreCall.planned_offsets), likewise."""
    cu_q = cu_seqlens_q if planned else device_prefix_sums(cu_seqlens_q, q.shape[0])
    batch = cu_q.numel() - 1
    paged = page_table is not None
    cu_k = None
    if not paged:
        cu_k = cu_seqlens_k if planned else device_prefix_sums(cu_seqlens_k, k.shape[0])
    k_lens = key_lengths(batch, q.device, cu_seqlens_k=cu_k, page_table=page_table,
                         seqused_k=seqused_k)
    if qo_offset is None and planned_offsets is not None:
        offsets = planned_offsets
    else:
        q_lens = cu_q[1:] - cu_q[:-1] if qo_offset is None else None   # bottom-right only
        offsets = causal_offsets(qo_offset, q_lens, k_lens).contiguous()
    return KernelInputs(batch=batch, cu_q=cu_q, cu_k=cu_k, k_lens=k_lens, offsets=offsets,
                        page_table=page_table.contiguous() if paged else None)


def max_scores(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: Optional[torch.Tensor], *, max_seqlen_q: int, max_k_tiles: int,
               scale: float, causal: bool, qo_offset: Union[None, int, torch.Tensor],
               page_table: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
               planned: bool = False, key_splits: int = 1,
               planned_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max_score [H, max_k_tiles, total_q] fp32 of q [total_q, H, 128] against one shared key
    head k (dense [total_k, 1, 128] with cu_seqlens_k, or paged [pages, 1, 128, 128] with
    page_table and optionally seqused_k), one launch on q's device and current stream, no host
    synchronization (capturable in a CUDA graph). Arguments as msa.block_max_scores'; supports()
    has accepted them. `key_splits`: the prefill form's CTAs per query tile along its key tiles
    (the decode form splits the keys itself)."""
    device = q.device
    total_q, num_heads, _ = q.shape
    check_launch_limits(max_k_tiles, page_table, seqused_k)
    out = torch.empty(num_heads, max_k_tiles, total_q, dtype=torch.float32, device=device)
    if total_q == 0:
        return out
    inputs = kernel_inputs(q, k, cu_seqlens_q, cu_seqlens_k, qo_offset, page_table, seqused_k,
                           planned=planned, planned_offsets=planned_offsets)
    batch, k_lens, offsets = inputs.batch, inputs.k_lens, inputs.offsets
    paged = page_table is not None
    cu_q = inputs.cu_q
    cu_k = cu_q if paged else inputs.cu_k                     # unused by the paged variant
    page_table = inputs.page_table if paged else k_lens.view(batch, 1)   # unused when dense
    dtype_name = _DTYPE_NAMES[q.dtype]
    form = serving.pick("indexer", dtype_name,
                        lambda f: (variant_name(num_heads, paged, q.dtype, f.name),),
                        layout="paged" if paged else "dense",
                        rows_per_request=max_seqlen_q * num_heads)
    if isinstance(form, str):   # supports() found the prefill form's artifact
        raise RuntimeError(f"msa.block_max_scores: {form}")
    if form.options.get("split_keys"):      # grid x: K-tile chunks per request
        grid_x = decode_key_splits(batch, max_k_tiles, sm_count(device))
        key_splits = 1
    else:                                    # grid x: strides over each request's query tiles
        grid_x = max(1, -(-max_seqlen_q // (TILE_ROWS // num_heads)))
        key_splits = launch_key_splits(key_splits, max_k_tiles)
    if debug.poison():
        out.fill_(float("nan"))
    name = variant_name(num_heads, paged, q.dtype, form.name)
    debug.record("block_max_scores", name)
    cute_runtime.launch(name, device, q, k, cu_q, cu_k, k_lens, offsets, page_table, out,
                        float(scale), int(causal), int(grid_x), key_splits)
    return out


_backend.register_native("block_max_scores", "sm90", run, supports)
