"""Upstream's import path of the paged decode schedule; the code is :mod:`msa.schedules.decode`."""

from ...schedules.decode import (QO_TILE_ROWS, DecodeSchedule,  # noqa: F401
                                 build_decode_schedule)
