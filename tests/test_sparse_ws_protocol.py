"""The TMA warp-specialized sparse forms' ring protocol (Q ring, the persistent forms' K/V ring
and work queue) on the CPU model tools/lab/model_sparse_persistent.py: every form of the
serving table runs its consumers and Q stages without a deadlock, a stale read, a lost or a
repeated item on random schedules of two CTAs sharing the queue, and the model catches the
configurations that would break (so the check can fail)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "lab"))
import model_sparse_persistent as model  # noqa: E402

from msa.cute_kernels import variants  # noqa: E402
from msa.cute_kernels.sparse_prefill_sm90_ws import NUM_MMA_WARPGROUPS, Q_STAGES  # noqa: E402


WS_FORMS = [f for f in variants.SPARSE_FORMS.values() if f.kernel == "SparsePrefillSm90Ws"]


@pytest.mark.parametrize("form", WS_FORMS, ids=lambda f: f.name)
def test_ws_form_ring_protocol_holds(form):
    consumers = form.options.get("consumers", NUM_MMA_WARPGROUPS)
    q_stages = form.options.get("q_stages", Q_STAGES)
    # o_in_q_stage: the stage goes back once the tile's stores have read it ("wait").
    o_in_q = "wait" if form.options.get("o_in_q_stage") else None
    assert model.sweep(consumers, q_stages, o_in_q, schedules=150) == {}


def test_model_catches_stale_q_stage_and_deferred_release_deadlock():
    # Three consumers on four stages: a wait passes on the phase two laps back.
    assert "check failed" in model.sweep(3, 4, schedules=150)
    # O staged in the Q stage and handed back at the next tile: two stages a consumer.
    assert "deadlock" in model.sweep(3, 3, "deferred", schedules=150)
    assert model.sweep(3, 6, "deferred", schedules=150) == {}
    # One next-item slot: warp 0 overwrites it before a slow producer warp read it.
    assert "check failed" in model.sweep(2, 4, schedules=150, next_slots=1)
