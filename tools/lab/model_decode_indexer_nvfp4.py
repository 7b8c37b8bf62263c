#!/usr/bin/env python3
"""The decode indexer's NVFP4 key fragments, replayed bit by bit (no GPU).

csrc/decode_indexer.cu widens eight E2M1 codes (one 32-bit word of a key row, code i in nibble
i) into four f16x2 B-fragment words with integer ops and byte_perm (`e2m1x8_to_f16x2`): each f16
is code * 2^-14 exactly, and the words hold the channel pairs (0, 4), (2, 6), (1, 5), (3, 7).
`load_queries<MT, true>` stages Q's e4m3 channels in that order, and `mma_k16` meets A registers
{lo.x, lo.y} with B words {0, 1} in k-step 0 and {lo.z, lo.w} with {2, 3} in k-step 1 (a0 with
b0, a2 with b1). This model replays those bit operations with __byte_perm's semantics and checks:
  * every f16 half of every word, for every code in every nibble, is E2M1(code) * 2^-14;
  * the fragment products over a chunk equal the exact dot product of the query and the key's
    decoded values times its block scale, on random words and queries;
  * a mutation is caught: Q staged in plain channel order against the paired key words;
  * `ScaleSlot`: each scored key's block scales at the warp's first-key offset plus (2 pair + n)
    key8 steps, in the linear and the 128x4 layouts (a wrong step caught).

    python tools/lab/model_decode_indexer_nvfp4.py
"""

from __future__ import annotations

import random
import struct

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MASK32 = 0xFFFFFFFF


def byte_perm(x: int, y: int, selector: int) -> int:
    """__byte_perm(x, y, s), default mode: result byte i = byte (s >> 4i) & 7 of y:x."""
    pool = ((y & MASK32) << 32) | (x & MASK32)
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        assert nibble < 8, "sign-replicate selectors are not used"
        out |= ((pool >> (8 * nibble)) & 0xFF) << (8 * i)
    return out


def e2m1x8_to_f16x2(w: int):
    """csrc/decode_indexer.cu's e2m1x8_to_f16x2, op for op."""
    magnitude = 0x0E0E0E0E
    signs = w & 0x88888888
    even = (((w << 1) & MASK32) & magnitude) | (((signs << 4) & MASK32) & ~magnitude & MASK32)
    odd = ((w >> 3) & magnitude) | (signs & ~magnitude & MASK32)
    return [byte_perm(even, 0, 0x2404), byte_perm(even, 0, 0x3414),
            byte_perm(odd, 0, 0x2404), byte_perm(odd, 0, 0x3414)]


def f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def halves(word: int):
    return f16(word), f16(word >> 16)


def e2m1(code: int) -> float:
    value = E2M1[code & 7]
    return -value if code & 8 else value


def staged_q_chunk(q8, paired: bool):
    """load_queries' four f16x2 words of one 8-channel chunk (as value pairs): the e4m3 bytes
    permuted by byte_perm (0x6240, 0x7351) when paired, then lo / hi halves of each word."""
    x, y = 0x03020100, 0x07060504          # raw.x / raw.y, each byte naming its channel
    if paired:
        x, y = byte_perm(x, y, 0x6240), byte_perm(x, y, 0x7351)
    v = [q8[(word >> (8 * i)) & 0xFF] for word in (x, y) for i in range(4)]
    return [(v[0], v[1]), (v[2], v[3]), (v[4], v[5]), (v[6], v[7])]


def chunk_product(q_words, k_words, scale: float) -> float:
    """mma_k16 over the chunk: k-step 0 meets A {x, y} with B {0, 1}, k-step 1 A {z, w} with
    B {2, 3} (a0 . b0 + a2 . b1); each B word scaled by the key's block scale (hmul2)."""
    total = 0.0
    for a, b in zip(q_words, k_words):
        kb = halves(b)
        total += a[0] * kb[0] * scale + a[1] * kb[1] * scale
    return total


def check_every_code_everywhere():
    for nibble in range(8):
        for code in range(16):
            w = code << (4 * nibble)
            words = e2m1x8_to_f16x2(w)
            values = [v for word in words for v in halves(word)]
            order = [0, 4, 2, 6, 1, 5, 3, 7]
            for slot, channel in enumerate(order):
                want = e2m1(code) * 2.0 ** -14 if channel == nibble else 0.0
                assert values[slot] == want or (want == 0.0 and values[slot] == 0.0), (
                    nibble, code, slot, values[slot], want)


def check_products(paired_q: bool, trials: int = 2000, seed: int = 7) -> bool:
    rng = random.Random(seed)
    for _ in range(trials):
        w = rng.getrandbits(32)
        q8 = [rng.choice([-1, 1]) * rng.randint(0, 448) / 64.0 for _ in range(8)]
        scale = rng.choice([0.5, 1.0, 2.0, 3.0, 0.125, 448.0])
        exact = sum(q8[c] * e2m1((w >> (4 * c)) & 0xF) for c in range(8)) * scale * 2.0 ** -14
        got = chunk_product(staged_q_chunk(q8, paired_q), e2m1x8_to_f16x2(w), scale)
        if got != exact:
            return False
    return True


def scale_offset(linear: bool, key: int, t: int) -> int:
    """Byte of scale 2t of `key` in a page's 1 KB of scales: linear rows of 8, or the 128x4
    layout (32-key rows of 16 bytes, key / 32 a 4-byte column, scale pair t / 2 a 512-byte half)."""
    if linear:
        return key * 8 + 2 * t
    return (t >> 1) * 512 + (key & 31) * 16 + (key >> 5) * 4 + 2 * (t & 1)


def scale_slots_hold(key8_swizzled: int = 128) -> bool:
    """ScaleSlot (computed once per warp from its first key) against the per-key offsets of
    every key score_page loads: key0 = (writer * MT + pair) * 16 for MT <= 2 (kWarps / MT
    writers), warp * 16 for MT > 2; key = key0 + 8 n + lane / 4, at slot.offset + (2 pair + n)
    * slot.key8."""
    warps = 8
    for linear in (True, False):
        key8 = 64 if linear else key8_swizzled
        for mt in (1, 2, 4):
            writers = warps // mt if mt <= 2 else warps
            pairs = mt if mt <= 2 else 1
            for writer in range(writers):
                first = (writer * mt if mt <= 2 else writer) * 16
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    base = scale_offset(linear, first + g, t)
                    for pair in range(pairs):
                        for n in range(2):
                            key = first + pair * 16 + n * 8 + g
                            if base + (2 * pair + n) * key8 != scale_offset(linear, key, t):
                                return False
    return True


def main() -> None:
    assert scale_slots_hold(), "a scale slot misses its key's scales"
    assert not scale_slots_hold(key8_swizzled=64), "a wrong 128x4 key step was not caught"
    print("scale slots: every scored key's offset from its warp's first key, both layouts "
          "(mutation caught)")
    check_every_code_everywhere()
    assert check_products(paired_q=True), "paired Q against paired key words: products differ"
    print("every E2M1 code in every nibble decodes exactly; chunk products exact (2000 words)")
    assert not check_products(paired_q=False), "plain-order Q was not caught"
    print("mutation caught: Q in plain channel order against the paired key words")


if __name__ == "__main__":
    main()
