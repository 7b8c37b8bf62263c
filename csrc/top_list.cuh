// A sorted (best first) top-k candidate list held in registers: larger score first, lower id
// on ties; empty slots are (-inf, -1), so -inf and NaN never enter. Shared by the top-k
// selection kernels (sparse_topk_select, the fused decode indexer).
#pragma once

#include <cmath>

namespace msa {

// Total order of candidates: larger score first, lower id on ties.
__device__ __forceinline__ bool ranks_before(float x, int xi, float y, int yi) {
  return x > y || (x == y && xi < yi);
}

template <int KCAP>
struct TopList {
  float score[KCAP];
  int id[KCAP];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < KCAP; ++i) {
      score[i] = -INFINITY;
      id[i] = -1;
    }
  }

  // Whether (x, xi) would enter the list (it must beat the last entry).
  __device__ __forceinline__ bool beats_last(float x, int xi) const {
    return ranks_before(x, xi, score[KCAP - 1], id[KCAP - 1]);
  }

  __device__ __forceinline__ void offer(float x, int xi) {
    if (!beats_last(x, xi)) return;
#pragma unroll
    for (int i = 0; i < KCAP; ++i) {
      if (ranks_before(x, xi, score[i], id[i])) {
        const float ts = score[i];
        const int ti = id[i];
        score[i] = x;
        id[i] = xi;
        x = ts;
        xi = ti;
      }
    }
  }

  // Removes the best entry.
  __device__ __forceinline__ void pop_front() {
#pragma unroll
    for (int i = 0; i + 1 < KCAP; ++i) {
      score[i] = score[i + 1];
      id[i] = id[i + 1];
    }
    score[KCAP - 1] = -INFINITY;
    id[KCAP - 1] = -1;
  }
};

}  // namespace msa
