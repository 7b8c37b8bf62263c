// Small helpers shared by the msa CUDA ops (csrc/*.cu).
//
// The .cu files are plain CUDA C++: they never include torch headers, so each one compiles on
// its own with nvcc (tools/check_csrc.sh). torch-ext/torch_binding.cpp validates tensors and
// calls the launchers declared in torch-ext/torch_binding.h with raw pointers and a stream.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace msa {
namespace detail {

// Threads per block of the element-wise kernels.
constexpr int kThreads = 256;

template <typename T>
__host__ __device__ __forceinline__ T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Blocks for `n` elements at `threads` per block (at least 1, so callers can skip n == 0).
inline unsigned int grid_for(int64_t n, int threads = kThreads) {
  int64_t blocks = ceil_div<int64_t>(n, threads);
  return static_cast<unsigned int>(blocks < 1 ? 1 : blocks);
}

// Rounds a byte offset up to 256 so every workspace slice is aligned for vector loads and CUB.
__host__ __device__ __forceinline__ size_t align_up_256(size_t bytes) {
  return (bytes + 255) & ~static_cast<size_t>(255);
}

// Bump allocator over one caller-provided workspace buffer (host side). Calling it with a null
// base only measures, so the same code computes the required size and carves the buffer.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(size_t count) {
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + used_);
    used_ += align_up_256(count * sizeof(T));
    return p;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// Reads entry i of an integer tensor that is either int32 or int64 (widened to int64).
__device__ __forceinline__ int64_t load_integer(const void* ptr, bool is_int64, int64_t i) {
  return is_int64 ? __ldg(static_cast<const long long*>(ptr) + i)
                  : static_cast<int64_t>(__ldg(static_cast<const int*>(ptr) + i));
}

// Inclusive prefix sum of v over the lanes of a full warp (lane l gets lanes 0 .. l's sum).
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T up = __shfl_up_sync(0xFFFFFFFFu, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

// ask(device) (a fact of the device or of the image it loaded), asked once per device and kept:
// each call site's lambda type has its own table. False for device ids past the table.
template <typename Ask>
inline bool asked_once_per_device(int device, Ask ask) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> state[kMaxDevices];      // 0 not asked, 1 yes, 2 no
  if (device < 0 || device >= kMaxDevices) return false;
  int known = state[device].load(std::memory_order_relaxed);
  if (known == 0) {
    known = ask(device) ? 1 : 2;
    state[device].store(known, std::memory_order_relaxed);
  }
  return known == 1;
}

// Number of bits needed to represent every value in [0, max_value].
inline int bits_for(uint64_t max_value) {
  int bits = 0;
  while (max_value > 0) {
    ++bits;
    max_value >>= 1;
  }
  return bits;
}

}  // namespace detail
}  // namespace msa

// Returns the first CUDA error from a launcher instead of throwing (the .cu side has no torch).
#define MSA_RETURN_IF_ERROR(expr)          \
  do {                                     \
    cudaError_t msa_err__ = (expr);        \
    if (msa_err__ != cudaSuccess) {        \
      return msa_err__;                    \
    }                                      \
  } while (0)
