// Shared-memory tiles and the warp-level Q K^T of the portable tier's kernels
// (docs/design-portable.md): rows of 128 bf16 channels stored as 16 chunks of 16 bytes, the chunk
// index XORed with row % 8 so the 8 rows an ldmatrix reads at one chunk hit 8 distinct bank
// groups; each warp computes 16 rows of S = Q K^T against a 128-key tile with mma.sync.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "sm80_primitives.cuh"

namespace msa {
namespace portable {

constexpr int kHeadDim = 128;
constexpr int kTileKeys = 128;            // keys of one KV block / index-key tile
constexpr int kRowBytes = kHeadDim * 2;   // one bf16 row
constexpr int kChunks = kRowBytes / 16;   // 16-byte chunks per row
constexpr int kTileBytes = kTileKeys * kRowBytes;

// Byte offset of chunk `chunk` of row `row` in a swizzled [rows, 128] bf16 tile.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// s[n][0..3] = the m16n8 accumulator of keys 8n .. 8n + 7: rows row0 + lane / 4 (elements 0, 1)
// and row0 + lane / 4 + 8 (elements 2, 3), keys 8n + 2 (lane % 4) + {0, 1}, of the product of
// rows row0 .. row0 + 15 of sQ and the 128 keys of sK (both swizzled bf16 tiles), in fp32.
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
      sm80::mma_bf16(s[2 * n2], qa, kb[0], kb[1]);
      sm80::mma_bf16(s[2 * n2 + 1], qa, kb[2], kb[3]);
    }
  }
}

}  // namespace portable
}  // namespace msa
