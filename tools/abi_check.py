#!/usr/bin/env python3
"""kernel-builder's ABI check over every shared object a build ships.

    python tools/abi_check.py [PATH ...]      # default: build/ (every variant under it)

For each ``*.so`` under the given variant directories, build roots or files: the manylinux_2_28
symbol ceilings (GLIBC 2.28, GLIBCXX 3.4.24, CXXABI 1.3.11, GCC 7.0.0: kernel-builder's policy)
and the Python limited API of 3.9 (abi3), checked with ``kernel_abi_check``, the PyPI package of
kernel-builder's own checker (`kernel-builder check-abi` runs the same code). Prints one line per
file and every violating symbol. Exit status 1 on any violation, 2 when there is nothing to check
or the checker is not installed.

A local build uses the host toolchain (tools/build_variant.py), so its compiled ops may exceed the
ceilings (Debian 12's glibc is 2.36): that is why local builds are never published. The CuTe-DSL
artifacts (exported objects linked against the DSL runtime) must pass, since a Hub build would
ship them as they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

MANYLINUX = "manylinux_2_28"
PYTHON_ABI = "3.9"
ROOT = Path(__file__).resolve().parents[1]


def shared_objects(paths: List[Path]) -> List[Path]:
    found = []
    for path in paths:
        if path.is_file():
            found.append(path)
        else:
            found.extend(p for p in sorted(path.rglob("*.so")) if p.is_file())
    return found


def check(path: Path) -> List[str]:
    """Violations of one shared object, as printable lines."""
    from kernel_abi_check import ObjectFile

    obj = ObjectFile(path)
    problems = [f"{MANYLINUX}: {v.name} needs {v.dep} {v.version}"
                for v in obj.check_manylinux(MANYLINUX)]
    for v in obj.check_python_abi(PYTHON_ABI):
        added = getattr(v, "version_added", None)
        problems.append(f"abi3 {PYTHON_ABI}: {v.name} "
                        + (f"is in the limited API only from {added}" if added
                           else "is not in the limited API"))
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[ROOT / "build"],
                        help="variant directories, build roots or .so files (default: build/)")
    args = parser.parse_args(argv)
    try:
        import kernel_abi_check
    except ImportError:
        print("error: kernel-abi-check is not installed (pip install kernel-abi-check)",
              file=sys.stderr)
        return 2
    files = shared_objects(args.paths)
    if not files:
        print(f"error: no .so under {', '.join(map(str, args.paths))}", file=sys.stderr)
        return 2
    failed = 0
    for path in files:
        problems = check(path)
        failed += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {path}")
        for problem in problems:
            print(f"     {problem}")
    print(f"{len(files)} shared objects, {failed} violating {MANYLINUX} / abi3 {PYTHON_ABI} "
          f"(kernel-abi-check {kernel_abi_check.__version__})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
