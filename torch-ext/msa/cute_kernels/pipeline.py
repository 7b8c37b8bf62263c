"""Synchronization building blocks of the warp-specialized kernels: mbarrier rings (full / empty
pairs per stage in one shared-memory mbarrier array), the static-stage phase bookkeeping of the
dense FMHA's K/V ring, and named barriers.

Accessors return ``mbar + index`` computed exactly as a hand-written offset would be (the
arithmetic, not a DSL pipeline object), so kernels read as "the K ring's full barrier of stage
s" and compile to the same instructions.
"""

from __future__ import annotations

import dataclasses

import cutlass.cute as cute


def _at(mbar, offset: int, stage):
    """mbar + offset + stage (no add for offset 0)."""
    return mbar + stage if offset == 0 else mbar + offset + stage


@dataclasses.dataclass(frozen=True)
class MbarrierRing:
    """Where a `stages`-deep ring's mbarriers sit in a kernel's mbarrier array (static):
    full[s] at index first + s, empty[s] at first + stages + s. full: the producer's arrival
    (plus the TMA's transaction bytes); empty: the consumers' arrivals. (Frozen and free of
    runtime values, so the DSL never carries it through a dynamic loop.)"""
    stages: int
    first: int = 0

    @property
    def count(self) -> int:
        """mbarriers the ring takes."""
        return 2 * self.stages

    def full(self, mbar, stage):
        return _at(mbar, self.first, stage)

    def empty(self, mbar, stage):
        return _at(mbar, self.first + self.stages, stage)

    def wait_full(self, mbar, use):
        """Wait until the ring's use number `use` (stage use % stages, lap use // stages) has
        been filled."""
        cute.arch.mbarrier_wait(self.full(mbar, use % self.stages), (use // self.stages) % 2)

    def wait_empty(self, mbar, use):
        """Wait until the stage of use number `use` is free: its previous lap consumed (the
        first lap passes at once)."""
        cute.arch.mbarrier_wait(self.empty(mbar, use % self.stages),
                                ((use // self.stages) % 2) ^ 1)


@cute.jit
def static_stage_phase(blk, parity):
    """(stage, mbarrier phase) of a tile's key block `blk` on a two-stage ring where every tile
    starts on stage 0 (block j on stage j % 2, use j // 2 of that stage in this tile); parity:
    bit s = the parity of stage s's uses before this tile."""
    stage = blk % 2
    phase = ((parity >> stage) ^ (blk // 2)) & 1
    return stage, phase


def next_stage_parity(parity, n_blocks):
    """static_stage_phase's parity after a tile of n_blocks (stage 0 takes the even blocks). A
    single register: a producer warp runs on 24."""
    return parity ^ (((n_blocks + 1) // 2) & 1) ^ (((n_blocks // 2) & 1) << 1)


@dataclasses.dataclass(frozen=True)
class NamedBarrier:
    """A hardware named barrier (ids from 1: 0 is sync_threads) over num_threads threads.
    Build it where it is used when the id is a runtime value (the DSL would carry an object
    holding one through dynamic control flow)."""
    barrier_id: object
    num_threads: int

    def sync(self):
        cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=self.num_threads)

    def arrive(self):
        cute.arch.barrier_arrive(barrier_id=self.barrier_id, number_of_threads=self.num_threads)
