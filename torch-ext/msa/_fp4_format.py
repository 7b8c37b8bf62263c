"""The two packed-FP4 formats the FP4 indexer accepts (nvfp4, mxfp4) and their names.

Hardware-neutral descriptions (torch only); upstream's import path for them is
``msa.src.sm100.fp4_indexer``.
"""

from __future__ import annotations

import dataclasses

import torch

FP4_PACKED_D_BYTES = 64   # D = 128 FP4 codes, two per byte
HEAD_DIM = 128
PAGE_SIZE = 128


@dataclasses.dataclass(frozen=True)
class Fp4FormatSpec:
    """One packed-FP4 format.

    name: "nvfp4" or "mxfp4"; sf_vec_size: elements per block scale (16 or 32);
    scale_groups: scales per 128-element row (8 or 4); torch_scale_dtype: the dtype of the
    scale tensors (float8_e4m3fn or float8_e8m0fnu).
    """
    name: str
    sf_vec_size: int
    scale_groups: int
    torch_scale_dtype: torch.dtype


_FORMATS = {
    "nvfp4": Fp4FormatSpec("nvfp4", 16, HEAD_DIM // 16, torch.float8_e4m3fn),
    "mxfp4": Fp4FormatSpec("mxfp4", 32, HEAD_DIM // 32, torch.float8_e8m0fnu),
}


def normalize_fp4_format(fmt) -> Fp4FormatSpec:
    """Return the :class:`Fp4FormatSpec` for "nvfp4" or "mxfp4" (case-insensitive; a spec passes
    through). Anything else raises ValueError naming ``fp4_format``."""
    if isinstance(fmt, Fp4FormatSpec):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"fp4_format: expected a str ('nvfp4' or 'mxfp4'), got "
                        f"{type(fmt).__name__}")
    spec = _FORMATS.get(fmt.strip().lower())
    if spec is None:
        raise ValueError(f"fp4_format: expected one of {sorted(_FORMATS)}, got {fmt!r}")
    return spec


def ceil_div(x: int, y: int) -> int:
    return -(-int(x) // int(y))
