// Programmatic dependent launch (sm_90+) for the kernels of the decode chain (indexer plan,
// indexer + top-k, attention, merge): a kernel launched dependent is started while the kernel
// before it on the stream still runs, so its CTAs are resident when that kernel's last CTAs
// finish instead of after the launch that follows its completion.
//
// Every kernel that may be launched dependent calls enter_dependent_grid() first, before any
// global memory access: it waits until the grids it depends on have completed (their writes
// visible), then lets the next grid start launching. Waiting before releasing keeps a chain of
// such kernels ordered like plain launches: when a grid is released, every grid before the one
// that released it has completed.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common.cuh"

namespace msa {
namespace detail {

// A no-op when the kernel was launched plainly; compiled out before sm_90, whose images the
// launchers never launch dependent (dependent_launch_loaded).
__device__ __forceinline__ void enter_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether the image the current device loaded for `kernel` was compiled for sm_90+ (so its
// enter_dependent_grid waits; not a compute_80 PTX build JIT-compiled on an SM90): asked once per
// device and kernel type. A dependent launch of an image that does not wait would race its
// predecessor.
template <typename Kernel>
inline bool dependent_launch_loaded(Kernel kernel) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  return asked_once_per_device(device, [kernel](int) {
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.ptxVersion >= 90;
  });
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), launched dependent on the stream's
// previous kernel when `dependent` (the caller checked dependent_launch_loaded).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                          cudaStream_t stream, bool dependent, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace detail
}  // namespace msa
