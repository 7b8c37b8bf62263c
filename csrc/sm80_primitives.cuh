// Warp-level primitives shared by the csrc kernels (sm_80+ instructions; every csrc arch):
// cp.async copies, ldmatrix, mma.sync m16n8k16 (bf16 / f16 in, fp32 accumulate), exact
// e4m3 -> f16 / fp32 widening of register pairs and fp32 -> e4m3 rounding.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace msa {
namespace sm80 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
// 16 bytes, or 16 zero bytes when !valid (src-size 0: nothing is read; src stays a valid
// address all the same).
__device__ __forceinline__ void cp_async_16_or_zero(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 address the rows of matrix i; lane l
// receives elements (l / 4, 2 (l % 4) + {0, 1}) of each, or with .trans elements
// (2 (l % 4) + {0, 1}, l / 4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 values of a 32-bit word -> f16x2, exact: bytes 0-1 (lo) or 2-3 (hi). sm_89+ has the
// conversion instruction; read through a b16 unpack, so it takes the upper half itself instead
// of after a shift. sm_80 / sm_86 / sm_87 (no FP8 conversions) go through cuda_fp8.h's exact
// integer path.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two),
                                                   __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}
__device__ __forceinline__ uint32_t e4m3x2_lo_to_f16x2(uint32_t word) {
  return e4m3x2_to_f16x2(static_cast<uint16_t>(word & 0xFFFFu));
}
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t word) {
  return e4m3x2_to_f16x2(static_cast<uint16_t>(word >> 16));
}
#else
__device__ __forceinline__ uint32_t e4m3x2_lo_to_f16x2(uint32_t word) {
  uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
      : "=r"(r) : "r"(word));
  return r;
}
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t word) {
  uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
      : "=r"(r) : "r"(word));
  return r;
}
#endif

// Two e4m3 values of a 32-bit word as f16x2 times 2^-8 (bytes 0-1 or 2-3) by integer ops, not
// the conversion pipe: each byte sign-extended into its 16-bit half (prmt's sign mode, which
// __byte_perm drops), shifted up 7 bits (exponent and mantissa land in place, the sign at bit
// 15 and its copies above), bit 14 and the spill into the next half cleared. Exact for every
// finite e4m3 (subnormals land on f16 subnormals); a NaN byte reads as +-480 * 2^-8. The
// caller folds the 2^8 back in (a score or output scale).
__device__ __forceinline__ uint32_t e4m3x2_lo_to_scaled_f16x2(uint32_t word) {
  uint32_t sx;
  asm("prmt.b32 %0, %1, 0, 0x9180;" : "=r"(sx) : "r"(word));
  return (sx << 7) & 0xBF80BF80u;
}
__device__ __forceinline__ uint32_t e4m3x2_hi_to_scaled_f16x2(uint32_t word) {
  uint32_t sx;
  asm("prmt.b32 %0, %1, 0, 0xB3A2;" : "=r"(sx) : "r"(word));
  return (sx << 7) & 0xBF80BF80u;
}

// Two e4m3 values (bits 0-7 and 8-15) -> float2, exact.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t bits) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits),
                                                      __NV_E4M3);
  return __half22float2(__half2(raw));
}

// (lo, hi) rounded to e4m3 (as an FP8 P.V MMA sees P), returned as the exact f16x2.
__device__ __forceinline__ uint32_t round_e4m3x2_to_f16x2(float lo, float hi) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3), __NV_E4M3);
  return static_cast<uint32_t>(raw.x) | (static_cast<uint32_t>(raw.y) << 16);
}

}  // namespace sm80
}  // namespace msa
