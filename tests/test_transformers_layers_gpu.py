"""msa.layers in a random-weight MiniMax-M3-shaped transformers model on the GPU.

Model: 64 query heads, 4 KV heads, head_dim 128, 4 index heads, top-16 blocks of 128 (own block
forced), one full-attention layer then three sparse layers, bf16.

* 4k-32k (MSA_M3_LENGTHS): the kernelized model (msa.layers.kernelize_minimax_m3 on an "sdpa"
  model: no private flag, no attn_implementation string) against the stock model on
  transformers' own MSA route (attn_implementation="MiniMaxAI/msa@v0" from the local build,
  SM100 gate lifted with _msa_validated, stock indexer): the first sparse layer's selection on
  identical inputs, logits, and 32 greedy tokens. Peak memory and time of both are printed.
* 128k-512k (MSA_M3_LONG): the kernelized model alone (the stock indexer would need 256 GB at
  128k): finite logits, the selection's invariants, peak memory (within docs/transformers.md's
  formula) and time printed.
* The sparse attention layer in query chunks (a tiny ATTENTION_WORKSPACE_BYTES) against one
  chunk and float64, on both packings of the cache (token-major K/V; the cache read in place
  for decode and short chunks on a long cache).
* torch.compile: the whole kernelized model at 8k against eager; the decoder layers compiled
  one by one (transformers traces a dense [S, S] SDPA mask when the mask creation itself is
  compiled) at MSA_M3_COMPILE_LONG (128k).

Run alone (one process; the long cases need most of the H200): see docs/transformers.md.
"""

import os
import time
from pathlib import Path

import pytest
import torch

from m3_testing import (BLOCK, assert_greedy_tokens_agree, assert_logits_close,
                        assert_same_selection, m3_config, m3_model, row_oracle,
                        stock_index_inputs)

pytestmark = [pytest.mark.gpu]

ROOT = Path(__file__).resolve().parents[1]


def _lengths(name, default):
    text = os.environ.get(name, default)
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


LENGTHS = _lengths("MSA_M3_LENGTHS", "4k,16k,32k")
LONG = _lengths("MSA_M3_LONG", "128k,256k,512k")
COMPILE_LONG = _lengths("MSA_M3_COMPILE_LONG", "128k")


def _config():
    return m3_config(hidden_size=1024, num_heads=64, num_kv_heads=4, index_heads=4,
                     topk_blocks=16, local_blocks=1, vocab_size=1024, max_positions=600_000,
                     layer_types=("full_attention",) + ("minimax_m3_sparse",) * 3)


@pytest.fixture(scope="module")
def modules():
    pytest.importorskip("transformers")
    pytest.importorskip("kernels")
    import msa
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as modeling
    return msa, modeling


def _kernelized(msa, state=None, seed=None):
    model = m3_model(_config(), dtype=torch.bfloat16, device="cuda", seed=seed)
    if state is not None:
        model.load_state_dict(state)
    return msa.layers.kernelize_minimax_m3(model)


def _stock_msa_route(state):
    """The stock model on transformers' MSA route (this repository's local build)."""
    if not any((ROOT / "build").glob("*/metadata.json")):
        pytest.skip("no local build: run tools/build_variant.py first")
    os.environ["LOCAL_KERNELS"] = f"MiniMaxAI/msa={ROOT}"
    from transformers.integrations.hub_kernels import allow_all_hub_kernels
    with allow_all_hub_kernels():
        model = m3_model(_config(), attn_implementation="MiniMaxAI/msa@v0", dtype=torch.bfloat16,
                         device="cuda")
    model.load_state_dict(state)
    for m in model.modules():
        if getattr(m, "indexer", None) is not None:
            m._msa_validated = True             # transformers gates its MSA route on SM100
    return model


def _timed(fn):
    """(result, seconds, peak GiB allocated during fn)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2 ** 30


def _capture_first_indexer(model):
    """A dict that receives the first sparse layer's indexer inputs and output on each call."""
    seen = {}
    indexer = model.model.layers[1].self_attn.indexer

    def hook(module, args, output):
        seen.update(args=args, output=output)
    indexer.register_forward_hook(hook)
    return seen


def _expect_native(msa, ops):
    backends = {op: msa._backend.last_backend(op) for op in ops}
    print("backends:", backends)
    if os.environ.get("MSA_EXPECT_NATIVE") == "1":
        assert all(b == "sm90" for b in backends.values()), backends


@pytest.mark.parametrize("length", LENGTHS)
def test_kernelized_matches_the_stock_msa_route(modules, length):
    msa, modeling = modules
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    ours = _kernelized(msa)
    stock = _stock_msa_route(ours.state_dict())
    captured = _capture_first_indexer(stock)
    ids = torch.randint(3, 1024, (1, length), device="cuda")

    logits_ref, t_ref, peak_ref = _timed(lambda: stock(ids).logits)
    # The first sparse layer's selection on the stock model's own inputs.
    indexer = stock.model.layers[1].self_attn.indexer
    hidden, pe, _cache, positions = captured["args"]
    with torch.no_grad():
        selection = msa.layers.MiniMaxM3VLIndexer.forward(indexer, hidden, pe, None, positions)
        idx_q, idx_k = stock_index_inputs(indexer, hidden, pe)
    differ = assert_same_selection(selection, captured["output"], positions, 1,
                                   row_oracle(idx_q, idx_k, positions), max_differing=1e-3)
    logits, t_ours, peak_ours = _timed(lambda: ours(ids).logits)
    print(f"{length}: stock {t_ref:.3f} s / {peak_ref:.1f} GiB peak, kernelized {t_ours:.3f} s "
          f"/ {peak_ours:.1f} GiB; first sparse layer rows differing from stock: {differ}")
    _expect_native(msa, ["block_max_scores", "sparse_topk_select", "build_k2q_csr",
                         "sparse_atten", "fmha_dense"])
    rel, decisive = assert_logits_close(logits, logits_ref)
    print(f"logits rel err {rel:.2e}, decisive rows {decisive:.3f}")
    del logits, logits_ref

    kwargs = dict(max_new_tokens=32, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        gen_ref = stock.generate(ids, **kwargs)
        gen = ours.generate(ids, **kwargs)
    print(f"identical greedy tokens: {assert_greedy_tokens_agree(gen, gen_ref, length)}/32")


def _check_selection(selection, positions):
    """Invariants of an M3 selection [B, H, S, 16]: the own block first, ids up to it, unique,
    -1 only at the tail."""
    own = torch.div(positions, BLOCK, rounding_mode="floor").unsqueeze(1)       # [B, 1, S]
    assert torch.equal(selection[..., 0], own.expand_as(selection[..., 0]))
    valid = selection >= 0
    assert bool((selection <= own.unsqueeze(-1)).all())
    assert bool((valid[..., 1:] <= valid[..., :-1]).all())                   # -1 at the tail
    expected = torch.clamp(own + 1, max=selection.shape[-1]).expand_as(selection[..., 0])
    assert torch.equal(valid.sum(-1), expected)
    ordered = selection.masked_fill(~valid, -1).sort(-1).values
    assert bool(((ordered[..., 1:] != ordered[..., :-1]) | (ordered[..., 1:] < 0)).all())


def _peak_estimate_gib(msa, model, length):
    """docs/transformers.md's peak formula for one sequence through this model (the cache and
    the model's activations, then the largest layer: a sparse layer's Q, O, token-major K/V
    copies, selection and one attention chunk's workspace)."""
    config = model.config
    t, hq, hkv, d = length, config.num_attention_heads, config.num_key_value_heads, 128
    n = config.index_topk_blocks
    sparse = sum(kind == "minimax_m3_sparse" for kind in config.layer_types)
    per_query = msa.prefill.workspace_bytes_per_query(
        num_qo_heads=hq, num_kv_heads=hkv, topk=n, max_k_tiles=0, partial_dtype=torch.bfloat16)
    chunk = msa.prefill.chunk_tokens(t, per_query, msa.layers.ATTENTION_WORKSPACE_BYTES)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = len(config.layer_types) * 4 * t * hkv * d + sparse * 2 * t * d
    activations = 3 * t * config.hidden_size * 2 + 2 * t * d * 2
    layer = 4 * t * hq * d + 4 * t * hkv * d + 16 * t * hkv * n + min(t, chunk) * per_query
    return (weights + cache + activations + layer) / 2 ** 30


@pytest.mark.parametrize("length", LONG)
def test_kernelized_long_context(modules, length):
    msa, _ = modules
    torch.cuda.empty_cache()
    model = _kernelized(msa, seed=int.from_bytes(os.urandom(4), "little"))
    captured = _capture_first_indexer(model)
    ids = torch.randint(3, 1024, (1, length), device="cuda")
    logits, seconds, peak = _timed(lambda: model(ids).logits)
    estimate = _peak_estimate_gib(msa, model, length)
    print(f"{length} tokens: {seconds:.2f} s (first call), {peak:.1f} GiB peak allocated "
          f"(formula: {estimate:.1f} GiB)")
    # Bounded: the attention's partials alone would be ~266 KB per token unchunked (139 GB at
    # 512k); the formula holds within allocator and transformers slack.
    assert peak <= 1.2 * estimate + 2, (peak, estimate)
    _expect_native(msa, ["block_max_scores", "sparse_topk_select", "build_k2q_csr",
                         "sparse_atten", "fmha_dense"])
    assert logits.shape == (1, length, 1024)
    assert bool(torch.isfinite(logits).all())
    _check_selection(captured["output"], captured["args"][3])
    _, seconds, _ = _timed(lambda: model(ids).logits)
    print(f"{length} tokens: {seconds:.2f} s (second call)")


def _sampled_oracle(query, key, value, block_indices, valid, scale, rows):
    """float64 [len(rows), Hq, 128] for (request, query) rows: the query's selected blocks of
    its request's first `valid` keys, bottom-right causal."""
    _, q_len, num_heads, dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    slots = torch.arange(valid, device=query.device)
    out = []
    for b, t in rows:
        heads = []
        for h in range(num_kv_heads):
            sel = block_indices[b, h, t]
            mask = (slots // BLOCK).unsqueeze(1).eq(sel[sel >= 0].unsqueeze(0)).any(1)
            mask &= slots <= t + valid - q_len
            q = query[b, t, h * group:(h + 1) * group].double()               # [G, D]
            s = (q @ key[b, h, :valid].double().T) * scale                      # [G, valid]
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
            heads.append(p @ value[b, h, :valid].double())
        out.append(torch.cat(heads))
    return torch.stack(out)


@pytest.mark.parametrize("batch,q_len,k_len,valid,heads_as_requests", [
    (1, 16384, 16384, 16384, False),     # self prefill: K/V copied token-major
    (2, 4096, 4096, 4096, False),
    (1, 2048, 65536, 61000, True),       # a chunk on a long static cache: read in place
    (2, 1, 32768, 32768, True),          # decode
])
def test_sparse_attention_layer_chunks_and_packings(modules, monkeypatch, native_hooks, batch,
                                                    q_len, k_len, valid, heads_as_requests):
    """The layer's sparse attention with a tiny workspace (chunks of 1024 query rows) equals
    the one-chunk call, and both match float64 on sampled rows; M3 heads, random selections
    with the own block first, native kernels, outputs poisoned."""
    msa, _ = modules
    native_hooks.poison()
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    hq, hkv, width = 64, 4, 16
    draw = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(  # noqa: E731
        torch.bfloat16)
    query, key, value = draw(batch, q_len, hq, 128), draw(batch, hkv, k_len, 128), \
        draw(batch, hkv, k_len, 128)
    own = (torch.arange(q_len, device="cuda") + valid - q_len) // BLOCK
    blocks = -(-valid // BLOCK)
    score = torch.rand(batch, hkv, q_len, blocks, generator=gen, device="cuda")
    score = score.masked_fill(torch.arange(blocks, device="cuda") > own.view(-1, 1), -1.0)
    score.scatter_(3, own.view(1, 1, -1, 1).expand(batch, hkv, -1, 1), 2.0)
    value_top, block_indices = score.topk(min(width, blocks), dim=3)
    block_indices = block_indices.masked_fill(value_top < 0, -1)
    del score
    positions = torch.arange(valid - q_len, valid, device="cuda").expand(batch, -1)
    packed = []
    real = msa.layers.sparse_atten_from_selection

    def spy(q, k, v, q2k, **kwargs):
        packed.append(k.shape[1])
        return real(q, k, v, q2k, **kwargs)
    monkeypatch.setattr(msa.layers, "sparse_atten_from_selection", spy)
    whole = msa.layers.sparse_attention(query, key, value, block_indices, positions, 0.088)
    _expect_native(msa, ["build_k2q_csr", "sparse_atten"])
    monkeypatch.setattr(msa.layers, "ATTENTION_WORKSPACE_BYTES", 1)
    chunked = msa.layers.sparse_attention(query, key, value, block_indices, positions, 0.088)
    assert packed == [1 if heads_as_requests else hkv] * 2
    torch.testing.assert_close(chunked, whole, atol=1e-3, rtol=8e-3)
    rows = [(b, t) for b in range(batch) for t in {0, q_len - 1, *torch.randint(
        q_len, (6,), generator=gen, device="cuda").tolist()}]
    ref = _sampled_oracle(query, key, value, block_indices, valid, 0.088, rows)
    got = torch.stack([chunked[b, t] for b, t in rows]).double()
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_kernelized_torch_compile(modules):
    import kernels
    msa, _ = modules
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = m3_model(_config(), dtype=torch.bfloat16, device="cuda")
    msa.layers.kernelize_minimax_m3(model, mode=kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE)
    ids = torch.randint(3, 1024, (1, 8192), device="cuda")
    eager, _, _ = _timed(lambda: model(ids).logits)
    compiled_model = torch.compile(model)
    compiled, seconds, _ = _timed(lambda: compiled_model(ids).logits)
    print(f"8k whole-model compile: first call {seconds:.1f} s")
    assert_logits_close(compiled, eager)
    del compiled_model, compiled, eager

    for layer in model.model.layers:
        layer.compile()
    for length in COMPILE_LONG:
        ids = torch.randint(3, 1024, (1, length), device="cuda")
        logits, seconds, peak = _timed(lambda: model(ids).logits)
        print(f"{length} tokens, compiled decoder layers: {seconds:.1f} s (with compilation), "
              f"{peak:.1f} GiB peak")
        assert bool(torch.isfinite(logits).all())
        _, seconds, _ = _timed(lambda: model(ids).logits)
        print(f"{length} tokens, compiled decoder layers: {seconds:.2f} s (second call)")
