// Torch registration of the msa CUDA ops (namespace TORCH_EXTENSION_NAME = _msa_cuda_<id>).
//
// Every op validates dtype / device / shape / contiguity with TORCH_CHECK (RuntimeError on the
// Python side), then calls the plain launcher from csrc/ on the current stream of the input's
// device. Temporary memory comes from the caching allocator on that stream, so the ops are
// safe to capture in CUDA graphs; nothing here reads device memory on the host.
#define MSA_TORCH_BINDING
#include "torch_binding.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "registration.h"

namespace {

void check_cuda_tensor(const torch::Tensor& t, const char* name, at::ScalarType dtype,
                       int64_t dim, const torch::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, ": must be a CUDA tensor");
  TORCH_CHECK(t.device() == device, name, ": is on ", t.device(), " but the inputs are on ",
              device);
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, ": expected rank ", dim, ", got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, ": must be contiguous");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// Validates the CSR arguments and fills the launcher struct.
msa::K2qCsrArgs make_csr_args(const torch::Tensor& q2k, const torch::Tensor& cu_q,
                              const torch::Tensor& cu_k, torch::Tensor& row_ptr,
                              torch::Tensor& q_idx, int64_t topk, int64_t blk_kv,
                              int64_t total_rows, int64_t max_kv_blocks, bool counting_sort) {
  TORCH_CHECK(q2k.is_cuda(), "q2k: must be a CUDA tensor");
  const torch::Device device = q2k.device();
  check_cuda_tensor(q2k, "q2k", at::kInt, 3, device);
  check_cuda_tensor(cu_q, "cu_seqlens_q", at::kInt, 1, device);
  check_cuda_tensor(cu_k, "cu_seqlens_k", at::kInt, 1, device);
  check_cuda_tensor(row_ptr, "row_ptr", at::kInt, 2, device);
  check_cuda_tensor(q_idx, "q_idx", at::kInt, 2, device);
  const int64_t hkv = q2k.size(0), total_q = q2k.size(1);
  TORCH_CHECK(q2k.size(2) == topk && topk >= 1, "topk: ", topk, " does not match q2k.shape[2] = ",
              q2k.size(2));
  TORCH_CHECK(hkv >= 1, "q2k: needs at least one KV head");
  TORCH_CHECK(cu_q.numel() >= 2 && cu_k.numel() == cu_q.numel(),
              "cu_seqlens_q / cu_seqlens_k: expected equal shapes [B+1] with B >= 1, got ",
              cu_q.sizes(), " and ", cu_k.sizes());
  TORCH_CHECK(blk_kv >= 1, "blk_kv: must be >= 1, got ", blk_kv);
  TORCH_CHECK(total_rows >= 0 && total_rows < INT_MAX, "total_rows: out of range: ", total_rows);
  TORCH_CHECK(max_kv_blocks >= 0 && max_kv_blocks <= INT_MAX, "max_kv_blocks: out of range: ",
              max_kv_blocks);
  TORCH_CHECK(hkv * total_q * topk < INT_MAX, "q2k: more than 2^31 - 1 entries");
  TORCH_CHECK(hkv * (total_rows + 1) <= static_cast<int64_t>(UINT32_MAX),
              "total_rows: Hkv * (total_rows + 1) must fit in 32 bits");
  TORCH_CHECK(row_ptr.size(0) == hkv && row_ptr.size(1) == total_rows + 1,
              "row_ptr: expected shape [", hkv, ", ", total_rows + 1, "], got ", row_ptr.sizes());
  TORCH_CHECK(q_idx.size(0) == hkv && q_idx.size(1) >= total_q * topk, "q_idx: expected shape [",
              hkv, ", >= ", total_q * topk, "], got ", q_idx.sizes());
  msa::K2qCsrArgs a{};
  a.q2k_indices = q2k.data_ptr<int32_t>();
  a.cu_seqlens_q = cu_q.data_ptr<int32_t>();
  a.cu_seqlens_k = cu_k.data_ptr<int32_t>();
  a.row_ptr = row_ptr.data_ptr<int32_t>();
  a.q_indices = q_idx.data_ptr<int32_t>();
  a.q_indices_stride = q_idx.size(1);
  a.hkv = static_cast<int>(hkv);
  a.total_q = static_cast<int>(total_q);
  a.topk = static_cast<int>(topk);
  a.batch = static_cast<int>(cu_q.numel() - 1);
  a.blk_kv = static_cast<int>(blk_kv);
  a.total_rows = static_cast<int>(total_rows);
  a.max_kv_blocks = static_cast<int>(max_kv_blocks);
  a.counting_sort = counting_sort;
  return a;
}

void launch_csr(const msa::K2qCsrArgs& a, const msa::K2qScheduleArgs* s,
                const torch::Tensor& like, const char* op) {
  const size_t bytes = msa::build_k2q_csr_workspace_bytes(a, s);
  // Allocated on the current stream by the caching allocator: capture-safe, no sync.
  torch::Tensor workspace = torch::empty({static_cast<int64_t>(bytes > 0 ? bytes : 1)},
                                         like.options().dtype(at::kByte));
  check_launch(msa::launch_build_k2q_csr(a, s, workspace.data_ptr(), bytes,
                                         c10::cuda::getCurrentCUDAStream(like.get_device())),
               op);
}

}  // namespace

void run_build_k2q_csr(const torch::Tensor& q2k, const torch::Tensor& cu_q,
                       const torch::Tensor& cu_k, torch::Tensor& row_ptr, torch::Tensor& q_idx,
                       int64_t topk, int64_t blk_kv, int64_t total_rows, int64_t max_kv_blocks,
                       bool counting_sort) {
  const c10::cuda::CUDAGuard guard(q2k.device());
  const msa::K2qCsrArgs a = make_csr_args(q2k, cu_q, cu_k, row_ptr, q_idx, topk, blk_kv,
                                          total_rows, max_kv_blocks, counting_sort);
  launch_csr(a, nullptr, q2k, "run_build_k2q_csr");
}

void run_build_k2q_csr_with_schedule(
    const torch::Tensor& q2k, const torch::Tensor& cu_q, const torch::Tensor& cu_k,
    torch::Tensor& row_ptr, torch::Tensor& q_idx, int64_t topk, int64_t blk_kv,
    int64_t total_rows, int64_t max_kv_blocks, torch::Tensor& scheduler_metadata,
    torch::Tensor& work_count, torch::Tensor& qsplit_idx, torch::Tensor& split_counts,
    int64_t target_q_per_cta, int64_t work_capacity, int64_t max_seqlen_q, bool counting_sort) {
  const c10::cuda::CUDAGuard guard(q2k.device());
  const msa::K2qCsrArgs a = make_csr_args(q2k, cu_q, cu_k, row_ptr, q_idx, topk, blk_kv,
                                          total_rows, max_kv_blocks, counting_sort);
  const torch::Device device = q2k.device();
  check_cuda_tensor(scheduler_metadata, "scheduler_metadata", at::kInt, 2, device);
  check_cuda_tensor(work_count, "work_count", at::kInt, 1, device);
  check_cuda_tensor(qsplit_idx, "qsplit_idx", at::kInt, 2, device);
  check_cuda_tensor(split_counts, "split_counts", at::kInt, 2, device);
  TORCH_CHECK(topk <= 32 && (topk & (topk - 1)) == 0,
              "topk: the schedule builder needs a power of two <= 32, got ", topk);
  TORCH_CHECK(a.total_q < (1 << 24) - 1, "q2k: the schedule packs query ids in 24 bits; total_q ",
              a.total_q, " is too large");
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_q < (1 << 24),
              "max_seqlen_q: packed query ids need < 2^24, got ", max_seqlen_q);
  TORCH_CHECK(target_q_per_cta >= 1 && target_q_per_cta <= INT_MAX,
              "target_q_per_cta: must be >= 1, got ", target_q_per_cta);
  TORCH_CHECK(work_capacity >= 1 && work_capacity <= INT_MAX,
              "work_capacity: must be >= 1, got ", work_capacity);
  TORCH_CHECK(scheduler_metadata.size(0) == work_capacity && scheduler_metadata.size(1) == 6,
              "scheduler_metadata: expected shape [", work_capacity, ", 6], got ",
              scheduler_metadata.sizes());
  TORCH_CHECK(work_count.numel() >= 1, "work_count: expected shape [1]");
  TORCH_CHECK(qsplit_idx.sizes() == q_idx.sizes(), "qsplit_idx: shape ", qsplit_idx.sizes(),
              " differs from q_idx ", q_idx.sizes());
  TORCH_CHECK(split_counts.size(0) == a.total_q && split_counts.size(1) == a.hkv,
              "split_counts: expected shape [", a.total_q, ", ", a.hkv, "], got ",
              split_counts.sizes());
  msa::K2qScheduleArgs s{};
  s.scheduler_metadata = scheduler_metadata.data_ptr<int32_t>();
  s.work_count = work_count.data_ptr<int32_t>();
  s.qsplit_indices = qsplit_idx.data_ptr<int32_t>();
  s.split_counts = split_counts.data_ptr<int32_t>();
  s.target_q_per_cta = static_cast<int>(target_q_per_cta);
  s.work_capacity = static_cast<int>(work_capacity);
  s.max_seqlen_q = static_cast<int>(max_seqlen_q);
  launch_csr(a, &s, q2k, "run_build_k2q_csr_with_schedule");
}

void sparse_topk_select(const torch::Tensor& max_score, torch::Tensor& out, int64_t topk,
                        int64_t num_valid_pages,
                        const std::optional<torch::Tensor>& num_valid_pages_per_query,
                        int64_t force_begin_blocks, int64_t force_end_blocks,
                        const std::optional<torch::Tensor>& causal_end_block,
                        int64_t num_out_heads, int64_t head_reduce, bool staged) {
  TORCH_CHECK(max_score.is_cuda(), "max_score: must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(max_score.device());
  const torch::Device device = max_score.device();
  check_cuda_tensor(max_score, "max_score", at::kFloat, 3, device);
  TORCH_CHECK(out.is_cuda() && out.device() == device, "out: must be on ", device);
  TORCH_CHECK(out.scalar_type() == at::kInt && out.dim() == 3, "out: expected an int32 rank-3 "
              "tensor, got ", out.scalar_type(), " ", out.sizes());
  const int64_t heads = max_score.size(0), tiles = max_score.size(1), total_q = max_score.size(2);
  TORCH_CHECK(topk >= 1 && topk <= 64, "topk: must be in [1, 64], got ", topk);
  TORCH_CHECK(head_reduce >= 0 && head_reduce <= 2, "head_reduce: 0 (none), 1 (sum) or 2 (max), got ",
              head_reduce);
  TORCH_CHECK(heads >= 1, "max_score: needs at least one head");
  TORCH_CHECK(tiles < INT_MAX && total_q < INT_MAX, "max_score: dimensions must be < 2^31");
  if (head_reduce == 0) {
    TORCH_CHECK(num_out_heads == heads, "num_out_heads: must equal the ", heads,
                " heads of max_score without head_reduce, got ", num_out_heads);
  } else {
    TORCH_CHECK(num_out_heads >= 1 && heads % num_out_heads == 0, "num_out_heads: ",
                num_out_heads, " does not divide the ", heads, " heads of max_score");
  }
  TORCH_CHECK(force_begin_blocks >= 0 && force_end_blocks >= 0,
              "force_begin_blocks / force_end_blocks: must be >= 0");
  TORCH_CHECK(out.size(0) == total_q && out.size(1) == num_out_heads && out.size(2) == topk,
              "out: expected shape [", total_q, ", ", num_out_heads, ", ", topk, "], got ",
              out.sizes());
  // [T, H_out, topk] contiguous, or the transposed view of a contiguous [H_out, T, topk] (the
  // q2k layout): rows of topk contiguous ids that never overlap.
  const bool token_major = out.is_contiguous();
  const bool head_major = out.stride(2) == 1 && out.stride(0) == topk &&
                          out.stride(1) == total_q * topk;
  TORCH_CHECK(token_major || head_major, "out: must be a contiguous [T, H_out, topk] tensor or "
              "the permute(1, 0, 2) view of a contiguous [H_out, T, topk] one, got strides ",
              out.strides());
  msa::TopkSelectArgs a{};
  a.max_score = max_score.data_ptr<float>();
  a.out = out.data_ptr<int32_t>();
  a.out_token_stride = out.stride(0);
  a.out_head_stride = out.stride(1);
  a.num_heads = static_cast<int>(heads);
  a.num_tiles = static_cast<int>(tiles);
  a.total_q = static_cast<int>(total_q);
  a.num_out_heads = static_cast<int>(num_out_heads);
  a.topk = static_cast<int>(topk);
  a.head_reduce = static_cast<msa::HeadReduce>(head_reduce);
  a.num_valid_pages = num_valid_pages;
  a.force_begin_blocks = force_begin_blocks;
  a.force_end_blocks = force_end_blocks;
  a.staged = staged;
  auto per_query = [&](const std::optional<torch::Tensor>& t, const char* name, const void** ptr,
                       bool* is_int64) {
    if (!t.has_value()) return;
    const torch::Tensor& v = *t;
    TORCH_CHECK(v.is_cuda() && v.device() == device, name, ": must be on ", device);
    TORCH_CHECK(v.scalar_type() == at::kInt || v.scalar_type() == at::kLong, name,
                ": expected int32 or int64, got ", v.scalar_type());
    TORCH_CHECK(v.dim() == 1 && v.size(0) == total_q && v.is_contiguous(), name,
                ": expected a contiguous [", total_q, "] tensor, got ", v.sizes());
    *ptr = v.data_ptr();
    *is_int64 = v.scalar_type() == at::kLong;
  };
  per_query(num_valid_pages_per_query, "num_valid_pages", &a.num_valid_pages_per_query,
            &a.num_valid_pages_is_int64);
  per_query(causal_end_block, "causal_end_block", &a.causal_end_block,
            &a.causal_end_block_is_int64);
  check_launch(msa::launch_sparse_topk_select(a, c10::cuda::getCurrentCUDAStream(device.index())),
               "sparse_topk_select");
}

void fmha_transpose_v_e4m3(const torch::Tensor& v, const torch::Tensor& cu_seqlens_k,
                           const torch::Tensor& kv_lens,
                           const std::optional<torch::Tensor>& page_table,
                           torch::Tensor& tables, torch::Tensor& vt) {
  TORCH_CHECK(v.is_cuda(), "v: must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(v.device());
  const torch::Device device = v.device();
  constexpr int64_t kBlock = 128;
  const bool paged = page_table.has_value();
  TORCH_CHECK(v.scalar_type() == at::kFloat8_e4m3fn, "v: expected float8_e4m3fn, got ",
              v.scalar_type());
  TORCH_CHECK(v.dim() == (paged ? 4 : 3), "v: expected ", paged ? "[pages, Hkv, 128, 128]" :
              "[tokens, Hkv, 128]", ", got shape ", v.sizes());
  TORCH_CHECK(v.size(-1) == kBlock && v.stride(-1) == 1, "v: the head dim must be 128 and "
              "contiguous, got shape ", v.sizes(), " strides ", v.strides());
  TORCH_CHECK(!paged || v.size(2) == kBlock, "v: pages must hold 128 slots, got ", v.sizes());
  for (int64_t d = 0; d + 1 < v.dim(); ++d) {
    TORCH_CHECK(v.stride(d) % 16 == 0, "v: strides must be multiples of 16 bytes, got ",
                v.strides());
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0,
              "v: data must be 16-byte aligned");
  const int64_t hkv = v.size(1);
  check_cuda_tensor(cu_seqlens_k, "cu_seqlens_k", at::kInt, 1, device);
  check_cuda_tensor(kv_lens, "kv_lens", at::kInt, 1, device);
  check_cuda_tensor(tables, "tables", at::kInt, 3, device);
  check_cuda_tensor(vt, "vt", at::kFloat8_e4m3fn, 4, device);
  const int64_t batch = kv_lens.size(0);
  TORCH_CHECK(cu_seqlens_k.size(0) == batch + 1, "cu_seqlens_k: expected ", batch + 1,
              " entries, got ", cu_seqlens_k.size(0));
  TORCH_CHECK(tables.size(0) == 2 && tables.size(1) == batch && tables.size(2) >= 1,
              "tables: expected [2, ", batch, ", width >= 1], got ", tables.sizes());
  TORCH_CHECK(vt.size(1) == hkv && vt.size(2) == kBlock && vt.size(3) == kBlock,
              "vt: expected [blocks, ", hkv, ", 128, 128], got ", vt.sizes());
  TORCH_CHECK(tables.size(2) < 65536 && hkv < 65536 && batch < 65536,
              "tables / v / kv_lens: grid dimensions past 65535");
  msa::TransposeVArgs a{};
  a.v = static_cast<const uint8_t*>(v.data_ptr());
  a.v_row_stride = paged ? v.stride(2) : v.stride(0);
  a.v_head_stride = v.stride(1);
  a.v_page_stride = paged ? v.stride(0) : 0;
  a.num_tokens = paged ? 0 : v.size(0);
  a.num_pages = paged ? v.size(0) : 0;
  a.cu_seqlens_k = cu_seqlens_k.data_ptr<int32_t>();
  a.kv_lens = kv_lens.data_ptr<int32_t>();
  if (paged) {
    check_cuda_tensor(*page_table, "page_table", at::kInt, 2, device);
    TORCH_CHECK(page_table->size(0) == batch, "page_table: expected ", batch, " rows, got ",
                page_table->size(0));
    a.page_table = page_table->data_ptr<int32_t>();
    a.page_table_width = static_cast<int>(page_table->size(1));
    TORCH_CHECK(tables.size(2) == page_table->size(1), "tables: paged, expected the page "
                "table's width ", page_table->size(1), ", got ", tables.size(2));
  }
  a.tables = tables.data_ptr<int32_t>();
  a.table_width = static_cast<int>(tables.size(2));
  a.vt = static_cast<uint8_t*>(vt.data_ptr());
  a.num_vt_blocks = vt.size(0);
  a.batch = static_cast<int>(batch);
  a.num_kv_heads = static_cast<int>(hkv);
  check_launch(msa::launch_fmha_transpose_v_e4m3(
                   a, c10::cuda::getCurrentCUDAStream(device.index())),
               "fmha_transpose_v_e4m3");
}

// q / k / v of the portable kernels: bf16 or e4m3, channels contiguous, every row 16-byte
// aligned (the kernels copy 16-byte chunks), strides free otherwise. Returns whether t is e4m3.
bool check_rows_16b(const torch::Tensor& t, const char* name, int64_t dim,
                    const torch::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, name, ": must be on ", device);
  const bool fp8 = t.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || t.scalar_type() == at::kBFloat16, name,
              ": expected bfloat16 or float8_e4m3fn, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.size(-1) == 128, name, ": expected rank ", dim,
              " with head_dim 128, got shape ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1, name, ": the head dimension must be contiguous");
  const int64_t per_16b = fp8 ? 16 : 8;       // elements per 16 bytes
  bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < dim; ++d) aligned = aligned && t.stride(d) % per_16b == 0;
  TORCH_CHECK(aligned, name, ": rows must be 16-byte aligned (strides multiples of ", per_16b,
              ")");
  return fp8;
}

msa::PartialType partial_type(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return msa::PartialType::kFloat32;
    case at::kBFloat16: return msa::PartialType::kBFloat16;
    case at::kHalf: return msa::PartialType::kFloat16;
    case at::kFloat8_e4m3fn: return msa::PartialType::kE4m3;
    default: TORCH_CHECK(false, name, ": expected float32, bfloat16, float16 or float8_e4m3fn, "
                         "got ", t.scalar_type());
  }
  return msa::PartialType::kFloat32;
}

// The page table of a portable kernel's paged K/V: [batch, max_pages] int32, contiguous.
void check_page_table(const torch::Tensor& table, int64_t batch, const torch::Device& device,
                      const int32_t** data, int64_t* stride, int* cols) {
  check_cuda_tensor(table, "page_table", at::kInt, 2, device);
  TORCH_CHECK(table.size(0) == batch && table.size(1) < INT_MAX,
              "page_table: expected [", batch, ", max_pages], got ", table.sizes());
  *data = table.data_ptr<int32_t>();
  *stride = table.stride(0);
  *cols = static_cast<int>(table.size(1));
}

// The per-slot partials both portable sparse prefill ops take: O [slots, total_q, Hq, 128]
// (fp32 / bf16 / fp16 / e4m3), LSE and the optional LSE_T [slots, total_q, Hq] fp32. Returns the
// partial type; *lse_t_ptr is the LSE_T pointer or null.
msa::PartialType check_partials(const torch::Tensor& o_partial, const torch::Tensor& lse_partial,
                                const std::optional<torch::Tensor>& lse_t_partial,
                                const torch::Device& device, float** lse_t_ptr) {
  const msa::PartialType partial = partial_type(o_partial, "o_partial");
  check_cuda_tensor(o_partial, "o_partial", o_partial.scalar_type(), 4, device);
  TORCH_CHECK(o_partial.size(0) >= 1 && o_partial.size(0) < 128 && o_partial.size(3) == 128,
              "o_partial: expected [slots in [1, 127], total_q, Hq, 128], got ",
              o_partial.sizes());
  check_cuda_tensor(lse_partial, "lse_partial", at::kFloat, 3, device);
  TORCH_CHECK(lse_partial.sizes() == o_partial.sizes().slice(0, 3), "lse_partial: expected ",
              o_partial.sizes().slice(0, 3), ", got ", lse_partial.sizes());
  TORCH_CHECK(o_partial.size(1) * o_partial.size(2) < INT_MAX,
              "o_partial: total_q * Hq must be < 2^31");
  *lse_t_ptr = nullptr;
  if (lse_t_partial.has_value()) {
    check_cuda_tensor(*lse_t_partial, "lse_t_partial", at::kFloat, 3, device);
    TORCH_CHECK(lse_t_partial->sizes() == lse_partial.sizes(),
                "lse_t_partial: must have the shape of lse_partial");
    *lse_t_ptr = lse_t_partial->data_ptr<float>();
  }
  return partial;
}

void sparse_prefill_portable(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
    const torch::Tensor& kv_lens, const std::optional<torch::Tensor>& page_table,
    const torch::Tensor& k2q_row_ptr, const torch::Tensor& qsplit_indices,
    const torch::Tensor& scheduler_metadata, const torch::Tensor& work_count,
    torch::Tensor& o_partial, torch::Tensor& lse_partial,
    const std::optional<torch::Tensor>& lse_t_partial, double softmax_scale,
    double inv_temperature, bool causal, bool pv_e4m3) {
  TORCH_CHECK(q.is_cuda(), "q: must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const torch::Device device = q.device();
  const bool paged = page_table.has_value();
  const bool q_fp8 = check_rows_16b(q, "q", 3, device);
  const bool kv_fp8 = check_rows_16b(k, "k", paged ? 4 : 3, device);
  check_rows_16b(v, "v", paged ? 4 : 3, device);
  TORCH_CHECK(v.sizes() == k.sizes() && v.strides() == k.strides() &&
                  v.scalar_type() == k.scalar_type(),
              "v: must have the shape, strides and dtype of k, got ", v.sizes(), " ",
              v.scalar_type(), " and ", k.sizes(), " ", k.scalar_type());
  TORCH_CHECK(!q_fp8 || kv_fp8, "k: e4m3 q needs e4m3 k / v, got ", k.scalar_type());
  TORCH_CHECK(!pv_e4m3 || q_fp8, "pv_e4m3: P in e4m3 needs e4m3 q / k / v, got q ",
              q.scalar_type());
  const int64_t total_q = q.size(0), hq = q.size(1), hkv = k.size(1);
  TORCH_CHECK(!paged || k.size(2) == 128, "k: paged K/V need 128-token pages, got ", k.sizes());
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0, "q: ", hq, " heads are not a multiple of the ", hkv,
              " KV heads");
  const int64_t group = hq / hkv;
  TORCH_CHECK(group == 1 || group == 2 || group == 4 || group == 8 || group == 16,
              "q: heads per KV head must be 1, 2, 4, 8 or 16, got ", group);
  check_cuda_tensor(cu_seqlens_q, "cu_seqlens_q", at::kInt, 1, device);
  check_cuda_tensor(cu_seqlens_k, "cu_seqlens_k", at::kInt, 1, device);
  const int64_t batch = cu_seqlens_q.numel() - 1;
  TORCH_CHECK(batch >= 1 && cu_seqlens_k.numel() == batch + 1,
              "cu_seqlens_k: expected ", batch + 1, " entries, got ", cu_seqlens_k.numel());
  check_cuda_tensor(kv_lens, "kv_lens", at::kInt, 1, device);
  TORCH_CHECK(kv_lens.numel() == batch, "kv_lens: expected ", batch, " entries, got ",
              kv_lens.numel());
  check_cuda_tensor(k2q_row_ptr, "k2q_row_ptr", at::kInt, 2, device);
  check_cuda_tensor(qsplit_indices, "qsplit_indices", at::kInt, 2, device);
  TORCH_CHECK(k2q_row_ptr.size(0) == hkv && qsplit_indices.size(0) == hkv &&
                  k2q_row_ptr.size(1) >= 1,
              "k2q_row_ptr / qsplit_indices: expected [", hkv, ", ...], got ",
              k2q_row_ptr.sizes(), " and ", qsplit_indices.sizes());
  check_cuda_tensor(scheduler_metadata, "scheduler_metadata", at::kInt, 2, device);
  TORCH_CHECK(scheduler_metadata.size(1) == 6 && scheduler_metadata.size(0) < INT_MAX,
              "scheduler_metadata: expected [capacity, 6], got ", scheduler_metadata.sizes());
  check_cuda_tensor(work_count, "work_count", at::kInt, 1, device);
  TORCH_CHECK(work_count.numel() == 1, "work_count: expected one element");
  msa::SparsePrefillArgs a{};
  a.partial = check_partials(o_partial, lse_partial, lse_t_partial, device, &a.lse_t_partial);
  TORCH_CHECK(o_partial.size(1) == total_q && o_partial.size(2) == hq,
              "o_partial: expected [slots, ", total_q, ", ", hq, ", 128], got ",
              o_partial.sizes());
  TORCH_CHECK(!kv_fp8 || a.partial != msa::PartialType::kFloat32,
              "o_partial: e4m3 K / V take bfloat16, float16 or float8_e4m3fn partials");
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.q_fp8 = q_fp8;
  a.kv_fp8 = kv_fp8;
  a.pv_fp8 = pv_e4m3;
  a.q_stride_token = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.kv_stride_unit = k.stride(0);
  a.kv_stride_head = k.stride(1);
  a.kv_stride_key = paged ? k.stride(2) : 0;
  a.kv_units = k.size(0);
  a.paged = paged;
  a.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  a.cu_seqlens_k = cu_seqlens_k.data_ptr<int32_t>();
  a.kv_lens = kv_lens.data_ptr<int32_t>();
  if (paged) {
    check_page_table(*page_table, batch, device, &a.page_table, &a.page_table_stride,
                     &a.page_table_cols);
  }
  a.row_ptr = k2q_row_ptr.data_ptr<int32_t>();
  a.row_ptr_stride = k2q_row_ptr.stride(0);
  TORCH_CHECK(k2q_row_ptr.size(1) - 1 < INT_MAX, "k2q_row_ptr: too many rows");
  a.rows = static_cast<int>(k2q_row_ptr.size(1) - 1);
  a.qsplit = qsplit_indices.data_ptr<int32_t>();
  a.qsplit_stride = qsplit_indices.stride(0);
  a.entries = qsplit_indices.size(1);
  a.metadata = scheduler_metadata.data_ptr<int32_t>();
  a.work_count = work_count.data_ptr<int32_t>();
  a.work_capacity = static_cast<int>(scheduler_metadata.size(0));
  a.o_partial = o_partial.data_ptr();
  a.lse_partial = lse_partial.data_ptr<float>();
  a.want_lse_t = a.lse_t_partial != nullptr;
  a.slots = static_cast<int>(o_partial.size(0));
  a.total_q = static_cast<int>(total_q);
  a.batch = static_cast<int>(batch);
  a.hkv = static_cast<int>(hkv);
  a.group = static_cast<int>(group);
  a.scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  a.inv_temperature = static_cast<float>(inv_temperature);
  a.causal = causal;
  check_launch(msa::launch_sparse_prefill_portable(
                   a, c10::cuda::getCurrentCUDAStream(device.index())),
               "sparse_prefill_portable");
}

void sparse_combine_portable(const torch::Tensor& o_partial, const torch::Tensor& lse_partial,
                             const std::optional<torch::Tensor>& lse_t_partial,
                             const torch::Tensor& split_counts, torch::Tensor& out,
                             torch::Tensor& lse, const std::optional<torch::Tensor>& lse_t) {
  TORCH_CHECK(o_partial.is_cuda(), "o_partial: must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(o_partial.device());
  const torch::Device device = o_partial.device();
  msa::SparseCombineArgs a{};
  float* lse_t_partial_ptr = nullptr;
  a.partial = check_partials(o_partial, lse_partial, lse_t_partial, device, &lse_t_partial_ptr);
  const int64_t total_q = o_partial.size(1), hq = o_partial.size(2);
  check_cuda_tensor(split_counts, "split_counts", at::kInt, 2, device);
  const int64_t hkv = split_counts.size(1);
  TORCH_CHECK(split_counts.size(0) == total_q && hkv >= 1 && hq % hkv == 0,
              "split_counts: expected [", total_q, ", Hkv] with Hkv dividing ", hq, ", got ",
              split_counts.sizes());
  check_cuda_tensor(out, "out", at::kBFloat16, 3, device);
  TORCH_CHECK(out.sizes() == o_partial.sizes().slice(1, 3), "out: expected ",
              o_partial.sizes().slice(1, 3), ", got ", out.sizes());
  check_cuda_tensor(lse, "lse", at::kFloat, 2, device);
  TORCH_CHECK(lse.sizes() == o_partial.sizes().slice(1, 2), "lse: expected ",
              o_partial.sizes().slice(1, 2), ", got ", lse.sizes());
  TORCH_CHECK(lse_t_partial.has_value() == lse_t.has_value(),
              "lse_t_partial / lse_t: give both or neither");
  a.o_partial = o_partial.data_ptr();
  a.lse_partial = lse_partial.data_ptr<float>();
  a.split_counts = split_counts.data_ptr<int32_t>();
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.want_lse_t = lse_t.has_value();
  if (a.want_lse_t) {
    check_cuda_tensor(*lse_t, "lse_t", at::kFloat, 2, device);
    TORCH_CHECK(lse_t->sizes() == lse.sizes(), "lse_t: must have the shape of lse");
    a.lse_t_partial = lse_t_partial_ptr;
    a.lse_t = lse_t->data_ptr<float>();
  }
  a.slots = static_cast<int>(o_partial.size(0));
  a.total_q = static_cast<int>(total_q);
  a.num_heads = static_cast<int>(hq);
  a.hkv = static_cast<int>(hkv);
  check_launch(msa::launch_sparse_combine_portable(
                   a, c10::cuda::getCurrentCUDAStream(device.index())),
               "sparse_combine_portable");
}

void block_max_score_portable(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& cu_seqlens_q,
                              const std::optional<torch::Tensor>& cu_seqlens_k,
                              const torch::Tensor& k_lens, const torch::Tensor& offsets,
                              const std::optional<torch::Tensor>& page_table,
                              torch::Tensor& out, double scale, bool causal, int64_t grid_x,
                              int64_t key_splits) {
  TORCH_CHECK(q.is_cuda(), "q_idx: must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const torch::Device device = q.device();
  const bool paged = page_table.has_value();
  const bool fp8 = check_rows_16b(q, "q_idx", 3, device);
  check_rows_16b(k, "k_idx", paged ? 4 : 3, device);
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k_idx: expected q_idx's dtype ",
              q.scalar_type(), ", got ", k.scalar_type());
  TORCH_CHECK(k.size(1) == 1, "k_idx: the portable kernel serves one shared key head, got ",
              k.sizes());
  TORCH_CHECK(!paged || k.size(2) == 128, "k_idx: pages must hold 128 keys, got ", k.sizes());
  const int64_t total_q = q.size(0), heads = q.size(1);
  TORCH_CHECK(heads == 1 || heads == 2 || heads == 4 || heads == 8,
              "q_idx: 1, 2, 4 or 8 index heads, got ", heads);
  check_cuda_tensor(cu_seqlens_q, "cu_seqlens_q", at::kInt, 1, device);
  const int64_t batch = cu_seqlens_q.numel() - 1;
  TORCH_CHECK(batch >= 1 && batch < 65535, "cu_seqlens_q: 1 to 65534 requests, got ", batch);
  check_cuda_tensor(k_lens, "k_lens", at::kInt, 1, device);
  check_cuda_tensor(offsets, "offsets", at::kInt, 1, device);
  TORCH_CHECK(k_lens.numel() == batch && offsets.numel() == batch,
              "k_lens / offsets: expected ", batch, " entries");
  check_cuda_tensor(out, "out", at::kFloat, 3, device);
  TORCH_CHECK(out.size(0) == heads && out.size(2) == total_q && out.size(1) < INT_MAX,
              "out: expected [", heads, ", max_k_tiles, ", total_q, "], got ", out.sizes());
  TORCH_CHECK(grid_x >= 1 && grid_x <= INT_MAX, "grid_x: must be in [1, 2^31), got ", grid_x);
  TORCH_CHECK(key_splits >= 1 && key_splits <= 65535, "key_splits: must be in [1, 65535], got ",
              key_splits);
  msa::BlockMaxScoreArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.fp8 = fp8;
  a.q_stride_token = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.k_stride_unit = k.stride(0);
  a.k_stride_key = paged ? k.stride(2) : 0;
  a.k_units = k.size(0);
  a.paged = paged;
  a.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  if (paged) {
    check_page_table(*page_table, batch, device, &a.page_table, &a.page_table_stride,
                     &a.page_table_cols);
  } else {
    TORCH_CHECK(cu_seqlens_k.has_value(), "cu_seqlens_k: required for dense keys");
    check_cuda_tensor(*cu_seqlens_k, "cu_seqlens_k", at::kInt, 1, device);
    TORCH_CHECK(cu_seqlens_k->numel() == batch + 1, "cu_seqlens_k: expected ", batch + 1,
                " entries, got ", cu_seqlens_k->numel());
    a.cu_seqlens_k = cu_seqlens_k->data_ptr<int32_t>();
  }
  a.k_lens = k_lens.data_ptr<int32_t>();
  a.offsets = offsets.data_ptr<int32_t>();
  a.out = out.data_ptr<float>();
  a.total_q = total_q;
  a.num_heads = static_cast<int>(heads);
  a.max_k_tiles = static_cast<int>(out.size(1));
  a.batch = static_cast<int>(batch);
  a.grid_x = static_cast<int>(grid_x);
  a.key_splits = static_cast<int>(key_splits);
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  check_launch(msa::launch_block_max_score_portable(
                   a, c10::cuda::getCurrentCUDAStream(device.index())),
               "block_max_score_portable");
}

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
    int64_t token_warps) {
  TORCH_CHECK(q.is_cuda(), "q: must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const torch::Device device = q.device();
  constexpr int64_t kDim = 128, kPage = 128;
  const at::ScalarType fp8 = at::kFloat8_e4m3fn;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == fp8,
              "q: expected bfloat16 or float8_e4m3fn, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 || k.scalar_type() == fp8,
              "k: expected bfloat16 or float8_e4m3fn, got ", k.scalar_type());
  TORCH_CHECK(!(q.scalar_type() == fp8 && k.scalar_type() == at::kBFloat16),
              "k: e4m3 q needs e4m3 K/V");
  check_cuda_tensor(q, "q", q.scalar_type(), 3, device);
  check_cuda_tensor(k, "k", k.scalar_type(), 4, device);
  check_cuda_tensor(v, "v", k.scalar_type(), 4, device);
  check_cuda_tensor(page_table, "page_table", at::kInt, 2, device);
  check_cuda_tensor(seqused_k, "seqused_k", at::kInt, 1, device);
  check_cuda_tensor(request_indices, "request_indices", at::kInt, 1, device);
  check_cuda_tensor(kv_tile_indices, "kv_tile_indices", at::kInt, 1, device);
  check_cuda_tensor(qo_tile_indices, "qo_tile_indices", at::kInt, 1, device);
  check_cuda_tensor(num_splits, "num_splits", at::kInt, 1, device);
  check_cuda_tensor(merge_indptr, "merge_indptr", at::kInt, 1, device);
  check_cuda_tensor(out, "out", at::kBFloat16, 3, device);
  const int64_t batch = seqused_k.numel();
  const int64_t hq = q.size(1), hkv = k.size(1);
  TORCH_CHECK(batch >= 1, "seqused_k: needs at least one request");
  TORCH_CHECK(seqlen_q >= 1 && seqlen_q <= 16, "seqlen_q: must be in [1, 16], got ", seqlen_q);
  TORCH_CHECK(qo_tile_rows >= 1 && qo_tile_rows <= 128, "qo_tile_rows: must be in [1, 128], got ",
              qo_tile_rows);
  TORCH_CHECK(q.size(0) == batch * seqlen_q && q.size(2) == kDim, "q: expected shape [",
              batch * seqlen_q, ", Hq, 128], got ", q.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "v: shape ", v.sizes(), " differs from k's ", k.sizes());
  TORCH_CHECK(k.size(0) >= 1 && k.size(2) == kPage && k.size(3) == kDim,
              "k: expected shape [pages >= 1, Hkv, 128, 128], got ", k.sizes());
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0 && hq / hkv <= 16, "q: ", hq,
              " heads is not a multiple (G <= 16) of k's ", hkv, " heads");
  TORCH_CHECK(hkv <= 65535, "k: at most 65535 KV heads (grid y)");
  TORCH_CHECK(page_table.size(0) == batch && page_table.size(1) >= 1 &&
                  page_table.size(1) <= INT_MAX,
              "page_table: expected shape [", batch, ", >= 1], got ", page_table.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "out: expected shape ", q.sizes(), ", got ", out.sizes());
  const int64_t num_work = request_indices.numel();
  TORCH_CHECK(num_work >= 1 && num_work <= INT_MAX && kv_tile_indices.numel() == num_work &&
                  qo_tile_indices.numel() == num_work,
              "request_indices / kv_tile_indices / qo_tile_indices: expected equal sizes >= 1");
  TORCH_CHECK(num_splits.numel() == batch && merge_indptr.numel() == batch + 1,
              "num_splits / merge_indptr: expected [", batch, "] and [", batch + 1, "]");
  TORCH_CHECK(kv_chunk_size >= 1 && kv_chunk_size <= INT_MAX,
              "kv_chunk_size: must be >= 1, got ", kv_chunk_size);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "q / k / v / out: data must be 16-byte aligned");
  msa::DecodeAttentionArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.q_fp8 = q.scalar_type() == fp8;
  a.kv_fp8 = k.scalar_type() == fp8;
  if (q2k_indices.has_value()) {
    const torch::Tensor& q2k = *q2k_indices;
    check_cuda_tensor(q2k, "q2k_indices", at::kInt, 3, device);
    TORCH_CHECK(q2k.size(0) == hkv && q2k.size(1) == batch * seqlen_q && q2k.size(2) >= 1 &&
                    q2k.size(2) <= 32,
                "q2k_indices: expected shape [", hkv, ", ", batch * seqlen_q,
                ", topK <= 32], got ", q2k.sizes());
    a.q2k_indices = q2k.data_ptr<int32_t>();
    a.topk = static_cast<int>(q2k.size(2));
  }
  a.page_table = page_table.data_ptr<int32_t>();
  a.page_table_width = static_cast<int>(page_table.size(1));
  a.seqused_k = seqused_k.data_ptr<int32_t>();
  a.batch = static_cast<int>(batch);
  a.seqlen_q = static_cast<int>(seqlen_q);
  a.num_qo_heads = static_cast<int>(hq);
  a.num_kv_heads = static_cast<int>(hkv);
  a.num_pages = k.size(0);
  a.request_indices = request_indices.data_ptr<int32_t>();
  a.kv_tile_indices = kv_tile_indices.data_ptr<int32_t>();
  a.qo_tile_indices = qo_tile_indices.data_ptr<int32_t>();
  a.qo_tile_rows = static_cast<int>(qo_tile_rows);
  a.num_splits = num_splits.data_ptr<int32_t>();
  a.merge_indptr = merge_indptr.data_ptr<int32_t>();
  a.num_work = static_cast<int>(num_work);
  a.kv_chunk_size = static_cast<int>(kv_chunk_size);
  a.split_kv = split_kv;
  // The persistent form: asked for with its request table and CTA count (a plan of a dense call
  // whose tiles take the ping-pong form), within its bounds (its request table, and a page
  // count whose ranges are ints); otherwise the schedule's work items run.
  const int64_t tiles = (seqlen_q * (hq / hkv) + qo_tile_rows - 1) / qo_tile_rows;
  a.persistent = request_pages.has_value() && persistent_ctas > 0 && pingpong && warpgroup &&
                 q.scalar_type() == k.scalar_type() && !q2k_indices.has_value() &&
                 batch <= msa::kDecodePersistentMaxRequests && persistent_ctas <= 65536 &&
                 batch * hkv * tiles * page_table.size(1) <= INT_MAX;
  if (a.persistent) {
    check_cuda_tensor(*request_pages, "request_pages", at::kLong, 1, device);
    TORCH_CHECK(request_pages->numel() == batch + 1, "request_pages: expected [", batch + 1,
                "], got ", request_pages->sizes());
    TORCH_CHECK(o_partial.has_value() && lse_partial.has_value(),
                "o_partial / lse_partial: the persistent form needs both workspaces");
    a.request_pages = request_pages->data_ptr<int64_t>();
    a.num_work = static_cast<int>(persistent_ctas);
  }
  if (split_kv || a.persistent) {
    TORCH_CHECK(o_partial.has_value() && lse_partial.has_value(),
                "o_partial / lse_partial: split_kv needs both workspaces");
    const torch::Tensor& op = *o_partial;
    const torch::Tensor& lp = *lse_partial;
    check_cuda_tensor(op, "o_partial", at::kFloat, 4, device);
    check_cuda_tensor(lp, "lse_partial", at::kFloat, 3, device);
    TORCH_CHECK(op.size(1) == seqlen_q && op.size(2) == hq && op.size(3) == kDim,
                "o_partial: expected shape [P, ", seqlen_q, ", ", hq, ", 128], got ", op.sizes());
    TORCH_CHECK(lp.size(0) == op.size(0) && lp.size(1) == seqlen_q && lp.size(2) == hq,
                "lse_partial: expected shape [", op.size(0), ", ", seqlen_q, ", ", hq, "], got ",
                lp.sizes());
    a.o_partial = op.data_ptr<float>();
    a.lse_partial = lp.data_ptr<float>();
    a.num_partial_slots = op.size(0);
    TORCH_CHECK(!a.persistent || a.num_partial_slots >= 2 * persistent_ctas,
                "o_partial: the persistent form needs ", 2 * persistent_ctas, " slots, got ",
                a.num_partial_slots);
  }
  a.out = out.data_ptr();
  if (lse.has_value()) {
    check_cuda_tensor(*lse, "lse", at::kFloat, 2, device);
    TORCH_CHECK(lse->size(0) == q.size(0) && lse->size(1) == hq, "lse: expected shape [",
                q.size(0), ", ", hq, "], got ", lse->sizes());
    a.lse = lse->data_ptr<float>();
  }
  a.softmax_scale = static_cast<float>(softmax_scale);
  // Split keys across warps only when every qo tile has <= 16 rows.
  a.split_keys = split_keys && std::min<int64_t>(qo_tile_rows, seqlen_q * (hq / hkv)) <= 16;
  // The direct e4m3 form (no conversion pass) serves split-keys tiles with e4m3 q and K/V.
  a.direct_fp8 = direct_fp8 && a.split_keys && a.q_fp8 && a.kv_fp8;
  // The warpgroup (wgmma) form serves q and K/V of one dtype (the caller asks for it on tiles
  // of > 16 rows, or on any tile when forced).
  a.warpgroup = warpgroup && a.q_fp8 == a.kv_fp8;
  // Its ping-pong form (a producer warpgroup and two consumers taking turns): q and K/V of one
  // dtype, as the warpgroup form.
  a.pingpong = pingpong && a.warpgroup;
  // Its e4m3 P.V form (e4m3 q and K/V; the ping-pong and persistent kernels).
  a.pv_fp8 = pv_fp8 && a.pingpong && a.q_fp8;
  // The token-warps form (1; 0: off): sparse tiles of more than 16 rows with e4m3 q and K/V
  // (the launcher takes it where it can make the caches' tensor maps; else the forms above
  // serve).
  TORCH_CHECK(token_warps == 0 || token_warps == 1, "token_warps: must be 0 or 1, got ",
              token_warps);
  const bool token_tiles = a.q2k_indices != nullptr && a.q_fp8 && a.kv_fp8 &&
                           std::min<int64_t>(qo_tile_rows, seqlen_q * (hq / hkv)) > 16;
  a.token_warps = token_tiles ? static_cast<int>(token_warps) : 0;
  check_launch(msa::launch_decode_attention(a, c10::cuda::getCurrentCUDAStream(device.index())),
               "sparse_decode_attention");
}

void decode_indexer_plan_update(const torch::Tensor& seqused_k, torch::Tensor& work,
                                torch::Tensor& requests, torch::Tensor& chunk_pages) {
  TORCH_CHECK(seqused_k.is_cuda(), "seqused_k: must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(seqused_k.device());
  const torch::Device device = seqused_k.device();
  check_cuda_tensor(seqused_k, "seqused_k", at::kInt, 1, device);
  check_cuda_tensor(work, "work", at::kInt, 2, device);
  check_cuda_tensor(requests, "requests", at::kInt, 2, device);
  check_cuda_tensor(chunk_pages, "chunk_pages", at::kInt, 1, device);
  const int64_t batch = seqused_k.numel();
  TORCH_CHECK(batch >= 1 && batch < INT_MAX, "seqused_k: needs 1 .. 2^31 - 2 requests");
  TORCH_CHECK(work.size(1) == 2 && work.size(0) > batch && work.size(0) < INT_MAX,
              "work: expected [capacity > B, 2], got ", work.sizes());
  TORCH_CHECK(requests.size(0) == batch && requests.size(1) == 3, "requests: expected [", batch,
              ", 3], got ", requests.sizes());
  TORCH_CHECK(chunk_pages.numel() >= 1, "chunk_pages: expected [1]");
  msa::DecodeIndexerPlanArgs a{};
  a.seqused_k = seqused_k.data_ptr<int32_t>();
  a.batch = static_cast<int>(batch);
  a.capacity = static_cast<int>(work.size(0));
  a.work = work.data_ptr<int32_t>();
  a.requests = requests.data_ptr<int32_t>();
  a.chunk_pages = chunk_pages.data_ptr<int32_t>();
  check_launch(msa::launch_decode_indexer_plan(a, c10::cuda::getCurrentCUDAStream(device.index())),
               "decode_indexer_plan_update");
}

void decode_indexer_topk(const torch::Tensor& q, const torch::Tensor& k,
                         const std::optional<torch::Tensor>& k_scale, bool k_scale_linear,
                         const std::optional<torch::Tensor>& k_global_scale,
                         const torch::Tensor& page_table, const torch::Tensor& seqused_k,
                         const torch::Tensor& work, torch::Tensor& requests,
                         const torch::Tensor& chunk_pages, torch::Tensor& partials,
                         torch::Tensor& out, const std::optional<torch::Tensor>& scores,
                         int64_t seqlen_q, int64_t topk, double scale, bool tma_pages,
                         bool offer_warp, bool butterfly_merge) {
  TORCH_CHECK(q.is_cuda(), "q: must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const torch::Device device = q.device();
  const at::ScalarType fp8 = at::kFloat8_e4m3fn;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == fp8,
              "q: expected bfloat16 or float8_e4m3fn, got ", q.scalar_type());
  check_cuda_tensor(q, "q", q.scalar_type(), 3, device);
  const bool nvfp4 = k.scalar_type() == at::kByte;
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 || k.scalar_type() == fp8 || nvfp4,
              "k: expected bfloat16, float8_e4m3fn or uint8 (NVFP4), got ", k.scalar_type());
  TORCH_CHECK((q.scalar_type() == at::kBFloat16) == (k.scalar_type() == at::kBFloat16),
              "k: bf16 keys need a bf16 q, e4m3 / NVFP4 keys an e4m3 q");
  check_cuda_tensor(k, "k", k.scalar_type(), 4, device);
  TORCH_CHECK(k.size(0) >= 1 && k.size(1) == 1 && k.size(2) == 128 &&
                  k.size(3) == (nvfp4 ? 64 : 128),
              "k: expected [pages, 1, 128, ", nvfp4 ? 64 : 128, "], got ", k.sizes());
  check_cuda_tensor(page_table, "page_table", at::kInt, 2, device);
  check_cuda_tensor(seqused_k, "seqused_k", at::kInt, 1, device);
  check_cuda_tensor(work, "work", at::kInt, 2, device);
  check_cuda_tensor(requests, "requests", at::kInt, 2, device);
  check_cuda_tensor(chunk_pages, "chunk_pages", at::kInt, 1, device);
  check_cuda_tensor(partials, "partials", at::kInt, 4, device);
  check_cuda_tensor(out, "out", at::kInt, 3, device);
  const int64_t batch = seqused_k.numel(), heads = q.size(1);
  TORCH_CHECK(batch >= 1, "seqused_k: needs at least one request");
  TORCH_CHECK(seqlen_q >= 1 && seqlen_q <= 16, "seqlen_q: must be in [1, 16], got ", seqlen_q);
  TORCH_CHECK(heads >= 1 && seqlen_q * heads <= 128, "q: seqlen_q * heads must be <= 128, got ",
              seqlen_q, " * ", heads);
  TORCH_CHECK(q.size(0) == batch * seqlen_q && q.size(2) == 128, "q: expected [", batch * seqlen_q,
              ", H, 128], got ", q.sizes());
  TORCH_CHECK(topk >= 2 && topk <= 32, "topk: must be in [2, 32], got ", topk);
  TORCH_CHECK(page_table.size(0) == batch && page_table.size(1) >= 1 &&
                  page_table.size(1) < INT_MAX / 128,
              "page_table: expected [", batch, ", 1 .. 2^24), got ", page_table.sizes());
  const int64_t capacity = work.size(0);
  TORCH_CHECK(work.size(1) == 2 && capacity > batch && capacity < INT_MAX,
              "work: expected [capacity > B, 2], got ", work.sizes());
  TORCH_CHECK(requests.size(0) == batch && requests.size(1) == 3, "requests: expected [", batch,
              ", 3], got ", requests.sizes());
  TORCH_CHECK(chunk_pages.numel() >= 1, "chunk_pages: expected [1]");
  const int64_t list_capacity = topk <= 16 ? 16 : 32;
  TORCH_CHECK(partials.size(0) == capacity && partials.size(1) == seqlen_q * heads &&
                  partials.size(2) == list_capacity && partials.size(3) == 2,
              "partials: expected [", capacity, ", ", seqlen_q * heads, ", ", list_capacity,
              ", 2], got ", partials.sizes());
  TORCH_CHECK(out.size(0) >= heads && out.size(0) % heads == 0 &&
                  out.size(1) == batch * seqlen_q && out.size(2) == topk,
              "out: expected [", heads, " * r, ", batch * seqlen_q, ", ", topk, "], got ",
              out.sizes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(partials.data_ptr()) % 16 == 0,
              "q / k / partials: data must be 16-byte aligned");
  msa::DecodeIndexerArgs a{};
  a.q = q.data_ptr();
  a.q_fp8 = q.scalar_type() == fp8;
  a.k = k.data_ptr();
  a.k_format = nvfp4 ? 2 : (k.scalar_type() == fp8 ? 1 : 0);
  a.num_pages = k.size(0);
  if (nvfp4) {
    TORCH_CHECK(k_scale.has_value(), "k_scale: NVFP4 keys need their block scales");
    const torch::Tensor& s = *k_scale;
    TORCH_CHECK(s.is_cuda() && s.device() == device && s.is_contiguous() &&
                    (s.scalar_type() == at::kByte || s.scalar_type() == fp8),
                "k_scale: expected a contiguous uint8 / float8_e4m3fn CUDA tensor on ", device);
    TORCH_CHECK(s.numel() >= k.size(0) * 1024, "k_scale: has ", s.numel(), " bytes, needs >= ",
                k.size(0) * 1024);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(s.data_ptr()) % 16 == 0,
                "k_scale: data must be 16-byte aligned");
    a.k_scale = static_cast<const uint8_t*>(s.data_ptr());
    a.k_scale_linear = k_scale_linear;
    if (k_global_scale.has_value()) {
      const torch::Tensor& g = *k_global_scale;
      TORCH_CHECK(g.is_cuda() && g.device() == device && g.scalar_type() == at::kFloat &&
                      g.numel() >= 1,
                  "k_global_scale: expected a float32 CUDA tensor on ", device);
      a.k_global_scale = g.data_ptr<float>();
    }
  }
  a.page_table = page_table.data_ptr<int32_t>();
  a.page_table_width = static_cast<int>(page_table.size(1));
  a.seqused_k = seqused_k.data_ptr<int32_t>();
  a.batch = static_cast<int>(batch);
  a.seqlen_q = static_cast<int>(seqlen_q);
  a.num_heads = static_cast<int>(heads);
  a.out_head_repeat = static_cast<int>(out.size(0) / heads);
  a.topk = static_cast<int>(topk);
  a.scale = static_cast<float>(scale);
  a.work = work.data_ptr<int32_t>();
  a.requests = requests.data_ptr<int32_t>();
  a.chunk_pages = chunk_pages.data_ptr<int32_t>();
  a.capacity = static_cast<int>(capacity);
  a.partials = partials.data_ptr<int32_t>();
  a.list_capacity = static_cast<int>(list_capacity);
  a.out = out.data_ptr<int32_t>();
  if (scores.has_value()) {
    check_cuda_tensor(*scores, "scores", at::kFloat, 3, device);
    TORCH_CHECK(scores->size(0) == heads && scores->size(1) == batch * seqlen_q &&
                    scores->size(2) == page_table.size(1),
                "scores: expected [", heads, ", ", batch * seqlen_q, ", ", page_table.size(1),
                "], got ", scores->sizes());
    a.scores = scores->data_ptr<float>();
  }
  a.tma_pages = tma_pages;
  a.offer_warp = offer_warp;
  a.butterfly_merge = butterfly_merge;
  check_launch(msa::launch_decode_indexer_topk(a, c10::cuda::getCurrentCUDAStream(device.index())),
               "decode_indexer_topk");
}

std::tuple<int64_t, int64_t, std::string> csrc_image(const std::string& unit, int64_t device) {
  using Query = cudaError_t (*)(cudaFuncAttributes*);
  static const std::pair<const char*, Query> kUnits[] = {
      {"build_k2q_csr", msa::build_k2q_csr_image},
      {"sparse_topk_select", msa::sparse_topk_select_image},
      {"decode_attention", msa::decode_attention_image},
      {"decode_indexer", msa::decode_indexer_image},
      {"fmha_transpose_v", msa::fmha_transpose_v_image},
      {"sparse_prefill_portable", msa::sparse_prefill_portable_image},
      {"block_max_score_portable", msa::block_max_score_portable_image},
  };
  // Never throws: a bad argument comes back as the error string (naming the argument), like
  // a unit the device cannot run, so that callers handle one outcome.
  Query query = nullptr;
  for (const auto& [name, fn] : kUnits) {
    if (unit == name) query = fn;
  }
  if (query == nullptr) return {0, 0, "unit: no csrc translation unit named '" + unit + "'"};
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  if (device < 0 || device >= count) {
    return {0, 0, "device: no CUDA device " + std::to_string(device) + " (" +
                      std::to_string(count) + " present)"};
  }
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaFuncAttributes attr{};
  const cudaError_t err = query(&attr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();   // not sticky: keep it from surfacing at the next launch check
    return {0, 0, std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)};
  }
  return {attr.binaryVersion, attr.ptxVersion, std::string()};
}

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def(
      "run_build_k2q_csr(Tensor q2k, Tensor cu_q, Tensor cu_k, Tensor! row_ptr, Tensor! q_idx, "
      "int topk, int blk_kv, int total_rows, int max_kv_blocks, bool counting_sort) -> ()");
  ops.impl("run_build_k2q_csr", torch::kCUDA, &run_build_k2q_csr);
  ops.def(
      "run_build_k2q_csr_with_schedule(Tensor q2k, Tensor cu_q, Tensor cu_k, Tensor! row_ptr, "
      "Tensor! q_idx, int topk, int blk_kv, int total_rows, int max_kv_blocks, "
      "Tensor! scheduler_metadata, Tensor! work_count, Tensor! qsplit_idx, "
      "Tensor! split_counts, int target_q_per_cta, int work_capacity, int max_seqlen_q, "
      "bool counting_sort) -> ()");
  ops.impl("run_build_k2q_csr_with_schedule", torch::kCUDA, &run_build_k2q_csr_with_schedule);
  ops.def(
      "sparse_topk_select(Tensor max_score, Tensor! out, int topk, int num_valid_pages, "
      "Tensor? num_valid_pages_per_query, int force_begin_blocks, int force_end_blocks, "
      "Tensor? causal_end_block, int num_out_heads, int head_reduce, bool staged) -> ()");
  ops.impl("sparse_topk_select", torch::kCUDA, &sparse_topk_select);
  ops.def(
      "sparse_decode_attention(Tensor q, Tensor k, Tensor v, Tensor? q2k_indices, "
      "Tensor page_table, Tensor seqused_k, Tensor request_indices, Tensor kv_tile_indices, "
      "Tensor qo_tile_indices, Tensor num_splits, Tensor merge_indptr, Tensor(a!)? o_partial, "
      "Tensor(b!)? lse_partial, Tensor(c!) out, Tensor(d!)? lse, int seqlen_q, "
      "int kv_chunk_size, bool split_kv, float softmax_scale, bool split_keys=False, "
      "bool direct_fp8=False, bool warpgroup=False, bool pingpong=False, "
      "int qo_tile_rows=128, Tensor(e!)? request_pages=None, int persistent_ctas=0, "
      "bool pv_fp8=False, int token_warps=0) -> ()");
  ops.impl("sparse_decode_attention", torch::kCUDA, &sparse_decode_attention);
  ops.def(
      "sparse_prefill_portable(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, Tensor kv_lens, Tensor? page_table, Tensor k2q_row_ptr, "
      "Tensor qsplit_indices, Tensor scheduler_metadata, Tensor work_count, "
      "Tensor(a!) o_partial, Tensor(b!) lse_partial, Tensor(c!)? lse_t_partial, "
      "float softmax_scale, float inv_temperature, bool causal, bool pv_e4m3=False) -> ()");
  ops.impl("sparse_prefill_portable", torch::kCUDA, &sparse_prefill_portable);
  ops.def(
      "sparse_combine_portable(Tensor o_partial, Tensor lse_partial, Tensor? lse_t_partial, "
      "Tensor split_counts, Tensor(a!) out, Tensor(b!) lse, Tensor(c!)? lse_t) -> ()");
  ops.impl("sparse_combine_portable", torch::kCUDA, &sparse_combine_portable);
  ops.def(
      "block_max_score_portable(Tensor q, Tensor k, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, "
      "Tensor k_lens, Tensor offsets, Tensor? page_table, Tensor(a!) out, float scale, "
      "bool causal, int grid_x, int key_splits) -> ()");
  ops.impl("block_max_score_portable", torch::kCUDA, &block_max_score_portable);
  ops.def(
      "fmha_transpose_v_e4m3(Tensor v, Tensor cu_seqlens_k, Tensor kv_lens, Tensor? page_table, "
      "Tensor(a!) tables, Tensor(b!) vt) -> ()");
  ops.impl("fmha_transpose_v_e4m3", torch::kCUDA, &fmha_transpose_v_e4m3);
  ops.def(
      "decode_indexer_plan_update(Tensor seqused_k, Tensor(a!) work, Tensor(b!) requests, "
      "Tensor(c!) chunk_pages) -> ()");
  ops.impl("decode_indexer_plan_update", torch::kCUDA, &decode_indexer_plan_update);
  ops.def(
      "decode_indexer_topk(Tensor q, Tensor k, Tensor? k_scale, bool k_scale_linear, "
      "Tensor? k_global_scale, Tensor page_table, Tensor seqused_k, Tensor work, "
      "Tensor(a!) requests, Tensor chunk_pages, Tensor(b!) partials, Tensor(c!) out, "
      "Tensor(d!)? scores, int seqlen_q, int topk, float scale, bool tma_pages=False, "
      "bool offer_warp=False, bool butterfly_merge=False) -> ()");
  ops.impl("decode_indexer_topk", torch::kCUDA, &decode_indexer_topk);
  ops.def("csrc_image(str unit, int device) -> (int, int, str)");
  // No tensor argument, so no dispatch key to register under: a catch-all kernel.
  ops.impl("csrc_image", &csrc_image);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
