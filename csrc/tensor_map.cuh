// Host side: TMA tensor maps (CUtensorMap) of paged caches, for kernels that copy whole pages
// with cp.async.bulk.tensor. The encoder comes from the driver through the runtime's entry-point
// query, so nothing links libcuda.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "common.cuh"

namespace msa {

// Whether the device has the TMA unit (sm_90+); asked once per device.
inline bool device_has_tma(int device) {
  return detail::asked_once_per_device(device, [](int d) {
    int major = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) == cudaSuccess &&
           major >= 9;
  });
}

// Encodes into `map` (64-byte aligned, sizeof(CUtensorMap)) the tensor map of `rows` rows of
// `row_bytes` bytes at `base` (row-major, bytes), copied in boxes of `box_rows` whole rows with
// the given shared-memory swizzle. False where the device has no TMA, the driver cannot encode
// it, the base is not 16-byte aligned or a row coordinate would not fit the copy's int32.
// A map depends on these arguments alone, and the launchers ask for the same few caches on every
// layer and step, so each host thread keeps its last few maps.
inline bool encode_row_map(void* map, const void* base, int64_t rows, uint32_t row_bytes,
                           uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || !device_has_tma(device) ||
      reinterpret_cast<uintptr_t>(base) % 16 != 0 || rows < 1 || rows > INT32_MAX) {
    return false;
  }
  struct Entry {
    const void* base = nullptr;
    int64_t rows = 0;
    uint32_t row_bytes = 0, box_rows = 0;
    int swizzle = -1;
    CUtensorMap map;
  };
  constexpr int kEntries = 8;
  thread_local Entry recent[kEntries];
  thread_local int next = 0;
  for (const Entry& e : recent) {
    if (e.base == base && e.rows == rows && e.row_bytes == row_bytes &&
        e.box_rows == box_rows && e.swizzle == static_cast<int>(swizzle)) {
      std::memcpy(map, &e.map, sizeof(CUtensorMap));
      return true;
    }
  }
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {row_bytes, static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {row_bytes};   // bytes between rows
  const cuuint32_t box[2] = {row_bytes, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  if (encode(static_cast<CUtensorMap*>(map), CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
             const_cast<void*>(base), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    return false;
  }
  Entry& slot = recent[next];
  next = (next + 1) % kEntries;
  slot.base = base;
  slot.rows = rows;
  slot.row_bytes = row_bytes;
  slot.box_rows = box_rows;
  slot.swizzle = static_cast<int>(swizzle);
  std::memcpy(&slot.map, map, sizeof(CUtensorMap));
  return true;
}

}  // namespace msa
