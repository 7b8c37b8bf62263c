"""``python -m msa warmup [...]``: compile the CuTe kernels into the JIT cache ahead of time
(msa._warmup; ``--help`` lists the options)."""

import sys

from ._warmup import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["warmup"]:
        print("usage: python -m msa warmup [--only NAME] [--arch sm_90a] [--workers N] "
              "[--force] [--quiet]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
