// V -> Vt for the e4m3 dense FMHA's "wsut" form (cute_kernels/fmha_sm90_ws.py, v_transposed).
//
// The e4m3 P.V wgmma needs V K-major (keys contiguous per channel) and in the key order in which
// the kernel hands P from registers (tile_utils.register_p_row_order; the column -> key rule
// is written out below). Transposing here, once per call, instead of per query tile inside the
// kernel, removes the transposer warps from the FMHA. One CTA per (key block, KV head, request):
// 128 keys x 128 channels (16 KB) in, the same bytes transposed out; keys at or past kv_len and
// rows outside the tensor or the page pool are written as zeros (the FMHA's masked P is exactly
// 0, but 0 * NaN from an unused page slot would not be).
//
// The op also writes the FMHA's [2, B, W] table (K's pages, then each key block's Vt block):
// request b's blocks are Vt blocks base(b) .., base(b) = the key blocks of the requests before
// it. Computing both here leaves one launch per call (the torch ops that built the tables took
// ~10 small launches, a few percent of a 4k-token e4m3 call).
#include "common.cuh"
#include "torch_binding.h"

namespace msa {
namespace {

constexpr int kBlock = 128;          // keys per block (= page size) and head dim, in bytes
constexpr int kThreads = 256;
constexpr int kRowChunks = kBlock / 16;         // 16-byte chunks per key row
constexpr int kChunksPerThread = kBlock * kRowChunks / kThreads;
static_assert(kBlock * kRowChunks % kThreads == 0, "every thread moves the same number of chunks");
static_assert(kThreads == 8 * 32, "the transpose maps 8 warps x 32 lanes onto 32 words x 8 groups");

// Vt column r = x0 + 2 x1 + 4 t + 16 j (t < 4) holds key x0 + 8 x1 + 2 t + 16 j
// (tile_utils.register_p_row_order; fmha_sm90.vt_column_keys; the GPU test compares bytes).

// Keys of request b: kv_len clamped to the page table's width in keys when paged, as the FMHA
// clamps it; negative lengths count as 0.
__device__ __forceinline__ int64_t clamped_kv_len(const TransposeVArgs& a, int b) {
  int64_t kv_len = max(a.kv_lens[b], 0);
  if (a.page_table != nullptr) {
    kv_len = min(kv_len, static_cast<int64_t>(a.page_table_width) * kBlock);
  }
  return kv_len;
}

__device__ __forceinline__ int64_t key_blocks(const TransposeVArgs& a, int b) {
  return (clamped_kv_len(a, b) + kBlock - 1) / kBlock;
}

// base(request) = key blocks of requests 0 .. request - 1: a strided sum and a block reduction.
__device__ int64_t first_vt_block(const TransposeVArgs& a, int request) {
  __shared__ int64_t warp_sums[kThreads / 32];
  int64_t sum = 0;
  for (int b = threadIdx.x; b < request; b += kThreads) sum += key_blocks(a, b);
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
  __syncthreads();
  int64_t total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  return total;
}

__global__ void __launch_bounds__(kThreads) transpose_v_e4m3_kernel(TransposeVArgs a) {
  const int blk = blockIdx.x, head = blockIdx.y, request = blockIdx.z;
  const int64_t vt_block = first_vt_block(a, request) + blk;
  if (head == 0 && threadIdx.x == 0) {
    // The FMHA's table row: K's page (paged; 0 past the page table) and this block's Vt block.
    const int64_t row = static_cast<int64_t>(request) * a.table_width + blk;
    a.tables[row] = a.page_table != nullptr && blk < a.page_table_width
                        ? a.page_table[static_cast<int64_t>(request) * a.page_table_width + blk]
                        : 0;
    a.tables[static_cast<int64_t>(a.batch) * a.table_width + row] =
        static_cast<int32_t>(vt_block);
  }
  const int64_t kv_len = clamped_kv_len(a, request);
  const int64_t key0 = static_cast<int64_t>(blk) * kBlock;
  if (key0 >= kv_len) return;
  if (vt_block >= a.num_vt_blocks) return;   // Vt sized from other lengths: never write past it

  // Source rows of this block: dense, token cu_seqlens_k[request] + key; paged, slot `key` of
  // the block's page. nullptr: a zero row.
  const uint8_t* base = nullptr;
  int64_t row_stride = a.v_row_stride;
  if (a.page_table != nullptr) {
    const int64_t page = a.page_table[static_cast<int64_t>(request) * a.page_table_width + blk];
    if (page >= 0 && page < a.num_pages) {
      base = a.v + page * a.v_page_stride + head * a.v_head_stride;
    }
  } else {
    base = a.v + (a.cu_seqlens_k[request] + key0) * a.v_row_stride + head * a.v_head_stride;
  }
  const int64_t tokens_left = a.page_table != nullptr
                                  ? kBlock
                                  : a.num_tokens - (a.cu_seqlens_k[request] + key0);

  // All of a thread's loads in flight at once (a load-store loop waited for each in turn).
  // Shared row `key` holds its 16-byte chunk `part` at part ^ ((key >> 4) & 7): the transpose
  // below reads one word from each of eight 16-key groups per step, in eight distinct chunks.
  __shared__ uint4 tile[kBlock][kRowChunks];
  uint4 vals[kChunksPerThread];
#pragma unroll
  for (int r = 0; r < kChunksPerThread; ++r) {
    const int i = threadIdx.x + r * kThreads, key = i >> 3, part = i & 7;
    vals[r] = make_uint4(0, 0, 0, 0);
    if (base != nullptr && key0 + key < kv_len && key < tokens_left) {
      vals[r] = __ldg(reinterpret_cast<const uint4*>(base + key * row_stride) + part);
    }
  }
#pragma unroll
  for (int r = 0; r < kChunksPerThread; ++r) {
    const int i = threadIdx.x + r * kThreads, key = i >> 3, part = i & 7;
    tile[key][part ^ ((key >> 4) & 7)] = vals[r];
  }
  __syncthreads();

  // Thread (warp, lane) takes channels 4 c .. 4 c + 3, c = 4 warp + lane / 8, of keys 16 g ..
  // 16 g + 15, g = lane % 8: sixteen 32-bit words, then 4 x 4 byte transposes (byte permutes)
  // into the 16 Vt columns of each of its 4 channels. Vt columns 16 g + 4 w + j hold keys
  // 16 g + 2 w + {0, 1, 8, 9}[j] (the rule above with t = w). A warp's store writes 4 whole
  // 128-byte Vt rows. (One byte-wide shared load per output byte made the op 1.8x slower:
  // 8.0 -> 4.5 us at 4k tokens x 8 KV heads.)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = lane & 7, word = lane >> 3, chunk = warp ^ group;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&tile[0][0]);
  uint32_t key_words[16];
#pragma unroll
  for (int x = 0; x < 16; ++x) {
    key_words[x] = words[(16 * group + x) * (kBlock / 4) + 4 * chunk + word];
  }
  uint32_t cols[4][4];   // [channel in the word][Vt word w]
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t k0 = key_words[2 * w], k1 = key_words[2 * w + 1];
    const uint32_t k8 = key_words[2 * w + 8], k9 = key_words[2 * w + 9];
    const uint32_t lo01 = __byte_perm(k0, k1, 0x5140), hi01 = __byte_perm(k0, k1, 0x7362);
    const uint32_t lo89 = __byte_perm(k8, k9, 0x5140), hi89 = __byte_perm(k8, k9, 0x7362);
    cols[0][w] = __byte_perm(lo01, lo89, 0x5410);
    cols[1][w] = __byte_perm(lo01, lo89, 0x7632);
    cols[2][w] = __byte_perm(hi01, hi89, 0x5410);
    cols[3][w] = __byte_perm(hi01, hi89, 0x7632);
  }
  uint8_t* out = a.vt + (vt_block * a.num_kv_heads + head) * (kBlock * kBlock);
  const int channel0 = 4 * (4 * warp + word);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    *reinterpret_cast<uint4*>(out + (channel0 + c) * kBlock + 16 * group) =
        make_uint4(cols[c][0], cols[c][1], cols[c][2], cols[c][3]);
  }
}

}  // namespace

cudaError_t fmha_transpose_v_image(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, transpose_v_e4m3_kernel);
}

cudaError_t launch_fmha_transpose_v_e4m3(const TransposeVArgs& args, cudaStream_t stream) {
  if (args.batch <= 0 || args.table_width <= 0 || args.num_kv_heads <= 0) {
    return cudaSuccess;
  }
  const dim3 grid(args.table_width, args.num_kv_heads, args.batch);
  transpose_v_e4m3_kernel<<<grid, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace msa
