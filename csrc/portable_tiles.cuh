// Shared-memory tiles and the warp-level Q K^T of the portable tier's kernels
// (docs/design-portable.md): rows of 128 16-bit channels (bf16, or f16 widened from e4m3)
// stored as 16 chunks of 16 bytes, the chunk index XORed with row % 8 so the 8 rows an ldmatrix
// reads at one chunk hit 8 distinct bank groups; each warp computes 16 rows of S = Q K^T
// against a 128-key tile with mma.sync. e4m3 rows (128 bytes, 8 chunks, the same swizzle) are
// staged raw and widened into such a tile: exact on every arch, so the MMAs stay 16-bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "sm80_primitives.cuh"

namespace msa {
namespace portable {

constexpr int kHeadDim = 128;
constexpr int kTileKeys = 128;            // keys of one KV block / index-key tile
constexpr int kRowBytes = kHeadDim * 2;   // one 16-bit row
constexpr int kChunks = kRowBytes / 16;   // 16-byte chunks per row
constexpr int kTileBytes = kTileKeys * kRowBytes;
constexpr int kRawRowBytes = kHeadDim;    // one e4m3 row
constexpr int kRawChunks = kRawRowBytes / 16;
constexpr int kRawTileBytes = kTileKeys * kRawRowBytes;

// Byte offset of chunk `chunk` of row `row` in a swizzled [rows, 128] 16-bit tile.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}
// Byte offset of chunk `chunk` of row `row` in a swizzled [rows, 128] e4m3 tile.
__device__ __forceinline__ int swizzled_raw(int row, int chunk) {
  return row * kRawRowBytes + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// x rounded to e4m3 (to nearest, ties to even, saturating at +-448 as cvt.rn.satfinite; NaN
// stays NaN), in fp32 arithmetic: the values below 2^-6 on e4m3's subnormal grid of 2^-9 by
// one add, the rest by rounding the fp32 mantissa to 3 bits.
__device__ __forceinline__ float round_to_e4m3_grid(float x) {
  const float a = fabsf(x);
  float r;
  if (a < 0.015625f) {
    r = (a + 16384.f) - 16384.f;      // 2^14: the fp32 ulp there is 2^-9
  } else {
    const uint32_t b = __float_as_uint(a);
    r = __uint_as_float((b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u);
  }
  return a != a ? x : copysignf(fminf(r, 448.f), x);
}

// (lo, hi) rounded to e4m3 as the exact f16x2: sm_89+ by its conversion instructions; below,
// by round_to_e4m3_grid (cuda_fp8.h's integer emulation would spill the attention kernel).
__device__ __forceinline__ uint32_t e4m3_rounded_f16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  return pack_f16(round_to_e4m3_grid(lo), round_to_e4m3_grid(hi));
#else
  return sm80::round_e4m3x2_to_f16x2(lo, hi);
#endif
}

// The m16n8k16 MMA of the 16-bit operand type T (__nv_bfloat16 or __half).
template <typename T>
__device__ __forceinline__ void mma_16bit(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    sm80::mma_f16(c, a, b0, b1);
  } else {
    sm80::mma_bf16(c, a, b0, b1);
  }
}

// Two e4m3 values of a 32-bit word, bytes 0-1 (kHi false) or 2-3 (kHi true), as T x2; exact.
template <typename T, bool kHi>
__device__ __forceinline__ uint32_t widen_e4m3x2(uint32_t word) {
  const uint32_t h = kHi ? sm80::e4m3x2_hi_to_f16x2(word) : sm80::e4m3x2_lo_to_f16x2(word);
  if constexpr (std::is_same_v<T, __half>) {
    return h;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack_bf16(f.x, f.y);
  }
}

// 16 e4m3 channels (one chunk of an e4m3 row) widened to T and stored as chunks 2 chunk and
// 2 chunk + 1 of row `row` of a swizzled 16-bit tile.
template <typename T>
__device__ __forceinline__ void store_widened(char* tile, int row, int chunk, const uint4& in) {
  const uint4 lo = make_uint4(widen_e4m3x2<T, false>(in.x), widen_e4m3x2<T, true>(in.x),
                              widen_e4m3x2<T, false>(in.y), widen_e4m3x2<T, true>(in.y));
  const uint4 hi = make_uint4(widen_e4m3x2<T, false>(in.z), widen_e4m3x2<T, true>(in.z),
                              widen_e4m3x2<T, false>(in.w), widen_e4m3x2<T, true>(in.w));
  *reinterpret_cast<uint4*>(tile + swizzled(row, 2 * chunk)) = lo;
  *reinterpret_cast<uint4*>(tile + swizzled(row, 2 * chunk + 1)) = hi;
}

// Rows [row0, row0 + kRows) of a swizzled e4m3 tile widened into the same rows of a swizzled
// T tile by `workers` threads (this one is `worker`). Consecutive threads take consecutive rows
// of one chunk, so 8 threads' 16-byte reads and writes hit 8 distinct bank groups.
template <typename T, int kRows>
__device__ __forceinline__ void widen_rows(const char* raw, char* tile, int row0, int worker,
                                           int workers) {
  for (int u = worker; u < kRows * kRawChunks; u += workers) {
    const int row = row0 + u % kRows, chunk = u / kRows;
    store_widened<T>(tile, row, chunk,
                     *reinterpret_cast<const uint4*>(raw + swizzled_raw(row, chunk)));
  }
}

// s[n][0..3] = the m16n8 accumulator of keys 8n .. 8n + 7: rows row0 + lane / 4 (elements 0, 1)
// and row0 + lane / 4 + 8 (elements 2, 3), keys 8n + 2 (lane % 4) + {0, 1}, of the product of
// rows row0 .. row0 + 15 of sQ and the 128 keys of sK (both swizzled T tiles), in fp32.
template <typename T>
__device__ __forceinline__ void warp_qk(float (&s)[16][4], const char* sQ, const char* sK,
                                        int row0, int lane) {
#pragma unroll
  for (int n = 0; n < 16; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t qa[4];
    sm80::ldmatrix_x4(qa, sQ + swizzled(row0 + lane % 16, 2 * kk + lane / 16));
#pragma unroll
    for (int n2 = 0; n2 < kTileKeys / 16; ++n2) {     // keys 16 n2 .. 16 n2 + 15: two n-tiles
      uint32_t kb[4];
      sm80::ldmatrix_x4(kb, sK + swizzled(16 * n2 + lane % 8 + (lane / 16) * 8,
                                          2 * kk + (lane / 8) % 2));
      mma_16bit<T>(s[2 * n2], qa, kb[0], kb[1]);
      mma_16bit<T>(s[2 * n2 + 1], qa, kb[2], kb[3]);
    }
  }
}

}  // namespace portable
}  // namespace msa
