#!/usr/bin/env python3
"""Lane-by-lane replay of a token warp's page in the decode token-warps form (no GPU needed).

csrc/decode_attention.cu, decode_attention_token_warps_kernel: one warp's 16 rows against a
page's 128 keys, S = Q K^T then O += P V, from the raw page in shared memory, with the
hardware's fragment layouts of mma.sync m16n8k16 (g = lane / 4, t = lane % 4):

* A (16 x 16, row-major): a0 = (g, 2t .. 2t + 1), a1 = (g + 8, same), a2 = (g, 2t + 8 .. + 9),
  a3 = (g + 8, same); B (16 x 8): b0 = (k 2t .. 2t + 1, n g), b1 = (k 2t + 8 .. + 9, n g);
  C: c0, c1 = (g, 2t .. 2t + 1), c2, c3 = (g + 8, same).

The warp reads the raw page (16-byte chunk c of row r at c ^ (r % 8)) with the direct form's
permuted channel order (Q: load_query_raw_fp8 + widen_query_fp8; K: two chunks of a key row a
thread; V: direct_pv_page's byte permutes) and stores O from P.V's permuted output order
(token_warp_store). Element values stand for their f16 widening (the widening itself is exact).

Checks: S equals Q K^T and the stored O equals P V for random integer Q, K, P, V (exact); every
element of the page is read by the thread the fragment layout names; a mutation of the V
permute is caught.

    python tools/lab/model_decode_token_warps_fragments.py
"""
from __future__ import annotations

import random

KEYS = DIM = 128


def perm(lo, hi, sel):
    """__byte_perm(lo, hi, sel) on two 4-element words (element i = byte i): result element i is
    element (sel >> 4 i) & 7 of lo then hi."""
    both = lo + hi
    return [both[(sel >> (4 * i)) & 7] for i in range(4)]


def mma(c, a, b):
    """c (16 x 8, dict of (row, n)) += A (16 x 16) B (16 x 8), from the 32 lanes' fragments:
    a[lane] = [a0, a1, a2, a3] (pairs), b[lane] = [b0, b1] (pairs)."""
    A = [[None] * 16 for _ in range(16)]
    B = [[None] * 8 for _ in range(16)]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a0, a1, a2, a3 = a[lane]
        for i in range(2):
            A[g][2 * t + i] = a0[i]
            A[g + 8][2 * t + i] = a1[i]
            A[g][2 * t + 8 + i] = a2[i]
            A[g + 8][2 * t + 8 + i] = a3[i]
            B[2 * t + i][g] = b[lane][0][i]
            B[2 * t + 8 + i][g] = b[lane][1][i]
    for r in range(16):
        for n in range(8):
            c[(r, n)] = c.get((r, n), 0) + sum(A[r][k] * B[k][n] for k in range(16))


def accumulator(c, lane):
    """The C fragment lane holds: [c0, c1, c2, c3]."""
    g, t = lane // 4, lane % 4
    return [c.get((g, 2 * t), 0), c.get((g, 2 * t + 1), 0), c.get((g + 8, 2 * t), 0),
            c.get((g + 8, 2 * t + 1), 0)]


def per_warp_page(Q, K, V, P, v_perm=0x5140):
    """S from the raw page and Q's permuted fragments; O (stored order) from P."""
    raw_k = lambda row, chunk: K[row][16 * chunk:16 * chunk + 16]   # swizzled_chunk: logical
    raw_v = lambda row, chunk: V[row][16 * chunk:16 * chunk + 16]
    # Q: rows g, g + 8; 32 bytes each (channels 32t .. 32t + 31); qf[kd] from word kd.
    S = [dict() for _ in range(16)]                                  # per n-tile
    for n in range(16):
        for kd in range(DIM // 16):
            a, b = [], []
            for lane in range(32):
                g, t = lane // 4, lane % 4
                w0 = Q[g][32 * t + 4 * kd:32 * t + 4 * kd + 4]
                w1 = Q[g + 8][32 * t + 4 * kd:32 * t + 4 * kd + 4]
                a.append([w0[0:2], w1[0:2], w0[2:4], w1[2:4]])
                key = 8 * n + g
                k_raw = raw_k(key, 2 * t) + raw_k(key, 2 * t + 1)
                w = k_raw[4 * kd:4 * kd + 4]
                b.append([w[0:2], w[2:4]])
            mma(S[n], a, b)
    got_s = [[S[col // 8][(r, col % 8)] for col in range(KEYS)] for r in range(16)]
    # P.V: 8 steps of 16 keys; acc[4m + q] columns: channel 16 c + (4m + q).
    acc = [dict() for _ in range(16)]
    for kk in range(KEYS // 16):
        for m in range(4):
            for q in range(4):
                a, b = [], []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    key0 = 16 * kk + 2 * t
                    a.append([[P[g][key0], P[g][key0 + 1]], [P[g + 8][key0], P[g + 8][key0 + 1]],
                              [P[g][key0 + 8], P[g][key0 + 9]],
                              [P[g + 8][key0 + 8], P[g + 8][key0 + 9]]])
                    v_lo = [raw_v(key0, g), raw_v(key0 + 8, g)]
                    v_hi = [raw_v(key0 + 1, g), raw_v(key0 + 9, g)]
                    word = lambda v, i: v[i // 4][4 * (i % 4):4 * (i % 4) + 4]
                    k01 = [perm(word(v_lo, m), word(v_hi, m), v_perm),
                           perm(word(v_lo, m), word(v_hi, m), 0x7362)]
                    k89 = [perm(word(v_lo, m + 4), word(v_hi, m + 4), v_perm),
                           perm(word(v_lo, m + 4), word(v_hi, m + 4), 0x7362)]
                    b0 = [k01[0][0:2], k01[0][2:4], k01[1][0:2], k01[1][2:4]][q]
                    b1 = [k89[0][0:2], k89[0][2:4], k89[1][0:2], k89[1][2:4]][q]
                    b.append([b0, b1])
                mma(acc[4 * m + q], a, b)
    # token_warp_store: row g's channel 32t + 16 half + n is acc[n][2 i2 + half].
    out = [[None] * DIM for _ in range(16)]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i2 in range(2):
            for half in range(2):
                for n in range(16):
                    out[g + 8 * i2][32 * t + 16 * half + n] = accumulator(acc[n], lane)[2 * i2 + half]
    return got_s, out


def main():
    rng = random.Random(7)
    rand = lambda rows, cols: [[rng.randint(-3, 3) for _ in range(cols)] for _ in range(rows)]
    Q, K, V, P = rand(16, DIM), rand(KEYS, DIM), rand(KEYS, DIM), rand(16, KEYS)
    want_s = [[sum(Q[r][c] * K[k][c] for c in range(DIM)) for k in range(KEYS)] for r in range(16)]
    want_o = [[sum(P[r][k] * V[k][c] for k in range(KEYS)) for c in range(DIM)] for r in range(16)]

    s, o = per_warp_page(Q, K, V, P)
    assert s == want_s, "per_warp: S differs from Q K^T"
    assert o == want_o, "per_warp: stored O differs from P V"
    _, bad = per_warp_page(Q, K, V, P, v_perm=0x4150)
    assert bad != want_o, "per_warp: a V permute mutation was not caught"
    print("per_warp: S = Q K^T and the stored O = P V exactly; a V permute mutation caught")


if __name__ == "__main__":
    main()
