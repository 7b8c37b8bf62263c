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


def run(num_pages, seed, fp8=False):
    """One random schedule of a CTA streaming `num_pages` pages."""
    rng = random.Random(seed)
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
        my, other = 1 + c, 2 - c
        turns = num_pages + 1
        if c == 1:
            named[1].arrive()                       # opens warpgroup 1's first turn
        for t in range(turns):
            has = t < num_pages
            if has:
                while not kf[kidx].done(kph): yield
            if t > 0:
                while not vf[vidx].done(vph): yield
            # named sync on my barrier: this wg's sync counts as an arrival, then wait the gen
            target = named[my].gen + 1
            named[my].arrive()
            while named[my].gen < target: yield
            if has:
                pg, landed = kstage[kidx]; assert landed and pg == t, (c, t, kstage[kidx])
                readers.setdefault(("K", kidx), set()).add(c)
            if t > 0:
                pg, landed = vstage[vidx]; assert landed and pg == t - 1, (c, t, vstage[vidx])
                readers.setdefault(("V", vidx), set()).add(c)
            if c == 0 or t + 1 < turns: named[other].arrive()
            yield                                    # wgmma in flight
            if has:
                readers[("K", kidx)].discard(c); ke[kidx].arrive()
                kidx += 1
                if kidx == KS: kidx, kph = 0, kph ^ 1
            if t > 0:
                readers[("V", vidx)].discard(c); ve[vidx].arrive()
                vidx += 1
                if vidx == VS: vidx, vph = 0, vph ^ 1
            yield                                    # softmax

    kcopies = []
    k_loader = loader("K", KS, kf, ke, kstage, kcopies)
    actors = [k_loader, landing(kstage, kf, kcopies, lambda: k_loader not in alive)]
    if fp8:
        actors.append(loader_fp8("V", VS, vf, ve, vstage))
    else:
        vcopies = []
        v_loader = loader("V", VS, vf, ve, vstage, vcopies)
        actors += [v_loader, landing(vstage, vf, vcopies, lambda: v_loader not in alive)]
    actors += [consumer(0), consumer(1)]
    alive = list(actors)
    steps = 0
    while alive:
        steps += 1
        if steps > 200000: raise RuntimeError(f"deadlock? pages={num_pages} seed={seed}")
        a = rng.choice(alive)
        try: next(a)
        except StopIteration: alive.remove(a)
    assert named[1].arrived == 0 and named[2].arrived == 0, "leftover named-barrier arrivals"


def main():
    for fp8 in (False, True):
        for n in (0, 1, 2, 3, 4, 7, 20):
            for seed in range(300):
                run(n, seed, fp8)
    print("ok: no deadlock, reads see landed pages, no stage overwritten while read")


if __name__ == "__main__":
    main()
