// Paged decode attention: dense or block-sparse, split-KV + merge. Built for every csrc arch;
// the warpgroup form below is sm_90a code (elsewhere its launch is refused).
//
// Semantics: msa.reference.decode (contract §1.4, sparse decode D6). One CTA per work item of the
// split-KV schedule (msa.src.sm100.decode_schedule) and KV head: it streams the K/V pages of one
// chunk of one request exactly once and serves every query row of that KV head in its qo tile
// (row r of the request's seqlen_q * G rows is query token r / G, q head h * G + r % G; a tile
// is qo_tile_rows <= 128 consecutive rows, and a sparse tile streams the union of its tokens'
// selected pages).
//
// Math on tensor cores with mma.sync m16n8k16 (bf16 in, fp32 accumulate), one 16-row m tile per
// warp. e4m3 Q/K/V are converted to bf16 exactly. Softmax is folded per page (128 keys) against
// the page max, like the reference: p = exp(s - page max) (rounded to e4m3 when Q and K/V are
// e4m3), scaled by exp(page max - running max); P.V uses P split into a bf16 high part plus a
// bf16 residual, so unrounded P keeps ~16 mantissa bits instead of bf16's 8.
//
// Direct e4m3 form (e4m3 Q and K/V, tiles of <= 16 rows, warps splitting each page's keys, two
// pages per step; a CTA streams a range of tiles, see its section): no conversion pass. Pages
// stay e4m3 in a six-stage cp.async ring (16-byte
// chunks of each row XOR-swizzled by row % 8; rows past the request's end zero-filled), fragments
// are read straight from it and widened in registers to f16 (exact for e4m3), and the MMA is f16
// with fp32 accumulation. Q lives in registers. QK^T uses a
// permuted channel order (k-chunk kd's positions {2t, 2t+1, 2t+8, 2t+9} hold channels
// 32t + 4kd + {0..3}, t = lane % 4) so each thread reads 32 contiguous bytes of a K row; P.V
// uses a permuted output order (n-tile j, column c holds channel 16c + j) so each thread reads
// one 16-byte chunk of four V rows and interleaves them with byte permutes. P is rounded to e4m3
// (exact in f16), scaled by exp(page max - running max) in f16 before the MMA.
//
// Warpgroup form (tiles of more than 16 rows, i.e. multi-token prediction; Q and K/V both bf16 or
// both e4m3): two warpgroups of 64 rows run Q K^T and P V on 16-bit wgmma m64n128 (e4m3 widened
// to f16 in shared memory) from 128-byte swizzled shared memory; see the wg namespace below and
// docs/design-decode.md.
//
// Safety: every page id, q2k id, length and schedule index is range-checked on the device;
// invalid ones are skipped (their keys are invisible). No host synchronization; every size is a
// host argument, so the launch can be captured in a CUDA graph.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "sm80_primitives.cuh"
#include "tensor_map.cuh"
#include "sm90_pipeline.cuh"
#include "torch_binding.h"

namespace msa {
namespace {

constexpr int kHeadDim = 128;
constexpr int kPageSize = 128;
constexpr int kRowsPerCta = 128;                 // the largest query tile (QO_TILE_ROWS)
constexpr int kWarps = 8;                        // one 16-row m tile each
constexpr int kThreads = kWarps * 32;
constexpr int kStride = kHeadDim + 8;            // bf16 per smem row: padding keeps fragment
                                                 // loads and ldmatrix free of bank conflicts
constexpr int kMaxCandidates = 16 * 32;          // seqlen_q <= 16 tokens x topK <= 32 slots
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Dynamic shared memory layout (bytes).
constexpr int kQBytes = kRowsPerCta * kStride * 2;               // Q tile, bf16
constexpr int kPageBf16Bytes = 2 * kPageSize * kStride * 2;      // K then V of one page, bf16
constexpr int kPageFp8Bytes = 2 * kPageSize * kHeadDim;          // K then V, raw e4m3
constexpr int kStageRegionBytes = 2 * kPageBf16Bytes;            // bf16: two pipeline stages
static_assert(kPageBf16Bytes + 2 * kPageFp8Bytes <= kStageRegionBytes,
              "e4m3: one converted page + two raw stages must fit the stage region");
constexpr int kListBytes = kMaxCandidates * 4 * 4;               // cand, phys, logical, mask
// warp_counts + page_total (one int per warp + 1) and the split-keys page maxima
// [kWarps][16] floats.
constexpr int kCountsSlotBytes = 64;
constexpr int kSmemBytes =
    kQBytes + kStageRegionBytes + kListBytes + kCountsSlotBytes + kWarps * 16 * 4;
static_assert(kWarps * 16 * (kHeadDim + 1) * 4 <= kStageRegionBytes,
              "split keys: the warps' partial accumulators must fit the stage region");
// Direct e4m3 form: no Q tile and no converted page, so the raw page ring takes the front of
// shared memory and is deep (five pages in flight per SM: the decode stream is latency-bound
// at fewer bytes in flight), followed by the same lists.
constexpr int kDirectStages = 6;
constexpr int kDirectRingBytes = kDirectStages * kPageFp8Bytes;

struct __align__(16) Bf16x8 {
  __nv_bfloat162 v[4];
};

using sm80::cp_async_16;
using sm80::cp_async_16_or_zero;
using sm80::cp_async_commit;
using sm80::e4m3x2_hi_to_f16x2;
using sm80::e4m3x2_lo_to_f16x2;
using sm80::e4m3x2_to_float2;
using sm80::mma_bf16;
using sm80::mma_f16;
using sm80::round_e4m3x2_to_f16x2;
using sm80::smem_addr;

__device__ __forceinline__ void cp_async_wait_one() { sm80::cp_async_wait<1>(); }
__device__ __forceinline__ void cp_async_wait_all() { sm80::cp_async_wait<0>(); }

// 32-bit word w (0..7) of two 16-byte chunks.
__device__ __forceinline__ uint32_t word_of(const uint4 (&v)[2], int w) {
  const uint4& c = v[w >> 2];
  switch (w & 3) {
    case 0: return c.x;
    case 1: return c.y;
    case 2: return c.z;
    default: return c.w;
  }
}

// 16-byte chunk `chunk` of row `row` of a swizzled raw e4m3 tile (rows of 128 bytes).
__device__ __forceinline__ uint4 swizzled_chunk(const char* tile, int row, int chunk) {
  return *reinterpret_cast<const uint4*>(tile + row * kHeadDim + ((chunk ^ (row & 7)) << 4));
}

// 2^x on the MUFU alone, subnormal results flushed to zero. exp2f keeps subnormals with a range
// test and two multiplies around the MUFU: ~3 more instructions per probability, and a
// probability below 2^-126 is nothing to P.V or the row sum.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Lab hooks of the softmax (benchmarks/lab/decode_pp_timeline.cu, not served):
// MSA_LAB_EXP_ON_FMA=n computes n of every 16 probabilities with exp2_fma (FlashAttention-4's
// split of the exponentials between the MUFU and the FMA units); MSA_LAB_NO_EXP drops the
// exponential (S scaled and shifted passed on as P) and MSA_LAB_NO_SOFTMAX the whole page
// softmax, to bound what a cheaper softmax could give.
#if defined(MSA_LAB_EXP_ON_FMA) && MSA_LAB_EXP_ON_FMA > 0
// 2^x for x <= 0 on the FMA pipe: 2^x = 2^n 2^f, n = rint(x) by the 1.5 * 2^23 shift, 2^f on
// [-0.5, 0.5] a degree-4 polynomial (relative error 2.9e-6, below e4m3's and bf16's rounding
// steps), 2^n added into the exponent field. x is clamped at -127 (-inf: 2^-127, nothing to
// the row sum or an e4m3 / bf16 P).
__device__ __forceinline__ float exp2_fma(float x) {
  x = fmaxf(x, -127.f);
  const float shifted = x + 12582912.f;          // 1.5 * 2^23: low bits hold rint(x)
  const float f = x - (shifted - 12582912.f);    // [-0.5, 0.5]
  float p = fmaf(0.009582853f, f, 0.05590643f);
  p = fmaf(p, f, 0.24024099f);
  p = fmaf(p, f, 0.69312418f);
  p = fmaf(p, f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
}
#endif

// Lab hook of the direct and token-warps forms (benchmarks/lab/sm90_pipe_rates.cu measures
// both rates, benchmarks/lab/decode_sparse_mtp_forms.cu the forms): MSA_LAB_WIDEN_BY_ALU=1
// widens their e4m3 K and V fragments by integer ops (sm80::e4m3x2_lo_to_scaled_f16x2: x
// 2^-8, folded back into the score scale and the output) instead of F2FP on the conversion
// pipe, =2 only K (the two pipes share the work).
#if defined(MSA_LAB_WIDEN_BY_ALU) && MSA_LAB_WIDEN_BY_ALU > 0
constexpr bool kLabKByAlu = true;
constexpr bool kLabVByAlu = MSA_LAB_WIDEN_BY_ALU == 1;
#else
constexpr bool kLabKByAlu = false;
constexpr bool kLabVByAlu = false;
#endif
// The score scale and output factor that undo the 2^-8 of those widenings.
constexpr float kLabKScale = kLabKByAlu ? 256.f : 1.f;
constexpr float kLabVScale = kLabVByAlu ? 256.f : 1.f;

// e4m3 pairs of a word (bytes 0-1 / 2-3) widened to f16x2 for an MMA: exactly (F2FP), or by
// integer ops as x 2^-8 with kByAlu.
template <bool kByAlu>
__device__ __forceinline__ uint32_t widen_lo(uint32_t w) {
  if constexpr (kByAlu) return sm80::e4m3x2_lo_to_scaled_f16x2(w);
  return e4m3x2_lo_to_f16x2(w);
}
template <bool kByAlu>
__device__ __forceinline__ uint32_t widen_hi(uint32_t w) {
  if constexpr (kByAlu) return sm80::e4m3x2_hi_to_scaled_f16x2(w);
  return e4m3x2_hi_to_f16x2(w);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Rounds a probability to e4m3 and back, as an FP8 P.V MMA would see it.
__device__ __forceinline__ float round_to_e4m3(float x) {
  const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  const __half_raw h = __nv_cvt_fp8_to_halfraw(q, __NV_E4M3);
  return __half2float(__half(h));
}

// 16 e4m3 values (one uint4) -> 16 bf16 values (two uint4), exact.
__device__ __forceinline__ void e4m3x16_to_bf16(const uint4& in, Bf16x8 (&out)[2]) {
  const uint32_t words[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float2 a = e4m3x2_to_float2(static_cast<uint16_t>(words[w] & 0xFFFFu));
    const float2 b = e4m3x2_to_float2(static_cast<uint16_t>(words[w] >> 16));
    out[w / 2].v[(w % 2) * 2 + 0] = __floats2bfloat162_rn(a.x, a.y);
    out[w / 2].v[(w % 2) * 2 + 1] = __floats2bfloat162_rn(b.x, b.y);
  }
}

// One KV page of the CTA's work list: physical page, logical block and the query tokens
// (bit t = token t) that may see it. token_mask == 0 means "skip" (invalid or unselected).
struct PageRef {
  int physical;
  int logical;
  uint32_t token_mask;
};

struct CtaContext {
  int request;
  int head;            // KV head
  int qo_tile;
  int first_row;       // the tile's first row (token * G + query head in group) of the request
  int first_token;     // the tokens the tile's rows belong to: first_token .. + num_tokens - 1
  int num_tokens;
  int chunk_begin;     // units: logical pages, or q2k slots with slot_chunks
  int chunk_end;
  bool slot_chunks;    // sparse, one token per qo tile: the chunk is a range of q2k slots
  int seqlen_k;        // seqused_k[request], clamped to >= 0
  int num_blocks;      // KV pages the request addresses: min(ceil(seqlen_k / 128), table width)
};

// A dense page's mask from its page-table entry: every token, or none for an id outside the
// pool (never read; its keys are not attention's). Sparse refs come settled from the page list.
__device__ __forceinline__ PageRef settle_page(const DecodeAttentionArgs& a, PageRef ref) {
  if (a.q2k_indices == nullptr) {
    ref.token_mask = ref.physical >= 0 && ref.physical < a.num_pages ? 0xFFFFFFFFu : 0u;
  }
  return ref;
}

// kSettle = false leaves a dense ref's mask to settle_page, so that the page-table load can stay
// in flight.
template <bool kSettle = true>
__device__ __forceinline__ PageRef resolve_page(const DecodeAttentionArgs& a,
                                                const CtaContext& ctx, int i,
                                                const int* list_phys, const int* list_logical,
                                                const uint32_t* list_mask) {
  PageRef ref;
  if (a.q2k_indices != nullptr) {
    ref.physical = list_phys[i];
    ref.logical = list_logical[i];
    ref.token_mask = list_mask[i];
    return ref;
  }
  ref.logical = ctx.chunk_begin + i;
  ref.physical = __ldg(a.page_table + static_cast<int64_t>(ctx.request) * a.page_table_width +
                       ref.logical);
  return kSettle ? settle_page(a, ref) : ref;
}

// The rows of ctx.qo_tile (returns their count) and the request's length (seqlen_k >= 0) and
// KV pages.
__device__ __forceinline__ int fill_tile(const DecodeAttentionArgs& a, CtaContext& ctx,
                                         int group, int seqlen_k) {
  ctx.first_row = ctx.qo_tile * a.qo_tile_rows;
  const int tile_rows = min(a.qo_tile_rows, a.seqlen_q * group - ctx.first_row);
  ctx.first_token = ctx.first_row / group;
  ctx.num_tokens = (ctx.first_row + tile_rows - 1) / group - ctx.first_token + 1;
  ctx.seqlen_k = seqlen_k;
  ctx.num_blocks = min((ctx.seqlen_k + kPageSize - 1) / kPageSize, a.page_table_width);
  return tile_rows;
}

// The unit range [begin, end) of chunk `chunk` of a request holding `units_now` units (the
// request's last chunk runs to its current end; a chunk past it is empty).
__device__ __forceinline__ void chunk_range(const DecodeAttentionArgs& a, int request, int chunk,
                                            int units_now, int& begin, int& end) {
  const bool last_chunk = chunk == __ldg(a.num_splits + request) - 1;
  begin = chunk * a.kv_chunk_size;
  end = last_chunk ? units_now : min(begin + a.kv_chunk_size, units_now);
  end = max(end, begin);
  if (begin >= units_now) end = begin;
}

// Work item `work` of the schedule for KV head `head`: request, chunk and qo tile, the
// request's length and the chunk's unit range (the request's last chunk runs to its current
// end). False for a corrupt schedule entry: nothing the CTA could safely write.
__device__ __forceinline__ bool make_context(const DecodeAttentionArgs& a, int work, int head,
                                             CtaContext& ctx, int& chunk, int& group,
                                             int& tile_rows) {
  ctx.head = head;
  ctx.request = __ldg(a.request_indices + work);
  chunk = __ldg(a.kv_tile_indices + work);
  ctx.qo_tile = __ldg(a.qo_tile_indices + work);
  group = a.num_qo_heads / a.num_kv_heads;
  const int rows_total = a.seqlen_q * group;
  if (ctx.request < 0 || ctx.request >= a.batch || chunk < 0 || ctx.qo_tile < 0 ||
      ctx.qo_tile >= (rows_total + a.qo_tile_rows - 1) / a.qo_tile_rows) {
    return false;
  }
  tile_rows = fill_tile(a, ctx, group, max(__ldg(a.seqused_k + ctx.request), 0));
  // Sparse chunks are q2k slot ranges when every qo tile holds one token, else logical page
  // ranges (schedules/decode.py: multi_token_tiles, the same rule).
  ctx.slot_chunks = a.q2k_indices != nullptr &&
                    !(a.seqlen_q > 1 && group % a.qo_tile_rows != 0);
  const int units_now = ctx.slot_chunks ? a.topk : ctx.num_blocks;
  chunk_range(a, ctx.request, chunk, units_now, ctx.chunk_begin, ctx.chunk_end);
  return true;
}

// Rows of a page that hold the request's keys (the rest are past seqused_k).
__device__ __forceinline__ int page_valid_rows(const CtaContext& ctx, const PageRef& ref) {
  return min(kPageSize, max(ctx.seqlen_k - ref.logical * kPageSize, 0));
}

// Issues the cp.async copies of one page's K and V head slice into a stage. Rows at or past
// `valid_rows` are zero-filled instead of read: whatever bytes a cache holds there (NaN
// patterns of an uninitialized pool included) never meet a zero probability in P.V.
__device__ __forceinline__ void load_page_async(const DecodeAttentionArgs& a, int head,
                                                const PageRef& ref, char* stage,
                                                int valid_rows) {
  if (ref.token_mask == 0) return;
  const int64_t elem_offset =
      (static_cast<int64_t>(ref.physical) * a.num_kv_heads + head) * (kPageSize * kHeadDim);
  if (!a.kv_fp8) {
    const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(a.k) + elem_offset;
    const __nv_bfloat16* v = static_cast<const __nv_bfloat16*>(a.v) + elem_offset;
    __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(stage);
    __nv_bfloat16* vs = ks + kPageSize * kStride;
    constexpr int kChunksPerRow = kHeadDim / 8;
    for (int c = threadIdx.x; c < kPageSize * kChunksPerRow; c += kThreads) {
      const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const bool valid = row < valid_rows;
      const int src = valid ? row * kHeadDim + col : 0;
      cp_async_16_or_zero(ks + row * kStride + col, k + src, valid);
      cp_async_16_or_zero(vs + row * kStride + col, v + src, valid);
    }
  } else {
    const uint8_t* k = static_cast<const uint8_t*>(a.k) + elem_offset;
    const uint8_t* v = static_cast<const uint8_t*>(a.v) + elem_offset;
    constexpr int kChunks = kPageSize * kHeadDim / 16;
    constexpr int kChunksPerRow = kHeadDim / 16;
    for (int c = threadIdx.x; c < kChunks; c += kThreads) {
      const bool valid = c / kChunksPerRow < valid_rows;
      const int src = valid ? c * 16 : 0;
      cp_async_16_or_zero(stage + c * 16, k + src, valid);
      cp_async_16_or_zero(stage + kPageSize * kHeadDim + c * 16, v + src, valid);
    }
  }
}

// Direct e4m3 form: one page's K and V head slice, raw, each row's 16-byte chunks XOR-swizzled
// by row % 8 (the fragment reads then touch eight distinct bank groups). Rows at or past
// `valid_rows` (the request's keys end inside the page) are zero-filled instead of read, so
// whatever bytes a cache holds there (NaN patterns of an uninitialized pool included) never meet
// a zero probability in P.V (0 x NaN = NaN).
__device__ __forceinline__ void load_page_fp8_swizzled(const DecodeAttentionArgs& a, int head,
                                                       const PageRef& ref, char* stage,
                                                       int valid_rows) {
  if (ref.token_mask == 0) return;
  const int64_t elem_offset =
      (static_cast<int64_t>(ref.physical) * a.num_kv_heads + head) * (kPageSize * kHeadDim);
  const uint8_t* k = static_cast<const uint8_t*>(a.k) + elem_offset;
  const uint8_t* v = static_cast<const uint8_t*>(a.v) + elem_offset;
  constexpr int kChunks = kPageSize * kHeadDim / 16;
  static_assert(kChunks % kThreads == 0, "every thread issues the same number of copies");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c >> 3;
    const int dst = row * kHeadDim + (((c & 7) ^ (row & 7)) << 4);
    const bool valid = row < valid_rows;
    cp_async_16_or_zero(stage + dst, k + (valid ? c * 16 : 0), valid);
    cp_async_16_or_zero(stage + kPageSize * kHeadDim + dst, v + (valid ? c * 16 : 0), valid);
  }
}

// Direct e4m3 form: this thread's Q bytes for rows row_base + lane/4 and + 8 of a tile (32
// bytes of each: channels 32t .. 32t + 31, t = lane % 4); zero past the tile.
__device__ __forceinline__ void load_query_raw_fp8(const DecodeAttentionArgs& a,
                                                   const CtaContext& ctx, int group,
                                                   int tile_rows, uint4 (&raw)[2][2],
                                                   int row_base = 0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    const int row = row_base + (lane >> 2) + i2 * 8;
    raw[i2][0] = raw[i2][1] = make_uint4(0u, 0u, 0u, 0u);
    if (row < tile_rows) {
      const int r = ctx.first_row + row;
      const int token = r / group, qo_head = ctx.head * group + r % group;
      const int64_t offset =
          ((static_cast<int64_t>(ctx.request) * a.seqlen_q + token) * a.num_qo_heads + qo_head) *
              kHeadDim + (lane & 3) * 32;
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.q) + offset);
      raw[i2][0] = src[0];
      raw[i2][1] = src[1];
    }
  }
}

// Those bytes as Q A-fragments (f16x2) in the permuted QK^T channel order (see the file
// comment): chunk kd holds channels 32t + 4kd + {0, 1} (qf[kd][0..1]) and + {2, 3} (qf[kd][2..3]).
__device__ __forceinline__ void widen_query_fp8(const uint4 (&raw)[2][2],
                                                uint32_t (&qf)[kHeadDim / 16][4]) {
#pragma unroll
  for (int kd = 0; kd < kHeadDim / 16; ++kd) {
    const uint32_t w0 = word_of(raw[0], kd), w1 = word_of(raw[1], kd);
    qf[kd][0] = e4m3x2_lo_to_f16x2(w0);
    qf[kd][1] = e4m3x2_lo_to_f16x2(w1);
    qf[kd][2] = e4m3x2_hi_to_f16x2(w0);
    qf[kd][3] = e4m3x2_hi_to_f16x2(w1);
  }
}

// e4m3 raw page (K then V, dense rows of 128 bytes) -> padded bf16 page.
__device__ __forceinline__ void convert_fp8_page(const char* raw, __nv_bfloat16* dst) {
  constexpr int kChunksPerRow = kHeadDim / 16;
  for (int c = threadIdx.x; c < 2 * kPageSize * kChunksPerRow; c += kThreads) {
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 16;   // row spans K then V
    const uint4 in = *reinterpret_cast<const uint4*>(raw + c * 16);
    Bf16x8 out[2];
    e4m3x16_to_bf16(in, out);
    *reinterpret_cast<Bf16x8*>(dst + row * kStride + col) = out[0];
    *reinterpret_cast<Bf16x8*>(dst + row * kStride + col + 8) = out[1];
  }
}

// Stages the CTA's query rows into shared memory as bf16 (zero rows past the tile).
__device__ __forceinline__ void load_queries(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                             int group, int tile_rows, __nv_bfloat16* qs) {
  constexpr int kChunksPerRow = kHeadDim / 8;   // 8 output elements per step
  for (int c = threadIdx.x; c < kRowsPerCta * kChunksPerRow; c += kThreads) {
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    Bf16x8 vals;
    if (row < tile_rows) {
      const int r = ctx.first_row + row;
      const int token = r / group, qo_head = ctx.head * group + r % group;
      const int64_t offset =
          ((static_cast<int64_t>(ctx.request) * a.seqlen_q + token) * a.num_qo_heads + qo_head) *
              kHeadDim + col;
      if (!a.q_fp8) {
        vals = *reinterpret_cast<const Bf16x8*>(static_cast<const __nv_bfloat16*>(a.q) + offset);
      } else {
        const uint2 bits = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.q) + offset);
        const uint32_t words[2] = {bits.x, bits.y};
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const float2 lo = e4m3x2_to_float2(static_cast<uint16_t>(words[w] & 0xFFFFu));
          const float2 hi = e4m3x2_to_float2(static_cast<uint16_t>(words[w] >> 16));
          vals.v[w * 2] = __floats2bfloat162_rn(lo.x, lo.y);
          vals.v[w * 2 + 1] = __floats2bfloat162_rn(hi.x, hi.y);
        }
      }
    } else {
      const __nv_bfloat162 zero = __floats2bfloat162_rn(0.f, 0.f);
      vals.v[0] = vals.v[1] = vals.v[2] = vals.v[3] = zero;
    }
    *reinterpret_cast<Bf16x8*>(qs + row * kStride + col) = vals;
  }
}

// A sparse tile's q2k candidates: each of its tokens' slots first_slot .. + num_slots - 1 (its
// chunk's slots, or every slot with page chunks), keeping blocks in [first_block, end_block).
struct SparseCandidates {
  int first_slot, num_slots, first_block, end_block, count;
};

__device__ __forceinline__ SparseCandidates sparse_candidates(const DecodeAttentionArgs& a,
                                                              const CtaContext& ctx) {
  SparseCandidates sc;
  sc.first_slot = ctx.slot_chunks ? ctx.chunk_begin : 0;
  sc.num_slots = ctx.slot_chunks ? ctx.chunk_end - ctx.chunk_begin
                                 : (ctx.chunk_end > ctx.chunk_begin ? a.topk : 0);
  sc.first_block = ctx.slot_chunks ? 0 : ctx.chunk_begin;
  sc.end_block = ctx.slot_chunks ? ctx.num_blocks : min(ctx.chunk_end, ctx.num_blocks);
  sc.count = sc.num_slots > 0 ? ctx.num_tokens * sc.num_slots : 0;
  return sc;
}

// Candidate c (token-major) of a tile: the block its token selects in that slot, or -1 outside
// the tile's block range.
__device__ __forceinline__ int candidate_block(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                               const SparseCandidates& sc, int c) {
  const int token = ctx.first_token + c / sc.num_slots, slot = sc.first_slot + c % sc.num_slots;
  const int64_t row = static_cast<int64_t>(ctx.request) * a.seqlen_q + token;
  const int64_t total_q = static_cast<int64_t>(a.batch) * a.seqlen_q;
  const int id = __ldg(a.q2k_indices + (ctx.head * total_q + row) * a.topk + slot);
  return (id >= sc.first_block && id < sc.end_block) ? id : -1;
}

// The barrier of the kNumThreads threads (threads 0 .. kNumThreads - 1) that build page lists
// together: the whole CTA's (__syncthreads), or named barrier kBarrierId over just them.
template <int kNumThreads, int kBarrierId>
__device__ __forceinline__ void list_barrier() {
  if constexpr (kBarrierId == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"n"(kBarrierId), "n"(kNumThreads) : "memory");
  }
}

// One round of an order-preserving append over threads 0 .. kNumThreads - 1: each calls it
// with whether it appends an entry; returns that entry's position (thread order after the
// *total entries of the earlier rounds) and advances *total. warp_counts: one int per warp.
template <int kNumThreads, int kBarrierId = 0>
__device__ __forceinline__ int append_position(bool append, int* warp_counts, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xFFFFFFFFu, append);
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  list_barrier<kNumThreads, kBarrierId>();
  int offset = *total + __popc(ballot & ((1u << lane) - 1u));
  for (int w = 0; w < warp; ++w) offset += warp_counts[w];
  list_barrier<kNumThreads, kBarrierId>();   // every thread has read *total and the counts
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int w = 0; w < kNumThreads / 32; ++w) sum += warp_counts[w];
    *total += sum;
  }
  list_barrier<kNumThreads, kBarrierId>();
  return offset;
}

// Whether candidate c (block id >= 0) of a tile whose candidates are cand[first .. first + count)
// is its block's first occurrence there and the block's page is in the pool; if so, physical
// is that page and mask the tokens that selected the block (bit first_token + the token of each
// candidate i holding it: (i - first) / num_slots token-major, (i - first) % num_tokens
// slot-major).
template <bool kSlotMajor = false>
__device__ __forceinline__ bool first_of_block(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                               const int* cand, int first, int count,
                                               int num_slots, int c, int id, uint32_t& mask,
                                               int& physical) {
  for (int other = first; other < first + count; ++other) {
    if (cand[other] == id) {
      if (other < c) return false;
      const int token = kSlotMajor ? (other - first) % ctx.num_tokens : (other - first) / num_slots;
      mask |= 1u << (ctx.first_token + token);
    }
  }
  physical = __ldg(a.page_table + static_cast<int64_t>(ctx.request) * a.page_table_width + id);
  return physical >= 0 && physical < a.num_pages;
}

// Sparse: the distinct valid blocks the tile's tokens select in the chunk (its q2k slots, or with
// page chunks every slot and the blocks in its page range), in (token, slot) order of first
// appearance, each with the mask of tokens that selected it (bit t = token t of the request).
// Returns the page count.
// kNumThreads: the CTA's threads (all of them call it; warp_counts holds one int per warp).
template <int kNumThreads = kThreads>
__device__ int build_sparse_page_list(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                      int* cand, int* list_phys, int* list_logical,
                                      uint32_t* list_mask, int* warp_counts, int* total) {
  const SparseCandidates sc = sparse_candidates(a, ctx);
  const int num_cand = sc.count, num_slots = sc.num_slots;
  for (int c = threadIdx.x; c < num_cand; c += kNumThreads) {
    cand[c] = candidate_block(a, ctx, sc, c);
  }
  if (threadIdx.x == 0) *total = 0;
  __syncthreads();
  for (int base = 0; base < num_cand; base += kNumThreads) {
    const int c = base + threadIdx.x;
    int id = -1, physical = -1;
    uint32_t mask = 0;
    bool leader = false;
    if (c < num_cand && (id = cand[c]) >= 0) {
      leader = first_of_block(a, ctx, cand, 0, num_cand, num_slots, c, id, mask, physical);
    }
    const int offset = append_position<kNumThreads>(leader, warp_counts, total);
    if (leader) {
      list_phys[offset] = physical;
      list_logical[offset] = id;
      list_mask[offset] = mask;
    }
  }
  __syncthreads();
  return *total;
}

// ---- Direct e4m3 form, per-warp pieces ------------------------------------------------
// A warp's slice of one page: keys key_base .. key_base + 15 (two n8-tiles), rows lane / 4 and
// lane / 4 + 8 of the <= 16-row tile. Fragment layouts as in the file comment.

// S = Q K^T of two pages at once (four independent MMA chains). (The e4m3 mma.sync
// m16n8k32 would skip the widening, but sm_90 has no FP8 mma.sync: ptxas expands it into the
// same F2FP unpacks and f16 HMMAs, plus adds.)
__device__ __forceinline__ void direct_qk_two_pages(const char* const (&k8)[2], int key_base,
                                                    int lane,
                                                    const uint32_t (&qf)[kHeadDim / 16][4],
                                                    float (&s)[2][2][4]) {
#pragma unroll
  for (int pg = 0; pg < 2; ++pg)
#pragma unroll
    for (int n = 0; n < 2; ++n) s[pg][n][0] = s[pg][n][1] = s[pg][n][2] = s[pg][n][3] = 0.f;
  uint4 k_raw[2][2][2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int key = key_base + n * 8 + (lane >> 2);
#pragma unroll
    for (int pg = 0; pg < 2; ++pg) {
      k_raw[pg][n][0] = swizzled_chunk(k8[pg], key, (lane & 3) * 2);
      k_raw[pg][n][1] = swizzled_chunk(k8[pg], key, (lane & 3) * 2 + 1);
    }
  }
#pragma unroll
  for (int kd = 0; kd < kHeadDim / 16; ++kd) {
#pragma unroll
    for (int pg = 0; pg < 2; ++pg) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const uint32_t w = word_of(k_raw[pg][n], kd);
        mma_f16(s[pg][n], qf[kd], widen_lo<kLabKByAlu>(w), widen_hi<kLabKByAlu>(w));
      }
    }
  }
}

// The A fragment of P.V over 16 keys (S accumulator n-tiles s[0], s[1]: keys 2t, 2t + 1 and
// 2t + 8, 2t + 9 of rows g and g + 8): each probability rounded to e4m3 (exact in f16) and
// scaled by its row's factor in f16 (sc_g: row g, sc_g8: row g + 8).
__device__ __forceinline__ void p_fragment_e4m3(const float (&s)[2][4], __half2 sc_g,
                                                __half2 sc_g8, uint32_t (&pa)[4]) {
  auto scaled = [](uint32_t p2, __half2 b) {
    const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&p2), b);
    return *reinterpret_cast<const uint32_t*>(&r);
  };
  pa[0] = scaled(round_e4m3x2_to_f16x2(s[0][0], s[0][1]), sc_g);
  pa[1] = scaled(round_e4m3x2_to_f16x2(s[0][2], s[0][3]), sc_g8);
  pa[2] = scaled(round_e4m3x2_to_f16x2(s[1][0], s[1][1]), sc_g);
  pa[3] = scaled(round_e4m3x2_to_f16x2(s[1][2], s[1][3]), sc_g8);
}

// O += (scale P) V over one page's 16 keys of this warp: P = s (probabilities against the page
// max) rounded to e4m3, times the per-row scale in f16, as the A fragment; V from the raw page.
// kZeroTail: V rows at or past valid_rows read as zeros (a TMA-copied page holds whatever the
// pool has past the request's keys, and 0 x NaN = NaN).
// With the lab's kLabVByAlu, V is widened by integer ops as V x 2^-8: acc holds O x 2^-8.
template <bool kZeroTail = false>
__device__ __forceinline__ void direct_pv_page(const char* v8, int key_base, int lane,
                                               const float (&s)[2][4], float scale_g,
                                               float scale_g8, float (&acc)[16][4],
                                               int valid_rows = kPageSize) {
  uint32_t pa[4];
  p_fragment_e4m3(s, __float2half2_rn(scale_g), __float2half2_rn(scale_g8), pa);
  const int key0 = key_base + 2 * (lane & 3);
  uint4 v_lo[2] = {swizzled_chunk(v8, key0, lane >> 2), swizzled_chunk(v8, key0 + 8, lane >> 2)};
  uint4 v_hi[2] = {swizzled_chunk(v8, key0 + 1, lane >> 2),
                   swizzled_chunk(v8, key0 + 9, lane >> 2)};
  if constexpr (kZeroTail) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    if (key0 >= valid_rows) v_lo[0] = zero;
    if (key0 + 8 >= valid_rows) v_lo[1] = zero;
    if (key0 + 1 >= valid_rows) v_hi[0] = zero;
    if (key0 + 9 >= valid_rows) v_hi[1] = zero;
  }
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const uint32_t k01_a = __byte_perm(word_of(v_lo, m), word_of(v_hi, m), 0x5140);
    const uint32_t k01_b = __byte_perm(word_of(v_lo, m), word_of(v_hi, m), 0x7362);
    const uint32_t k89_a = __byte_perm(word_of(v_lo, m + 4), word_of(v_hi, m + 4), 0x5140);
    const uint32_t k89_b = __byte_perm(word_of(v_lo, m + 4), word_of(v_hi, m + 4), 0x7362);
    const uint32_t b0[4] = {widen_lo<kLabVByAlu>(k01_a), widen_hi<kLabVByAlu>(k01_a),
                            widen_lo<kLabVByAlu>(k01_b), widen_hi<kLabVByAlu>(k01_b)};
    const uint32_t b1[4] = {widen_lo<kLabVByAlu>(k89_a), widen_hi<kLabVByAlu>(k89_a),
                            widen_lo<kLabVByAlu>(k89_b), widen_hi<kLabVByAlu>(k89_b)};
#pragma unroll
    for (int q = 0; q < 4; ++q) mma_f16(acc[4 * m + q], pa, b0[q], b1[q]);
  }
}

// A quad's four shares of its two rows' sums (rows lane / 4 and lane / 4 + 8), added.
__device__ __forceinline__ void add_quad_sums(float (&row_sum)[2]) {
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    row_sum[i2] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[i2], 1);
    row_sum[i2] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[i2], 2);
  }
}

// O's rows times alpha: rows lane / 4 (alpha[0]) and lane / 4 + 8 (alpha[1]) of 16 n8-tiles.
__device__ __forceinline__ void scale_rows(float (&acc)[16][4], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    acc[n][0] *= alpha[0];
    acc[n][1] *= alpha[0];
    acc[n][2] *= alpha[1];
    acc[n][3] *= alpha[1];
  }
}

// Page `idx` of the CTA's list, or a skipped page past its end.
template <bool kSettle = true>
__device__ __forceinline__ PageRef page_or_none(const DecodeAttentionArgs& a,
                                                const CtaContext& ctx, int idx, int num_pages,
                                                const int* list_phys, const int* list_logical,
                                                const uint32_t* list_mask) {
  if (idx < num_pages) {
    return resolve_page<kSettle>(a, ctx, idx, list_phys, list_logical, list_mask);
  }
  PageRef none;
  none.physical = 0;
  none.logical = 0;
  none.token_mask = 0;
  return none;
}

// Writes one finished row of the warpgroup form (query token, q head): channel pairs
// 8n + 2 (lane % 4) + {0, 1} from pair(n), n < 16, as the fp32 partial of slot `slot` (>= 0) or
// as the bf16 output (slot -1), and the LSE from the quad's first lane. (The older forms inline
// the same stores; they stay as they are until they can be re-run on a GPU.)
template <typename PairFn>
__device__ __forceinline__ void store_row(const DecodeAttentionArgs& a, int64_t slot,
                                          int request, int token, int qo_head, int lane,
                                          float lse, PairFn pair) {
  if (slot >= 0) {
    const int64_t idx = (slot * a.seqlen_q + token) * a.num_qo_heads + qo_head;
    float* o = a.o_partial + idx * kHeadDim + (lane & 3) * 2;
#pragma unroll
    for (int n = 0; n < 16; ++n) *reinterpret_cast<float2*>(o + n * 8) = pair(n);
    if ((lane & 3) == 0) a.lse_partial[idx] = lse;
  } else {
    const int64_t idx =
        (static_cast<int64_t>(request) * a.seqlen_q + token) * a.num_qo_heads + qo_head;
    __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.out) + idx * kHeadDim + (lane & 3) * 2;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const float2 v = pair(n);
      *reinterpret_cast<__nv_bfloat162*>(o + n * 8) = __floats2bfloat162_rn(v.x, v.y);
    }
    if ((lane & 3) == 0 && a.lse != nullptr) a.lse[idx] = lse;
  }
}

// ---- Warpgroup form (tiles of more than 16 rows: multi-token prediction) ------------------
// One CTA of two warpgroups per work item; warpgroup w holds rows 64w .. 64w + 63 of the qo
// tile. Per page: S = Q K^T with wgmma m64n128k16 from shared memory, masking and the page's
// softmax in registers, then O += P V with P as the register A operand and V as a transposed
// (MN-major) shared-memory B operand. Every operand wgmma reads is 16-bit: bf16, or f16
// widened (exactly) from e4m3. An e4m3 wgmma would read the raw pages, but its accumulator
// keeps ~13 mantissa bits: S = Q K^T then moves by ~1e-4 of its magnitude, enough to flip
// P's e4m3 rounding (the reference computes S in fp32) in up to a third of the output rows;
// f16 wgmma accumulates in fp32. Operands sit in shared memory in the 128-byte swizzled layout wgmma
// reads: rows of 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8), one 128-byte column
// block after the other (16-bit rows of 256 bytes are two blocks). Loads are cp.async into a
// ring of stages (rows past the request's end are zero-filled, so stale NaN bytes never meet
// P = 0); an e4m3 stage is widened once per page into an f16 K and V copy. e4m3: P is rounded
// to e4m3 against the page's max and scaled by exp(page max - running max) in f16, as the
// reference rounds it (the direct form does the same), so the f16 P.V reproduces an e4m3 P.V
// up to that f16 scaling. bf16 P is rounded to bf16 (the reference keeps it unrounded; the
// difference is within the bf16 contract). Fully visible pages of every tile token skip the
// mask.
// Lab hooks (benchmarks/lab/decode_pp_timeline.cu builds this file with them; they compile to
// nothing otherwise): MSA_LAB_TIMELINE records clock64 stamps of CTA (0, 0)'s first kLabTurns
// pages of the ping-pong form per actor (0: the K stream, 1: the V stream, 2 / 3: the
// consumers); MSA_LAB_NO_LOADS makes its producer zero-fill every page instead of reading it
// (the pipeline without DRAM).
#ifdef MSA_LAB_TIMELINE
constexpr int kLabTurns = 64, kLabMarks = 6;
__device__ long long lab_timeline[4][kLabTurns][kLabMarks];
#define MSA_LAB_MARK(leader, actor, turn, mark)                                           \
  do {                                                                                    \
    if ((leader) && blockIdx.x == 0 && blockIdx.y == 0 && (turn) < kLabTurns) {          \
      lab_timeline[actor][turn][mark] = clock64();                                        \
    }                                                                                     \
  } while (0)
#else
#define MSA_LAB_MARK(leader, actor, turn, mark) \
  do {                                          \
  } while (0)
#endif

// Log-sum-exp combine of one (query row, q head)'s partials, slots slot_of(0 .. count - 1), by
// kThreadsPerRow threads: each its 128 / kThreadsPerRow dims of O, the first one the LSE.
// kUnrolled unrolls the loops over the partials (the persistent merge, as timed); the split-KV
// merge keeps the compiler's choice: with the unrolling its B 1-4 calls of many partials ran
// 1.5-7 us slower (bench_decode_production low-latency suite, a387645).
template <int kThreadsPerRow, bool kUnrolled, typename SlotOf>
__device__ __forceinline__ void merge_row(const DecodeAttentionArgs& a, int64_t q_row, int token,
                                          int qo_head, int count, SlotOf slot_of) {
  constexpr int kDims = kHeadDim / kThreadsPerRow;
  static_assert(kDims % 4 == 0, "whole float4s of O per thread");
  const int part = static_cast<int>(threadIdx.x % kThreadsPerRow);
  auto lse_index = [&](int64_t p) { return (p * a.seqlen_q + token) * a.num_qo_heads + qo_head; };
  float max_lse = -INFINITY;
  bool nan_partial = false;
  auto take_lse = [&](int i) {
    const float lse = a.lse_partial[lse_index(slot_of(i))];
    max_lse = fmaxf(max_lse, lse);
    nan_partial |= isnan(lse);
  };
  if constexpr (kUnrolled) {
#pragma unroll 4
    for (int i = 0; i < count; ++i) take_lse(i);
  } else {
    for (int i = 0; i < count; ++i) take_lse(i);
  }
  // fmaxf drops NaN: a NaN partial (non-finite data) must make the row NaN, not empty.
  if (nan_partial) max_lse = NAN;
  float acc[kDims];
#pragma unroll
  for (int d = 0; d < kDims; ++d) acc[d] = 0.f;
  float weight_sum = 0.f;
  auto add_partial = [&](int i) {
    const int64_t p = slot_of(i);
    const float lse = a.lse_partial[lse_index(p)];
    if (lse == -INFINITY) return;
    const float w = __expf(lse - max_lse);
    const float4* o = reinterpret_cast<const float4*>(a.o_partial + lse_index(p) * kHeadDim +
                                                      part * kDims);
#pragma unroll
    for (int v = 0; v < kDims / 4; ++v) {
      const float4 x = o[v];
      acc[4 * v] += w * x.x;
      acc[4 * v + 1] += w * x.y;
      acc[4 * v + 2] += w * x.z;
      acc[4 * v + 3] += w * x.w;
    }
    weight_sum += w;
  };
  if (max_lse != -INFINITY) {
    if constexpr (kUnrolled) {
#pragma unroll 2
      for (int i = 0; i < count; ++i) add_partial(i);
    } else {
      for (int i = 0; i < count; ++i) add_partial(i);
    }
  }
  const float inv = weight_sum != 0.f ? 1.f / weight_sum : 0.f;
  const int64_t out_index = q_row * a.num_qo_heads + qo_head;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out) + out_index * kHeadDim + part * kDims;
#pragma unroll
  for (int d = 0; d < kDims; d += 2) {
    *reinterpret_cast<__nv_bfloat162*>(out + d) =
        __floats2bfloat162_rn(acc[d] * inv, acc[d + 1] * inv);
  }
  if (part == 0 && a.lse != nullptr) {
    a.lse[out_index] = weight_sum != 0.f ? max_lse + logf(weight_sum) : -INFINITY;
  }
}

// The persistent form's partition (decode_attention_persistent_kernel; its merge rebuilds it
// from the table the kernel writes): the (request, KV head, qo tile) page sequences end to end,
// request-major, cut into `ctas` ranges of equal page counts.
struct Partition {
  const int64_t* pages_before;   // [batch + 1]: sum of p(r') over r' < r (one sequence's pages)
  const int* lengths;            // [batch]: seqused_k clamped to >= 0 (the kernel's table only)
  int batch;
  int tiles;                     // qo tiles of a KV head
  int seqs_per_request;          // KV heads x tiles
  int64_t total;                 // pages of all sequences
  int ctas;                      // CTAs with a range: min(grid, total)

  __device__ __forceinline__ Partition(const DecodeAttentionArgs& a, const int64_t* pages_before_,
                                       const int* lengths_, int grid)
      : pages_before(pages_before_), lengths(lengths_), batch(a.batch) {
    const int group = a.num_qo_heads / a.num_kv_heads;
    tiles = (a.seqlen_q * group + a.qo_tile_rows - 1) / a.qo_tile_rows;
    seqs_per_request = a.num_kv_heads * tiles;
    total = seqs_per_request * pages_before[a.batch];
    ctas = static_cast<int>(min(static_cast<int64_t>(grid), total));
  }
  // CTA c's range starts at page cut(c).
  __device__ __forceinline__ int64_t cut(int cta) const { return total * cta / ctas; }
  // The sequence holding page g: its request, its index within the request (KV head x tiles +
  // qo tile) and its pages (p(request)); returns its first page.
  __device__ __forceinline__ int64_t locate(int64_t g, int& request, int& seq, int& pages) const {
    int lo = 0, hi = batch - 1;                 // the last request starting at or before g
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (seqs_per_request * pages_before[mid] <= g) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    request = lo;
    pages = static_cast<int>(pages_before[lo + 1] - pages_before[lo]);
    const int64_t base = first_page(lo, 0, pages);
    seq = static_cast<int>((g - base) / pages);
    return base + static_cast<int64_t>(seq) * pages;
  }
  // The first page of sequence `seq` of request `request` (its sequences have `pages` pages).
  __device__ __forceinline__ int64_t first_page(int request, int seq, int pages) const {
    return seqs_per_request * pages_before[request] + static_cast<int64_t>(seq) * pages;
  }
  // The CTA whose range holds page g: the last c with cut(c) <= g.
  __device__ __forceinline__ int cta_of(int64_t g) const {
    return static_cast<int>(((g + 1) * ctas - 1) / total);
  }
  // The pieces of a sequence of `pages` pages from page `start`: CTAs first .. last, and the
  // partial slot of piece i (as the kernel's piece_slot writes it): 2 c for the piece that opens
  // CTA c's range, 2 first + 1 for CTA first's when its range opens before the sequence.
  struct Span {
    int first, last;
    bool opens_before;
    __device__ __forceinline__ int pieces() const { return last - first + 1; }
    __device__ __forceinline__ int64_t slot(int i) const {
      return 2 * static_cast<int64_t>(first + i) + (i == 0 && opens_before ? 1 : 0);
    }
  };
  __device__ __forceinline__ Span span(int64_t start, int64_t pages) const {
    const int first = cta_of(start);
    return Span{first, cta_of(start + pages - 1), cut(first) < start};
  }
};

namespace wg {

constexpr int kRowBytes = 128;                 // one swizzled row
constexpr int kWarpgroupRows = 64;

template <bool kFp8>
struct Shape {
  // Q and the K / V pages wgmma reads are 16-bit (bf16, or f16 widened from e4m3): rows of
  // 256 bytes as two 128-byte column blocks.
  static constexpr int kQBlockBytes = kWarpgroupRows * kRowBytes;
  static constexpr int kQBytes = 2 * kQBlockBytes;           // one warpgroup's Q rows
  static constexpr int kPageBlockBytes = kPageSize * kRowBytes;
  static constexpr int kWideBytes = 2 * kPageBlockBytes;     // a 16-bit K or V page
  static constexpr int kKBytes = kFp8 ? kPageBlockBytes : kWideBytes;   // K as loaded
  static constexpr int kStages = kFp8 ? 3 : 2;
  static constexpr int kStageBytes = 2 * kKBytes;            // K then V
  static constexpr int kWidenedBytes = kFp8 ? 2 * kWideBytes : 0;   // e4m3 K, V widened to f16
  static constexpr int kStagesOffset = 2 * kQBytes;
  static constexpr int kWidenedOffset = kStagesOffset + kStages * kStageBytes;
  static constexpr int kListOffset = kWidenedOffset + kWidenedBytes;
  static constexpr int kBytes = kListOffset + kListBytes + kCountsSlotBytes;
  static constexpr int kAlloc = kBytes + 1024;               // the base is aligned to 1024 bytes
};
static_assert(Shape<false>::kAlloc <= 227 * 1024, "warpgroup form (bf16): shared memory");
static_assert(Shape<true>::kAlloc <= 227 * 1024, "warpgroup form (e4m3): shared memory");

// Pages stream through a ring of kStages stages of whole pages (K then V), one cp.async group
// per page, beside Q in shared memory: bf16 two stages (page i + 1 loads while page i
// computes), e4m3 three stages of e4m3 pages plus the f16 copy of the page being computed.

// The paged K and V caches as TMA tensor maps (e4m3: [num_pages x num_kv_heads x 128 rows, 128
// bytes], a page's head slice one box of 128 rows) for the e4m3 P.V form: K 128-byte swizzled,
// as the Q K^T wgmma reads it; V unswizzled, read row by row by the transposes. Kernel
// parameters (__grid_constant__), written by the launcher.
struct PagedKvMaps {
  alignas(64) uint64_t k[16];
  alignas(64) uint64_t v[16];
};

// wgmma is sm_90a only: other archs compile just the kernel's entry point (a trap).
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kAtomBytes = 8 * kRowBytes;      // the 8-row swizzle atom (stride byte offset)

__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

// Matrix descriptor of a 128-byte swizzled operand: start address, leading byte offset (the
// next 64-element block along MN for MN-major operands; unused for K-major ones), stride byte
// offset (the next 8-row atom), swizzle mode 128B.
__device__ __forceinline__ uint64_t descriptor(const void* start, uint32_t leading_bytes) {
  return static_cast<uint64_t>((smem_addr(start) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(kAtomBytes >> 4) << 32) | (1ull << 62);
}

// A 16-bit V tile as P V's transposed (MN-major) B operand: its second 64-channel column block
// one block of kPageSize rows further.
__device__ __forceinline__ uint64_t v_descriptor(const void* tile) {
  return descriptor(tile, kPageSize * kRowBytes);
}

__device__ __forceinline__ void fence_operands() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit_and_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// The 64 accumulator registers of an m64n128 fp32 tile: asm text and operands (d[0] .. d[63]
// are %0 .. %63).
#define MSA_WGMMA_D_TEXT \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"   \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45," \
  "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define MSA_WGMMA_D_OPERANDS(d)                                                               \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),          \
      "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),          \
      "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),          \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),          \
      "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),          \
      "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),          \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),          \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),          \
      "+f"(d[62]), "+f"(d[63])

// wgmma m64n128 wrappers (one warpgroup): D (64 fp32 per thread, the m64nNk16 accumulator
// layout) += A * B. QK: A (Q) and B (K) from shared memory, both K-major 128-byte swizzled. PV:
// A (P) from registers (the m64k16 fragment layout), B (V) from shared memory, MN-major
// (transposed) 128-byte swizzled. scale_d = 0 overwrites D instead of accumulating.
__device__ __forceinline__ void wgmma_qk_bf16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                          int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      MSA_WGMMA_D_TEXT ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : MSA_WGMMA_D_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_qk_f16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                         int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      MSA_WGMMA_D_TEXT ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : MSA_WGMMA_D_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// e4m3 x e4m3, k32: both operands K-major from shared memory (FP8 wgmma takes no other
// majorness), one 128-byte row per query row / key.
__device__ __forceinline__ void wgmma_qk_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                          int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      MSA_WGMMA_D_TEXT ", %64, %65, p, 1, 1;\n}\n"
      : MSA_WGMMA_D_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_pv_bf16(float (&d)[64], const uint32_t (&a)[4],
                                          uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      MSA_WGMMA_D_TEXT ", {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : MSA_WGMMA_D_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_pv_f16(float (&d)[64], const uint32_t (&a)[4],
                                          uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      MSA_WGMMA_D_TEXT ", {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : MSA_WGMMA_D_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}


// e4m3 x e4m3, k32: A (P) from registers (the m64k32 8-bit fragment layout), B (V^T) K-major
// from shared memory, one 128-byte row of key positions per channel.
__device__ __forceinline__ void wgmma_pv_e4m3(float (&d)[64], const uint32_t (&a)[4],
                                          uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      MSA_WGMMA_D_TEXT ", {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
      : MSA_WGMMA_D_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}


// 16 e4m3 values (channels 16 c .. 16 c + 15 of `row`) widened to f16 (exact) into a 16-bit
// swizzled tile of two column blocks (`block_bytes` apart): its chunks 2 c and 2 c + 1. The
// chunk stored first alternates with c / 4, so the eight threads of one row (chunks 0 .. 7)
// store to eight distinct 16-byte bank groups at a time.
__device__ __forceinline__ void store_widened(const uint4& raw, int row, int c, char* tile,
                                              int block_bytes) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  const uint4 lo = make_uint4(e4m3x2_lo_to_f16x2(w[0]), e4m3x2_hi_to_f16x2(w[0]),
                             e4m3x2_lo_to_f16x2(w[1]), e4m3x2_hi_to_f16x2(w[1]));
  const uint4 hi = make_uint4(e4m3x2_lo_to_f16x2(w[2]), e4m3x2_hi_to_f16x2(w[2]),
                             e4m3x2_lo_to_f16x2(w[3]), e4m3x2_hi_to_f16x2(w[3]));
  const bool hi_first = (c >> 2) & 1;
  char* block = tile + (c / 4) * block_bytes;    // f16 chunks 2 c, 2 c + 1: in-block 2 (c % 4) + h
  *reinterpret_cast<uint4*>(block + swizzled(row, 2 * (c % 4) + hi_first)) = hi_first ? hi : lo;
  *reinterpret_cast<uint4*>(block + swizzled(row, 2 * (c % 4) + !hi_first)) = hi_first ? lo : hi;
}

// 16-byte chunk `chunk` of tile row `row` of q as stored (elements of element_bytes), zero past
// tile_rows.
__device__ __forceinline__ uint4 query_chunk(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                             int group, int tile_rows, int row, int chunk,
                                             int element_bytes) {
  if (row >= tile_rows) return make_uint4(0u, 0u, 0u, 0u);
  const int r = ctx.first_row + row;
  const int token = r / group, qo_head = ctx.head * group + r % group;
  const int64_t bytes =
      ((static_cast<int64_t>(ctx.request) * a.seqlen_q + token) * a.num_qo_heads + qo_head) *
      kHeadDim * element_bytes;
  return *reinterpret_cast<const uint4*>(static_cast<const char*>(a.q) + bytes + chunk * 16);
}

// Q rows of the tile (zero past tile_rows) into each warpgroup's swizzled 16-bit block (e4m3 Q
// widened to f16).
template <bool kFp8, int kNumThreads = kThreads>
__device__ __forceinline__ void load_queries(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                             int group, int tile_rows, char* qs,
                                             int thread = threadIdx.x) {
  using S = Shape<kFp8>;
  constexpr int kChunksPerRow = kFp8 ? 8 : 16;   // 16-byte chunks of a row as stored in q
  for (int c = thread; c < kRowsPerCta * kChunksPerRow; c += kNumThreads) {
    const int row = c / kChunksPerRow, chunk = c % kChunksPerRow;
    const uint4 v = query_chunk(a, ctx, group, tile_rows, row, chunk, kFp8 ? 1 : 2);
    const int local = row % kWarpgroupRows;
    char* q_rows = qs + (row / kWarpgroupRows) * S::kQBytes;
    if constexpr (kFp8) {
      store_widened(v, local, chunk, q_rows, S::kQBlockBytes);
    } else {
      *reinterpret_cast<uint4*>(q_rows + (chunk / 8) * S::kQBlockBytes +
                                swizzled(local, chunk % 8)) = v;
    }
  }
}

// One page's K and V head slices into a stage, swizzled (bf16: two column blocks, e4m3: one);
// rows >= valid_rows zero-filled.
template <bool kFp8>
__device__ __forceinline__ void load_page(const DecodeAttentionArgs& a, int head,
                                          const PageRef& ref, char* stage, int valid_rows) {
  using S = Shape<kFp8>;
  if (ref.token_mask == 0) return;
  constexpr int kChunksPerRow = kFp8 ? 8 : 16;
  constexpr int kChunks = kPageSize * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "every thread issues the same number of copies");
  const int64_t bytes = (static_cast<int64_t>(ref.physical) * a.num_kv_heads + head) *
                        (kPageSize * kHeadDim) * (kFp8 ? 1 : 2);
  const char* k = static_cast<const char*>(a.k) + bytes;
  const char* v = static_cast<const char*>(a.v) + bytes;
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c / kChunksPerRow, chunk = c % kChunksPerRow;
    const int dst = (chunk / 8) * S::kPageBlockBytes + swizzled(row, chunk % 8);
    const bool valid = row < valid_rows;
    const int64_t src = valid ? static_cast<int64_t>(c) * 16 : 0;
    cp_async_16_or_zero(stage + dst, k + src, valid);
    cp_async_16_or_zero(stage + S::kKBytes + dst, v + src, valid);
  }
}

// e4m3 K and V of a stage (swizzled, one column block each) -> f16 K then V (swizzled, two
// blocks each), exact.
__device__ __forceinline__ void widen_page(const char* stage, char* widened) {
  using S = Shape<true>;
  constexpr int kItems = 2 * kPageSize * 8;      // 16-byte e4m3 chunks of K and V
  static_assert(kItems % kThreads == 0, "every thread widens the same number of chunks");
#pragma unroll 4   // fully unrolled, the hoisted loads cost ~40 more registers
  for (int i = 0; i < kItems / kThreads; ++i) {
    const int item = threadIdx.x + i * kThreads;
    const int tensor = item / (kPageSize * 8), row = (item / 8) % kPageSize, chunk = item % 8;
    const uint4 raw =
        *reinterpret_cast<const uint4*>(stage + tensor * S::kKBytes + swizzled(row, chunk));
    store_widened(raw, row, chunk, widened + tensor * S::kWideBytes, S::kPageBlockBytes);
  }
}

__device__ __forceinline__ uint32_t pack_f16_scaled_e4m3(float lo, float hi, __half2 scale) {
  const uint32_t p = round_e4m3x2_to_f16x2(lo, hi);
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&p), scale);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The partial slot of a split-KV work item, merge_indptr[request] + chunk; -1 where the plan
// writes O directly, kCorruptSlot (nothing may be written) for a slot outside the workspaces.
constexpr int64_t kCorruptSlot = -2;
__device__ __forceinline__ int64_t chunk_slot(const DecodeAttentionArgs& a, int request,
                                              int chunk) {
  if (!a.split_kv) return -1;
  const int64_t slot = static_cast<int64_t>(__ldg(a.merge_indptr + request)) + chunk;
  return slot >= 0 && slot < a.num_partial_slots ? slot : kCorruptSlot;
}

// Per-thread row state: rows lane / 4 and lane / 4 + 8 of the warp's 16 rows.
struct Rows {
  int token[2];
  int last_key[2];    // the row's last visible key (-1: a padding row)
  float max[2];       // reference max of the raw scores (page_probabilities; -inf before any key)
  float sum[2];       // this thread's share of the running softmax sum
};

// A warpgroup's view of its qo tile: this thread's two rows (`group_row`: the warpgroup's first
// row in the tile), the tokens of the tile and the last key every one of them sees (pages
// past it need the mask), and the finalize step.
struct TileView {
  int group, tile_rows;
  uint32_t tile_tokens;
  int shared_last_key;

  __device__ __forceinline__ TileView(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                      int group_, int tile_rows_)
      : group(group_), tile_rows(tile_rows_) {
    const int last_token = ctx.first_token + ctx.num_tokens - 1;
    tile_tokens = (last_token >= 31 ? 0xFFFFFFFFu : ((1u << (last_token + 1)) - 1u)) &
                  ~((1u << ctx.first_token) - 1u);
    shared_last_key = min(ctx.seqlen_k - 1, ctx.first_token + ctx.seqlen_k - a.seqlen_q);
  }

  // Row `i2` (0, 1) of this thread in the tile.
  __device__ __forceinline__ int row(int group_row, int i2) const {
    const int lane = threadIdx.x & 31, warp_in_group = (threadIdx.x % 128) / 32;
    return group_row + warp_in_group * 16 + (lane >> 2) + 8 * i2;
  }

  __device__ __forceinline__ Rows rows(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                       int group_row) const {
    Rows rows;
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      const int r = row(group_row, i2);
      rows.token[i2] = min((ctx.first_row + r) / group, 31);
      rows.last_key[i2] =
          r < tile_rows ? min(ctx.seqlen_k - 1, rows.token[i2] + ctx.seqlen_k - a.seqlen_q)
                        : -1;
      rows.max[i2] = -INFINITY;
      rows.sum[i2] = 0.f;
    }
    return rows;
  }

  // Every token of the tile sees every key of the page: the page skips the mask.
  __device__ __forceinline__ bool fully_visible(const PageRef& page) const {
    return (page.token_mask & tile_tokens) == tile_tokens &&
           page.logical * kPageSize + kPageSize - 1 <= shared_last_key;
  }

  // Normalized O and LSE (natural log) of this thread's rows into out (slot -1) or partial slot
  // `slot`; empty rows give O = 0, LSE = -inf.
  __device__ __forceinline__ void finalize(const DecodeAttentionArgs& a, const CtaContext& ctx,
                                           int64_t slot, int group_row, const Rows& rows,
                                           float scale_log2, const float (&o)[64]) const {
    if (slot == kCorruptSlot) return;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      float sum = rows.sum[i2];
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
      const int r_tile = row(group_row, i2);
      if (r_tile >= tile_rows) continue;
      const int r = ctx.first_row + r_tile;
      const int token = r / group, qo_head = ctx.head * group + r % group;
      const bool empty = !(sum > 0.f);
      const float inv = empty ? 0.f : 1.f / sum;
      const float lse = empty ? -INFINITY : (rows.max[i2] * scale_log2 + log2f(sum)) * kLn2;
      store_row(a, slot, ctx.request, token, qo_head, lane, lse, [&](int j) {
        return make_float2(o[4 * j + 2 * i2] * inv, o[4 * j + 2 * i2 + 1] * inv);
      });
    }
  }
};

// The page step of one warpgroup, in pieces that a caller may interleave with another
// warpgroup's (issue_qk, page_softmax, rescale, issue_pv); page_step runs them in order. Q (qs)
// and K (ks) are 16-bit swizzled tiles, bf16 or f16 (e4m3 widened); V (vs) likewise.

// S = Q K^T over the page's 128 keys: the wgmmas are issued, not waited for.
template <bool kFp8>
__device__ __forceinline__ void issue_qk(const char* qs, const char* ks, float (&s)[64]) {
  using S = Shape<kFp8>;
  fence_operands();
  // One descriptor per operand, stepped by constant offsets (16-byte units of the start field;
  // shared memory stays below its 256 KB reach, so no step carries out of it).
  const uint64_t desc_q = descriptor(qs, 16), desc_k = descriptor(ks, 16);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int block = kk / 4, within = 32 * (kk % 4);
    const uint64_t step_q = (block * S::kQBlockBytes + within) >> 4;
    const uint64_t step_k = (block * S::kPageBlockBytes + within) >> 4;
    if constexpr (kFp8) {
      wgmma_qk_f16(s, desc_q + step_q, desc_k + step_k, kk);
    } else {
      wgmma_qk_bf16(s, desc_q + step_q, desc_k + step_k, kk);
    }
  }
}

// With e4m3 K/V a row's reference max (Rows::max) moves only when a page's max passes it by
// more than 2^kLazyRescaleLog2 in probability (FlashAttention-4's lazy rescale): O and the sum
// are then kept against a reference up to that much below the true running max, the same
// numbers at another scale (fp32 O and sums; beta-scaled P stays <= 256), and O's rescale (64
// multiplies) runs only on the rare pages that move a row's reference, not on nearly every page
// of a short request. The LSE and the split-KV partials use the reference, so they are exact
// whatever it is. bf16 keeps the exact running max: its P is rounded to bf16 against it, so a
// row's largest probability is exactly 1 rather than a rounded value up to 256 (whose rounding
// put O one ulp past the contract's bf16 bound on some inputs), and bf16 calls are bound by
// HBM, not by the rescale.
template <bool kFp8>
constexpr float kLazyRescaleLog2 = kFp8 ? 8.f : 0.f;

// The page's softmax on S (complete): mask (causal against seqused_k, the page's selection per
// token) unless `full`, page maxima per row; S becomes P in fp32 (bf16: against the reference
// max; e4m3: against the page max, beta the factor from it to the reference max), alpha the
// factor by which O must be rescaled before P.V is added; the row state advances. Returns false
// where no row of the warp selected the page: P is then 0, and S is zeroed with kZeroSkipped
// (inside that branch: a select after the call would cost every page 64 instructions) or left.
// `before_exponentials()` runs after the maxima, in the same basic block as the exponentials:
// independent work of the caller's (the ping-pong forms' fold of the previous page's P.V) then
// issues in the MUFU's shadow instead of before or after the softmax.
template <bool kFp8, bool kZeroSkipped, typename BeforeExponentials>
__device__ __forceinline__ bool page_probabilities(const PageRef& page, bool full,
                                                   float scale_log2, Rows& rows, float (&s)[64],
                                                   float (&alpha)[2], float (&beta)[2],
                                                   BeforeExponentials&& before_exponentials) {
#ifdef MSA_LAB_NO_SOFTMAX   // (lab hooks of the softmax: above exp2_fma)
  alpha[0] = alpha[1] = beta[0] = beta[1] = 1.f;
  before_exponentials();
  return true;
#endif
  const int lane = threadIdx.x & 31;
  float page_max[2];
  // Where the tile's tokens do not all see the page (a sparse union, the request's last page),
  // this thread's own rows may still see all of it: then they skip the mask too. The branch is
  // warp-uniform at G >= 8 (a thread's two rows, r and r + 8, are its warp's only tokens).
  const int page_last = page.logical * kPageSize + kPageSize - 1;
  const bool selected[2] = {((page.token_mask >> rows.token[0]) & 1u) != 0,
                            ((page.token_mask >> rows.token[1]) & 1u) != 0};
  const bool rows_see_page = selected[0] && selected[1] &&
                             page_last <= min(rows.last_key[0], rows.last_key[1]);
  // A warp none of whose rows' tokens selected the page (in a union, about half of them):
  // every score would be masked, so P = 0 and the rows keep their state, exactly what the
  // masked path below gives, without its mask and softmax on -inf scores. Those made such a
  // warp the slowest of its warpgroup on nearly every union page (its turn waits for all four).
  // Every lane votes here, outside the branch: below G 8 a warp's rows hold several tokens, so
  // the branch diverges, and a full-mask vote inside it would wait for lanes that never come.
  const bool warp_unselected = __all_sync(0xFFFFFFFFu, !selected[0] && !selected[1]);
  if (!full && !rows_see_page) {
    if (warp_unselected) {
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        alpha[i2] = rows.max[i2] == -INFINITY ? 0.f : 1.f;
        beta[i2] = 0.f;
        rows.sum[i2] *= alpha[i2];
      }
      before_exponentials();
      if constexpr (kZeroSkipped) {
#pragma unroll
        for (int i = 0; i < 64; ++i) s[i] = 0.f;
      }
      return false;
    }
    int last[2];
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      last[i2] = selected[i2] ? rows.last_key[i2] - page.logical * kPageSize : -1;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 8 * j + 2 * (lane & 3) + (e & 1);
        if (key > last[e >> 1]) s[4 * j + e] = -INFINITY;
      }
    }
  }
  // Row maxima and sums as four partials each (dependency chains of 8, not 32).
  float part[2][4];
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
#pragma unroll
    for (int c = 0; c < 4; ++c) part[i2][c] = -INFINITY;
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float& m = part[e >> 1][2 * (j & 1) + (e & 1)];
      m = fmaxf(m, s[4 * j + e]);
    }
  }
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    page_max[i2] = fmaxf(fmaxf(part[i2][0], part[i2][1]), fmaxf(part[i2][2], part[i2][3]));
  }
  // Both rows' quad reductions side by side: their shuffles' latencies overlap.
#pragma unroll
  for (int lanes = 1; lanes <= 2; lanes *= 2) {
    const float other[2] = {__shfl_xor_sync(0xFFFFFFFFu, page_max[0], lanes),
                            __shfl_xor_sync(0xFFFFFFFFu, page_max[1], lanes)};
    page_max[0] = fmaxf(page_max[0], other[0]);
    page_max[1] = fmaxf(page_max[1], other[1]);
  }
  float shift[2];
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    // Also true for a row's first visible page (reference -inf); false for a page it does not
    // see (-inf - -inf is NaN).
    const bool moves = (page_max[i2] - rows.max[i2]) * scale_log2 > kLazyRescaleLog2<kFp8>;
    const float new_max = moves ? page_max[i2] : rows.max[i2];
    alpha[i2] = !moves ? 1.f
                : rows.max[i2] == -INFINITY ? 0.f
                                            : exp2_ftz((rows.max[i2] - new_max) * scale_log2);
    // bf16: P against the reference max; e4m3: against the page max (then scaled by beta).
    const float ref = kFp8 ? page_max[i2] : new_max;
    shift[i2] = ref == -INFINITY ? 0.f : -ref * scale_log2;
    beta[i2] = page_max[i2] == -INFINITY ? 0.f : exp2_ftz((page_max[i2] - new_max) * scale_log2);
    rows.max[i2] = new_max;
  }
  before_exponentials();
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
#pragma unroll
    for (int c = 0; c < 4; ++c) part[i2][c] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = fmaf(s[4 * j + e], scale_log2, shift[e >> 1]);
#if defined(MSA_LAB_NO_EXP)
      const float p = x;
#elif defined(MSA_LAB_EXP_ON_FMA) && MSA_LAB_EXP_ON_FMA > 0
      const float p = (4 * j + e) % 16 >= 16 - MSA_LAB_EXP_ON_FMA ? exp2_fma(x) : exp2_ftz(x);
#else
      const float p = exp2_ftz(x);
#endif
      part[e >> 1][2 * (j & 1) + (e & 1)] += p;
      s[4 * j + e] = p;
    }
  }
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    const float page_sum = (part[i2][0] + part[i2][1]) + (part[i2][2] + part[i2][3]);
    rows.sum[i2] = rows.sum[i2] * alpha[i2] + (kFp8 ? beta[i2] : 1.f) * page_sum;
  }
  return true;
}

// The same, S always becoming P (0 where the warp's rows did not select the page).
template <bool kFp8>
__device__ __forceinline__ void page_probabilities(const PageRef& page, bool full,
                                                   float scale_log2, Rows& rows, float (&s)[64],
                                                   float (&alpha)[2], float (&beta)[2]) {
  page_probabilities<kFp8, true>(page, full, scale_log2, rows, s, alpha, beta, [] {});
}

// P (page_probabilities) as the 16-bit P.V wgmma's A operand, k-step kk: keys 16 kk .. + 15
// (bf16; e4m3: each P rounded to e4m3 as an FP8 P.V would see it, times beta, in f16).
template <bool kFp8>
__device__ __forceinline__ void pack_p_16bit(const float (&s)[64], const float (&beta)[2],
                                             uint32_t (&pa)[8][4]) {
  const __half2 beta0 = __float2half2_rn(beta[0]), beta1 = __float2half2_rn(beta[1]);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
    for (int f = 0; f < 4; ++f) {   // a0: row r, a1: row r + 8, a2 / a3: the same, keys + 8
      const float* src = s + 8 * kk + 4 * (f >> 1) + 2 * (f & 1);
      if constexpr (kFp8) {
        pa[kk][f] = pack_f16_scaled_e4m3(src[0], src[1], (f & 1) ? beta1 : beta0);
      } else {
        pa[kk][f] = pack_bf16(src[0], src[1]);
      }
    }
  }
}

// Four probabilities rounded to e4m3, byte i = p_i.
__device__ __forceinline__ uint32_t pack_e4m3x4(float p0, float p1, float p2, float p3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(p0, p1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(p2, p3), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// P (page_probabilities, e4m3: against the page max) as the e4m3 P.V wgmma's A operand, k-step
// kk: key positions 32 kk .. + 31. Register a0 holds row r's positions 4t .. 4t + 3 (t = lane %
// 4), a1 row r + 8's, a2 / a3 the same 16 positions on; V^T holds in position 4u + i of each
// 16-key group the key 2u + (i & 1) + 8 (i >> 1) (transpose_v_quarter), which is where S's
// accumulator leaves this thread's keys: no shuffle.
__device__ __forceinline__ void pack_p_e4m3(const float (&s)[64], uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const int j = 4 * kk + 2 * (f >> 1), e = 2 * (f & 1);
      pa[kk][f] = pack_e4m3x4(s[4 * j + e], s[4 * j + e + 1], s[4 * j + 4 + e],
                              s[4 * j + 4 + e + 1]);
    }
  }
}

template <bool kFp8>
__device__ __forceinline__ void page_softmax(const PageRef& page, bool full, float scale_log2,
                                             Rows& rows, float (&s)[64], uint32_t (&pa)[8][4],
                                             float (&alpha)[2]) {
  float beta[2];
  page_probabilities<kFp8>(page, full, scale_log2, rows, s, alpha, beta);
  pack_p_16bit<kFp8>(s, beta, pa);
}

// O *= alpha per row (skipped when neither row's reference max moved).
__device__ __forceinline__ void rescale(float (&o)[64], const float (&alpha)[2]) {
  if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[4 * j] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  }
}

// O += P V: V [keys][channels] as the transposed B operand, 16 keys per step (issued, not
// waited for).
template <bool kFp8>
__device__ __forceinline__ void issue_pv(uint64_t desc_v, const uint32_t (&pa)[8][4],
                                         float (&o)[64]) {
  fence_operands();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const uint64_t step = (kk * 16 * kRowBytes) >> 4;
    if constexpr (kFp8) {
      wgmma_pv_f16(o, pa[kk], desc_v + step, 1);
    } else {
      wgmma_pv_bf16(o, pa[kk], desc_v + step, 1);
    }
  }
}

template <bool kFp8>
__device__ __forceinline__ void page_step(const char* qs, const char* ks, const char* vs,
                                          const PageRef& page, bool full, float scale_log2,
                                          Rows& rows, float (&s)[64], float (&o)[64]) {
  issue_qk<kFp8>(qs, ks, s);
  commit_and_wait();
  uint32_t pa[8][4];
  float alpha[2];
  page_softmax<kFp8>(page, full, scale_log2, rows, s, pa, alpha);
  rescale(o, alpha);
  issue_pv<kFp8>(v_descriptor(vs), pa, o);
  commit_and_wait();
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    decode_attention_wg_kernel(const DecodeAttentionArgs a) {
  using S = Shape<kFp8>;
  constexpr int kStages = S::kStages;         // whole-page stages
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  char* q_smem = smem;                        // each warpgroup's Q rows
  char* stages = smem + S::kStagesOffset;
  char* widened = smem + S::kWidenedOffset;   // e4m3: the page's f16 K, then V
  int* cand = reinterpret_cast<int*>(smem + S::kListOffset);
  int* list_phys = cand + kMaxCandidates;
  int* list_logical = list_phys + kMaxCandidates;
  uint32_t* list_mask = reinterpret_cast<uint32_t*>(list_logical + kMaxCandidates);
  int* warp_counts = reinterpret_cast<int*>(list_mask + kMaxCandidates);
  int* page_total = warp_counts + kWarps;

  CtaContext ctx;
  int chunk, group, tile_rows;
  if (!make_context(a, blockIdx.x, blockIdx.y, ctx, chunk, group, tile_rows)) return;
  load_queries<kFp8>(a, ctx, group, tile_rows, q_smem);
  int num_pages;
  if (a.q2k_indices != nullptr) {
    num_pages = build_sparse_page_list(a, ctx, cand, list_phys, list_logical, list_mask,
                                       warp_counts, page_total);
  } else {
    num_pages = ctx.chunk_end - ctx.chunk_begin;
  }

  const int warpgroup = threadIdx.x / 128;
  const bool group_active = warpgroup * kWarpgroupRows < tile_rows;   // uniform per warpgroup
  const char* qs = q_smem + warpgroup * S::kQBytes;
  const TileView tile(a, ctx, group, tile_rows);
  Rows rows = tile.rows(a, ctx, warpgroup * kWarpgroupRows);
  const float scale_log2 = a.softmax_scale * kLog2e;

  float s[64], o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = o[i] = 0.f;

  auto page_of = [&](int idx) {
    return page_or_none(a, ctx, idx, num_pages, list_phys, list_logical, list_mask);
  };
  auto stage_of = [&](int idx) { return stages + (idx % kStages) * S::kStageBytes; };
  auto issue = [&](int idx) {   // one cp.async group per page, empty past the end
    const PageRef ref = page_of(idx);
    load_page<kFp8>(a, ctx.head, ref, stage_of(idx), page_valid_rows(ctx, ref));
    cp_async_commit();
  };
#pragma unroll
  for (int idx = 0; idx < kStages - 1; ++idx) issue(idx);

  for (int i = 0; i < num_pages; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    sm90::fence_proxy_async_shared();
    // Page i has landed; every thread is done with page i - 1, whose stage takes the next page.
    __syncthreads();
    issue(i + kStages - 1);
    const PageRef page = page_of(i);
    if (page.token_mask == 0) continue;                // uniform: skipped (nothing loaded)
    const char* kst = stage_of(i);
    if constexpr (kFp8) {
      widen_page(kst, widened);
      sm90::fence_proxy_async_shared();
    }
    const bool full = tile.fully_visible(page);
    if constexpr (kFp8) {
      __syncthreads();                                 // the widened K and V are complete
    }
    if (group_active) {
      const char* ks = kFp8 ? widened : kst;
      page_step<kFp8>(qs, ks, ks + (kFp8 ? S::kWideBytes : S::kKBytes), page, full,
                      scale_log2, rows, s, o);
    }
  }
  cp_async_wait_all();

  if (group_active) {
    tile.finalize(a, ctx, chunk_slot(a, ctx.request, chunk), warpgroup * kWarpgroupRows, rows,
                  scale_log2, o);
  }
}

// ---- Ping-pong form (q and K/V of one dtype, tiles of > 64 rows) ----------------------
// Three warpgroups: warpgroup 0 streams pages (cp.async, 56 registers; warps 0-1 K, warps 2-3
// V), warpgroups 1 and 2 own rows 0-63 and 64-127 (224 registers). K and V flow through
// separate stage rings, each stage with a "full" mbarrier (copied stages: bf16 K and V, e4m3 K
// kept raw: the stream's 64 threads' copies arrive on it as they land, and the consumers fence
// for the async proxy after their wait; e4m3 V: the loaders arrive once they have widened their
// chunks into the f16 stage and fenced) and an "empty" one (the 256 consumer threads arrive
// once their wgmmas no longer read it). The consumers take turns issuing wgmmas (named barriers
// 1 and 2): while one warpgroup issues its Q K^T of page i and P V of page i - 1, the other
// runs its softmax of the page before, so the softmax of one hides under the other's tensor
// work (FlashAttention-3's ping-pong and its in-warpgroup overlap of P V with the next Q K^T).
// e4m3 Q K^T runs on e4m3 wgmma (k32) from the raw Q and K; P V on f16 wgmma, as bf16's.
namespace pingpong {

constexpr int kThreadsPP = 3 * 128;
constexpr int kQueriesReady = 3;     // named barrier of the consumers' Q load (1, 2: their turns)
constexpr int kProducerBarrier = 6;     // e4m3 P.V: the producer warpgroup's page barrier
constexpr int kRawStages = 2;           // e4m3 P.V: raw V pages in flight (TMA copies)
static_assert((kThreadsPP / 32 + 1) * 4 <= kCountsSlotBytes, "warp counts and the page total");

// setmaxnreg moves registers within the CTA's launch allocation (384 threads x 168), not the
// SM's 64K: a split past it would hang the consumers' increase. The e4m3 P.V form's consumers
// hold a third accumulator (the page's P.V before it is folded into O).
constexpr int kLaunchRegisters = 168;
template <bool kPvFp8>
struct RegisterSplit {
  static constexpr int kProducer = kPvFp8 ? 24 : 56;
  static constexpr int kConsumer = kPvFp8 ? 240 : 224;
  static_assert(128 * kProducer + 256 * kConsumer <= kThreadsPP * kLaunchRegisters,
                "the register split must fit the launch allocation");
};

// Shared memory: Q (bf16: both consumers' 16-bit rows, 32 KB; e4m3: their raw rows, K-major
// for the e4m3 Q K^T wgmma, then a 16-bit tile of zeros, the first turn's V tile), the K ring
// (bf16: 16-bit tiles; e4m3: raw pages, K-major), the V ring of 16-bit tiles, for e4m3 V's raw
// page slot (its loaders' cp.async target, widened by the same threads into the ring), the ring
// barriers, the sparse page list. The persistent form keeps two Q slots (the next sequence's
// rows land while this one's run; bf16 then has room for two K stages) and the partition's
// request table instead of the list.
//
// kPvFp8 (e4m3 only): P.V on e4m3 wgmma, the V ring holding e4m3 V^T tiles (16 KB, three
// stages) instead of f16 V, the tile of zeros 16 KB; K (three stages) and V arrive by TMA, V
// into kRawStages raw page slots (their full barriers and each slot's valid rows after the ring
// barriers). Shared memory stays near the f16 P.V form's: more would take it from the L1 that
// holds the consumers' register spills.
template <bool kFp8, bool kPersistent = false, bool kPvFp8 = false>
struct Layout {
  using S = Shape<kFp8>;
  static_assert(kFp8 || !kPvFp8, "e4m3 P.V needs e4m3 K/V");
  static constexpr int kQBytes = kFp8 ? kWarpgroupRows * kRowBytes : S::kQBytes;  // per consumer
  static constexpr int kQSlotBytes = 2 * kQBytes;
  static constexpr int kVTileBytes = kPvFp8 ? S::kPageBlockBytes : S::kWideBytes;
  static constexpr int kZerosOffset = (kPersistent ? 2 : 1) * kQSlotBytes;
  static constexpr int kZerosBytes = kFp8 ? kVTileBytes : 0;
  static constexpr int kKTileBytes = kFp8 ? S::kPageBlockBytes : S::kWideBytes;
  static constexpr int kKStages = kPvFp8 ? 3 : kFp8 ? 4 : (kPersistent ? 2 : 3);
  static constexpr int kVStages = kPvFp8 ? 3 : 2;
  static constexpr int kRawSlots = kPvFp8 ? kRawStages : (kFp8 ? 1 : 0);
  static constexpr int kRawBytes = kRawSlots * kPageSize * kRowBytes;
  static constexpr int kKOffset = kZerosOffset + kZerosBytes;
  static constexpr int kVOffset = kKOffset + kKStages * kKTileBytes;
  static constexpr int kRawOffset = kVOffset + kVStages * kVTileBytes;
  static constexpr int kBarrierOffset = kRawOffset + kRawBytes;
  static constexpr int kBarriers = 2 * (kKStages + kVStages) + (kPvFp8 ? kRawStages : 0);
  static constexpr int kRawRowsOffset = kBarrierOffset + kBarriers * 8;
  static constexpr int kListOffset = kRawRowsOffset + (kPvFp8 ? 16 : 0);
  static_assert(!kPvFp8 || kRawStages * 4 <= 16, "the raw slots' valid rows");
  static_assert(!kPvFp8 || kRawStages <= kKStages, "a page's K and V are copied together");
  static constexpr int kPartitionBytes =
      (kDecodePersistentMaxRequests + 1) * 8 + kDecodePersistentMaxRequests * 4;
  static constexpr int kBytes =
      kListOffset + (kPersistent ? kPartitionBytes : kListBytes) + kCountsSlotBytes;
  static constexpr int kAlloc = kBytes + 1024;
  static_assert(kAlloc <= 227 * 1024, "ping-pong form: shared memory");
};

// e4m3 Q of the tile as stored (rows of 128 bytes, swizzled, K-major for the e4m3 Q K^T wgmma;
// zero past tile_rows) into each consumer's block, and the 16-bit tile of zeros after them, by
// the 256 consumer threads.
template <typename L>
__device__ __forceinline__ void load_raw_queries(const DecodeAttentionArgs& a,
                                                 const CtaContext& ctx, int group, int tile_rows,
                                                 char* qs, int thread) {
  constexpr int kChunksPerRow = kHeadDim / 16;
  constexpr int kThreads = 256;
  static_assert(kRowsPerCta * kChunksPerRow % kThreads == 0, "every thread loads as many");
#pragma unroll
  for (int i = 0; i < kRowsPerCta * kChunksPerRow / kThreads; ++i) {
    const int c = thread + i * kThreads;
    const int row = c / kChunksPerRow, chunk = c % kChunksPerRow;
    *reinterpret_cast<uint4*>(qs + swizzled(row, chunk)) =     // row 64 starts block 1
        query_chunk(a, ctx, group, tile_rows, row, chunk, 1);
  }
  uint4* zeros = reinterpret_cast<uint4*>(qs + L::kZerosOffset);
#pragma unroll
  for (int i = 0; i < L::kZerosBytes / 16 / kThreads; ++i) {
    zeros[thread + i * kThreads] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// S = Q K^T on e4m3 wgmma (k32) straight from the raw page: Q and K rows of 128 bytes, one
// swizzled column block, 32 bytes per k-step (issued, not waited for).
__device__ __forceinline__ void issue_qk_raw(const char* qs, const char* ks, float (&s)[64]) {
  fence_operands();
  const uint64_t desc_q = descriptor(qs, 16), desc_k = descriptor(ks, 16);
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 32; ++kk) {
    wgmma_qk_e4m3(s, desc_q + ((32 * kk) >> 4), desc_k + ((32 * kk) >> 4), kk);
  }
}

// A tensor's (K or V) slice of a page is copied by kLoaders threads; rows >= valid_rows are
// zero-filled (no byte read).
constexpr int kLoaders = 64;

// The global address of one tensor's head slice of a page (elements of element_bytes), and the
// rows to read from it: none for a skipped page (its id may be anything; the stage is
// zero-filled, since the consumers' wgmmas still read it) or under MSA_LAB_NO_LOADS.
__device__ __forceinline__ const char* page_source(const DecodeAttentionArgs& a, int head,
                                                   const PageRef& ref, const void* tensor,
                                                   int element_bytes, int& valid_rows) {
  if (ref.token_mask == 0) valid_rows = 0;
#ifdef MSA_LAB_NO_LOADS
  valid_rows = 0;
#endif
  const char* src = static_cast<const char*>(tensor);
  if (valid_rows > 0) {
    src += (static_cast<int64_t>(ref.physical) * a.num_kv_heads + head) *
           (kPageSize * kHeadDim) * element_bytes;
  }
  return src;
}

// The first row of a page's head slice in PagedKvMaps ((physical x num_kv_heads + head) x 128)
// and the rows to read from it, as page_source: none for a skipped page.
__device__ __forceinline__ int page_row(const DecodeAttentionArgs& a, int head, const PageRef& ref,
                                        int& valid_rows) {
  if (ref.token_mask == 0) valid_rows = 0;
#ifdef MSA_LAB_NO_LOADS
  valid_rows = 0;
#endif
  if (valid_rows <= 0) return 0;
  return static_cast<int>((static_cast<int64_t>(ref.physical) * a.num_kv_heads + head) *
                          kPageSize);
}

// A loader's chunks of a page copied as stored into a swizzled tile (bf16: 16-bit rows of two
// column blocks; e4m3 K: raw 128-byte rows, K-major for the e4m3 Q K^T wgmma): chunk c =
// thread % (chunks per row) of rows thread / (chunks per row) + i x (rows per step), each step
// 1 KB of consecutive bytes. bf16's rows 4 apart alternate two swizzle phases (two tile
// offsets); e4m3's rows 8 apart keep one.
template <int kBytesPerElement>
struct PageLoader {
  static constexpr int kElementBytes = kBytesPerElement;
  static constexpr int kStoredRowBytes = kHeadDim * kElementBytes;
  static constexpr int kChunksPerRow = kStoredRowBytes / 16;
  static constexpr int kRowsPerStep = kLoaders / kChunksPerRow;
  static constexpr int kSteps = kPageSize / kRowsPerStep;
  static_assert(kRowsPerStep == 4 || kRowsPerStep == 8, "one or two swizzle phases");
  int first_row;
  int src_offset;
  int tile_offset[2];    // the first row's chunk in the tile; [1]: as seen from kRowsPerStep on
  __device__ __forceinline__ explicit PageLoader(int thread) {
    const int chunk = thread % kChunksPerRow;
    first_row = thread / kChunksPerRow;
    src_offset = first_row * kStoredRowBytes + chunk * 16;
    const int block = (chunk / 8) * kPageSize * kRowBytes;
    tile_offset[0] = block + swizzled(first_row, chunk % 8);
    tile_offset[1] =
        block + swizzled(first_row + kRowsPerStep, chunk % 8) - kRowsPerStep * kRowBytes;
  }
  __device__ __forceinline__ void load(const char* src, char* tile, int valid_rows) const {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const bool valid = first_row + kRowsPerStep * i < valid_rows;
      const int src_bytes = src_offset + i * kRowsPerStep * kStoredRowBytes;
      const int phase = kRowsPerStep == 8 ? 0 : i & 1;
      cp_async_16_or_zero(tile + tile_offset[phase] + i * kRowsPerStep * kRowBytes,
                          src + (valid ? src_bytes : 0), valid);
    }
  }
};

// e4m3 V: the page's slice, raw, into the raw slot (row-major, 128 bytes a row) by kLoaders
// threads, a quarter (32 rows) at a time, rows >= valid_rows zero-filled; then
// widen_own_quarter turns exactly the chunks this thread copied into the 16-bit tile, so the
// loaders need no barrier among them. A loader's chunks are chunk thread % 8 of rows
// 8 i + (thread / 8 ^ (thread / 4) % 2), i = 0 .. 15: the rows of chunks 4-7 are swapped
// pairwise, so the eight threads of a quarter warp store their widened chunks to eight distinct
// 16-byte bank groups (chunks j and j + 4 of one row land on the same groups of the two column
// blocks) without selecting which half a thread stores first.
constexpr int kRawQuarters = 4;
constexpr int kRawRowsPerStep = kLoaders / 8;
constexpr int kRawChunksPerLoader = kPageSize * 8 / kLoaders;
constexpr int kRawChunksPerQuarter = kRawChunksPerLoader / kRawQuarters;
static_assert(kRawRowsPerStep == 8, "a loader's rows keep one row % 8 (one swizzle phase)");

// A loader's place in the raw slot and the 16-bit tile: its first row (row i of its chunks is
// 8 i further, the same swizzle phase) and the byte offsets of its chunk in both.
struct RawLoader {
  int first_row;
  int raw_offset;        // first row's chunk in the raw slot and in the page as stored
  int tile_offset;       // first row's f16 chunk 2 (chunk % 4) in the tile
  int next_offset;       // and its f16 chunk 2 (chunk % 4) + 1
  __device__ __forceinline__ explicit RawLoader(int thread) {
    const int chunk = thread & 7;
    first_row = (thread >> 3) ^ ((thread >> 2) & 1);
    raw_offset = first_row * kRowBytes + chunk * 16;
    const int block = (chunk >> 2) * Shape<true>::kPageBlockBytes;
    tile_offset = block + swizzled(first_row, 2 * (chunk & 3));
    next_offset = block + swizzled(first_row, 2 * (chunk & 3) + 1);
  }
};

__device__ __forceinline__ void load_raw_quarter(const RawLoader& me, const char* src, char* raw,
                                                 int valid_rows, int quarter) {
#pragma unroll
  for (int k = 0; k < kRawChunksPerQuarter; ++k) {
    const int step = quarter * kRawChunksPerQuarter + k;
    const bool valid = me.first_row + kRawRowsPerStep * step < valid_rows;
    const int offset = me.raw_offset + step * kRawRowsPerStep * kRowBytes;
    cp_async_16_or_zero(raw + offset, src + (valid ? offset : 0), valid);
  }
}

__device__ __forceinline__ void widen_own_quarter(const RawLoader& me, const char* raw,
                                                  char* tile, int quarter) {
#pragma unroll
  for (int k = 0; k < kRawChunksPerQuarter; ++k) {
    const int step_bytes = (quarter * kRawChunksPerQuarter + k) * kRawRowsPerStep * kRowBytes;
    const uint4 w = *reinterpret_cast<const uint4*>(raw + me.raw_offset + step_bytes);
    *reinterpret_cast<uint4*>(tile + me.tile_offset + step_bytes) =
        make_uint4(e4m3x2_lo_to_f16x2(w.x), e4m3x2_hi_to_f16x2(w.x), e4m3x2_lo_to_f16x2(w.y),
                   e4m3x2_hi_to_f16x2(w.y));
    *reinterpret_cast<uint4*>(tile + me.next_offset + step_bytes) =
        make_uint4(e4m3x2_lo_to_f16x2(w.z), e4m3x2_hi_to_f16x2(w.z), e4m3x2_lo_to_f16x2(w.w),
                   e4m3x2_hi_to_f16x2(w.w));
  }
}

// One tensor's stream (K, or V) of the producer: pages 0 .. num_pages - 1 into a ring of
// kStages tiles. Each loader's copies of a stage arrive on its full barrier as they land
// (cp.async.mbarrier.arrive), so the loader goes straight on to the next stage's empty wait and
// a page is ready the moment its bytes are; the consumers fence for the async proxy before
// their wgmmas read it.
// locate(i, valid_rows) is page i's source, with the rows to read from it (page_source); it is
// called for i = 0, 1, .. in order.
template <int kStages, typename Loader, typename Locate, typename Full, typename Empty,
          typename Tile>
__device__ __forceinline__ void stream_tensor(int num_pages, [[maybe_unused]] int lab_actor, int thread,
                                              Locate locate, Full full, Empty empty,
                                              Tile tile) {
  sm90::RingState<kStages> ring;
  const Loader me(thread);
  for (int i = 0; i < num_pages; ++i) {
    int valid_rows;
    const char* src = locate(i, valid_rows);
    MSA_LAB_MARK(thread == 0, lab_actor, i, 0);
    empty(ring.index).wait(ring.phase ^ 1u);
    MSA_LAB_MARK(thread == 0, lab_actor, i, 1);
    me.load(src, tile(ring.index), valid_rows);
    full(ring.index).arrive_on_copies();
    MSA_LAB_MARK(thread == 0, lab_actor, i, 2);
    ring.advance();
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");   // no copy outlives its thread
}

// e4m3 V's stream of the producer. The raw slot is a ring of four quarter pages: the
// quarter just widened takes the next page's copies at once, so three quarters are in flight
// while one is widened and the DRAM latency hides under the widening. Per page: the stage's
// empty wait, then per quarter: wait for its copies (one cp.async group per quarter, the oldest
// of four), widen them into the stage, issue the next page's; then fence for the async proxy
// and tell the full barrier.
template <int kStages, typename Locate, typename Full, typename Empty, typename Tile>
__device__ __forceinline__ void stream_tensor_fp8(int num_pages, [[maybe_unused]] int lab_actor, char* raw,
                                                  int thread, Locate locate_page, Full full,
                                                  Empty empty, Tile tile) {
  sm90::RingState<kStages> ring;
  const RawLoader me(thread);
  int next_rows = 0;
  const char* next_src = nullptr;
  auto locate = [&](int idx) { next_src = locate_page(idx, next_rows); };
  if (num_pages > 0) locate(0);
#pragma unroll
  for (int q = 0; q < kRawQuarters; ++q) {
    if (num_pages > 0) load_raw_quarter(me, next_src, raw, next_rows, q);
    cp_async_commit();
  }
  for (int i = 0; i < num_pages; ++i) {
    MSA_LAB_MARK(thread == 0, lab_actor, i, 0);
    const bool more = i + 1 < num_pages;
    if (more) locate(i + 1);
    MSA_LAB_MARK(thread == 0, lab_actor, i, 1);
    empty(ring.index).wait(ring.phase ^ 1u);
    MSA_LAB_MARK(thread == 0, lab_actor, i, 2);
#pragma unroll
    for (int q = 0; q < kRawQuarters; ++q) {
      sm80::cp_async_wait<kRawQuarters - 1>();     // this page's quarter q has landed
      widen_own_quarter(me, raw, tile(ring.index), q);
      if (more) load_raw_quarter(me, next_src, raw, next_rows, q);
      cp_async_commit();                            // empty past the last page: the count holds
    }
    sm90::fence_proxy_async_shared();
    full(ring.index).arrive();
    MSA_LAB_MARK(thread == 0, lab_actor, i, 3);
    ring.advance();
  }
  cp_async_wait_all();                              // no copy outlives its thread
}

// e4m3 V for the e4m3 P.V: quarter `quarter` (32 keys, row-major in the raw slot) of a page
// transposed into its V^T tile: channel-major, 128 rows of 128 key positions, K-major and
// 128-byte swizzled as FP8 wgmma takes B, each 16-key group's keys in the order P's e4m3 A
// fragment holds them (pack_p_e4m3): position 4u + i = key 2u + (i & 1) + 8 (i >> 1). Thread
// (g = thread / 32, cq = thread % 32) takes keys 16 g .. + 15 of channels 4 cq .. + 3 in two
// halves (keys 4h .. 4h + 3 and 4h + 8 .. 4h + 11: positions 8h .. 8h + 7), each 8 4-byte
// loads (a warp reads 128 consecutive bytes of a row), 16 byte permutes (two 4 x 4 transposes
// per u), 4 8-byte stores. Store st writes channel 4 cq + (rot + st) % 4, rot = cq / 2 % 4, and
// lanes cq and cq + 8 take the halves in opposite orders: a half warp's stores meet 16
// distinct 8-byte bank slots (eight swizzle phases x two halves).
__device__ __forceinline__ void transpose_v_quarter(const char* quarter_rows, char* tile,
                                                    int quarter, int thread) {
  const int g = thread >> 5, cq = thread & 31, rot = (cq >> 1) & 3;
  const char* src = quarter_rows + g * 16 * kRowBytes + 4 * cq;
  const uint32_t r0 = rot, r1 = (rot + 1) & 3, r2 = (rot + 2) & 3, r3 = (rot + 3) & 3;
  // Stage 1 pairs two keys' bytes of channels (r0, r1), then (r2, r3); stage 2 joins two pairs.
  const uint32_t sel_a = r0 | ((4 + r0) << 4) | (r1 << 8) | ((4 + r1) << 12);
  const uint32_t sel_b = r2 | ((4 + r2) << 4) | (r3 << 8) | ((4 + r3) << 12);
  const int chunk = 2 * quarter + g;
  const int first_half = (cq >> 3) & 1;
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int h = it ^ first_half;
    const char* rows = src + 4 * h * kRowBytes;
    uint32_t x[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[k] = *reinterpret_cast<const uint32_t*>(rows + k * kRowBytes);           // keys 4h + k
      x[4 + k] = *reinterpret_cast<const uint32_t*>(rows + (8 + k) * kRowBytes);  // 4h + 8 + k
    }
    uint32_t y[4][2];   // [store][v]: channel (rot + store) % 4, word u = 2h + v
#pragma unroll
    for (int v = 0; v < 2; ++v) {   // keys 2u, 2u + 1, 2u + 8, 2u + 9
      const uint32_t t0 = __byte_perm(x[2 * v], x[2 * v + 1], sel_a);
      const uint32_t t1 = __byte_perm(x[2 * v], x[2 * v + 1], sel_b);
      const uint32_t t2 = __byte_perm(x[4 + 2 * v], x[5 + 2 * v], sel_a);
      const uint32_t t3 = __byte_perm(x[4 + 2 * v], x[5 + 2 * v], sel_b);
      y[0][v] = __byte_perm(t0, t2, 0x5410);
      y[1][v] = __byte_perm(t0, t2, 0x7632);
      y[2][v] = __byte_perm(t1, t3, 0x5410);
      y[3][v] = __byte_perm(t1, t3, 0x7632);
    }
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      const int row = 4 * cq + ((rot + st) & 3);
      *reinterpret_cast<uint2*>(tile + swizzled(row, chunk) + 8 * h) =
          make_uint2(y[st][0], y[st][1]);
    }
  }
}

// The producer warpgroup's transposes of one raw V page (thread 0 .. 127): rows at or past
// valid_rows zeroed first (a zero P must not meet NaN bytes of the pool), then the page
// transposed into its V^T tile (two quarters a thread group) and fenced for the async proxy
// (wgmma reads it). The caller then tells the tile's full barrier.
template <int kBarrierId>
__device__ __forceinline__ void transpose_raw_page(char* page, int valid_rows, char* tile,
                                                   int thread) {
  constexpr int kQuarterBytes = kPageSize * kRowBytes / 4;
  if (valid_rows < kPageSize) {                      // uniform: the request's last page
    uint4* tail = reinterpret_cast<uint4*>(page + max(valid_rows, 0) * kRowBytes);
    const int chunks = (kPageSize - max(valid_rows, 0)) * kRowBytes / 16;
    for (int c = thread; c < chunks; c += 128) tail[c] = make_uint4(0u, 0u, 0u, 0u);
    sm90::named_sync(kBarrierId, 128);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int quarter = 2 * half + (thread >> 6);
    transpose_v_quarter(page + quarter * kQuarterBytes, tile, quarter, thread & 63);
  }
  sm90::fence_proxy_async_shared();                  // V^T (generic stores) is read by wgmma
}

// The e4m3 P.V form's producer warpgroup (128 threads). Thread 0 copies each page's K slice into
// the K ring and its V slice into a ring of kRawStages raw slots, one TMA copy each, counted on
// the stages' full barriers; page j's pair is issued once the transposes of page j - kRawStages
// have left its raw slot, so kRawStages pages are in flight. K rows past the request's keys
// hold whatever the pool does there (their scores are masked); V's are zeroed in the raw slot
// before the transposes (a zero P must not meet NaN bytes), as are all of a skipped page's,
// which is not read. All four warps transpose each page into its V^T stage (two quarters a
// thread group), fence for the async proxy and tell the stage's full barrier; a barrier of the
// warpgroup then frees the raw slot. locate(j, valid_rows) gives page j's first row in the maps
// (j = 0, 1, .. in order; called by thread 0 only).
template <typename L, typename Locate, typename KFull, typename KEmpty, typename KTile,
          typename VFull, typename VEmpty, typename VTile>
__device__ __forceinline__ void stream_pages_tma(int num_pages, int thread, char* smem,
                                                 const PagedKvMaps& maps, Locate locate,
                                                 KFull k_full, KEmpty k_empty, KTile k_tile,
                                                 VFull v_full, VEmpty v_empty, VTile v_tile) {
  constexpr int kPageBytes = kPageSize * kRowBytes;
  uint64_t* raw_bars = reinterpret_cast<uint64_t*>(smem + L::kBarrierOffset) +
                       2 * (L::kKStages + L::kVStages);
  int* raw_rows = reinterpret_cast<int*>(smem + L::kRawRowsOffset);
  auto raw_full = [&](int slot) { return sm90::Mbarrier{raw_bars + slot}; };
  auto raw = [&](int slot) { return smem + L::kRawOffset + slot * kPageBytes; };
  sm90::RingState<L::kKStages> k_issue;
  sm90::RingState<kRawStages> raw_issue;
  auto issue = [&](int j) {   // thread 0
    int valid_rows;
    const int row = locate(j, valid_rows);
    raw_rows[raw_issue.index] = valid_rows;   // published by the raw slot's barrier
    MSA_LAB_MARK(true, 0, j, 0);
    k_empty(k_issue.index).wait(k_issue.phase ^ 1u);
    MSA_LAB_MARK(true, 0, j, 1);
    const sm90::Mbarrier k_bar = k_full(k_issue.index), v_bar = raw_full(raw_issue.index);
    if (valid_rows > 0) {
      k_bar.arrive_expect_tx(kPageBytes);
      sm90::tma_load_2d(k_tile(k_issue.index), maps.k, 0, row, k_bar);
      v_bar.arrive_expect_tx(kPageBytes);
      sm90::tma_load_2d(raw(raw_issue.index), maps.v, 0, row, v_bar);
    } else {
      k_bar.arrive();
      v_bar.arrive();
    }
    MSA_LAB_MARK(true, 0, j, 2);
    k_issue.advance();
    raw_issue.advance();
  };
  if (thread == 0) {
    for (int j = 0; j < min(num_pages, kRawStages); ++j) issue(j);
  }
  sm90::RingState<L::kVStages> v_ring;
  sm90::RingState<kRawStages> raw_ring;
  for (int i = 0; i < num_pages; ++i) {
    MSA_LAB_MARK(thread == 0, 1, i, 0);
    v_empty(v_ring.index).wait(v_ring.phase ^ 1u);
    MSA_LAB_MARK(thread == 0, 1, i, 1);
    raw_full(raw_ring.index).wait(raw_ring.phase);
    MSA_LAB_MARK(thread == 0, 1, i, 2);
    transpose_raw_page<kProducerBarrier>(raw(raw_ring.index), raw_rows[raw_ring.index],
                                         v_tile(v_ring.index), thread);
    v_full(v_ring.index).arrive();
    MSA_LAB_MARK(thread == 0, 1, i, 3);
    sm90::named_sync(kProducerBarrier, 128);           // every read of the raw slot is done
    if (thread == 0 && i + kRawStages < num_pages) issue(i + kRawStages);
    v_ring.advance();
    raw_ring.advance();
  }
}

// The producer warpgroup's streams: warps 0-1 K, warps 2-3 V (e4m3 V through the raw slot at
// smem + L::kRawOffset, widened into the ring), num_pages pages whose sources
// locate(i, valid_rows) gives in order.
template <bool kFp8, typename L, typename Locate, typename KFull, typename KEmpty, typename KTile,
          typename VFull, typename VEmpty, typename VTile>
__device__ __forceinline__ void stream_pages(int num_pages, bool streams_k, int thread,
                                             char* smem, Locate locate, KFull k_full,
                                             KEmpty k_empty, KTile k_tile, VFull v_full,
                                             VEmpty v_empty, VTile v_tile) {
  constexpr int kKStages = L::kKStages, kVStages = L::kVStages;
  if (streams_k) {
    stream_tensor<kKStages, PageLoader<kFp8 ? 1 : 2>>(num_pages, 0, thread, locate, k_full,
                                                      k_empty, k_tile);
  } else if constexpr (kFp8) {
    stream_tensor_fp8<kVStages>(num_pages, 1, smem + L::kRawOffset, thread, locate, v_full,
                                v_empty, v_tile);
  } else {
    stream_tensor<kVStages, PageLoader<2>>(num_pages, 1, thread, locate, v_full, v_empty,
                                           v_tile);
  }
}

// The P.V a consumer issues in a turn: the previous page's P (zero when there is none: the first
// turn, a skipped page, an idle warpgroup; what a zero P multiplies is always finite and
// settled). 16-bit P (bf16, or e4m3 P as f16 times beta) accumulates straight into O. With
// e4m3 P (kPvFp8) the page's P.V goes into a fresh accumulator and is added to O in fp32, times
// beta, after the turn's wait (accumulating in the FP8 unit drifts with the length).
template <bool kFp8, bool kPvFp8>
struct PendingPV {
  uint32_t pa[8][4];
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
  }
  __device__ __forceinline__ static uint64_t descriptor_of(const char* v) {
    return v_descriptor(v);
  }
  __device__ __forceinline__ void issue(uint64_t desc_v, float (&o)[64]) {
    issue_pv<kFp8>(desc_v, pa, o);
  }
  __device__ __forceinline__ void fold(float (&)[64]) const {}
  __device__ __forceinline__ void set(const float (&p)[64], const float (&beta)[2]) {
    pack_p_16bit<kFp8>(p, beta, pa);
  }
  __device__ __forceinline__ void discard() { clear(); }
};

template <>
struct PendingPV<true, true> {
  uint32_t pa[4][4];
  float acc[64];
  float beta[2];
  __device__ __forceinline__ void clear() {
    discard();
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  }
  __device__ __forceinline__ static uint64_t descriptor_of(const char* v) {
    return descriptor(v, 16);   // V^T: K-major, 32 key positions per k-step
  }
  __device__ __forceinline__ void issue(uint64_t desc_v, float (&)[64]) {
    fence_operands();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_pv_e4m3(acc, pa[kk], desc_v + ((32 * kk) >> 4), kk);
  }
  __device__ __forceinline__ void fold(float (&o)[64]) const {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[4 * j] = fmaf(beta[0], acc[4 * j], o[4 * j]);
      o[4 * j + 1] = fmaf(beta[0], acc[4 * j + 1], o[4 * j + 1]);
      o[4 * j + 2] = fmaf(beta[1], acc[4 * j + 2], o[4 * j + 2]);
      o[4 * j + 3] = fmaf(beta[1], acc[4 * j + 3], o[4 * j + 3]);
    }
  }
  __device__ __forceinline__ void set(const float (&p)[64], const float (&beta_)[2]) {
    pack_p_e4m3(p, pa);
    beta[0] = beta_[0];
    beta[1] = beta_[1];
  }
  __device__ __forceinline__ void discard() {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    beta[0] = beta[1] = 0.f;
  }
};

// A consumer's turn after its wgmma wait: O takes the previous page's P V (pending), and where
// this warpgroup computes the page, its softmax makes the next P (otherwise P = 0) and O moves
// to the rows' new reference. The fold runs inside the softmax, between the maxima and the
// exponentials, where it fills the MUFU's shadow.
template <bool kFp8, bool kPvFp8>
__device__ __forceinline__ void consume_turn(bool active, const PageRef& page, bool full,
                                             float scale_log2, Rows& rows, float (&s)[64],
                                             float (&o)[64], PendingPV<kFp8, kPvFp8>& pending) {
  if (active) {
    float alpha[2], beta[2];
    const bool computed = page_probabilities<kFp8, false>(page, full, scale_log2, rows, s, alpha,
                                                          beta, [&] { pending.fold(o); });
    rescale(o, alpha);
    if (computed) {
      pending.set(s, beta);
    } else {
      pending.discard();
    }
  } else {
    pending.fold(o);
    pending.discard();
  }
}

// The ring barriers (thread 0). Full: counted by the loaders' copies (e4m3 P.V: thread 0's K
// copy, the 128 threads that transposed the V^T stage, the raw slot's V copy); empty: by both
// consumer warpgroups.
template <typename L, bool kPvFp8>
__device__ __forceinline__ void init_ring_barriers(uint64_t* bars) {
  for (int st = 0; st < L::kKStages; ++st) {
    sm90::Mbarrier{bars + st}.init(kPvFp8 ? 1 : kLoaders);
    sm90::Mbarrier{bars + L::kKStages + st}.init(256);
  }
  for (int st = 0; st < L::kVStages; ++st) {
    sm90::Mbarrier{bars + 2 * L::kKStages + st}.init(kPvFp8 ? 128 : kLoaders);
    sm90::Mbarrier{bars + 2 * L::kKStages + L::kVStages + st}.init(256);
  }
  if constexpr (kPvFp8) {
    for (int r = 0; r < kRawStages; ++r) {
      sm90::Mbarrier{bars + 2 * (L::kKStages + L::kVStages) + r}.init(1);
    }
  }
  sm90::fence_barrier_init();
}

// The pages a request of `len` keys addresses: ceil(len / 128), at most the table's width.
__device__ __forceinline__ int request_table_pages(const DecodeAttentionArgs& a, int len) {
  return min(len / kPageSize + (len % kPageSize != 0), a.page_table_width);
}

template <bool kFp8, bool kPvFp8 = false>
__global__ void __launch_bounds__(kThreadsPP, 1) decode_attention_pp_kernel(
    const DecodeAttentionArgs a, const __grid_constant__ PagedKvMaps maps) {
  using L = Layout<kFp8, false, kPvFp8>;
  using Registers = RegisterSplit<kPvFp8>;
  constexpr int kKStages = L::kKStages, kVStages = L::kVStages;
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBarrierOffset);
  auto k_full = [&](int st) { return sm90::Mbarrier{bars + st}; };
  auto k_empty = [&](int st) { return sm90::Mbarrier{bars + kKStages + st}; };
  auto v_full = [&](int st) { return sm90::Mbarrier{bars + 2 * kKStages + st}; };
  auto v_empty = [&](int st) { return sm90::Mbarrier{bars + 2 * kKStages + kVStages + st}; };
  auto k_tile = [&](int st) { return smem + L::kKOffset + st * L::kKTileBytes; };
  auto v_tile = [&](int st) { return smem + L::kVOffset + st * L::kVTileBytes; };
  int* cand = reinterpret_cast<int*>(smem + L::kListOffset);
  int* list_phys = cand + kMaxCandidates;
  int* list_logical = list_phys + kMaxCandidates;
  uint32_t* list_mask = reinterpret_cast<uint32_t*>(list_logical + kMaxCandidates);
  int* warp_counts = reinterpret_cast<int*>(list_mask + kMaxCandidates);
  int* page_total = warp_counts + kThreadsPP / 32;

  CtaContext ctx;
  int chunk, group, tile_rows;
  // Uniform over the CTA.
  if (!make_context(a, blockIdx.x, blockIdx.y, ctx, chunk, group, tile_rows)) return;
  if (threadIdx.x == 0) init_ring_barriers<L, kPvFp8>(bars);
  int num_pages;
  if (a.q2k_indices != nullptr) {
    num_pages = build_sparse_page_list<kThreadsPP>(a, ctx, cand, list_phys, list_logical,
                                                   list_mask, warp_counts, page_total);
  } else {
    num_pages = ctx.chunk_end - ctx.chunk_begin;
  }
  __syncthreads();            // the page list and the barriers are ready

  auto page_of = [&](int idx) {
    return page_or_none(a, ctx, idx, num_pages, list_phys, list_logical, list_mask);
  };
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // Producer: warps 0-1 stream K, warps 2-3 stream V, each at its own pace (e4m3 P.V: TMA
    // copies, the four warps transposing V).
    sm90::registers_down<Registers::kProducer>();
    if constexpr (kPvFp8) {
      auto locate = [&](int idx, int& valid_rows) {
        const PageRef ref = page_of(idx);
        valid_rows = page_valid_rows(ctx, ref);
        return page_row(a, ctx.head, ref, valid_rows);
      };
      stream_pages_tma<L>(num_pages, threadIdx.x, smem, maps, locate, k_full, k_empty, k_tile,
                          v_full, v_empty, v_tile);
    } else {
      const int thread = threadIdx.x % kLoaders;
      const bool streams_k = threadIdx.x < kLoaders;
      const void* tensor = streams_k ? a.k : a.v;
      auto locate = [&](int idx, int& valid_rows) {
        const PageRef ref = page_of(idx);
        valid_rows = page_valid_rows(ctx, ref);
        return page_source(a, ctx.head, ref, tensor, kFp8 ? 1 : 2, valid_rows);
      };
      stream_pages<kFp8, L>(num_pages, streams_k, thread, smem, locate, k_full, k_empty, k_tile,
                            v_full, v_empty, v_tile);
    }
    return;
  }

  // Consumers. Q of their rows (warpgroup 1: rows 0-63 in the first block) is loaded while the
  // producer's first pages are in flight.
  sm90::registers_up<Registers::kConsumer>();
  if constexpr (kFp8) {
    load_raw_queries<L>(a, ctx, group, tile_rows, smem, threadIdx.x - 128);
  } else {
    load_queries<false, 256>(a, ctx, group, tile_rows, smem, threadIdx.x - 128);
  }
  sm90::fence_proxy_async_shared();   // Q (generic stores) is read by wgmma
  sm90::named_sync(kQueriesReady, 256);
  const int consumer = warpgroup - 1;                  // rows 64 consumer .. + 63
  const bool group_active = consumer * kWarpgroupRows < tile_rows;   // uniform per warpgroup
  const char* qs = smem + consumer * L::kQBytes;
  const TileView tile(a, ctx, group, tile_rows);
  Rows rows = tile.rows(a, ctx, consumer * kWarpgroupRows);
  const float scale_log2 = a.softmax_scale * kLog2e;

  float s[64], o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = o[i] = 0.f;
  // P of the previous page, for its P V in this turn. The wgmmas are issued on every turn,
  // whatever the page: a wgmma under a branch ptxas cannot prove uniform per warpgroup is
  // serialized. Skipped pages are zero-filled by the producer, and the first turn's P V reads
  // the bf16 Q tiles (32 KB, the size of a V tile) or e4m3's tile of zeros instead of a V stage
  // the producer may be writing.
  PendingPV<kFp8, kPvFp8> pending;
  pending.clear();
  sm90::RingState<kKStages> k_ring;
  sm90::RingState<kVStages> v_ring;  // the V stage of the page whose P V is issued this turn
  // Turns: warpgroup 1 issues first. Barrier 1 is warpgroup 1's turn (it syncs, 2 arrives),
  // barrier 2 warpgroup 2's; warpgroup 2 opens warpgroup 1's first turn, and skips its last
  // arrive so that no arrival is left over at the end.
  const int my_turn = 1 + consumer, other_turn = 2 - consumer;
  if (consumer == 1) sm90::named_arrive(1, 256);
  const int turns = num_pages + 1;                     // the last turn issues the last P V
  [[maybe_unused]] const bool lab_leader = threadIdx.x % 128 == 0;   // MSA_LAB_MARK
  // Each page's reference is read a turn ahead and settled at the top of its own turn: a dense
  // page's is a page-table load, whose latency would otherwise open every turn. It is issued
  // after the turn's fence for the async proxy (a MEMBAR, which waits for every load in flight)
  // and hides under the turn's wgmmas and softmax.
  auto early_ref = [&](int idx) {
    return page_or_none<false>(a, ctx, idx, num_pages, list_phys, list_logical, list_mask);
  };
  PageRef next_page = early_ref(0);
  const uint64_t first_desc_v = pending.descriptor_of(smem + (kFp8 ? L::kZerosOffset : 0));
  for (int t = 0; t < turns; ++t) {
    MSA_LAB_MARK(lab_leader, 2 + consumer, t, 0);
    const bool has_page = t < num_pages;
    const PageRef page = settle_page(a, next_page);
    bool active = false;
    if (has_page) {
      active = group_active && page.token_mask != 0;
      k_full(k_ring.index).wait(k_ring.phase);
    }
    // Every stage's full phase is waited for, pages skipped included, so the parity waits
    // never run a phase ahead of the V stream.
    if (t > 0) v_full(v_ring.index).wait(v_ring.phase);
    // K stages (and bf16 V stages) are written by cp.async (the generic proxy) and read by
    // wgmma (the async proxy); the e4m3 V producer fences its widening stores itself.
    sm90::fence_proxy_async_shared();
    MSA_LAB_MARK(lab_leader, 2 + consumer, t, 1);
    sm90::named_sync(my_turn, 256);
    MSA_LAB_MARK(lab_leader, 2 + consumer, t, 2);
    if constexpr (kFp8) {                             // past the last page: discarded
      issue_qk_raw(qs, k_tile(k_ring.index), s);
    } else {
      issue_qk<false>(qs, k_tile(k_ring.index), s);
    }
    pending.issue(t > 0 ? pending.descriptor_of(v_tile(v_ring.index)) : first_desc_v, o);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    if (consumer == 0 || t + 1 < turns) sm90::named_arrive(other_turn, 256);
    if (t + 1 < num_pages) next_page = early_ref(t + 1);
    MSA_LAB_MARK(lab_leader, 2 + consumer, t, 3);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    MSA_LAB_MARK(lab_leader, 2 + consumer, t, 4);
    if (has_page) {
      k_empty(k_ring.index).arrive();
      k_ring.advance();
    }
    if (t > 0) {
      v_empty(v_ring.index).arrive();                  // page t - 1's V stage is free
      v_ring.advance();
    }
    consume_turn(active, page, active && tile.fully_visible(page), scale_log2, rows, s, o,
                 pending);                             // O now holds P V up to page t - 1
    MSA_LAB_MARK(lab_leader, 2 + consumer, t, 5);
  }

  if (group_active) {
    tile.finalize(a, ctx, chunk_slot(a, ctx.request, chunk), consumer * kWarpgroupRows, rows,
                  scale_log2, o);
  }
}


// ---- Persistent ping-pong form (dense) -------------------------------------------------------
// One CTA per SM. The call's page sequences, one per (request, KV head, qo tile) of p(r) =
// max(1, the request's KV pages) pages (an empty request keeps one skipped page, so its rows are
// still written: O = 0, LSE = -inf), are laid end to end, request-major, and cut into `ctas`
// ranges of equal page counts from the live lengths (every CTA computes the same prefix over the
// requests). A CTA streams its range back to back: the producer runs on across sequences; a
// consumer finalizes a sequence's piece after the wait of the turn that issues its last P V, and
// loads the next piece's Q rows (cp.async) into the other of two slots while the current piece
// runs. A piece that is its whole sequence writes O directly; a sequence cut by a range boundary
// leaves one partial per piece, in slot 2c (the piece that opens CTA c's range) or 2c + 1 (the
// one that closes it), combined by decode_merge_persistent_kernel.

// p(r) into pages_before[r + 1] and the clamped lengths, then their prefix: every thread of the
// CTA calls it (two CTA barriers inside).
__device__ __forceinline__ void build_request_table(const DecodeAttentionArgs& a,
                                                    int64_t* pages_before, int* lengths) {
  for (int r = threadIdx.x; r < a.batch; r += blockDim.x) {
    const int len = max(__ldg(a.seqused_k + r), 0);
    lengths[r] = len;
    pages_before[r + 1] = max(1, request_table_pages(a, len));
  }
  __syncthreads();
  if (threadIdx.x < 32) {                    // warp 0: lane l scans one run of requests
    const int lane = threadIdx.x;
    const int per_lane = (a.batch + 31) / 32;
    const int begin = min(lane * per_lane, a.batch), end = min(begin + per_lane, a.batch);
    int64_t own = 0;
    for (int r = begin; r < end; ++r) own += pages_before[r + 1];
    int64_t running = detail::warp_inclusive_sum(own) - own;
    for (int r = begin; r < end; ++r) {
      running += pages_before[r + 1];
      pages_before[r + 1] = running;
    }
    if (lane == 0) pages_before[0] = 0;
  }
  __syncthreads();
}

// A page of the partition: its request, sequence within the request (KV head x tiles + qo tile)
// and page within the sequence (`pages` = p(request)).
struct Cursor {
  int request, seq, page, pages;

  __device__ __forceinline__ void seek(const Partition& part, int64_t g) {
    page = static_cast<int>(g - part.locate(g, request, seq, pages));
  }
  __device__ __forceinline__ void next_sequence(const Partition& part) {
    page = 0;
    if (++seq == part.seqs_per_request) {
      seq = 0;
      if (++request < part.batch) {
        pages = static_cast<int>(part.pages_before[request + 1] - part.pages_before[request]);
      }
    }
  }
  __device__ __forceinline__ void advance(const Partition& part) {
    if (++page == pages) next_sequence(part);
  }
  __device__ __forceinline__ int head(const Partition& part) const { return seq / part.tiles; }
};

// The cursor's page, settled: its page-table entry, or the skipped placeholder of an empty
// request (physical -1, no token).
__device__ __forceinline__ PageRef cursor_page(const DecodeAttentionArgs& a,
                                               const Partition& part, const Cursor& c) {
  PageRef ref;
  ref.logical = c.page;
  ref.physical = -1;
  ref.token_mask = 0;
  if (part.lengths[c.request] > 0) {
    ref.physical =
        __ldg(a.page_table + static_cast<int64_t>(c.request) * a.page_table_width + c.page);
    ref = settle_page(a, ref);
  }
  return ref;
}

// The context of the cursor's sequence (dense: one chunk, the whole request); tile_rows: its
// rows.
__device__ __forceinline__ CtaContext sequence_context(const DecodeAttentionArgs& a,
                                                       const Partition& part, const Cursor& c,
                                                       int& tile_rows) {
  CtaContext ctx;
  ctx.request = c.request;
  ctx.head = c.head(part);
  ctx.qo_tile = c.seq % part.tiles;
  tile_rows = fill_tile(a, ctx, a.num_qo_heads / a.num_kv_heads, part.lengths[c.request]);
  ctx.chunk_begin = 0;
  ctx.chunk_end = ctx.num_blocks;
  ctx.slot_chunks = false;
  return ctx;
}

// The partial slot of a piece that starts at `start` (turn `turn` of the CTA) and has
// `pages` pages in the CTA's range: -1 when it is its whole sequence (direct O).
__device__ __forceinline__ int64_t piece_slot(const Cursor& start, int pages, int turn) {
  if (start.page == 0 && pages == start.pages) return -1;
  return 2 * static_cast<int64_t>(blockIdx.x) + (turn > 0 ? 1 : 0);
}

// One consumer's Q rows of a tile (rows 64 consumer .. + 63, zero past tile_rows) into its block
// of a Q slot as the Q K^T wgmma reads it (bf16: 16-bit swizzled rows of two column blocks;
// e4m3: raw 128-byte swizzled rows), by its 128 threads with cp.async, as one committed group
// (cp.async.wait_group waits for committed groups only).
template <bool kFp8>
__device__ __forceinline__ void load_own_queries_async(const DecodeAttentionArgs& a,
                                                       const CtaContext& ctx, int group,
                                                       int tile_rows, int consumer, char* block,
                                                       int thread) {
  constexpr int kChunksPerRow = kFp8 ? 8 : 16;   // 16-byte chunks of a row as stored in q
  constexpr int kSteps = kWarpgroupRows * kChunksPerRow / 128;
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int c = thread + i * 128;
    const int local = c / kChunksPerRow, chunk = c % kChunksPerRow;
    const int row = consumer * kWarpgroupRows + local;
    const bool valid = row < tile_rows;
    const int r = ctx.first_row + (valid ? row : 0);
    const int token = r / group, qo_head = ctx.head * group + r % group;
    const char* src = static_cast<const char*>(a.q) +
        ((static_cast<int64_t>(ctx.request) * a.seqlen_q + token) * a.num_qo_heads + qo_head) *
            kHeadDim * (kFp8 ? 1 : 2) + chunk * 16;
    char* dst = kFp8 ? block + swizzled(local, chunk)
                     : block + (chunk / 8) * Shape<false>::kQBlockBytes +
                           swizzled(local, chunk % 8);
    cp_async_16_or_zero(dst, src, valid);
  }
  cp_async_commit();
}

template <bool kFp8, bool kPvFp8 = false>
__global__ void __launch_bounds__(kThreadsPP, 1) decode_attention_persistent_kernel(
    const DecodeAttentionArgs a, const __grid_constant__ PagedKvMaps maps) {
  using L = Layout<kFp8, true, kPvFp8>;
  using Registers = RegisterSplit<kPvFp8>;
  constexpr int kKStages = L::kKStages, kVStages = L::kVStages;
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBarrierOffset);
  auto k_full = [&](int st) { return sm90::Mbarrier{bars + st}; };
  auto k_empty = [&](int st) { return sm90::Mbarrier{bars + kKStages + st}; };
  auto v_full = [&](int st) { return sm90::Mbarrier{bars + 2 * kKStages + st}; };
  auto v_empty = [&](int st) { return sm90::Mbarrier{bars + 2 * kKStages + kVStages + st}; };
  auto k_tile = [&](int st) { return smem + L::kKOffset + st * L::kKTileBytes; };
  auto v_tile = [&](int st) { return smem + L::kVOffset + st * L::kVTileBytes; };
  int64_t* pages_before = reinterpret_cast<int64_t*>(smem + L::kListOffset);
  int* lengths = reinterpret_cast<int*>(pages_before + kDecodePersistentMaxRequests + 1);

  if (threadIdx.x == 0) init_ring_barriers<L, kPvFp8>(bars);
  build_request_table(a, pages_before, lengths);      // the barriers are ready after it too
  const int group = a.num_qo_heads / a.num_kv_heads;
  const Partition part(a, pages_before, lengths, gridDim.x);
  if (blockIdx.x == 0) {
    for (int r = threadIdx.x; r <= a.batch; r += blockDim.x) a.request_pages[r] = pages_before[r];
  }
  if (static_cast<int>(blockIdx.x) >= part.ctas) return;           // uniform over the CTA
  const int64_t first_page = part.cut(blockIdx.x);
  const int num_pages = static_cast<int>(part.cut(blockIdx.x + 1) - first_page);

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // Producer: warps 0-1 stream K, warps 2-3 stream V, across the range's sequences (e4m3
    // P.V: TMA copies, the four warps transposing V).
    sm90::registers_down<Registers::kProducer>();
    const int thread = threadIdx.x % kLoaders;
    const bool streams_k = threadIdx.x < kLoaders;
    const void* tensor = streams_k ? a.k : a.v;
    Cursor at;
    at.seek(part, first_page);
    if constexpr (kPvFp8) {
      auto locate = [&](int idx, int& valid_rows) {
        if (idx > 0) at.advance(part);
        const PageRef ref = cursor_page(a, part, at);
        valid_rows = min(kPageSize, max(part.lengths[at.request] - ref.logical * kPageSize, 0));
        return page_row(a, at.head(part), ref, valid_rows);
      };
      stream_pages_tma<L>(num_pages, threadIdx.x, smem, maps, locate, k_full, k_empty, k_tile,
                          v_full, v_empty, v_tile);
    } else {
      auto locate = [&](int idx, int& valid_rows) {
        if (idx > 0) at.advance(part);
        const PageRef ref = cursor_page(a, part, at);
        valid_rows = min(kPageSize, max(part.lengths[at.request] - ref.logical * kPageSize, 0));
        return page_source(a, at.head(part), ref, tensor, kFp8 ? 1 : 2, valid_rows);
      };
      stream_pages<kFp8, L>(num_pages, streams_k, thread, smem, locate, k_full, k_empty, k_tile,
                            v_full, v_empty, v_tile);
    }
    return;
  }

  // Consumers: the pieces one after the other, each as decode_attention_pp_kernel runs its
  // work item (pages + 1 turns, the last one issuing the last P V), then its finalize. A piece's
  // first P V (P = 0) reads the K stage its first turn waited for, bf16's stand-in for a V tile
  // (settled and finite, unlike a Q slot the next rows may be landing in), or e4m3's zeros.
  sm90::registers_up<Registers::kConsumer>();
  const int consumer = warpgroup - 1;                  // rows 64 consumer .. + 63 of a tile
  const int thread = threadIdx.x % 128;
  const int own_queries_ready = kQueriesReady + 1 + consumer;   // named barriers 4, 5
  auto q_block = [&](int slot) {
    return smem + slot * L::kQSlotBytes + consumer * L::kQBytes;
  };
  const float scale_log2 = a.softmax_scale * kLog2e;
  Cursor piece_start;                                  // the piece's first page
  piece_start.seek(part, first_page);
  int piece_turn = 0;                                  // its first page's index in the range
  int q_slot = 0;
  {
    int tile_rows;
    const CtaContext ctx = sequence_context(a, part, piece_start, tile_rows);
    load_own_queries_async<kFp8>(a, ctx, group, tile_rows, consumer, q_block(0), thread);
  }
  if constexpr (kFp8) {
    uint4* zeros = reinterpret_cast<uint4*>(smem + L::kZerosOffset);
    for (int i = threadIdx.x - 128; i < L::kZerosBytes / 16; i += 256) {
      zeros[i] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  cp_async_wait_all();
  sm90::fence_proxy_async_shared();
  sm90::named_sync(kQueriesReady, 256);                // both consumers' zeros and first rows

  float s[64], o[64];
  PendingPV<kFp8, kPvFp8> pending;
  sm90::RingState<kKStages> k_ring;
  sm90::RingState<kVStages> v_ring;
  const int my_turn = 1 + consumer, other_turn = 2 - consumer;
  if (consumer == 1) sm90::named_arrive(1, 256);
  // MSA_LAB_MARK: the CTA's turns counted across pieces (a piece's trailing turn included).
  [[maybe_unused]] const bool lab_leader = threadIdx.x % 128 == 0;
  [[maybe_unused]] int lab_turn = 0;
  while (true) {
    const int pages = min(piece_start.pages - piece_start.page, num_pages - piece_turn);
    const bool last_piece = piece_turn + pages == num_pages;
    int tile_rows;
    const CtaContext ctx = sequence_context(a, part, piece_start, tile_rows);
    const TileView tile(a, ctx, group, tile_rows);
    const bool group_active = consumer * kWarpgroupRows < tile_rows;   // uniform per warpgroup
    Rows rows = tile.rows(a, ctx, consumer * kWarpgroupRows);
    if (piece_turn > 0) {                              // this piece's rows (the first are in)
      cp_async_wait_all();
      sm90::fence_proxy_async_shared();
      sm90::named_sync(own_queries_ready, 128);
    }
    if (!last_piece) {                                 // the next piece's, into the other slot
      Cursor next = piece_start;
      next.next_sequence(part);
      int next_rows;
      const CtaContext next_ctx = sequence_context(a, part, next, next_rows);
      load_own_queries_async<kFp8>(a, next_ctx, group, next_rows, consumer, q_block(q_slot ^ 1),
                                   thread);
    }
    const char* qs = q_block(q_slot);
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] = o[i] = 0.f;
    pending.clear();
    // A piece stays within its sequence, so the page read ahead is an entry of one page-table
    // row: a pointer and an index, not a cursor (the turn loop runs at the register limit).
    const int* table_row = part.lengths[piece_start.request] > 0
        ? a.page_table + static_cast<int64_t>(piece_start.request) * a.page_table_width
        : nullptr;
    auto early_ref = [&](int logical) {
      PageRef ref;
      ref.logical = logical;
      ref.physical = table_row != nullptr ? __ldg(table_row + logical) : -1;
      ref.token_mask = 0;
      return ref;
    };
    PageRef next_page = early_ref(piece_start.page);
    for (int j = 0; j <= pages; ++j) {
      MSA_LAB_MARK(lab_leader, 2 + consumer, lab_turn, 0);
      const bool has_page = j < pages;
      const PageRef page = settle_page(a, next_page);
      bool active = false;
      if (has_page) {
        active = group_active && page.token_mask != 0;
        k_full(k_ring.index).wait(k_ring.phase);
      }
      if (j > 0) v_full(v_ring.index).wait(v_ring.phase);
      sm90::fence_proxy_async_shared();
      MSA_LAB_MARK(lab_leader, 2 + consumer, lab_turn, 1);
      sm90::named_sync(my_turn, 256);
      MSA_LAB_MARK(lab_leader, 2 + consumer, lab_turn, 2);
      const char* ks = k_tile(k_ring.index);          // past the piece's last page: discarded
      if constexpr (kFp8) {
        issue_qk_raw(qs, ks, s);
      } else {
        issue_qk<false>(qs, ks, s);
      }
      const char* first_v = kFp8 ? smem + L::kZerosOffset : ks;
      pending.issue(pending.descriptor_of(j > 0 ? v_tile(v_ring.index) : first_v), o);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      if (consumer == 0 || !(last_piece && j == pages)) sm90::named_arrive(other_turn, 256);
      if (j + 1 < pages) next_page = early_ref(next_page.logical + 1);
      MSA_LAB_MARK(lab_leader, 2 + consumer, lab_turn, 3);
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      MSA_LAB_MARK(lab_leader, 2 + consumer, lab_turn, 4);
      if (has_page) {
        k_empty(k_ring.index).arrive();
        k_ring.advance();
      }
      if (j > 0) {
        v_empty(v_ring.index).arrive();
        v_ring.advance();
      }
      consume_turn(active, page, active && tile.fully_visible(page), scale_log2, rows, s, o,
                   pending);
      MSA_LAB_MARK(lab_leader, 2 + consumer, lab_turn, 5);
      ++lab_turn;
    }
    if (group_active) {   // the context again, rather than live through the turns
      int done_rows;
      const CtaContext done = sequence_context(a, part, piece_start, done_rows);
      TileView(a, done, group, done_rows)
          .finalize(a, done, piece_slot(piece_start, pages, piece_turn), consumer * kWarpgroupRows,
                    rows, scale_log2, o);
    }
    if (last_piece) break;
    piece_start.next_sequence(part);
    piece_turn += pages;
    q_slot ^= 1;
  }
  cp_async_wait_all();                                 // no copy outlives its thread
}

}  // namespace pingpong

#else   // device code of any arch but sm_90a: the form's entry point only, never launched

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    decode_attention_wg_kernel(const DecodeAttentionArgs) {
  __trap();
}

namespace pingpong {
constexpr int kThreadsPP = 3 * 128;
template <bool kFp8, bool kPersistent = false, bool kPvFp8 = false>
struct Layout {
  static constexpr int kAlloc = 0;
};
template <bool kFp8, bool kPvFp8 = false>
__global__ void __launch_bounds__(kThreadsPP, 1) decode_attention_pp_kernel(
    const DecodeAttentionArgs, const __grid_constant__ PagedKvMaps) {
  __trap();
}
template <bool kFp8, bool kPvFp8 = false>
__global__ void __launch_bounds__(kThreadsPP, 1) decode_attention_persistent_kernel(
    const DecodeAttentionArgs, const __grid_constant__ PagedKvMaps) {
  __trap();
}
}  // namespace pingpong

#endif  // sm_90a
}  // namespace wg

// ---- Direct e4m3 form: a CTA streams a range of tiles ----------------------------------------
// The call's tiles (work item w of the schedule, KV head h: tile w * Hkv + h) are cut into
// gridDim.x equal ranges. A CTA streams its range's pages through one ring, tile after tile:
// the next tile's pages are in flight while a tile's last pairs compute and its rows are
// written, so a CTA pays one prologue for its range instead of one per tile (a sparse tile is
// just 16 pages: ~16 us of HBM time per SM against a few microseconds of prologue and drain).
// The tiles' contexts and (sparse) page lists are made in batches of at most kDirectMaxTiles
// tiles and kMaxCandidates q2k candidates; one batch covers a CTA's range whenever the range
// fits (at MTP 8 and G 16 up to B 128: <= 32 one-token tiles of top-16 a CTA).
//
// Within a tile: two pages per step (warp w owns keys 16w .. 16w + 15 of both pages; rows
// lane / 4 and lane / 4 + 8). (A 16-warp form, each warp computing one page of the pair, ran
// 2.6-2.8 TB/s against this form's 3.4: twice the warps but 1.4x the instructions a pair.) Key
// rows past the request's end are zero-filled on load. The ring's six stages are three pair
// slots, one cp.async group per pair (a tile has at least one pair: an empty tile still writes
// its rows). Per pair: one top barrier, one page-max exchange for both pages, then the pages
// fold in order (page 0, then page 1) exactly as two one-page steps would:
// O = alpha0 alpha1 O + beta0 alpha1 (P0 V0) + beta1 (P1 V1), each P against its page's max.
constexpr int kDirectSlots = kDirectStages / 2;
constexpr int kDirectMaxTiles = 32;   // a batch's tiles: one per lane of warp 0

struct DirectTile {
  CtaContext ctx;
  int chunk;
  int tile_rows;
  int num_cand;      // sparse: its q2k candidates, cand_begin .. cand_begin + num_cand - 1
  int cand_begin;
  int num_pages;     // pages it streams (sparse: its list, list_begin .. + num_pages - 1)
  int list_begin;
  int num_pairs;     // max(1, ceil(num_pages / 2))
};

// This CTA's tiles [f, f_end) of the call's num_work x Hkv (work item, KV head) tiles: an equal
// share over the grid, the first `extra` CTAs one more (the direct and token forms).
__device__ __forceinline__ void cta_tile_range(const DecodeAttentionArgs& a, int64_t& f,
                                               int64_t& f_end) {
  const int64_t total_tiles = static_cast<int64_t>(a.num_work) * a.num_kv_heads;
  const int64_t share = total_tiles / gridDim.x, extra = total_tiles % gridDim.x;
  f = blockIdx.x * share + min(static_cast<int64_t>(blockIdx.x), extra);
  f_end = f + share + (blockIdx.x < extra ? 1 : 0);
}

// A batch of a CTA's tiles in shared memory (the direct and token forms): their contexts, their page lists
// (the candidates, then per list entry the physical page, logical block and token mask) and the
// counters (per tile, per warp, then info: tiles kept, consumed, candidates; total).
struct TileBatch {
  int* cand;
  int* list_phys;
  int* list_logical;
  uint32_t* list_mask;
  DirectTile* tiles;
  int* tile_pages;
  int* warp_counts;
  int* info;

  __device__ __forceinline__ TileBatch(char* smem, int list_offset, int tiles_offset,
                                       int counts_offset, int warps)
      : cand(reinterpret_cast<int*>(smem + list_offset)),
        list_phys(cand + kMaxCandidates),
        list_logical(list_phys + kMaxCandidates),
        list_mask(reinterpret_cast<uint32_t*>(list_logical + kMaxCandidates)),
        tiles(reinterpret_cast<DirectTile*>(smem + tiles_offset)),
        tile_pages(reinterpret_cast<int*>(smem + counts_offset)),
        warp_counts(tile_pages + kDirectMaxTiles),
        info(warp_counts + warps) {}

  // This CTA's tiles [f, f_end) (cta_tile_range); the per-tile page counts start at zero.
  __device__ __forceinline__ void start(const DecodeAttentionArgs& a, int64_t& f,
                                        int64_t& f_end) const {
    cta_tile_range(a, f, f_end);
    if (threadIdx.x < kDirectMaxTiles) tile_pages[threadIdx.x] = 0;
  }
};

// Page idx of a tile's stream, or a skipped page past its end. Sparse refs come from the
// batch's lists, dense ones from the page table.
__device__ __forceinline__ PageRef direct_page(const DecodeAttentionArgs& a, const DirectTile& t,
                                               int idx, const TileBatch& batch) {
  if (idx >= t.num_pages) return PageRef{0, 0, 0u};
  return resolve_page(a, t.ctx, a.q2k_indices != nullptr ? t.list_begin + idx : idx,
                      batch.list_phys, batch.list_logical, batch.list_mask);
}

// Warp 0: the contexts of tiles f .. (at most kDirectMaxTiles, at most kMaxCandidates sparse
// candidates in all) into tiles[], corrupt work items left out. info[0]: tiles kept, info[1]:
// tiles consumed (kept or not), info[2]: candidates.
__device__ __forceinline__ void plan_direct_batch(const DecodeAttentionArgs& a, int64_t f,
                                                  int64_t f_end, DirectTile* tiles, int* info) {
  const int lane = threadIdx.x & 31;
  const int64_t mine = f + lane;
  DirectTile t;
  int group = 0;
  bool valid = false;
  int cand = 0;
  if (mine < f_end) {
    valid = make_context(a, static_cast<int>(mine / a.num_kv_heads),
                         static_cast<int>(mine % a.num_kv_heads), t.ctx, t.chunk, group,
                         t.tile_rows);
    if (valid && a.q2k_indices != nullptr) cand = sparse_candidates(a, t.ctx).count;
  }
  // A tile has <= 16 rows (<= 16 tokens) and <= topK <= 32 slots, so the first always fits.
  static_assert(kMaxCandidates >= 16 * 32, "a direct tile's candidates fit one batch");
  const int inclusive = detail::warp_inclusive_sum(cand);
  const bool taken = mine < f_end && inclusive <= kMaxCandidates;   // a prefix of the lanes
  const unsigned kept = __ballot_sync(0xFFFFFFFFu, taken && valid);
  if (taken && valid) {
    t.num_cand = cand;
    t.cand_begin = inclusive - cand;
    t.num_pages = a.q2k_indices != nullptr ? 0 : t.ctx.chunk_end - t.ctx.chunk_begin;
    t.list_begin = 0;
    t.num_pairs = max(1, (t.num_pages + 1) / 2);
    tiles[__popc(kept & ((1u << lane) - 1u))] = t;
  }
  const unsigned consumed = __ballot_sync(0xFFFFFFFFu, taken);
  const int last_kept = 31 - __clz(kept | 1u);
  const int total = __shfl_sync(0xFFFFFFFFu, inclusive, last_kept);
  if (lane == 0) {
    info[0] = __popc(kept);
    info[1] = __popc(consumed);
    info[2] = kept != 0 ? total : 0;
  }
}

// Sparse: every kept tile's page list (as build_sparse_page_list makes one tile's), end to end
// in tile order: tile i's distinct valid blocks at list_begin .. + num_pages - 1 in (token,
// slot) order of first appearance, or with kSlotMajor in (slot, token) order (every token's
// first choices first: a tile's tokens then share its list's stretches evenly). Threads 0 ..
// kNumThreads - 1 call it (warp_counts: one int per warp), meeting at list_barrier<kNumThreads,
// kBarrierId>; it ends with one.
template <int kNumThreads = kThreads, bool kSlotMajor = false, int kBarrierId = 0>
__device__ void build_direct_page_lists(const DecodeAttentionArgs& a, DirectTile* tiles,
                                        int num_tiles, int num_cand, int* cand, int* list_phys,
                                        int* list_logical, uint32_t* list_mask, int* tile_pages,
                                        int* warp_counts, int* total) {
  auto tile_of = [&](int c) {   // the tile whose candidates hold c
    int t = 0;
#pragma unroll
    for (int step = kDirectMaxTiles / 2; step > 0; step >>= 1) {
      if (t + step < num_tiles && tiles[t + step].cand_begin <= c) t += step;
    }
    return t;
  };
  for (int c = threadIdx.x; c < num_cand; c += kNumThreads) {
    const DirectTile& t = tiles[tile_of(c)];
    const SparseCandidates sc = sparse_candidates(a, t.ctx);
    int i = c - t.cand_begin;   // token-major: token i / num_slots, slot i % num_slots
    if constexpr (kSlotMajor) i = (i % t.ctx.num_tokens) * sc.num_slots + i / t.ctx.num_tokens;
    cand[c] = candidate_block(a, t.ctx, sc, i);
  }
  if (threadIdx.x == 0) *total = 0;
  list_barrier<kNumThreads, kBarrierId>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int base = 0; base < num_cand; base += kNumThreads) {
    const int c = base + threadIdx.x;
    int id = -1, physical = -1, tile = 0;
    uint32_t mask = 0;
    bool leader = false;
    if (c < num_cand && (id = cand[c]) >= 0) {
      tile = tile_of(c);
      const DirectTile& t = tiles[tile];
      leader = first_of_block<kSlotMajor>(a, t.ctx, cand, t.cand_begin, t.num_cand,
                                          sparse_candidates(a, t.ctx).num_slots, c, id, mask,
                                          physical);
    }
    const int offset = append_position<kNumThreads, kBarrierId>(leader, warp_counts, total);
    if (leader) {
      list_phys[offset] = physical;
      list_logical[offset] = id;
      list_mask[offset] = mask;
      atomicAdd(tile_pages + tile, 1);
    }
  }
  list_barrier<kNumThreads, kBarrierId>();
  // The lists are in tile order, so tile i's begins after the pages of tiles 0 .. i - 1.
  if (warp == 0) {
    const int pages = lane < num_tiles ? tile_pages[lane] : 0;
    const int inclusive = detail::warp_inclusive_sum(pages);
    if (lane < num_tiles) {
      tiles[lane].num_pages = pages;
      tiles[lane].list_begin = inclusive - pages;
      tiles[lane].num_pairs = max(1, (pages + 1) / 2);
      tile_pages[lane] = 0;   // zero again for the next batch
    }
  }
  list_barrier<kNumThreads, kBarrierId>();
}

// One step of a tile: pages page[0] and page[1], landed at k8[0] and k8[1] (K, then V).
__device__ __forceinline__ void direct_pair_step(
    const PageRef (&page)[2], const char* const (&k8)[2], float* warp_page_max,
    const uint32_t (&qf)[kHeadDim / 16][4], const int (&row_token)[2],
    const int (&row_last_key)[2], float scale_log2, float (&acc)[16][4], float (&row_max)[2],
    float (&row_sum)[2]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int key_base = warp * 16;
  float s[2][2][4];
  direct_qk_two_pages(k8, key_base, lane, qf, s);

  // Mask (causal against seqused_k, the selection per token, skipped pages), page maxima
  // over this warp's keys.
  float page_max[2][2];
#pragma unroll
  for (int pl = 0; pl < 2; ++pl) {
    const PageRef& ref = page[pl];
    int last_key[2];
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      const bool selected = (ref.token_mask >> row_token[i2]) & 1u;
      last_key[i2] = selected ? row_last_key[i2] - ref.logical * kPageSize : -1;
      page_max[pl][i2] = -INFINITY;
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key_base + n * 8 + (lane & 3) * 2 + (e & 1);
        const float v =
            key <= last_key[e >> 1] ? s[pl][n][e] * (scale_log2 * kLabKScale) : -INFINITY;
        s[pl][n][e] = v;
        page_max[pl][e >> 1] = fmaxf(page_max[pl][e >> 1], v);
      }
    }
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      page_max[pl][i2] =
          fmaxf(page_max[pl][i2], __shfl_xor_sync(0xFFFFFFFFu, page_max[pl][i2], 1));
      page_max[pl][i2] =
          fmaxf(page_max[pl][i2], __shfl_xor_sync(0xFFFFFFFFu, page_max[pl][i2], 2));
    }
  }
  // Both pages' maxima over all warps: [page][row][warp], so a row's eight warps are two
  // 16-byte reads.
  static_assert(kWarps == 8, "a row's warp maxima are read as two float4");
  if ((lane & 3) == 0) {
#pragma unroll
    for (int pg = 0; pg < 2; ++pg) {
      warp_page_max[(pg * 16 + (lane >> 2)) * kWarps + warp] = page_max[pg][0];
      warp_page_max[(pg * 16 + (lane >> 2) + 8) * kWarps + warp] = page_max[pg][1];
    }
  }
  __syncthreads();
#pragma unroll
  for (int pg = 0; pg < 2; ++pg) {
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      const float4* row_max4 = reinterpret_cast<const float4*>(
          warp_page_max + (pg * 16 + (lane >> 2) + i2 * 8) * kWarps);
      const float4 lo = row_max4[0], hi = row_max4[1];
      page_max[pg][i2] = fmaxf(fmaxf(fmaxf(lo.x, lo.y), fmaxf(lo.z, lo.w)),
                               fmaxf(fmaxf(hi.x, hi.y), fmaxf(hi.z, hi.w)));
    }
  }

  // Fold page 0 then page 1 into the running max: O's rescale and each page's P scale.
  float alpha[2], p_scale[2][2];
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    const float m0 = fmaxf(row_max[i2], page_max[0][i2]);
    const float a0 = row_max[i2] == -INFINITY ? 0.f : exp2_ftz(row_max[i2] - m0);
    const float b0 = page_max[0][i2] == -INFINITY ? 0.f : exp2_ftz(page_max[0][i2] - m0);
    const float m1 = fmaxf(m0, page_max[1][i2]);
    const float a1 = m0 == -INFINITY ? 0.f : exp2_ftz(m0 - m1);
    const float b1 = page_max[1][i2] == -INFINITY ? 0.f : exp2_ftz(page_max[1][i2] - m1);
    alpha[i2] = a0 * a1;
    p_scale[0][i2] = b0 * a1;
    p_scale[1][i2] = b1;
    row_max[i2] = m1;
#pragma unroll
    for (int pg = 0; pg < 2; ++pg) {
      if (page_max[pg][i2] == -INFINITY) page_max[pg][i2] = 0.f;   // exp2(-inf - 0) = 0
    }
  }
  float page_sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
  for (int pg = 0; pg < 2; ++pg) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2_ftz(s[pg][n][e] - page_max[pg][e >> 1]);
        page_sum[pg][e >> 1] += p;
        s[pg][n][e] = p;
      }
    }
  }
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    row_sum[i2] = row_sum[i2] * alpha[i2] + p_scale[0][i2] * page_sum[0][i2] +
                  p_scale[1][i2] * page_sum[1][i2];
  }
  if (!__all_sync(0xFFFFFFFFu, alpha[0] == 1.f && alpha[1] == 1.f)) scale_rows(acc, alpha);
  // Skipped pages were not loaded: their stage holds stale bytes, never multiplied.
#pragma unroll
  for (int pg = 0; pg < 2; ++pg) {
    if (page[pg].token_mask != 0) {
      direct_pv_page(k8[pg] + kPageSize * kHeadDim, key_base, lane, s[pg], p_scale[pg][0],
                     p_scale[pg][1], acc);
    }
  }
}

// Direct form: the warps' partial accumulators of half the rows, [warp][8 rows][8 column groups
// of 17 floats] (the permuted writes and the natural reads hit at most two threads per bank),
// then the warps' row sums [warp][16], in the stage of the tile's last pair.
constexpr int kDirectPartRow = 8 * 17 + 1;
constexpr int kDirectPartBytes = (kWarps * 8 * kDirectPartRow + kWarps * 16) * 4;
static_assert(kDirectPartBytes <= 2 * kPageFp8Bytes,
              "direct e4m3: a half tile's partials fit a pair slot");

// A finished tile: adds the warps' partial accumulators and sums (every warp folded with the
// same running maxima), half the rows at a time in `scratch` (the stage of the tile's last pair,
// free until the next pair's top barrier), each warp then writing 16 channels of each row: the
// normalized O and the LSE (natural log), or the fp32 partial of a split request. Rows that saw
// no key get O = 0, LSE = -inf.
__device__ __forceinline__ void direct_finish_tile(const DecodeAttentionArgs& a,
                                                   const DirectTile& t, float* scratch,
                                                   const float (&acc)[16][4],
                                                   const float (&row_max)[2],
                                                   float (&row_sum)[2]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = a.num_qo_heads / a.num_kv_heads;
  add_quad_sums(row_sum);
  const int64_t slot = a.split_kv ? static_cast<int64_t>(__ldg(a.merge_indptr + t.ctx.request)) +
                                        t.chunk
                                  : -1;
  const bool writable = !a.split_kv || (slot >= 0 && slot < a.num_partial_slots);
  float* part_sum = scratch + kWarps * 8 * kDirectPartRow;
  __syncthreads();   // every warp is done with the last pair's pages
  if ((lane & 3) == 0) {
    part_sum[warp * 16 + (lane >> 2)] = row_sum[0];
    part_sum[warp * 16 + 8 + (lane >> 2)] = row_sum[1];
  }
  const int r8 = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (half == 1) __syncthreads();   // the first half is read
    // n-tile n, column 2 quad + e holds channel 16 (2 quad + e) + n
    float* mine = scratch + (warp * 8 + r8) * kDirectPartRow;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      mine[17 * (2 * quad) + n] = acc[n][half * 2];
      mine[17 * (2 * quad + 1) + n] = acc[n][half * 2 + 1];
    }
    __syncthreads();
    // This warp's channels 16 warp + 4 quad + j of row r8 of the half.
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float* src = scratch + (w * 8 + r8) * kDirectPartRow + 17 * warp + 4 * quad;
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j] += src[j];
      sum += part_sum[w * 16 + half * 8 + r8];
    }
    const int row = half * 8 + r8;
    if (!writable || row >= t.tile_rows) continue;
    const int r = t.ctx.first_row + row;
    const int token = r / group, qo_head = t.ctx.head * group + r % group;
    // Only a zero sum means "no visible key": a NaN sum (a NaN or +inf score) gives NaN O and
    // LSE, never the empty row's O = 0, LSE = -inf.
    const bool empty = sum == 0.f;
    const float inv = empty ? 0.f : kLabVScale / sum;
    const float lse = empty ? -INFINITY : (row_max[half] + log2f(sum)) * kLn2;
    const int channel = 16 * warp + 4 * quad;
    const bool writes_lse = warp == 0 && quad == 0;
    if (a.split_kv) {
      const int64_t idx = (slot * a.seqlen_q + token) * a.num_qo_heads + qo_head;
      *reinterpret_cast<float4*>(a.o_partial + idx * kHeadDim + channel) =
          make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
      if (writes_lse) a.lse_partial[idx] = lse;
    } else {
      const int64_t idx =
          (static_cast<int64_t>(t.ctx.request) * a.seqlen_q + token) * a.num_qo_heads + qo_head;
      const __nv_bfloat162 lo = __floats2bfloat162_rn(o[0] * inv, o[1] * inv);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(o[2] * inv, o[3] * inv);
      *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(a.out) + idx * kHeadDim + channel) =
          make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                     *reinterpret_cast<const uint32_t*>(&hi));
      if (writes_lse && a.lse != nullptr) a.lse[idx] = lse;
    }
  }
}

// Direct e4m3 form (tiles of <= 16 rows, e4m3 Q and K/V): see the section comment above and the
// file comment (fragment layouts). Shared memory: the ring, the lists, the page maxima, the
// batch's tiles and counters.
constexpr int kDirectListOffset = kDirectRingBytes;
constexpr int kDirectMaxOffset = kDirectListOffset + kListBytes;
constexpr int kDirectTilesOffset = kDirectMaxOffset + 2 * 16 * kWarps * 4;
constexpr int kDirectCountsOffset =
    kDirectTilesOffset + kDirectMaxTiles * static_cast<int>(sizeof(DirectTile));
constexpr int kDirectSmemBytes = kDirectCountsOffset + (kDirectMaxTiles + kWarps + 4) * 4;
static_assert(kDirectSmemBytes <= 227 * 1024, "direct e4m3: shared memory per CTA");
static_assert(kDirectMaxOffset % 16 == 0 && kDirectTilesOffset % 16 == 0,
              "direct e4m3: the page maxima are read as float4");

__global__ void __launch_bounds__(kThreads, 1)
    decode_attention_direct_kernel(const DecodeAttentionArgs a) {
  extern __shared__ __align__(128) char smem[];
  char* const ring = smem;
  float* const warp_page_max = reinterpret_cast<float*>(smem + kDirectMaxOffset);
  const TileBatch batch(smem, kDirectListOffset, kDirectTilesOffset, kDirectCountsOffset, kWarps);

  const int lane = threadIdx.x & 31;
  const int group = a.num_qo_heads / a.num_kv_heads;
  const float scale_log2 = a.softmax_scale * kLog2e;
  int64_t f, f_end;
  batch.start(a, f, f_end);
  auto stage_of = [&](unsigned pair, int pg) {   // ring position -> its pair slot's page pg
    return ring + ((pair % kDirectSlots) * 2 + pg) * kPageFp8Bytes;
  };
  unsigned issued = 0, computed = 0;   // pairs issued / computed since the kernel began

  while (f < f_end) {
    __syncthreads();   // the last batch's tiles and lists are no longer read
    if (threadIdx.x < 32) plan_direct_batch(a, f, f_end, batch.tiles, batch.info);
    __syncthreads();
    const int num_tiles = batch.info[0];
    f += batch.info[1];
    if (a.q2k_indices != nullptr) {
      build_direct_page_lists(a, batch.tiles, num_tiles, batch.info[2], batch.cand,
                              batch.list_phys, batch.list_logical, batch.list_mask,
                              batch.tile_pages, batch.warp_counts, batch.info + 3);
    }
    if (num_tiles == 0) continue;

    // The issue side runs kDirectSlots - 1 pairs ahead of the compute side, across tiles (the
    // last batch's trailing groups were empty: its ring positions are free).
    int issue_tile = 0, issue_pair = 0;
    issued = computed;
    auto issue = [&]() {   // one cp.async group per pair, empty past the batch's last tile
      if (issue_tile < num_tiles) {
        const DirectTile& t = batch.tiles[issue_tile];
#pragma unroll
        for (int pg = 0; pg < 2; ++pg) {
          const PageRef ref = direct_page(a, t, 2 * issue_pair + pg, batch);
          load_page_fp8_swizzled(a, t.ctx.head, ref, stage_of(issued, pg),
                                 page_valid_rows(t.ctx, ref));
        }
        if (++issue_pair == t.num_pairs) {
          issue_pair = 0;
          ++issue_tile;
        }
      }
      cp_async_commit();
      ++issued;
    };
#pragma unroll
    for (int p = 0; p < kDirectSlots - 1; ++p) issue();

    uint4 q_raw[2][2];   // the next tile's Q, loaded a tile ahead
    load_query_raw_fp8(a, batch.tiles[0].ctx, group, batch.tiles[0].tile_rows, q_raw);
    for (int ti = 0; ti < num_tiles; ++ti) {
      const DirectTile t = batch.tiles[ti];
      uint32_t qf[kHeadDim / 16][4];
      widen_query_fp8(q_raw, qf);
      if (ti + 1 < num_tiles) {
        load_query_raw_fp8(a, batch.tiles[ti + 1].ctx, group, batch.tiles[ti + 1].tile_rows,
                           q_raw);
      }
      // Rows lane / 4 and lane / 4 + 8: their token and last visible key (-1: none).
      int row_token[2], row_last_key[2];
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        const int row = (lane >> 2) + i2 * 8;
        // Clamped so the token-mask shift stays < 32 for padding rows (masked off anyway).
        row_token[i2] = min((t.ctx.first_row + row) / group, 31);
        const int last = min(t.ctx.seqlen_k - 1, row_token[i2] + t.ctx.seqlen_k - a.seqlen_q);
        row_last_key[i2] = row < t.tile_rows ? last : -1;
      }
      float acc[16][4];
#pragma unroll
      for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
      float row_max[2] = {-INFINITY, -INFINITY};
      float row_sum[2] = {0.f, 0.f};

      for (int p = 0; p < t.num_pairs; ++p) {
        // This pair has landed; after the barrier every warp is done with the previous pair,
        // whose slot takes the pair kDirectSlots - 1 ahead.
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kDirectSlots - 2) : "memory");
        __syncthreads();
        issue();
        const PageRef page[2] = {
            direct_page(a, t, 2 * p, batch), direct_page(a, t, 2 * p + 1, batch)};
        const char* k8[2] = {stage_of(computed, 0), stage_of(computed, 1)};
        direct_pair_step(page, k8, warp_page_max, qf, row_token, row_last_key, scale_log2, acc,
                         row_max, row_sum);
        ++computed;
      }
      direct_finish_tile(a, t, reinterpret_cast<float*>(stage_of(computed - 1, 0)), acc,
                         row_max, row_sum);
    }
  }
  cp_async_wait_all();
}

// ---- Token-warps forms (sparse tiles of more than 16 rows, e4m3 q and K/V, sm_90a) ---------
// A sparse tile of 8 tokens x G 16 streams the union of its tokens' selections, but each token
// selected only topK of those pages: the ping-pong form computes all 128 rows against every
// union page (at 4k keys about twice the work the selections ask for), and 16-row query tiles
// read a page once for every token that chose it. Here each of eight consumer warps owns 16
// rows (one token at G = 16) with their Q in registers and computes a page only where its
// rows' tokens selected it: all 128 keys of the page (16 independent QK^T chains on f16
// mma.sync), the page's softmax within the warp (it holds whole rows: no exchange; the
// warpgroup forms' page softmax and row state), then P.V over the page's 128 keys (P rounded to
// e4m3 against the page max, scaled by exp(page max - running max) in f16, as the direct and
// warpgroup forms round it). The union's pages arrive once each by TMA
// from one thread of a producer warpgroup. A warp waits for every page (so no warp arrives a
// round ahead on an empty barrier) but computes only its own, so the warps drift apart within
// the ring and a page costs the SM about the work of the tokens that chose it. The lists are
// slot-major (each token's first choices first), which spreads every token's pages evenly
// along the union: with token-major lists one warp's sixteen pages come first and hold the ring
// (tools/lab/model_decode_token_warps.py, 32-800 blocks: 1.11-1.26x the ideal time slot-major
// with six stages, 1.22-2.49x token-major). Tiles come from the CTA's range and batches as the
// direct form's; a tile writes O, or its chunk's partial of a split plan.
//
// The raw e4m3 pages stream through a ring of six (the direct form's swizzle is the 128-byte
// TMA swizzle); each warp widens its pages' K and V fragments in registers (the direct form's
// fragment orders). A warp's page is ~1400 SASS, 566 of them F2FP, so where F2FP is slow the
// widening, repeated by every warp that chose the page, sets the pace. Rows past a request's
// keys arrive as the pool holds them: masked scores, V read as zeros on the request's last page.
// benchmarks/lab/sm90_pipe_rates.cu measures the widening rates, and
// benchmarks/lab/decode_sparse_mtp_forms.cu the forms.
enum TokenWarpsForm : int { kTwOff = 0, kTwPerWarp = 1 };
constexpr int kTwConsumers = 8;                         // warpgroups 0-1
constexpr int kTwConsumerThreads = kTwConsumers * 32;
constexpr int kTwThreads = kTwConsumerThreads + 128;      // + the producer warpgroup

// Shared memory: the consumers' ring of raw pages, its barriers (full, then empty), the batch's
// lists, tiles and counters. setmaxnreg moves registers within the launch allocation (384
// threads x 168): the consumers hold S, O and Q's fragments (160 registers) besides the page's
// addresses.
struct TwLayout {
  static constexpr int kStages = 6;
  static constexpr int kStageBytes = kPageFp8Bytes;
  static constexpr int kBarrierOffset = kStages * kStageBytes;
  static constexpr int kListOffset = kBarrierOffset + (2 * kStages + 1) / 2 * 16;
  static constexpr int kTilesOffset = kListOffset + kListBytes;
  static constexpr int kCountsOffset =
      kTilesOffset + kDirectMaxTiles * static_cast<int>(sizeof(DirectTile));
  static constexpr int kBytes = kCountsOffset + (kDirectMaxTiles + kTwConsumers + 4) * 4;
  static constexpr int kAlloc = kBytes + 1024;           // room to align the ring to 1024 bytes
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static_assert(kAlloc <= 227 * 1024, "token warps: shared memory per CTA");
  static_assert(kListOffset % 16 == 0 && kTilesOffset % 16 == 0,
                "token warps: the lists and tiles are aligned");
  static_assert(128 * kProducerRegisters + kTwConsumerThreads * kConsumerRegisters <=
                    kTwThreads * 168,
                "token warps: the register split must fit the launch allocation");
};

// Lab hook (benchmarks/lab/decode_sparse_mtp_forms.cu builds this file with it):
// MSA_LAB_TW_TIMELINE records clock64 stamps of CTA 0's first kTwLabPages pages per warp (0-7:
// the consumers: before and after the page's full wait, after its compute or skip; 8: the
// producer: before and after the empty wait, after the copies' issue).
#ifdef MSA_LAB_TW_TIMELINE
constexpr int kTwLabPages = 64;
__device__ long long lab_tw_timeline[kTwConsumers + 1][kTwLabPages][3];
__device__ int lab_tw_computed[kTwConsumers][kTwLabPages];
#define MSA_LAB_TW_MARK(leader, actor, page, mark)                                        \
  do {                                                                                    \
    if ((leader) && blockIdx.x == 0 && (page) < kTwLabPages) {                            \
      lab_tw_timeline[actor][page][mark] = clock64();                                     \
    }                                                                                     \
  } while (0)
#else
#define MSA_LAB_TW_MARK(leader, actor, page, mark) \
  do {                                             \
  } while (0)
#endif

// setmaxnreg and TMA copies are sm_90a code here: other archs compile just the kernel's entry
// point (a trap; the launcher asks for the forms only where the sm_90a image is loaded).
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A token batch's list entry e: physical page, logical block, token mask.
__device__ __forceinline__ PageRef list_page(const TileBatch& batch, int e) {
  return PageRef{batch.list_phys[e], batch.list_logical[e], batch.list_mask[e]};
}

// The token forms' consumer warps (kTwConsumerThreads): warp 0 plans the batch of tiles from f
// and all of them make its page lists (slot-major), meeting at kListBarrier; then every thread of
// the CTA meets at kBatchBarrier (the producer warpgroup waits there for the lists).
template <int kListBarrier, int kBatchBarrier>
__device__ __forceinline__ void make_token_batch(const DecodeAttentionArgs& a, int64_t f,
                                                 int64_t f_end, const TileBatch& batch) {
  if (threadIdx.x < 32) plan_direct_batch(a, f, f_end, batch.tiles, batch.info);
  sm90::named_sync(kListBarrier, kTwConsumerThreads);
  build_direct_page_lists<kTwConsumerThreads, true, kListBarrier>(
      a, batch.tiles, batch.info[0], batch.info[2], batch.cand, batch.list_phys,
      batch.list_logical, batch.list_mask, batch.tile_pages, batch.warp_counts, batch.info + 3);
  sm90::named_sync(kBatchBarrier, kTwThreads);
}

// A token warp's page softmax and O's rescale, the warpgroup forms' (S holds the m16n8
// accumulators of the page's 16 key n-tiles, the same layout as a warpgroup's m64n128 one):
// P against the page max, beta its rows' scale, the rows' reference max and sum advance.
__device__ __forceinline__ void token_warp_softmax(const PageRef& page, float scale_log2,
                                                   wg::Rows& rows, float (&s)[16][4],
                                                   float (&acc)[16][4], float (&beta)[2]) {
  float alpha[2];
  wg::page_probabilities<true>(page, false, scale_log2, rows,
                               *reinterpret_cast<float(*)[64]>(&s[0][0]), alpha, beta);
  wg::rescale(*reinterpret_cast<float(*)[64]>(&acc[0][0]), alpha);
}

// kTwPerWarp: one page of a token warp: S = Q K^T over the page's 128 keys for the warp's 16
// rows (rows lane / 4 and lane / 4 + 8) from the raw page, the softmax, then O += (beta P) V.
// kTail: the page ends the request's keys at valid_rows, and V rows past them read as zeros.
template <bool kTail>
__device__ __forceinline__ void token_warp_page(const char* k8, const char* v8, int lane,
                                                const uint32_t (&qf)[kHeadDim / 16][4],
                                                const PageRef& page, int valid_rows,
                                                float scale_log2, wg::Rows& rows,
                                                float (&acc)[16][4]) {
  float s[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    const int key = n * 8 + (lane >> 2);
    const uint4 k_raw[2] = {swizzled_chunk(k8, key, (lane & 3) * 2),
                            swizzled_chunk(k8, key, (lane & 3) * 2 + 1)};
#pragma unroll
    for (int kd = 0; kd < kHeadDim / 16; ++kd) {
      const uint32_t w = word_of(k_raw, kd);
      mma_f16(s[n], qf[kd], widen_lo<kLabKByAlu>(w), widen_hi<kLabKByAlu>(w));
    }
  }
  float beta[2];
  token_warp_softmax(page, scale_log2, rows, s, acc, beta);
#pragma unroll
  for (int kk = 0; kk < kPageSize / 16; ++kk) {
    const float(&s2)[2][4] = *reinterpret_cast<const float(*)[2][4]>(&s[2 * kk][0]);
    direct_pv_page<kTail>(v8, 16 * kk, lane, s2, beta[0], beta[1], acc, valid_rows);
  }
}

// kTwPerWarp: a token warp's finished rows (16 of the tile, rows row_base + lane / 4 and + 8)
// as wg::TileView::finalize writes a warpgroup's (the same O, LSE and empty rows), from P.V's
// permuted output order (n-tile n, column c = 2t + e is channel 16c + n): this thread holds
// channels 32t .. 32t + 31 of each row.
__device__ __forceinline__ void token_warp_store(const DecodeAttentionArgs& a,
                                                 const DirectTile& t, int row_base,
                                                 const wg::Rows& rows, float scale_log2,
                                                 const float (&acc)[16][4]) {
  const int lane = threadIdx.x & 31, quad = lane & 3;
  const int group = a.num_qo_heads / a.num_kv_heads;
  const int64_t slot = wg::chunk_slot(a, t.ctx.request, t.chunk);
  if (slot == wg::kCorruptSlot) return;
  float row_sum[2] = {rows.sum[0], rows.sum[1]};
  add_quad_sums(row_sum);
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    const int row = row_base + (lane >> 2) + i2 * 8;
    if (row >= t.tile_rows) continue;
    const int r = t.ctx.first_row + row;
    const int token = r / group, qo_head = t.ctx.head * group + r % group;
    const bool empty = !(row_sum[i2] > 0.f);
    const float inv = empty ? 0.f : kLabVScale / row_sum[i2];   // (the lab's O x 2^-8)
    const float lse = empty ? -INFINITY
                            : (rows.max[i2] * scale_log2 + log2f(row_sum[i2])) * kLn2;
    const int channel = 32 * quad;
    if (slot >= 0) {
      const int64_t idx = (slot * a.seqlen_q + token) * a.num_qo_heads + qo_head;
      float4* o = reinterpret_cast<float4*>(a.o_partial + idx * kHeadDim + channel);
#pragma unroll
      for (int half = 0; half < 2; ++half) {   // channels 32t + 16 half + n: acc[n][2 i2 + half]
#pragma unroll
        for (int n = 0; n < 16; n += 4) {
          o[4 * half + n / 4] =
              make_float4(acc[n][2 * i2 + half] * inv, acc[n + 1][2 * i2 + half] * inv,
                          acc[n + 2][2 * i2 + half] * inv, acc[n + 3][2 * i2 + half] * inv);
        }
      }
      if (quad == 0) a.lse_partial[idx] = lse;
    } else {
      const int64_t idx =
          (static_cast<int64_t>(t.ctx.request) * a.seqlen_q + token) * a.num_qo_heads + qo_head;
      uint4* o = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.out) + idx * kHeadDim +
                                          channel);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int n = 0; n < 16; n += 8) {
          const int c = 2 * i2 + half;
          o[2 * half + n / 8] = make_uint4(pack_bf16(acc[n][c] * inv, acc[n + 1][c] * inv),
                                           pack_bf16(acc[n + 2][c] * inv, acc[n + 3][c] * inv),
                                           pack_bf16(acc[n + 4][c] * inv, acc[n + 5][c] * inv),
                                           pack_bf16(acc[n + 6][c] * inv, acc[n + 7][c] * inv));
        }
      }
      if (quad == 0 && a.lse != nullptr) a.lse[idx] = lse;
    }
  }
}

__global__ void __launch_bounds__(kTwThreads, 1)
    decode_attention_token_warps_kernel(const DecodeAttentionArgs a,
                                        const __grid_constant__ wg::PagedKvMaps maps) {
  using L = TwLayout;
  constexpr int kProducerWarp = kTwConsumers;   // the producer warpgroup's first warp copies
  constexpr int kBatchBarrier = 1;              // all threads: a batch's lists are ready / done
  constexpr int kListBarrier = 2;               // the consumers, while they make the lists
  extern __shared__ __align__(1024) char smem_raw[];
  char* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + L::kBarrierOffset);
  auto full = [&](int stage) { return sm90::Mbarrier{bars + stage}; };
  auto empty = [&](int stage) { return sm90::Mbarrier{bars + L::kStages + stage}; };
  auto stage_of = [&](int stage) { return smem + stage * L::kStageBytes; };
  const TileBatch batch(smem, L::kListOffset, L::kTilesOffset, L::kCountsOffset, kTwConsumers);
  int64_t f, f_end;
  batch.start(a, f, f_end);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool producer = warp >= kTwConsumers;
  if (threadIdx.x == 0) {
    for (int st = 0; st < L::kStages; ++st) {
      full(st).init(1);   // the copy's arrival and bytes
      empty(st).init(kTwConsumerThreads);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  // The producer and every consumer thread walk the same ring positions, one per list page,
  // across tiles and batches (the producer: lane 0 of its first warp alone).
  sm90::RingState<L::kStages> pos;
#ifdef MSA_LAB_TW_TIMELINE
  int lab_page = 0;   // the CTA's pages so far
#define LAB_TW_NEXT_PAGE() ++lab_page
#else
#define LAB_TW_NEXT_PAGE() \
  do {                     \
  } while (0)
#endif

  if (producer) {
    sm90::registers_down<L::kProducerRegisters>();
    while (f < f_end) {
      sm90::named_sync(kBatchBarrier, kTwThreads);   // the batch's lists are ready
      const int num_tiles = batch.info[0];
      f += batch.info[1];
      // Copies list page e (its tile ti) into `stage`, counted on `bar`.
      auto copy = [&](int ti, int e, char* stage, const sm90::Mbarrier& bar) {
        const int row =
            (batch.list_phys[e] * a.num_kv_heads + batch.tiles[ti].ctx.head) * kPageSize;
        bar.arrive_expect_tx(kPageFp8Bytes);
        sm90::tma_load_2d(stage, maps.k, 0, row, bar);
        sm90::tma_load_2d(stage + kPageSize * kHeadDim, maps.v, 0, row, bar);
      };
      if (warp == kProducerWarp && lane == 0) {
        for (int ti = 0; ti < num_tiles; ++ti) {
          const int end = batch.tiles[ti].list_begin + batch.tiles[ti].num_pages;
          for (int e = batch.tiles[ti].list_begin; e < end; ++e) {
            MSA_LAB_TW_MARK(true, kTwConsumers, lab_page, 0);
            empty(pos.index).wait(pos.phase ^ 1u);
            MSA_LAB_TW_MARK(true, kTwConsumers, lab_page, 1);
            copy(ti, e, stage_of(pos.index), full(pos.index));
            MSA_LAB_TW_MARK(true, kTwConsumers, lab_page, 2);
            pos.advance();
            LAB_TW_NEXT_PAGE();
          }
        }
      }
      __syncwarp();
      sm90::named_sync(kBatchBarrier, kTwThreads);   // the batch's lists are no longer read
    }
    return;
  }

  sm90::registers_up<L::kConsumerRegisters>();
  const int group = a.num_qo_heads / a.num_kv_heads;
  const float scale_log2 = a.softmax_scale * kLog2e * kLabKScale;   // (the lab's K x 2^-8)
  const int row_base = 16 * warp;
  const int group_row = 64 * (warp / 4);   // the TileView row of this warp's warpgroup
  while (f < f_end) {
    make_token_batch<kListBarrier, kBatchBarrier>(a, f, f_end, batch);   // lists ready
    const int num_tiles = batch.info[0];
    f += batch.info[1];
    for (int ti = 0; ti < num_tiles; ++ti) {
      const DirectTile& t = batch.tiles[ti];
      uint32_t qf[kHeadDim / 16][4];
      uint4 q_raw[2][2];
      load_query_raw_fp8(a, t.ctx, group, t.tile_rows, q_raw, row_base);
      widen_query_fp8(q_raw, qf);
      // This thread's rows (the warpgroup forms' row state) and the tokens of the warp's rows.
      const wg::TileView view(a, t.ctx, group, t.tile_rows);
      wg::Rows rows = view.rows(a, t.ctx, group_row);
      uint32_t warp_tokens = 0u;
      if (row_base < t.tile_rows) {
        const int first = (t.ctx.first_row + row_base) / group;
        const int last = (t.ctx.first_row + min(row_base + 15, t.tile_rows - 1)) / group;
        warp_tokens = (2u << last) - (1u << first);   // tokens < 16 (seqlen_q <= 16)
      }
      float acc[16][4];
#pragma unroll
      for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
      const int end = t.list_begin + t.num_pages;
      for (int e = t.list_begin; e < end; ++e) {
        const PageRef page = list_page(batch, e);
        MSA_LAB_TW_MARK(lane == 0, warp, lab_page, 0);
        full(pos.index).wait(pos.phase);   // also when skipped: no warp arrives a round ahead
        MSA_LAB_TW_MARK(lane == 0, warp, lab_page, 1);
#ifdef MSA_LAB_TW_TIMELINE
        if (lane == 0 && blockIdx.x == 0 && lab_page < kTwLabPages) {
          lab_tw_computed[warp][lab_page] = (page.token_mask & warp_tokens) != 0;
        }
#endif
        if (page.token_mask & warp_tokens) {   // warp-uniform
          const char* stage = stage_of(pos.index);
          const char* v8 = stage + kPageSize * kHeadDim;
          const int valid_rows = page_valid_rows(t.ctx, page);
          if (valid_rows == kPageSize) {   // uniform: only a request's last page is short
            token_warp_page<false>(stage, v8, lane, qf, page, valid_rows, scale_log2, rows, acc);
          } else {
            token_warp_page<true>(stage, v8, lane, qf, page, valid_rows, scale_log2, rows, acc);
          }
        }
        MSA_LAB_TW_MARK(lane == 0, warp, lab_page, 2);
        empty(pos.index).arrive();
        pos.advance();
        LAB_TW_NEXT_PAGE();
      }
      token_warp_store(a, t, row_base, rows, scale_log2, acc);
    }
    sm90::named_sync(kBatchBarrier, kTwThreads);     // the batch's lists are no longer read
  }
#undef LAB_TW_NEXT_PAGE
}

#else

__global__ void __launch_bounds__(kTwThreads, 1)
    decode_attention_token_warps_kernel(const DecodeAttentionArgs,
                                        const __grid_constant__ wg::PagedKvMaps) {
  __trap();
}

#endif  // sm_90a

// kSplitKeys (every qo tile has <= 16 rows, e.g. decode with G = 16 and one token): all 8
// warps hold the same 16 rows and warp w takes keys [16w, 16w + 16) of every page, instead of
// one warp doing the whole page while seven idle. The page max is shared through shared memory,
// so every warp folds with the same running max as the one-warp path; the warps' partial sums
// and accumulators are added at the end. (e4m3 Q and K/V take the direct form above.)
template <bool kSplitKeys>
__global__ void __launch_bounds__(kThreads, 1)
    decode_attention_kernel(const DecodeAttentionArgs a) {
  extern __shared__ __align__(128) char smem[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  char* stages = smem + kQBytes;
  int* cand = reinterpret_cast<int*>(stages + kStageRegionBytes);
  int* list_phys = cand + kMaxCandidates;
  int* list_logical = list_phys + kMaxCandidates;
  uint32_t* list_mask = reinterpret_cast<uint32_t*>(list_logical + kMaxCandidates);
  int* warp_counts = reinterpret_cast<int*>(list_mask + kMaxCandidates);
  int* page_total = warp_counts + kWarps;
  // Split keys: per-warp page maxima.
  float* warp_page_max =
      reinterpret_cast<float*>(reinterpret_cast<char*>(warp_counts) + kCountsSlotBytes);
  static_assert(kWarps * 4 + 4 <= kCountsSlotBytes, "warp_counts and page_total fit their slot");

  CtaContext ctx;
  int chunk, group, tile_rows;
  if (!make_context(a, blockIdx.x, blockIdx.y, ctx, chunk, group, tile_rows)) return;

  load_queries(a, ctx, group, tile_rows, qs);
  int num_pages;
  if (a.q2k_indices != nullptr) {
    num_pages = build_sparse_page_list(a, ctx, cand, list_phys, list_logical, list_mask,
                                       warp_counts, page_total);
  } else {
    num_pages = ctx.chunk_end - ctx.chunk_begin;
    __syncthreads();
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Rows of this warp start at row_base; its key n8-tiles are n_base .. n_base + kNTiles - 1.
  constexpr int kNTiles = kSplitKeys ? 2 : kPageSize / 8;
  const int row_base = kSplitKeys ? 0 : warp * 16;
  const int n_base = kSplitKeys ? warp * kNTiles : 0;
  const bool warp_active = row_base < tile_rows;
  const float scale_log2 = a.softmax_scale * kLog2e;
  const bool pv_fp8 = a.q_fp8 && a.kv_fp8;

  // Per thread: rows warp*16 + lane/4 (+8); the last visible key of each row (-1: none).
  int row_token[2];
  int row_last_key[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_base + (lane >> 2) + i * 8;
    // Clamped so the token-mask shift stays < 32 for padding rows (masked off anyway).
    row_token[i] = min((ctx.first_row + row) / group, 31);
    row_last_key[i] = row < tile_rows
                          ? min(ctx.seqlen_k - 1, row_token[i] + ctx.seqlen_k - a.seqlen_q)
                          : -1;
  }

  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  // Pipeline stage st starts at stage_base + st * stage_bytes (bf16: the padded page itself;
  // e4m3: raw bytes, converted into `converted` before use).
  __nv_bfloat16* converted = reinterpret_cast<__nv_bfloat16*>(stages);
  char* const stage_base = a.kv_fp8 ? stages + kPageBf16Bytes : stages;
  const int stage_bytes = a.kv_fp8 ? kPageFp8Bytes : kPageBf16Bytes;

  if (num_pages > 0) {
    const PageRef first = resolve_page(a, ctx, 0, list_phys, list_logical, list_mask);
    load_page_async(a, ctx.head, first, stage_base, page_valid_rows(ctx, first));
  }
  cp_async_commit();
  for (int i = 0; i < num_pages; ++i) {
    if (i + 1 < num_pages) {
      const PageRef next = resolve_page(a, ctx, i + 1, list_phys, list_logical, list_mask);
      load_page_async(a, ctx.head, next, stage_base + ((i + 1) & 1) * stage_bytes,
                      page_valid_rows(ctx, next));
    }
    cp_async_commit();
    cp_async_wait_one();
    __syncthreads();
    const PageRef page = resolve_page(a, ctx, i, list_phys, list_logical, list_mask);
    const __nv_bfloat16* ks;
    if (a.kv_fp8) {
      if (page.token_mask != 0) convert_fp8_page(stage_base + (i & 1) * stage_bytes, converted);
      __syncthreads();
      ks = converted;
    } else {
      ks = reinterpret_cast<const __nv_bfloat16*>(stage_base + (i & 1) * stage_bytes);
    }
    const __nv_bfloat16* vs = ks + kPageSize * kStride;

    if (warp_active && page.token_mask != 0) {
      // S = Q K^T for this warp's 16 rows and its keys of the page.
      float s[kNTiles][4];
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      const __nv_bfloat16* qw = qs + (row_base + (lane >> 2)) * kStride + (lane & 3) * 2;
#pragma unroll
      for (int kd = 0; kd < kHeadDim / 16; ++kd) {
        uint32_t qa[4];
        qa[0] = *reinterpret_cast<const uint32_t*>(qw + kd * 16);
        qa[1] = *reinterpret_cast<const uint32_t*>(qw + 8 * kStride + kd * 16);
        qa[2] = *reinterpret_cast<const uint32_t*>(qw + kd * 16 + 8);
        qa[3] = *reinterpret_cast<const uint32_t*>(qw + 8 * kStride + kd * 16 + 8);
        const __nv_bfloat16* kp =
            ks + (n_base * 8 + (lane >> 2)) * kStride + kd * 16 + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
          const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kp + n * 8 * kStride);
          const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kp + n * 8 * kStride + 8);
          mma_bf16(s[n], qa, b0, b1);
        }
      }
      // Mask (causal against seqused_k, selection per token), page max per row.
      int last_key[2];
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        const bool selected = (page.token_mask >> row_token[i2]) & 1u;
        last_key[i2] = selected ? row_last_key[i2] - page.logical * kPageSize : -1;
      }
      float page_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = (n_base + n) * 8 + (lane & 3) * 2 + (e & 1);
          const float v = key <= last_key[e >> 1] ? s[n][e] * scale_log2 : -INFINITY;
          s[n][e] = v;
          page_max[e >> 1] = fmaxf(page_max[e >> 1], v);
        }
      }
      float alpha[2], beta[2];
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        page_max[i2] = fmaxf(page_max[i2], __shfl_xor_sync(0xFFFFFFFFu, page_max[i2], 1));
        page_max[i2] = fmaxf(page_max[i2], __shfl_xor_sync(0xFFFFFFFFu, page_max[i2], 2));
      }
      if constexpr (kSplitKeys) {
        // The whole page's max per row: every warp's max over its keys, through shared memory.
        // (The branch is CTA-uniform here: every warp is active and sees the same page.)
        if ((lane & 3) == 0) {
          warp_page_max[warp * 16 + (lane >> 2)] = page_max[0];
          warp_page_max[warp * 16 + (lane >> 2) + 8] = page_max[1];
        }
        __syncthreads();
#pragma unroll
        for (int i2 = 0; i2 < 2; ++i2) {
          float m = -INFINITY;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_page_max[w * 16 + (lane >> 2) + i2 * 8]);
          page_max[i2] = m;
        }
      }
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        const float new_max = fmaxf(row_max[i2], page_max[i2]);
        alpha[i2] = row_max[i2] == -INFINITY ? 0.f : exp2_ftz(row_max[i2] - new_max);
        beta[i2] = page_max[i2] == -INFINITY ? 0.f : exp2_ftz(page_max[i2] - new_max);
        if (page_max[i2] == -INFINITY) page_max[i2] = 0.f;   // exp2(-inf - 0) = 0 below
        row_max[i2] = new_max;
      }
      float page_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = exp2_ftz(s[n][e] - page_max[e >> 1]);
          page_sum[e >> 1] += p;
          s[n][e] = (pv_fp8 ? round_to_e4m3(p) : p) * beta[e >> 1];
        }
      }
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) row_sum[i2] = row_sum[i2] * alpha[i2] + beta[i2] * page_sum[i2];
      scale_rows(acc, alpha);
      // O += P V with P = high + residual (both bf16), over this warp's keys.
#pragma unroll
      for (int kk = 0; kk < kNTiles / 2; ++kk) {
        uint32_t p_hi[4], p_lo[4];
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          const float* src = s[2 * kk + (f >> 1)] + (f & 1) * 2;
          const __nv_bfloat162 hi = __floats2bfloat162_rn(src[0], src[1]);
          const float2 hi_f = __bfloat1622float2(hi);
          p_hi[f] = *reinterpret_cast<const uint32_t*>(&hi);
          p_lo[f] = pack_bf16(src[0] - hi_f.x, src[1] - hi_f.y);
        }
        const int v_row = (n_base / 2 + kk) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int nd = 0; nd < 16; nd += 2) {
          uint32_t b[4];
          sm80::ldmatrix_x4_trans(b, vs + v_row * kStride + (nd + (lane >> 4)) * 8);
          mma_bf16(acc[nd], p_hi, b[0], b[1]);
          mma_bf16(acc[nd], p_lo, b[0], b[1]);
          mma_bf16(acc[nd + 1], p_hi, b[2], b[3]);
          mma_bf16(acc[nd + 1], p_lo, b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }

  // Finalize: normalized O and LSE (natural log) per row; empty rows give O = 0, LSE = -inf.
  add_quad_sums(row_sum);
  if constexpr (kSplitKeys) {
    // Add the warps' partial accumulators and sums (same running max in every warp) in the
    // now idle stage region; warp 0 then writes the rows as the one-warp path does.
    cp_async_wait_all();
    float* part_acc = reinterpret_cast<float*>(stages);                 // [kWarps][16][128]
    float* part_sum = part_acc + kWarps * 16 * kHeadDim;
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      const int row = (lane >> 2) + i2 * 8;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<float2*>(part_acc + (warp * 16 + row) * kHeadDim + n * 8 +
                                   (lane & 3) * 2) =
            make_float2(acc[n][i2 * 2], acc[n][i2 * 2 + 1]);
      }
      if ((lane & 3) == 0) part_sum[warp * 16 + row] = row_sum[i2];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      const int row = (lane >> 2) + i2 * 8;
      float total = 0.f;
      for (int w = 0; w < kWarps; ++w) total += part_sum[w * 16 + row];
      row_sum[i2] = total;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        float2 sum2 = make_float2(0.f, 0.f);
        for (int w = 0; w < kWarps; ++w) {
          const float2 x = *reinterpret_cast<const float2*>(
              part_acc + (w * 16 + row) * kHeadDim + n * 8 + (lane & 3) * 2);
          sum2.x += x.x;
          sum2.y += x.y;
        }
        acc[n][i2 * 2] = sum2.x;
        acc[n][i2 * 2 + 1] = sum2.y;
      }
    }
  }
  if (!warp_active) return;
  const int64_t slot = a.split_kv ? static_cast<int64_t>(__ldg(a.merge_indptr + ctx.request)) + chunk
                                  : 0;
  if (a.split_kv && (slot < 0 || slot >= a.num_partial_slots)) return;
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    const int row = row_base + (lane >> 2) + i2 * 8;
    if (row >= tile_rows) continue;
    const int r = ctx.first_row + row;
    const int token = r / group, qo_head = ctx.head * group + r % group;
    // Only a zero sum means "no visible key": a NaN sum (a NaN or +inf score) gives NaN O and
    // LSE, never the empty row's O = 0, LSE = -inf.
    const bool empty = row_sum[i2] == 0.f;
    const float inv = empty ? 0.f : 1.f / row_sum[i2];
    const float lse = empty ? -INFINITY : (row_max[i2] + log2f(row_sum[i2])) * kLn2;
    if (a.split_kv) {
      const int64_t idx = (slot * a.seqlen_q + token) * a.num_qo_heads + qo_head;
      float* o = a.o_partial + idx * kHeadDim + (lane & 3) * 2;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<float2*>(o + n * 8) =
            make_float2(acc[n][i2 * 2] * inv, acc[n][i2 * 2 + 1] * inv);
      }
      if ((lane & 3) == 0) a.lse_partial[idx] = lse;
    } else {
      const int64_t idx =
          (static_cast<int64_t>(ctx.request) * a.seqlen_q + token) * a.num_qo_heads + qo_head;
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.out) + idx * kHeadDim + (lane & 3) * 2;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<__nv_bfloat162*>(o + n * 8) =
            __floats2bfloat162_rn(acc[n][i2 * 2] * inv, acc[n][i2 * 2 + 1] * inv);
      }
      if ((lane & 3) == 0 && a.lse != nullptr) a.lse[idx] = lse;
    }
  }
}

// Merge of a split-KV plan: one warp per (query row, q head), request b's partials in slots
// merge_indptr[b] .. merge_indptr[b + 1].
constexpr int kMergeWarps = 4;

__global__ void __launch_bounds__(kMergeWarps * 32)
    decode_merge_kernel(const DecodeAttentionArgs a) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5);
  const int64_t total_q = static_cast<int64_t>(a.batch) * a.seqlen_q;
  if (item >= total_q * a.num_qo_heads) return;
  const int64_t q_row = item / a.num_qo_heads;
  const int qo_head = static_cast<int>(item % a.num_qo_heads);
  const int request = static_cast<int>(q_row / a.seqlen_q);
  const int token = static_cast<int>(q_row % a.seqlen_q);
  const int64_t begin = max(static_cast<int64_t>(__ldg(a.merge_indptr + request)), int64_t{0});
  const int64_t end =
      min(static_cast<int64_t>(__ldg(a.merge_indptr + request + 1)), a.num_partial_slots);
  merge_row<32, false>(a, q_row, token, qo_head, static_cast<int>(max(end - begin, int64_t{0})),
            [&](int i) { return begin + i; });
}

// Merge of the persistent form, one CTA per boundary between CTA ranges: CTA c (1 <= c < ctas)
// merges the sequence that CTA c's range opens inside of, when that sequence starts in CTA
// c - 1's range (a sequence cut several times is merged once, at its first cut); every other
// sequence was written directly. The sequence spans CTAs first = c - 1 .. last; CTA first's
// piece is in slot 2 first + 1 when that range opens before the sequence (else 2 first), every
// later CTA's in 2 c'. Each row of the sequence's tile takes 8 threads (16 dims each), so the
// partials of all its rows are read at once: one CTA per cut and a few round trips to L2.
constexpr int kMergePersistentThreads = 1024;
constexpr int kMergePersistentThreadsPerRow = kMergePersistentThreads / kRowsPerCta;

__global__ void __launch_bounds__(kMergePersistentThreads)
    decode_merge_persistent_kernel(const DecodeAttentionArgs a) {
  __shared__ int64_t pages_before[kDecodePersistentMaxRequests + 1];
  for (int r = threadIdx.x; r <= a.batch; r += blockDim.x) pages_before[r] = a.request_pages[r];
  __syncthreads();
  const Partition part(a, pages_before, nullptr, a.num_work);
  const int boundary = blockIdx.x;
  if (boundary == 0 || boundary >= part.ctas) return;
  const int64_t cut = part.cut(boundary);
  int request, seq, pages;
  const int64_t start = part.locate(cut, request, seq, pages);
  if (start == cut || part.cta_of(start) != boundary - 1) return;
  const Partition::Span span = part.span(start, pages);
  const int group = a.num_qo_heads / a.num_kv_heads;
  const int tile_begin = (seq % part.tiles) * a.qo_tile_rows;
  const int row = tile_begin + static_cast<int>(threadIdx.x / kMergePersistentThreadsPerRow);
  if (row >= min(tile_begin + a.qo_tile_rows, a.seqlen_q * group)) return;
  const int token = row / group;
  merge_row<kMergePersistentThreadsPerRow, true>(
      a, static_cast<int64_t>(request) * a.seqlen_q + token, token,
      seq / part.tiles * group + row % group, span.pieces(), [&](int i) { return span.slot(i); });
}

}  // namespace

cudaError_t decode_attention_image(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, decode_merge_kernel);
}

// The warpgroup and token-warps forms' bodies exist in the sm_90a code only (wgmma, setmaxnreg);
// elsewhere (another arch, or compute_80 PTX JIT-compiled on an SM90) they would trap, so their
// launches are refused. The answer depends on the image the current device loaded: asked once
// per device.
static bool warpgroup_form_loaded() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  return detail::asked_once_per_device(device, [](int) {
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, wg::decode_attention_wg_kernel<false>) == cudaSuccess &&
           attr.ptxVersion == 90 && attr.binaryVersion == 90;
  });
}

// The e4m3 caches' tensor maps (k and v: [num_pages, num_kv_heads, 128, 128] bytes, rows of 128
// bytes, a page's head slice a box; K 128-byte swizzled, V as v_swizzle asks: unswizzled for the
// e4m3 P.V form's transposes, swizzled for the token-warps form's fragment reads); false where
// either cannot be made.
static bool encode_kv_maps(const DecodeAttentionArgs& a, wg::PagedKvMaps& maps,
                           CUtensorMapSwizzle v_swizzle) {
  static_assert(sizeof(maps.k) == sizeof(CUtensorMap), "the tensor map's storage");
  const int64_t rows = a.num_pages * a.num_kv_heads * kPageSize;
  if (a.num_pages < 1 || a.num_pages > INT32_MAX) return false;
  return encode_row_map(maps.k, a.k, rows, kHeadDim, kPageSize, CU_TENSOR_MAP_SWIZZLE_128B) &&
         encode_row_map(maps.v, a.v, rows, kHeadDim, kPageSize, v_swizzle);
}

// The CTAs of a call's tile ranges (direct and token-warps forms): a CTA per tile of a dense
// call (its chunks were sized for the grid), at most one per SM for a sparse call's tiles.
static cudaError_t range_ctas(const DecodeAttentionArgs& a, int64_t& ctas) {
  const int64_t tiles = static_cast<int64_t>(a.num_work) * a.num_kv_heads;
  ctas = std::min<int64_t>(tiles, INT_MAX);
  if (a.q2k_indices != nullptr) {
    int device = 0, sms = 0;
    MSA_RETURN_IF_ERROR(cudaGetDevice(&device));
    MSA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    ctas = std::min<int64_t>(ctas, std::max(sms, 1));
  }
  return cudaSuccess;
}

// The ping-pong form's entry point: the persistent kernel or the work items' one.
template <bool kPersistent, bool kFp8, bool kPvFp8>
constexpr auto pingpong_kernel() {
  if constexpr (kPersistent) {
    return &wg::pingpong::decode_attention_persistent_kernel<kFp8, kPvFp8>;
  } else {
    return &wg::pingpong::decode_attention_pp_kernel<kFp8, kPvFp8>;
  }
}

cudaError_t launch_decode_attention(const DecodeAttentionArgs& args, cudaStream_t stream) {
  if (args.num_work <= 0 || args.num_kv_heads <= 0) return cudaSuccess;
  // The persistent form's CTAs cover every KV head themselves.
  const dim3 grid(static_cast<unsigned>(args.num_work),
                  args.persistent ? 1u : static_cast<unsigned>(args.num_kv_heads));
  // Split keys across warps only when every qo tile has <= 16 rows, the direct e4m3 form only
  // then with e4m3 Q and K/V, the warpgroup form only with Q and K/V of one dtype (the binding
  // checks all three; the caller asks for the warpgroup form on tiles of > 16 rows).
  auto launch_on = [&](dim3 ctas, auto kernel, int smem_bytes, int threads,
                       auto... more) -> cudaError_t {
    MSA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             smem_bytes));
    kernel<<<ctas, threads, smem_bytes, stream>>>(args, more...);
    return cudaSuccess;
  };
  auto launch = [&](auto kernel, int smem_bytes, int threads, auto... more) -> cudaError_t {
    return launch_on(grid, kernel, smem_bytes, threads, more...);
  };
  // A token-warps form where its image and the caches' tensor maps allow; otherwise the form
  // the caller asked for beside it serves the call.
  wg::PagedKvMaps token_maps{};
  if (args.token_warps != kTwOff && args.q2k_indices != nullptr && warpgroup_form_loaded() &&
      encode_kv_maps(args, token_maps, CU_TENSOR_MAP_SWIZZLE_128B)) {
    int64_t ctas = 0;
    MSA_RETURN_IF_ERROR(range_ctas(args, ctas));
    const dim3 range_grid(static_cast<unsigned>(ctas));
    MSA_RETURN_IF_ERROR(launch_on(range_grid, decode_attention_token_warps_kernel,
                                  TwLayout::kAlloc, kTwThreads, token_maps));
  } else if (args.warpgroup) {
    if (!warpgroup_form_loaded()) return cudaErrorNotSupported;
    // The e4m3 P.V form copies pages through tensor maps of the caches; where they cannot be
    // made, the e4m3 form with f16 P.V serves (same rounding of P, same products).
    wg::PagedKvMaps maps{};
    const bool pv_fp8 = (args.pingpong || args.persistent) && args.q_fp8 && args.pv_fp8 &&
                        encode_kv_maps(args, maps, CU_TENSOR_MAP_SWIZZLE_NONE);
    // The ping-pong form's kernel (its work items, or persistent) of the call's dtypes, with the
    // shared-memory layout it was compiled against.
    auto launch_pingpong = [&](auto persistent) -> cudaError_t {
      constexpr bool kPersistent = decltype(persistent)::value;
      using wg::pingpong::Layout;
      constexpr int kThreadsPP = wg::pingpong::kThreadsPP;
      if (pv_fp8) {
        return launch(pingpong_kernel<kPersistent, true, true>(),
                      Layout<true, kPersistent, true>::kAlloc, kThreadsPP, maps);
      }
      if (args.q_fp8) {
        return launch(pingpong_kernel<kPersistent, true, false>(),
                      Layout<true, kPersistent>::kAlloc, kThreadsPP, maps);
      }
      return launch(pingpong_kernel<kPersistent, false, false>(),
                    Layout<false, kPersistent>::kAlloc, kThreadsPP, maps);
    };
    if (args.persistent) {
      MSA_RETURN_IF_ERROR(launch_pingpong(std::true_type{}));
    } else if (args.pingpong) {
      MSA_RETURN_IF_ERROR(launch_pingpong(std::false_type{}));
    } else if (args.q_fp8) {
      MSA_RETURN_IF_ERROR(
          launch(wg::decode_attention_wg_kernel<true>, wg::Shape<true>::kAlloc, kThreads));
    } else {
      MSA_RETURN_IF_ERROR(
          launch(wg::decode_attention_wg_kernel<false>, wg::Shape<false>::kAlloc, kThreads));
    }
  } else if (args.direct_fp8) {
    // A sparse call's tiles (16 pages each at top-16) in equal ranges over one CTA per SM.
    int64_t ctas = 0;
    MSA_RETURN_IF_ERROR(range_ctas(args, ctas));
    MSA_RETURN_IF_ERROR(launch_on(dim3(static_cast<unsigned>(ctas)),
                                  decode_attention_direct_kernel, kDirectSmemBytes, kThreads));
  } else if (args.split_keys) {
    MSA_RETURN_IF_ERROR(launch(decode_attention_kernel<true>, kSmemBytes, kThreads));
  } else {
    MSA_RETURN_IF_ERROR(launch(decode_attention_kernel<false>, kSmemBytes, kThreads));
  }
  MSA_RETURN_IF_ERROR(cudaGetLastError());
  const int64_t items = static_cast<int64_t>(args.batch) * args.seqlen_q * args.num_qo_heads;
  if (args.persistent) {
    decode_merge_persistent_kernel<<<static_cast<unsigned>(args.num_work),
                                     kMergePersistentThreads, 0, stream>>>(args);
    MSA_RETURN_IF_ERROR(cudaGetLastError());
  } else if (args.split_kv) {
    decode_merge_kernel<<<detail::grid_for(items, kMergeWarps), kMergeWarps * 32, 0, stream>>>(
        args);
    MSA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return cudaSuccess;
}

}  // namespace msa
