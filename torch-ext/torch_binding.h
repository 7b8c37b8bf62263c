// Plain C++ launchers of the msa CUDA ops (csrc/*.cu) and the torch op functions that wrap them.
//
// The launchers take raw device pointers and a stream; they never synchronize, read only what the
// sizes below allow whatever the index values say, and are safe to capture in a CUDA graph
// (every size comes from the host, temporary memory comes from the caller's workspace).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace msa {

// ----------------------------------------------------------------------------------------------
// q2k -> k2q CSR (+ optional sparse forward schedule). Semantics: contract §1.1 and
// msa.sparse_index_utils.build_k2q_csr_torch_reference / prepare_scheduler (bit-identical).
// ----------------------------------------------------------------------------------------------
struct K2qCsrArgs {
  const int32_t* q2k_indices;    // [hkv, total_q, topk] batch-local block ids, -1 = empty slot
  const int32_t* cu_seqlens_q;   // [batch + 1]
  const int32_t* cu_seqlens_k;   // [batch + 1]
  int32_t* row_ptr;              // out [hkv, total_rows + 1]
  int32_t* q_indices;            // out [hkv, q_indices_stride]; -1 past row_ptr[h, -1]
  int64_t q_indices_stride;      // >= total_q * topk
  int hkv;
  int total_q;
  int topk;
  int batch;
  int blk_kv;                    // tokens per KV block (128)
  int total_rows;                // CSR rows to emit (host hint; rows past it are dropped)
  int max_kv_blocks;             // host hint: ceil(max k_len / blk_kv); sizes a lookup table only
  bool counting_sort;            // small calls may take the spread counting sort
};

// Present only for run_build_k2q_csr_with_schedule.
struct K2qScheduleArgs {
  int32_t* scheduler_metadata;   // out [work_capacity, 6] (head, row, q_begin, q_count, batch, block)
  int32_t* work_count;           // out [1]
  int32_t* qsplit_indices;       // out, layout of q_indices: q_local | slot << 24, -1 = none
  int32_t* split_counts;         // out [total_q, hkv]
  int target_q_per_cta;          // > 0
  int work_capacity;             // rows of scheduler_metadata
  int max_seqlen_q;              // host hint; checked < 2^24 (packing), drops no entry
};

// Bytes of temporary device memory launch_build_k2q_csr needs (depends on sizes only).
size_t build_k2q_csr_workspace_bytes(const K2qCsrArgs& args, const K2qScheduleArgs* schedule);

// `schedule` may be null. `workspace` must hold build_k2q_csr_workspace_bytes(args, schedule).
// With a schedule, topk must be a power of two <= 32 and total_q < 2^24 - 1.
cudaError_t launch_build_k2q_csr(const K2qCsrArgs& args, const K2qScheduleArgs* schedule,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
// sparse_topk_select. Semantics: msa.reference.topk.sparse_topk_select_reference.
// ----------------------------------------------------------------------------------------------
enum class HeadReduce : int { kNone = 0, kSum = 1, kMax = 2 };

struct TopkSelectArgs {
  const float* max_score;        // [num_heads, num_tiles, total_q] fp32, contiguous
  int32_t* out;                  // out [total_q, num_out_heads, topk], row (t, g) at
  int64_t out_token_stride;      //   t * out_token_stride + g * out_head_stride (elements;
  int64_t out_head_stride;       //   a row's topk ids contiguous)
  int num_heads;
  int num_tiles;                 // K
  int total_q;                   // T
  int num_out_heads;             // == num_heads when head_reduce is kNone
  int topk;                      // 1..64
  HeadReduce head_reduce;
  int64_t num_valid_pages;       // used when num_valid_pages_per_query is null
  const void* num_valid_pages_per_query;  // optional [total_q] int32/int64
  bool num_valid_pages_is_int64;
  const void* causal_end_block;  // optional [total_q] int32/int64
  bool causal_end_block_is_int64;
  int64_t force_begin_blocks;    // >= 0
  int64_t force_end_blocks;      // >= 0
  bool staged;                   // the staged kernel where it applies (many queries, topk <= 16)
};

cudaError_t launch_sparse_topk_select(const TopkSelectArgs& args, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
// Paged decode attention (dense or block-sparse) with the split-KV schedule of
// msa.src.sm100.decode_schedule. Semantics: msa.reference.decode (contract §1.4, D6).
// Head dim and page size are 128. Grid: [num_work, num_kv_heads], plus a merge pass when split.
// ----------------------------------------------------------------------------------------------
struct DecodeAttentionArgs {
  const void* q;                  // [batch * seqlen_q, num_qo_heads, 128] bf16 or e4m3
  const void* k;                  // [num_pages, num_kv_heads, 128, 128] bf16 or e4m3
  const void* v;                  // same shape / dtype as k
  bool q_fp8;
  bool kv_fp8;
  const int32_t* q2k_indices;     // null (dense) or [num_kv_heads, batch * seqlen_q, topk]
  int topk;
  const int32_t* page_table;      // [batch, page_table_width] logical -> physical page
  int page_table_width;
  const int32_t* seqused_k;       // [batch]
  int batch;
  int seqlen_q;                   // 1..16
  int num_qo_heads;
  int num_kv_heads;
  int64_t num_pages;              // k.shape[0]; page ids outside [0, num_pages) are skipped
  const int32_t* request_indices; // [num_work] schedule: work item -> request
  const int32_t* kv_tile_indices; // [num_work] work item -> chunk of the request
  const int32_t* qo_tile_indices; // [num_work] work item -> query tile of qo_tile_rows rows
  int qo_tile_rows;               // rows (token * G + head in group) per query tile, 1..128
  const int32_t* num_splits;      // [batch] chunks per request
  const int32_t* merge_indptr;    // [batch + 1] first partial slot of each request
  int num_work;
  int kv_chunk_size;              // units per chunk: pages (dense) or q2k slots (sparse)
  bool split_kv;                  // write partials + merge (true) or out/lse directly
  float* o_partial;               // [num_partial_slots, seqlen_q, num_qo_heads, 128] fp32
  float* lse_partial;             // [num_partial_slots, seqlen_q, num_qo_heads] fp32
  int64_t num_partial_slots;
  void* out;                      // [batch * seqlen_q, num_qo_heads, 128] bf16
  float* lse;                     // null or [batch * seqlen_q, num_qo_heads] fp32
  float softmax_scale;
  bool split_keys;                // warps split each page's keys (every qo tile <= 16 rows)
  bool direct_fp8;                // with split_keys, e4m3 q and K/V: no bf16 conversion pass
  bool warpgroup;                 // wgmma form (q and K/V both bf16 or both e4m3)
  bool pingpong;                  // with warpgroup, bf16: the warp-specialized ping-pong form
  bool pv_fp8;                    // e4m3 ping-pong / persistent: P.V on e4m3 wgmma (V^T tiles)
  int token_warps;                // sparse, e4m3 q and K/V, > 16 rows: a warp per 16 rows (TMA);
                                  // 0 off, 1 each warp widens its pages, 2 widened once a page,
                                  // 3 a warpgroup's tokens on wgmma (S^T = K Q^T, O^T)
  // The persistent ping-pong form (dense, pingpong): num_work CTAs stream equal page ranges of
  // the call's (request, KV head, qo tile) sequences from the live lengths; partial slots
  // 2 * num_work. request_pages [batch + 1] is written by it: each request's first page of a
  // sequence's pages (the merge reads it).
  bool persistent;
  int64_t* request_pages;
};

// Requests the persistent decode form plans for at most (its request table is in shared memory).
constexpr int kDecodePersistentMaxRequests = 1024;

cudaError_t launch_decode_attention(const DecodeAttentionArgs& args, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
// Fused decode indexer + top-k over a paged index-K cache of one key head, and the per-step work
// split it reads. Semantics: msa.reference.decode_indexer (msa.decode_indexer_topk).
// ----------------------------------------------------------------------------------------------
struct DecodeIndexerPlanArgs {
  const int32_t* seqused_k;       // [batch]
  int batch;
  int capacity;                   // work items (the indexer's grid)
  int32_t* work;                  // out [capacity, 2] (request, chunk), -1 = idle
  int32_t* requests;              // out [batch, 3] (first work item, chunks, arrival counter = 0)
  int32_t* chunk_pages;           // out [1] history blocks per chunk
};

cudaError_t launch_decode_indexer_plan(const DecodeIndexerPlanArgs& args, cudaStream_t stream);

struct DecodeIndexerArgs {
  const void* q;                  // [batch * seqlen_q, num_heads, 128] bf16 or e4m3
  bool q_fp8;
  const void* k;                  // [num_pages, 1, 128, 128] bf16 / e4m3, or [.., 64] NVFP4 bytes
  int k_format;                   // 0 bf16, 1 e4m3, 2 NVFP4
  const uint8_t* k_scale;         // NVFP4: E4M3 scales, 1 KB per page (128x4 tiles or linear)
  bool k_scale_linear;            // [pages, 128, 8] instead of the 128x4 tiled layout
  const float* k_global_scale;    // NVFP4: null or [>= 1]
  int64_t num_pages;              // page ids outside [0, num_pages) are skipped
  const int32_t* page_table;      // [batch, page_table_width]
  int page_table_width;
  const int32_t* seqused_k;       // [batch]
  int batch;
  int seqlen_q;                   // 1..16
  int num_heads;                  // index heads; seqlen_q * num_heads <= 128
  int out_head_repeat;            // out heads per index head
  int topk;                       // 4..32
  float scale;                    // score factor (> 0)
  const int32_t* work;            // the plan's [capacity, 2]
  int32_t* requests;              // the plan's [batch, 3] (arrival counters reset after use)
  const int32_t* chunk_pages;     // the plan's [1]
  int capacity;
  int32_t* partials;              // [capacity, seqlen_q * num_heads, list_capacity, 2]
  int list_capacity;              // 16 (topk <= 16) or 32
  int32_t* out;                   // [num_heads * out_head_repeat, batch * seqlen_q, topk]
  float* scores;                  // null or [num_heads, batch * seqlen_q, page_table_width]
  // e4m3 keys on an sm_90+ device: each page one TMA copy into a 128-byte swizzled stage (the
  // launcher encodes the tensor map; it keeps the cp.async form when it cannot).
  bool tma_pages;
  // 17-32 rows a request: a ninth warp holds the candidate lists and offers each page's scores
  // while the eight scoring warps score the next page.
  bool offer_warp;
  // The merge of a request's chunk lists as a butterfly over each row's lanes (bitonic merges
  // of 64-bit keys) instead of topk - 1 rounds of segment maxima.
  bool butterfly_merge;
  alignas(64) uint64_t k_tensor_map[16];   // CUtensorMap of k, written by the launcher
};

cudaError_t launch_decode_indexer_topk(const DecodeIndexerArgs& args, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
// e4m3 V -> Vt for the dense FMHA's wsut form: for every (request, key block < ceil(kv_len /
// 128), KV head), Vt[vt_table[request, block], head, channel, r] = V(key k(r) of the block,
// head, channel), k(r) = tile_utils.register_p_row_order (msa._native.fmha_sm90.VT_COLUMN_KEYS);
// keys at or past kv_len and rows outside the tensor / page pool are zero.
// ----------------------------------------------------------------------------------------------
struct TransposeVArgs {
  const uint8_t* v;               // dense [num_tokens, hkv, 128] or paged [num_pages, hkv, 128, 128]
  int64_t v_row_stride;           // bytes between tokens (dense) or page slots (paged)
  int64_t v_head_stride;          // bytes between heads
  int64_t v_page_stride;          // bytes between pages (paged)
  int64_t num_tokens;             // dense rows of v
  int64_t num_pages;              // paged: page ids outside [0, num_pages) read as zeros
  const int32_t* cu_seqlens_k;    // [batch + 1] (dense)
  const int32_t* kv_lens;         // [batch]
  const int32_t* page_table;      // null (dense) or [batch, page_table_width]
  int page_table_width;           // paged: key lengths are clamped to width * 128, as the FMHA
  int32_t* tables;                // out [2, batch, table_width]: K's page (0 when dense), then
                                  // the Vt block of each key block (the FMHA's page_table)
  int table_width;                // >= the longest request's key blocks (paged: the page
                                  // table's width)
  uint8_t* vt;                    // out [num_vt_blocks, hkv, 128, 128]
  int64_t num_vt_blocks;
  int batch;
  int num_kv_heads;
};

cudaError_t launch_fmha_transpose_v_e4m3(const TransposeVArgs& args, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
// Portable sparse prefill (sm_80+, mma.sync; docs/design-portable.md): bf16 or e4m3 q/k/v
// attention over the k2q schedule into per-slot partials, then their combine. Semantics: contract
// §1.2, the same partials and combine as the Hopper kernels (msa/_native/sparse_prefill_sm90.py).
// ----------------------------------------------------------------------------------------------
enum class PartialType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kE4m3 = 3 };

struct SparsePrefillArgs {
  const void* q;                 // [total_q, Hq, 128] bf16 or e4m3, channels contiguous
  const void* k;                 // dense [total_k, Hkv, 128] or paged [pages, Hkv, 128, 128],
                                 // bf16 or e4m3 (e4m3 q needs e4m3 k / v)
  const void* v;                 // same layout, strides and dtype as k
  bool q_fp8;                    // q is e4m3 (then the MMAs run in f16, widened exactly)
  bool kv_fp8;                   // k / v are e4m3
  bool pv_fp8;                   // (e4m3 q) P is rounded to e4m3 before P V, as an FP8 MMA sees it
  int64_t q_stride_token, q_stride_head;
  int64_t kv_stride_unit;        // per token (dense) or page (paged)
  int64_t kv_stride_head;
  int64_t kv_stride_key;         // per token inside a page (paged only)
  int64_t kv_units;              // k.shape[0]: tokens (dense) or pages (paged)
  bool paged;
  const int32_t* cu_seqlens_q;   // [batch + 1], monotone within total_q
  const int32_t* cu_seqlens_k;   // [batch + 1] (dense token offsets)
  const int32_t* kv_lens;        // [batch]
  const int32_t* page_table;     // [batch, page_table_cols] (paged only)
  int64_t page_table_stride;
  int page_table_cols;
  const int32_t* row_ptr;        // [hkv, rows + 1]
  int64_t row_ptr_stride;
  int rows;
  const int32_t* qsplit;         // [hkv, entries] q_local | slot << 24, -1 = none
  int64_t qsplit_stride;
  int64_t entries;
  const int32_t* metadata;       // [work_capacity, 6] (head, row, q_begin, q_count, batch, block)
  const int32_t* work_count;     // [1]
  int work_capacity;
  void* o_partial;               // out [slots, total_q, Hq, 128] partial dtype
  float* lse_partial;            // out [slots, total_q, Hq]
  float* lse_t_partial;          // out, same shape (want_lse_t only)
  PartialType partial;
  int slots;
  int total_q;
  int batch;
  int hkv;
  int group;                     // query heads per KV head: 1, 2, 4, 8 or 16
  float scale_log2;              // softmax_scale * log2(e)
  float inv_temperature;         // 1 / lse_temperature_scale
  bool causal;
  bool want_lse_t;
};

struct SparseCombineArgs {
  const void* o_partial;         // [slots, total_q, Hq, 128] partial dtype
  const float* lse_partial;      // [slots, total_q, Hq]
  const float* lse_t_partial;    // same shape (want_lse_t only)
  const int32_t* split_counts;   // [total_q, hkv] entries per (query, KV head)
  void* out;                     // out [total_q, Hq, 128] bf16
  float* lse;                    // out [total_q, Hq]
  float* lse_t;                  // out [total_q, Hq] (want_lse_t only)
  PartialType partial;
  int slots;
  int total_q;
  int num_heads;
  int hkv;
  bool want_lse_t;
};

// Portable indexer block max-scores (bf16 or e4m3, one shared index-key head). Semantics:
// msa.reference.max_score.block_max_scores_reference; the Hopper kernel's bounds rules.
struct BlockMaxScoreArgs {
  const void* q;                 // [total_q, H, 128] bf16 or e4m3, channels contiguous
  const void* k;                 // dense [total_k, 1, 128] or paged [pages, 1, 128, 128], q's dtype
  bool fp8;                      // q and k are e4m3 (widened exactly to f16)
  int64_t q_stride_token, q_stride_head;
  int64_t k_stride_unit;         // per token (dense) or page (paged)
  int64_t k_stride_key;          // per token inside a page (paged only)
  int64_t k_units;               // k.shape[0]
  bool paged;
  const int32_t* cu_seqlens_q;   // [batch + 1], monotone within total_q
  const int32_t* cu_seqlens_k;   // [batch + 1] dense token offsets (dense only)
  const int32_t* k_lens;         // [batch]
  const int32_t* offsets;        // [batch] causal offsets
  const int32_t* page_table;     // [batch, page_table_cols] (paged only)
  int64_t page_table_stride;
  int page_table_cols;
  float* out;                    // out [H, max_k_tiles, total_q] fp32, every element written
  int64_t total_q;
  int num_heads;                 // 1, 2, 4 or 8
  int max_k_tiles;
  int batch;                     // < 65535 (grid y = batch + 1)
  int grid_x;                    // CTAs per request along its query tiles (>= 1; they stride)
  int key_splits;                // CTAs per query tile along its K tiles (1 .. 65535)
  float scale;
  bool causal;
};

cudaError_t launch_block_max_score_portable(const BlockMaxScoreArgs& args, cudaStream_t stream);

// The attention launch picks its tile (128 or 64 rows) from the device's shared memory per
// block; cudaErrorNotSupported on a device with less than ~97 KB.
cudaError_t launch_sparse_prefill_portable(const SparsePrefillArgs& args, cudaStream_t stream);
cudaError_t launch_sparse_combine_portable(const SparseCombineArgs& args, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
// The image of one csrc translation unit (csrc/<unit>.cu) the loaded module runs on the current
// device: cudaFuncGetAttributes of one of its kernels (a unit's kernels share one fatbinary).
// binaryVersion is the SASS arch that runs (the device's own when the driver JIT-compiled PTX),
// ptxVersion the virtual arch the code was compiled for. An error (no kernel image for the
// device, PTX newer than the driver, ...) means the build cannot run that unit here. The query's
// error is not sticky; callers clear it (cudaGetLastError).
// ----------------------------------------------------------------------------------------------
cudaError_t build_k2q_csr_image(cudaFuncAttributes* attr);
cudaError_t sparse_topk_select_image(cudaFuncAttributes* attr);
cudaError_t decode_attention_image(cudaFuncAttributes* attr);
cudaError_t decode_indexer_image(cudaFuncAttributes* attr);
cudaError_t fmha_transpose_v_image(cudaFuncAttributes* attr);
cudaError_t sparse_prefill_portable_image(cudaFuncAttributes* attr);
cudaError_t block_max_score_portable_image(cudaFuncAttributes* attr);

}  // namespace msa

// Torch op functions (defined in torch_binding.cpp; only that file includes torch headers).
#ifdef MSA_TORCH_BINDING
#include <torch/all.h>

#include <string>
#include <tuple>

void run_build_k2q_csr(const torch::Tensor& q2k, const torch::Tensor& cu_q,
                       const torch::Tensor& cu_k, torch::Tensor& row_ptr, torch::Tensor& q_idx,
                       int64_t topk, int64_t blk_kv, int64_t total_rows, int64_t max_kv_blocks,
                       bool counting_sort);

void run_build_k2q_csr_with_schedule(
    const torch::Tensor& q2k, const torch::Tensor& cu_q, const torch::Tensor& cu_k,
    torch::Tensor& row_ptr, torch::Tensor& q_idx, int64_t topk, int64_t blk_kv,
    int64_t total_rows, int64_t max_kv_blocks, torch::Tensor& scheduler_metadata,
    torch::Tensor& work_count, torch::Tensor& qsplit_idx, torch::Tensor& split_counts,
    int64_t target_q_per_cta, int64_t work_capacity, int64_t max_seqlen_q, bool counting_sort);

void sparse_topk_select(const torch::Tensor& max_score, torch::Tensor& out, int64_t topk,
                        int64_t num_valid_pages,
                        const std::optional<torch::Tensor>& num_valid_pages_per_query,
                        int64_t force_begin_blocks, int64_t force_end_blocks,
                        const std::optional<torch::Tensor>& causal_end_block,
                        int64_t num_out_heads, int64_t head_reduce, bool staged);

void decode_indexer_plan_update(const torch::Tensor& seqused_k, torch::Tensor& work,
                                torch::Tensor& requests, torch::Tensor& chunk_pages);

void decode_indexer_topk(const torch::Tensor& q, const torch::Tensor& k,
                         const std::optional<torch::Tensor>& k_scale, bool k_scale_linear,
                         const std::optional<torch::Tensor>& k_global_scale,
                         const torch::Tensor& page_table, const torch::Tensor& seqused_k,
                         const torch::Tensor& work, torch::Tensor& requests,
                         const torch::Tensor& chunk_pages, torch::Tensor& partials,
                         torch::Tensor& out, const std::optional<torch::Tensor>& scores,
                         int64_t seqlen_q, int64_t topk, double scale, bool tma_pages,
                         bool offer_warp, bool butterfly_merge);

void fmha_transpose_v_e4m3(const torch::Tensor& v, const torch::Tensor& cu_seqlens_k,
                           const torch::Tensor& kv_lens,
                           const std::optional<torch::Tensor>& page_table,
                           torch::Tensor& tables, torch::Tensor& vt);

void sparse_prefill_portable(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
    const torch::Tensor& kv_lens, const std::optional<torch::Tensor>& page_table,
    const torch::Tensor& k2q_row_ptr, const torch::Tensor& qsplit_indices,
    const torch::Tensor& scheduler_metadata, const torch::Tensor& work_count,
    torch::Tensor& o_partial, torch::Tensor& lse_partial,
    const std::optional<torch::Tensor>& lse_t_partial, double softmax_scale,
    double inv_temperature, bool causal, bool pv_e4m3);

void sparse_combine_portable(const torch::Tensor& o_partial, const torch::Tensor& lse_partial,
                             const std::optional<torch::Tensor>& lse_t_partial,
                             const torch::Tensor& split_counts, torch::Tensor& out,
                             torch::Tensor& lse, const std::optional<torch::Tensor>& lse_t);

void block_max_score_portable(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& cu_seqlens_q,
                              const std::optional<torch::Tensor>& cu_seqlens_k,
                              const torch::Tensor& k_lens, const torch::Tensor& offsets,
                              const std::optional<torch::Tensor>& page_table,
                              torch::Tensor& out, double scale, bool causal, int64_t grid_x,
                              int64_t key_splits);

void sparse_decode_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const std::optional<torch::Tensor>& q2k_indices, const torch::Tensor& page_table,
    const torch::Tensor& seqused_k, const torch::Tensor& request_indices,
    const torch::Tensor& kv_tile_indices, const torch::Tensor& qo_tile_indices,
    const torch::Tensor& num_splits, const torch::Tensor& merge_indptr,
    const std::optional<torch::Tensor>& o_partial, const std::optional<torch::Tensor>& lse_partial,
    torch::Tensor& out, const std::optional<torch::Tensor>& lse, int64_t seqlen_q,
    int64_t kv_chunk_size, bool split_kv, double softmax_scale, bool split_keys,
    bool direct_fp8, bool warpgroup, bool pingpong, int64_t qo_tile_rows,
    const std::optional<torch::Tensor>& request_pages, int64_t persistent_ctas, bool pv_fp8,
    int64_t token_warps);

std::tuple<int64_t, int64_t, std::string> csrc_image(const std::string& unit, int64_t device);
#endif
