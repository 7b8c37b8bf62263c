#!/usr/bin/env python3
"""The loops of a kernel's SASS and their instruction mix (no GPU needed).

    ptxas -arch=sm_90a kernel.ptx -o k.cubin && nvdisasm -c k.cubin > k.sass
    python tools/lab/sass_loops.py k.sass [--min-mma 16]

Prints every loop (a backward branch to a label) holding at least --min-mma warpgroup MMAs
(HGMMA / QGMMA): its address range, instruction count and most frequent opcodes. Comparing two
forms' hot loops this way shows select (FSEL) chains from dynamic branches around fragment
stores, or wgmma descriptor arithmetic (R2UR / IMAD) that a form keeps in vector registers.
"""

from __future__ import annotations

import argparse
import collections
import re


def parse(path):
    """[(address, instruction text)], {label: index of the instruction it marks}."""
    instructions, labels, pending = [], {}, []
    for line in open(path).read().splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if ins:
            labels.update((name, len(instructions)) for name in pending)
            pending = []
            instructions.append((int(ins.group(1), 16), ins.group(2).strip()))
    return instructions, labels


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sass", help="nvdisasm -c output")
    ap.add_argument("--min-mma", type=int, default=16)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args(argv)
    instructions, labels = parse(args.sass)
    for i, (address, text) in enumerate(instructions):
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if not branch or labels.get(branch.group(1), i) >= i:
            continue
        body = instructions[labels[branch.group(1)]:i + 1]
        mmas = sum("GMMA" in t for _, t in body)
        if mmas >= args.min_mma:
            mix = collections.Counter(opcode(t) for _, t in body).most_common(args.top)
            print(f"loop {body[0][0]:#x}-{address:#x}: {len(body)} instructions, {mmas} MMA; "
                  + ", ".join(f"{op} {n}" for op, n in mix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
