#!/usr/bin/env python3
"""Lane-by-lane replay of the e4m3 P.V operands of the decode ping-pong form (no GPU needed).

csrc/decode_attention.cu, kPvFp8: the producer's 128 threads transpose each raw page into a V^T
tile, two quarters a thread (transpose_v_quarter), and the consumers pack P as the e4m3 wgmma's
A fragments (pack_p_e4m3) straight from the Q.K^T accumulator. Replayed here with the hardware's layouts:

* the m64nNk16 accumulator (S): register 4 j + e of lane l in warp w is row 16 w + l / 4 +
  8 (e >> 1), column 8 j + 2 (l % 4) + (e & 1);
* the m64k32 8-bit A fragment (CuTe's ALayout_64x32): byte b of register f of lane l in warp w
  is row 16 w + l / 4 + 8 (f & 1), k 4 (l % 4) + b + 16 (f >> 1);
* B K-major, 128-byte swizzle (the K tile's form): element (n, k) at n * 128 + ((k / 16) ^
  (n % 8)) * 16 + k % 16 of the tile, k-step kk reading k = 32 kk .. 32 kk + 31.

Checks: every V^T byte is V[key(position)][channel]; sum_k A B over the four k-steps equals P V
for random P and V (exact integers); the transposer's loads and 8-byte stores meet no bank
conflict; a mutation of the key order is caught.

    python tools/lab/model_decode_pv_fragments.py
"""
from __future__ import annotations

import random

ROW = 128


def byte_perm(x, y, sel):
    """CUDA __byte_perm: result byte i = byte (sel >> 4 i) & 7 of the 8 bytes y:x."""
    src = x | (y << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def swizzled(row, chunk):
    return row * ROW + ((chunk ^ (row & 7)) << 4)


def key_of_position(pos):
    """Key in position pos of a page's V^T row: position 4u + i of each 16-key group holds key
    2u + (i & 1) + 8 (i >> 1)."""
    group, within = divmod(pos, 16)
    u, i = divmod(within, 4)
    return 16 * group + 2 * u + (i & 1) + 8 * (i >> 1)


def transpose_quarter(raw, tile, quarter, thread, stores):
    """transpose_v_quarter for one loader thread: raw = the page's 128 x 128 bytes (row-major,
    bytearray), tile = the V^T tile (bytearray, swizzled); stores collects (instruction, lane
    group, byte address) of the 8-byte stores for the bank check."""
    g, cq = thread >> 5, thread & 31
    rot = (cq >> 1) & 3
    r = [(rot + s) & 3 for s in range(4)]
    sel_a = r[0] | ((4 + r[0]) << 4) | (r[1] << 8) | ((4 + r[1]) << 12)
    sel_b = r[2] | ((4 + r[2]) << 4) | (r[3] << 8) | ((4 + r[3]) << 12)
    chunk = 2 * quarter + g
    first_half = (cq >> 3) & 1
    base = (32 * quarter + 16 * g) * ROW + 4 * cq
    for it in range(2):
        h = it ^ first_half
        rows = base + 4 * h * ROW
        word = lambda off: int.from_bytes(raw[off:off + 4], "little")  # noqa: E731
        x = [word(rows + k * ROW) for k in range(4)] + [word(rows + (8 + k) * ROW)
                                                         for k in range(4)]
        y = [[0, 0] for _ in range(4)]
        for v in range(2):
            t0 = byte_perm(x[2 * v], x[2 * v + 1], sel_a)
            t1 = byte_perm(x[2 * v], x[2 * v + 1], sel_b)
            t2 = byte_perm(x[4 + 2 * v], x[5 + 2 * v], sel_a)
            t3 = byte_perm(x[4 + 2 * v], x[5 + 2 * v], sel_b)
            y[0][v] = byte_perm(t0, t2, 0x5410)
            y[1][v] = byte_perm(t0, t2, 0x7632)
            y[2][v] = byte_perm(t1, t3, 0x5410)
            y[3][v] = byte_perm(t1, t3, 0x7632)
        for st in range(4):
            row = 4 * cq + ((rot + st) & 3)
            addr = swizzled(row, chunk) + 8 * h
            tile[addr:addr + 8] = (y[st][0] | (y[st][1] << 32)).to_bytes(8, "little")
            stores.append(((quarter, it, st, g), thread, addr))


def check_transpose(rng):
    raw = bytearray(rng.randrange(256) for _ in range(128 * ROW))
    tile = bytearray(128 * ROW)
    stores = []
    for half in range(2):                 # stream_pages_tma: 128 producer threads, two calls
        for thread in range(128):
            transpose_quarter(raw, tile, 2 * half + (thread >> 6), thread & 63, stores)
    for channel in range(128):
        for pos in range(128):
            got = tile[swizzled(channel, pos // 16) + pos % 16]
            want = raw[key_of_position(pos) * ROW + channel]
            assert got == want, (channel, pos, got, want)
    # 8-byte stores: a half warp (16 lanes) per wavefront must cover 16 distinct 8-byte slots.
    by_instruction = {}
    for instr, thread, addr in stores:
        by_instruction.setdefault(instr, []).append((thread, addr))
    for instr, lanes in by_instruction.items():
        lanes.sort()
        for half in range(2):
            slots = {(addr % 128) // 8 for thread, addr in lanes[16 * half:16 * half + 16]}
            assert len(slots) == 16, (instr, half, sorted(slots))
    # 4-byte loads: a warp reads row k, bytes 4 cq: 32 distinct banks by construction.
    return raw, tile


def accumulator_coords(warp, lane, reg):
    j, e = divmod(reg, 4)
    return 16 * warp + lane // 4 + 8 * (e >> 1), 8 * j + 2 * (lane % 4) + (e & 1)


def a_fragment_coords(warp, lane, reg, byte):
    return 16 * warp + lane // 4 + 8 * (reg & 1), 4 * (lane % 4) + byte + 16 * (reg >> 1)


def pack_p(s_regs, key_order=True):
    """pack_p_e4m3 for one lane: s_regs[64] -> pa[kk][f] as 4-tuples of values (byte order)."""
    pa = []
    for kk in range(4):
        regs = []
        for f in range(4):
            j, e = 4 * kk + 2 * (f >> 1), 2 * (f & 1)
            picks = [4 * j + e, 4 * j + e + 1, 4 * j + 4 + e, 4 * j + 4 + e + 1]
            if not key_order:
                picks = [4 * j + e, 4 * j + 4 + e, 4 * j + e + 1, 4 * j + 4 + e + 1]
            regs.append([s_regs[p] for p in picks])
        pa.append(regs)
    return pa


def check_product(rng, raw, tile, key_order=True):
    p = [[rng.randrange(-8, 9) for _ in range(128)] for _ in range(64)]   # P[row][key]
    v = [[raw[key * ROW + n] - 128 for n in range(128)] for key in range(128)]
    vt = lambda n, k: tile[swizzled(n, k // 16) + k % 16] - 128   # noqa: E731
    a = {}
    for warp in range(4):
        for lane in range(32):
            s_regs = [0] * 64
            for reg in range(64):
                row, col = accumulator_coords(warp, lane, reg)
                s_regs[reg] = p[row][col]
            pa = pack_p(s_regs, key_order)
            for kk in range(4):
                for f in range(4):
                    for b in range(4):
                        row, k = a_fragment_coords(warp, lane, f, b)
                        a[(row, 32 * kk + k)] = pa[kk][f][b]
    assert len(a) == 64 * 128, "A fragments must cover the 64 x 128 tile once"
    for row in range(0, 64, 7):
        for n in range(0, 128, 5):
            got = sum(a[(row, k)] * vt(n, k) for k in range(128))
            want = sum(p[row][key] * v[key][n] for key in range(128))
            if got != want:
                return False
    return True


def main():
    rng = random.Random(20261205)
    raw, tile = check_transpose(rng)
    print("transpose: every V^T byte in place; loads and 8-byte stores conflict-free")
    assert check_product(rng, raw, tile), "P.V from the fragments differs from P V"
    print("fragments: sum over the four k32 steps of A(P) B(V^T) == P V")
    assert not check_product(rng, raw, tile, key_order=False), "key-order mutation not caught"
    print("mutation (P packed in plain key order) caught")


if __name__ == "__main__":
    main()
