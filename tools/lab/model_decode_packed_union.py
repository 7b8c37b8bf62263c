#!/usr/bin/env python3
"""Warpgroup turns of the decode step's sparse attention at 4k-10k keys, union vs packed (no GPU).

What it answers (design-decode.md, Open): how many consumer-warpgroup turns a step's 128-row
tile (MTP 8 x G 16: four tokens a warpgroup) takes on the production protocol's selections,
today and in a packed form.

* Union (the ping-pong form today): every page of the union of the tile's tokens' selections
  is a turn of both warpgroups, whichever of their tokens selected it.
* Packed: a page that at most four tokens selected is one warpgroup's turn (those tokens' rows
  gathered into its 64 rows), else both warpgroups'.
* Swapped operands (`benchmarks/lab/decode_swap_ab_lab.cu`): each warpgroup keeps its four
  tokens and takes a page only when one of them selected it, paying per selected token (m64n16
  wgmmas); printed as its warpgroup-pages and the selected tokens each of them computes.

Selections as the protocol makes them (`bench_decode_production.py`): ragged lengths, pairs
nominal +- d with d uniform in [nominal / 20, nominal / 4]; token t of a request of L keys sits at
L - 8 + t; it selects its own block and topk - 1 of the blocks before it (random index keys:
a uniform sample), or all of them when fewer.

    python tools/lab/model_decode_packed_union.py [--kv 4000,5000,10000] [--requests 4000]
"""

from __future__ import annotations

import argparse
import random

BLOCK = 128
TOKENS = 8              # seqlen_q (1 + 7 MTP drafts)
TOKENS_PER_GROUP = 4    # 64 rows of a warpgroup at G 16


def request_turns(length: int, topk: int, rng: random.Random):
    """(union pages, union turns, packed turns, selected token-pages, swapped form's
    warpgroup-pages) of one (request, KV head)."""
    selections = []
    for t in range(TOKENS):
        own = (length - TOKENS + t) // BLOCK
        history = range(own)
        picked = set(rng.sample(history, min(topk - 1, own)))
        picked.add(own)
        selections.append(picked)
    union = set().union(*selections)
    counts = [sum(page in s for s in selections) for page in union]
    packed = sum(1 if c <= TOKENS_PER_GROUP else 2 for c in counts)
    groups = [set().union(*selections[g:g + TOKENS_PER_GROUP])
              for g in range(0, TOKENS, TOKENS_PER_GROUP)]
    return len(union), 2 * len(union), packed, sum(counts), sum(len(g) for g in groups)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="4000,5000,10000", help="nominal KV lengths")
    ap.add_argument("--requests", type=int, default=4000, help="sampled requests per length")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    print("nominal_kv\tunion_pages\tunion_turns\tpacked_turns\tpacked/union\t"
          "token_pages/4\tswapped_wg_pages\ttokens_a_swapped_wg_page")
    for nominal in (int(x) for x in args.kv.split(",")):
        sums = [0, 0, 0, 0, 0]
        for _ in range(args.requests):
            d = rng.randint(max(1, nominal // 20), max(1, nominal // 4))
            length = max(nominal + rng.choice((-d, d)), TOKENS)
            for i, x in enumerate(request_turns(length, args.topk, rng)):
                sums[i] += x
        union, turns, packed, token_pages, wg_pages = (x / args.requests for x in sums)
        print(f"{nominal}\t{union:.1f}\t{turns:.1f}\t{packed:.1f}\t{packed / turns:.2f}\t"
              f"{token_pages / TOKENS_PER_GROUP:.1f}\t{wg_pages:.1f}\t"
              f"{token_pages / wg_pages:.2f}")


if __name__ == "__main__":
    main()
