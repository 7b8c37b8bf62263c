// Portable block-sparse prefill attention (bf16 or e4m3 q/k/v): the KV-outer kernel of the
// Hopper tier (docs/design-sparse-prefill.md) written with sm_80 instructions only (cp.async,
// ldmatrix, mma.sync m16n8k16), so one source serves sm_80 through sm_120 and its compute_80 PTX
// runs on any later GPU through the driver's JIT (docs/design-portable.md).
//
// Attention: one CTA per work item of the k2q schedule (head h, CSR row, q_begin, q_count,
// request b, KV block beta). The CTA loads the 128 x 128 K and V block once, then walks the
// item's queries in tiles of kRows rows = (kRows / G queries) x (G query heads of h): each warp
// owns 16 rows. Per tile: S = Q K^T (fp32), mask (kv_len tail, bottom-right causal), a
// single-block softmax (one block is one tile: no online rescale; a row that sees no key gets
// LSE = -inf and O = 0), O = P V with P in registers, normalize, and write the row's partial
// (partial dtype) and LSE (and LSE_T) to the query's slot. Q tiles are double-buffered: the
// gather of tile t + 1 is in flight while tile t computes; the qsplit entries run a tile ahead.
//
// e4m3 inputs (contract §1.2, no scale factors) are widened on load, exactly: e4m3 K / V with
// bf16 q to bf16; e4m3 q / K / V to f16 (one conversion per pair where the arch has it), and
// then both MMAs run in f16. With pv_dtype e4m3 the unnormalized P = exp(s - row max) is
// rounded to e4m3 (as an FP8 P.V MMA sees it; exact in f16) while the normalizer sums the
// unrounded P, as the reference defines it; with pv_dtype bf16, P enters the MMA as f16 (at
// least bf16's precision on [0, 1]). e4m3 K / V are read through registers once per CTA; an
// e4m3 Q tile lands raw (cp.async, double-buffered) and each warp widens its own 16 rows.
// e4m3 partials are rounded from fp32 (to nearest, saturating), staged as their exact f16
// values and narrowed as the rows leave.
//
// Combine: per (query, q head), L = logsumexp_s LSE_s, O = sum_s exp(LSE_s - L) O_s -> bf16;
// a row with more CSR entries than slots lost work and comes back NaN.
//
// Bounds: every index read from the schedule, the CSR, the page table and the prefix sums is
// range-checked before it addresses memory (a work item naming a head, request, row or entry
// out of range is skipped; a page outside the pool reads as no keys; a slot past the partials
// is not written), so no index value can make either kernel read or write out of bounds.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <type_traits>

#include "common.cuh"
#include "portable_tiles.cuh"
#include "sm80_primitives.cuh"
#include "torch_binding.h"

namespace msa {
namespace {

using namespace sm80;

using namespace portable;

constexpr int kBlockKeys = kTileKeys;     // keys of one KV block
constexpr int kSlotShift = 24;            // qsplit entry = q_local | slot << 24
constexpr int kLocalMask = (1 << kSlotShift) - 1;
constexpr int kMetaColumns = 6;
constexpr float kLn2 = 0.69314718055994530942f;
constexpr float kLog2e = 1.44269504088896340736f;

template <PartialType kPartial>
struct Partial;
template <>
struct Partial<PartialType::kFloat32> {
  using T = float;
};
template <>
struct Partial<PartialType::kBFloat16> {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_bf16(lo, hi); }
  static __device__ __forceinline__ float2 unpack(uint32_t w) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  }
};
template <>
struct Partial<PartialType::kFloat16> {
  using T = __half;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_f16(lo, hi); }
  static __device__ __forceinline__ float2 unpack(uint32_t w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
};
// e4m3 rows are staged as their exact f16 values (pack) and narrowed as they leave (narrow:
// four f16 in two words -> four e4m3 in one, exact).
template <>
struct Partial<PartialType::kE4m3> {
  using T = __nv_fp8_storage_t;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    return e4m3_rounded_f16x2(lo, hi);
  }
  static __device__ __forceinline__ uint32_t narrow(uint32_t lo, uint32_t hi) {
    auto e4m3x2 = [](uint32_t w) -> uint32_t {
      __half2_raw h;
      h.x = static_cast<unsigned short>(w & 0xFFFFu);
      h.y = static_cast<unsigned short>(w >> 16);
      return __nv_cvt_halfraw2_to_fp8x2(h, __NV_SATFINITE, __NV_E4M3);
    };
    return e4m3x2(lo) | (e4m3x2(hi) << 16);
  }
};

// The 16 bytes of a partial row at one load (4 fp32, 8 16-bit or 16 e4m3 channels) in fp32.
template <PartialType kPartial, int kVec = 16 / sizeof(typename Partial<kPartial>::T)>
__device__ __forceinline__ void unpack_chunk(const uint4& v, float (&f)[kVec]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (kPartial == PartialType::kFloat32) {
      f[j] = __uint_as_float(w[j]);
    } else if constexpr (kPartial == PartialType::kE4m3) {
      const float2 lo = e4m3x2_to_float2(static_cast<uint16_t>(w[j] & 0xFFFFu));
      const float2 hi = e4m3x2_to_float2(static_cast<uint16_t>(w[j] >> 16));
      f[4 * j] = lo.x, f[4 * j + 1] = lo.y, f[4 * j + 2] = hi.x, f[4 * j + 3] = hi.y;
    } else {
      const float2 x = Partial<kPartial>::unpack(w[j]);
      f[2 * j] = x.x, f[2 * j + 1] = x.y;
    }
  }
}

// The dtypes of a launch (SparsePrefillArgs q_fp8 / kv_fp8 / pv_fp8): bf16 q / K / V; bf16 q
// with e4m3 K / V; e4m3 q / K / V with P in f16 (pv_dtype bf16) or rounded to e4m3.
enum class Inputs : int { kBf16, kBf16KvE4m3, kE4m3PvF16, kE4m3 };

template <Inputs kIn>
struct InputTraits {
  static constexpr bool kQFp8 = kIn == Inputs::kE4m3PvF16 || kIn == Inputs::kE4m3;
  static constexpr bool kKvFp8 = kIn != Inputs::kBf16;
  static constexpr bool kRoundP = kIn == Inputs::kE4m3;
  using T = std::conditional_t<kQFp8, __half, __nv_bfloat16>;   // the MMAs' operand type
};

// Shared memory of the attention kernel with kWarps warps (kRows = 16 kWarps rows per tile):
// K and V as 16-bit tiles, then the Q tiles: two 16-bit stages gathered by cp.async (bf16 q),
// or two raw e4m3 stages gathered by cp.async plus the one 16-bit tile each warp widens its
// rows into (e4m3 q).
template <int kWarps, bool kQFp8>
struct AttentionSmem {
  static constexpr int kRows = 16 * kWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStages = 2;
  static constexpr int kQTiles = kQFp8 ? 1 : kStages;
  static constexpr int kRawStages = kQFp8 ? kStages : 0;
  static constexpr int kKvBytes = kTileBytes;
  static constexpr int kQBytes = kRows * kRowBytes;
  static constexpr int kRawQBytes = kRows * kRawRowBytes;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKvBytes;
  static constexpr int kQ = kV + kKvBytes;
  static constexpr int kRawQ = kQ + kQTiles * kQBytes;
  static constexpr int kEntry = kRawQ + kRawStages * kRawQBytes;
  static constexpr int kBytes = kEntry + kStages * kRows * 4;
  // 16-byte chunks of a gathered Q row, and the rows of a Q tile each thread gathers.
  static constexpr int kGatherChunks = kQFp8 ? kRawChunks : kChunks;
  static constexpr int kGatherRows = kRows * kGatherChunks / kThreads;
};

// The work item's view of its request and KV block.
struct WorkItem {
  int head;
  int q_count;
  int64_t entry0;        // first qsplit entry of the item
  int q_start, q_len;    // the request's queries
  int64_t kv_row0;       // first token (dense) or page (paged)
  int n_keys;            // keys of the block that exist (<= 0: none)
  int64_t causal_shift;  // key j is visible to q_local iff j <= q_local + causal_shift
};

// Reads schedule row `work`; false when any of its indices is out of range (the item is skipped).
__device__ __forceinline__ bool load_work_item(const SparsePrefillArgs& a, int work, WorkItem& w) {
  const int32_t* m = a.metadata + static_cast<int64_t>(work) * kMetaColumns;
  const int head = m[0], row = m[1], q_begin = m[2], q_count = m[3], b = m[4], beta = m[5];
  if (head < 0 || head >= a.hkv || row < 0 || row >= a.rows || b < 0 || b >= a.batch ||
      beta < 0 || q_begin < 0 || q_count <= 0) {
    return false;
  }
  w.head = head;
  w.entry0 = static_cast<int64_t>(a.row_ptr[head * a.row_ptr_stride + row]) + q_begin;
  if (w.entry0 < 0 || w.entry0 >= a.entries) return false;
  w.q_count = static_cast<int>(min(static_cast<int64_t>(q_count), a.entries - w.entry0));
  w.q_start = a.cu_seqlens_q[b];
  w.q_len = a.cu_seqlens_q[b + 1] - w.q_start;
  const int k_len = a.kv_lens[b];
  const int64_t key0 = static_cast<int64_t>(beta) * kBlockKeys;
  int64_t n_keys = min(static_cast<int64_t>(k_len) - key0, static_cast<int64_t>(kBlockKeys));
  if (a.paged) {
    const int64_t page = beta < a.page_table_cols ? a.page_table[b * a.page_table_stride + beta]
                                                  : -1;
    if (page < 0 || page >= a.kv_units) {
      n_keys = 0;
      w.kv_row0 = 0;
    } else {
      w.kv_row0 = page;
    }
  } else {
    w.kv_row0 = a.cu_seqlens_k[b] + key0;
    n_keys = min(n_keys, a.kv_units - w.kv_row0);
  }
  w.n_keys = static_cast<int>(max(n_keys, static_cast<int64_t>(0)));
  w.causal_shift = static_cast<int64_t>(k_len) - w.q_len - key0;
  return true;
}

// Address of key `key` (< 128) of the block in K or V (elements of kElemBytes bytes).
template <int kElemBytes>
__device__ __forceinline__ const char* kv_row(const SparsePrefillArgs& a, const void* base,
                                              const WorkItem& w, int key) {
  const int64_t elem = a.paged ? w.kv_row0 * a.kv_stride_unit + w.head * a.kv_stride_head +
                                     key * a.kv_stride_key
                               : (w.kv_row0 + key) * a.kv_stride_unit + w.head * a.kv_stride_head;
  return static_cast<const char*>(base) + elem * kElemBytes;
}

// The block's e4m3 keys of K or V widened into the 16-bit tile dst (keys past n_keys zero),
// through registers: every load of a pass is in flight before the first conversion.
template <typename T, int kThreads>
__device__ __forceinline__ void load_widened_block(const SparsePrefillArgs& a, const void* base,
                                                   const WorkItem& w, char* dst, int tid) {
  constexpr int kPerThread = kTileKeys * kRawChunks / kThreads;
  uint4 in[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {       // consecutive threads read one row's chunks
    const int u = tid + i * kThreads, key = u / kRawChunks, chunk = u % kRawChunks;
    in[i] = key < w.n_keys
                ? __ldg(reinterpret_cast<const uint4*>(kv_row<1>(a, base, w, key) + chunk * 16))
                : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int u = tid + i * kThreads;
    store_widened<T>(dst, u / kRawChunks, u % kRawChunks, in[i]);
  }
}

// Packed qsplit entry of the item's query `local`, or -1 past the item.
__device__ __forceinline__ int load_entry(const SparsePrefillArgs& a, const WorkItem& w,
                                          int local) {
  return local < w.q_count ? a.qsplit[w.head * a.qsplit_stride + w.entry0 + local] : -1;
}

// Whether a packed entry names a query of the request (its rows are gathered and written).
__device__ __forceinline__ bool entry_valid(int packed, int q_len) {
  return packed >= 0 && (packed & kLocalMask) < q_len;
}

template <int kWarps, PartialType kPartial, Inputs kIn>
__global__ void __launch_bounds__(32 * kWarps, 1)
    sparse_prefill_portable_kernel(const SparsePrefillArgs a) {
  using In = InputTraits<kIn>;
  using T = typename In::T;
  using Smem = AttentionSmem<kWarps, In::kQFp8>;
  constexpr int kRows = Smem::kRows;
  constexpr int kThreads = Smem::kThreads;
  const int work = blockIdx.x;
  if (work >= a.work_count[0]) return;
  WorkItem w;
  if (!load_work_item(a, work, w)) return;

  extern __shared__ __align__(128) char smem[];
  char* sK = smem + Smem::kK;
  char* sV = smem + Smem::kV;
  int* sEntry = reinterpret_cast<int*>(smem + Smem::kEntry);
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int group = a.group;
  const int queries_per_tile = kRows / group;
  const int n_tiles = (w.q_count + queries_per_tile - 1) / queries_per_tile;

  // bf16 K and V: 16 threads per row, keys past n_keys zero-filled (their source is never read).
  if constexpr (!In::kKvFp8) {
    const int chunk = tid % kChunks;
    for (int key = tid / kChunks; key < kBlockKeys; key += kThreads / kChunks) {
      const bool valid = key < w.n_keys;
      const int k_eff = valid ? key : 0;
      cp_async_16_or_zero(sK + swizzled(key, chunk), kv_row<2>(a, a.k, w, k_eff) + chunk * 16,
                          valid);
      cp_async_16_or_zero(sV + swizzled(key, chunk), kv_row<2>(a, a.v, w, k_eff) + chunk * 16,
                          valid);
    }
  }

  // Q gather of one tile into a stage (16-bit rows, or raw e4m3 rows): row r = query r / G of
  // the tile, head r % G of h; each thread gathers chunk tid % C of rows tid / C + i kThreads / C,
  // C = the row's 16-byte chunks.
  constexpr int kGatherChunks = Smem::kGatherChunks;
  constexpr int kQElemBytes = In::kQFp8 ? 1 : 2;
  const int gather_chunk = tid % kGatherChunks;
  const int gather_row0 = tid / kGatherChunks;
  int entries[Smem::kGatherRows];
  auto load_entries = [&](int tile) {
#pragma unroll
    for (int i = 0; i < Smem::kGatherRows; ++i) {
      const int r = gather_row0 + i * (kThreads / kGatherChunks);
      entries[i] = tile < n_tiles ? load_entry(a, w, tile * queries_per_tile + r / group) : -1;
    }
  };
  auto gather = [&](int stage) {
#pragma unroll
    for (int i = 0; i < Smem::kGatherRows; ++i) {
      const int r = gather_row0 + i * (kThreads / kGatherChunks);
      const int packed = entries[i];
      const bool valid = entry_valid(packed, w.q_len);
      const int64_t q_abs = w.q_start + (valid ? (packed & kLocalMask) : 0);
      const char* src = static_cast<const char*>(a.q) +
                        (q_abs * a.q_stride_token +
                         static_cast<int64_t>(w.head * group + r % group) * a.q_stride_head) *
                            kQElemBytes +
                        gather_chunk * 16;
      char* dst = In::kQFp8 ? smem + Smem::kRawQ + stage * Smem::kRawQBytes +
                                  swizzled_raw(r, gather_chunk)
                            : smem + Smem::kQ + stage * Smem::kQBytes + swizzled(r, gather_chunk);
      cp_async_16_or_zero(dst, valid ? src : a.q, valid);
      if (gather_chunk == 0) sEntry[stage * kRows + r] = packed;
    }
  };
  load_entries(0);
  gather(0);
  cp_async_commit();
  // e4m3 K and V: widened through registers while the first Q tile is in flight.
  if constexpr (In::kKvFp8) {
    load_widened_block<T, kThreads>(a, a.k, w, sK, tid);
    load_widened_block<T, kThreads>(a, a.v, w, sV, tid);
  }
  load_entries(1);

  // This thread's accumulator rows within the tile: g and g + 8 of the warp's 16.
  const int g = lane / 4, t = lane % 4;
  const int row_a = warp * 16 + g;
  const float scale_log2 = a.scale_log2;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    // Tile `tile` (and, the first time, K / V) has landed; every warp is done with the
    // previous tile, so the other stage may be overwritten.
    cp_async_wait<0>();
    __syncthreads();
    if (tile + 1 < n_tiles) {
      gather(stage ^ 1);
      load_entries(tile + 2);
    }
    cp_async_commit();
    char* sQ = smem + Smem::kQ + (In::kQFp8 ? 0 : stage) * Smem::kQBytes;
    if constexpr (In::kQFp8) {
      // This warp's 16 rows, raw -> 16-bit; only this warp reads them (S and the epilogue).
      widen_rows<T, 16>(smem + Smem::kRawQ + stage * Smem::kRawQBytes, sQ, warp * 16, lane, 32);
      __syncwarp();
    }

    // ---- S = Q K^T: 16 rows x 128 keys per warp -----------------------------------------------
    float s[16][4];
    warp_qk<T>(s, sQ, sK, warp * 16, lane);

    // ---- mask + single-block softmax of rows g (i = 0) and g + 8 (i = 1) ----------------------
    float inv_sum[2], lse[2], lse_t[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int packed = sEntry[stage * kRows + row_a + 8 * i];
      int64_t visible = w.n_keys;                      // keys [0, visible) are visible
      if (a.causal) {
        visible = min(visible, static_cast<int64_t>(packed & kLocalMask) + w.causal_shift + 1);
      }
      const int end = static_cast<int>(max(visible, static_cast<int64_t>(0)));
      float row_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * n + 2 * t + e;
          float& x = s[n][2 * i + e];
          x = col < end ? x : -INFINITY;
          row_max = fmaxf(row_max, x);
        }
      }
      row_max = fmaxf(row_max, __shfl_xor_sync(0xFFFFFFFFu, row_max, 1));
      row_max = fmaxf(row_max, __shfl_xor_sync(0xFFFFFFFFu, row_max, 2));
      // A row that sees nothing uses 0 as its max, so exp2 gives exact zeros, never NaN.
      const float max_scaled = row_max == -INFINITY ? 0.f : row_max * scale_log2;
      float sum = 0.f, sum_t = 0.f;
      if (a.want_lse_t) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            sum_t += exp2f((s[n][2 * i + e] * scale_log2 - max_scaled) * a.inv_temperature);
          }
        }
        sum_t += __shfl_xor_sync(0xFFFFFFFFu, sum_t, 1);
        sum_t += __shfl_xor_sync(0xFFFFFFFFu, sum_t, 2);
      }
#pragma unroll
      for (int n = 0; n < 16; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[n][2 * i + e];
          x = exp2f(x * scale_log2 - max_scaled);
          sum += x;
        }
      }
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
      // Only a zero sum means "no visible key"; a NaN sum (a NaN or +inf score) reaches O and
      // LSE as NaN (!= is an unordered compare).
      const bool seen = sum != 0.f;
      inv_sum[i] = seen ? 1.f / sum : 0.f;
      lse[i] = seen ? (max_scaled + log2f(sum)) * kLn2 : -INFINITY;
      lse_t[i] = sum_t != 0.f ? (max_scaled * a.inv_temperature + log2f(sum_t)) * kLn2
                              : -INFINITY;
    }

    // ---- O = P V: P (T) from the S accumulators, V^T fragments by ldmatrix.trans --------------
    auto pack_p = [](float lo, float hi) -> uint32_t {
      if constexpr (In::kRoundP) return e4m3_rounded_f16x2(lo, hi);
      else if constexpr (std::is_same_v<T, __half>) return pack_f16(lo, hi);
      else return pack_bf16(lo, hi);
    };
    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kBlockKeys / 16; ++kk) {      // keys 16 kk .. 16 kk + 15
      const uint32_t pa[4] = {pack_p(s[2 * kk][0], s[2 * kk][1]),
                              pack_p(s[2 * kk][2], s[2 * kk][3]),
                              pack_p(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_p(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n2 = 0; n2 < 8; ++n2) {                  // channels 16 n2 .. 16 n2 + 15
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sV + swizzled(16 * kk + lane % 8 + ((lane / 8) % 2) * 8,
                                            2 * n2 + lane / 16));
        mma_16bit<T>(o[2 * n2], pa, vb[0], vb[1]);
        mma_16bit<T>(o[2 * n2 + 1], pa, vb[2], vb[3]);
      }
    }

    // ---- epilogue: normalized partial rows and LSE into each query's slot ---------------------
    auto destination = [&](int packed, int r) -> int64_t {   // element offset of the row, or -1
      if (!entry_valid(packed, w.q_len) || (packed >> kSlotShift) >= a.slots) return -1;
      const int64_t q_abs = w.q_start + (packed & kLocalMask);
      const int64_t hq = static_cast<int64_t>(w.head) * group + r % group;
      return ((static_cast<int64_t>(packed >> kSlotShift) * a.total_q + q_abs) * a.hkv * group +
              hq);
    };
    if (t == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row_a + 8 * i;
        const int64_t row = destination(sEntry[stage * kRows + r], r);
        if (row >= 0) {
          a.lse_partial[row] = lse[i];
          if (a.want_lse_t) a.lse_t_partial[row] = lse_t[i];
        }
      }
    }
    if constexpr (kPartial == PartialType::kFloat32) {
      // A quad writes 32 contiguous bytes of a row per n-tile: whole sectors, no staging.
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row_a + 8 * i;
        const int64_t row = destination(sEntry[stage * kRows + r], r);
        if (row >= 0) {
          float* dst = static_cast<float*>(a.o_partial) + row * kHeadDim + 2 * t;
#pragma unroll
          for (int n = 0; n < 16; ++n) {
            *reinterpret_cast<float2*>(dst + 8 * n) =
                make_float2(o[n][2 * i] * inv_sum[i], o[n][2 * i + 1] * inv_sum[i]);
          }
        }
      }
    } else {
      // 16-bit rows (e4m3 rows as their f16 values) are staged in the warp's own Q rows (only
      // this warp read them), then each row leaves as 16 lanes x 16 bytes (e4m3: x 8 bytes).
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row_a + 8 * i;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          *reinterpret_cast<uint32_t*>(sQ + swizzled(r, n) + 4 * t) = Partial<kPartial>::pack(
              o[n][2 * i] * inv_sum[i], o[n][2 * i + 1] * inv_sum[i]);
        }
      }
      __syncwarp();
      using P = typename Partial<kPartial>::T;
#pragma unroll
      for (int step = 0; step < 8; ++step) {
        const int r = warp * 16 + 2 * step + lane / 16;
        const int chunk = lane % 16;
        const uint4 v = *reinterpret_cast<const uint4*>(sQ + swizzled(r, chunk));
        const int64_t row = destination(sEntry[stage * kRows + r], r);
        if (row < 0) continue;
        if constexpr (kPartial == PartialType::kE4m3) {
          *reinterpret_cast<uint2*>(static_cast<P*>(a.o_partial) + row * kHeadDim + chunk * 8) =
              make_uint2(Partial<kPartial>::narrow(v.x, v.y), Partial<kPartial>::narrow(v.z, v.w));
        } else {
          *reinterpret_cast<uint4*>(static_cast<P*>(a.o_partial) + row * kHeadDim + chunk * 8) = v;
        }
      }
    }
  }
  cp_async_wait<0>();
}

// ---- combine ---------------------------------------------------------------------------------

constexpr int kCombineWarps = 4;

// Group reductions over the `lanes` lanes of a row (a power of two, rows aligned to it).
__device__ __forceinline__ float group_max(float x, int lanes) {
  for (int m = lanes / 2; m >= 1; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, m));
  return x;
}
__device__ __forceinline__ float group_sum(float x, int lanes) {
  for (int m = lanes / 2; m >= 1; m /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, m);
  return x;
}
__device__ __forceinline__ bool group_any(bool x, int lanes) {
  unsigned v = x ? 1u : 0u;
  for (int m = lanes / 2; m >= 1; m /= 2) v |= __shfl_xor_sync(0xFFFFFFFFu, v, m);
  return v != 0;
}

struct MergedRow {
  float max_log2;   // log2-scaled max slot LSE (0 when every slot is -inf)
  float inv;        // 1 / sum_s exp2(LSE_s log2 e - max_log2), 0 for an empty row
  float lse;        // merged LSE: -inf when empty, NaN when a slot LSE is NaN
};

// The merged LSE of a row's n_slots slot LSEs (lse_row[s * stride]); lanes of the row share the
// slots (lane j: slots j, j + lanes, ...).
__device__ __forceinline__ MergedRow merge_lse(const float* lse_row, int64_t stride, int n_slots,
                                               int lane_in_row, int lanes) {
  float m = -INFINITY;
  bool nan = false;
  for (int s = lane_in_row; s < n_slots; s += lanes) {
    const float x = lse_row[s * stride];
    nan |= x != x;
    m = fmaxf(m, x);
  }
  m = group_max(m, lanes);
  nan = group_any(nan, lanes);
  const float max_log2 = m == -INFINITY ? 0.f : m * kLog2e;
  float sum = 0.f;
  for (int s = lane_in_row; s < n_slots; s += lanes) {
    sum += exp2f(lse_row[s * stride] * kLog2e - max_log2);
  }
  sum = group_sum(sum, lanes);
  MergedRow r;
  r.max_log2 = max_log2;
  r.inv = sum != 0.f ? 1.f / sum : 0.f;
  r.lse = nan ? NAN : (sum != 0.f ? (max_log2 + log2f(sum)) * kLn2 : -INFINITY);
  if (nan) r.inv = NAN;
  return r;
}

template <PartialType kPartial>
__global__ void __launch_bounds__(32 * kCombineWarps)
    sparse_combine_portable_kernel(const SparseCombineArgs a) {
  using T = typename Partial<kPartial>::T;
  constexpr int kVec = 16 / sizeof(T);              // channels per 16-byte load: 4, 8 or 16
  constexpr int kLanes = kHeadDim / kVec;           // lanes per row
  constexpr int kRowsPerWarp = 32 / kLanes;
  const int64_t rows = static_cast<int64_t>(a.total_q) * a.num_heads;
  const int lane_in_row = threadIdx.x % kLanes;
  int64_t row = (static_cast<int64_t>(blockIdx.x) * kCombineWarps * kRowsPerWarp) +
                threadIdx.x / kLanes;
  const bool in_range = row < rows;
  row = min(row, rows - 1);        // lanes past the end take part in the shuffles, store nothing
  const int64_t q_abs = row / a.num_heads;
  const int hq = static_cast<int>(row % a.num_heads);
  const int group = a.num_heads / a.hkv;
  const int n_entries = a.split_counts[q_abs * a.hkv + hq / group];
  const int n_slots = max(0, min(n_entries, a.slots));
  const int64_t slot_stride = rows;               // elements between slots of the LSE partials

  MergedRow m = merge_lse(a.lse_partial + row, slot_stride, n_slots, lane_in_row, kLanes);
  if (n_entries > a.slots) m.inv = m.lse = NAN;  // entries past the slots were dropped

  float acc[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
  const T* part = static_cast<const T*>(a.o_partial) + row * kHeadDim + lane_in_row * kVec;
  constexpr int kUnroll = 4;
  for (int s0 = 0; s0 < n_slots; s0 += kUnroll) {
    uint4 v[kUnroll];
    float wgt[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = min(s0 + u, n_slots - 1);
      v[u] = *reinterpret_cast<const uint4*>(part + s * slot_stride * kHeadDim);
      const float x = exp2f(a.lse_partial[s * slot_stride + row] * kLog2e - m.max_log2) * m.inv;
      wgt[u] = s0 + u < n_slots ? x : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float f[kVec];
      unpack_chunk<kPartial>(v[u], f);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = fmaf(f[j], wgt[u], acc[j]);
    }
  }
  if (n_entries > a.slots) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = NAN;
  }
  float lse_t = -INFINITY;
  if (a.want_lse_t) {
    lse_t = merge_lse(a.lse_t_partial + row, slot_stride, n_slots, lane_in_row, kLanes).lse;
    if (n_entries > a.slots) lse_t = NAN;
  }
  if (!in_range) return;
  // kVec bf16 channels of the row (16, 8 or 4): 16-byte stores, or one 8-byte store.
  uint32_t packed[kVec / 2];
#pragma unroll
  for (int e = 0; e < kVec / 2; ++e) packed[e] = pack_bf16(acc[2 * e], acc[2 * e + 1]);
  __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(a.out) + row * kHeadDim + lane_in_row * kVec;
  if constexpr (kVec >= 8) {
#pragma unroll
    for (int c = 0; c < kVec / 8; ++c) {
      *reinterpret_cast<uint4*>(dst + 8 * c) =
          make_uint4(packed[4 * c], packed[4 * c + 1], packed[4 * c + 2], packed[4 * c + 3]);
    }
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
  }
  if (lane_in_row == 0) {
    a.lse[row] = m.lse;
    if (a.want_lse_t) a.lse_t[row] = lse_t;
  }
}

template <int kWarps, PartialType kPartial, Inputs kIn>
cudaError_t launch_attention(const SparsePrefillArgs& a, cudaStream_t stream) {
  auto kernel = sparse_prefill_portable_kernel<kWarps, kPartial, kIn>;
  constexpr int bytes = AttentionSmem<kWarps, InputTraits<kIn>::kQFp8>::kBytes;
  MSA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<a.work_capacity, 32 * kWarps, bytes, stream>>>(a);
  return cudaGetLastError();
}

// fp32 partials only with bf16 inputs (the Hopper tier's set: its FP8 modes take 16-bit or
// e4m3 partials).
template <int kWarps, Inputs kIn>
cudaError_t launch_attention_for(const SparsePrefillArgs& a, cudaStream_t stream) {
  switch (a.partial) {
    case PartialType::kFloat32:
      if constexpr (kIn == Inputs::kBf16) {
        return launch_attention<kWarps, PartialType::kFloat32, kIn>(a, stream);
      }
      return cudaErrorInvalidValue;
    case PartialType::kBFloat16:
      return launch_attention<kWarps, PartialType::kBFloat16, kIn>(a, stream);
    case PartialType::kFloat16:
      return launch_attention<kWarps, PartialType::kFloat16, kIn>(a, stream);
    case PartialType::kE4m3: return launch_attention<kWarps, PartialType::kE4m3, kIn>(a, stream);
  }
  return cudaErrorInvalidValue;
}

// 128-row tiles (8 warps) where shared memory allows (sm_80, sm_90, sm_100); 64-row tiles
// (4 warps) on the ~99 KB parts (sm_86, sm_89, sm_120).
template <Inputs kIn>
cudaError_t launch_attention_sized(const SparsePrefillArgs& a, int optin, cudaStream_t stream) {
  constexpr bool kQFp8 = InputTraits<kIn>::kQFp8;
  if (optin >= AttentionSmem<8, kQFp8>::kBytes) return launch_attention_for<8, kIn>(a, stream);
  if (optin >= AttentionSmem<4, kQFp8>::kBytes) return launch_attention_for<4, kIn>(a, stream);
  return cudaErrorNotSupported;
}

}  // namespace

cudaError_t sparse_prefill_portable_image(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, sparse_combine_portable_kernel<PartialType::kFloat32>);
}

cudaError_t launch_sparse_prefill_portable(const SparsePrefillArgs& a, cudaStream_t stream) {
  if (a.work_capacity <= 0) return cudaSuccess;
  if (a.group != 1 && a.group != 2 && a.group != 4 && a.group != 8 && a.group != 16) {
    return cudaErrorInvalidValue;
  }
  int device = 0, optin = 0;
  MSA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MSA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (!a.q_fp8 && !a.kv_fp8 && !a.pv_fp8) {
    return launch_attention_sized<Inputs::kBf16>(a, optin, stream);
  }
  if (!a.q_fp8 && a.kv_fp8 && !a.pv_fp8) {
    return launch_attention_sized<Inputs::kBf16KvE4m3>(a, optin, stream);
  }
  if (a.q_fp8 && a.kv_fp8) {
    return a.pv_fp8 ? launch_attention_sized<Inputs::kE4m3>(a, optin, stream)
                    : launch_attention_sized<Inputs::kE4m3PvF16>(a, optin, stream);
  }
  return cudaErrorInvalidValue;      // e4m3 q with bf16 K / V, or P in e4m3 with bf16 q
}

cudaError_t launch_sparse_combine_portable(const SparseCombineArgs& a, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(a.total_q) * a.num_heads;
  if (rows == 0) return cudaSuccess;
  if (a.hkv <= 0 || a.num_heads % a.hkv != 0) return cudaErrorInvalidValue;
  const int threads = 32 * kCombineWarps;
  auto launch = [&](auto kernel, int rows_per_warp) {
    const int64_t per_cta = static_cast<int64_t>(kCombineWarps) * rows_per_warp;
    kernel<<<static_cast<unsigned>((rows + per_cta - 1) / per_cta), threads, 0, stream>>>(a);
    return cudaGetLastError();
  };
  switch (a.partial) {
    case PartialType::kFloat32:
      return launch(sparse_combine_portable_kernel<PartialType::kFloat32>, 1);
    case PartialType::kBFloat16:
      return launch(sparse_combine_portable_kernel<PartialType::kBFloat16>, 2);
    case PartialType::kFloat16:
      return launch(sparse_combine_portable_kernel<PartialType::kFloat16>, 2);
    case PartialType::kE4m3:
      return launch(sparse_combine_portable_kernel<PartialType::kE4m3>, 4);
  }
  return cudaErrorInvalidValue;
}

}  // namespace msa
