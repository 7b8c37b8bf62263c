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

With fp8 = "pv8" it models the e4m3 P.V form's producer (stream_pages_tma): thread 0 copies
each page's K and raw V (TMA, landing later on the stages' full barriers), several transposer
threads read the raw slot into the V^T stage, tell its full barrier and meet at the
warpgroup's barrier, after which thread 0 refills the slot with the page kRawStages ahead.

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

STAGES = {False: (3, 2), True: (4, 2), "pv8": (3, 3)}   # (kKStages, kVStages) of Layout
RAW_STAGES = 2                         # e4m3 P.V: raw V page slots (kRawStages)


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
PERSISTENT_STAGES = {False: (2, 2), True: (4, 2), "pv8": (3, 3)}   # Layout<kFp8, true>


def run(num_pages, seed, fp8=False, sequences=None, commit=True, v_threads=3, reissue_lag=1):
    """One random schedule of a CTA streaming `num_pages` pages (or, persistent, pieces of
    `sequences` pages each (>= 1), back to back). fp8 = "pv8": the e4m3 P.V form, whose
    producer threads (v_threads of them here, 128 in the kernel) transpose raw V pages that
    thread 0 copied (stream_pages_tma); reissue_lag = 0 is the unsafe variant that refills a
    raw slot before the producer's barrier has seen it read."""
    rng = random.Random(seed)
    persistent = sequences is not None
    if persistent:
        assert all(n >= 1 for n in sequences)
        num_pages = sum(sequences)
    KS, VS = (PERSISTENT_STAGES if persistent else STAGES)[fp8]
    kf = [Mbar(1) for _ in range(KS)]; ke = [Mbar(2) for _ in range(KS)]
    vf = [Mbar(v_threads if fp8 == "pv8" else 1) for _ in range(VS)]
    ve = [Mbar(2) for _ in range(VS)]
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

    # stream_pages_tma: thread 0 (of transposer 0) copies page j's K into the K ring and its V
    # into raw slot j % RAW_STAGES (TMA: each copy lands later and completes its full
    # barrier); every transposer waits for the page's V^T stage to be empty and its raw slot to
    # be full, transposes, arrives on the stage's full barrier, then meets the others at the
    # warpgroup's barrier, after which thread 0 issues page i + RAW_STAGES into the freed slot.
    raw = [None] * RAW_STAGES                                     # slot -> (page, landed)
    raw_full = [Mbar(1) for _ in range(RAW_STAGES)]
    raw_readers = [set() for _ in range(RAW_STAGES)]
    raw_copies = []
    v_bar = {"arrived": 0, "gen": 0}
    vt_written = [dict() for _ in range(VS)]                      # stage -> thread -> page
    k_issue = {"idx": 0, "phase": 0}

    def issue(j):
        """Thread 0: page j's K and raw V copies (j < num_pages)."""
        idx = k_issue["idx"]
        while not ke[idx].done(k_issue["phase"] ^ 1): yield
        assert not readers.get(("K", idx)), f"K stage {idx} overwritten while read"
        kstage[idx] = (j, False)
        kcopies.append(idx)
        k_issue["idx"] += 1
        if k_issue["idx"] == KS: k_issue["idx"], k_issue["phase"] = 0, k_issue["phase"] ^ 1
        slot = j % RAW_STAGES
        assert not raw_readers[slot], f"raw slot {slot} refilled while read (page {j})"
        raw[slot] = (j, False)
        raw_copies.append(slot)

    def v_transposer(me):
        if me == 0:
            for j in range(min(num_pages, RAW_STAGES)):
                yield from issue(j)
        idx, phase = 0, 0
        for i in range(num_pages):
            slot = i % RAW_STAGES
            while not ve[idx].done(phase ^ 1): yield
            assert not readers.get(("V", idx)), f"V stage {idx} overwritten while read"
            vt_written[idx].pop(me, None)
            while not raw_full[slot].done((i // RAW_STAGES) & 1): yield
            assert raw[slot] == (i, True), f"page {i} transposed before it landed: {raw[slot]}"
            raw_readers[slot].add(me)
            if reissue_lag == 0 and me == 0 and i + RAW_STAGES < num_pages:
                raw_readers[slot].discard(me)
                yield from issue(i + RAW_STAGES)         # unsafe: before the barrier
                raw_readers[slot].add(me)
            yield                                        # reading the raw page, writing V^T
            raw_readers[slot].discard(me)
            vt_written[idx][me] = i
            vf[idx].arrive()                             # fence, then the full barrier
            target = v_bar["gen"] + 1
            v_bar["arrived"] += 1
            if v_bar["arrived"] == v_threads:
                v_bar["arrived"], v_bar["gen"] = 0, v_bar["gen"] + 1
            while v_bar["gen"] < target: yield
            if reissue_lag and me == 0 and i + RAW_STAGES < num_pages:
                yield from issue(i + RAW_STAGES)
            idx += 1
            if idx == VS: idx, phase = 0, phase ^ 1

    def raw_landing(transposers_done):
        while raw_copies or not transposers_done():
            if raw_copies:
                slot = raw_copies.pop(0)
                raw[slot] = (raw[slot][0], True)
                raw_full[slot].arrive()
            yield

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
                if j > 0 and fp8 == "pv8":
                    assert all(vt_written[vidx].get(t) == page - 1 for t in range(v_threads)), \
                        (c, page, vt_written[vidx])
                elif j > 0:
                    pg, landed = vstage[vidx]
                    assert landed and pg == page - 1, (c, page, vstage[vidx])
                if j > 0:
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
    if fp8 == "pv8":
        transposers = [v_transposer(t) for t in range(v_threads)]
        actors = list(transposers)
        actors.append(landing(kstage, kf, kcopies, lambda: transposers[0] not in alive))
        actors.append(raw_landing(lambda: not any(x in alive for x in transposers)))
    else:
        k_loader = loader("K", KS, kf, ke, kstage, kcopies)
        actors = [k_loader, landing(kstage, kf, kcopies, lambda: k_loader not in alive)]
    if fp8 is True:
        actors.append(loader_fp8("V", VS, vf, ve, vstage))
    elif not fp8:
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
    for fp8 in (False, True, "pv8"):
        for n in (0, 1, 2, 3, 4, 7, 20):
            for seed in range(300):
                run(n, seed, fp8)
    print("ok: no deadlock, reads see landed pages, no stage overwritten while read")
    rng = random.Random(7)
    cases = [[1], [3], [1, 1], [2, 5, 1], [1, 4, 1, 2], [1, 1, 1, 1, 1]]
    cases += [[rng.randint(1, 6) for _ in range(rng.randint(1, 6))] for _ in range(30)]
    for fp8 in (False, True, "pv8"):
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
    early = 0
    for seed in range(200):
        try:
            run(6, seed, "pv8", reissue_lag=0)
        except (AssertionError, RuntimeError):   # read while refilled, or a parity aliased
            early += 1
    assert early, "refilling a raw slot before the producer's barrier was never caught"
    print(f"ok, e4m3 P.V: a raw slot refilled before the producer's barrier caught (a read of "
          f"the refilled slot, or a hang on its aliased parity) in {early} of 200 schedules")


if __name__ == "__main__":
    main()
