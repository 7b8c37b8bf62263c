// sparse_topk_select: per (query t, output head g) pick the best KV blocks from max_score
// [H, K, T] fp32, exactly as msa.reference.topk.sparse_topk_select_reference:
//
//   end   = clamp(min(num_valid_pages[t], causal_end_block[t] + 1), 0, K)  (eligible ids < end)
//   F     = [0, min(fb, end)) U [max(end - fe, 0), end)    forced, emitted whatever their score
//   fill  = the topk - |F| best eligible non-forced blocks with score > -inf (NaN never), ties
//           to the lower id; output ascending, then -1 up to topk (never -1 inside the prefix).
//   head_reduce: scores of output head g reduce heads [g*R, (g+1)*R) by max (NaN-propagating,
//           like torch.amax) or by an fp32 sum in ascending head order (R = H / H_out).
//
// Because F is two intervals, the candidates of a row are exactly ids [fbc, e0) with
// fbc = min(fb, end) and e0 = max(end - fe, fbc); they rank strictly by (score desc, id asc).
//
// Two kernels, both keeping a sorted top-KCAP list per thread in registers (insertion is rare
// after warm-up: a new value must beat the current last entry):
//   * tile kernel (many queries): a warp's lanes are 32 consecutive queries, so every load of a
//     block k is one coalesced 128-byte line; W warps of a CTA split the K range and merge their
//     lists through shared memory.
//   * row kernel (few queries, e.g. decode): one CTA per (t, g) row, its threads split K, then
//     `budget` rounds of a block-wide arg-max pick the winners.
// and, for many queries against up to kStagedFloats / (queries a CTA + 1) blocks with topk <= 16
// (the prefill chunks; behind the binding's `staged` switch), a staged kernel whose warps take
// whole rows, so a row costs ~K / 32 key computations per lane instead of K insertion steps
// that a warp of 32 lane-held lists runs whenever any lane's list takes a candidate. On an H100
// (f6e4e96, benchmarks/lab/topk_forms.py, 4 heads) it took 16k queries x 373 / 660 blocks from
// 201 / 336 us to 169 / 287 and short chunks (171-182 queries) from 25-38 to 21-28 us; at 1360
// blocks, one CTA an SM, it lost (772 vs 611 us), hence two CTAs an SM at most.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "common.cuh"
#include "top_list.cuh"
#include "torch_binding.h"

namespace msa {
namespace {

constexpr int kRowThreads = 128;
constexpr int kWarp = 32;
constexpr int kMaxTileWarps = 8;

struct RowBounds {
  int end;          // eligible ids are [0, end)
  int begin_count;  // forced ids [0, begin_count)
  int tail_start;   // forced ids [tail_start, end); candidates are [begin_count, tail_start)
  int width;        // min(topk, K): slots that can hold an id
  int budget;       // slots left for candidates
};

__device__ __forceinline__ RowBounds row_bounds(const TopkSelectArgs& a, int t) {
  int64_t end = a.num_valid_pages_per_query == nullptr
                    ? a.num_valid_pages
                    : detail::load_integer(a.num_valid_pages_per_query,
                                           a.num_valid_pages_is_int64, t);
  if (a.causal_end_block != nullptr) {
    const int64_t causal_end =
        detail::load_integer(a.causal_end_block, a.causal_end_block_is_int64, t);
    // causal_end + 1 without overflow at INT64_MAX.
    end = causal_end < end ? causal_end + 1 : end;
  }
  end = end < 0 ? 0 : (end > a.num_tiles ? a.num_tiles : end);
  RowBounds r;
  r.end = static_cast<int>(end);
  r.begin_count = static_cast<int>(a.force_begin_blocks < end ? a.force_begin_blocks : end);
  const int64_t window_start = end - a.force_end_blocks;   // may be negative
  r.tail_start = window_start > r.begin_count ? static_cast<int>(window_start) : r.begin_count;
  r.width = a.topk < a.num_tiles ? a.topk : a.num_tiles;
  const int forced = r.begin_count + (r.end - r.tail_start);
  r.budget = r.width > forced ? r.width - forced : 0;
  return r;
}

// Score of block k for query t and output head g (reducing R = H / H_out heads).
template <int kMode>
__device__ __forceinline__ float block_score(const TopkSelectArgs& a, int64_t head_stride,
                                             int g, int heads_per_group, int k, int t) {
  const float* p = a.max_score + static_cast<int64_t>(g) * heads_per_group * head_stride +
                   static_cast<int64_t>(k) * a.total_q + t;
  float v = __ldg(p);
  if constexpr (kMode != static_cast<int>(HeadReduce::kNone)) {
    for (int r = 1; r < heads_per_group; ++r) {
      const float x = __ldg(p + r * head_stride);
      if constexpr (kMode == static_cast<int>(HeadReduce::kSum)) {
        v = v + x;
      } else {
        v = (v != v || x > v || x != x) ? (v != v ? v : x) : v;   // NaN-propagating max
      }
    }
  }
  return v;
}

// Writes one output row given the selected candidate ids in ascending order (sorted_ids[i],
// i < selected). Forced ids surround them: [0, begin_count) first, [tail_start, end) after.
__device__ __forceinline__ void write_forced_and_tail(int32_t* out_row, const RowBounds& r,
                                                     int selected, int topk) {
  const int begin_slots = r.begin_count < r.width ? r.begin_count : r.width;
  for (int p = 0; p < begin_slots; ++p) out_row[p] = p;
  const int tail_first = r.begin_count + selected;
  for (int f = r.tail_start; f < r.end; ++f) {
    const int p = tail_first + (f - r.tail_start);
    if (p >= r.width) break;
    out_row[p] = f;
  }
  int filled = tail_first + (r.end - r.tail_start);
  filled = filled < r.width ? filled : r.width;
  for (int p = filled; p < topk; ++p) out_row[p] = -1;
}

// Tile kernel: blockDim = 32 * W; lane = query within a tile of 32, warp = K chunk.
template <int KCAP, int kMode>
__global__ void __launch_bounds__(kWarp* kMaxTileWarps)
topk_tile_kernel(TopkSelectArgs a, int heads_per_group, int warps, int k_chunk) {
  __shared__ float merge_score[KCAP][kWarp];
  __shared__ int merge_id[KCAP][kWarp];
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const int tiles_per_head = (a.total_q + kWarp - 1) / kWarp;
  const int g = blockIdx.x / tiles_per_head;
  const int t = (blockIdx.x - g * tiles_per_head) * kWarp + lane;
  const bool active = t < a.total_q;
  const int64_t head_stride = static_cast<int64_t>(a.num_tiles) * a.total_q;

  RowBounds r{};
  TopList<KCAP> list;
  list.clear();
  if (active) {
    r = row_bounds(a, t);
    int lo = warp * k_chunk;
    int hi = lo + k_chunk;
    lo = lo > r.begin_count ? lo : r.begin_count;
    hi = hi < r.tail_start ? hi : r.tail_start;
    if (r.budget > 0) {
      int k = lo;
      // Eight independent loads in flight per lane before they are ranked.
      constexpr int kBatch = 8;
      for (; k + kBatch <= hi; k += kBatch) {
        float x[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          x[u] = block_score<kMode>(a, head_stride, g, heads_per_group, k + u, t);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) list.offer(x[u], k + u);
      }
      for (; k < hi; ++k) {
        list.offer(block_score<kMode>(a, head_stride, g, heads_per_group, k, t), k);
      }
    }
  }
  // Warp 0 absorbs the lists of warps 1..W-1 (in order) through shared memory.
  for (int w = 1; w < warps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int i = 0; i < KCAP; ++i) {
        merge_score[i][lane] = list.score[i];
        merge_id[i][lane] = list.id[i];
      }
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int i = 0; i < KCAP; ++i) list.offer(merge_score[i][lane], merge_id[i][lane]);
    }
    __syncthreads();
  }
  if (warp != 0 || !active) return;

  // The first `budget` entries are the winners; sort their ids ascending (bitonic network on
  // registers, empty slots as INT_MAX sink to the end).
  int ids[KCAP];
  int selected = 0;
#pragma unroll
  for (int i = 0; i < KCAP; ++i) {
    const bool take = i < r.budget && list.id[i] >= 0;
    ids[i] = take ? list.id[i] : INT_MAX;
    selected += take ? 1 : 0;
  }
#pragma unroll
  for (int size = 2; size <= KCAP; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < KCAP; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          const int lo_v = min(ids[i], ids[j]);
          const int hi_v = max(ids[i], ids[j]);
          const bool ascending = (i & size) == 0;
          ids[i] = ascending ? lo_v : hi_v;
          ids[j] = ascending ? hi_v : lo_v;
        }
      }
    }
  }
  int32_t* out_row =
      a.out + static_cast<int64_t>(t) * a.out_token_stride + g * a.out_head_stride;
#pragma unroll
  for (int i = 0; i < KCAP; ++i) {
    if (i < selected) out_row[r.begin_count + i] = ids[i];
  }
  write_forced_and_tail(out_row, r, selected, a.topk);
}

// Row kernel: one CTA of kRowThreads per (t, g).
template <int KCAP, int kMode>
__global__ void __launch_bounds__(kRowThreads)
topk_row_kernel(TopkSelectArgs a, int heads_per_group) {
  constexpr int kWarps = kRowThreads / kWarp;
  __shared__ float best_score[2][kWarps];
  __shared__ int best_id[2][kWarps];
  __shared__ int chosen[64];
  const int t = blockIdx.x % a.total_q;
  const int g = blockIdx.x / a.total_q;
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const int64_t head_stride = static_cast<int64_t>(a.num_tiles) * a.total_q;
  const RowBounds r = row_bounds(a, t);

  TopList<KCAP> list;
  list.clear();
  if (r.budget > 0) {
    for (int k = r.begin_count + threadIdx.x; k < r.tail_start; k += kRowThreads) {
      list.offer(block_score<kMode>(a, head_stride, g, heads_per_group, k, t), k);
    }
  }
  int selected = 0;
  for (; selected < r.budget; ++selected) {   // r is uniform over the CTA
    float s = list.score[0];
    int id = list.id[0];
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
      const float os = __shfl_xor_sync(0xffffffffu, s, offset);
      const int oi = __shfl_xor_sync(0xffffffffu, id, offset);
      if (ranks_before(os, oi, s, id)) {
        s = os;
        id = oi;
      }
    }
    const int buf = selected & 1;
    if (lane == 0) {
      best_score[buf][warp] = s;
      best_id[buf][warp] = id;
    }
    __syncthreads();
    s = best_score[buf][0];
    id = best_id[buf][0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      if (ranks_before(best_score[buf][w], best_id[buf][w], s, id)) {
        s = best_score[buf][w];
        id = best_id[buf][w];
      }
    }
    if (id < 0) break;                          // nothing left above -inf (uniform)
    if (list.id[0] == id) list.pop_front();     // ids are unique: exactly one owner
    if (threadIdx.x == 0) chosen[selected] = id;
  }
  __syncthreads();
  int32_t* out_row =
      a.out + static_cast<int64_t>(t) * a.out_token_stride + g * a.out_head_stride;
  if (threadIdx.x < selected) {
    const int mine = chosen[threadIdx.x];
    int rank = 0;
    for (int j = 0; j < selected; ++j) rank += chosen[j] < mine ? 1 : 0;
    out_row[r.begin_count + rank] = mine;
  }
  if (threadIdx.x == 0) write_forced_and_tail(out_row, r, selected, a.topk);
}

// ---- staged kernel -----------------------------------------------------------------------
// A CTA of kStagedWarps warps stages the scores of kQueries (8, 16 or 32) consecutive queries x
// every block of one output head in shared memory (kQueries consecutive floats per block; a
// pitch of kQueries + 1 floats makes a row's column reads conflict-free), then each warp selects
// whole rows. Short chunks take 8 or 16 queries a CTA so the grid still fills the GPU (32 gave a
// 182-query chunk 24 CTAs, each warp four rows one after another). A candidate is
// a 64-bit key, its orderable score above its negated id, so keys are distinct and the larger
// key ranks first exactly as ranks_before says (-0 is read as +0: they tie). Per row:
//   1. theta = the budget-th largest of the 32 lanes' maxima: budget distinct candidates are
//      >= theta, so every winner is (a bitonic sort of the 32 maxima);
//   2. the candidates >= theta are compacted into a 64-entry buffer; with at most 64 of them a
//      bitonic sort across the warp (two per lane) puts the winners in lanes 0 .. budget-1;
//      with more (adversarial layouts), `budget` rounds of a warp-wide arg-max below the
//      previous winner pick them;
//   3. each winner's rank among the winners' ids gives its output slot (ids ascending).
constexpr int kStagedWarps = 8;
// Shared memory of the staged scores: 768 blocks at 32 queries (x 33 floats), 99 KiB, two CTAs
// an SM; narrower CTAs fit more blocks in it (16 queries: 1490, 8: 2816). Where the staged
// kernel pays past 768 blocks is the caller's choice (`staged`): at 1360 blocks and 32 queries
// a CTA it lost to the tile kernel.
constexpr int kStagedFloats = 25344;      // 768 blocks x 33 floats
constexpr int kStagedMinTiles = 64;
constexpr int kStagedMinQueries = 64;      // fewer take the row kernel
constexpr int kStagedMaxWidth = 16;
constexpr int kSurvivors = 64;
constexpr unsigned kFullMask = 0xffffffffu;

// 0 for what is never filled (-inf, NaN); else larger ranks first: score desc, then id asc.
__device__ __forceinline__ uint64_t candidate_key(float x, int id) {
  if (!(x > -INFINITY)) return 0;
  const uint32_t bits = __float_as_uint(x == 0.0f ? 0.0f : x);
  const uint32_t ord = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(ord) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(id));
}

__device__ __forceinline__ int key_id(uint64_t key) {
  return static_cast<int>(~static_cast<uint32_t>(key));
}

// One bitonic compare-exchange step for the element at position p (partner p ^ stride).
__device__ __forceinline__ uint64_t bitonic_step(uint64_t v, uint64_t other, int p, int stride,
                                                 int size) {
  const bool keep_max = ((p & stride) == 0) == ((p & size) == 0);
  return keep_max ? (v > other ? v : other) : (v < other ? v : other);
}

// Descending across the warp, one key per lane (lane i holds the i-th largest).
__device__ __forceinline__ uint64_t warp_sort_desc32(uint64_t v, int lane) {
#pragma unroll
  for (int size = 2; size <= kWarp; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      v = bitonic_step(v, __shfl_xor_sync(kFullMask, v, stride), lane, stride, size);
    }
  }
  return v;
}

// Descending across the warp, two keys per lane: position lane in lo, lane + 32 in hi.
__device__ __forceinline__ void warp_sort_desc64(uint64_t& lo, uint64_t& hi, int lane) {
#pragma unroll
  for (int size = 2; size <= 2 * kWarp; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride == kWarp) {          // size 64: positions lane and lane + 32, descending
        const uint64_t big = lo > hi ? lo : hi;
        hi = lo > hi ? hi : lo;
        lo = big;
      } else {
        const uint64_t lo_other = __shfl_xor_sync(kFullMask, lo, stride);
        const uint64_t hi_other = __shfl_xor_sync(kFullMask, hi, stride);
        lo = bitonic_step(lo, lo_other, lane, stride, size);
        hi = bitonic_step(hi, hi_other, lane + kWarp, stride, size);
      }
    }
  }
}

__device__ __forceinline__ uint64_t warp_max_key(uint64_t v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const uint64_t other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// Grid: (query tiles of kQueries) x output heads; blockDim 32 * kStagedWarps; dynamic shared
// memory num_tiles * (kQueries + 1) floats (at most kStagedFloats); width <= 16.
template <int kMode, int kQueries>
__global__ void __launch_bounds__(kWarp* kStagedWarps, 2)
topk_staged_kernel(TopkSelectArgs a, int heads_per_group) {
  static_assert(kQueries == 8 || kQueries == 16 || kQueries == 32, "a power of two <= 32");
  constexpr int kPitch = kQueries + 1;
  extern __shared__ float staged[];
  __shared__ uint64_t survivors[kStagedWarps][kSurvivors];
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const int tiles_per_head = (a.total_q + kQueries - 1) / kQueries;
  const int g = blockIdx.x / tiles_per_head;
  const int t0 = (blockIdx.x - g * tiles_per_head) * kQueries;
  const int64_t head_stride = static_cast<int64_t>(a.num_tiles) * a.total_q;
  const int num_tiles = a.num_tiles;

  // Stage: a warp load covers kBlocksPerLoad blocks x kQueries queries (lane = block offset,
  // query), kBatch loads in flight a warp.
  {
    constexpr int kBatch = 16;
    constexpr int kBlocksPerLoad = kWarp / kQueries;
    const int query = lane % kQueries;
    const int t = t0 + query;
    const bool active = t < a.total_q;
    for (int k0 = (warp * kBatch) * kBlocksPerLoad + lane / kQueries; k0 < num_tiles;
         k0 += kStagedWarps * kBatch * kBlocksPerLoad) {
      float x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int k = k0 + u * kBlocksPerLoad;
        x[u] = active && k < num_tiles
                   ? block_score<kMode>(a, head_stride, g, heads_per_group, k, t)
                   : -INFINITY;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int k = k0 + u * kBlocksPerLoad;
        if (k < num_tiles) staged[k * kPitch + query] = x[u];
      }
    }
  }
  __syncthreads();

  for (int q = warp; q < kQueries; q += kStagedWarps) {
    const int t = t0 + q;
    if (t >= a.total_q) break;                      // uniform: q is the warp's
    const RowBounds r = row_bounds(a, t);
    const float* column = staged + q;
    int selected = 0;
    uint64_t winner = 0;                            // lane i < selected: the i-th winner
    if (r.budget > 0 && r.tail_start > r.begin_count) {
      uint64_t lane_max = 0;
      for (int k = r.begin_count + lane; k < r.tail_start; k += kWarp) {
        const uint64_t key = candidate_key(column[k * kPitch], k);
        lane_max = key > lane_max ? key : lane_max;
      }
      const uint64_t theta =
          __shfl_sync(kFullMask, warp_sort_desc32(lane_max, lane), r.budget - 1);
      const uint64_t floor_key = theta > 0 ? theta : 1;   // 0 keys are never filled
      int count = 0;
      for (int k0 = r.begin_count; k0 < r.tail_start; k0 += kWarp) {
        const int k = k0 + lane;
        const uint64_t key = k < r.tail_start ? candidate_key(column[k * kPitch], k) : 0;
        const bool keep = key >= floor_key;
        const unsigned ballot = __ballot_sync(kFullMask, keep);
        const int pos = count + __popc(ballot & ((1u << lane) - 1u));
        if (keep && pos < kSurvivors) survivors[warp][pos] = key;
        count += __popc(ballot);
      }
      __syncwarp();
      if (count <= kSurvivors) {
        uint64_t lo = lane < count ? survivors[warp][lane] : 0;
        uint64_t hi = lane + kWarp < count ? survivors[warp][lane + kWarp] : 0;
        warp_sort_desc64(lo, hi, lane);
        winner = lo;
        selected = count < r.budget ? count : r.budget;
      } else {
        uint64_t last = ~0ull;
        for (; selected < r.budget; ++selected) {
          uint64_t best = 0;
          for (int k = r.begin_count + lane; k < r.tail_start; k += kWarp) {
            const uint64_t key = candidate_key(column[k * kPitch], k);
            best = key < last && key > best ? key : best;
          }
          best = warp_max_key(best);
          if (best == 0) break;                     // uniform: nothing left above -inf
          if (lane == selected) winner = best;
          last = best;
        }
      }
      __syncwarp();                                 // the next row reuses the buffer
    }
    int32_t* out_row =
        a.out + static_cast<int64_t>(t) * a.out_token_stride + g * a.out_head_stride;
    const int id = key_id(winner);
    int rank = 0;
    for (int j = 0; j < selected; ++j) rank += __shfl_sync(kFullMask, id, j) < id ? 1 : 0;
    if (lane < selected) out_row[r.begin_count + rank] = id;
    if (lane == 0) write_forced_and_tail(out_row, r, selected, a.topk);
  }
}

template <int kMode, int kQueries>
cudaError_t launch_staged_with(const TopkSelectArgs& a, int heads_per_group,
                               cudaStream_t stream) {
  const int64_t blocks =
      static_cast<int64_t>((a.total_q + kQueries - 1) / kQueries) * a.num_out_heads;
  const int smem_bytes = a.num_tiles * (kQueries + 1) * static_cast<int>(sizeof(float));
  MSA_RETURN_IF_ERROR(cudaFuncSetAttribute(topk_staged_kernel<kMode, kQueries>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           smem_bytes));
  topk_staged_kernel<kMode, kQueries><<<static_cast<unsigned>(blocks), kWarp * kStagedWarps,
                                        smem_bytes, stream>>>(a, heads_per_group);
  return cudaGetLastError();
}

// Queries a CTA of the staged kernel takes: the most (up to 32, the widest staging loads) whose
// grid still covers every SM, else 8 (one row a warp).
inline int staged_queries_per_cta(int64_t total_q, int64_t out_heads, int sms) {
  for (int queries = 32; queries > 8; queries /= 2) {
    if ((total_q + queries - 1) / queries * out_heads >= sms) return queries;
  }
  return 8;
}

template <int kMode>
cudaError_t launch_staged(const TopkSelectArgs& a, int heads_per_group, int queries,
                          cudaStream_t stream) {
  switch (queries) {
    case 32: return launch_staged_with<kMode, 32>(a, heads_per_group, stream);
    case 16: return launch_staged_with<kMode, 16>(a, heads_per_group, stream);
    default: return launch_staged_with<kMode, 8>(a, heads_per_group, stream);
  }
}

template <int KCAP, int kMode>
cudaError_t launch_with(const TopkSelectArgs& a, int heads_per_group, cudaStream_t stream) {
  const int64_t tiles_per_head = (a.total_q + kWarp - 1) / kWarp;
  // Few queries: the tile kernel would leave most lanes idle and run long serial chains.
  if (a.total_q < 64) {
    const int64_t blocks = static_cast<int64_t>(a.total_q) * a.num_out_heads;
    topk_row_kernel<KCAP, kMode><<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(
        a, heads_per_group);
    return cudaGetLastError();
  }
  int device = 0, sms = 132;
  MSA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MSA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if constexpr (KCAP <= kStagedMaxWidth) {
    const int queries = staged_queries_per_cta(a.total_q, a.num_out_heads, sms);
    if (a.staged && a.total_q >= kStagedMinQueries && a.num_tiles >= kStagedMinTiles &&
        a.num_tiles <= kStagedFloats / (queries + 1)) {
      return launch_staged<kMode>(a, heads_per_group, queries, stream);
    }
  }
  // Split K over more warps only while the grid is too small to fill the GPU (~32 warps/SM),
  // and keep at least 128 blocks of K per warp.
  const int64_t blocks = tiles_per_head * a.num_out_heads;
  int64_t warps = (static_cast<int64_t>(sms) * 32 + blocks - 1) / blocks;
  const int64_t by_k = (a.num_tiles + 127) / 128;
  warps = warps < by_k ? warps : by_k;
  warps = warps < 1 ? 1 : (warps > kMaxTileWarps ? kMaxTileWarps : warps);
  const int k_chunk = static_cast<int>((a.num_tiles + warps - 1) / warps);
  topk_tile_kernel<KCAP, kMode><<<static_cast<unsigned>(blocks),
                                  static_cast<unsigned>(warps * kWarp), 0, stream>>>(
      a, heads_per_group, static_cast<int>(warps), k_chunk);
  return cudaGetLastError();
}

template <int KCAP>
cudaError_t launch_mode(const TopkSelectArgs& a, int heads_per_group, cudaStream_t stream) {
  switch (a.head_reduce) {
    case HeadReduce::kSum:
      return launch_with<KCAP, static_cast<int>(HeadReduce::kSum)>(a, heads_per_group, stream);
    case HeadReduce::kMax:
      return launch_with<KCAP, static_cast<int>(HeadReduce::kMax)>(a, heads_per_group, stream);
    default:
      return launch_with<KCAP, static_cast<int>(HeadReduce::kNone)>(a, 1, stream);
  }
}

}  // namespace

cudaError_t sparse_topk_select_image(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, topk_row_kernel<16, static_cast<int>(HeadReduce::kNone)>);
}

cudaError_t launch_sparse_topk_select(const TopkSelectArgs& a, cudaStream_t stream) {
  if (a.topk < 1 || a.topk > 64 || a.num_heads < 1 || a.num_out_heads < 1 || a.num_tiles < 0 ||
      a.total_q < 0 || a.force_begin_blocks < 0 || a.force_end_blocks < 0) {
    return cudaErrorInvalidValue;
  }
  int heads_per_group = 1;
  if (a.head_reduce != HeadReduce::kNone) {
    if (a.num_heads % a.num_out_heads != 0) return cudaErrorInvalidValue;
    heads_per_group = a.num_heads / a.num_out_heads;
  } else if (a.num_out_heads != a.num_heads) {
    return cudaErrorInvalidValue;
  }
  if (a.total_q == 0) return cudaSuccess;
  const int width = a.topk < a.num_tiles ? a.topk : a.num_tiles;
  if (width <= 8) return launch_mode<8>(a, heads_per_group, stream);
  if (width <= 16) return launch_mode<16>(a, heads_per_group, stream);
  if (width <= 32) return launch_mode<32>(a, heads_per_group, stream);
  return launch_mode<64>(a, heads_per_group, stream);
}

}  // namespace msa
