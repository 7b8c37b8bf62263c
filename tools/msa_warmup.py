#!/usr/bin/env python3
"""Compile the CuTe-DSL kernels into the JIT cache ahead of time, from a checkout.

    python tools/msa_warmup.py [--only NAME] [--arch sm_90a] [--workers N] [--force] [--quiet]

Loads msa as tools/msa_loading.py does (MSA_PACKAGE_DIR, else the variant of build/ the
`kernels` loader picks, else the source tree) and runs its warm-up (msa._warmup.main: the same
as ``msa.warmup()`` / ``python -m msa warmup``). Exit status 0 when every kernel compiled, 1 when
one failed, 2 when nothing can be compiled here.
"""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from msa_loading import load_msa  # noqa: E402

if __name__ == "__main__":
    msa = load_msa(verbose=False)
    sys.exit(importlib.import_module(f"{msa.__name__}._warmup").main(sys.argv[1:]))
