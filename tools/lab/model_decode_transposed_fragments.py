#!/usr/bin/env python3
"""Lane-by-lane replay of the transposed token form's P tile (no GPU needed).

csrc/decode_attention.cu, kTwTransposed: a consumer warpgroup holds S^T = K Q^T of a page as
two m64n64 accumulators (keys 64 m .. 64 m + 63 by columns = its 64 tile rows), turns a column
group's entries into P and stores them (store_p_transposed) as the B operand of O^T = V^T P^T:
row = column, the 128 key positions K-major and 128-byte swizzled, each 16-key group in the
V^T tile's key order (transpose_v_quarter, replayed by model_decode_pv_fragments.py). Replayed
here with the hardware's layouts:

* the m64nNk32 accumulator: register 4 j + e of lane l in warp w is row 16 w + l / 4 + 8 (e >> 1),
  column 8 j + 2 (l % 4) + (e & 1); tt_index(j, e, h) names column e of group j, row + 8 h;
* B K-major, 128-byte swizzle: element (n, k) at n * 128 + ((k / 16) ^ (n % 8)) * 16 + k % 16.

Checks: every P byte lands at (column, position of its key) and every byte of the four group
tiles is written once; sum over positions of V^T P equals P V (exact integers, V^T from the
replayed transposer); a half warp's 4-byte stores; swapped byte selectors are caught.

    python tools/lab/model_decode_transposed_fragments.py
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_decode_pv_fragments import (ROW, byte_perm, check_transpose,  # noqa: E402
                                       key_of_position, swizzled)

EVEN_SELECTOR, ODD_SELECTOR = 0x5140, 0x1504


def tt_index(j, e, h):
    return 8 * j + 4 * (e >> 1) + 2 * h + (e & 1)


def accumulator_coords(warp, lane, reg):
    j, e = divmod(reg, 4)
    return 16 * warp + lane // 4 + 8 * (e >> 1), 8 * j + 2 * (lane % 4) + (e & 1)


def store_p(p, group, tiles, writes, selectors=(EVEN_SELECTOR, ODD_SELECTOR)):
    """store_p_transposed for column group `group` of a warpgroup: p[col][key] (col 0..63 of the
    warpgroup, key 0..127 of the page) -> tiles (bytearray of the four group tiles, 2 KB
    each); writes counts the bytes written per address."""
    tile0 = group * 16 * ROW
    for warp in range(4):
        s = {}   # (lane, m) -> 32 registers
        for lane in range(32):
            for m in range(2):
                regs = [0] * 32
                for reg in range(32):
                    row, col = accumulator_coords(warp, lane, reg)
                    regs[reg] = p[col][64 * m + row]
                s[(lane, m)] = regs
        for m in range(2):
            pairs, sends = {}, {}
            for lane in range(32):
                regs = s[(lane, m)]
                pair = [regs[tt_index(group, e, 0)] | (regs[tt_index(group, e, 1)] << 8)
                        for e in range(4)]
                odd = (lane >> 2) & 1
                pairs[lane] = pair
                sends[lane] = (pair[0] | (pair[1] << 16)) if odd else (pair[2] | (pair[3] << 16))
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                odd = g & 1
                recv = sends[lane ^ 4]
                for b in range(2):
                    mine = pairs[lane][2 + b] if odd else pairs[lane][b]
                    theirs = (recv >> (16 * b)) & 0xFFFF
                    word = byte_perm(mine, theirs, selectors[odd])
                    col = 8 * odd + 2 * t + b
                    kg = 4 * m + warp
                    addr = tile0 + col * ROW + ((kg ^ (col & 7)) << 4) + 4 * (g >> 1)
                    for i in range(4):
                        tiles[addr + i] = (word >> (8 * i)) & 0xFF
                        writes[addr + i] = writes.get(addr + i, 0) + 1


def check_tile(rng, selectors=(EVEN_SELECTOR, ODD_SELECTOR)):
    p = [[rng.randrange(256) for _ in range(128)] for _ in range(64)]
    tiles, writes = bytearray(4 * 16 * ROW), {}
    for group in range(4):
        store_p(p, group, tiles, writes, selectors)
    if len(writes) != len(tiles) or set(writes.values()) != {1}:
        return None
    for col in range(64):
        for pos in range(128):
            got = tiles[swizzled(col, pos // 16) + pos % 16]
            if got != p[col][key_of_position(pos)]:
                return None
    return p, tiles


def main():
    rng = random.Random(20261207)
    raw, vt = check_transpose(rng)
    checked = check_tile(rng)
    assert checked is not None, "P tile: a byte out of place"
    p, tiles = checked
    print("P tile: every byte at (column, its key's V^T position), each written once")
    v = [[raw[key * ROW + n] for n in range(128)] for key in range(128)]
    for col in range(0, 64, 3):
        for n in range(0, 128, 7):
            got = sum(vt[swizzled(n, k // 16) + k % 16] * tiles[swizzled(col, k // 16) + k % 16]
                      for k in range(128))
            want = sum(v[key][n] * p[col][key] for key in range(128))
            assert got == want, (col, n)
    print("O^T = V^T P^T over the positions equals (P V)^T")
    assert check_tile(rng, (ODD_SELECTOR, EVEN_SELECTOR)) is None, "a mutation went unnoticed"
    print("mutation (selectors swapped) caught")


if __name__ == "__main__":
    main()
