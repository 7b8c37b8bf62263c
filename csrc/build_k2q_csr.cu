// q2k -> k2q CSR builder and sparse forward schedule (contract §1.1), bit-identical to
// msa.sparse_index_utils.build_k2q_csr_torch_reference and
// msa.src.sm100.prepare_scheduler.prepare_sparse_fwd_schedule_and_split.
//
// Algorithm (no atomics, so the output is deterministic; no host synchronization):
//   1. rows_b = ceil(k_len_b / blk_kv) per request; a [batch, table_blocks] table maps
//      (b, beta) to its round-robin CSR row (blocks past the table are computed directly).
//   2. One thread per q2k entry computes its CSR row and a sort key
//      h * (total_rows + 1) + row (row = total_rows for dropped entries), its payload q_local
//      and, with a schedule, its combine slot = the rank of the entry's row among its query's
//      rows (ties by position in the q2k row). That equals the reference's traversal order
//      (rows ascending), so slots need no atomics.
//   3. A stable radix sort by key: entries are generated in (head, query, slot) order, so within
//      a row the query ids come out ascending, and each head's entries stay in its own
//      contiguous segment of exactly total_q * topk items, dropped entries (-1) at its tail.
//   4. row_ptr[h, r] = lower_bound of key (h, r) in the sorted keys.
//   5. Schedule: chunk counts per (head, row) in head-major order (the items a grid runs at
//      once then share one KV head's queries, whose gathers L2 holds better), an inclusive
//      scan, then one thread per work item binary-searches its (head, row) and writes its
//      metadata.
#include <cub/cub.cuh>

#include <algorithm>
#include <climits>

#include "common.cuh"
#include "torch_binding.h"

namespace msa {
namespace {

using detail::ceil_div;
using detail::grid_for;
using detail::kThreads;

constexpr int kMetaColumns = 6;
constexpr int kSlotShift = 24;
constexpr uint32_t kNoSlot = 0xFFu;                 // slot field of an entry without a slot
constexpr int32_t kQLocalMask = (1 << kSlotShift) - 1;
// Cap of the (request, block) -> row table: 16M entries (64 MB); blocks past it use the
// direct O(batch) formula, so a wrong max_kv_blocks hint costs time, never correctness.
constexpr int64_t kMaxRowTableEntries = int64_t(1) << 24;

struct CsrDeviceArgs {
  const int32_t* q2k;
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int32_t* rows;        // [batch] blocks per request
  const int32_t* row_table;   // [batch, table_blocks]
  int batch;
  int table_blocks;
  int hkv;
  int total_q;
  int topk;
  int total_rows;
  int64_t n_entries;          // hkv * total_q * topk
};

// ceil(max(k_len_b, 0) / blk_kv) for every request.
__global__ void request_rows_kernel(const int32_t* __restrict__ cu_k, int batch, int blk_kv,
                                    int32_t* __restrict__ rows) {
  int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  int64_t len = static_cast<int64_t>(cu_k[b + 1]) - static_cast<int64_t>(cu_k[b]);
  if (len < 0) len = 0;
  int64_t blocks = ceil_div<int64_t>(len, blk_kv);
  rows[b] = static_cast<int32_t>(blocks > INT_MAX ? INT_MAX : blocks);
}

// One thread per block index beta: row(b, beta) = sum_b' min(rows_b', beta) + rank of b among
// the requests that have a block beta (round-robin packing), -1 where b has no block beta.
__global__ void row_table_kernel(const int32_t* __restrict__ rows, int batch, int table_blocks,
                                 int32_t* __restrict__ table) {
  int beta = blockIdx.x * blockDim.x + threadIdx.x;
  if (beta >= table_blocks) return;
  int64_t next_row = 0;
  for (int b = 0; b < batch; ++b) next_row += min(rows[b], beta);
  for (int b = 0; b < batch; ++b) {
    int32_t row = -1;
    if (rows[b] > beta) {
      row = static_cast<int32_t>(next_row > INT_MAX ? INT_MAX : next_row);
      ++next_row;
    }
    table[static_cast<int64_t>(b) * table_blocks + beta] = row;
  }
}

// CSR row of block beta of request b; the caller guarantees 0 <= beta < rows[b].
__device__ __forceinline__ int64_t csr_row_of(const CsrDeviceArgs& a, int b, int beta) {
  if (beta < a.table_blocks) {
    return a.row_table[static_cast<int64_t>(b) * a.table_blocks + beta];
  }
  int64_t row = 0;
  for (int i = 0; i < a.batch; ++i) {
    int r = a.rows[i];
    row += min(r, beta) + ((i < b && r > beta) ? 1 : 0);
  }
  return row;
}

// The request that owns global query q: the largest b with cu_q[b] <= q (empty requests
// share their start with the next one, so the largest is the right one).
__device__ __forceinline__ int request_of_query(const int32_t* __restrict__ cu_q, int batch,
                                                int q) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu_q + mid) <= q) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Step 2: sort key and payload of every q2k entry (and, kWithSlots, its combine slot and the
// per-(query, head) slot count). kWithSlots needs topk to be a power of two <= 32 so a query's
// entries sit in consecutive lanes of one warp.
template <bool kWithSlots>
__global__ void __launch_bounds__(kThreads)
entry_keys_kernel(CsrDeviceArgs a, uint32_t* __restrict__ keys,
                  int32_t* __restrict__ values, int32_t* __restrict__ split_counts) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool in_range = i < a.n_entries;
  const int64_t per_head = static_cast<int64_t>(a.total_q) * a.topk;
  int h = 0, q = 0, slot_in_row = 0;
  bool valid = false;
  int32_t row = 0, q_local = 0;
  if (in_range) {
    h = static_cast<int>(i / per_head);
    const int64_t rem = i - h * per_head;
    q = static_cast<int>(rem / a.topk);
    slot_in_row = static_cast<int>(rem - static_cast<int64_t>(q) * a.topk);
    const int32_t block = __ldg(a.q2k + i);
    const int b = request_of_query(a.cu_q, a.batch, q);
    const int q_begin = __ldg(a.cu_q + b);
    const int q_end = __ldg(a.cu_q + b + 1);
    if (block >= 0 && q >= q_begin && q < q_end && block < a.rows[b]) {
      const int64_t r = csr_row_of(a, b, block);
      if (r >= 0 && r < a.total_rows) {
        valid = true;
        row = static_cast<int32_t>(r);
        q_local = q - q_begin;
      }
    }
  }
  const uint32_t key = static_cast<uint32_t>(h) * static_cast<uint32_t>(a.total_rows + 1) +
                       static_cast<uint32_t>(valid ? row : a.total_rows);
  int32_t value = valid ? q_local : -1;
  if constexpr (kWithSlots) {
    // The reference hands out slots walking rows in ascending order, so an entry's slot is the
    // number of its query's counted entries in smaller rows (earlier q2k position on ties).
    // Every valid entry counts (q_local < q_len_b by construction): max_seqlen_q, a host hint,
    // only bounds the packing (checked by the binding) and never drops work when it is short.
    const bool counted = valid;
    const int rank_key = counted ? row : INT_MAX;
    const int lane = threadIdx.x & 31;
    const int group_base = lane & ~(a.topk - 1);
    const int my_pos = lane - group_base;
    int slot = 0, count = 0;
    for (int o = 0; o < a.topk; ++o) {   // every lane runs the same trip count
      const int other = __shfl_sync(0xffffffffu, rank_key, group_base + o);
      const bool other_counted = other != INT_MAX;
      count += other_counted ? 1 : 0;
      slot += (other_counted && (other < rank_key || (other == rank_key && o < my_pos))) ? 1 : 0;
    }
    if (in_range && slot_in_row == 0) {
      split_counts[static_cast<int64_t>(q) * a.hkv + h] = count;
    }
    if (valid) {
      const uint32_t slot_field = counted ? static_cast<uint32_t>(slot) : kNoSlot;
      value = static_cast<int32_t>(static_cast<uint32_t>(q_local) | (slot_field << kSlotShift));
    }
  }
  if (in_range) {
    keys[i] = key;
    values[i] = value;
  }
}

// Step 4: row_ptr[h, r] = number of head-h entries whose row is < r (lower bound in the sorted
// keys of head h's segment).
__global__ void row_ptr_kernel(const uint32_t* __restrict__ sorted_keys, int hkv, int total_rows,
                               int64_t per_head, int32_t* __restrict__ row_ptr) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t width = static_cast<int64_t>(total_rows) + 1;
  if (idx >= hkv * width) return;
  const int h = static_cast<int>(idx / width);
  const int r = static_cast<int>(idx - h * width);
  const uint32_t target = static_cast<uint32_t>(h) * static_cast<uint32_t>(width) +
                          static_cast<uint32_t>(r);
  const uint32_t* seg = sorted_keys + h * per_head;
  int64_t lo = 0, hi = per_head;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (seg[mid] < target) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  row_ptr[idx] = static_cast<int32_t>(lo);
}

// Writes q_indices (and qsplit_indices) from the sorted payloads; columns past total_q * topk
// (a wider caller buffer) get -1.
template <bool kWithSlots>
__global__ void unpack_payload_kernel(const int32_t* __restrict__ sorted_values, int hkv,
                                      int64_t per_head, int64_t stride,
                                      int32_t* __restrict__ q_indices,
                                      int32_t* __restrict__ qsplit_indices) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= hkv * stride) return;
  const int64_t h = idx / stride;
  const int64_t e = idx - h * stride;
  const int32_t v = e < per_head ? sorted_values[h * per_head + e] : -1;
  if constexpr (kWithSlots) {
    const bool empty = v == -1;
    const bool has_slot = !empty && (static_cast<uint32_t>(v) >> kSlotShift) != kNoSlot;
    q_indices[idx] = empty ? -1 : (v & kQLocalMask);
    qsplit_indices[idx] = has_slot ? v : -1;
  } else {
    q_indices[idx] = v;
  }
}

// Schedule step: chunk counts per (head, row) in head-major order, and for each row its owner
// (request b, block beta), found by bisection over the round-robin layout.
__global__ void schedule_rows_kernel(const int32_t* __restrict__ row_ptr,
                                     const int32_t* __restrict__ rows, int batch, int hkv,
                                     int total_rows, int target_q_per_cta,
                                     int32_t* __restrict__ chunk_counts,
                                     int32_t* __restrict__ owner_batch,
                                     int32_t* __restrict__ owner_block) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(total_rows) * hkv) return;
  const int h = static_cast<int>(idx / total_rows);
  const int r = static_cast<int>(idx - static_cast<int64_t>(h) * total_rows);
  const int32_t* head_ptr = row_ptr + static_cast<int64_t>(h) * (total_rows + 1);
  const int len = max(head_ptr[r + 1] - head_ptr[r], 0);
  chunk_counts[idx] = ceil_div(len, target_q_per_cta);
  if (h != 0) return;
  int64_t exact_rows = 0;
  int max_blocks = 0;
  for (int b = 0; b < batch; ++b) {
    exact_rows += rows[b];
    max_blocks = max(max_blocks, rows[b]);
  }
  int b_owner = -1, beta_owner = -1;
  if (r < exact_rows) {
    // Rows of block beta start at base(beta) = sum_b min(rows_b, beta), strictly increasing on
    // [0, max_blocks]; find the largest beta with base(beta) <= r.
    int lo = 0, hi = max_blocks - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      int64_t base = 0;
      for (int b = 0; b < batch; ++b) base += min(rows[b], mid);
      if (base <= r) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    int64_t base = 0;
    for (int b = 0; b < batch; ++b) base += min(rows[b], lo);
    int64_t rank = r - base;
    for (int b = 0; b < batch; ++b) {
      if (rows[b] > lo) {
        if (rank == 0) {
          b_owner = b;
          break;
        }
        --rank;
      }
    }
    beta_owner = lo;
  }
  owner_batch[r] = b_owner;
  owner_block[r] = beta_owner;
}

// Schedule step: one thread per work item slot; items past the work count are zero.
__global__ void schedule_items_kernel(const int32_t* __restrict__ row_ptr,
                                      const int32_t* __restrict__ chunk_counts,
                                      const int32_t* __restrict__ chunk_incl,
                                      const int32_t* __restrict__ owner_batch,
                                      const int32_t* __restrict__ owner_block, int hkv,
                                      int total_rows, int target_q_per_cta, int work_capacity,
                                      int32_t* __restrict__ metadata,
                                      int32_t* __restrict__ work_count) {
  const int w = blockIdx.x * blockDim.x + threadIdx.x;
  if (w >= work_capacity) return;
  const int64_t n = static_cast<int64_t>(total_rows) * hkv;
  const int total_items = n > 0 ? chunk_incl[n - 1] : 0;
  if (w == 0) work_count[0] = min(total_items, work_capacity);
  int32_t item[kMetaColumns] = {0, 0, 0, 0, 0, 0};
  if (w < total_items) {
    int64_t lo = 0, hi = n - 1;   // first (head, row) whose inclusive count exceeds w
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (chunk_incl[mid] > w) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const int h = static_cast<int>(lo / total_rows);
    const int r = static_cast<int>(lo - static_cast<int64_t>(h) * total_rows);
    const int chunk = w - (chunk_incl[lo] - chunk_counts[lo]);
    const int32_t* head_ptr = row_ptr + static_cast<int64_t>(h) * (total_rows + 1);
    const int len = head_ptr[r + 1] - head_ptr[r];
    const int q_begin = chunk * target_q_per_cta;
    item[0] = h;
    item[1] = r;
    item[2] = q_begin;
    item[3] = min(target_q_per_cta, len - q_begin);
    item[4] = owner_batch[r];
    item[5] = owner_block[r];
  }
#pragma unroll
  for (int c = 0; c < kMetaColumns; ++c) {
    metadata[static_cast<int64_t>(w) * kMetaColumns + c] = item[c];
  }
}

// Every temporary buffer, carved from one workspace (or only measured when base is null).
struct CsrWorkspace {
  int32_t* rows = nullptr;
  int32_t* row_table = nullptr;
  int table_blocks = 0;
  uint32_t* keys[2] = {nullptr, nullptr};
  int32_t* values[2] = {nullptr, nullptr};
  void* sort_temp = nullptr;
  size_t sort_temp_bytes = 0;
  int end_bit = 1;
  int32_t* chunk_counts = nullptr;
  int32_t* chunk_incl = nullptr;
  int32_t* owner_batch = nullptr;
  int32_t* owner_block = nullptr;
  void* scan_temp = nullptr;
  size_t scan_temp_bytes = 0;
  size_t total_bytes = 0;
};

int64_t entry_count(const K2qCsrArgs& a) {
  return static_cast<int64_t>(a.hkv) * a.total_q * a.topk;
}

cudaError_t plan_workspace(const K2qCsrArgs& a, const K2qScheduleArgs* s, void* base,
                           CsrWorkspace* ws) {
  detail::WorkspaceCarver carve(base);
  const int64_t n_entries = entry_count(a);
  ws->rows = carve.take<int32_t>(a.batch);
  const int64_t cap = kMaxRowTableEntries / (a.batch > 0 ? a.batch : 1);
  ws->table_blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(std::max(a.max_kv_blocks, 1), cap)));
  ws->row_table = carve.take<int32_t>(static_cast<size_t>(a.batch) * ws->table_blocks);
  for (int i = 0; i < 2; ++i) {
    ws->keys[i] = carve.take<uint32_t>(n_entries);
    ws->values[i] = carve.take<int32_t>(n_entries);
  }
  const uint64_t max_key =
      static_cast<uint64_t>(a.hkv) * (static_cast<uint64_t>(a.total_rows) + 1) - 1;
  ws->end_bit = std::max(1, detail::bits_for(max_key));
  if (n_entries > 0) {
    cub::DoubleBuffer<uint32_t> keys(ws->keys[0], ws->keys[1]);
    cub::DoubleBuffer<int32_t> values(ws->values[0], ws->values[1]);
    MSA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
        nullptr, ws->sort_temp_bytes, keys, values, static_cast<int>(n_entries), 0, ws->end_bit,
        cudaStream_t(0)));
  }
  ws->sort_temp = carve.take<char>(ws->sort_temp_bytes);
  if (s != nullptr) {
    const int64_t n_row_heads = static_cast<int64_t>(a.total_rows) * a.hkv;
    ws->chunk_counts = carve.take<int32_t>(n_row_heads);
    ws->chunk_incl = carve.take<int32_t>(n_row_heads);
    ws->owner_batch = carve.take<int32_t>(a.total_rows);
    ws->owner_block = carve.take<int32_t>(a.total_rows);
    if (n_row_heads > 0) {
      MSA_RETURN_IF_ERROR(cub::DeviceScan::InclusiveSum(
          nullptr, ws->scan_temp_bytes, ws->chunk_counts, ws->chunk_incl,
          static_cast<int>(n_row_heads), cudaStream_t(0)));
    }
    ws->scan_temp = carve.take<char>(ws->scan_temp_bytes);
  }
  ws->total_bytes = carve.used();
  return cudaSuccess;
}

}  // namespace

cudaError_t build_k2q_csr_image(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, request_rows_kernel);
}

size_t build_k2q_csr_workspace_bytes(const K2qCsrArgs& args, const K2qScheduleArgs* schedule) {
  CsrWorkspace ws;
  if (plan_workspace(args, schedule, nullptr, &ws) != cudaSuccess) return 0;
  return ws.total_bytes;
}

cudaError_t launch_build_k2q_csr(const K2qCsrArgs& a, const K2qScheduleArgs* s, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream) {
  if (a.hkv < 1 || a.batch < 1 || a.total_q < 0 || a.topk < 1 || a.blk_kv < 1 ||
      a.total_rows < 0 || a.q_indices_stride < static_cast<int64_t>(a.total_q) * a.topk) {
    return cudaErrorInvalidValue;
  }
  if (s != nullptr && (a.topk > 32 || (a.topk & (a.topk - 1)) != 0 ||
                       s->target_q_per_cta < 1 || s->work_capacity < 1 ||
                       a.total_q >= kQLocalMask)) {
    return cudaErrorInvalidValue;
  }
  CsrWorkspace ws;
  MSA_RETURN_IF_ERROR(plan_workspace(a, s, workspace, &ws));
  if (workspace_bytes < ws.total_bytes) return cudaErrorInvalidValue;

  const int64_t n_entries = entry_count(a);
  const int64_t per_head = static_cast<int64_t>(a.total_q) * a.topk;

  request_rows_kernel<<<grid_for(a.batch), kThreads, 0, stream>>>(a.cu_seqlens_k, a.batch,
                                                                  a.blk_kv, ws.rows);
  row_table_kernel<<<grid_for(ws.table_blocks), kThreads, 0, stream>>>(
      ws.rows, a.batch, ws.table_blocks, ws.row_table);
  MSA_RETURN_IF_ERROR(cudaGetLastError());

  const uint32_t* sorted_keys = ws.keys[0];
  const int32_t* sorted_values = ws.values[0];
  if (n_entries > 0) {
    CsrDeviceArgs d{a.q2k_indices, a.cu_seqlens_q, a.cu_seqlens_k, ws.rows, ws.row_table,
                    a.batch, ws.table_blocks, a.hkv, a.total_q, a.topk, a.total_rows,
                    n_entries};
    if (s != nullptr) {
      entry_keys_kernel<true><<<grid_for(n_entries), kThreads, 0, stream>>>(
          d, ws.keys[0], ws.values[0], s->split_counts);
    } else {
      entry_keys_kernel<false><<<grid_for(n_entries), kThreads, 0, stream>>>(
          d, ws.keys[0], ws.values[0], nullptr);
    }
    MSA_RETURN_IF_ERROR(cudaGetLastError());
    cub::DoubleBuffer<uint32_t> keys(ws.keys[0], ws.keys[1]);
    cub::DoubleBuffer<int32_t> values(ws.values[0], ws.values[1]);
    size_t temp_bytes = ws.sort_temp_bytes;
    MSA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(ws.sort_temp, temp_bytes, keys, values,
                                                        static_cast<int>(n_entries), 0,
                                                        ws.end_bit, stream));
    // The buffer selector is host state set by the dispatch (pass count is size-determined).
    sorted_keys = keys.Current();
    sorted_values = values.Current();
  }

  const int64_t row_ptr_elems = static_cast<int64_t>(a.hkv) * (a.total_rows + 1);
  row_ptr_kernel<<<grid_for(row_ptr_elems), kThreads, 0, stream>>>(sorted_keys, a.hkv,
                                                                   a.total_rows, per_head,
                                                                   a.row_ptr);
  const int64_t q_elems = static_cast<int64_t>(a.hkv) * a.q_indices_stride;
  if (q_elems > 0) {
    if (s != nullptr) {
      unpack_payload_kernel<true><<<grid_for(q_elems), kThreads, 0, stream>>>(
          sorted_values, a.hkv, per_head, a.q_indices_stride, a.q_indices, s->qsplit_indices);
    } else {
      unpack_payload_kernel<false><<<grid_for(q_elems), kThreads, 0, stream>>>(
          sorted_values, a.hkv, per_head, a.q_indices_stride, a.q_indices, nullptr);
    }
  }
  MSA_RETURN_IF_ERROR(cudaGetLastError());
  if (s == nullptr) return cudaSuccess;

  const int64_t n_row_heads = static_cast<int64_t>(a.total_rows) * a.hkv;
  if (n_row_heads > 0) {
    schedule_rows_kernel<<<grid_for(n_row_heads), kThreads, 0, stream>>>(
        a.row_ptr, ws.rows, a.batch, a.hkv, a.total_rows, s->target_q_per_cta, ws.chunk_counts,
        ws.owner_batch, ws.owner_block);
    MSA_RETURN_IF_ERROR(cudaGetLastError());
    size_t temp_bytes = ws.scan_temp_bytes;
    MSA_RETURN_IF_ERROR(cub::DeviceScan::InclusiveSum(ws.scan_temp, temp_bytes, ws.chunk_counts,
                                                      ws.chunk_incl,
                                                      static_cast<int>(n_row_heads), stream));
  }
  schedule_items_kernel<<<grid_for(s->work_capacity), kThreads, 0, stream>>>(
      a.row_ptr, ws.chunk_counts, ws.chunk_incl, ws.owner_batch, ws.owner_block, a.hkv,
      a.total_rows, s->target_q_per_cta, s->work_capacity, s->scheduler_metadata,
      s->work_count);
  return cudaGetLastError();
}

}  // namespace msa
