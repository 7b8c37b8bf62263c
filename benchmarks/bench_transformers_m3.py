"""transformers MiniMax-M3 prefill, stock against kernelized (msa.layers): time and peak memory.

A random-weight MiniMax-M3 text model with M3's attention shapes (64 query heads, 4 KV heads,
head_dim 128, 4 index heads, top-16 blocks of 128 with the own block forced), hidden size 1024,
dense MLPs, bf16, one forward over a single sequence (logits for the last token only):

  stock       transformers as shipped. CUDA: its MSA hub-kernel route (attn_implementation
              "MiniMaxAI/msa@v0" loaded from this repository's build through LOCAL_KERNELS, the
              SM100 gate lifted with _msa_validated), the stock indexer (an fp32 [S x S] score
              matrix per index head) and SDPA on the full-attention layers. CPU (--tiny): the
              SDPA model (its MSA route needs CUDA).
  kernelized  the same weights after msa.layers.kernelize_minimax_m3: the package's indexer and
              top-k, block-sparse attention, and its dense FMHA on the full-attention layers.

--models lists layer mixes as "<full>+<sparse>" (M3 itself: 3 full-attention layers of 60).
latency_ms is the median of --reps timed forwards after one warm-up; peak_gib is
torch.cuda.max_memory_allocated over one forward (weights included). A run that does not fit
gives a row with the OOM in its note. The acceptance of issue 26 at 64k: kernelized >= 3x faster,
peak <= 1/5 of stock's.

    python benchmarks/bench_transformers_m3.py --out benchmarks/results/transformers_m3_h200.tsv
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from _common import (GIB, ROOT, TsvWriter, add_common_args, apply_preset, load_msa,
                     parse_names, parse_sizes, setup, synchronize)

COLUMNS = ("model", "seq_len", "impl", "latency_ms", "peak_gib", "speedup_vs_stock",
           "peak_ratio_vs_stock", "note")
IMPLS = ("stock", "kernelized")


def config(args, full: int, sparse: int):
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import \
        MiniMaxM3VLTextConfig
    n = full + sparse
    return MiniMaxM3VLTextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden,
        dense_intermediate_size=2 * args.hidden, shared_intermediate_size=args.hidden,
        num_hidden_layers=n, num_attention_heads=args.hq, num_key_value_heads=args.hkv,
        head_dim=128, mlp_layer_types=["dense"] * n,
        layer_types=["full_attention"] * full + ["minimax_m3_sparse"] * sparse,
        index_n_heads=args.hkv, index_head_dim=128, index_block_size=128,
        index_topk_blocks=args.topk, index_local_blocks=1,
        max_position_embeddings=max(args.seq) + 1024, num_local_experts=4,
        num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build(msa, impl: str, args, mix, device, state=None):
    """(model, note) for impl; the weights are random (seeded) or `state`."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM
    attn = "sdpa"
    if impl == "stock" and device.type == "cuda":
        os.environ.setdefault("LOCAL_KERNELS", f"MiniMaxAI/msa={ROOT}")
        attn = "MiniMaxAI/msa@v0"
    if attn != "sdpa":
        from transformers.integrations.hub_kernels import allow_all_hub_kernels
        with allow_all_hub_kernels():
            model = MiniMaxM3VLForCausalLM._from_config(config(args, *mix),
                                                        attn_implementation=attn)
    else:
        model = MiniMaxM3VLForCausalLM._from_config(config(args, *mix), attn_implementation=attn)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    if state is not None:
        model.load_state_dict(state)
    if impl == "kernelized":
        msa.layers.kernelize_minimax_m3(model)
        return model, "msa.layers"
    if attn != "sdpa":
        for m in model.modules():
            if getattr(m, "indexer", None) is not None:
                m._msa_validated = True
        return model, "transformers MSA route"
    return model, "transformers SDPA"


def measure(model, ids, reps: int, device):
    """(median ms, peak GiB) of model(ids) prefills."""
    def forward():
        with torch.no_grad():
            return model(ids, logits_to_keep=1, use_cache=False).logits
    forward()
    synchronize(device)
    samples = []
    for i in range(reps):
        if device.type == "cuda" and i == reps - 1:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        forward()
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return statistics.median(samples), peak


def free(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, rep_ms=0)
    parser.add_argument("--seq", type=parse_sizes, default=parse_sizes("64k"),
                        help="sequence lengths (default 64k)")
    parser.add_argument("--models", type=parse_names, default=parse_names("1+3,1+7"),
                        help="layer mixes <full>+<sparse> (default 1+3,1+7)")
    parser.add_argument("--impls", type=parse_names, default=list(IMPLS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--hq", type=int, default=64)
    parser.add_argument("--hkv", type=int, default=4)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    apply_preset(args, parser, **({"seq": [600], "models": ["1+1"], "hidden": 64, "hq": 8,
                                   "hkv": 2, "topk": 4, "vocab": 128, "reps": 1}
                                  if args.tiny else {}))
    device = setup(args)
    msa = load_msa()
    writer = TsvWriter(args.out, COLUMNS, device,
                       formats={"latency_ms": ".1f", "peak_gib": ".2f",
                                "speedup_vs_stock": ".2f", "peak_ratio_vs_stock": ".3f"})
    for mix_text in args.models:
        mix = tuple(int(x) for x in mix_text.split("+"))
        for seq in args.seq:
            ids = torch.randint(3, args.vocab, (1, seq), device=device)
            state, results = None, {}
            for impl in [i for i in IMPLS if i in args.impls]:
                model = None
                try:
                    model, note = build(msa, impl, args, mix, device, state)
                    state = state or {k: v.clone() for k, v in model.state_dict().items()}
                    ms, peak = measure(model, ids, args.reps, device)
                except torch.OutOfMemoryError as exc:
                    ms, peak, note = None, None, f"OOM: {str(exc).splitlines()[0][:120]}"
                results[impl] = (ms, peak)
                base_ms, base_peak = results.get("stock", (None, None))
                speedup = base_ms / ms if impl != "stock" and ms and base_ms else None
                ratio = peak / base_peak if impl != "stock" and peak and base_peak else None
                writer.write(model=f"{mix[0]}full+{mix[1]}sparse h{args.hidden}", seq_len=seq,
                             impl=impl, latency_ms=ms, peak_gib=peak, speedup_vs_stock=speedup,
                             peak_ratio_vs_stock=ratio, note=note)
                del model
                free(device)


if __name__ == "__main__":
    main()
