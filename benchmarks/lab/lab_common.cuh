// Helpers of the standalone lab harnesses (benchmarks/lab/*_timeline.cu): error checks,
// synthetic device data from an integer hash, a shuffled page order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#define CHECK(call)                                                                     \
  do {                                                                                  \
    cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(err_));                                           \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

namespace lab {

// What fill_bytes writes: any byte (E2M1 code pairs), a finite e4m3 value in [-1, 1), an E4M3
// scale in [0.5, 2), or bf16 values in [-1, 1) (two bytes each).
enum class Fill : int { kAnyByte, kE4m3, kE4m3Scale, kBf16 };

__global__ void fill_bytes(uint8_t* data, int64_t count, Fill kind, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float x = (static_cast<int>(h & 0xFFFF) - 32768) / 32768.f;
    if (kind == Fill::kAnyByte) {
      data[i] = static_cast<uint8_t>(h >> 8);
    } else if (kind == Fill::kE4m3) {
      data[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    } else if (kind == Fill::kE4m3Scale) {
      data[i] = static_cast<uint8_t>(0x30 + (h >> 20) % 16);
    } else if (i % 2 == 0) {
      const __nv_bfloat16 b = __float2bfloat16(x);
      std::memcpy(data + i, &b, 2);
    }
  }
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* ptr = nullptr;
  CHECK(cudaMalloc(&ptr, host.size() * sizeof(T)));
  CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return ptr;
}

template <typename T>
T* device_zeros(int64_t count) {
  T* ptr = nullptr;
  CHECK(cudaMalloc(&ptr, count * sizeof(T)));
  CHECK(cudaMemset(ptr, 0, count * sizeof(T)));
  return ptr;
}

// Pages 0 .. n - 1 in a fixed pseudo-random order (a page table's physical ids).
inline std::vector<int32_t> shuffled_pages(int64_t n) {
  std::vector<int32_t> pages(n);
  for (int64_t i = 0; i < n; ++i) pages[i] = static_cast<int32_t>(i);
  uint64_t state = 12345;
  for (int64_t i = n - 1; i > 0; --i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(pages[i], pages[static_cast<int64_t>((state >> 33) % (i + 1))]);
  }
  return pages;
}

// Mean milliseconds per call of `launch` (a callable returning cudaError_t) over `iters` calls,
// after one warm-up call.
template <typename Launch>
float mean_ms(Launch launch, int iters = 10) {
  CHECK(launch());
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i) CHECK(launch());
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  return ms / iters;
}

}  // namespace lab
