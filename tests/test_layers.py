"""msa.layers against transformers' MiniMax-M3 (the CPU semantics; runs in CI).

The indexer layer must return what the stock MiniMaxM3VLIndexer returns (same ids in the same
order, the forced blocks' +inf ties compared as sets; a differing row is allowed only at a
float64 near-tie), for any chunking, batch, local-block count, position layout and through a
KV cache. The attention layer must give the logits and greedy tokens of the stock SDPA model,
which applies the same selection as a dense mask. The layers must pass the kernels library's
layer rules and swap in through kernels.kernelize: with a LocalLayerRepository on a built
variant, and with the one-call helper.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import msa
from msa import layers, prefill
from m3_testing import (assert_greedy_tokens_agree, assert_logits_close, assert_same_selection,
                        m3_config, m3_model, row_oracle, stock_index_inputs)
from test_indexer import dense_attention_from_selection

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
kernels = pytest.importorskip("kernels")

ROOT = Path(__file__).resolve().parents[1]
STOCK = {"MiniMaxM3VLIndexer": modeling.MiniMaxM3VLIndexer,
         "MiniMaxM3VLAttention": modeling.MiniMaxM3VLAttention}


def _indexer_case(*, batch, q_len, local_blocks, topk_blocks=4, dtype=torch.float32, seed=0,
                  positions=None):
    """A stock indexer with random weights, hidden states and rotary embeddings."""
    config = m3_config(topk_blocks=topk_blocks, local_blocks=local_blocks)
    model = m3_model(config, std=0.5, dtype=dtype, seed=seed)
    indexer = model.model.layers[1].self_attn.indexer
    hidden = torch.randn(batch, q_len, config.hidden_size).to(dtype)
    if positions is None:
        positions = torch.arange(q_len).unsqueeze(0).expand(batch, -1)
    position_embeddings = model.model.rotary_emb(hidden, positions)
    return model, indexer, hidden, positions, position_embeddings


def _run_both(indexer, hidden, position_embeddings, positions, caches=(None, None)):
    with torch.no_grad():
        stock = modeling.MiniMaxM3VLIndexer.forward(indexer, hidden, position_embeddings,
                                                   caches[0], positions)
        ours = layers.MiniMaxM3VLIndexer.forward(indexer, hidden, position_embeddings,
                                                 caches[1], positions)
    return ours, stock


def _oracle(indexer, hidden, position_embeddings, positions, history=None):
    """(row_scores for assert_same_selection, the index keys so far)."""
    with torch.no_grad():
        idx_q, idx_k = stock_index_inputs(indexer, hidden, position_embeddings)
    if history is not None:
        idx_k = torch.cat([history, idx_k], dim=2)
    return row_oracle(idx_q, idx_k, positions), idx_k


# ---------------------------------------------------------------------------------------------
# Layer rules
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(STOCK))
def test_layers_follow_the_kernels_layer_rules(name):
    layer, stock = getattr(layers, name), STOCK[name]
    assert issubclass(layer, torch.nn.Module)
    assert layer.__init__ is torch.nn.Module.__init__
    extra = {n for n, _ in inspect.getmembers(layer)} - {n for n, _ in
                                                          inspect.getmembers(torch.nn.Module)}
    assert extra == {"can_torch_compile", "has_backward"}
    assert layer.can_torch_compile is True and layer.has_backward is False
    ours = list(inspect.signature(layer.forward).parameters.values())
    theirs = list(inspect.signature(stock.forward).parameters.values())
    assert [p.kind for p in ours] == [p.kind for p in theirs]
    assert [p.name for p in ours] == [p.name for p in theirs]
    assert "layers" in msa.__all_additive__ and "layers" not in msa.__all__


def test_importing_msa_loads_neither_transformers_nor_kernels_nor_dynamo():
    code = ("import sys, torch; import msa; "
            "print(sorted(m for m in ('transformers', 'kernels', 'torch._dynamo') "
            "if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "torch-ext"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------------------------
# Indexer semantics
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch,q_len,local_blocks,topk_blocks,dtype,chunk_bytes", [
    (1, 700, 1, 4, torch.float32, None),
    (2, 700, 1, 4, torch.bfloat16, 9600),          # query chunks of 100 rows per request
    (1, 520, 0, 4, torch.float32, 4 * 2 * 5 * 128),
    (2, 300, 2, 4, torch.float32, None),
    (1, 900, 3, 4, torch.bfloat16, 40000),
    (1, 200, 1, 16, torch.float32, None),          # fewer blocks than the budget: n = 2
    (1, 1, 1, 4, torch.float32, None),
])
def test_indexer_matches_stock(monkeypatch, batch, q_len, local_blocks, topk_blocks, dtype,
                               chunk_bytes):
    if chunk_bytes is not None:
        monkeypatch.setattr(layers, "SCORE_CHUNK_BYTES", chunk_bytes)
    _, indexer, hidden, positions, pe = _indexer_case(batch=batch, q_len=q_len,
                                                      local_blocks=local_blocks,
                                                      topk_blocks=topk_blocks, dtype=dtype)
    ours, stock = _run_both(indexer, hidden, pe, positions)
    assert ours.shape == (batch, 2, q_len, min(topk_blocks, -(-q_len // 128)))
    oracle, _ = _oracle(indexer, hidden, pe, positions)
    assert_same_selection(ours, stock, positions, local_blocks, oracle)


@pytest.mark.parametrize("local_blocks", [0, 1])
def test_indexer_matches_stock_with_irregular_positions(monkeypatch, local_blocks):
    """Left padding (pads at position 1, then 0, 1, ...) and a shifted row: the causal rule and
    the own block follow position_ids, not the key slot; chunks of 128 queries."""
    monkeypatch.setattr(layers, "SCORE_CHUNK_BYTES", 4 * 2 * 6 * 2 * 128)
    q_len = 700
    positions = torch.arange(q_len).repeat(2, 1)
    positions[0, :37] = 1
    positions[0, 37:] = torch.arange(q_len - 37)
    positions[1, 300:] -= 90
    _, indexer, hidden, positions, pe = _indexer_case(batch=2, q_len=q_len,
                                                      local_blocks=local_blocks,
                                                      positions=positions)
    ours, stock = _run_both(indexer, hidden, pe, positions)
    oracle, _ = _oracle(indexer, hidden, pe, positions)
    assert_same_selection(ours, stock, positions, local_blocks, oracle)


def test_indexer_matches_stock_through_a_kv_cache():
    """Prefill, then decode steps: each layer appends its index keys to its own cache and the
    selections stay equal."""
    from transformers.cache_utils import DynamicCache
    model, indexer, hidden, positions, pe = _indexer_case(batch=2, q_len=400, local_blocks=1)
    caches = (DynamicCache(config=model.config), DynamicCache(config=model.config))
    history = None
    for step in range(4):
        if step:
            hidden = torch.randn(2, 1, hidden.shape[-1])
            positions = torch.full((2, 1), 399 + step)
            pe = model.model.rotary_emb(hidden, positions)
        oracle, history = _oracle(indexer, hidden, pe, positions, history)
        ours, stock = _run_both(indexer, hidden, pe, positions, caches)
        assert_same_selection(ours, stock, positions, 1, oracle)
        assert torch.equal(caches[0].layers[1].idx_keys, caches[1].layers[1].idx_keys)


def test_indexer_rejects_what_it_cannot_serve():
    _, indexer, hidden, positions, pe = _indexer_case(batch=1, q_len=200, local_blocks=1)
    indexer.block_size = 64
    with pytest.raises(ValueError, match="index_block_size"):
        layers.MiniMaxM3VLIndexer.forward(indexer, hidden, pe, None, positions)
    indexer.block_size = 128
    with pytest.raises(ValueError, match="position_ids"):
        layers.MiniMaxM3VLIndexer.forward(indexer, hidden, pe, None, positions[:, :10])
    with pytest.raises(TypeError, match="position_ids"):
        layers.MiniMaxM3VLIndexer.forward(indexer, hidden, pe, None, positions.float())


# ---------------------------------------------------------------------------------------------
# Whole model: the attention layer and the swap
# ---------------------------------------------------------------------------------------------

def _stock_and_kernelized(seed, **config):
    stock = m3_model(m3_config(**config), std=0.2, dtype=torch.bfloat16, seed=seed)
    ours = m3_model(m3_config(**config), dtype=torch.bfloat16)
    ours.load_state_dict(stock.state_dict())
    layers.kernelize_minimax_m3(ours)
    return stock, ours


def _replaced(model):
    """{module path: module name of the forward it runs} for the two swapped classes."""
    return {name: m.forward.__func__.__module__ for name, m in model.named_modules()
            if type(m).__name__ in layers.LAYER_NAMES}


def test_kernelized_model_matches_the_stock_sdpa_model(seed):
    stock, ours = _stock_and_kernelized(seed)
    assert set(_replaced(ours).values()) == {layers.__name__}
    assert set(_replaced(stock).values()) == {modeling.__name__}
    ids = torch.randint(3, 128, (1, 600))                  # 5 blocks > topk 4
    with torch.no_grad():
        rel, decisive = assert_logits_close(ours(ids).logits, stock(ids).logits)
        print(f"logits rel err {rel:.2e}, decisive rows {decisive:.3f}")
        gen = [m.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                          return_dict_in_generate=True) for m in (ours, stock)]
    print("identical greedy tokens:", assert_greedy_tokens_agree(gen[0], gen[1], ids.shape[1]))


def test_kernelized_model_batch_and_dense_fmha_path(monkeypatch, seed):
    """Two requests, and the dense layer through the package's FMHA: on a GPU with a native FMHA
    a causal prefill without a mask goes there; here arch_family is made to claim sm90 so the
    path runs (the FMHA call itself then takes the reference on the CPU)."""
    stock, ours = _stock_and_kernelized(seed)
    served = []
    real = layers.dense_causal_attention

    def spy(*args):
        served.append(args[0].shape)
        return real(*args)
    monkeypatch.setattr(layers._backend, "arch_family", lambda device: "sm90")
    monkeypatch.setattr(layers, "dense_causal_attention", spy)
    ids = torch.randint(3, 128, (2, 300))
    with torch.no_grad():
        assert_logits_close(ours(ids).logits, stock(ids).logits)
    assert served == [(2, 300, 8, 128)]


def _random_block_indices(batch, hkv, q_len, valid, width, gen):
    """[B, Hkv, S_q, width] int64 like the indexer's output: per (request, head, query at
    position valid - S_q + t) its own block first, then distinct earlier blocks, -1 tail."""
    own = (torch.arange(q_len) + valid - q_len) // 128
    blocks = -(-valid // 128)
    score = torch.rand(batch, hkv, q_len, blocks, generator=gen)
    score = score.masked_fill(torch.arange(blocks) > own.view(-1, 1), -1.0)
    score.scatter_(3, own.view(1, 1, -1, 1).expand(batch, hkv, -1, 1), 2.0)
    value, ids = score.topk(min(width, blocks), dim=3)
    ids = ids.masked_fill(value < 0, -1)
    return torch.nn.functional.pad(ids, (0, width - ids.shape[3]), value=-1)


def _layer_oracle(query, key, value, block_indices, valid, scale):
    """float64 [B, S_q, Hq, 128]: each request's queries on its first `valid` keys."""
    batch, q_len, num_heads, _ = query.shape
    outs = []
    for b in range(batch):
        q2k = block_indices[b].to(torch.int32)                         # [Hkv, S_q, n]
        outs.append(dense_attention_from_selection(
            query[b], key[b, :, :valid].transpose(0, 1), value[b, :, :valid].transpose(0, 1),
            q2k, [q_len], [valid], scale))
    return torch.stack(outs)


@pytest.mark.parametrize("batch,q_len,k_len,valid,heads_as_requests", [
    (1, 600, 600, 600, False),      # self prefill: K/V copied token-major
    (2, 300, 300, 300, False),
    (1, 300, 1000, 700, False),     # a StaticCache's unwritten tail (keys past 700 unused)
    (1, 200, 2000, 2000, True),     # a short chunk on a long cache: the cache read in place
    (1, 130, 1000, 800, True),
    (1, 1, 700, 700, True),         # decode
    (2, 3, 500, 500, True),
])
def test_sparse_attention_in_query_chunks_equals_one_call(monkeypatch, seed, batch, q_len,
                                                          k_len, valid, heads_as_requests):
    """The attention layer's sparse path in chunks of 128 query rows equals one call, on both
    packings of the cache, and matches the float64 masked attention on the selection."""
    gen = torch.Generator().manual_seed(seed)
    hkv, hq, width = 2, 8, 5                                        # topK 8, three slots -1
    draw = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16)  # noqa: E731
    query, key, value = draw(batch, q_len, hq, 128), draw(batch, hkv, k_len, 128), \
        draw(batch, hkv, k_len, 128)
    block_indices = _random_block_indices(batch, hkv, q_len, valid, width, gen)
    positions = torch.arange(valid - q_len, valid).expand(batch, -1)
    packed = []
    real = layers.sparse_atten_from_selection

    def spy(q, k, v, q2k, **kwargs):
        packed.append((k.shape[1], kwargs["workspace_bytes"]))
        return real(q, k, v, q2k, **kwargs)
    monkeypatch.setattr(layers, "sparse_atten_from_selection", spy)
    whole = layers.sparse_attention(query, key, value, block_indices, positions, 0.1)
    monkeypatch.setattr(layers, "ATTENTION_WORKSPACE_BYTES", 1)
    monkeypatch.setattr(prefill, "MIN_CHUNK_TOKENS", 128)
    chunked = layers.sparse_attention(query, key, value, block_indices, positions, 0.1)
    assert packed == [(1 if heads_as_requests else hkv, layers.DEFAULT_WORKSPACE_BYTES),
                      (1 if heads_as_requests else hkv, 1)]
    assert chunked.shape == (batch, q_len, hq, 128) and chunked.dtype == torch.bfloat16
    torch.testing.assert_close(chunked, whole, atol=1e-3, rtol=8e-3)
    ref = _layer_oracle(query, key, value, block_indices, valid, 0.1)
    torch.testing.assert_close(chunked.double(), ref, atol=2e-2, rtol=2e-2)


def test_kernelized_model_in_attention_chunks_matches_stock(monkeypatch, seed):
    """Tiny attention chunks (128 query rows) and projection steps (256 tokens) through the
    whole model: logits and greedy tokens of the stock SDPA model; decode steps read the cache
    in place (one KV head per request)."""
    stock, ours = _stock_and_kernelized(seed)
    monkeypatch.setattr(layers, "ATTENTION_WORKSPACE_BYTES", 1)
    monkeypatch.setattr(prefill, "MIN_CHUNK_TOKENS", 128)
    monkeypatch.setattr(layers, "PROJECTION_CHUNK_TOKENS", 256)
    calls = []
    real = layers.sparse_atten_from_selection

    def spy(q, k, v, q2k, **kwargs):
        calls.append((q.shape[0], k.shape[1]))
        return real(q, k, v, q2k, **kwargs)
    monkeypatch.setattr(layers, "sparse_atten_from_selection", spy)
    chunks = []
    real_chunk = prefill.run_chunk
    monkeypatch.setattr(prefill, "run_chunk",
                        lambda chunk, *a, **k: chunks.append(chunk) or real_chunk(chunk, *a, **k))
    ids = torch.randint(3, 128, (1, 600))
    with torch.no_grad():
        assert_logits_close(ours(ids).logits, stock(ids).logits)
        assert calls == [(600, 2)] * 2 and len(chunks) == 2 * 5        # two sparse layers
        # min_new_tokens: an EOS drawn by the random model must not end generation early.
        gen = [m.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
               for m in (ours, stock)]
    # generate: the prompt, then 5 decode steps x 2 layers of 2 (request, KV head) rows.
    assert calls[2:] == [(600, 2)] * 2 + [(2, 1)] * 2 * 5
    print("identical greedy tokens:", assert_greedy_tokens_agree(gen[0], gen[1], ids.shape[1]))


def test_kernelize_with_a_local_layer_repository(tmp_path, seed):
    """The documented kernels flow on a built variant: replace_kernel_forward_from_hub on the
    transformers classes, then kernelize with LocalLayerRepository mappings."""
    build = subprocess.run([sys.executable, str(ROOT / "tools" / "build_variant.py"), "--out",
                            str(tmp_path / "build"), "--no-compile", "--id", "tlayers1"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    stock = m3_model(m3_config(), std=0.2, dtype=torch.bfloat16, seed=seed)
    ours = m3_model(m3_config(), dtype=torch.bfloat16)
    ours.load_state_dict(stock.state_dict())
    mapping = {}
    for name, cls in STOCK.items():
        kernels.replace_kernel_forward_from_hub(cls, name)
        mapping[name] = {"cpu": kernels.LocalLayerRepository(repo_path=tmp_path, layer_name=name)}
    with kernels.use_kernel_mapping(mapping):
        kernels.kernelize(ours, mode=kernels.Mode.INFERENCE, device="cpu", use_fallback=False)
    loaded = set(_replaced(ours).values())
    assert len(loaded) == 1, loaded                    # the variant's module, imported by kernels
    assert Path(sys.modules[loaded.pop()].__file__).is_relative_to(tmp_path / "build")
    ids = torch.randint(3, 128, (1, 400))
    with torch.no_grad():
        assert_logits_close(ours(ids).logits, stock(ids).logits)


def test_kernelize_modes(seed):
    """A TORCH_COMPILE mode keeps the layers (can_torch_compile); TRAINING keeps the model's own
    forwards (no backward); a model without an M3 indexer is refused by name."""
    model = m3_model(m3_config(), dtype=torch.bfloat16, seed=seed)
    layers.kernelize_minimax_m3(model, mode=kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE)
    assert set(_replaced(model).values()) == {layers.__name__}
    model = m3_model(m3_config(), dtype=torch.bfloat16)
    layers.kernelize_minimax_m3(model, mode=kernels.Mode.TRAINING)
    assert set(_replaced(model).values()) == {modeling.__name__}
    with pytest.raises(ValueError, match="model: no MiniMaxM3VLIndexer"):
        layers.kernelize_minimax_m3(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_kernelized_model_under_torch_compile(seed):
    """torch.compile (the eager backend here: Dynamo's tracing without a C++ toolchain) runs the
    package calls between graphs and gives the eager result."""
    _, ours = _stock_and_kernelized(seed)
    ids = torch.randint(3, 128, (1, 300))
    with torch.no_grad():
        eager = ours(ids).logits
        compiled = torch.compile(ours, backend="eager")(ids).logits
    assert torch.equal(compiled, eager)


def test_attention_layer_rejects_what_it_cannot_serve(seed):
    model = m3_model(m3_config(), dtype=torch.float32, seed=seed)
    layers.kernelize_minimax_m3(model)
    with torch.no_grad(), pytest.raises(TypeError, match="query: .* bf16"):
        model(torch.randint(3, 128, (1, 200)))
    model = m3_model(m3_config(topk_blocks=40, layer_types=("minimax_m3_sparse",),
                               max_positions=8192), dtype=torch.bfloat16)
    layers.kernelize_minimax_m3(model)
    with torch.no_grad(), pytest.raises(ValueError, match="index_topk_blocks"):
        model(torch.randint(3, 128, (1, 33 * 128 + 5)))     # 34 blocks: 40 -> 34 > 32
    query = torch.randn(1, 200, 8, 128).to(torch.bfloat16)
    key = torch.randn(1, 2, 200, 128).to(torch.bfloat16)
    three_heads = torch.zeros(1, 3, 200, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="index_n_heads: .* one index head per KV head"):
        layers.sparse_attention(query, key, key, three_heads, torch.arange(200)[None], 0.1)
