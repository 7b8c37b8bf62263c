#!/usr/bin/env python3
"""Fingerprint the sm_90a PTX of every shipped CuTe-DSL variant (no GPU needed).

Refactors of kernel code that cannot be re-run on a GPU right away are proven no-ops this way:

    python tools/ptx_fingerprint.py before.json     # on the old code
    python tools/ptx_fingerprint.py after.json --compare before.json

Source-location lines (.loc / .file) are ignored, so moving code between files does not count.
A change that deletes variants on purpose adds --allow-removed (they are listed, not failed),
one that adds variants --allow-added, one that renames them --rename OLD=NEW (the old file's
names have OLD replaced by NEW before comparing, e.g. --rename _e4m3_rp_=_e4m3_).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "torch-ext"))

import compile_cute  # noqa: E402,F401  (selects sm_90a for the DSL, like the real build)
from msa.cute_kernels.build import compile_variant  # noqa: E402
from msa.cute_kernels.variants import shipped_variants  # noqa: E402


def fingerprint(variant) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        compile_variant(variant, dump_dir=tmp)
        ptx = sorted(Path(tmp).glob("*.ptx"))[0].read_text()
    body = "\n".join(line for line in ptx.splitlines()
                     if not re.match(r"\s*\.(loc|file)\b", line))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file: variant name -> PTX fingerprint")
    ap.add_argument("--compare", metavar="JSON", help="fail unless every fingerprint matches")
    ap.add_argument("--allow-removed", action="store_true",
                    help="with --compare: variants no longer shipped are listed, not failed")
    ap.add_argument("--allow-added", action="store_true",
                    help="with --compare: variants new since the old file are listed, not failed")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="with --compare: replace OLD by NEW in the old file's variant names")
    ap.add_argument("--only", metavar="REGEX",
                    help="fingerprint only the variants whose name matches (re.search)")
    args = ap.parse_args()
    prints = {}
    for variant in shipped_variants():
        if args.only and not re.search(args.only, variant.name):
            continue
        prints[variant.name] = fingerprint(variant)
        print(f"{variant.name:<52} {prints[variant.name]}", flush=True)
    Path(args.out).write_text(json.dumps(prints, indent=1, sort_keys=True))
    if args.compare:
        old = json.loads(Path(args.compare).read_text())
        for spec in args.rename:
            before, after = spec.split("=", 1)
            moved = {k.replace(before, after): v for k, v in old.items() if before in k}
            old = {k: v for k, v in old.items() if before not in k}
            old.update(moved)
        if args.only:
            old = {k: v for k, v in old.items() if re.search(args.only, k)}
        removed = sorted(set(old) - set(prints))
        added = sorted(set(prints) - set(old))
        changed = sorted(k for k in prints if k in old and old[k] != prints[k])
        if not args.allow_removed:
            changed = sorted(changed + removed)
        if not args.allow_added:
            changed = sorted(changed + added)
        print(f"{len(prints)} variants, {len(changed)} changed" +
              (f": {', '.join(changed)}" if changed else ""))
        if removed and args.allow_removed:
            print(f"{len(removed)} removed: {', '.join(removed)}")
        if added and args.allow_added:
            print(f"{len(added)} added: {', '.join(added)}")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
