// How fast can a KV-outer sparse attention hand its per-block results on, per (query, KV head,
// selected block) entry? A GPU diagnostic for docs/design-production-prefill.md (no TSV). Today
// each entry writes a bf16 partial row block (G x 128) that the combine reads back from HBM;
// the two-pass design would instead add P.V, already normalized by an exact LSE, into an fp32 O
// kept in L2 by query windows (O of W queries x 4 KV heads x 16 x 128 x 4 B: 32 MB at W 1024),
// so its rate is that of the L2's reduction units. This times, with the entries of one (query,
// KV head) spread over 16 CTAs far apart in time (slot-major order, the (query, head) pairs
// hashed):
//
//   bf16 store   st.global.v4 of bf16 partial rows, every entry its own 4 KB (HBM-bound)
//   f32 red.v4   red.global.add.v4.f32 of 8 KB into the O window
//   f32 red      red.global.add.f32, the same adds one float at a time
//   f32 store    st.global.v4.f32 of the same 8 KB into the window (the L2 write rate alone)
//   bf16 load    ld.global.v4 of the bf16 partials (the combine's read of today's round trip)
//   f16x2 red.v4 red.global.add.noftz.v4.f16x2 of 4 KB into an f16 O window (half the bytes:
//                safe from overflow for e4m3 V, |V| <= 448)
//
// H100 (f7d879b): red.v4.f32 2.7-3.1 TB/s into a window of <= 32 MB, f16x2 red.v4 2.5-2.9,
// bf16 stores and loads 2.4-3.2 (HBM): the L2's reductions run at about the HBM rate.
//
//   nvcc -arch=sm_90a -O3 -o /tmp/l2_red benchmarks/lab/l2_reduction_rate.cu && /tmp/l2_red
//
// Prints, per window W (queries), each form's microseconds per launch and payload TB/s.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "lab_common.cuh"

constexpr int kHeadsKv = 4, kSlots = 16, kRowFloats = 16 * 128;   // G 16 x D 128
constexpr int kThreads = 256;   // 8 floats of an entry a thread
constexpr int kUnroll = 4;                                                // entries in flight

enum Form : int { kBf16Store, kRedV4, kRedScalar, kF32Store, kBf16Load, kRedF16V4 };
const char* const kFormNames[] = {"bf16 store", "f32 red.v4", "f32 red", "f32 store",
                                  "bf16 load", "f16x2 red.v4"};
constexpr int kForms = 6;

// Entry e (slot-major): its slot e / pairs and (query, head) pair hashed from e % pairs, so a
// pair's 16 entries are pairs entries apart in the launch's order.
__device__ __forceinline__ int64_t pair_of(int64_t e, int64_t pairs) {
  return (static_cast<uint64_t>(e % pairs) * 2654435761ull) % pairs;   // odd multiplier: a permutation
}                                                                      // when pairs is a power of 2

template <int kForm>
__global__ void __launch_bounds__(kThreads) write_entries(float* o, __nv_bfloat16* partial,
                                                          int64_t pairs, float value) {
  const int64_t entries = pairs * kSlots;
  const int t = threadIdx.x;
  uint32_t loaded = 0;
  for (int64_t e0 = static_cast<int64_t>(blockIdx.x) * kUnroll; e0 < entries;
       e0 += static_cast<int64_t>(gridDim.x) * kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = e0 + u;
      if (e >= entries) break;
      const float x = value + 1e-3f * u;
      if constexpr (kForm == kBf16Store) {
        // The partial of (slot, pair): a distinct 4 KB row block each.
        __nv_bfloat162 h = __floats2bfloat162_rn(x, x);
        uint32_t w;
        memcpy(&w, &h, 4);
        uint4* dst = reinterpret_cast<uint4*>(partial + e * kRowFloats) + t;
        asm volatile("st.global.v4.b32 [%0], {%1, %1, %1, %1};" ::"l"(dst), "r"(w) : "memory");
      } else if constexpr (kForm == kBf16Load) {
        const uint4 v = __ldcs(reinterpret_cast<const uint4*>(partial + e * kRowFloats) + t);
        loaded ^= v.x ^ v.y ^ v.z ^ v.w;
      } else if constexpr (kForm == kRedF16V4) {
        // The f16 window of (query, head) pairs: 4 KB each, 8 halves a thread.
        __half2 h = __floats2half2_rn(x, x);
        uint32_t w;
        memcpy(&w, &h, 4);
        void* dst = reinterpret_cast<__half*>(o) + pair_of(e, pairs) * kRowFloats + t * 8;
        asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %1, %1, %1};" ::"l"(dst), "r"(w)
                     : "memory");
      } else {
        float* dst = o + pair_of(e, pairs) * kRowFloats + t * 4;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float* p = dst + half * kThreads * 4;
          if constexpr (kForm == kRedV4) {
            asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(p), "f"(x)
                         : "memory");
          } else if constexpr (kForm == kRedScalar) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + i), "f"(x) : "memory");
            }
          } else {
            asm volatile("st.global.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(p), "f"(x)
                         : "memory");
          }
        }
      }
    }
  }
  if (kForm == kBf16Load && loaded == 0x9E3779B9u) o[t] = 0.f;   // keeps the loads
}

template <int kForm>
float time_form(float* o, __nv_bfloat16* partial, int64_t pairs, int grid) {
  const float ms = lab::mean_ms([&] {
    write_entries<kForm><<<grid, kThreads>>>(o, partial, pairs, 1.f);
    return cudaGetLastError();
  });
  return ms * 1e3f;   // microseconds per launch
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  const int64_t max_window = 16384;
  const int64_t max_pairs = max_window * kHeadsKv;
  float* o = lab::device_zeros<float>(max_pairs * kRowFloats);                       // 0.5 GB
  __nv_bfloat16* partial = lab::device_zeros<__nv_bfloat16>(max_pairs * kSlots * kRowFloats);
  std::printf("%8s %10s", "W", "O MB");
  for (const char* name : kFormNames) std::printf(" %14s", name);
  std::printf("\n");
  for (int64_t window : {256, 512, 1024, 2048, 4096, 16384}) {
    const int64_t pairs = window * kHeadsKv, entries = pairs * kSlots;
    const int grid = sms * 8;
    const float us[kForms] = {time_form<kBf16Store>(o, partial, pairs, grid),
                              time_form<kRedV4>(o, partial, pairs, grid),
                              time_form<kRedScalar>(o, partial, pairs, grid),
                              time_form<kF32Store>(o, partial, pairs, grid),
                              time_form<kBf16Load>(o, partial, pairs, grid),
                              time_form<kRedF16V4>(o, partial, pairs, grid)};
    const double bytes[kForms] = {entries * kRowFloats * 2.0, entries * kRowFloats * 4.0,
                                  entries * kRowFloats * 4.0, entries * kRowFloats * 4.0,
                                  entries * kRowFloats * 2.0, entries * kRowFloats * 2.0};
    std::printf("%8lld %10.0f", static_cast<long long>(window),
                pairs * kRowFloats * 4.0 / (1 << 20));
    for (int f = 0; f < kForms; ++f) std::printf("  %7.1f %4.2fTB", us[f], bytes[f] / us[f] / 1e6);
    std::printf("   (us per launch, payload TB/s)\n");
  }
  CHECK(cudaFree(o));
  CHECK(cudaFree(partial));
  return 0;
}
