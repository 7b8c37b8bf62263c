// Issue rates of the instructions in the e4m3 softmax and the e4m3 widening (a GPU diagnostic,
// no TSV): MUFU.EX2, F2FP (fp32 pair -> e4m3x2), both mixed as the softmax mixes them (two exps
// per conversion), the widening F2FP (e4m3x2 -> f16x2, cvt.rn.f16x2.e4m3x2), the same widening
// by integer ops (sm80::e4m3x2_lo_to_scaled_f16x2: PRMT, SHF, LOP3 giving x * 2^-8 exactly),
// and an FMA-pipe baseline. Questions it answers: do F2FP and MUFU share one
// 16-lane-per-clock pipe (then the e4m3 loop's 64 exps + 32 conversions per thread and block
// cost ~1.5x what the exps alone would), or do they overlap? At what rate do e4m3 fragments
// widen in registers (the direct and token-warps decode forms widen ~512 a page and warp), and
// does the integer form beat the conversion pipe?
//
//   nvcc -arch=sm_90a -O3 -o /tmp/pipe_rates benchmarks/lab/sm90_pipe_rates.cu && /tmp/pipe_rates
//
// Each thread runs kChains independent chains, 1024 threads per CTA, two CTAs per SM (the
// 8-chain kernels fit two per SM; the 16-chain ones need over 32 registers and run in two
// waves), so latency should be hidden and the rate is the pipe's; the 16-chain runs check that
// (same rate: the pipe; higher: the 8-chain run was latency-bound). Prints lanes per clock per
// SM per opcode (see run()).
#include <cstdio>
#include <cuda_runtime.h>

#include "../../csrc/sm80_primitives.cuh"

constexpr int kIters = 4096;

template <int kMode, int kChains>  // 0: FMUL only, 1: + EX2, 2: + F2FP, 3: + 2 EX2 per F2FP,
                                   // 4: + widening F2FP, 5: + widening by PRMT / SHF / LOP3
__global__ void __launch_bounds__(1024) rates(float seed, unsigned* sink) {
  float a[kChains];
  unsigned acc = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) a[c] = seed + 0.01f * c + 1e-4f * threadIdx.x;
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; c += 2) {
      float x = a[c], y = a[c + 1];
      if (kMode == 1 || kMode == 3) {
        asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(x));
        asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(y));
      }
      if (kMode == 2 || kMode == 3) {
        unsigned short h;
        asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(x), "f"(y));
        acc += h;
      }
      if (kMode == 4) {
        unsigned h;
        asm volatile("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n"
                     " cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(h) : "r"(__float_as_uint(x)));
        acc ^= h;
      }
      if (kMode == 5) acc ^= msa::sm80::e4m3x2_lo_to_scaled_f16x2(__float_as_uint(x));
      a[c] = x * -0.999f;       // keeps x in (-1, 1): ex2 stays finite
      a[c + 1] = y * -0.998f;
    }
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += a[c];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc + __float_as_uint(s);
}

// Rates from the grid's wall time (CUDA events, not clock64: on the H200 a clock64 timing gave
// FMUL 210 lanes per "clock" per SM, above the pipe's 128), in lanes per ns per SM, and in
// lanes per clock taking the 8-chain FMUL-only run as 128 lanes per clock (it is issue-bound).
static double g_fmul_lanes_per_ns = 0;

template <int kMode, int kChains>
static void run(const char* label, int sms, unsigned* sink) {
  const int blocks = 2 * sms, threads = 1024;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  rates<kMode, kChains><<<blocks, threads>>>(0.5f, sink);   // warm-up
  cudaEventRecord(e0);
  rates<kMode, kChains><<<blocks, threads>>>(0.5f, sink);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  const double ns = ms * 1e6;
  // Per step and thread: 2 FMUL, plus 2 EX2 and / or 1 F2FP.
  const double steps = 1.0 * blocks * threads * kIters * (kChains / 2) / sms;   // per SM
  if (kMode == 0 && kChains == 8) g_fmul_lanes_per_ns = 2 * steps / ns;
  const double clk = g_fmul_lanes_per_ns / 128.0;   // clocks per ns, by the FMUL calibration
  printf("%-24s %2d chains %9.1f us", label, kChains, ms * 1e3);
  printf("  FMUL %6.1f/clk", 2 * steps / ns / clk);
  if (kMode == 1 || kMode == 3) printf("  EX2 %5.1f/clk", 2 * steps / ns / clk);
  if (kMode == 2 || kMode == 3) printf("  F2FP %5.1f/clk", steps / ns / clk);
  if (kMode == 4) printf("  widening F2FP %5.1f/clk", steps / ns / clk);
  if (kMode == 5) printf("  widenings by ALU %5.1f/clk", steps / ns / clk);
  printf("  (lanes per clock per SM; %.2f clocks per ns)\n", clk);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  unsigned* sink;
  cudaMalloc(&sink, 2 * sms * 1024 * sizeof(unsigned));
  run<0, 8>("FMUL only", sms, sink);
  run<1, 8>("FMUL + 2 EX2", sms, sink);
  run<2, 8>("FMUL + 1 F2FP", sms, sink);
  run<3, 8>("FMUL + 2 EX2 + 1 F2FP", sms, sink);
  run<0, 16>("FMUL only", sms, sink);
  run<1, 16>("FMUL + 2 EX2", sms, sink);
  run<2, 16>("FMUL + 1 F2FP", sms, sink);
  run<3, 16>("FMUL + 2 EX2 + 1 F2FP", sms, sink);
  run<4, 8>("FMUL + 1 widening F2FP", sms, sink);
  run<4, 16>("FMUL + 1 widening F2FP", sms, sink);
  run<5, 8>("FMUL + 1 widening by ALU", sms, sink);
  run<5, 16>("FMUL + 1 widening by ALU", sms, sink);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) { printf("CUDA error: %s\n", cudaGetErrorString(err)); return 1; }
  return 0;
}
