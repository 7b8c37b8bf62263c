#!/usr/bin/env python3
"""Protocol model of the decode kernel's ping-pong form (no GPU needed).

csrc/decode_attention.cu, wg::pingpong: the K and V loader streams (bf16 K and V, e4m3 K kept
raw: cp.async into the ring, each stage's full mbarrier told by the copies themselves as they
land, in order; e4m3 V: cp.async into a raw slot, then, once the stage is empty, widened into
it and its full mbarrier told),
two consumer warpgroups taking turns
through named barriers 1 and 2, the empty mbarriers, phase parities as the kernel waits on them.
Each actor is a generator that yields where the hardware could interleave; random schedules of
every page count check that nothing deadlocks, that every Q.K^T / P.V reads a stage holding
the right page after it landed, that no stage is refilled while a warpgroup may still read it,
and that no named-barrier arrival is left over at the end.

With `sequences` it models the persistent form's CTA (decode_attention_persistent_kernel):
the pieces of several sequences back to back, the page stream their pages in order, K in the
persistent layout's ring (bf16 two stages). Each consumer runs a piece as the single-sequence
form runs its work item, pages + 1 turns (the last one waits for no K, reads a K stage the
producer may be filling, discarded, and issues the last P.V), then finalizes. It loads its own
Q rows of the next piece (cp.async, landing later) into the other of two slots when a piece
starts, and waits for them when the next piece starts: with `commit=False` that wait is
cp.async.wait_group 0 over copies never committed, which returns at once; the model then
catches a Q.K^T reading rows that have not landed. Also checked: no Q slot refilled while its
consumer's Q.K^T reads it, each piece finalized once by each consumer after the P.V of all its
pages.

    python tools/lab/model_decode_pingpong.py
"""
import random

STAGES = {False: (3, 2), True: (4, 2)}   # (kKStages, kVStages) of Layout<kFp8>


class Mbar:
    """An mbarrier: a phase completes after `count` arrivals."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, parity):
        """try_wait.parity: the phase of this parity has completed."""
        return (self.phase & 1) != parity


class Named:
    """A named barrier over two warpgroups (bar.sync and bar.arrive both count one)."""

    def __init__(self):
        self.arrived, self.gen = 0, 0

    def arrive(self):
        self.arrived += 1
        if self.arrived == 2:
            self.arrived, self.gen = 0, self.gen + 1


Q_SLOTS = 2                            # the persistent form's Q slots (each consumer's block)
PERSISTENT_STAGES = {False: (2, 2), True: (4, 2)}   # Layout<kFp8, true>


def run(num_pages, seed, fp8=False, sequences=None, commit=True):
    """One random schedule of a CTA streaming `num_pages` pages (or, persistent, pieces of
    `sequences` pages each (>= 1), back to back)."""
    rng = random.Random(seed)
    persistent = sequences is not None
    if persistent:
        assert all(n >= 1 for n in sequences)
        num_pages = sum(sequences)
    KS, VS = (PERSISTENT_STAGES if persistent else STAGES)[fp8]
    kf = [Mbar(1) for _ in range(KS)]; ke = [Mbar(2) for _ in range(KS)]
    vf = [Mbar(1) for _ in range(VS)]; ve = [Mbar(2) for _ in range(VS)]
    kstage = [None] * KS; vstage = [None] * VS      # (page, landed)
    named = {1: Named(), 2: Named()}
    readers = {}                                    # (tensor, stage) -> set of wg reading
    qslot = {(c, i): None for c in (0, 1) for i in range(Q_SLOTS)}   # (piece, landed)
    q_in_flight = []                                # (consumer, slot) copies not landed yet
    finalized = {c: [] for c in (0, 1)}

    def loader(tensor, stages, full, empty, store, copies):
        idx, phase = 0, 0
        for i in range(num_pages):
            while not empty[idx].done(phase ^ 1): yield
            assert not readers.get((tensor, idx)), f"{tensor} stage {idx} overwritten while read"
            store[idx] = (i, False)
            copies.append(idx)                       # cp.async + arrive-on-copies: lands later
            yield
            idx += 1
            if idx == stages: idx, phase = 0, phase ^ 1

    def landing(store, full, copies, loader_done):
        """The copies of one stream land in order; each stage's arrival follows its bytes."""
        while copies or not loader_done():
            if copies:
                st = copies.pop(0)
                pg, _ = store[st]
                store[st] = (pg, True)
                full[st].arrive()
            yield

    def q_landing(consumers_done):
        """A consumer's Q copies land at some later point of the schedule."""
        while q_in_flight or not consumers_done():
            if q_in_flight:
                key = q_in_flight.pop(rng.randrange(len(q_in_flight)))
                qslot[key] = (qslot[key][0], True)
            yield

    def loader_fp8(tensor, stages, full, empty, store):
        idx, phase = 0, 0
        for i in range(num_pages):
            yield                                    # raw copies in flight, then landed
            while not empty[idx].done(phase ^ 1): yield
            assert not readers.get((tensor, idx)), f"{tensor} stage {idx} overwritten while read"
            store[idx] = (i, False)                  # widening into the stage
            yield
            store[idx] = (i, True)                   # widened and fenced
            full[idx].arrive()
            idx += 1
            if idx == stages: idx, phase = 0, phase ^ 1

    pieces = sequences or [num_pages]
    first_page = [sum(pieces[:k]) for k in range(len(pieces))]
    total_turns = num_pages + (len(pieces) if persistent else 1)

    def load_q(c, slot, piece):
        assert not readers.get(("Q", c, slot)), f"Q slot {slot} of {c} overwritten while read"
        qslot[c, slot] = (piece, False)
        q_in_flight.append((c, slot))

    def wait_q(c):
        """cp.async.wait_group 0: the committed copies of this consumer have landed."""
        if commit:
            while any(key[0] == c for key in q_in_flight): yield

    def consumer(c):
        kidx = kph = vidx = vph = 0
        my, other = 1 + c, 2 - c
        turn = 0
        if c == 1:
            named[1].arrive()                       # opens warpgroup 1's first turn
        if persistent:
            load_q(c, 0, 0)
            yield from wait_q(c)
        for k, n in enumerate(pieces):
            slot = k % Q_SLOTS
            if persistent:
                if k > 0:
                    yield from wait_q(c)             # this piece's rows
                if k + 1 < len(pieces):
                    load_q(c, slot ^ 1, k + 1)       # the next piece's, into the other slot
                yield
            for j in range(n + 1):
                has = j < n
                page = first_page[k] + j
                if has:
                    while not kf[kidx].done(kph): yield
                if j > 0:
                    while not vf[vidx].done(vph): yield
                target = named[my].gen + 1
                named[my].arrive()
                while named[my].gen < target: yield
                if has:
                    if persistent:
                        piece, landed = qslot[c, slot]
                        assert landed and piece == k, (c, k, j, qslot[c, slot])
                        readers.setdefault(("Q", c, slot), set()).add(c)
                    pg, landed = kstage[kidx]; assert landed and pg == page, (c, page, kstage[kidx])
                    readers.setdefault(("K", kidx), set()).add(c)
                if j > 0:
                    pg, landed = vstage[vidx]
                    assert landed and pg == page - 1, (c, page, vstage[vidx])
                    readers.setdefault(("V", vidx), set()).add(c)
                turn += 1
                if c == 0 or turn < total_turns: named[other].arrive()
                yield                                # wgmma in flight
                if has:
                    readers[("K", kidx)].discard(c); ke[kidx].arrive()
                    readers.get(("Q", c, slot), set()).discard(c)
                    kidx += 1
                    if kidx == KS: kidx, kph = 0, kph ^ 1
                if j > 0:
                    readers[("V", vidx)].discard(c); ve[vidx].arrive()
                    vidx += 1
                    if vidx == VS: vidx, vph = 0, vph ^ 1
                yield                                # softmax
            finalized[c].append(k)                   # after the piece's last P.V

    kcopies = []
    k_loader = loader("K", KS, kf, ke, kstage, kcopies)
    actors = [k_loader, landing(kstage, kf, kcopies, lambda: k_loader not in alive)]
    if fp8:
        actors.append(loader_fp8("V", VS, vf, ve, vstage))
    else:
        vcopies = []
        v_loader = loader("V", VS, vf, ve, vstage, vcopies)
        actors += [v_loader, landing(vstage, vf, vcopies, lambda: v_loader not in alive)]
    consumers = [consumer(0), consumer(1)]
    actors += consumers
    if persistent:
        actors.append(q_landing(lambda: not any(x in alive for x in consumers)))
    alive = list(actors)
    steps = 0
    while alive:
        steps += 1
        if steps > 500000: raise RuntimeError(f"deadlock? {sequences or num_pages} seed={seed}")
        a = rng.choice(alive)
        try: next(a)
        except StopIteration: alive.remove(a)
    assert named[1].arrived == 0 and named[2].arrived == 0, "leftover named-barrier arrivals"
    assert finalized[0] == finalized[1] == list(range(len(pieces)))


def main():
    for fp8 in (False, True):
        for n in (0, 1, 2, 3, 4, 7, 20):
            for seed in range(300):
                run(n, seed, fp8)
    print("ok: no deadlock, reads see landed pages, no stage overwritten while read")
    rng = random.Random(7)
    cases = [[1], [3], [1, 1], [2, 5, 1], [1, 4, 1, 2], [1, 1, 1, 1, 1]]
    cases += [[rng.randint(1, 6) for _ in range(rng.randint(1, 6))] for _ in range(30)]
    for fp8 in (False, True):
        for sequences in cases:
            for seed in range(100):
                run(None, seed, fp8, sequences)
    print("ok, persistent: Q reads see their own landed piece, no Q slot overwritten while "
          "read, each piece finalized once after all its P.V")
    caught = 0
    for seed in range(200):
        try:
            run(None, seed, False, [1, 1, 1, 2, 1], commit=False)
        except AssertionError:
            caught += 1
    assert caught, "the uncommitted Q wait was never caught"
    print(f"ok: uncommitted Q copies (wait_group 0 returns at once) caught in {caught} of 200 "
          "schedules")


if __name__ == "__main__":
    main()
