#!/usr/bin/env python3
"""Protocol model of a persistent ping-pong decode CTA (no GPU needed; a design for the next
form of csrc/decode_attention.cu, not yet a kernel).

The persistent form streams several (request, KV head) sequences back to back through one
CTA: the page stream is their pages in order, each tagged with its sequence. On top of the
ping-pong protocol of tools/lab/model_decode_pingpong.py (K / V rings, full / empty mbarriers,
two consumer warpgroups taking turns through named barriers 1 and 2, turn t issuing Q.K^T of
page t and P.V of page t - 1), the producer also loads each sequence's Q into one of two Q slots
(q_full[slot] told when it has landed; the slot reused once both consumers arrived on
q_empty[slot]), and each consumer

  * waits q_full of page t's sequence before the turn that issues its first Q.K^T;
  * finalizes sequence s (its O complete, since the turn's P.V of its last page has been
    waited for) right after the wait of the turn where page t starts another sequence (or of the
    last turn), then resets O and the row state before page t's softmax;
  * releases s's Q slot in that same place: its last Q.K^T was issued a turn earlier.

Random schedules of random sequence lengths check: no deadlock; every Q.K^T reads the Q of its
own page's sequence, landed and not being overwritten; every K / V read sees its landed page;
each sequence is finalized exactly once by each consumer, after the P.V of each of its pages;
no named-barrier arrival is left over.

    python tools/lab/model_decode_persistent.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_decode_pingpong import Mbar, Named  # noqa: E402

K_STAGES, V_STAGES, Q_SLOTS = 3, 2, 2


def run(seq_pages, seed):
    """One random schedule of a CTA streaming sequences of `seq_pages` pages each."""
    rng = random.Random(seed)
    pages = [(s, i) for s, n in enumerate(seq_pages) for i in range(n)]   # (sequence, page)
    num_pages = len(pages)
    kf = [Mbar(1) for _ in range(K_STAGES)]; ke = [Mbar(2) for _ in range(K_STAGES)]
    vf = [Mbar(1) for _ in range(V_STAGES)]; ve = [Mbar(2) for _ in range(V_STAGES)]
    qf = [Mbar(1) for _ in range(Q_SLOTS)]; qe = [Mbar(2) for _ in range(Q_SLOTS)]
    kstage, vstage, qslot = [None] * K_STAGES, [None] * V_STAGES, [None] * Q_SLOTS
    named = {1: Named(), 2: Named()}
    readers = {}
    pv_done = {c: [set() for _ in seq_pages] for c in (0, 1)}   # pages whose P.V is in O
    finalized = {c: [] for c in (0, 1)}
    # Sequences with pages, in stream order: the ones Q is loaded for (empty ones are skipped).
    live = [s for s, n in enumerate(seq_pages) if n]

    def ring_loader(tensor, stages, full, empty, store):
        idx, phase = 0, 0
        for i in range(num_pages):
            while not empty[idx].done(phase ^ 1): yield
            assert not readers.get((tensor, idx)), f"{tensor} stage {idx} overwritten while read"
            store[idx] = (i, False)
            yield                                    # copies in flight
            store[idx] = (i, True)
            full[idx].arrive()
            idx += 1
            if idx == stages: idx, phase = 0, phase ^ 1

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

    def consumer(c):
        kidx = kph = vidx = vph = 0
        qidx = qph = 0                               # the slot of the current sequence
        my, other = 1 + c, 2 - c
        turns = num_pages + 1
        if c == 1:
            named[1].arrive()
        for t in range(turns):
            has = t < num_pages
            starts = has and (t == 0 or pages[t][0] != pages[t - 1][0])
            if has:
                if starts and t > 0:                 # the next slot holds the next sequence
                    qidx += 1
                    if qidx == Q_SLOTS: qidx, qph = 0, qph ^ 1
                if starts:
                    while not qf[qidx].done(qph): yield
                while not kf[kidx].done(kph): yield
            if t > 0:
                while not vf[vidx].done(vph): yield
            target = named[my].gen + 1
            named[my].arrive()
            while named[my].gen < target: yield
            if has:
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
                readers[("Q", qidx)].discard(c)
                kidx += 1
                if kidx == K_STAGES: kidx, kph = 0, kph ^ 1
            if t > 0:
                readers[("V", vidx)].discard(c); ve[vidx].arrive()
                pv_done[c][pages[t - 1][0]].add(pages[t - 1][1])
                vidx += 1
                if vidx == V_STAGES: vidx, vph = 0, vph ^ 1
                ends = not has or pages[t][0] != pages[t - 1][0]
                if ends:                             # O of the previous sequence is complete
                    s = pages[t - 1][0]
                    assert pv_done[c][s] == set(range(seq_pages[s])), (c, s, pv_done[c][s])
                    finalized[c].append(s)
                    prev = qidx - 1 if has else qidx  # the slot the finished sequence used
                    if prev < 0: prev = Q_SLOTS - 1
                    qe[prev].arrive()
            yield                                    # softmax (after a reset when starts)

    actors = [ring_loader("K", K_STAGES, kf, ke, kstage),
              ring_loader("V", V_STAGES, vf, ve, vstage), q_loader(), consumer(0), consumer(1)]
    alive = list(actors)
    steps = 0
    while alive:
        steps += 1
        if steps > 500000: raise RuntimeError(f"deadlock? seqs={seq_pages} seed={seed}")
        a = rng.choice(alive)
        try: next(a)
        except StopIteration: alive.remove(a)
    assert named[1].arrived == 0 and named[2].arrived == 0, "leftover named-barrier arrivals"
    for c in (0, 1):
        assert finalized[c] == live, (c, finalized[c], live)


def main():
    rng = random.Random(7)
    cases = [[1], [3], [1, 1], [2, 5, 1], [0, 4, 0, 2], [1, 1, 1, 1, 1]]
    cases += [[rng.randint(0, 6) for _ in range(rng.randint(1, 6))] for _ in range(30)]
    for seqs in cases:
        for seed in range(150):
            run(seqs, seed)
    print("ok: no deadlock, Q / K / V reads see their own landed data, no slot or stage "
          "overwritten while read, each sequence finalized once after all its P.V")


if __name__ == "__main__":
    main()
