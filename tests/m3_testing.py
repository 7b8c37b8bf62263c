"""Shared pieces of the transformers MiniMax-M3 layer tests (CPU and GPU): random-weight model
configs, the stock indexer's inputs, a float64 oracle of its selection, and logit / greedy-token
comparisons that tolerate only genuine near-ties."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

BLOCK = 128


def m3_config(*, hidden_size: int = 64, num_heads: int = 8, num_kv_heads: int = 2,
              index_heads: int = 2, topk_blocks: int = 4, local_blocks: int = 1,
              layer_types: Sequence[str] = ("full_attention", "minimax_m3_sparse",
                                            "minimax_m3_sparse"),
              vocab_size: int = 128, max_positions: int = 4096, block_size: int = BLOCK):
    """A small MiniMaxM3VLTextConfig (dense MLPs, head_dim 128). transformers' _from_config
    mutates its config: build one per model."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import \
        MiniMaxM3VLTextConfig
    n = len(layer_types)
    return MiniMaxM3VLTextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size,
        dense_intermediate_size=2 * hidden_size, shared_intermediate_size=hidden_size,
        num_hidden_layers=n, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=128, mlp_layer_types=["dense"] * n, layer_types=list(layer_types),
        index_n_heads=index_heads, index_head_dim=128, index_block_size=block_size,
        index_topk_blocks=topk_blocks, index_local_blocks=local_blocks,
        max_position_embeddings=max_positions, num_local_experts=4, num_experts_per_tok=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)


def m3_model(config, *, attn_implementation: str = "sdpa", std: Optional[float] = None,
             dtype: torch.dtype = torch.float32, device="cpu", seed: Optional[int] = None):
    """MiniMaxM3VLForCausalLM with random weights (normal(0, std) everywhere when std is given:
    the default init leaves the norms at zero and the index scores nearly flat), eval mode."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM
    if seed is not None:
        torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM._from_config(config, attn_implementation=attn_implementation)
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, std)
    return model.to(device=device, dtype=dtype).eval()


def stock_index_inputs(indexer, hidden_states, position_embeddings):
    """(idx_q [B, H, S, D], idx_k [B, 1, S, D]) exactly as the stock indexer computes them
    before its cache update (transformers' own functions)."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb
    batch, q_len, _ = hidden_states.shape
    d = indexer.head_dim
    idx_q = indexer.q_norm(indexer.q_proj(hidden_states).view(batch, q_len, -1, d)).transpose(1, 2)
    idx_k = indexer.k_norm(indexer.k_proj(hidden_states).view(batch, q_len, 1, d)).transpose(1, 2)
    cos, sin = position_embeddings
    return apply_rotary_pos_emb(idx_q, idx_k, cos[..., :d], sin[..., :d])


def oracle_block_scores(idx_q, idx_k, position_ids) -> torch.Tensor:
    """[B, H, S_q, blocks] float64: per query the max over each 128-key block of q . k over the
    keys j <= position (and < S_k); -inf where the block has none (the stock's definition)."""
    q, k = idx_q.double(), idx_k.double()
    scores = q @ k.transpose(-1, -2)                                        # [B, H, S_q, S_k]
    k_len = k.shape[2]
    future = torch.arange(k_len, device=k.device).view(1, 1, 1, -1) > position_ids.view(
        position_ids.shape[0], 1, -1, 1)
    scores = scores.masked_fill(future, float("-inf"))
    blocks = -(-k_len // BLOCK)
    scores = torch.nn.functional.pad(scores, (0, blocks * BLOCK - k_len), value=float("-inf"))
    return scores.view(*scores.shape[:3], blocks, BLOCK).amax(-1)


def forced_counts(position_ids, local_blocks: int, width: int, num_heads: int) -> torch.Tensor:
    """[B, H, S_q] number of forced blocks of each row: the distinct max(own - l, 0), l < local,
    capped at the row width."""
    own = torch.div(position_ids, BLOCK, rounding_mode="floor")
    count = torch.minimum(own + 1, torch.full_like(own, local_blocks)).clamp(min=0)
    count = count.clamp(max=width)
    return count.unsqueeze(1).expand(-1, num_heads, -1)


def canonical(selection: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """The forced prefix of each row sorted ascending (torch.topk leaves the order of its +inf
    ties unspecified); the rest as is."""
    in_prefix = torch.arange(selection.shape[-1]) < forced.unsqueeze(-1)
    big = torch.iinfo(selection.dtype).max
    prefix = torch.where(in_prefix, selection, big).sort(-1).values
    return torch.where(in_prefix, prefix, selection)


def check_row_against_oracle(row, scores, own: int, local_blocks: int, tol: float) -> None:
    """A selected row (ids, -1 tail) is a valid stock selection under the float64 scores of its
    (query, head): the forced blocks, then the best other blocks up to the own block, a block
    left out only when it is within tol of the cut, in descending score order (within tol)."""
    n = row.numel()
    ids = [int(x) for x in row if int(x) >= 0]
    assert all(int(x) < 0 for x in row[len(ids):]), f"-1 not at the tail: {row.tolist()}"
    assert len(set(ids)) == len(ids), f"duplicate ids: {row.tolist()}"
    forced = {max(own - l, 0) for l in range(local_blocks)}
    eligible = [b for b in range(min(own, scores.numel() - 1) + 1)
                if b not in forced and torch.isfinite(scores[b])]
    eligible.sort(key=lambda b: -float(scores[b]))
    keep = n - min(len(forced), n)
    assert len(ids) == min(n, min(len(forced), n) + len(eligible)), (row.tolist(), own)
    head = min(len(forced), n)
    assert set(ids[:head]) <= forced and (forced <= set(ids) or len(forced) > n), (
        row.tolist(), forced)                             # forced blocks first, all of them
    chosen = ids[head:]
    assert all(b <= own for b in chosen), (row.tolist(), own)
    if eligible[keep:keep + 1]:
        cut = float(scores[eligible[keep - 1]]) if keep else float("inf")
        for b in eligible:
            s = float(scores[b])
            if s > cut + tol:
                assert b in chosen, (row.tolist(), b, s, cut)
            if b in chosen:
                assert s >= cut - tol, (row.tolist(), b, s, cut)
    values = [float(scores[b]) for b in chosen]
    assert all(a >= b - tol for a, b in zip(values, values[1:])), (row.tolist(), values)


def assert_same_selection(ours, stock, position_ids, local_blocks: int, row_scores,
                          max_differing: float = 0.01, tol: float = 1e-4) -> int:
    """ours == stock row by row (forced prefixes compared as sets); rows that differ must each
    be a valid selection under the float64 scores row_scores(b, h, t) -> [blocks] (a near-tie at
    the cut) and be at most max_differing of all rows. Returns the number of differing rows."""
    assert ours.shape == stock.shape and ours.dtype == stock.dtype == torch.int64
    ours, stock, position_ids = ours.cpu(), stock.cpu(), position_ids.cpu()
    width = ours.shape[-1]
    forced = forced_counts(position_ids, local_blocks, width, ours.shape[1])
    differ = (canonical(ours, forced) != canonical(stock, forced)).any(-1)
    count = int(differ.sum())
    assert count <= max_differing * differ.numel(), f"{count} of {differ.numel()} rows differ"
    own = torch.div(position_ids, BLOCK, rounding_mode="floor")
    for b, h, t in differ.nonzero().tolist():
        scores = row_scores(b, h, t).cpu()
        scale = max(1.0, float(scores.nan_to_num(0.0, 0.0, 0.0).abs().max()))
        check_row_against_oracle(ours[b, h, t], scores, int(own[b, t]), local_blocks,
                                 tol * scale)
    return count


def row_oracle(idx_q, idx_k, position_ids):
    """row_scores(b, h, t) for assert_same_selection: float64 block scores of one query row
    (the stock index inputs, idx_q [B, H, S_q, D], idx_k [B, 1, S_k, D]), on their device."""
    def scores(b, h, t):
        q = idx_q[b, h, t:t + 1].unsqueeze(0).unsqueeze(0)
        return oracle_block_scores(q, idx_k[b:b + 1], position_ids[b:b + 1, t:t + 1])[0, 0, 0]
    return scores


def margin(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def assert_logits_close(logits, logits_ref, rel_tol: float = 2e-2, min_decisive: float = 0.5):
    """Relative error within rel_tol; argmax equal wherever the reference's top-2 margin exceeds
    twice the row's largest logit error (elsewhere rounding may flip a near-tie); at least
    min_decisive of the rows decisive. Returns (relative error, decisive fraction)."""
    logits, logits_ref = logits.float(), logits_ref.float()
    rel = float((logits - logits_ref).norm() / logits_ref.norm())
    assert rel < rel_tol, rel
    decisive = margin(logits_ref) > 2 * (logits - logits_ref).abs().amax(-1)
    fraction = float(decisive.float().mean())
    assert fraction > min_decisive, fraction
    assert torch.equal(logits.argmax(-1)[decisive], logits_ref.argmax(-1)[decisive])
    return rel, fraction


def assert_greedy_tokens_agree(gen, gen_ref, prompt_len: int):
    """Greedy continuations equal, or split only at a genuine near-tie: up to the first divergent
    step both runs saw the same tokens, so their logits there are comparable, and the
    reference's top-2 margin must be within twice their difference. Returns the number of
    identical new tokens."""
    out, out_ref = gen.sequences[0, prompt_len:], gen_ref.sequences[0, prompt_len:]
    same = out == out_ref
    if not same.all():
        step = int((~same).nonzero()[0])
        a, b = gen.logits[step][0].float(), gen_ref.logits[step][0].float()
        assert margin(b) <= 2 * (a - b).abs().max(), (out.tolist(), out_ref.tolist(), step)
    return int(same.sum())
