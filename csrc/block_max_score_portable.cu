// Portable indexer block max-scores (bf16 or e4m3): the Hopper indexer's computation
// (cute_kernels/block_max_score_sm90.py) with sm_80 instructions only (docs/design-portable.md).
//
// For query t of request b (local position i), index head h and 128-key tile beta:
//   out[h, beta, t] = max over visible keys j of the tile of scale * <q[t, h], k[j]>
// (-inf where no key of the tile is visible); key j is visible iff j < k_len_b, it exists in
// the K tensor (dense) or its page lies in the pool (paged), and, when causal, j <= i + offset_b.
// One shared index-key head (Hk = 1, as in MSA).
//
// A CTA owns 128 rows = 128 / H consecutive queries of one request x all H heads (row r is query
// r / H, head r % H: q's memory order); 8 warps of 16 rows. It streams the request's K tiles up
// to the last one any of its rows can see through a two-stage cp.async ring, computes each
// warp's S = Q K^T (mma.sync), masks where a tile meets the key end or the causal diagonal,
// takes the row maxima (quad shuffles), stages them in shared memory and writes them along
// total_q (the output's fastest dimension). Tiles past that limit get -inf. Grid (x, B + 1, S):
// x strides over a request's query tiles (so the host hint sizing it drops no work); y = B is
// the rows [cu_seqlens_q[B], total_q) no request owns, which only get -inf; z splits the keys:
// CTA z computes the query tile's K tiles [z c, (z + 1) c), c = ceil(n_tiles / S), at their own
// tile index (disjoint outputs, no reduction), and z = 0 also writes the -inf tiles, so a short
// chunk against a long prefix spreads over S times the SMs. Every element of out is written
// exactly once; Q rows past a request, K rows past the tensor and pages outside the pool are
// never read.
//
// e4m3 q and k are widened exactly to f16 and the MMAs run in f16: Q through registers once per
// query tile, each K tile raw through the cp.async ring (16 KB a stage) and then by all threads
// into one f16 tile the warps read; the shared memory is the bf16 form's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "common.cuh"
#include "portable_tiles.cuh"
#include "sm80_primitives.cuh"
#include "torch_binding.h"

namespace msa {
namespace {

using namespace portable;
using namespace sm80;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;         // (query, head) rows per CTA
constexpr int kStages = 2;                 // K tiles in flight
constexpr int kQ = 0;
constexpr int kK = kQ + kRows * kRowBytes;    // bf16: the K stages; e4m3: the f16 K tile
constexpr int kKRaw = kK + kTileBytes;        // e4m3: the raw K stages
constexpr int kMax = kK + kStages * kTileBytes;
constexpr int kSmemBytes = kMax + kRows * 4;   // 96.5 KB: fits every arch of the tier
static_assert(kKRaw + kStages * kRawTileBytes <= kMax, "e4m3 K stages overlap the row maxima");

// The K tile `tile` of request b: first token (dense) or page (paged), and how many of its keys
// may be read (0 for a page outside the table or the pool; never past the K tensor).
struct KeyTile {
  int64_t row0;
  int n_keys;
};

__device__ __forceinline__ KeyTile key_tile(const BlockMaxScoreArgs& a, int b, int k_len,
                                            int tile) {
  const int64_t key0 = static_cast<int64_t>(tile) * kTileKeys;
  int64_t n = min(static_cast<int64_t>(k_len) - key0, static_cast<int64_t>(kTileKeys));
  KeyTile t{0, 0};
  if (a.paged) {
    const int64_t page = tile < a.page_table_cols ? a.page_table[b * a.page_table_stride + tile]
                                                  : -1;
    if (page >= 0 && page < a.k_units) t.row0 = page;
    else n = 0;
  } else {
    t.row0 = a.cu_seqlens_k[b] + key0;
    n = min(n, a.k_units - t.row0);
  }
  t.n_keys = static_cast<int>(max(n, static_cast<int64_t>(0)));
  return t;
}

// K tile t into dst (a 16-bit tile, or raw e4m3 rows when kFp8), keys past n_keys zero.
template <bool kFp8>
__device__ __forceinline__ void load_key_tile(const BlockMaxScoreArgs& a, const KeyTile& t,
                                              char* dst, int tid) {
  constexpr int kRowChunks = kFp8 ? kRawChunks : kChunks;
  const int chunk = tid % kRowChunks;
  for (int key = tid / kRowChunks; key < kTileKeys; key += kThreads / kRowChunks) {
    const bool valid = key < t.n_keys;
    const int64_t elem = a.paged ? t.row0 * a.k_stride_unit + (valid ? key : 0) * a.k_stride_key
                                 : (t.row0 + (valid ? key : 0)) * a.k_stride_unit;
    const char* src = static_cast<const char*>(a.k) + elem * (kFp8 ? 1 : 2) + chunk * 16;
    cp_async_16_or_zero(dst + (kFp8 ? swizzled_raw(key, chunk) : swizzled(key, chunk)),
                        valid ? src : a.k, valid);
  }
}

// -inf into out[h, tiles [t_begin, t_end), q0 .. q0 + n_q - 1], consecutive threads along the
// queries (the output's fastest dimension).
__device__ __forceinline__ void fill_minus_inf(const BlockMaxScoreArgs& a, int64_t q0, int n_q,
                                               int t_begin, int t_end, int tid) {
  const int64_t per_tile = static_cast<int64_t>(n_q) * a.num_heads;
  const int64_t total = per_tile * max(t_end - t_begin, 0);
  for (int64_t e = tid; e < total; e += kThreads) {
    const int tile = t_begin + static_cast<int>(e / per_tile);
    const int64_t rest = e % per_tile;
    const int h = static_cast<int>(rest / n_q);
    const int64_t qi = rest % n_q;
    a.out[(static_cast<int64_t>(h) * a.max_k_tiles + tile) * a.total_q + q0 + qi] = -INFINITY;
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) block_max_score_portable_kernel(
    const BlockMaxScoreArgs a) {
  using T = std::conditional_t<kFp8, __half, __nv_bfloat16>;   // the MMA's operand type
  extern __shared__ __align__(128) char smem[];
  char* sQ = smem + kQ;
  float* sMax = reinterpret_cast<float*>(smem + kMax);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int b = blockIdx.y;
  const int split = blockIdx.z;            // this CTA's K-tile split of each query tile
  const int heads = a.num_heads;
  const int queries_per_cta = kRows / heads;

  if (b >= a.batch) {        // rows no request owns: -inf everywhere (split 0 writes them)
    if (split != 0) return;
    const int64_t first = a.cu_seqlens_q[a.batch];
    for (int64_t q0 = first + static_cast<int64_t>(blockIdx.x) * queries_per_cta;
         q0 < a.total_q; q0 += static_cast<int64_t>(gridDim.x) * queries_per_cta) {
      const int n_q = static_cast<int>(min(static_cast<int64_t>(queries_per_cta),
                                           a.total_q - q0));
      fill_minus_inf(a, q0, n_q, 0, a.max_k_tiles, tid);
    }
    return;
  }
  const int q_start = a.cu_seqlens_q[b];
  const int q_len = a.cu_seqlens_q[b + 1] - q_start;
  const int k_len = a.k_lens[b];
  const int64_t offset = a.offsets[b];
  const int n_q_tiles = q_len > 0 ? (q_len + queries_per_cta - 1) / queries_per_cta : 0;

  for (int q_tile = blockIdx.x; q_tile < n_q_tiles; q_tile += gridDim.x) {
    const int q_lo = q_tile * queries_per_cta;
    const int n_q = min(queries_per_cta, q_len - q_lo);
    // Tiles [0, n_tiles) hold a key some row of this CTA may see.
    int64_t last_key = static_cast<int64_t>(k_len) - 1;
    if (a.causal) last_key = min(last_key, q_lo + n_q - 1 + offset);
    int n_tiles = last_key >= 0 ? static_cast<int>(min(last_key / kTileKeys + 1,
                                                       static_cast<int64_t>(a.max_k_tiles)))
                                : 0;
    if (a.paged) n_tiles = min(n_tiles, a.page_table_cols);
    // This CTA's tiles [t_begin, t_end) of them.
    const int n_splits = static_cast<int>(gridDim.z);
    const int per_split = (n_tiles + n_splits - 1) / n_splits;
    const int t_begin = min(split * per_split, n_tiles);
    const int t_end = min(t_begin + per_split, n_tiles);
    if (t_end <= t_begin) {    // an empty split (early causal query tiles): no Q, no K
      if (split == 0) {
        fill_minus_inf(a, static_cast<int64_t>(q_start) + q_lo, n_q, n_tiles, a.max_k_tiles,
                       tid);
      }
      continue;
    }

    __syncthreads();           // the previous query tile's readers of sQ / sK / sMax are done
    // Address of chunk `chunk` of Q row r (query r / H, head r % H), or null past the queries.
    auto q_chunk = [&](int r, int chunk) -> const char* {
      const int qi = r / heads;
      if (qi >= n_q) return nullptr;
      const int64_t elem = (static_cast<int64_t>(q_start) + q_lo + qi) * a.q_stride_token +
                           (r % heads) * a.q_stride_head;
      return static_cast<const char*>(a.q) + elem * (kFp8 ? 1 : 2) + chunk * 16;
    };
    if constexpr (!kFp8) {     // Q rows (zero past the request's queries)
      const int chunk = tid % kChunks;
      for (int r = tid / kChunks; r < kRows; r += kThreads / kChunks) {
        const char* src = q_chunk(r, chunk);
        cp_async_16_or_zero(sQ + swizzled(r, chunk), src != nullptr ? src : a.q, src != nullptr);
      }
    }
    KeyTile next = key_tile(a, b, k_len, t_begin);
    load_key_tile<kFp8>(a, next, smem + (kFp8 ? kKRaw : kK), tid);
    cp_async_commit();
    if constexpr (kFp8) {      // e4m3 Q rows widened through registers while K tile 0 lands
      constexpr int kPerThread = kRows * kRawChunks / kThreads;
      uint4 in[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int u = tid + i * kThreads;
        const char* src = q_chunk(u / kRawChunks, u % kRawChunks);
        in[i] = src != nullptr ? __ldg(reinterpret_cast<const uint4*>(src))
                               : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int u = tid + i * kThreads;
        store_widened<T>(sQ, u / kRawChunks, u % kRawChunks, in[i]);
      }
    }

    // This thread's accumulator rows: r_i = 16 warp + lane / 4 + 8 i, query r_i / H.
    int last_visible[2];       // keys of the request up to this one are causally visible
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int qi = (warp * 16 + lane / 4 + 8 * i) / heads;
      last_visible[i] = static_cast<int>(max(min(a.causal ? q_lo + qi + offset
                                                          : static_cast<int64_t>(k_len) - 1,
                                                 static_cast<int64_t>(k_len) - 1),
                                             static_cast<int64_t>(-1)));
    }
    for (int tile = t_begin; tile < t_end; ++tile) {
      const KeyTile cur = next;
      const int stage = (tile - t_begin) % kStages;
      cp_async_wait<0>();
      __syncthreads();         // tile `tile` landed; every warp is done with the other stage
      if (tile + 1 < t_end) {
        next = key_tile(a, b, k_len, tile + 1);
        const int ahead = (stage + 1) % kStages;
        load_key_tile<kFp8>(a, next,
                            kFp8 ? smem + kKRaw + ahead * kRawTileBytes
                                 : smem + kK + ahead * kTileBytes,
                            tid);
      }
      cp_async_commit();
      if constexpr (kFp8) {    // the raw tile -> the one f16 tile every warp reads
        widen_rows<T, kTileKeys>(smem + kKRaw + stage * kRawTileBytes, smem + kK, 0, tid,
                                 kThreads);
        __syncthreads();
      }

      float s[16][4];
      warp_qk<T>(s, sQ, smem + kK + (kFp8 ? 0 : stage * kTileBytes), warp * 16, lane);
      const int key0 = tile * kTileKeys;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        // Columns [0, end) of the tile are visible to row i: loaded, and causally visible.
        const int end = max(0, min(cur.n_keys, last_visible[i] - key0 + 1));
        float m = -INFINITY;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = s[n][2 * i + e] * a.scale;
            m = 8 * n + 2 * (lane % 4) + e < end ? fmaxf(m, x) : m;
          }
        }
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
        if (lane % 4 == 0) sMax[warp * 16 + lane / 4 + 8 * i] = m;
      }
      __syncthreads();
      // Row r = (query r / H, head r % H) -> out[h, tile, q_start + q_lo + r / H]: thread e
      // takes head e / n_q, query e % n_q, so consecutive threads write consecutive queries.
      if (tid < n_q * heads) {
        const int h = tid / n_q, qi = tid % n_q;
        a.out[(static_cast<int64_t>(h) * a.max_k_tiles + tile) * a.total_q + q_start + q_lo +
              qi] = sMax[qi * heads + h];
      }
    }
    cp_async_wait<0>();
    if (split == 0) {
      fill_minus_inf(a, static_cast<int64_t>(q_start) + q_lo, n_q, n_tiles, a.max_k_tiles, tid);
    }
  }
}

}  // namespace

cudaError_t block_max_score_portable_image(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, block_max_score_portable_kernel<false>);
}

cudaError_t launch_block_max_score_portable(const BlockMaxScoreArgs& a, cudaStream_t stream) {
  if (a.total_q == 0 || a.max_k_tiles == 0) return cudaSuccess;
  if (a.num_heads != 1 && a.num_heads != 2 && a.num_heads != 4 && a.num_heads != 8) {
    return cudaErrorInvalidValue;
  }
  auto kernel = a.fp8 ? block_max_score_portable_kernel<true>
                      : block_max_score_portable_kernel<false>;
  MSA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  if (a.key_splits < 1 || a.key_splits > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(a.grid_x), static_cast<unsigned>(a.batch + 1),
                  static_cast<unsigned>(a.key_splits));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace msa
