#!/usr/bin/env python3
"""Models of the decode kernel's token-warps form (no GPU needed).

csrc/decode_attention.cu, decode_attention_token_warps_kernel: a producer thread
copies each page of a tile's union list into a ring of TwLayout::kStages (6) raw pages (TMA:
the stage's full mbarrier completes when its one arrival and the copy's bytes are in), eight
consumer warps walk the same list, each waiting for every page's full barrier, computing only
the pages its tokens selected, and arriving on the stage's empty barrier (256 threads) when done
with it.

1. Protocol (`protocol`): random schedules check that nothing deadlocks, every computed page is
   the landed page of that ring position, no stage is refilled while a warp may still read its
   previous page, and every parity wait names the barrier's current or previous phase. With
   `wait_skipped=False` (a warp that did not select a page arrives on its empty barrier without
   waiting for the page) the model finds the race the kernel's comment names: a warp running a
   round ahead completes an empty phase early and the producer overwrites a page still read.
2. Balance (`balance`): the ring's drift window against the list order. A warp's page costs W
   issue cycles; two busy warps on one SM sub-partition share it (warps w and w + 4); a warp
   may run at most the ring's stages pages ahead of the slowest. Time over the ideal (each
   sub-partition busy with its two warps' 16 pages each), random top-16 selections of 8 tokens
   (own block last), for token-major, slot-major and block-sorted lists, and for a ring of two
   stages.

    python tools/lab/model_decode_token_warps.py
"""
import random

from model_decode_pingpong import Mbar as PhaseMbar

STAGES = 6        # TwLayout::kStages
WARPS = 8         # kTwConsumers


class Mbar(PhaseMbar):
    """An mbarrier (a full barrier's one arrival stands for its copy's bytes too) whose waits
    also say which round of the barrier they mean."""

    def done(self, parity, round_):
        """try_wait.parity for the waiter's `round_` of this barrier: only the current or the
        previous phase may be named (else the parity is ambiguous)."""
        assert self.phase in (round_, round_ + 1), (self.phase, round_)
        return super().done(parity)


def choices(rng, num_pages):
    """Each page's choosing warps: a random nonempty set of the tile's warps with rows."""
    active = rng.randint(1, WARPS)
    return [{w for w in range(active) if rng.random() < 0.5} or {rng.randrange(active)}
            for _ in range(num_pages)]


def landing(rng, in_flight, holds, bars, done):
    """TMA copies (slot, page) landing in order at random times: the slot holds the page and its
    full barrier completes."""
    while not (done() and not in_flight):
        if in_flight and rng.random() < 0.5:
            slot, e = in_flight.pop(0)
            holds[slot] = e
            bars[slot].arrive()
        yield


def schedule(rng, actors):
    """Runs the actors (generators) in a random interleaving until all finish."""
    steps = 0
    while actors:
        actor = rng.choice(actors)
        try:
            next(actor)
        except StopIteration:
            actors.remove(actor)
        steps += 1
        assert steps < 200000, "deadlock"


def protocol(num_pages, seed, wait_skipped=True):
    """One random schedule of one CTA streaming `num_pages` union pages, each selected by a
    random nonempty set of warps (warps without rows select none)."""
    rng = random.Random(seed)
    chosen = choices(rng, num_pages)
    full = [Mbar(1) for _ in range(STAGES)]
    empty = [Mbar(WARPS) for _ in range(STAGES)]          # a warp's 32 arrivals as one
    holds = [None] * STAGES                               # the page landed in each stage
    readers = [set() for _ in range(STAGES)]              # warps reading each stage now
    in_flight = []                                        # (stage, page) copies not landed

    def producer():
        for e in range(num_pages):
            idx, rnd = e % STAGES, e // STAGES
            while not empty[idx].done((rnd & 1) ^ 1, rnd - 1):   # a fresh barrier: at once
                yield
            assert not readers[idx], f"stage {idx} refilled while read by {readers[idx]}"
            holds[idx] = None
            in_flight.append((idx, e))
            yield

    def consumer(w):
        for e in range(num_pages):
            idx, rnd = e % STAGES, e // STAGES
            selected = w in chosen[e]
            if selected or wait_skipped:
                while not full[idx].done(rnd & 1, rnd):
                    yield
            if selected:
                assert holds[idx] == e, f"warp {w} read stage {idx}: {holds[idx]} for {e}"
                readers[idx].add(w)
                for _ in range(rng.randint(1, 3)):         # S, softmax, P.V
                    yield
                    assert holds[idx] == e, f"page {e} overwritten under warp {w}"
                readers[idx].discard(w)
            empty[idx].arrive()
            yield

    state = {"producer": False}

    def producer_wrapped():
        yield from producer()
        state["producer"] = True

    actors = [producer_wrapped(), landing(rng, in_flight, holds, full, lambda: state["producer"])]
    schedule(rng, actors + [consumer(w) for w in range(WARPS)])


def selections(num_blocks, rng, tokens=WARPS, topk=16):
    own = num_blocks - 1
    return [sorted(rng.sample(range(own), min(topk - 1, own))) + [own] for _ in range(tokens)]


def union(sel, order):
    if order == "token":
        seq = [b for s in sel for b in s]
    elif order == "slot":
        seq = [s[i] for i in range(max(map(len, sel))) for s in sel if i < len(s)]
    else:
        seq = sorted({b for s in sel for b in s})
    return list(dict.fromkeys(seq))


def balance(sel, pages, stages=STAGES, steps_per_page=64):
    """Time (in pages of one warp's work) for the warps to finish, the ring's window kept."""
    need = [set(s) for s in sel]
    pos = [0] * len(sel)
    left = [steps_per_page if pages[0] in need[w] else 0 for w in range(len(sel))]
    t = 0
    while min(pos) < len(pages):
        low = min(pos)
        busy = {}
        for w in range(len(sel)):
            if pos[w] < min(len(pages), low + stages) and left[w] > 0:
                busy.setdefault(w % 4, []).append(w)
        for w in range(len(sel)):
            if pos[w] >= min(len(pages), low + stages):
                continue
            if left[w] <= 0:
                pos[w] += 1
                if pos[w] < len(pages):
                    left[w] = steps_per_page if pages[pos[w]] in need[w] else 0
                continue
            left[w] -= 1 / len(busy[w % 4])
        t += 1
    return t / steps_per_page


def main():
    checks = (("per_warp", protocol, dict(wait_skipped=False),
               "without waiting for skipped pages"),)
    for name, model, mutation, what in checks:
        for num_pages in range(0, 20):
            for seed in range(40):
                model(num_pages, seed)
        caught = 0
        for seed in range(200):
            try:
                model(16, seed, **mutation)
            except AssertionError:
                caught += 1
        print(f"{name}: 800 schedules of 0-19 pages, no deadlock, no stale or overwritten read; "
              f"{what}, a violation in {caught} of 200")
    rng = random.Random(0)
    for blocks in (32, 40, 80, 800):
        cases = [selections(blocks, rng) for _ in range(5)]
        row = []
        for order in ("token", "slot", "sorted"):
            t = sum(balance(s, union(s, order)) for s in cases) / len(cases)
            row.append(f"{order} {t / 32:.2f}x")
        print(f"balance, {blocks} blocks, {STAGES} stages: " + ", ".join(row))
        t = sum(balance(s, union(s, "slot"), stages=2) for s in cases) / len(cases)
        print(f"balance, {blocks} blocks, 2 stages: slot {t / 32:.2f}x")


if __name__ == "__main__":
    main()
