// Fused decode indexer + top-k for Hopper (sm_90a): block scores of a paged index-K cache and the
// per-row selection in one launch, no score matrix in memory.
//
// Semantics: msa.reference.decode_indexer. Row r of request b is (MTP query q = r / H, index head
// h = r % H); its own block is (L - Q + q) / 128 and its candidates are the history blocks before
// it (every key of such a block precedes the query, so no per-key mask). The selection is the
// topk - 1 best candidates (score desc, ties to the lower block id, -inf / NaN never), in rank
// order, then the own block, then -1.
//
// Work split (decode_indexer_plan_kernel, once per decode step, capturable): the batch's live
// history blocks are cut into chunks of `chunk_pages` (the same for every request) over a fixed
// grid; request b owns work items first_b .. first_b + n_b - 1. A request's last chunk runs to its
// live end, so a plan that was not updated after the lengths grew stays correct.
//
// Scoring CTA (256 threads, 8 warps): the chunk's pages stream through a four-stage ring (rows
// padded so the fragment reads hit distinct banks; NVFP4 rows of 64 bytes need no padding):
// every thread cp.asyncs its share of a page, or, for NVFP4 pages on sm_90+, the last warp
// issues the page and its scales as two bulk copies counted on the stage's full mbarrier.
// Warp w scores keys 16w .. 16w + 15 of each page for every row with mma.sync m16n8k16 (f16 for
// e4m3 q with e4m3 / NVFP4 keys, bf16 for bf16 q and keys), Q in shared memory. Channels are
// permuted inside each k-chunk (positions {2t, 2t+1, 2t+8, 2t+9} of chunk kd hold channels
// 32t + 4kd + {0..3}) so a thread reads one contiguous span of its key row. e4m3 widens to f16
// exactly; an NVFP4 code becomes f16 bits (sign << 15 | code << 9 = value * 2^-14, exact) times
// its E4M3 block scale (an exact f16 product), and the 2^14 returns in the fp32 score factor.
// Per page: the row maxima over the warps' keys meet in shared memory, and each row's page score
// is offered to its sorted candidate list, held in registers: by the row's thread (ThreadLists,
// rows > 16) or across a segment of KCAP lanes (LaneLists, rows <= 16). The offer-warp form
// (17-32 rows) adds a ninth warp that holds the lists and offers page i - 1 while the eight
// warps score page i.
//
// Merge: each CTA writes its rows' lists to the plan's workspace, then counts itself in on the
// request's arrival counter; the last CTA of the request merges the n_b lists per row (a warp per
// row: lanes pool chunk lists, each list's entries loaded together, then topk - 1 rounds of a
// warp-wide arg-max), writes the output rows and resets the counter for the next launch.
//
// Safety: page ids outside [0, num_pages) are skipped (never read), lengths are clamped to the
// page table, corrupt work items exit. No host synchronization; every size is a host argument.
#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "sm80_primitives.cuh"
#include "sm90_pipeline.cuh"
#include "tensor_map.cuh"
#include "top_list.cuh"
#include "torch_binding.h"

namespace msa {
namespace {

using sm80::cp_async_16;
using sm80::cp_async_commit;
using sm80::cp_async_wait;

constexpr int kDim = 128;
constexpr int kPage = 128;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 4;
constexpr int kQStride = kDim + 8;          // halves per Q row in shared memory (272 bytes)
#ifdef MSA_LAB_MIN_CHUNK_PAGES
constexpr int kMinChunkPages = MSA_LAB_MIN_CHUNK_PAGES;
#else
constexpr int kMinChunkPages = 4;           // fewer pages per CTA are not worth a merge entry
#endif
constexpr int kMaxTopk = 32;
constexpr int kPlanThreads = 256;          // one CTA; its barriers are the plan's cost
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kPlanCachedRequests = 2048;  // history lengths the plan keeps in shared memory

// kE4m3Tma is not a format callers name: e4m3 keys whose pages arrive as one TMA copy each
// into an unpadded, 128-byte swizzled stage (the launcher picks it for tma_pages on sm_90+).
enum KFormat : int { kBf16 = 0, kE4m3 = 1, kNvfp4 = 2, kE4m3Tma = 3 };

template <int F>
constexpr bool kIsE4m3 = F == kE4m3 || F == kE4m3Tma;

// Lab hooks (benchmarks/lab/decode_indexer_timeline.cu builds this file with them; they compile
// to nothing otherwise): MSA_LAB_TIMELINE records clock64 stamps of work item 0's first
// kLabPages pages per warp, each after a shared-memory fence (a deferred-blocking barrier lets a
// warp issue past BAR.SYNC until its first memory instruction: unfenced, the barrier's wait
// shows up in the next phase); MSA_LAB_NO_LOADS issues no copies (the stages keep whatever they
// hold: the loop without DRAM); MSA_LAB_NO_OFFERS skips the offers (the loop without the lists);
// MSA_LAB_NO_MERGE leaves out the request's merge (its last CTA exits after the count);
// MSA_LAB_MIN_CHUNK_PAGES=n sets the plan's smallest chunk (the kernel's, not the Python plan's);
// MSA_LAB_WIDEN_BY_ALU widens e4m3 keys by integer ops (sm80::e4m3x2_lo_to_scaled_f16x2: x 2^-8,
// folded back into the score factor) instead of F2FP (a NaN key byte then reads as +-480).
#if defined(MSA_LAB_WIDEN_BY_ALU) && MSA_LAB_WIDEN_BY_ALU > 0
constexpr bool kLabWidenByAlu = true;
#else
constexpr bool kLabWidenByAlu = false;
#endif
#ifdef MSA_LAB_TIMELINE
constexpr int kLabPages = 64, kLabMarks = 6;
constexpr int kLabWarps = kWarps + 1;   // the offer warp's stamps last
__device__ long long lab_timeline[kLabWarps][kLabPages][kLabMarks];
#define MSA_LAB_MARK(page, mark)                                                          \
  do {                                                                                    \
    if (blockIdx.x == 0 && (threadIdx.x & 31) == 0 && (page) < kLabPages) {              \
      __threadfence_block();                                                              \
      lab_timeline[threadIdx.x >> 5][page][mark] = clock64();                             \
    }                                                                                     \
  } while (0)
#else
#define MSA_LAB_MARK(page, mark) \
  do {                           \
  } while (0)
#endif
// MSA_LAB_CALL_PHASES: every CTA's thread 0 stamps the phases of its call (entry, queries
// loaded, pages done, counted in, and in the request's merging CTA: its lists loaded, its rows
// stored) with clock64, plus %globaltimer at entry and exit to line the CTAs up: where a short
// call's time goes beyond the page loop.
#ifdef MSA_LAB_CALL_PHASES
constexpr int kLabCallMarks = 6, kLabMaxCtas = 2048;
__device__ long long lab_call_clock[kLabMaxCtas][kLabCallMarks];
__device__ long long lab_call_ns[kLabMaxCtas][2];
__device__ __forceinline__ long long lab_globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define MSA_LAB_CALL_MARK(mark)                                               \
  do {                                                                        \
    if (threadIdx.x == 0 && blockIdx.x < kLabMaxCtas) {                      \
      lab_call_clock[blockIdx.x][mark] = clock64();                           \
      if ((mark) == 0) {   /* the merge's stamps stay 0 in CTAs that do not merge */ \
        lab_call_ns[blockIdx.x][0] = lab_globaltimer();                       \
        lab_call_clock[blockIdx.x][4] = lab_call_clock[blockIdx.x][5] = 0;    \
      }                                                                       \
    }                                                                         \
  } while (0)
#define MSA_LAB_CALL_EXIT()                                                   \
  do {                                                                        \
    if (threadIdx.x == 0 && blockIdx.x < kLabMaxCtas) {                      \
      lab_call_ns[blockIdx.x][1] = lab_globaltimer();                         \
    }                                                                         \
  } while (0)
#else
#define MSA_LAB_CALL_MARK(mark) \
  do {                          \
  } while (0)
#define MSA_LAB_CALL_EXIT() \
  do {                      \
  } while (0)
#endif

// Bytes of one key row in global memory, its padded stride in a stage, and a stage's size.
// Rows are padded so the fragment reads hit distinct banks, except NVFP4's (64 bytes need none)
// and kE4m3Tma's (the 128-byte swizzle spreads them instead).
template <int F>
struct PageShape {
  static constexpr int kRowBytes = F == kBf16 ? 256 : (kIsE4m3<F> ? 128 : 64);
  static constexpr int kRowStride = (F == kNvfp4 || F == kE4m3Tma) ? kRowBytes : kRowBytes + 16;
  static constexpr bool kSwizzled = F == kE4m3Tma;   // chunk c of row r at chunk c ^ (r % 8)
  static constexpr int kScaleBytes = F == kNvfp4 ? kPage * 8 : 0;
  static constexpr int kStageBytes = kPage * kRowStride + kScaleBytes;
  static constexpr int kWordsPerKey = kRowBytes / 16;   // 32-bit words a thread reads per key
};

// Swizzled stages start on 1024 bytes (the swizzle's period), so the base is aligned by hand
// (kBaseAlign spare bytes).
template <int F, int MT>
struct SmemLayout {
  static constexpr int kBaseAlign = PageShape<F>::kSwizzled ? 1024 : 0;
  static constexpr int kQBytes = MT * 16 * kQStride * 2;
  static constexpr int kStagesOffset =
      kBaseAlign ? (kQBytes + kBaseAlign - 1) / kBaseAlign * kBaseAlign : kQBytes;
  static constexpr int kMaxOffset = kStagesOffset + kStages * PageShape<F>::kStageBytes;
  static constexpr int kBytes = kMaxOffset + 2 * kWarps * MT * 16 * 4;   // [2][warp][row]
  static constexpr int kAlloc = kBytes + kBaseAlign;
};

// *counter += value at GPU scope with acquire-release semantics; the old value.
__device__ __forceinline__ int add_acq_rel_gpu(int* counter, int value) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(counter), "r"(value)
               : "memory");
  return old;
}

// fp32 -> uint32 with the same order (-0 == +0), for warp-wide max reductions.
__device__ __forceinline__ uint32_t order_code(float x) {
  const uint32_t bits = __float_as_uint(x + 0.0f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Lanes a row takes in the merge of its request's chunk lists: the narrowest segment that
// still spreads the rows over every warp (32 lanes while the rows fit one a warp; narrower
// would leave warps idle and take more reduction steps than redux), so each warp merges its
// rows in one pass. Lane slot pools chunks slot, slot + seg, ... before the segment merges: on
// an H100 a further pass of segments (its list loads and butterfly) cost more than a lane's
// few extra lists (MTP 8, 4 index heads, 9-16 chunks).
__device__ __forceinline__ int merge_segment_lanes(int rows, int warps) {
  const int rows_per_warp = (rows + warps - 1) / warps;
  int seg = 32;
  while (seg > 1 && 32 / (seg / 2) <= rows_per_warp) seg >>= 1;
  return seg;
}

// Maximum of v over each aligned segment of `seg` lanes (a power of two, uniform over the warp;
// every lane takes part).
__device__ __forceinline__ uint32_t segment_max(uint32_t v, int seg) {
  if (seg == 32) return __reduce_max_sync(0xFFFFFFFFu, v);
  for (int offset = seg >> 1; offset > 0; offset >>= 1) {
    v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

// The best KCAP entries of the lists a segment of `seg` lanes holds (a power of two, uniform
// over the warp; every lane takes part), in every lane of the segment, best first, as 64-bit
// keys order_code(score) << 32 | ~id (one order: higher score, then lower id; empty slots are
// the smallest). A butterfly over the segment: at each level a lane's list and its partner's,
// the partner's reversed, give elementwise the larger key, a bitonic sequence holding the best
// KCAP of both (the lists hold disjoint blocks), which log2(KCAP) half-cleaner steps sort.
// log2(seg) levels of independent shuffles and compare-exchanges, where extracting the best
// head KCAP - 1 times is a chain of dependent segment maxima.
template <int KCAP>
__device__ __forceinline__ void segment_best_keys(const TopList<KCAP>& list, int seg,
                                                  unsigned long long (&key)[KCAP]) {
#pragma unroll
  for (int i = 0; i < KCAP; ++i) {
    key[i] = static_cast<unsigned long long>(order_code(list.score[i])) << 32 |
             ~static_cast<uint32_t>(list.id[i]);
  }
  for (int offset = 1; offset < seg; offset <<= 1) {
#pragma unroll
    for (int i = 0; i < KCAP / 2; ++i) {
      const int j = KCAP - 1 - i;
      const unsigned long long theirs_j = __shfl_xor_sync(0xFFFFFFFFu, key[j], offset);
      const unsigned long long theirs_i = __shfl_xor_sync(0xFFFFFFFFu, key[i], offset);
      key[i] = key[i] > theirs_j ? key[i] : theirs_j;
      key[j] = key[j] > theirs_i ? key[j] : theirs_i;
    }
#pragma unroll
    for (int stride = KCAP / 2; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < KCAP; ++i) {
        if ((i & stride) == 0) {
          const unsigned long long x = key[i], y = key[i + stride];
          key[i] = x > y ? x : y;
          key[i + stride] = x > y ? y : x;
        }
      }
    }
  }
}

// History blocks of a request of length `len`: those before the block of its last key.
__device__ __forceinline__ int history_pages(int len) { return len > 0 ? (len - 1) / kPage : 0; }

// Eight E2M1 codes (one 32-bit word, code i in nibble i) -> four f16x2 words holding code * 2^-14
// exactly (f16 bits = sign << 15 | magnitude << 9), as the channel pairs (0, 4), (2, 6), (1, 5),
// (3, 7): the pairs whose upper bytes one byte_perm each takes from the even and odd codes' bytes
// (10 integer ops for the 8 codes; the pairs (0, 1) ... (6, 7) took ~15). load_queries stages
// NVFP4 calls' Q channels in the same order (kQChannelPairs), so each k-step still meets a key
// channel with its query channel.
__device__ __forceinline__ void e2m1x8_to_f16x2(uint32_t w, uint32_t (&out)[4]) {
  constexpr uint32_t kMagnitude = 0x0E0E0E0Eu;   // an f16 upper byte's magnitude bits (1-3)
  const uint32_t signs = w & 0x88888888u;
  // Per byte j, the f16 upper byte of code 2j (even) and of code 2j + 1 (odd): the magnitude
  // from the shifted word, the sign (bit 7, outside kMagnitude) from the shifted signs.
  const uint32_t even = ((w << 1) & kMagnitude) | ((signs << 4) & ~kMagnitude);
  const uint32_t odd = ((w >> 3) & kMagnitude) | (signs & ~kMagnitude);
  out[0] = __byte_perm(even, 0u, 0x2404);   // codes 0, 4 as the upper bytes of two f16
  out[1] = __byte_perm(even, 0u, 0x3414);   // codes 2, 6
  out[2] = __byte_perm(odd, 0u, 0x2404);    // codes 1, 5
  out[3] = __byte_perm(odd, 0u, 0x3414);    // codes 3, 7
}

// Q's order of the channels of each 8-channel chunk (as f16x2 pairs) for NVFP4 keys: the order
// e2m1x8_to_f16x2 yields them in.
template <int F>
constexpr bool kQChannelPairs = F == kNvfp4;

__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, __half2 b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), b);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Issues the cp.async copies of one physical index-K page (and its 1 KB of NVFP4 scales, which
// both scale layouts keep contiguous per page of a one-head cache) into a stage.
template <int F>
__device__ __forceinline__ void load_page(const DecodeIndexerArgs& a, int64_t physical,
                                          char* stage) {
  using S = PageShape<F>;
  constexpr int kChunksPerRow = S::kRowBytes / 16;
  const char* src = static_cast<const char*>(a.k) + physical * (kPage * S::kRowBytes);
#pragma unroll
  for (int i = 0; i < kPage * kChunksPerRow / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c / kChunksPerRow, col = c % kChunksPerRow;
    const int dst_col = S::kSwizzled ? col ^ (row & 7) : col;   // as a TMA copy would place it
    cp_async_16(stage + row * S::kRowStride + dst_col * 16, src + static_cast<int64_t>(c) * 16);
  }
  if constexpr (F == kNvfp4) {
    if (threadIdx.x < S::kScaleBytes / 16) {
      cp_async_16(stage + kPage * S::kRowStride + threadIdx.x * 16,
                  a.k_scale + physical * S::kScaleBytes + threadIdx.x * 16);
    }
  }
}

// Whether pages of format F arrive as bulk copies (sm_90+, rows not padded: NVFP4, kE4m3Tma)
// instead of every thread's cp.asyncs. A padded stage would take a bulk copy per key row: 128
// for an e4m3 page kept the issuing warp ~7400 cycles a page (the TMA unit takes one copy at a
// time), 3x the whole page's period with cp.async; kE4m3Tma's page is one tensor-map copy.
template <int F>
__host__ __device__ constexpr bool bulk_pages() {
#if __CUDA_ARCH__ >= 900
  return PageShape<F>::kRowStride == PageShape<F>::kRowBytes;
#else
  return false;
#endif
}

// One physical index-K page (and its NVFP4 scales) as two bulk copies from lanes 0 and 1, or
// (kE4m3Tma) one tensor-map copy of its 128 rows, counted on the stage's full barrier as
// complete_tx.
template <int F>
__device__ __forceinline__ void bulk_load_page(const DecodeIndexerArgs& a, int64_t physical,
                                               char* stage, const sm90::Mbarrier& full) {
  using S = PageShape<F>;
  static_assert(bulk_pages<F>(), "a page of unpadded rows, on sm_90+");
  const int lane = threadIdx.x & 31;
  if constexpr (F == kE4m3Tma) {
    if (lane == 0) {
      sm90::tma_load_2d(stage, a.k_tensor_map, 0, static_cast<int>(physical) * kPage, full);
    }
    return;
  }
  if (lane == 0) {
    sm90::bulk_copy_to_shared(
        stage, static_cast<const char*>(a.k) + physical * (kPage * S::kRowBytes),
        kPage * S::kRowBytes, full);
  }
  if (F == kNvfp4 && lane == 1) {
    sm90::bulk_copy_to_shared(stage + kPage * S::kRowStride,
                              a.k_scale + physical * S::kScaleBytes, S::kScaleBytes, full);
  }
}

// Request b's Q rows (r = q * H + h) as f16 (e4m3 q) or bf16 (bf16 q), zero past `rows`; with
// kPaired, each 8-channel chunk as the f16x2 pairs (0, 4), (2, 6), (1, 5), (3, 7).
template <int MT, bool kPaired>
__device__ __forceinline__ void load_queries(const DecodeIndexerArgs& a, int b, int rows,
                                             __half* qs) {
  const int64_t base = static_cast<int64_t>(b) * rows * kDim;
  for (int c = threadIdx.x; c < MT * 16 * (kDim / 8); c += kThreads) {
    const int row = c / (kDim / 8), col = (c % (kDim / 8)) * 8;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row < rows) {
      const int64_t offset = base + static_cast<int64_t>(row) * kDim + col;
      if (a.q_fp8) {
        uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.q) + offset);
        if constexpr (kPaired) {   // bytes (0, 4, 2, 6), (1, 5, 3, 7)
          raw = make_uint2(__byte_perm(raw.x, raw.y, 0x6240), __byte_perm(raw.x, raw.y, 0x7351));
        }
        v.x = sm80::e4m3x2_lo_to_f16x2(raw.x);
        v.y = sm80::e4m3x2_hi_to_f16x2(raw.x);
        v.z = sm80::e4m3x2_lo_to_f16x2(raw.y);
        v.w = sm80::e4m3x2_hi_to_f16x2(raw.y);
      } else {
        v = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.q) + offset);
      }
    }
    *reinterpret_cast<uint4*>(qs + row * kQStride + col) = v;
  }
}

// Where this thread's two E4M3 block scales (2t, 2t + 1, t = lane % 4) of key key0 + lane / 4
// sit in a staged page's 1 KB of NVFP4 scales, and how much further key + 8's are (key + 16's
// twice that where key0 % 32 == 0). The staged order repeats every page, so a warp computes it
// once instead of per page (~30 SASS instructions a page and key pair, both layouts selected at
// run time).
struct ScaleSlot {
  int offset = 0;
  int key8 = 0;

  __device__ __forceinline__ ScaleSlot(bool linear, int key0) {
    const int lane = threadIdx.x & 31;
    const int key = key0 + (lane >> 2), t = lane & 3;
    // Linear: 8 scale bytes a key. 128x4: 32-key rows of 16 bytes, key / 32 its 4-byte column,
    // scale column pair t / 2 its 512-byte half.
    offset = linear ? key * 8 + 2 * t
                    : (t >> 1) * 512 + (key & 31) * 16 + (key >> 5) * 4 + 2 * (t & 1);
    key8 = linear ? 64 : 128;
  }
};

// Keys key0 + 8 n + lane / 4 (n = 0, 1) of a staged page: this thread's span of each key row
// (channels 32t .. 32t + 31, t = lane % 4) and, for NVFP4, its two E4M3 block scales.
template <int F>
struct KeyPair {
  uint32_t words[2][PageShape<F>::kWordsPerKey];
  __half2 scale[2][2];

  // scale_offset: where key key0 + lane / 4's scales sit (ScaleSlot, NVFP4 only).
  __device__ __forceinline__ void load(const char* stage, int key0, int scale_offset,
                                       int scale_key8) {
    using S = PageShape<F>;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int key = key0 + n * 8 + g;
      const char* row = stage + key * S::kRowStride;
#pragma unroll
      for (int i = 0; i < S::kWordsPerKey / 4; ++i) {
        // 16-byte chunk 2t + i of the thread's span (kWordsPerKey / 4 chunks of it), in place
        // or at its swizzled chunk: two keys of a quarter warp differ in row % 8, so their
        // chunks land in distinct bank groups either way.
        const int chunk = t * (S::kWordsPerKey / 4) + i;
        const uint4 v = *reinterpret_cast<const uint4*>(
            row + 16 * (S::kSwizzled ? chunk ^ (key & 7) : chunk));
        words[n][4 * i] = v.x;
        words[n][4 * i + 1] = v.y;
        words[n][4 * i + 2] = v.z;
        words[n][4 * i + 3] = v.w;
      }
      if constexpr (F == kNvfp4) {
        // Scales 2t and 2t + 1 of the key (channels 32t .. 32t + 15 and 32t + 16 .. 32t + 31).
        const uint8_t* scales = reinterpret_cast<const uint8_t*>(stage + kPage * S::kRowStride);
        const uint32_t two =
            *reinterpret_cast<const uint16_t*>(scales + scale_offset + n * scale_key8);
        const uint32_t f16 = sm80::e4m3x2_lo_to_f16x2(two);
        const __half2 both = *reinterpret_cast<const __half2*>(&f16);
        scale[n][0] = __low2half2(both);
        scale[n][1] = __high2half2(both);
      }
    }
  }

  // The B fragments of channels 32t + 8 kd2 .. + 7: b[n][kk][b0 / b1] for the two k-steps.
  __device__ __forceinline__ void fragments(int kd2, uint32_t (&b)[2][2][2]) const {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      if constexpr (F == kBf16) {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          b[n][kk][0] = words[n][2 * (2 * kd2 + kk)];
          b[n][kk][1] = words[n][2 * (2 * kd2 + kk) + 1];
        }
      } else if constexpr (kIsE4m3<F>) {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const uint32_t w = words[n][2 * kd2 + kk];
          b[n][kk][0] = kLabWidenByAlu ? sm80::e4m3x2_lo_to_scaled_f16x2(w)
                                       : sm80::e4m3x2_lo_to_f16x2(w);
          b[n][kk][1] = kLabWidenByAlu ? sm80::e4m3x2_hi_to_scaled_f16x2(w)
                                       : sm80::e4m3x2_hi_to_f16x2(w);
        }
      } else {
        uint32_t codes[4];
        e2m1x8_to_f16x2(words[n][kd2], codes);
        const __half2 sc = scale[n][kd2 >> 1];
#pragma unroll
        for (int i = 0; i < 4; ++i) b[n][i >> 1][i & 1] = hmul2_u32(codes[i], sc);
      }
    }
  }
};

// Q's A fragments of m-tile m for channels 32t + 8 kd2 .. + 7 (rows lane / 4 and + 8).
struct QFragments {
  uint4 lo[4], hi[4];

  __device__ __forceinline__ void load(const __half* qs, int m) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kd2 = 0; kd2 < 4; ++kd2) {
      lo[kd2] = *reinterpret_cast<const uint4*>(qs + (16 * m + g) * kQStride + 32 * t + 8 * kd2);
      hi[kd2] = *reinterpret_cast<const uint4*>(qs + (16 * m + g + 8) * kQStride + 32 * t +
                                                8 * kd2);
    }
  }
};

template <int F>
__device__ __forceinline__ void mma_k16(float (&acc)[4], const uint4& lo, const uint4& hi,
                                        int kk, const uint32_t (&b)[2]) {
  const uint32_t af[4] = {kk ? lo.z : lo.x, kk ? hi.z : hi.x, kk ? lo.w : lo.y,
                          kk ? hi.w : hi.y};
  if constexpr (F == kBf16) {
    sm80::mma_bf16(acc, af, b[0], b[1]);
  } else {
    sm80::mma_f16(acc, af, b[0], b[1]);
  }
}

// Per row i2 (lane / 4, + 8) of an m-tile, the max of acc over this warp's keys, reduced over
// the quad.
__device__ __forceinline__ float quad_row_max(const float (&acc)[2][4], int i2) {
  float v = fmaxf(fmaxf(acc[0][2 * i2], acc[0][2 * i2 + 1]),
                  fmaxf(acc[1][2 * i2], acc[1][2 * i2 + 1]));
  v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}

// Warps writing maxima of one row per page: every warp scores 16 keys for every row (MT > 2,
// Q fragments read from shared memory per page), or, for MT <= 2, the kWarps / MT warps of the
// row's m-tile score 16 MT keys each with the m-tile's Q fragments held in registers.
template <int MT>
constexpr int kMaxWriters = MT <= 2 ? kWarps / MT : kWarps;

// One page against every row: per row the max over the keys, into
// warp_max[writer][row] (writer < kMaxWriters<MT>).
template <int F, int MT>
__device__ __forceinline__ void score_page(const char* stage, const __half* qs,
                                           const QFragments& q_regs, const ScaleSlot& scale_slot,
                                           float* warp_max) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  if constexpr (MT <= 2) {
    constexpr int kWarpsPerTile = kWarps / MT;
    const int m = warp / kWarpsPerTile, writer = warp % kWarpsPerTile;
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll 1
    for (int pair = 0; pair < MT; ++pair) {   // 16 keys at a time
      KeyPair<F> keys;
      // MT 2: key0 = 32 writer + 16 pair, so pair 1's scales are two key8 steps on.
      keys.load(stage, (writer * MT + pair) * 16, scale_slot.offset + pair * 2 * scale_slot.key8,
                scale_slot.key8);
      float acc[2][4] = {};
#pragma unroll
      for (int kd2 = 0; kd2 < 4; ++kd2) {
        uint32_t b[2][2][2];
        keys.fragments(kd2, b);
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            mma_k16<F>(acc[n], q_regs.lo[kd2], q_regs.hi[kd2], kk, b[n][kk]);
          }
        }
      }
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) row_max[i2] = fmaxf(row_max[i2], quad_row_max(acc, i2));
    }
    if (t == 0) {
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) warp_max[writer * MT * 16 + 16 * m + g + 8 * i2] = row_max[i2];
    }
  } else {
    KeyPair<F> keys;
    keys.load(stage, warp * 16, scale_slot.offset, scale_slot.key8);
    float acc[MT][2][4] = {};
#pragma unroll
    for (int kd2 = 0; kd2 < 4; ++kd2) {
      uint4 a_lo[MT], a_hi[MT];   // rows g and g + 8: channels 32t + 8 kd2 .. + 7
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        a_lo[m] = *reinterpret_cast<const uint4*>(qs + (16 * m + g) * kQStride + 32 * t + 8 * kd2);
        a_hi[m] =
            *reinterpret_cast<const uint4*>(qs + (16 * m + g + 8) * kQStride + 32 * t + 8 * kd2);
      }
      uint32_t b[2][2][2];
      keys.fragments(kd2, b);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
          for (int n = 0; n < 2; ++n) mma_k16<F>(acc[m][n], a_lo[m], a_hi[m], kk, b[n][kk]);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        const float v = quad_row_max(acc[m], i2);
        if (t == 0) warp_max[warp * MT * 16 + 16 * m + g + 8 * i2] = v;
      }
    }
  }
}

// The page table's id for logical page `page` of request b (checked against the pool where it
// is used, so that the load stays in flight until then).
__device__ __forceinline__ int table_entry(const DecodeIndexerArgs& a, int b, int page) {
  return __ldg(a.page_table + static_cast<int64_t>(b) * a.page_table_width + page);
}

// The chunk's candidate lists, one per row, sorted as TopList (larger score first, lower id on
// ties, empty (-inf, -1) last), in one of two layouts with the same interface: round k of the
// calling thread holds row row(k) (round_empty: no row of round k in this warp, uniform over
// it); offer(k, x, xi) offers (x, xi) to that row (x = -inf offers nothing; every thread of a
// warp whose round k is not empty calls it, rows past the last with -inf); store(k, dst) writes
// the row's list to dst[0 .. KCAP - 1].
//
// ThreadLists (rows > 16): thread r holds row r's list (TopList), so warp 0 offers up to 32 rows
// at the cost of one KCAP-step insertion chain; in the offer-warp form (kByLane) lane r of the
// offer warp holds it.
template <int KCAP, bool kByLane = false>
struct ThreadLists {
  static constexpr int kRounds = 1;
  TopList<KCAP> list;

  __device__ __forceinline__ static int row(int) {
    return kByLane ? threadIdx.x & 31 : threadIdx.x;
  }
  __device__ __forceinline__ static bool round_empty(int, int rows) {
    return kByLane ? false : (threadIdx.x & ~31) >= rows;
  }
  __device__ __forceinline__ static bool writes_scores() { return true; }
  __device__ __forceinline__ void clear() { list.clear(); }
  __device__ __forceinline__ void offer(int, float x, int xi) { list.offer(x, xi); }
  __device__ __forceinline__ void store(int, int2* dst) const {
#pragma unroll
    for (int i = 0; i < KCAP; ++i) dst[i] = make_int2(__float_as_int(list.score[i]), list.id[i]);
  }
};

// LaneLists (rows <= 16): row r's list lives in a segment of KCAP lanes (lane j of the segment
// holds entry j), so a page's offers cost every warp a few shuffles per row instead of warp 0 a
// KCAP-step insertion chain while the others wait for it at the next page's barrier. (With 32
// rows, two rounds of shuffles in every warp cost more than warp 0's one SIMT chain.) Round k of
// warp w holds rows k kRowsPerRound + (lane / KCAP) kWarps + w.
template <int MT, int KCAP>
struct LaneLists {
  static constexpr int kSegments = 32 / KCAP;                 // lists per warp and round
  static constexpr int kRowsPerRound = kWarps * kSegments;
  static constexpr int kRounds = (MT * 16 + kRowsPerRound - 1) / kRowsPerRound;
  static constexpr uint32_t kSegmentMask = KCAP == 32 ? 0xFFFFFFFFu : (1u << KCAP) - 1u;
  static_assert(32 % KCAP == 0, "whole segments of a warp");
  float score[kRounds];
  int id[kRounds];

  __device__ __forceinline__ static int row(int k) {
    const int lane = threadIdx.x & 31;
    return k * kRowsPerRound + (lane / KCAP) * kWarps + (threadIdx.x >> 5);
  }
  // Whether no row of round k is in this warp (uniform over the warp: its lowest row).
  __device__ __forceinline__ static bool round_empty(int k, int rows) {
    return k * kRowsPerRound + (threadIdx.x >> 5) >= rows;
  }
  __device__ __forceinline__ static bool writes_scores() { return threadIdx.x % KCAP == 0; }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
      score[k] = -INFINITY;
      id[k] = -1;
    }
  }
  // Offers (x, xi), the same on every lane of a segment, to the segment's round-k list (x = -inf
  // offers nothing). Every lane of the warp takes part (shuffles over all 32 lanes).
  __device__ __forceinline__ void offer(int k, float x, int xi) {
    const int lane = threadIdx.x & 31, j = lane % KCAP;
    const float last_score = __shfl_sync(0xFFFFFFFFu, score[k], KCAP - 1, KCAP);
    const int last_id = __shfl_sync(0xFFFFFFFFu, id[k], KCAP - 1, KCAP);
    const bool enters = ranks_before(x, xi, last_score, last_id);
    if (!__any_sync(0xFFFFFFFFu, enters)) return;
    // The entries ranking before (x, xi) are a prefix of the sorted list: its length is x's rank.
    const uint32_t before = __ballot_sync(0xFFFFFFFFu, ranks_before(score[k], id[k], x, xi));
    const int rank = __popc((before >> (lane - j)) & kSegmentMask);
    const float up_score = __shfl_up_sync(0xFFFFFFFFu, score[k], 1, KCAP);
    const int up_id = __shfl_up_sync(0xFFFFFFFFu, id[k], 1, KCAP);
    if (enters && j >= rank) {
      score[k] = j == rank ? x : up_score;
      id[k] = j == rank ? xi : up_id;
    }
  }
  __device__ __forceinline__ void store(int k, int2* dst) const {
    dst[threadIdx.x % KCAP] = make_int2(__float_as_int(score[k]), id[k]);
  }
};

// The lists of a warp that only scores (the offer-warp form's scoring warps).
struct NoLists {};

// The offer-warp form (kOfferWarp, 17-32 rows: MT 2): a ninth warp holds the rows' lists and
// offers page i - 1 while the eight scoring warps score page i, so a page costs the longer of
// the two instead of their sum (warp 0 offering and scoring). One named barrier a page for all
// nine warps; the maxima stay double-buffered as before.
template <bool kOfferWarp>
constexpr int kThreadsOf = kThreads + (kOfferWarp ? 32 : 0);

template <int F, int MT, int KCAP, bool kOfferWarp>
__global__ void __launch_bounds__(kThreadsOf<kOfferWarp>,
                                  (F != kBf16 && MT <= 2 && KCAP <= 16) ? 2 : 1)
    decode_indexer_topk_kernel(const __grid_constant__ DecodeIndexerArgs a) {
  static_assert(!kOfferWarp || MT == 2, "the offer warp holds 17-32 rows");
  using L = SmemLayout<F, MT>;
  extern __shared__ __align__(128) char smem_raw[];
  char* smem = smem_raw;
  if constexpr (L::kBaseAlign > 0) {
    smem += (L::kBaseAlign - (sm80::smem_addr(smem_raw) & (L::kBaseAlign - 1))) &
            (L::kBaseAlign - 1);
  }
  __half* qs = reinterpret_cast<__half*>(smem);
  char* stages = smem + L::kStagesOffset;
  float* warp_max = reinterpret_cast<float*>(smem + L::kMaxOffset);   // [2][kWarps][MT*16]
  __shared__ int s_last;
  // Whether page i of the chunk is valid, at s_valid[i % 8]: written when its copies are issued
  // (kStages - 1 pages ahead), read by the scoring and the offer of page i.
  __shared__ bool s_valid[8];
  static_assert(kStages + 1 <= 8, "the validity ring outlives a page's offer");
  // Bulk pages: stage s's full barrier; page i's copies land on full[i % kStages], phase
  // (i / kStages) & 1.
  __shared__ uint64_t full_bars[kStages];

  MSA_LAB_CALL_MARK(0);
  const int work = blockIdx.x;
  const int b = __ldg(a.work + 2 * work);
  const int chunk = __ldg(a.work + 2 * work + 1);
  if (b < 0 || b >= a.batch || chunk < 0) return;
  const int first = a.requests[3 * b];
  const int num_chunks = a.requests[3 * b + 1];
  const int chunk_pages = max(__ldg(a.chunk_pages), 1);
  if (chunk >= num_chunks || first < 0 || first + num_chunks > a.capacity) return;

  const int rows = a.seqlen_q * a.num_heads;
  const int len = min(max(__ldg(a.seqused_k + b), 0), a.page_table_width * kPage);
  const int history = history_pages(len);
  const int64_t begin64 = static_cast<int64_t>(chunk) * chunk_pages;
  const int begin = begin64 < history ? static_cast<int>(begin64) : history;
  const int end = chunk == num_chunks - 1 ? history : min(begin + chunk_pages, history);
  const int num_pages = max(end - begin, 0);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool scoring_warp = warp < kWarps;   // every warp but the offer warp
  constexpr bool kBulk = bulk_pages<F>();
  constexpr int kIssueWarp = kWarps - 1;   // bulk pages: not warp 0, which offers thread lists
  auto full = [&](int i) { return sm90::Mbarrier{full_bars + i % kStages}; };
  if constexpr (kBulk) {
    if (threadIdx.x < kStages) full(threadIdx.x).init(1);   // the issuing lane's arrival
    sm90::fence_barrier_init();
  }
  if (!kOfferWarp || scoring_warp) load_queries<MT, kQChannelPairs<F>>(a, b, rows, qs);
  __syncthreads();                                // qs written, the barriers initialized
  MSA_LAB_CALL_MARK(1);
  const float score_mul =
      a.scale * (F == kNvfp4 ? 16384.f * (a.k_global_scale != nullptr ? __ldg(a.k_global_scale)
                                                                      : 1.f)
                             : (kIsE4m3<F> && kLabWidenByAlu ? 256.f : 1.f));
  const int64_t total_q = static_cast<int64_t>(a.batch) * a.seqlen_q;

  auto stage_of = [&](int i) { return stages + (i % kStages) * PageShape<F>::kStageBytes; };
  // Page-table entries are read one page ahead of the copies that need them (a register
  // pipeline), so no page waits on a global load before its copies are issued.
  auto entry = [&](int i) { return i < num_pages ? table_entry(a, b, begin + i) : -1; };
  int next_entry = entry(0);
#ifdef MSA_LAB_NO_LOADS
  constexpr bool kLoads = false;
#else
  constexpr bool kLoads = true;
#endif
  // Page begin + i into its stage: bulk pages from one warp, their full barrier completing
  // either way (no bytes for a page outside the pool or past the chunk); otherwise every
  // scoring thread's cp.asyncs, one group either way.
  auto issue = [&](int i) {
    if (kBulk && warp != kIssueWarp) return;
    const int64_t physical = next_entry;
    next_entry = entry(i + 1);
    const bool valid = physical >= 0 && physical < a.num_pages;
    if constexpr (kBulk) {
      constexpr uint32_t kBytes = kPage * PageShape<F>::kRowBytes + PageShape<F>::kScaleBytes;
      if (lane == 0) {
        s_valid[i % 8] = valid;
        if (valid && kLoads) {
          full(i).arrive_expect_tx(kBytes);
        } else {
          full(i).arrive();
        }
      }
      __syncwarp();
      // The stage's last readers (page i - kStages) are past this page's barrier; their generic
      // reads come before the bulk copies' async-proxy writes.
      sm90::fence_proxy_async_shared();
      if (valid && kLoads) bulk_load_page<F>(a, physical, stage_of(i), full(i));
    } else {
      if (valid && kLoads) load_page<F>(a, physical, stage_of(i));
      if (threadIdx.x == 0) s_valid[i % 8] = valid;
      cp_async_commit();
    }
  };
  auto wait_for_page = [&](int i) {   // page i's bytes have landed (for this thread)
    if constexpr (kBulk) {
      full(i).wait((i / kStages) & 1);
    } else {
      cp_async_wait<kStages - 2>();
    }
  };
  // The page barrier: every warp is done with page i - 1 (its stage, its maxima, its offer).
  auto page_barrier = [&] {
    if constexpr (kOfferWarp) {
      sm90::named_sync(1, kThreadsOf<true>);
    } else {
      __syncthreads();
    }
  };
  // Each list row's own block (its candidates are the blocks before it).
  auto own_blocks = [&](const auto& lists, auto& own) {
    using Lists = std::decay_t<decltype(lists)>;
#pragma unroll
    for (int k = 0; k < Lists::kRounds; ++k) {
      const int row = Lists::row(k);
      const int pos = row < rows ? len - a.seqlen_q + row / a.num_heads : -1;
      own[k] = pos >= 0 ? pos / kPage : -1;
    }
  };
  // Every row's score of page begin + i (from the warps' maxima), offered to its list by the
  // list's lanes (LaneLists: every warp takes its rows' offers).
  auto offer = [&](auto& lists, const auto& own, int i) {
    using Lists = std::decay_t<decltype(lists)>;
#ifdef MSA_LAB_NO_OFFERS
    return;
#endif
    if (!s_valid[i % 8]) return;                       // uniform over the CTA
    const float* maxima = warp_max + (i & 1) * kWarps * MT * 16;
    const int page = begin + i;
#pragma unroll
    for (int k = 0; k < Lists::kRounds; ++k) {
      if (Lists::round_empty(k, rows)) break;
      const int row = Lists::row(k);
      const bool candidate = row < rows && page < own[k];
      float score = -INFINITY;
      if (candidate) {
        float m = maxima[row];
#pragma unroll
        for (int w = 1; w < kMaxWriters<MT>; ++w) m = fmaxf(m, maxima[w * MT * 16 + row]);
        score = m * score_mul;
      }
      lists.offer(k, score, page);
      if (candidate && a.scores != nullptr && Lists::writes_scores()) {
        const int q = row / a.num_heads, h = row % a.num_heads;
        a.scores[((h * total_q) + static_cast<int64_t>(b) * a.seqlen_q + q) * a.page_table_width +
                 page] = score;
      }
    }
  };
  // This chunk's lists into the workspace.
  auto store_lists = [&](const auto& lists) {
    using Lists = std::decay_t<decltype(lists)>;
#pragma unroll
    for (int k = 0; k < Lists::kRounds; ++k) {
      const int row = Lists::row(k);
      if (row < rows) {
        lists.store(k, reinterpret_cast<int2*>(a.partials) +
                           (static_cast<int64_t>(work) * rows + row) * a.list_capacity);
      }
    }
  };
  // The chunk's pages: every warp meets at each page's barrier; kScores warps wait for the
  // page, issue the copies kStages - 1 pages ahead and score it, kOffers warps offer the
  // previous page's scores (the last page's after the loop).
  auto run_pages = [&](auto scores_tag, auto offers_tag, auto& lists, const auto& own) {
    constexpr bool kScores = decltype(scores_tag)::value, kOffers = decltype(offers_tag)::value;
    [[maybe_unused]] QFragments q_regs;
    // The first key this warp scores in every page (score_page's key0 at pair 0).
    [[maybe_unused]] const ScaleSlot scale_slot(
        a.k_scale_linear, (MT <= 2 ? warp % (kWarps / MT) * MT : warp) * 16);
    if constexpr (kScores) {
      if constexpr (MT <= 2) q_regs.load(qs, warp / (kWarps / MT));
#pragma unroll
      for (int i = 0; i < kStages - 1; ++i) issue(i);
    }
    for (int i = 0; i < num_pages; ++i) {
      MSA_LAB_MARK(i, 0);
      if constexpr (kScores) wait_for_page(i);
      MSA_LAB_MARK(i, 1);
      // Page i has landed for every scoring thread; every warp is done with page i - 1 (its
      // stage and its maxima buffer).
      page_barrier();
      MSA_LAB_MARK(i, 2);
      if constexpr (kScores) issue(i + kStages - 1);
      MSA_LAB_MARK(i, 3);
      if constexpr (kOffers) {
        if (i > 0) offer(lists, own, i - 1);
      }
      MSA_LAB_MARK(i, 4);
      if constexpr (kScores) {
        if (s_valid[i % 8]) {   // uniform over the CTA
          score_page<F, MT>(stage_of(i), qs, q_regs, scale_slot,
                            warp_max + (i & 1) * kWarps * MT * 16);
        }
      }
      MSA_LAB_MARK(i, 5);
    }
    if constexpr (kScores) cp_async_wait<0>();   // bulk pages: none is issued past those waited for
    page_barrier();
    if constexpr (kOffers) {
      if (num_pages > 0) offer(lists, own, num_pages - 1);
      store_lists(lists);
    }
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if constexpr (kOfferWarp) {
    if (scoring_warp) {   // no lists: run_pages reads lists and own only where it offers
      NoLists none;
      const int no_own[1] = {-1};
      run_pages(Yes{}, No{}, none, no_own);
    } else {
      ThreadLists<KCAP, true> lists;
      lists.clear();
      int own[1];
      own_blocks(lists, own);
      run_pages(No{}, Yes{}, lists, own);
    }
  } else {
    using Lists = std::conditional_t<MT == 1, LaneLists<MT, KCAP>, ThreadLists<KCAP>>;
    Lists lists;
    lists.clear();
    int own[Lists::kRounds];
    own_blocks(lists, own);
    run_pages(Yes{}, Yes{}, lists, own);
  }

  // Count this CTA in. Its lists reach the request's merging CTA through the counter: the CTA
  // barrier orders every thread's list stores before thread 0's acquire-release add at GPU
  // scope (cumulative over what the barrier ordered), and the merging CTA's thread 0 acquires
  // every earlier chunk's lists through the same add, then its barrier hands them to its warps
  // (whose loads go to L2). One thread's acq_rel atomic instead of every thread's sequentially
  // consistent fence (MEMBAR.SC.GPU and an L1 invalidation) before and after the count.
  MSA_LAB_CALL_MARK(2);
  __syncthreads();
  if (threadIdx.x == 0) s_last = add_acq_rel_gpu(a.requests + 3 * b + 2, 1) == num_chunks - 1;
  __syncthreads();
  MSA_LAB_CALL_MARK(3);
  if (!s_last) MSA_LAB_CALL_EXIT();
  if (!s_last || (kOfferWarp && !scoring_warp)) return;   // the merge: a scoring warp a row
#ifdef MSA_LAB_NO_MERGE
  if (threadIdx.x == 0) a.requests[3 * b + 2] = 0;
  MSA_LAB_CALL_EXIT();
  return;
#endif
  // The last CTA of the request: per row, merge the request's chunk lists. A row takes a
  // segment of `seg` lanes (merge_segment_lanes), lane `slot` holding chunk slot's list (and
  // chunk slot + seg's, ... merged into it past seg chunks), so a warp merges 32 / seg rows at
  // once: a short history's few chunks would leave most lanes idle and its rows one after
  // another (the merge was most of a 4k-key call).
  const int keep = a.topk - 1;
  const uint32_t empty_code = order_code(-INFINITY);
  // The pages' stages are free now (every copy waited for): each warp's rows' picks go there.
  static_assert(kStages * PageShape<F>::kStageBytes >= kWarps * 32 * kMaxTopk * 4,
                "the merge's picks fit the stages");
  int* merge_picks = reinterpret_cast<int*>(stages);
  const int seg = merge_segment_lanes(rows, kWarps);
  const int rows_per_pass = 32 / seg;
  const int slot = lane & (seg - 1);
  for (int row0 = warp * rows_per_pass; row0 < rows; row0 += kWarps * rows_per_pass) {
    const int row = row0 + lane / seg;
    const bool live = row < rows;   // lanes past the rows still take part in the shuffles
    TopList<KCAP> pool;
    pool.clear();
    for (int c = slot; live && c < num_chunks; c += seg) {
      const int2* src = reinterpret_cast<const int2*>(a.partials) +
                        (static_cast<int64_t>(first + c) * rows + row) * a.list_capacity;
      // The list's entries are loaded kBatch at a time, all in flight together: one L2
      // round trip per batch, not per entry.
      constexpr int kBatch = KCAP < 16 ? KCAP : 16;
      bool more = true;
      for (int i0 = 0; i0 < KCAP && more; i0 += kBatch) {
        int2 e[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) e[j] = __ldcg(src + i0 + j);
        if (c == slot) {
          // The lane's first list is sorted like the pool (empty slots last): it is the pool.
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            pool.score[i0 + j] = __int_as_float(e[j].x);
            pool.id[i0 + j] = e[j].y;
          }
          continue;
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const float s = __int_as_float(e[j].x);
          // The chunk's list is sorted: once an entry loses, the rest lose too.
          more = more && pool.beats_last(s, e[j].y);
          if (more) pool.offer(s, e[j].y);
        }
      }
    }
    MSA_LAB_CALL_MARK(4);
    const int q = row / a.num_heads, h = row % a.num_heads;
    auto store = [&](int k, int value) {   // entry k of the row's selection
      for (int rep = 0; rep < a.out_head_repeat; ++rep) {
        const int64_t out_row = (static_cast<int64_t>(h) * a.out_head_repeat + rep) * total_q +
                                static_cast<int64_t>(b) * a.seqlen_q + q;
        a.out[out_row * a.topk + k] = value;
      }
    };
    const int pos = len - a.seqlen_q + q;
    const int row_own = pos >= 0 ? pos / kPage : -1;   // the row's own block
    if (a.butterfly_merge) {
      // Every lane of the segment gets the row's best KCAP entries at once; each writes its
      // share: the picks, then the own block, and -1 in the slots past it.
      unsigned long long key[KCAP];
      segment_best_keys(pool, seg, key);
      int count = 0;
#pragma unroll
      for (int k = 0; k < KCAP; ++k) {
        count += k < keep && static_cast<uint32_t>(key[k] >> 32) != empty_code;
      }
#pragma unroll
      for (int k = 0; k < KCAP; ++k) {
        if (live && k < a.topk && (k & (seg - 1)) == slot) {
          store(k, k < count ? static_cast<int>(~static_cast<uint32_t>(key[k]))
                             : (k == count ? row_own : -1));
        }
      }
      continue;
    }
    // Each round the segment's best head (highest score, then lowest id) leaves its lane's
    // list into the row's picks in shared memory; the row goes to global memory once after
    // the rounds, off their dependency chain.
    int* picks = merge_picks + (warp * 32 + lane / seg) * kMaxTopk;
    int count = 0;
    for (int k = 0; k < keep; ++k) {
      const uint32_t hi = order_code(pool.score[0]);
      const uint32_t best_hi = segment_max(hi, seg);
      const uint32_t lo = hi == best_hi ? ~static_cast<uint32_t>(pool.id[0]) : 0u;
      const uint32_t best_lo = segment_max(lo, seg);
      if (best_hi != empty_code) {   // else the segment's lists are spent (uniform in it)
        if (hi == best_hi && lo == best_lo) pool.pop_front();
        if (slot == (k & (seg - 1))) picks[k] = static_cast<int>(~best_lo);
        count = k + 1;
      }
    }
    __syncwarp();
    // The picks, then the row's own block, and -1 in the slots past it.
    for (int k = slot; live && k < a.topk; k += seg) {
      store(k, k < count ? picks[k] : (k == count ? row_own : -1));
    }
    __syncwarp();   // the next pass's picks reuse the buffer
  }
  if (threadIdx.x == 0) a.requests[3 * b + 2] = 0;   // for the next launch
  MSA_LAB_CALL_MARK(5);
  MSA_LAB_CALL_EXIT();
}

// Sum over the CTA of `value` (every thread passes its share; every thread gets the sum).
// `scratch` holds one entry per warp; the barriers make back-to-back calls safe.
__device__ __forceinline__ long long plan_block_sum(long long value, long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) value += __shfl_xor_sync(0xFFFFFFFFu, value, o);
  __syncthreads();                       // the previous call's readers are done
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  long long total = 0;
#pragma unroll 4
  for (int w = 0; w < kPlanWarps; ++w) total += scratch[w];
  return total;
}

// Splits the live history blocks into equal chunks over the plan's grid (one CTA). The chunk
// length c minimizes waves x c over the spread (= max_ctas) slots, since a few work items past
// a wave cost a whole chunk's time. Candidates: ceil(total / spread) (the plain split: at most
// spread + B = capacity items), the smallest c whose items fit the capacity, and the smallest
// whose items fit one wave of spread (on ties the later one). plan_work_split in
// decode_indexer.py computes the same.
//
// The kernel is a chain of CTA barriers, so its searches probe kPlanWarps chunk lengths a
// round (a warp counts one length's items over every request, the requests' history lengths
// cached in shared memory) instead of bisecting with a CTA-wide sum per step.
__global__ void __launch_bounds__(kPlanThreads) decode_indexer_plan_kernel(
    const DecodeIndexerPlanArgs a) {
  __shared__ long long s_total[kPlanWarps];
  __shared__ long long s_items[2][kPlanWarps];   // a round's counts (rounds alternate)
  __shared__ int s_history[kPlanCachedRequests];
  __shared__ int s_scan[kPlanWarps];
  __shared__ int s_carry;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto load_history = [&](int b) { return history_pages(max(__ldg(a.seqused_k + b), 0)); };
  auto history = [&](int b) {
    return b < kPlanCachedRequests ? s_history[b] : load_history(b);
  };

  long long local = 0;
  for (int b = threadIdx.x; b < a.batch; b += kPlanThreads) {
    const int h = load_history(b);
    if (b < kPlanCachedRequests) s_history[b] = h;
    local += h;
  }
  const long long total = plan_block_sum(local, s_total);   // its barriers publish s_history
  if (threadIdx.x == 0) s_carry = 0;

  // Work items of chunk length c, counted by one warp: sum over the requests of
  // max(1, ceil(h / c)). 32-bit division (h < 2^24, c <= INT_MAX, so h + c - 1 < 2^32): a
  // 64-bit one is a long subroutine.
  auto warp_items = [&](long long c) {
    const uint32_t cu = static_cast<uint32_t>(c);
    long long count = 0;
    for (int b = lane; b < a.batch; b += 32) {
      count += max(1u, (static_cast<uint32_t>(history(b)) + cu - 1u) / cu);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(0xFFFFFFFFu, count, o);
    return count;
  };
  // One round: warp w < n counts the items of length_of(w); every thread gets the counts.
  int round = 0;
  auto count_items = [&](auto length_of, int n) {
    long long* counts = s_items[round & 1];
    if (warp < n) {
      const long long c = warp_items(length_of(warp));
      if (lane == 0) counts[warp] = c;
    }
    __syncthreads();   // and the round before last's readers are done with this buffer
    ++round;
    return static_cast<const long long*>(counts);
  };

  const long long spread = max(a.capacity - a.batch, 1);
  auto clamp_chunk = [](long long c) {
    return c < kMinChunkPages ? static_cast<long long>(kMinChunkPages)
                              : (c < INT_MAX ? c : static_cast<long long>(INT_MAX));
  };
  // The smallest c in [lo, hi) whose items fit cap, else hi (items(c) does not grow with c):
  // kPlanWarps probes a round, spread evenly over the range (every length once it is short).
  auto smallest_fitting = [&](long long lo, long long hi, long long cap) {
    while (lo < hi) {      // block-uniform: every thread takes the same path
      const long long span = hi - lo;
      const bool every = span <= kPlanWarps;
      const int n = every ? static_cast<int>(span) : kPlanWarps;
      auto probe = [&](int i) { return every ? lo + i : lo + (i + 1) * span / (kPlanWarps + 1); };
      const long long* counts = count_items(probe, n);
      int fit = n;
      for (int i = n - 1; i >= 0; --i) {
        if (counts[i] <= cap) fit = i;
      }
      if (fit == n) {
        lo = probe(n - 1) + 1;
      } else {
        const long long below = fit > 0 ? probe(fit - 1) + 1 : lo;
        hi = probe(fit);
        lo = every ? hi : below;
      }
    }
    return hi;
  };
  // The candidates: the plain split, then the fits of the capacity and of one wave.
  long long candidates[3] = {clamp_chunk((total + spread - 1) / spread), 0, 0};
  int num_candidates = 1;
  for (int fit = 0; fit < 2; ++fit) {
    const long long cap = fit == 0 ? a.capacity : spread;
    if (cap <= a.batch) continue;
    // items(c) <= total / c + B, so hi fits; items(c) >= total / c, so nothing below lo does.
    const long long lo = clamp_chunk((total + cap - 1) / cap);
    const long long hi =
        clamp_chunk(max(lo, (total + cap - a.batch - 1) / (cap - a.batch)));
    const long long c = smallest_fitting(lo, hi, cap);
    if (num_candidates == 1) candidates[1] = c; else candidates[2] = c;
    ++num_candidates;
  }
  // (by name, not by a runtime index, so the array stays in registers)
  auto candidate = [&](int i) {
    return i == 0 ? candidates[0] : (i == 1 ? candidates[1] : candidates[2]);
  };
  const long long* counts = count_items(candidate, num_candidates);
  long long best = candidates[0];
  long long best_cost = (counts[0] + spread - 1) / spread * best;
  for (int i = 1; i < num_candidates; ++i) {
    const long long c = candidate(i);
    const long long cost = (counts[i] + spread - 1) / spread * c;
    if (cost <= best_cost) {
      best = c;
      best_cost = cost;
    }
  }
  const int chunk = static_cast<int>(best);

  for (int base = 0; base < a.batch; base += kPlanThreads) {
    const int b = base + threadIdx.x;
    const int h = b < a.batch ? history(b) : 0;
    // 64-bit: garbage lengths may push chunk towards INT_MAX.
    const int n = b < a.batch ? static_cast<int>(max(1LL, (h + chunk - 1LL) / chunk)) : 0;
    int incl = detail::warp_inclusive_sum(n);   // inclusive scan: warp, then warp totals
    if (lane == 31) s_scan[warp] = incl;
    __syncthreads();
    int before = s_carry;
    for (int w = 0; w < warp; ++w) before += s_scan[w];
    const int first = before + incl - n;
    if (b < a.batch) {
      a.requests[3 * b] = first;
      a.requests[3 * b + 1] = n;
      a.requests[3 * b + 2] = 0;
      for (int c = 0; c < n && first + c < a.capacity; ++c) {
        a.work[2 * (first + c)] = b;
        a.work[2 * (first + c) + 1] = c;
      }
    }
    __syncthreads();
    if (threadIdx.x == kPlanThreads - 1) s_carry = before + incl;
    __syncthreads();
  }
  for (int w = s_carry + threadIdx.x; w < a.capacity; w += kPlanThreads) {
    a.work[2 * w] = -1;
    a.work[2 * w + 1] = -1;
  }
  if (threadIdx.x == 0) *a.chunk_pages = chunk;
}

template <int F, int MT, int KCAP, bool kOfferWarp = false>
cudaError_t launch_topk(const DecodeIndexerArgs& a, cudaStream_t stream) {
  auto kernel = decode_indexer_topk_kernel<F, MT, KCAP, kOfferWarp>;
  constexpr int kSmem = SmemLayout<F, MT>::kAlloc;
  MSA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  kernel<<<a.capacity, kThreadsOf<kOfferWarp>, kSmem, stream>>>(a);
  return cudaGetLastError();
}

template <int F, int KCAP>
cudaError_t launch_by_rows(const DecodeIndexerArgs& a, cudaStream_t stream) {
  const int tiles = (a.seqlen_q * a.num_heads + 15) / 16;
  if (tiles <= 1) return launch_topk<F, 1, KCAP>(a, stream);
  if (tiles <= 2) {
    return a.offer_warp ? launch_topk<F, 2, KCAP, true>(a, stream)
                        : launch_topk<F, 2, KCAP>(a, stream);
  }
  if (tiles <= 4) return launch_topk<F, 4, KCAP>(a, stream);
  return launch_topk<F, 8, KCAP>(a, stream);
}

template <int F>
cudaError_t launch_by_list(const DecodeIndexerArgs& a, cudaStream_t stream) {
  return a.list_capacity == 16 ? launch_by_rows<F, 16>(a, stream)
                               : launch_by_rows<F, 32>(a, stream);
}

}  // namespace

cudaError_t decode_indexer_image(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, decode_indexer_plan_kernel);
}

cudaError_t launch_decode_indexer_plan(const DecodeIndexerPlanArgs& args, cudaStream_t stream) {
  if (args.batch <= 0 || args.capacity <= 0) return cudaSuccess;
  decode_indexer_plan_kernel<<<1, kPlanThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

// The tensor map of e4m3 index keys [num_pages * 128 rows, 128 bytes] for tiles of one page
// (128 x 128 bytes, 128-byte swizzle) into a.k_tensor_map; false (the cp.async form serves)
// when the device is older than sm_90, k is not 16-byte aligned or the driver cannot encode it.
bool encode_page_map(DecodeIndexerArgs& a) {
  static_assert(sizeof(a.k_tensor_map) == sizeof(CUtensorMap), "the tensor map's storage");
  if (a.num_pages < 1 || a.num_pages > (int64_t{1} << 24)) return false;
  return encode_row_map(a.k_tensor_map, a.k, a.num_pages * kPage, kDim, kPage,
                        CU_TENSOR_MAP_SWIZZLE_128B);
}

cudaError_t launch_decode_indexer_topk(const DecodeIndexerArgs& args, cudaStream_t stream) {
  if (args.batch <= 0 || args.capacity <= 0) return cudaSuccess;
  if (args.topk < 1 || args.topk > kMaxTopk) return cudaErrorInvalidValue;   // the merge's picks
  if (args.k_format == kE4m3 && args.tma_pages) {
    DecodeIndexerArgs with_map = args;
    if (encode_page_map(with_map)) return launch_by_list<kE4m3Tma>(with_map, stream);
  }
  switch (args.k_format) {
    case kBf16: return launch_by_list<kBf16>(args, stream);
    case kE4m3: return launch_by_list<kE4m3>(args, stream);
    case kNvfp4: return launch_by_list<kNvfp4>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace msa
