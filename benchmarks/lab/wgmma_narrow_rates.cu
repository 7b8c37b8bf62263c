// Rate of the tensor pipe on narrow wgmma tiles (a GPU diagnostic, no TSV): e4m3 m64nNk32 and
// bf16 m64nNk16 with both operands in shared memory, N = 16, 32, 64, 128, issued by one to
// three warpgroups of one CTA an SM.
//
// What it answers (docs/design-decode.md, Open): a token-granular sparse decode tile would swap
// the operands (S^T = K Q^T, O^T = V^T P^T: M = keys or channels, N = one token's 16 query
// heads) so that a page costs wgmmas only for the tokens that selected it. That pays only if
// an m64n16 wgmma runs near the m64n128 rate per multiply-add, and if its latency (the wait
// before a turn's softmax) stays short. Two modes, per (dtype, N, warpgroups):
// * throughput: each warpgroup issues batches of 4 wgmmas (a 128-channel k loop) into one
//   accumulator, committing each and waiting for all but the last group: the pipe's rate;
// * latency: one batch of 4 into one accumulator, then wait for it: a turn's Q K^T as the
//   softmax waits for it.
// Prints cycles per batch and multiply-adds per clock per SM (and that as a fraction of the
// same dtype's m64n128 rate with as many warpgroups).
//
//   nvcc -arch=sm_90a -O3 -std=c++17 -o /tmp/wgmma_rates benchmarks/lab/wgmma_narrow_rates.cu
//   /tmp/wgmma_rates
//
// Operands are 128-byte swizzled K-major tiles of small finite values (the same bytes every
// batch: the rate of the pipe, not of shared-memory traffic from other warps).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "../../csrc/sm80_primitives.cuh"
#include "lab_common.cuh"

namespace {

constexpr int kBatch = 4;        // wgmmas a batch: 128 channels of k32 e4m3 / 4 x k16 bf16 steps
constexpr int kBatches = 4096;   // per warpgroup
constexpr int kRowBytes = 128;   // one 128-byte swizzled row per M or N index

#define LAB_D8_TEXT "{%0,%1,%2,%3,%4,%5,%6,%7}"
#define LAB_D8_OPERANDS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7])
#define LAB_D16_TEXT "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define LAB_D16_OPERANDS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
    "+f"(d[14]), "+f"(d[15])
#define LAB_D32_TEXT \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31}"
#define LAB_D32_OPERANDS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
    "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
    "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), \
    "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define LAB_D64_TEXT \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45," \
  "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define LAB_D64_OPERANDS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
    "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
    "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), \
    "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), \
    "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
    "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
    "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), \
    "+f"(d[62]), "+f"(d[63])

// K-major, 128-byte swizzle: stride byte offset = one 8-row atom.
__device__ __forceinline__ uint64_t descriptor(const void* start) {
  return static_cast<uint64_t>((msa::sm80::smem_addr(start) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(8 * kRowBytes >> 4) << 32) | (1ull << 62);
}

// One m64nN wgmma (R = N / 2 accumulators a thread: %0 .. %R-1, then the two descriptors and
// scale_d as %R, %R+1, %R+2, spelled out since asm operand numbers are text).
#define LAB_WGMMA(SHAPE, TAIL, R, A, B, S)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #S ", 0;\n"                             \
               "wgmma.mma_async.sync.aligned." SHAPE " " LAB_D##R##_TEXT ", %" #A ", %" #B \
               TAIL "\n}\n"                                                                 \
               : LAB_D##R##_OPERANDS(d)                                                     \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))

template <int kN>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b,
                                           int scale_d) {
  if constexpr (kN == 16) LAB_WGMMA("m64n16k32.f32.e4m3.e4m3", ", p, 1, 1;", 8, 8, 9, 10);
  if constexpr (kN == 32) LAB_WGMMA("m64n32k32.f32.e4m3.e4m3", ", p, 1, 1;", 16, 16, 17, 18);
  if constexpr (kN == 64) LAB_WGMMA("m64n64k32.f32.e4m3.e4m3", ", p, 1, 1;", 32, 32, 33, 34);
  if constexpr (kN == 128) LAB_WGMMA("m64n128k32.f32.e4m3.e4m3", ", p, 1, 1;", 64, 64, 65, 66);
}

template <int kN>
__device__ __forceinline__ void wgmma_bf16(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b,
                                           int scale_d) {
  if constexpr (kN == 16) LAB_WGMMA("m64n16k16.f32.bf16.bf16", ", p, 1, 1, 0, 0;", 8, 8, 9, 10);
  if constexpr (kN == 32) LAB_WGMMA("m64n32k16.f32.bf16.bf16", ", p, 1, 1, 0, 0;", 16, 16, 17, 18);
  if constexpr (kN == 64) LAB_WGMMA("m64n64k16.f32.bf16.bf16", ", p, 1, 1, 0, 0;", 32, 32, 33, 34);
  if constexpr (kN == 128)
    LAB_WGMMA("m64n128k16.f32.bf16.bf16", ", p, 1, 1, 0, 0;", 64, 64, 65, 66);
}

__device__ __forceinline__ void fence_operands() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wait_groups() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

template <bool kFp8, int kN>
__device__ __forceinline__ void batch(float (&d)[kN / 2], const uint8_t* a, const uint8_t* b) {
  // A: 64 rows x 128 bytes, B: kN rows x 128 bytes; each k step advances 32 bytes in the row
  // (the swizzle atom's base stays aligned, as a k loop over one swizzled tile does).
#pragma unroll
  for (int k = 0; k < kBatch; ++k) {
    const uint64_t da = descriptor(a + 32 * k), db = descriptor(b + 32 * k);
    if constexpr (kFp8) {
      wgmma_e4m3<kN>(d, da, db, 1);
    } else {
      wgmma_bf16<kN>(d, da, db, 1);
    }
  }
}

// One CTA an SM; warpgroup w uses its own A and B tiles. Writes each CTA's cycles to cycles[].
template <bool kFp8, int kN, bool kLatency>
__global__ void __launch_bounds__(384, 1) rates(const uint8_t* src, long long* cycles,
                                                float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int warpgroup = threadIdx.x / 128;
  constexpr int kTileBytes = 64 * kRowBytes + 128 * kRowBytes;   // A (64 rows) + B (<= 128)
  for (int i = threadIdx.x; i < 3 * kTileBytes / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(smem)[i] = reinterpret_cast<const uint4*>(src)[i];
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint8_t* a = smem + warpgroup * kTileBytes;
  const uint8_t* b = a + 64 * kRowBytes;
  float d[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) d[i] = 0.f;
  const long long start = clock64();
  for (int it = 0; it < kBatches; ++it) {
    fence_operands();
    batch<kFp8, kN>(d, a, b);
    commit();
    if constexpr (kLatency) {
      wait_groups<0>();
    } else {
      wait_groups<1>();
    }
  }
  wait_groups<0>();
  const long long stop = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) s += d[i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

struct Run {
  double cycles_per_batch;
  double fma_per_clock;
};

template <bool kFp8, int kN, bool kLatency>
Run run(int warpgroups, int sms, const uint8_t* src, long long* cycles, float* sink) {
  auto kernel = rates<kFp8, kN, kLatency>;
  const int smem = 3 * (64 + 128) * kRowBytes;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<sms, 128 * warpgroups, smem>>>(src, cycles, sink);   // warm-up
  kernel<<<sms, 128 * warpgroups, smem>>>(src, cycles, sink);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  long long host[1024];
  CHECK(cudaMemcpy(host, cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost));
  double mean = 0.;
  for (int i = 0; i < sms; ++i) mean += static_cast<double>(host[i]) / sms;
  const double k = kFp8 ? 32. : 16.;
  const double fma = static_cast<double>(warpgroups) * kBatches * kBatch * 64. * kN * k;
  return {mean / kBatches, fma / mean};
}

template <bool kFp8>
void table(int sms, const uint8_t* src, long long* cycles, float* sink) {
  const char* dtype = kFp8 ? "e4m3 k32" : "bf16 k16";
  for (int mode = 0; mode < 2; ++mode) {
    const bool latency = mode == 1;
    for (int warpgroups = 1; warpgroups <= 3; ++warpgroups) {
      const Run wide = latency ? run<kFp8, 128, true>(warpgroups, sms, src, cycles, sink)
                               : run<kFp8, 128, false>(warpgroups, sms, src, cycles, sink);
      const Run narrow[4] = {
          latency ? run<kFp8, 16, true>(warpgroups, sms, src, cycles, sink)
                  : run<kFp8, 16, false>(warpgroups, sms, src, cycles, sink),
          latency ? run<kFp8, 32, true>(warpgroups, sms, src, cycles, sink)
                  : run<kFp8, 32, false>(warpgroups, sms, src, cycles, sink),
          latency ? run<kFp8, 64, true>(warpgroups, sms, src, cycles, sink)
                  : run<kFp8, 64, false>(warpgroups, sms, src, cycles, sink),
          wide};
      const int widths[4] = {16, 32, 64, 128};
      for (int i = 0; i < 4; ++i) {
        std::printf("%s\t%s\t%d\tN=%d\t%.1f cycles a batch\t%.0f FMA/clk/SM\t%.2fx of N=128\n",
                    dtype, latency ? "latency" : "throughput", warpgroups, widths[i],
                    narrow[i].cycles_per_batch, narrow[i].fma_per_clock,
                    narrow[i].fma_per_clock / wide.fma_per_clock);
      }
    }
  }
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t src_bytes = 3 * (64 + 128) * kRowBytes;
  uint8_t* src = nullptr;
  long long* cycles = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&src, src_bytes));
  CHECK(cudaMalloc(&cycles, sms * sizeof(long long)));
  CHECK(cudaMalloc(&sink, sms * 384 * sizeof(float)));
  std::printf("dtype\tmode\twarpgroups\tN\tcycles\trate\tvs N=128\n");
  lab::fill_bytes<<<64, 256>>>(src, src_bytes, lab::Fill::kE4m3, 7u);
  table<true>(sms, src, cycles, sink);
  lab::fill_bytes<<<64, 256>>>(src, src_bytes, lab::Fill::kBf16, 7u);
  table<false>(sms, src, cycles, sink);
  return 0;
}
