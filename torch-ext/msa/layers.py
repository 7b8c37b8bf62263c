"""``kernels`` layers for transformers' MiniMax-M3 (``models/minimax_m3_vl``), and a one-call swap.

Two layers, named after the transformers classes whose ``forward`` they replace:

``MiniMaxM3VLIndexer``
    Returns exactly what the stock indexer returns, ``[B, index_n_heads, S_q, n]`` int64 block
    ids with ``n = min(index_topk_blocks, ceil(S_k / 128))``: per (query, index head) the blocks
    with the highest max-over-the-block index score ``q_idx . k_idx`` (fp32, no scale) among the
    blocks up to the query's own block ``position_ids // 128``, the ``index_local_blocks``
    blocks ending at the own block always kept, ids ordered by descending score, ``-1`` after
    the last valid id. It runs this package's indexer (``block_max_scores``) and top-k
    (``sparse_topk_select``) over query chunks, so its memory is linear in the sequence length
    (the stock module builds the fp32 [S_q x S_k] score matrix per index head: 64 GB at 64k).
``MiniMaxM3VLAttention``
    Sparse layers (those with an indexer): the stock projections, norms, rotary embedding and
    cache update, then the block-sparse attention of this package over the indexer's selection
    (``msa.prefill.sparse_atten_from_selection``: ``build_k2q_csr`` and ``sparse_atten_func``
    in query chunks whose scratch fits ATTENTION_WORKSPACE_BYTES), on any device and without
    transformers' SM100 gate (no ``_msa_validated`` flag, no ``attn_implementation`` string).
    bf16 only. Dense layers: a causal prefill without a padding mask or cache history, on a GPU
    this build has a native FMHA for, runs this package's dense FMHA (``fmha``); everything
    else runs the model's own forward.

Memory is linear in the sequence length; the peak formula is in docs/transformers.md.

Semantics shared with transformers' MSA route: bottom-right causal attention over the cache
(one request: its valid length ``position_ids[0, -1] + 1``, so a StaticCache works; several:
the whole cache length), the padding mask is not applied on sparse layers, no attention dropout.

Swap them into a loaded model (any ``attn_implementation``; ``"sdpa"`` is fine)::

    msa = kernels.get_kernel("MiniMaxAI/msa", version=0, trust_remote_code=True)
    msa.layers.kernelize_minimax_m3(model)      # or kernels.kernelize with a LayerRepository

The layers follow the ``kernels`` rules: no ``__init__``, no members besides ``forward``,
``can_torch_compile`` and ``has_backward`` (inference only), the state read from the host module.
Under ``torch.compile`` the package calls run outside the graph (a graph break), so compile
without ``fullgraph=True``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from . import _backend
from ._validation import (BLOCK_SIZE, HEAD_DIM, SUPPORTED_TOPK, check_head_dim,
                          check_positive_int, check_shape, check_tensor)
from .fmha import fmha, fmha_plan
from .indexer import INDEX_DTYPES, block_max_scores
from .prefill import DEFAULT_WORKSPACE_BYTES, sparse_atten_from_selection
from .topk import sparse_topk_select

# Scratch of one query chunk's block scores, [index heads, key blocks, B * chunk] fp32: the
# indexer layer sizes its query chunks to stay within it (64k tokens: one chunk; 512k: 16k
# queries per chunk).
SCORE_CHUNK_BYTES = 1 << 30
# Scratch of one query chunk of the sparse attention (CSR, schedule, per-block partials, the
# chunk's output): msa.prefill's chunking (512k M3 tokens: ~60k queries per chunk).
ATTENTION_WORKSPACE_BYTES = DEFAULT_WORKSPACE_BYTES
# Tokens per step of the query / key projections, norms and rotary embedding.
PROJECTION_CHUNK_TOKENS = 16384
# Query rows per step when recomputing own-block scores exactly (index_local_blocks == 0 only).
_OWN_BLOCK_ROWS = 1024


class MiniMaxM3VLIndexer(nn.Module):
    """Drop-in forward of transformers' ``MiniMaxM3VLIndexer`` (see the module docstring).

    Reads from the host module: ``q_proj``, ``k_proj``, ``q_norm``, ``k_norm``, ``head_dim``,
    ``block_size``, ``topk_blocks``, ``local_blocks``, ``layer_idx``.
    """

    can_torch_compile: bool = True
    has_backward: bool = False

    q_proj: nn.Linear
    k_proj: nn.Linear
    q_norm: nn.Module
    k_norm: nn.Module
    head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int
    layer_idx: int

    def forward(self, hidden_states: torch.Tensor, position_embeddings, past_key_values,
                position_ids: torch.Tensor) -> torch.Tensor:
        # [B, S, H, D] throughout (the stock module transposes to [B, H, S, D]; the per-row norm
        # and the element-wise rotation give the same values in either layout).
        cos, sin = position_embeddings
        cos = cos[..., :self.head_dim].unsqueeze(2)
        sin = sin[..., :self.head_dim].unsqueeze(2)
        idx_q = _project(self.q_proj, self.q_norm, hidden_states, cos, sin, self.head_dim)
        idx_k = _project(self.k_proj, self.k_norm, hidden_states, cos, sin, self.head_dim)
        idx_k = idx_k.transpose(1, 2)                                 # [B, 1, S, D]: the cache's
        if past_key_values is not None:
            idx_k = past_key_values.layers[self.layer_idx].update_index(idx_k)
        return _outside_graph(select_blocks)(idx_q, idx_k, position_ids,
                                             topk_blocks=self.topk_blocks,
                                             local_blocks=self.local_blocks,
                                             block_size=self.block_size)


class MiniMaxM3VLAttention(nn.Module):
    """Drop-in forward of transformers' ``MiniMaxM3VLAttention`` (see the module docstring).

    Reads from the host module: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
    ``k_norm``, ``indexer``, ``head_dim``, ``scaling``, ``layer_idx``, ``attention_dropout``.
    """

    can_torch_compile: bool = True
    has_backward: bool = False

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: nn.Module
    k_norm: nn.Module
    indexer: Optional[nn.Module]
    head_dim: int
    scaling: float
    layer_idx: int
    attention_dropout: float

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask,
                past_key_values=None, **kwargs):
        if self.indexer is None and not _outside_graph(_dense_fmha_serves)(
                self, hidden_states, attention_mask, past_key_values):
            # A dense layer the FMHA does not serve (a mask, cache history, decode, no native
            # kernel): the model's own forward (the class's; kernelize replaced the instance's).
            return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                      past_key_values, **kwargs)
        batch, q_len, _ = hidden_states.shape
        if self.training and self.attention_dropout:
            raise ValueError(f"attention_dropout: {self.attention_dropout} is not supported by "
                             "the msa attention layer (inference only); set it to 0")
        shape = (batch, q_len, -1, self.head_dim)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        query = _project(self.q_proj, self.q_norm, hidden_states, cos, sin, self.head_dim)
        key = _project(self.k_proj, self.k_norm, hidden_states, cos, sin, self.head_dim)
        value = self.v_proj(hidden_states).view(shape)
        key, value = key.transpose(1, 2), value.transpose(1, 2)            # [B, Hkv, S, D]
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        if self.indexer is None:
            out = _outside_graph(dense_causal_attention)(query, key, value, self.scaling)
        else:
            position_ids = kwargs.get("position_ids")
            if position_ids is None:
                position_ids = torch.arange(key.shape[2] - q_len, key.shape[2],
                                            device=query.device)
            position_ids = (position_ids if position_ids.dim() > 1
                            else position_ids.unsqueeze(0)).expand(batch, -1)
            block_indices = self.indexer(hidden_states, position_embeddings, past_key_values,
                                         position_ids)
            out = _outside_graph(sparse_attention)(query, key, value, block_indices,
                                                   position_ids, self.scaling)
        return self.o_proj(out.reshape(batch, q_len, -1)), None


# ---------------------------------------------------------------------------------------------
# The package calls (outside any torch.compile graph)
# ---------------------------------------------------------------------------------------------

_DISABLED: dict = {}


def _outside_graph(fn):
    """fn itself when running eagerly; under torch.compile, fn wrapped once by
    torch.compiler.disable, so the package's calls run eagerly between graphs (a graph break).
    Wrapped lazily: torch.compiler.disable imports torch._dynamo (seconds), which importing
    this package must not."""
    if not torch.compiler.is_compiling():
        return fn
    wrapped = _DISABLED.get(fn)
    if wrapped is None:
        wrapped = _DISABLED[fn] = torch.compiler.disable(fn)
    return wrapped


def select_blocks(idx_q: torch.Tensor, idx_k: torch.Tensor, position_ids: torch.Tensor, *,
                  topk_blocks: int, local_blocks: int, block_size: int = BLOCK_SIZE
                  ) -> torch.Tensor:
    """The stock M3 indexer's selection, from its projected index queries and keys.

    Args:
      idx_q: [B, S_q, H, 128] index queries (after norm and rotary embedding).
      idx_k: [B, 1, S_k, 128] index keys of the whole cache (one shared head).
      position_ids: [B, S_q] (or [S_q]) int: the content position of each query. Key slot j is
        visible to query t when j <= position_ids[t]; the query's own block is
        position_ids[t] // 128.
      topk_blocks, local_blocks: ``index_topk_blocks`` / ``index_local_blocks`` of the config.
      block_size: ``index_block_size``; must be 128.

    Returns [B, H, S_q, n] int64, n = min(topk_blocks, ceil(S_k / 128)): per (query, head) the
    forced blocks (own block and the local_blocks - 1 before it) and the best-scoring other
    blocks up to the own block, ordered by descending score (forced first; ties by ascending
    id), -1 in the slots left over. Index scores are the max over each block's visible keys of
    q_idx . k_idx in fp32. Scratch is one query chunk's [H, ceil(S_k/128), B * chunk] fp32
    scores (SCORE_CHUNK_BYTES).
    """
    _check_selection_args(idx_q, idx_k, position_ids, topk_blocks, local_blocks, block_size)
    batch, q_len, num_heads, dim = idx_q.shape
    k_len = idx_k.shape[2]
    num_blocks = -(-k_len // BLOCK_SIZE)
    width = min(topk_blocks, num_blocks)
    forced = min(local_blocks, width)
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    position_ids = position_ids.expand(batch, q_len)
    device = idx_q.device
    out = torch.empty(batch, num_heads, q_len, width, dtype=torch.int64, device=device)
    if batch == 0 or q_len == 0:
        return out
    keys = idx_k.reshape(batch * k_len, 1, dim)
    if not keys.is_contiguous():
        keys = keys.contiguous()
    cu_k = torch.arange(0, (batch + 1) * k_len, k_len, dtype=torch.int32, device=device)
    chunk = _query_chunk(num_heads, num_blocks, batch, q_len)
    for start in range(0, q_len, chunk):
        rows = min(chunk, q_len - start)
        queries = idx_q[:, start:start + rows].reshape(batch * rows, num_heads, dim)
        if not queries.is_contiguous():
            queries = queries.contiguous()
        positions = position_ids[:, start:start + rows]
        # One causal offset per request chunk: the largest position - local index, so every key
        # up to each query's position is visible (exact when positions advance by one per
        # query). Keys past a query's own block may become visible too; the selection never
        # reaches them (causal_end_block), and its own block is forced or recomputed.
        local = torch.arange(rows, device=device)
        offsets = (positions - local).amax(dim=1)
        cu_q = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32, device=device)
        scores = block_max_scores(queries, keys, cu_q, cu_k, max_seqlen_q=rows,
                                  max_seqlen_k=k_len, scale=1.0, causal=True,
                                  qo_offset=offsets, max_k_tiles=num_blocks)
        own = torch.div(positions, BLOCK_SIZE, rounding_mode="floor").clamp(0, num_blocks - 1)
        own = own.reshape(-1).to(torch.int32)
        if local_blocks == 0:
            _rescore_own_block(scores, queries, keys, positions.reshape(-1), own, rows, k_len)
        selection = sparse_topk_select(scores, width, num_blocks, force_end_blocks=forced,
                                       causal_end_block=own)             # [B*rows, H, n]
        ids = _by_descending_score(selection, scores, own, local_blocks)  # [H, n, B*rows]
        out[:, :, start:start + rows] = ids.view(num_heads, width, batch, rows).permute(2, 0, 3, 1)
    return out


def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     block_indices: torch.Tensor, position_ids: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """Block-sparse causal attention over an M3 indexer selection.

    Args:
      query: [B, S_q, Hq, 128]; key, value: [B, Hkv, S_k, 128] (the cache).
      block_indices: [B, Hkv, S_q, n] block ids, -1 = empty slot (the indexer's output: one
        index head per KV head).
      position_ids: [B, S_q]; with B == 1 the keys past position_ids[0, -1] are not attended
        (a StaticCache's unwritten tail).
      softmax_scale: logit scale.

    Returns [B, S_q, Hq, 128] in query's dtype (bf16). Query i of request b sees key j of a
    selected block when j <= i + k_len_b - S_q (bottom-right), k_len_b = S_k, or the valid
    length above for one request.

    Runs ``msa.prefill.sparse_atten_from_selection`` (query chunks within
    ATTENTION_WORKSPACE_BYTES) on one of two packings, whichever copies less: queries as they
    are and K/V copied token-major ([B*S_k, Hkv, 128], a prefill), or each (request, KV head) as
    a request of Hq/Hkv query heads against one KV head, reading the cache's [B, Hkv, S_k, 128]
    memory in place and copying the queries instead (decode and short chunks on a long cache).
    """
    _check_attention_args(query, key, value)
    batch, q_len, num_heads, dim = query.shape
    num_kv_heads, k_len = key.shape[1], key.shape[2]
    check_tensor("block_indices", block_indices, ndim=4)
    if block_indices.is_floating_point() or block_indices.dtype == torch.bool:
        raise TypeError(f"block_indices: expected integer block ids, got {block_indices.dtype}")
    if block_indices.shape[1] != num_kv_heads:
        raise ValueError(f"index_n_heads: the sparse attention takes one index head per KV head "
                         f"({num_kv_heads}), the indexer gave {block_indices.shape[1]}")
    check_shape("block_indices", block_indices, (batch, num_kv_heads, q_len, None))
    _check_position_ids(position_ids, batch, q_len)
    position_ids = position_ids.view(-1, q_len)
    width = block_indices.shape[-1]
    topk = next((t for t in SUPPORTED_TOPK if t >= width), None)
    if topk is None:
        raise ValueError(f"index_topk_blocks: the sparse attention takes at most "
                         f"{SUPPORTED_TOPK[-1]} blocks per query, the indexer gave {width}")
    q2k = block_indices.to(torch.int32)                                   # [B, Hkv, S_q, n]
    if topk != width:
        q2k = torch.nn.functional.pad(q2k, (0, topk - width), value=-1)
    # One request: the keys past its last position are a StaticCache's unwritten tail.
    valid = (position_ids[0, -1:] + 1).clamp(1, k_len).to(torch.int32) if batch == 1 else None
    group = num_heads // num_kv_heads
    heads_as_requests = (q_len * num_heads < k_len * num_kv_heads and key.is_contiguous()
                         and value.is_contiguous())
    if heads_as_requests:
        requests = batch * num_kv_heads
        q = query.reshape(batch, q_len, num_kv_heads, group, dim).transpose(1, 2)
        q = q.reshape(requests * q_len, group, dim)
        k = key.view(requests * k_len, 1, dim)
        v = value.view(requests * k_len, 1, dim)
        q2k = q2k.reshape(1, requests * q_len, topk).contiguous()
    else:
        requests = batch
        q = query.reshape(batch * q_len, num_heads, dim)
        if not q.is_contiguous():
            q = q.contiguous()
        k = key.transpose(1, 2).reshape(batch * k_len, num_kv_heads, dim).contiguous()
        v = value.transpose(1, 2).reshape(batch * k_len, num_kv_heads, dim).contiguous()
        q2k = q2k.permute(1, 0, 2, 3).reshape(num_kv_heads, batch * q_len, topk).contiguous()
    cu_q, cu_k = _strided_seqlens(requests, q_len, k_len, valid, query.device)
    out = sparse_atten_from_selection(q, k, v, q2k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=q_len, max_seqlen_k=k_len, causal=True,
                                      softmax_scale=softmax_scale,
                                      workspace_bytes=ATTENTION_WORKSPACE_BYTES)
    if heads_as_requests:
        out = out.view(batch, num_kv_heads, q_len, group, dim).transpose(1, 2)
    return out.reshape(batch, q_len, num_heads, dim)


def dense_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           softmax_scale: float) -> torch.Tensor:
    """Causal self-attention of a prefill without history through this package's dense FMHA.

    query [B, S, Hq, 128]; key, value [B, Hkv, S, 128]; bf16. Returns [B, S, Hq, 128] bf16.
    """
    _check_attention_args(query, key, value)
    batch, q_len, num_heads, dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[2] != q_len:
        raise ValueError(f"key: has {key.shape[2]} keys per request, the prefill without history "
                         f"needs S_k = S_q = {q_len}")
    lengths = torch.full((batch,), q_len, dtype=torch.int32)
    plan = fmha_plan(lengths, lengths, num_heads, num_kv_heads, causal=True, device=query.device)
    q = query.reshape(batch * q_len, num_heads, dim)
    if not q.is_contiguous():
        q = q.contiguous()
    k = key.transpose(1, 2).reshape(batch * q_len, num_kv_heads, dim).contiguous()
    v = value.transpose(1, 2).reshape(batch * q_len, num_kv_heads, dim).contiguous()
    out, _ = fmha(q, k, v, plan, sm_scale=softmax_scale, output_maxscore=False)
    return out.view(batch, q_len, num_heads, dim)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def _dense_fmha_serves(module, hidden_states: torch.Tensor, attention_mask, cache) -> bool:
    """Whether a dense layer's call goes to the native dense FMHA: a causal prefill (more than one
    query, no mask: the model's SDPA mask is None for causal attention without padding) with no
    cache history, bf16, head_dim 128, on a GPU this build has a native FMHA for."""
    if (attention_mask is not None or hidden_states.shape[1] < 2
            or hidden_states.dtype != torch.bfloat16 or module.head_dim != HEAD_DIM):
        return False
    if cache is not None:
        seen = cache.get_seq_length(module.layer_idx)   # a tensor for static caches: not served
        if not isinstance(seen, int) or seen != 0:
            return False
    arch = _backend.arch_family(hidden_states.device)
    return arch is not None and ("fmha_dense", arch) in _backend.registered()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] channels of x (the rest pass through), with
    the same operations and dtypes as transformers' apply_rotary_pos_emb / rotate_half."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = x_rot.shape[-1] // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat(((x_rot * cos) + (rotated * sin), x_pass), dim=-1)


def _project(proj: nn.Module, norm: nn.Module, hidden_states: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """norm(proj(hidden_states)) per head with the rotary embedding (cos / sin [B, S, 1, r]):
    [B, S, H, D] in the model's dtype. Long inputs go through in token chunks: the norm
    computes in fp32, and at 512k tokens with 64 heads one piece would need ~50 GB of
    temporaries (4 heads: ~3 GB)."""
    batch, q_len, _ = hidden_states.shape
    step = max(1, PROJECTION_CHUNK_TOKENS // max(batch, 1))
    out = None
    for start in range(0, q_len, step):
        part = hidden_states[:, start:start + step]
        x = norm(proj(part).view(batch, part.shape[1], -1, head_dim))
        x = _rotate(x, cos[:, start:start + step], sin[:, start:start + step])
        if step >= q_len:
            return x
        if out is None:
            out = torch.empty(batch, q_len, x.shape[2], head_dim, dtype=x.dtype, device=x.device)
        out[:, start:start + step] = x
    return out


def _strided_seqlens(requests: int, q_len: int, k_len: int, valid: Optional[torch.Tensor],
                     device: torch.device):
    """(cu_seqlens_q, cu_seqlens_k) int32 of `requests` requests of q_len queries whose keys
    start every k_len rows. valid ([1] int32 on the device, or None for all k_len): the keys
    each request uses; a zero-query request after each then holds its unused rows, so
    cu_seqlens_k stays a prefix sum with every request at its own start (no host sync)."""
    cu_q = torch.arange(0, (requests + 1) * q_len, q_len, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (requests + 1) * k_len, k_len, dtype=torch.int32, device=device)
    if valid is None:
        return cu_q, cu_k
    cu_q_gap = torch.empty(2 * requests + 1, dtype=torch.int32, device=device)
    cu_q_gap[0::2] = cu_q
    cu_q_gap[1::2] = cu_q[1:]
    cu_k_gap = torch.empty_like(cu_q_gap)
    cu_k_gap[0::2] = cu_k
    cu_k_gap[1::2] = cu_k[:-1] + valid
    return cu_q_gap, cu_k_gap


# Errors about values the model config sets name the config field (index_block_size, ...).

def _check_selection_args(idx_q, idx_k, position_ids, topk_blocks, local_blocks, block_size):
    if block_size != BLOCK_SIZE:
        raise ValueError(f"index_block_size: only {BLOCK_SIZE} is supported, got {block_size}")
    check_tensor("idx_q", idx_q, dtypes=INDEX_DTYPES, ndim=4)
    check_tensor("idx_k", idx_k, dtypes=(idx_q.dtype,), ndim=4)
    if idx_q.shape[-1] != HEAD_DIM or idx_k.shape[-1] != HEAD_DIM:
        raise ValueError(f"index_head_dim: only {HEAD_DIM} is supported, got "
                         f"{idx_q.shape[-1]} (idx_q) and {idx_k.shape[-1]} (idx_k)")
    if idx_k.shape[0] != idx_q.shape[0] or idx_k.shape[1] != 1 or idx_k.shape[2] < 1:
        raise ValueError(f"idx_k: expected [B = {idx_q.shape[0]}, 1, S_k >= 1, D], got "
                         f"{list(idx_k.shape)}")
    check_positive_int("index_topk_blocks", topk_blocks, minimum=1)
    if topk_blocks > 64:
        raise ValueError(f"index_topk_blocks: must be in [1, 64], got {topk_blocks}")
    check_positive_int("index_local_blocks", local_blocks)
    _check_position_ids(position_ids, idx_q.shape[0], idx_q.shape[1])


def _check_position_ids(position_ids, batch: int, q_len: int) -> None:
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point() \
            or position_ids.dtype == torch.bool:
        raise TypeError("position_ids: expected an integer tensor")
    if position_ids.dim() not in (1, 2) or position_ids.shape[-1] != q_len or (
            position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch)):
        raise ValueError(f"position_ids: expected [B = {batch}, S_q = {q_len}], got "
                         f"{list(position_ids.shape)}")


def _check_attention_args(query, key, value) -> None:
    """query [B, S_q, Hq, 128] bf16; key, value [B, Hkv, S_k, 128] of query's dtype."""
    if isinstance(query, torch.Tensor) and query.dtype != torch.bfloat16:
        raise TypeError(f"query: the msa attention layers serve bf16 models, got {query.dtype} "
                        "(load the model with dtype=torch.bfloat16)")
    check_tensor("query", query, ndim=4)
    check_head_dim("query", query.shape[-1])
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, dtypes=(torch.bfloat16,), ndim=4)
        if t.shape[0] != query.shape[0] or t.shape[-1] != query.shape[-1]:
            raise ValueError(f"{name}: expected [B = {query.shape[0]}, Hkv, S_k, "
                             f"{query.shape[-1]}], got {list(t.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value: shape {list(value.shape)} differs from key's "
                         f"{list(key.shape)}")


def _query_chunk(num_heads: int, num_blocks: int, batch: int, q_len: int) -> int:
    """Queries per request per chunk: the scores [H, blocks, B * chunk] fp32 fit
    SCORE_CHUNK_BYTES; a multiple of 128 when more than 128."""
    chunk = max(1, SCORE_CHUNK_BYTES // (4 * num_heads * num_blocks * batch))
    if chunk > BLOCK_SIZE:
        chunk -= chunk % BLOCK_SIZE
    return min(chunk, q_len)


def _rescore_own_block(scores: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
                       positions: torch.Tensor, own: torch.Tensor, rows: int, k_len: int) -> None:
    """Overwrite scores[:, own[t], t] with the max over keys 128*own[t] .. positions[t] (and
    < k_len) of q_t . k in fp32: the own block's exact score when it is not forced (the chunk's
    shared causal offset may have shown it keys past a query's position)."""
    total, num_heads, _ = queries.shape
    device = queries.device
    request = torch.div(torch.arange(total, device=device), rows, rounding_mode="floor")
    lane = torch.arange(BLOCK_SIZE, device=device)
    for start in range(0, total, _OWN_BLOCK_ROWS):
        part = slice(start, min(start + _OWN_BLOCK_ROWS, total))
        slot = own[part].long().unsqueeze(1) * BLOCK_SIZE + lane             # [t, 128]
        visible = (slot <= positions[part].unsqueeze(1)) & (slot < k_len)
        rows_k = keys[(request[part].unsqueeze(1) * k_len + slot.clamp(max=k_len - 1)), 0]
        dots = torch.einsum("thd,tjd->thj", queries[part].float(), rows_k.float())
        best = dots.masked_fill(~visible.unsqueeze(1), float("-inf")).amax(dim=-1)   # [t, H]
        columns = torch.arange(part.start, part.stop, device=device)
        scores[:, own[part].long(), columns] = best.t()


def _by_descending_score(selection: torch.Tensor, scores: torch.Tensor, own: torch.Tensor,
                         local_blocks: int) -> torch.Tensor:
    """[T, H, n] ascending ids (-1 tail) -> [H, n, T] int64 ordered as torch.topk orders the
    stock scores: forced blocks (+inf) first, then descending score, -1 last; ties keep the
    ascending id order."""
    ids = selection.permute(1, 2, 0).long()                                # [H, n, T]
    valid = ids >= 0
    value = scores.gather(1, ids.clamp(min=0))
    value = value.masked_fill(~valid, float("-inf"))
    is_forced = valid & (ids > own.long().view(1, 1, -1) - local_blocks)
    value = value.masked_fill(is_forced, float("inf"))
    order = torch.sort(value, dim=1, descending=True, stable=True).indices
    return ids.gather(1, order)


# ---------------------------------------------------------------------------------------------
# One-call swap
# ---------------------------------------------------------------------------------------------

LAYER_NAMES = ("MiniMaxM3VLIndexer", "MiniMaxM3VLAttention")


@dataclasses.dataclass(frozen=True)
class _LoadedPackageRepository:
    """A ``kernels`` repository (``layer_name`` + ``load()``) serving this already loaded
    package's layers, so kernelize needs no second download or import."""
    layer_name: str

    def load(self):
        return globals()[self.layer_name]

    def __str__(self) -> str:
        return f"`{__name__}` (loaded), layer `{self.layer_name}`"


def kernelize_minimax_m3(model: nn.Module, *, mode=None, device: Optional[str] = None):
    """Swap this package's M3 layers into a loaded transformers MiniMax-M3 model, in place.

    Equivalent to the manual ``kernels`` flow (``replace_kernel_forward_from_hub`` on the two
    transformers classes, then ``kernels.kernelize`` with a mapping to these layers), with the
    mapping pointing at this loaded package. Needs the ``kernels`` package (0.16 or 0.17).

    Args:
      model: a transformers model holding ``MiniMaxM3VLIndexer`` modules (text or vision-language
        M3). Only those and ``MiniMaxM3VLAttention`` modules change.
      mode: a ``kernels.Mode``; default ``Mode.INFERENCE``. ``Mode.INFERENCE |
        Mode.TORCH_COMPILE`` keeps the layers too (they declare can_torch_compile); a TRAINING
        mode keeps the model's own forwards (the layers have no backward).
      device: "cuda" or "cpu"; default the device of the model's parameters.

    Returns the model. Raises ValueError when the model has no MiniMaxM3VLIndexer.
    """
    try:
        import kernels
    except ImportError as exc:
        raise ImportError("kernelize_minimax_m3 needs the `kernels` package "
                          "(pip install kernels)") from exc
    classes = {}
    for module in model.modules():
        name = type(module).__name__
        if name in LAYER_NAMES:
            classes.setdefault(name, type(module))
    if LAYER_NAMES[0] not in classes:
        raise ValueError("model: no MiniMaxM3VLIndexer module found; is it a MiniMax-M3 model?")
    if device is None:
        device = next(model.parameters()).device.type
    for name, cls in classes.items():
        kernels.replace_kernel_forward_from_hub(cls, name)
    mapping = {name: {device: _LoadedPackageRepository(name)} for name in classes}
    with kernels.use_kernel_mapping(mapping):
        kernels.kernelize(model, mode=mode if mode is not None else kernels.Mode.INFERENCE,
                          device=device)
    return model
