// q2k -> k2q CSR builder and sparse forward schedule (contract §1.1), bit-identical to
// msa.sparse_index_utils.build_k2q_csr_torch_reference and
// msa.src.sm100.prepare_scheduler.prepare_sparse_fwd_schedule_and_split.
//
// Algorithm (no global atomics, so the output is deterministic; no host synchronization):
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
// Small calls (see fits_counting_sort: up to 64 requests and 2047 rows, spans of at most 4096
// entries; the caller may ask for the radix form anyway, K2qCsrArgs::counting_sort) take two
// launches instead of ~12: a counting sort spread over several CTAs a KV head (each span's row
// counts, then each span's scatter at its first position in every row) whose second launch
// also builds the schedule. Under a CUDA graph each launch costs a few microseconds, which was
// most of a short chunk's CSR stage; one CTA a head walking all its entries was the rest.
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

// ceil(max(k_len_b, 0) / blk_kv) of request b, clamped to int.
__device__ __forceinline__ int32_t request_blocks(const int32_t* cu_k, int b, int blk_kv) {
  int64_t len = static_cast<int64_t>(cu_k[b + 1]) - static_cast<int64_t>(cu_k[b]);
  if (len < 0) len = 0;
  const int64_t blocks = ceil_div<int64_t>(len, blk_kv);
  return static_cast<int32_t>(blocks > INT_MAX ? INT_MAX : blocks);
}

// request_blocks for every request.
__global__ void request_rows_kernel(const int32_t* __restrict__ cu_k, int batch, int blk_kv,
                                    int32_t* __restrict__ rows) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch) rows[b] = request_blocks(cu_k, b, blk_kv);
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

// CSR row of block beta of request b by the round-robin formula, O(batch).
__device__ __forceinline__ int64_t round_robin_row(const int32_t* rows, int batch, int b,
                                                   int beta) {
  int64_t row = 0;
  for (int i = 0; i < batch; ++i) {
    const int r = rows[i];
    row += min(r, beta) + ((i < b && r > beta) ? 1 : 0);
  }
  return row;
}

// CSR row of block beta of request b; the caller guarantees 0 <= beta < rows[b].
__device__ __forceinline__ int64_t csr_row_of(const CsrDeviceArgs& a, int b, int beta) {
  if (beta < a.table_blocks) {
    return a.row_table[static_cast<int64_t>(b) * a.table_blocks + beta];
  }
  return round_robin_row(a.rows, a.batch, b, beta);
}

// An int32 of global memory (read-only path) or, kShared, of shared memory.
template <bool kShared>
__device__ __forceinline__ int32_t load_i32(const int32_t* p, int64_t i) {
  if constexpr (kShared) {
    return p[i];
  } else {
    return __ldg(p + i);
  }
}

// The request that owns global query q: the largest b with cu_q[b] <= q (empty requests
// share their start with the next one, so the largest is the right one).
template <bool kShared = false>
__device__ __forceinline__ int request_of_query(const int32_t* __restrict__ cu_q, int batch,
                                                int q) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (load_i32<kShared>(cu_q, mid) <= q) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Where one q2k entry goes: its CSR row and local query id when it is valid (a block of its own
// request, a query inside its request, a row below total_rows), else dropped.
struct EntryPlace {
  int q = 0;             // global query id
  int slot_in_row = 0;   // position in the query's q2k row
  bool valid = false;
  int32_t row = 0;
  int32_t q_local = 0;
};

// Entry e of a head's segment (e < total_q * topk) holding block id `block`; row_of(b, beta)
// maps a block of request b to its round-robin row, rows[b] are the requests' block counts. cu_q
// is in shared memory when kShared (the counting sort stages it), else global.
template <bool kShared, typename RowOf>
__device__ __forceinline__ EntryPlace place_block(const CsrDeviceArgs& a, const int32_t* rows,
                                                  const int32_t* cu_q, int64_t e,
                                                  int32_t block, RowOf row_of) {
  EntryPlace p;
  p.q = static_cast<int>(e / a.topk);
  p.slot_in_row = static_cast<int>(e - static_cast<int64_t>(p.q) * a.topk);
  const int b = request_of_query<kShared>(cu_q, a.batch, p.q);
  const int q_begin = load_i32<kShared>(cu_q, b);
  const int q_end = load_i32<kShared>(cu_q, b + 1);
  if (block >= 0 && p.q >= q_begin && p.q < q_end && block < rows[b]) {
    const int64_t r = row_of(b, block);
    if (r >= 0 && r < a.total_rows) {
      p.valid = true;
      p.row = static_cast<int32_t>(r);
      p.q_local = p.q - q_begin;
    }
  }
  return p;
}

// Entry e of a head's segment q2k_head (global memory).
template <typename RowOf>
__device__ __forceinline__ EntryPlace place_entry(const CsrDeviceArgs& a, const int32_t* rows,
                                                  const int32_t* q2k_head, const int32_t* cu_q,
                                                  int64_t e, RowOf row_of) {
  return place_block<false>(a, rows, cu_q, e, __ldg(q2k_head + e), row_of);
}

// The combine slot of an entry and its query's slot count, from the topk lanes that hold the
// query's entries (topk a power of two <= 32, entries at lanes e % 32; every lane of the warp
// must call it). The reference hands out slots walking rows in ascending order, so an entry's
// slot is the number of its query's valid entries in smaller rows (earlier q2k position on
// ties). Every valid entry counts (q_local < q_len_b by construction): max_seqlen_q, a host
// hint, only bounds the packing (checked by the binding) and never drops work when it is short.
__device__ __forceinline__ void combine_slot(const EntryPlace& p, int topk, int* slot,
                                             int* count) {
  const int rank_key = p.valid ? p.row : INT_MAX;
  const int lane = threadIdx.x & 31;
  const int group_base = lane & ~(topk - 1);
  const int my_pos = lane - group_base;
  int s = 0, c = 0;
  for (int o = 0; o < topk; ++o) {   // every lane runs the same trip count
    const int other = __shfl_sync(0xffffffffu, rank_key, group_base + o);
    const bool other_counted = other != INT_MAX;
    c += other_counted ? 1 : 0;
    s += (other_counted && (other < rank_key || (other == rank_key && o < my_pos))) ? 1 : 0;
  }
  *slot = s;
  *count = c;
}

// The sorted payload of an entry: q_local (| slot << 24 with a schedule), -1 when dropped.
__device__ __forceinline__ int32_t entry_payload(const EntryPlace& p, int slot,
                                                 bool with_slots) {
  if (!p.valid) return -1;
  if (!with_slots) return p.q_local;
  return static_cast<int32_t>(static_cast<uint32_t>(p.q_local) |
                              (static_cast<uint32_t>(slot) << kSlotShift));
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
  const int h = in_range ? static_cast<int>(i / per_head) : 0;
  EntryPlace p;
  if (in_range) {
    p = place_entry(a, a.rows, a.q2k + h * per_head, a.cu_q, i - h * per_head,
                           [&](int b, int beta) { return csr_row_of(a, b, beta); });
  }
  const uint32_t key = static_cast<uint32_t>(h) * static_cast<uint32_t>(a.total_rows + 1) +
                       static_cast<uint32_t>(p.valid ? p.row : a.total_rows);
  int slot = 0, count = 0;
  if constexpr (kWithSlots) {
    combine_slot(p, a.topk, &slot, &count);
    if (in_range && p.slot_in_row == 0) {
      split_counts[static_cast<int64_t>(p.q) * a.hkv + h] = count;
    }
  }
  if (in_range) {
    keys[i] = key;
    values[i] = entry_payload(p, slot, kWithSlots);
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

// Stores a sorted payload at position pos of a head's outputs: q_indices gets q_local (-1 for
// a dropped entry or an unused column), qsplit_indices (with a schedule) the packed payload;
// every valid entry has a slot (entry_payload).
template <bool kWithSlots>
__device__ __forceinline__ void store_payload(int32_t* __restrict__ q_indices,
                                              int32_t* __restrict__ qsplit_indices, int64_t pos,
                                              int32_t payload) {
  if constexpr (kWithSlots) {
    q_indices[pos] = payload == -1 ? -1 : (payload & kQLocalMask);
    qsplit_indices[pos] = payload;
  } else {
    q_indices[pos] = payload;
  }
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
  store_payload<kWithSlots>(q_indices, qsplit_indices, idx,
                            e < per_head ? sorted_values[h * per_head + e] : -1);
}

// The request b and block beta that own CSR row r of the round-robin layout ((-1, -1) past the
// rows that exist), by bisection over the blocks; rows: [batch] blocks per request.
__device__ __forceinline__ void row_owner(const int32_t* rows, int batch, int r, int32_t* b_owner,
                                          int32_t* beta_owner) {
  int64_t exact_rows = 0;
  int max_blocks = 0;
  for (int b = 0; b < batch; ++b) {
    exact_rows += rows[b];
    max_blocks = max(max_blocks, rows[b]);
  }
  *b_owner = -1;
  *beta_owner = -1;
  if (r >= exact_rows) return;
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
        *b_owner = b;
        break;
      }
      --rank;
    }
  }
  *beta_owner = lo;
}

// Work item w of the schedule: (head, row, q_begin, q_count, request, block) of the chunk that
// w falls in, found by bisection over chunk_incl (the inclusive chunk counts of the n
// (head, row) pairs, head-major); zeros past the items (total_items = chunk_incl[n - 1]).
template <typename RowLen>
__device__ __forceinline__ void write_work_item(int w, const int32_t* chunk_incl, int64_t n,
                                                RowLen row_len,
                                                const int32_t* owner_batch,
                                                const int32_t* owner_block, int total_rows,
                                                int target_q_per_cta,
                                                int32_t* __restrict__ metadata) {
  const int total_items = n > 0 ? chunk_incl[n - 1] : 0;
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
    const int chunk = w - (lo > 0 ? chunk_incl[lo - 1] : 0);
    const int len = row_len(lo, h, r);
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

// Schedule step: chunk counts per (head, row) in head-major order, and for each row its owner
// (request b, block beta).
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
  if (h == 0) row_owner(rows, batch, r, owner_batch + r, owner_block + r);
}

// Schedule step: one thread per work item slot; items past the work count are zero.
__global__ void schedule_items_kernel(const int32_t* __restrict__ row_ptr,
                                      const int32_t* __restrict__ chunk_incl,
                                      const int32_t* __restrict__ owner_batch,
                                      const int32_t* __restrict__ owner_block, int hkv,
                                      int total_rows, int target_q_per_cta, int work_capacity,
                                      int32_t* __restrict__ metadata,
                                      int32_t* __restrict__ work_count) {
  const int w = blockIdx.x * blockDim.x + threadIdx.x;
  if (w >= work_capacity) return;
  const int64_t n = static_cast<int64_t>(total_rows) * hkv;
  if (w == 0) work_count[0] = min(n > 0 ? chunk_incl[n - 1] : 0, work_capacity);
  const auto row_len = [&](int64_t, int h, int r) {
    const int32_t* head_ptr = row_ptr + static_cast<int64_t>(h) * (total_rows + 1);
    return head_ptr[r + 1] - head_ptr[r];
  };
  write_work_item(w, chunk_incl, n, row_len, owner_batch, owner_block, total_rows,
                  target_q_per_cta, metadata);
}

// ---------------------------------------------------------------------------------------------
// Small calls: a counting sort spread over several CTAs a KV head, in two launches.
// ---------------------------------------------------------------------------------------------
// Each head's entries are cut into ctas_per_head contiguous spans (multiples of 32 entries, so
// a query's topk entries share a warp). csr_count_kernel counts one span's entries per row
// (bin total_rows = dropped) into the workspace; csr_scatter_schedule_kernel then gives each
// span CTA its first position in every row (the row's start, the exclusive scan of the rows'
// totals, plus the earlier spans' counts of that row), counts its warps' entries per row again
// and scatters each warp's entries in order, ranked among the lanes of the same row: entries
// keep their (query, slot) order within a row, the radix sort's stable order, bit for bit. The
// same launch's schedule CTAs build the work items from the counts (the rows' lengths), in
// parallel with the scatter.
constexpr int kSpreadThreads = 512;
constexpr int kSpreadWarps = kSpreadThreads / 32;
constexpr int kSmallMaxBatch = 64;             // requests' block counts kept in shared memory
constexpr int kSmallMaxBins = 2048;            // total_rows + 1 (the dropped entries' bin)
constexpr int64_t kSpreadEntriesPerCta = 512;  // the span aimed for: one entry a thread
constexpr int64_t kSpreadMaxSpan = 4096;       // entries a span CTA stages (16 KB); positions
                                               // within a span fit the 16-bit histograms
constexpr int kSpreadMaxCtasPerHead = 64;
constexpr int kSpreadMaxCounts = 16384;        // ctas_per_head x bins, which each CTA sums
constexpr int kSmallMaxRowHeads = 8192;        // hkv * total_rows (the schedule's scan)
constexpr int kScheduleItemsPerCta = 1024;
constexpr int kMaxScheduleCtas = 16;

struct SpreadShape {
  int ctas_per_head = 1;
  int64_t span = 0;         // entries a span CTA takes
  int schedule_ctas = 0;    // CTAs that write the work items (0 without a schedule)
};

SpreadShape spread_shape(const K2qCsrArgs& a, const K2qScheduleArgs* s) {
  const int64_t per_head = static_cast<int64_t>(a.total_q) * a.topk;
  const int bins = a.total_rows + 1;
  const int max_ctas = std::max(1, std::min(kSpreadMaxCtasPerHead, kSpreadMaxCounts / bins));
  const int64_t wanted = ceil_div<int64_t>(per_head, kSpreadEntriesPerCta);
  SpreadShape shape;
  shape.ctas_per_head = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, max_ctas)));
  shape.span = ceil_div<int64_t>(ceil_div<int64_t>(per_head, shape.ctas_per_head), 32) * 32;
  if (s != nullptr) {
    shape.schedule_ctas =
        std::max(1, std::min(kMaxScheduleCtas, ceil_div(s->work_capacity, kScheduleItemsPerCta)));
  }
  return shape;
}

// Whether a call takes the counting sort (msa._native.csr_builder.counting_sort_applies
// mirrors it): spans of at most kSpreadMaxSpan entries.
bool fits_counting_sort(const K2qCsrArgs& a, const K2qScheduleArgs* s) {
  if (!a.counting_sort || a.batch > kSmallMaxBatch || a.total_rows + 1 > kSmallMaxBins) {
    return false;
  }
  if (s != nullptr && static_cast<int64_t>(a.hkv) * a.total_rows > kSmallMaxRowHeads) {
    return false;
  }
  return spread_shape(a, s).span <= kSpreadMaxSpan;
}

size_t count_smem_bytes(int bins) {
  return sizeof(int32_t) * (2 * kSmallMaxBatch + 2 + static_cast<size_t>(bins));
}

// Span CTAs: rows, cu_q, each row's first position, the staged span, then the per-warp
// histograms; schedule CTAs: rows, the (head, row) lengths and inclusive chunk counts, the
// rows' owners.
size_t scatter_schedule_smem_bytes(int hkv, int total_rows, int64_t span, bool schedule) {
  const size_t bins = static_cast<size_t>(total_rows) + 1;
  const size_t scatter = sizeof(int32_t) * (2 * kSmallMaxBatch + 2 + bins + span) +
                         sizeof(uint16_t) * kSpreadWarps * bins;
  const size_t n = static_cast<size_t>(hkv) * total_rows;
  const size_t sched = sizeof(int32_t) * (kSmallMaxBatch + 2 * n + 2 * total_rows);
  return schedule ? std::max(scatter, sched) : scatter;
}

// Stages the requests' block counts and cu_q in shared memory.
__device__ __forceinline__ void stage_requests(const CsrDeviceArgs& a,
                                               const int32_t* __restrict__ cu_k, int blk_kv,
                                               int32_t* rows, int32_t* cu_q) {
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) rows[b] = request_blocks(cu_k, b, blk_kv);
  for (int b = threadIdx.x; b <= a.batch; b += blockDim.x) cu_q[b] = __ldg(a.cu_q + b);
}

// counts[h, c, bin]: the entries of span c of head h per row (grid: ctas_per_head x hkv).
__global__ void __launch_bounds__(kSpreadThreads)
csr_count_kernel(CsrDeviceArgs a, const int32_t* __restrict__ cu_k, int blk_kv, int64_t span,
                 int32_t* __restrict__ counts) {
  extern __shared__ int32_t smem[];
  int32_t* rows = smem;                           // [kSmallMaxBatch]
  int32_t* cu_q = rows + kSmallMaxBatch;          // [kSmallMaxBatch + 2]
  int32_t* hist = cu_q + kSmallMaxBatch + 2;      // [bins]
  const int c = blockIdx.x;
  const int h = blockIdx.y;
  const int bins = a.total_rows + 1;
  stage_requests(a, cu_k, blk_kv, rows, cu_q);
  for (int i = threadIdx.x; i < bins; i += kSpreadThreads) hist[i] = 0;
  __syncthreads();
  const int64_t per_head = static_cast<int64_t>(a.total_q) * a.topk;
  const int64_t end = min(per_head, (c + 1) * span);
  const int32_t* q2k_head = a.q2k + h * per_head;
  const auto row_of = [&](int b, int beta) { return round_robin_row(rows, a.batch, b, beta); };
  for (int64_t e = c * span + threadIdx.x; e < end; e += kSpreadThreads) {
    const EntryPlace p = place_block<true>(a, rows, cu_q, e, __ldg(q2k_head + e), row_of);
    atomicAdd(hist + (p.valid ? p.row : a.total_rows), 1);
  }
  __syncthreads();
  int32_t* out = counts + (static_cast<int64_t>(h) * gridDim.x + c) * bins;
  for (int i = threadIdx.x; i < bins; i += kSpreadThreads) out[i] = hist[i];
}

// Span CTA (h, c) of csr_scatter_schedule_kernel.
template <bool kWithSlots>
__device__ __forceinline__ void scatter_span(const CsrDeviceArgs& a,
                                             const int32_t* __restrict__ cu_k, int blk_kv,
                                             int h, int c, int ctas_per_head, int64_t span,
                                             const int32_t* __restrict__ counts,
                                             int64_t q_stride, int32_t* __restrict__ row_ptr,
                                             int32_t* __restrict__ q_indices,
                                             int32_t* __restrict__ qsplit_indices,
                                             int32_t* __restrict__ split_counts) {
  extern __shared__ int32_t smem[];
  const int bins = a.total_rows + 1;
  int32_t* rows = smem;                                       // [kSmallMaxBatch]
  int32_t* cu_q = rows + kSmallMaxBatch;                      // [kSmallMaxBatch + 2]
  int32_t* first = cu_q + kSmallMaxBatch + 2;                 // [bins]
  int32_t* q2k = first + bins;                                // [span]
  uint16_t* hist = reinterpret_cast<uint16_t*>(q2k + span);   // [kSpreadWarps, bins]
  using BlockScan = cub::BlockScan<int32_t, kSpreadThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int64_t per_head = static_cast<int64_t>(a.total_q) * a.topk;
  const int64_t span_begin = c * span;
  const int64_t span_end = min(per_head, span_begin + span);
  stage_requests(a, cu_k, blk_kv, rows, cu_q);
  for (int64_t e = span_begin + tid; e < span_end; e += kSpreadThreads) {
    q2k[e - span_begin] = __ldg(a.q2k + h * per_head + e);
  }
  for (int i = tid; i < kSpreadWarps * bins; i += kSpreadThreads) hist[i] = 0;

  // Each row's start (exclusive scan of the rows' totals over every span) and this span's
  // first position in it (the start plus the earlier spans' counts); thread t owns the rows
  // [t * per_thread, ...). Span 0 writes row_ptr.
  const int per_thread = ceil_div(bins, kSpreadThreads);
  const int32_t* head_counts = counts + static_cast<int64_t>(h) * ctas_per_head * bins;
  int32_t owned = 0;
  for (int k = 0; k < per_thread; ++k) {
    const int bin = tid * per_thread + k;
    if (bin < bins) {
      for (int s = 0; s < ctas_per_head; ++s) owned += head_counts[s * bins + bin];
    }
  }
  int32_t start = 0;
  BlockScan(scan_storage).ExclusiveSum(owned, start);
  for (int k = 0; k < per_thread; ++k) {
    const int bin = tid * per_thread + k;
    if (bin < bins) {
      if (c == 0) row_ptr[static_cast<int64_t>(h) * bins + bin] = start;
      int32_t before = 0, total = 0;
      for (int s = 0; s < ctas_per_head; ++s) {
        const int32_t n = head_counts[s * bins + bin];
        before += s < c ? n : 0;
        total += n;
      }
      first[bin] = start + before;
      start += total;
    }
  }
  __syncthreads();

  // Warp w owns a contiguous range of the span (a multiple of 32 long).
  const int64_t warp_span = ceil_div<int64_t>(ceil_div<int64_t>(span, kSpreadWarps), 32) * 32;
  const int64_t begin = span_begin + warp * warp_span;
  const int64_t end = min(span_end, begin + warp_span);
  const auto row_of = [&](int b, int beta) { return round_robin_row(rows, a.batch, b, beta); };
  const auto place = [&](int64_t e) {
    return place_block<true>(a, rows, cu_q, e, q2k[e - span_begin], row_of);
  };
  uint16_t* warp_hist = hist + warp * bins;
  const unsigned lanes_below = (1u << lane) - 1u;
  // A warp's entries of one row: counted by the row's lowest lane (no atomics: the warp owns
  // its histogram).
  const auto count_peers = [&](int bin, bool in_range, int* rank) {
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    *rank = __popc(peers & lanes_below);
    return in_range ? __popc(peers) : 0;
  };
  for (int64_t base = begin; base < end; base += 32) {   // warp-uniform trip count
    const int64_t e = base + lane;
    const bool in_range = e < end;
    EntryPlace p;
    if (in_range) p = place(e);
    const int bin = in_range ? (p.valid ? p.row : a.total_rows) : -1;
    int rank = 0;
    const int peers = count_peers(bin, in_range, &rank);
    if (in_range && rank == 0) warp_hist[bin] = static_cast<uint16_t>(warp_hist[bin] + peers);
    __syncwarp();
  }
  __syncthreads();
  // Per-warp counts -> each warp's offset within the span's share of the row (< span: 16 bits).
  for (int bin = tid; bin < bins; bin += kSpreadThreads) {
    uint16_t running = 0;
    for (int w = 0; w < kSpreadWarps; ++w) {
      const uint16_t n = hist[w * bins + bin];
      hist[w * bins + bin] = running;
      running = static_cast<uint16_t>(running + n);
    }
  }
  __syncthreads();

  int32_t* head_q = q_indices + h * q_stride;
  int32_t* head_qsplit = kWithSlots ? qsplit_indices + h * q_stride : nullptr;
  for (int64_t base = begin; base < end; base += 32) {   // warp-uniform trip count
    const int64_t e = base + lane;
    const bool in_range = e < end;
    EntryPlace p;
    if (in_range) p = place(e);
    int slot = 0, count = 0;
    if constexpr (kWithSlots) {
      combine_slot(p, a.topk, &slot, &count);
      if (in_range && p.slot_in_row == 0) {
        split_counts[static_cast<int64_t>(p.q) * a.hkv + h] = count;
      }
    }
    const int bin = in_range ? (p.valid ? p.row : a.total_rows) : -1;
    int rank = 0;
    const int peers = count_peers(bin, in_range, &rank);
    if (in_range) {
      store_payload<kWithSlots>(head_q, head_qsplit, first[bin] + warp_hist[bin] + rank,
                                entry_payload(p, slot, kWithSlots));
    }
    __syncwarp();
    if (in_range && rank == 0) warp_hist[bin] = static_cast<uint16_t>(warp_hist[bin] + peers);
    __syncwarp();
  }
  // A wider buffer's tail, shared by the head's spans.
  for (int64_t e = per_head + static_cast<int64_t>(c) * kSpreadThreads + tid; e < q_stride;
       e += static_cast<int64_t>(ctas_per_head) * kSpreadThreads) {
    store_payload<kWithSlots>(head_q, head_qsplit, e, -1);
  }
}

// Schedule CTA s of `schedule_ctas`: the (head, row) lengths from the counts, their chunk
// counts scanned in shared memory (<= kSmallMaxRowHeads pairs), the rows' owners, then every
// schedule_ctas-th block of work items.
__device__ __forceinline__ void schedule_part(const CsrDeviceArgs& a,
                                              const int32_t* __restrict__ cu_k, int blk_kv,
                                              int ctas_per_head,
                                              const int32_t* __restrict__ counts, int s,
                                              int schedule_ctas, int target_q_per_cta,
                                              int work_capacity, int32_t* __restrict__ metadata,
                                              int32_t* __restrict__ work_count) {
  extern __shared__ int32_t smem[];
  const int total_rows = a.total_rows;
  const int bins = total_rows + 1;
  const int64_t n = static_cast<int64_t>(a.hkv) * total_rows;
  int32_t* rows = smem;                               // [kSmallMaxBatch]
  int32_t* row_len = rows + kSmallMaxBatch;           // [n]
  int32_t* chunk_incl = row_len + n;                  // [n]
  int32_t* owner_batch = chunk_incl + n;              // [total_rows]
  int32_t* owner_block = owner_batch + total_rows;    // [total_rows]
  using BlockScan = cub::BlockScan<int32_t, kSpreadThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int tid = threadIdx.x;
  for (int b = tid; b < a.batch; b += kSpreadThreads) rows[b] = request_blocks(cu_k, b, blk_kv);

  // Thread t owns the pairs [t * per_thread, ...), head-major.
  const int per_thread = static_cast<int>(ceil_div<int64_t>(n, kSpreadThreads));
  int32_t owned = 0;
  for (int k = 0; k < per_thread; ++k) {
    const int64_t i = static_cast<int64_t>(tid) * per_thread + k;
    if (i < n) {
      const int h = static_cast<int>(i / total_rows);
      const int r = static_cast<int>(i - static_cast<int64_t>(h) * total_rows);
      const int32_t* pair_counts = counts + static_cast<int64_t>(h) * ctas_per_head * bins + r;
      int32_t len = 0;
      for (int c = 0; c < ctas_per_head; ++c) len += pair_counts[c * bins];
      row_len[i] = len;
      const int32_t chunks = ceil_div(len, target_q_per_cta);
      chunk_incl[i] = chunks;
      owned += chunks;
    }
  }
  int32_t running = 0;
  BlockScan(scan_storage).ExclusiveSum(owned, running);
  for (int k = 0; k < per_thread; ++k) {
    const int64_t i = static_cast<int64_t>(tid) * per_thread + k;
    if (i < n) {
      running += chunk_incl[i];
      chunk_incl[i] = running;
    }
  }
  __syncthreads();   // rows[], row_len[] and chunk_incl[] are complete
  for (int r = tid; r < total_rows; r += kSpreadThreads) {
    row_owner(rows, a.batch, r, owner_batch + r, owner_block + r);
  }
  __syncthreads();
  if (s == 0 && tid == 0) work_count[0] = min(n > 0 ? chunk_incl[n - 1] : 0, work_capacity);
  const auto len_of = [&](int64_t i, int, int) { return row_len[i]; };
  for (int w = s * kSpreadThreads + tid; w < work_capacity; w += schedule_ctas * kSpreadThreads) {
    write_work_item(w, chunk_incl, n, len_of, owner_batch, owner_block, total_rows,
                    target_q_per_cta, metadata);
  }
}

// The CSR's span CTAs (hkv x ctas_per_head, head-major) and, with a schedule, its schedule
// CTAs after them.
template <bool kWithSlots>
__global__ void __launch_bounds__(kSpreadThreads)
csr_scatter_schedule_kernel(CsrDeviceArgs a, const int32_t* __restrict__ cu_k, int blk_kv,
                            int ctas_per_head, int64_t span, const int32_t* __restrict__ counts,
                            int64_t q_stride, int32_t* __restrict__ row_ptr,
                            int32_t* __restrict__ q_indices,
                            int32_t* __restrict__ qsplit_indices,
                            int32_t* __restrict__ split_counts, int target_q_per_cta,
                            int work_capacity, int32_t* __restrict__ metadata,
                            int32_t* __restrict__ work_count) {
  const int span_ctas = a.hkv * ctas_per_head;
  const int cta = blockIdx.x;
  if (cta < span_ctas) {
    scatter_span<kWithSlots>(a, cu_k, blk_kv, cta / ctas_per_head, cta % ctas_per_head,
                             ctas_per_head, span, counts, q_stride, row_ptr, q_indices,
                             qsplit_indices, split_counts);
  } else if constexpr (kWithSlots) {
    schedule_part(a, cu_k, blk_kv, ctas_per_head, counts, cta - span_ctas,
                  gridDim.x - span_ctas, target_q_per_cta, work_capacity, metadata,
                  work_count);
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
  int32_t* span_counts = nullptr;   // counting sort: [hkv, ctas_per_head, total_rows + 1]
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
  if (fits_counting_sort(a, s)) {   // the spans' row counts; the rest lives in shared memory
    const SpreadShape shape = spread_shape(a, s);
    ws->span_counts = carve.take<int32_t>(static_cast<size_t>(a.hkv) * shape.ctas_per_head *
                                          (static_cast<size_t>(a.total_rows) + 1));
    ws->total_bytes = carve.used();
    return cudaSuccess;
  }
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

// The small-call path: csr_count_kernel, then csr_scatter_schedule_kernel.
cudaError_t launch_counting_sort(const K2qCsrArgs& a, const K2qScheduleArgs* s,
                                 const CsrWorkspace& ws, cudaStream_t stream) {
  const CsrDeviceArgs d{a.q2k_indices, a.cu_seqlens_q, a.cu_seqlens_k, nullptr, nullptr,
                        a.batch, 0, a.hkv, a.total_q, a.topk, a.total_rows, entry_count(a)};
  const SpreadShape shape = spread_shape(a, s);
  const int bins = a.total_rows + 1;
  const size_t count_smem = count_smem_bytes(bins);
  MSA_RETURN_IF_ERROR(cudaFuncSetAttribute(csr_count_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(count_smem)));
  csr_count_kernel<<<dim3(shape.ctas_per_head, a.hkv), kSpreadThreads, count_smem, stream>>>(
      d, a.cu_seqlens_k, a.blk_kv, shape.span, ws.span_counts);
  MSA_RETURN_IF_ERROR(cudaGetLastError());
  const size_t smem = scatter_schedule_smem_bytes(a.hkv, a.total_rows, shape.span, s != nullptr);
  const unsigned grid = static_cast<unsigned>(a.hkv * shape.ctas_per_head + shape.schedule_ctas);
  if (s != nullptr) {
    MSA_RETURN_IF_ERROR(cudaFuncSetAttribute(csr_scatter_schedule_kernel<true>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem)));
    csr_scatter_schedule_kernel<true><<<grid, kSpreadThreads, smem, stream>>>(
        d, a.cu_seqlens_k, a.blk_kv, shape.ctas_per_head, shape.span, ws.span_counts,
        a.q_indices_stride, a.row_ptr, a.q_indices, s->qsplit_indices, s->split_counts,
        s->target_q_per_cta, s->work_capacity, s->scheduler_metadata, s->work_count);
  } else {
    MSA_RETURN_IF_ERROR(cudaFuncSetAttribute(csr_scatter_schedule_kernel<false>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem)));
    csr_scatter_schedule_kernel<false><<<grid, kSpreadThreads, smem, stream>>>(
        d, a.cu_seqlens_k, a.blk_kv, shape.ctas_per_head, shape.span, ws.span_counts,
        a.q_indices_stride, a.row_ptr, a.q_indices, nullptr, nullptr, 0, 0, nullptr, nullptr);
  }
  return cudaGetLastError();
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
  if (fits_counting_sort(a, s)) return launch_counting_sort(a, s, ws, stream);

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
      a.row_ptr, ws.chunk_incl, ws.owner_batch, ws.owner_block, a.hkv,
      a.total_rows, s->target_q_per_cta, s->work_capacity, s->scheduler_metadata,
      s->work_count);
  return cudaGetLastError();
}

}  // namespace msa
