"""Upstream's import path of the sparse attention schedule; the code is
:mod:`msa.schedules.sparse`."""

from ...schedules.sparse import (METADATA_COLUMNS, SLOT_SHIFT,  # noqa: F401
                                 SparseAttentionSchedule, SparseSchedulePlan,
                                 prepare_sparse_fwd_schedule_and_split, schedule_capacity,
                                 target_q_per_cta)
