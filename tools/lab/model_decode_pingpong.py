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

With `sequences` it models a persistent CTA (a design for the next form, not yet a kernel):
several (request, KV head) sequences streamed back to back, the page stream their pages in
order. The producer also loads each sequence's Q into one of two slots (q_full told when it has
landed, the slot reused once both consumers arrived on q_empty); a consumer waits q_full before
the turn that issues a sequence's first Q.K^T, and right after the wait of the turn whose page
starts the next sequence (its P.V finished the previous one) finalizes that sequence, releases
its Q slot and resets O and the row state before the page's softmax. Also checked: every Q.K^T
reads its own sequence's landed Q, no Q slot is refilled while read, each sequence is finalized
once by each consumer after the P.V of all its pages.

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


Q_SLOTS = 2   # the persistent form's Q buffers


def run(num_pages, seed, fp8=False, sequences=None):
    """One random schedule of a CTA streaming `num_pages` pages (or, persistent, sequences of
    `sequences` pages each, back to back)."""
    rng = random.Random(seed)
    persistent = sequences is not None
    if persistent:
        num_pages = sum(sequences)
    pages = [(s, i) for s, n in enumerate(sequences or [num_pages]) for i in range(n)]
    live = [s for s, n in enumerate(sequences or []) if n]    # the sequences Q is loaded for
    qf = [Mbar(1) for _ in range(Q_SLOTS)]; qe = [Mbar(2) for _ in range(Q_SLOTS)]
    qslot = [None] * Q_SLOTS
    pv_done = {c: [set() for _ in sequences or []] for c in (0, 1)}
    finalized = {c: [] for c in (0, 1)}
    KS, VS = STAGES[fp8]
    kf = [Mbar(1) for _ in range(KS)]; ke = [Mbar(2) for _ in range(KS)]
    vf = [Mbar(1) for _ in range(VS)]; ve = [Mbar(2) for _ in range(VS)]
    kstage = [None] * KS; vstage = [None] * VS      # (page, landed)
    named = {1: Named(), 2: Named()}
    readers = {}                                    # (tensor, stage) -> set of wg reading

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

    def q_loader():
        idx, phase = 0, 0
        for s in live:
            while not qe[idx].done(phase ^ 1): yield
            assert not readers.get(("Q", idx)), f"Q slot {idx} overwritten while read"
            qslot[idx] = (s, False)
            yield
            qslot[idx] = (s, True)
            qf[idx].arrive()
            idx += 1
            if idx == Q_SLOTS: idx, phase = 0, phase ^ 1

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

    def consumer(c):
        kidx = kph = vidx = vph = 0
        qidx = qph = 0                               # persistent: the current sequence's slot
        my, other = 1 + c, 2 - c
        turns = num_pages + 1
        if c == 1:
            named[1].arrive()                       # opens warpgroup 1's first turn
        for t in range(turns):
            has = t < num_pages
            starts = persistent and has and (t == 0 or pages[t][0] != pages[t - 1][0])
            if starts:
                if t > 0:                            # the next slot holds the next sequence
                    qidx += 1
                    if qidx == Q_SLOTS: qidx, qph = 0, qph ^ 1
                while not qf[qidx].done(qph): yield
            if has:
                while not kf[kidx].done(kph): yield
            if t > 0:
                while not vf[vidx].done(vph): yield
            # named sync on my barrier: this wg's sync counts as an arrival, then wait the gen
            target = named[my].gen + 1
            named[my].arrive()
            while named[my].gen < target: yield
            if has:
                if persistent:
                    seq, landed = qslot[qidx]
                    assert landed and seq == pages[t][0], (c, t, qslot[qidx], pages[t])
                    readers.setdefault(("Q", qidx), set()).add(c)
                pg, landed = kstage[kidx]; assert landed and pg == t, (c, t, kstage[kidx])
                readers.setdefault(("K", kidx), set()).add(c)
            if t > 0:
                pg, landed = vstage[vidx]; assert landed and pg == t - 1, (c, t, vstage[vidx])
                readers.setdefault(("V", vidx), set()).add(c)
            if c == 0 or t + 1 < turns: named[other].arrive()
            yield                                    # wgmma in flight
            if has:
                readers[("K", kidx)].discard(c); ke[kidx].arrive()
                readers.get(("Q", qidx), set()).discard(c)
                kidx += 1
                if kidx == KS: kidx, kph = 0, kph ^ 1
            if t > 0:
                readers[("V", vidx)].discard(c); ve[vidx].arrive()
                vidx += 1
                if vidx == VS: vidx, vph = 0, vph ^ 1
                if persistent:
                    seq = pages[t - 1][0]
                    pv_done[c][seq].add(pages[t - 1][1])
                    if not has or pages[t][0] != seq:    # O of that sequence is complete
                        assert pv_done[c][seq] == set(range(sequences[seq])), (c, seq)
                        finalized[c].append(seq)
                        qe[(qidx - 1) % Q_SLOTS if has else qidx].arrive()   # its slot
            yield                                    # softmax (after a reset when it starts)

    kcopies = []
    k_loader = loader("K", KS, kf, ke, kstage, kcopies)
    actors = [k_loader, landing(kstage, kf, kcopies, lambda: k_loader not in alive)]
    if fp8:
        actors.append(loader_fp8("V", VS, vf, ve, vstage))
    else:
        vcopies = []
        v_loader = loader("V", VS, vf, ve, vstage, vcopies)
        actors += [v_loader, landing(vstage, vf, vcopies, lambda: v_loader not in alive)]
    if persistent:
        actors.append(q_loader())
    actors += [consumer(0), consumer(1)]
    alive = list(actors)
    steps = 0
    while alive:
        steps += 1
        if steps > 500000: raise RuntimeError(f"deadlock? {sequences or num_pages} seed={seed}")
        a = rng.choice(alive)
        try: next(a)
        except StopIteration: alive.remove(a)
    assert named[1].arrived == 0 and named[2].arrived == 0, "leftover named-barrier arrivals"
    if persistent:
        assert finalized[0] == live and finalized[1] == live, (finalized, live)


def main():
    for fp8 in (False, True):
        for n in (0, 1, 2, 3, 4, 7, 20):
            for seed in range(300):
                run(n, seed, fp8)
    print("ok: no deadlock, reads see landed pages, no stage overwritten while read")
    rng = random.Random(7)
    cases = [[1], [3], [1, 1], [2, 5, 1], [0, 4, 0, 2], [1, 1, 1, 1, 1]]
    cases += [[rng.randint(0, 6) for _ in range(rng.randint(1, 6))] for _ in range(30)]
    for fp8 in (False, True):
        for sequences in cases:
            for seed in range(100):
                run(None, seed, fp8, sequences)
    print("ok, persistent: Q reads see their own landed sequence, no Q slot overwritten while "
          "read, each sequence finalized once after all its P.V")


if __name__ == "__main__":
    main()
