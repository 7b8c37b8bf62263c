#!/usr/bin/env python3
"""Models of the decode kernel's token-warps forms (no GPU needed).

csrc/decode_attention.cu, decode_attention_token_warps_kernel<kTwPerWarp>: a producer thread
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
   `protocol_once` models kTwOnce: the producer warpgroup widening each raw TMA page into an
   f16 stage the warps read; without the widening barrier before the raw slot's refill it finds
   a raw page overwritten under a widening thread.
2. Balance (`balance`): the ring's drift window against the list order. A warp's page costs W
   issue cycles; two busy warps on one SM sub-partition share it (warps w and w + 4); a warp
   may run at most the ring's stages pages ahead of the slowest. Time over the ideal (each
   sub-partition busy with its two warps' 16 pages each), random top-16 selections of 8 tokens
   (own block last), for token-major, slot-major and block-sorted lists, and for kTwOnce's two
   f16 stages.

    python tools/lab/model_decode_token_warps.py
"""
import random

from model_decode_pingpong import Mbar as PhaseMbar

STAGES = 6        # TwLayout<kTwPerWarp>::kStages
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


WIDEN_THREADS = 3   # kTwOnce's producer warpgroup, as a few threads
RAW_STAGES = 2      # kTwOnce: raw TMA slots ahead of the widening (TwLayout::kRawStages)
WIDE_STAGES = 2     # kTwOnce: f16 stages the consumers read (TwLayout::kStages)


def protocol_once(num_pages, seed, barrier=True):
    """kTwOnce: thread 0 of the producer warpgroup copies pages into RAW_STAGES raw slots (TMA:
    they land later on the slots' full barriers), every producer thread waits for the raw page
    and for the f16 stage's empty barrier, widens its share of the page into the stage, arrives
    on the stage's full barrier (one arrival a thread) and meets the others at the widening
    barrier, after which thread 0 refills the raw slot with page e + RAW_STAGES; the consumers
    wait for every stage, read the ones their warp chose and arrive on its empty barrier. With
    `barrier=False` thread 0 refills the slot as soon as it has widened its own share."""
    rng = random.Random(seed)
    chosen = choices(rng, num_pages)
    raw_full = [Mbar(1) for _ in range(RAW_STAGES)]
    full = [Mbar(WIDEN_THREADS) for _ in range(WIDE_STAGES)]
    empty = [Mbar(WARPS) for _ in range(WIDE_STAGES)]
    raw_holds = [None] * RAW_STAGES                 # the page landed in each raw slot
    raw_readers = [set() for _ in range(RAW_STAGES)]
    wide_parts = [dict() for _ in range(WIDE_STAGES)]   # thread -> page it widened there
    readers = [set() for _ in range(WIDE_STAGES)]
    in_flight = []
    meet = {"gen": 0, "count": 0}

    def copy(e):
        slot = e % RAW_STAGES
        assert not raw_readers[slot], f"raw slot {slot} refilled while read by {raw_readers[slot]}"
        raw_holds[slot] = None
        in_flight.append((slot, e))

    def widener(th):
        if th == 0:
            for e in range(min(num_pages, RAW_STAGES)):
                copy(e)
        for e in range(num_pages):
            slot, raw_round = e % RAW_STAGES, e // RAW_STAGES
            idx, rnd = e % WIDE_STAGES, e // WIDE_STAGES
            while not raw_full[slot].done(raw_round & 1, raw_round):
                yield
            while not empty[idx].done((rnd & 1) ^ 1, rnd - 1):
                yield
            assert raw_holds[slot] == e, f"thread {th} widened {raw_holds[slot]} for page {e}"
            assert not readers[idx], f"stage {idx} rewritten while read by {readers[idx]}"
            raw_readers[slot].add(th)
            yield                                          # reading the raw page, writing f16
            assert raw_holds[slot] == e, f"raw page {e} overwritten under thread {th}"
            raw_readers[slot].discard(th)
            wide_parts[idx][th] = e
            full[idx].arrive()
            if barrier:
                target = meet["gen"] + 1
                meet["count"] += 1
                if meet["count"] == WIDEN_THREADS:
                    meet["count"] = 0
                    meet["gen"] += 1
                while meet["gen"] < target:
                    yield
            if th == 0 and e + RAW_STAGES < num_pages:
                copy(e + RAW_STAGES)
            yield

    def consumer(w):
        for e in range(num_pages):
            idx, rnd = e % WIDE_STAGES, e // WIDE_STAGES
            while not full[idx].done(rnd & 1, rnd):
                yield
            if w in chosen[e]:
                assert all(wide_parts[idx].get(th) == e for th in range(WIDEN_THREADS)), \
                    f"warp {w} read stage {idx} not (wholly) page {e}: {wide_parts[idx]}"
                readers[idx].add(w)
                for _ in range(rng.randint(1, 3)):
                    yield
                    assert all(wide_parts[idx].get(th) == e for th in range(WIDEN_THREADS))
                readers[idx].discard(w)
            empty[idx].arrive()
            yield

    finished = set()

    def wrapped(th):
        yield from widener(th)
        finished.add(th)

    actors = [wrapped(th) for th in range(WIDEN_THREADS)]
    actors += [landing(rng, in_flight, raw_holds, raw_full,
                       lambda: len(finished) == WIDEN_THREADS)]
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
               "without waiting for skipped pages"),
              ("once", protocol_once, dict(barrier=False),
               "with the raw slot refilled before the widening barrier"))
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
        t = sum(balance(s, union(s, "slot"), stages=WIDE_STAGES) for s in cases) / len(cases)
        print(f"balance, {blocks} blocks, {WIDE_STAGES} stages (widened once): slot {t / 32:.2f}x")


if __name__ == "__main__":
    main()
