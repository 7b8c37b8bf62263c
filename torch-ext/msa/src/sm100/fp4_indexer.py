"""Upstream's import path of the FP4 indexer formats; the code is :mod:`msa._fp4_format`."""

from ..._fp4_format import (FP4_PACKED_D_BYTES, HEAD_DIM, PAGE_SIZE,  # noqa: F401
                            Fp4FormatSpec, ceil_div, normalize_fp4_format)
