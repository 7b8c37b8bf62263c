#!/usr/bin/env python3
"""Protocol model of the persistent sparse prefill forms "wsp" / "wsp3w" (no GPU needed).

cute_kernels/sparse_prefill_sm90_ws.py, persistent=True: CTAS CTAs share one work queue of
items, each a K/V block and n_tiles 64-row Q tiles. CTA c starts on item c and fetches its next
items as CTAS + an atomic add on the item counter.

* Producer warpgroup, LOADERS threads (modelled per warp): per item, warp 0 fetches the CTA's
  next item (the atomic); every warp waits for the K/V stage (item % KV_STAGES) to be empty,
  warp 0 writes the item's number beside the stage, every warp issues its share of the K and
  V copies (they land later) and arrives twice on the stage's full barrier: once when its
  copies land (cp.async.mbarrier.arrive.noinc) and once at once (the plain arrive after its
  zeroed rows). Warp 0 publishes the fetched number in the next-item slot of this item's
  parity, the warpgroup meets at its named barrier and every warp reads it. Warp 0 then fills
  the Q ring with the item's tiles, numbered on from the earlier items: wait for the stage
  (ring tile % Q_STAGES) to be empty, publish the entries, start the TMA (the full barrier
  completes when the bytes land). Past the last item the next K/V stage carries -1.
* Consumer warpgroups: per item, wait for its K/V stage and read the item's number beside it
  (-1: done), take the item's tiles whose ring number falls to them (ring tile % consumers),
  each: wait for the Q stage, read Q and K/V, write O, hand the Q stage back; after the item,
  arrive on the K/V stage's empty barrier.

Each actor is a generator that yields where the hardware could interleave; random schedules of
random item lists check that nothing deadlocks, that every item is taken by exactly one CTA
and each of its tiles done once, that every tile reads the Q rows of its own ring tile and the
K/V of its own item after they landed, and that no stage (or item slot) is refilled while a
consumer may still read it.

The Q ring's stages must be a multiple of the consumers: a consumer waits on a stage's
parity only, so the stage's previous use must be its own tile (which it has read), or a tile
of another consumer not landed yet lets the wait pass on the phase two laps back (3 consumers
on 4 stages: the model's "read Q stage ... holding" failures; ws3w runs 6).

`o_in_q` models the three-consumer form that stages O in the consumer's own Q stage
(no separate O tiles): the TMA store reads that stage after the tile, so the stage is handed
back only when the store has read it, either right after the store ("wait": the consumer
waits for the read, as wsp3w does) or at the consumer's next tile ("deferred", no wait). The
deferred form holds two stages per consumer and deadlocks unless Q_STAGES >= 2 x consumers,
which the model finds.

    python tools/lab/model_sparse_persistent.py
"""
import random

from model_decode_pingpong import Mbar   # an mbarrier: arrivals complete phases, parity waits

LOADERS = 4                # producer warps, each a loader (warp 0 also fills the Q ring)
KV_STAGES = 2


class Queue:
    """The call's work items (tiles per item) and the item counter the CTAs fetch from."""
    def __init__(self, items, ctas):
        self.items, self.ctas, self.counter = items, ctas, 0
        self.taken = []                            # item numbers, in the order CTAs took them

    def fetch(self):
        old, self.counter = self.counter, self.counter + 1
        return self.ctas + old


class Barrier:
    """A named barrier over `count` actors (generation counted)."""
    def __init__(self, count):
        self.count, self.arrived, self.generation = count, 0, 0

    def sync(self):
        generation = self.generation
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.generation = 0, self.generation + 1
        while self.generation == generation:
            yield


class Cta:
    def __init__(self, queue, first, consumers, q_stages, o_in_q=None, next_slots=2):
        self.queue, self.first, self.next_slots = queue, first, next_slots
        self.consumers, self.q_stages, self.o_in_q = consumers, q_stages, o_in_q
        self.item_slot = [None] * KV_STAGES       # the item number beside each K/V stage
        self.next_slot = [None] * next_slots      # the producer's next item, by item parity
        self.producer_bar = Barrier(LOADERS)
        self.q_full = [Mbar(1) for _ in range(q_stages)]
        self.q_empty = [Mbar(1) for _ in range(q_stages)]     # one consuming warpgroup
        self.kv_full = [Mbar(2 * LOADERS) for _ in range(KV_STAGES)]
        self.kv_empty = [Mbar(consumers) for _ in range(KV_STAGES)]
        self.q_stage = [None] * q_stages          # ring tile whose Q rows landed there
        self.kv_stage = [[None] * LOADERS for _ in range(KV_STAGES)]   # item per loader share
        self.kv_readers = [set() for _ in range(KV_STAGES)]
        self.q_store_reading = [False] * q_stages  # a TMA store still reads O staged there
        self.landing = []                          # (callback) pending async completions


def loader(cta, warp):
    items = cta.queue.items
    ring_base = 0
    item = 0
    work = cta.first
    while work < len(items):
        n_tiles = items[work]
        if warp == 0:
            fetched = cta.queue.fetch()
            yield
        s = item % KV_STAGES
        while not cta.kv_empty[s].done(((item // KV_STAGES) % 2) ^ 1):
            yield
        assert not cta.kv_readers[s], f"K/V stage {s} refilled while read by {cta.kv_readers[s]}"
        if warp == 0:
            cta.item_slot[s] = work
            cta.queue.taken.append(work)

        def land(s=s, work=work):
            cta.kv_stage[s][warp] = work
            cta.kv_full[s].arrive()                # cp.async.mbarrier.arrive.noinc
        cta.landing.append(land)
        cta.kv_full[s].arrive()                    # the plain arrive after the zeroed rows
        yield
        if warp == 0:
            cta.next_slot[item % cta.next_slots] = fetched
        yield from cta.producer_bar.sync()
        next_work = cta.next_slot[item % cta.next_slots]
        yield
        if warp == 0:
            for t in range(n_tiles):
                g = ring_base + t
                q = g % cta.q_stages
                while not cta.q_empty[q].done(((g // cta.q_stages) % 2) ^ 1):
                    yield
                assert not cta.q_store_reading[q], f"Q stage {q} refilled under a store"

                def land_q(q=q, g=g):
                    cta.q_stage[q] = g
                    cta.q_full[q].arrive()         # the TMA's bytes complete the phase
                cta.landing.append(land_q)
                yield
        ring_base += n_tiles
        item += 1
        work = next_work
    s = item % KV_STAGES                           # no more items: the next stage says -1
    while not cta.kv_empty[s].done(((item // KV_STAGES) % 2) ^ 1):
        yield
    if warp == 0:
        cta.item_slot[s] = -1
    cta.kv_full[s].arrive()
    cta.kv_full[s].arrive()


def consumer(cta, wg):
    ring_base = 0
    item = 0
    deferred = None                                # o_in_q "deferred": stage to hand back
    while True:
        s = item % KV_STAGES
        while not cta.kv_full[s].done((item // KV_STAGES) % 2):
            yield
        work = cta.item_slot[s]
        if work == -1:
            break
        n_tiles = cta.queue.items[work]
        assert cta.kv_stage[s] == [work] * LOADERS, (work, cta.kv_stage[s])
        cta.kv_readers[s].add(wg)
        first = (wg + cta.consumers - ring_base % cta.consumers) % cta.consumers
        for t in range(first, n_tiles, cta.consumers):
            g = ring_base + t
            q = g % cta.q_stages
            while not cta.q_full[q].done((g // cta.q_stages) % 2):
                yield
            assert cta.q_stage[q] == g, f"tile {g} read Q stage {q} holding {cta.q_stage[q]}"
            assert cta.kv_stage[s] == [work] * LOADERS
            yield                                  # S = Q K^T, softmax, P V
            if cta.o_in_q is None:
                cta.q_empty[q].arrive()
            else:
                if deferred is not None:           # the previous tile's store has read it
                    cta.q_store_reading[deferred] = False
                    cta.q_empty[deferred].arrive()
                    deferred = None
                cta.q_stage[q] = ("O", g)          # O staged over the dead Q rows
                cta.q_store_reading[q] = True
                if cta.o_in_q == "wait":
                    yield                          # cp.async.bulk.wait_group.read 0
                    cta.q_store_reading[q] = False
                    cta.q_empty[q].arrive()
                else:
                    deferred = q
            cta.queue.tiles_done.append((work, t))
            yield
        cta.kv_readers[s].discard(wg)
        cta.kv_empty[s].arrive()
        ring_base += n_tiles
        item += 1
    if deferred is not None:
        cta.q_store_reading[deferred] = False
        cta.q_empty[deferred].arrive()


def run(items, consumers, q_stages, o_in_q=None, seed=0, ctas=2, next_slots=2):
    """One random schedule of min(ctas, items) CTAs on one queue; returns None when it
    completes, else a description of the failure (a deadlock or a broken check). next_slots:
    the producer's next-item slots (the kernel's 2; one lets warp 0 overwrite the number
    before a slow warp read it)."""
    rng = random.Random(seed)
    queue = Queue(items, min(ctas, len(items)))
    queue.tiles_done = []
    actors, landings = [], []
    for first in range(queue.ctas):
        cta = Cta(queue, first, consumers, q_stages, o_in_q, next_slots)
        landings.append(cta.landing)
        actors += [loader(cta, w) for w in range(LOADERS)]
        actors += [consumer(cta, c) for c in range(consumers)]
    live = list(actors)
    stalls = 0
    try:
        while live or any(landings):
            pending = [landing for landing in landings if landing]
            if pending and (not live or rng.random() < 0.3):
                landing = rng.choice(pending)
                landing.pop(rng.randrange(len(landing)))()
                stalls = 0
                continue
            actor = rng.choice(live)
            try:
                next(actor)
            except StopIteration:
                live.remove(actor)
            stalls += 1
            if stalls > 20000:
                return "deadlock"
    except AssertionError as exc:
        return f"check failed: {exc}"
    if sorted(queue.taken) != list(range(len(items))):
        return f"items taken {sorted(queue.taken)} of {len(items)}"
    expected = sorted((w, t) for w, n in enumerate(items) for t in range(n))
    if sorted(queue.tiles_done) != expected:
        return f"tiles done {len(queue.tiles_done)} of {len(expected)}"
    return None


def sweep(consumers, q_stages, o_in_q=None, schedules=300, next_slots=2):
    failures = {}
    for seed in range(schedules):
        rng = random.Random(seed)
        items = [rng.choice((0, 1, 1, 2, 3, 4, 6, 9)) for _ in range(rng.randrange(1, 12))]
        why = run(items, consumers, q_stages, o_in_q, seed, next_slots=next_slots)
        if why is not None:
            failures.setdefault(why.split(":")[0], (items, why))
    return failures


def main():
    cases = [("2 consumers, 4 Q stages (O tiles)", 2, 4, None),
             ("3 consumers, 4 Q stages", 3, 4, None),
             ("3 consumers, 6 Q stages", 3, 6, None),
             ("wsp3w: 3 consumers, O in Q, wait, 6 stages", 3, 6, "wait"),
             ("3 consumers, O in Q, deferred, 3 stages", 3, 3, "deferred"),
             ("3 consumers, O in Q, deferred, 6 stages", 3, 6, "deferred")]
    for name, consumers, q_stages, o_in_q in cases:
        failures = sweep(consumers, q_stages, o_in_q)
        print(f"{name:48s} {'ok' if not failures else failures}")


if __name__ == "__main__":
    main()
