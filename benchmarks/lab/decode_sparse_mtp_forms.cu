// The decode step's sparse attention at MTP 8 x G 16 with e4m3 q and K/V, one form after another
// on the same bytes (a GPU diagnostic, no TSV): the ping-pong form with e4m3 P.V on 128-row tiles
// (what the step serves at 4k-5k keys), the direct form on 16-row query tiles and the
// token-warps form on 128-row tiles (each warp widening its pages). Every request one chunk (no
// split, no merge), pages shuffled, synthetic values; each (token, KV head) selects topK blocks:
// topK - 1 distinct history blocks at random, ascending, then its own (last) block, as the
// decode indexer writes them. Prints each form's time per call, the selected K/V bytes per second (each selected page
// counted once per token that chose it) and the largest |O| difference from the ping-pong form
// (inf where either is NaN).
//
//   nvcc -arch=sm_90a -O3 -std=c++17 -Icsrc -Itorch-ext -o /tmp/sparse_forms \
//       benchmarks/lab/decode_sparse_mtp_forms.cu
//   /tmp/sparse_forms [batch=32] [keys=4000] [uniform|ragged]
//
// Add -DMSA_LAB_WIDEN_BY_ALU=1 for the direct and token-warps forms widening K and V by integer
// ops instead of F2FP, =2 for K alone (csrc/decode_attention.cu); -DMSA_LAB_TW_TIMELINE also prints
// where CTA 0's pages go in the token-warps form, per warp (mean cycles of its full waits over
// every page, of its computes over its own pages) and for the producer (empty waits, issue).
#include "../../csrc/decode_attention.cu"
#include "lab_common.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

__global__ void max_abs_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n,
                             float* out) {
  float m = 0.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float d = fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i]));
    m = fmaxf(m, d == d ? d : INFINITY);   // a NaN on either side shows as inf
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
}

}  // namespace

int main(int argc, char** argv) {
  const int batch = argc > 1 ? std::atoi(argv[1]) : 32;
  const int keys = argc > 2 ? std::atoi(argv[2]) : 4000;
  const bool ragged = argc > 3 && std::strcmp(argv[3], "ragged") == 0;
  const int seqlen_q = 8, hq = 64, hkv = 4, group = hq / hkv, dim = 128, page = 128, topk = 16;
  std::vector<int32_t> lengths(batch, keys);
  uint64_t lcg = 2718281828ull;
  auto next = [&] {
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    return lcg >> 11;
  };
  for (int b = 0; b < batch && ragged; ++b) {
    lengths[b] = static_cast<int32_t>(keys * (0.75 + 0.5 * (next() * 0x1.0p-53)));
  }
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  const int pages_per_request = (max_len + page - 1) / page;
  const int64_t num_pages = static_cast<int64_t>(batch) * pages_per_request;
  const int64_t page_bytes = static_cast<int64_t>(hkv) * page * dim;
  uint8_t *k = nullptr, *v = nullptr, *q = nullptr;
  CHECK(cudaMalloc(&k, num_pages * page_bytes));
  CHECK(cudaMalloc(&v, num_pages * page_bytes));
  const int64_t rows = static_cast<int64_t>(batch) * seqlen_q;
  CHECK(cudaMalloc(&q, rows * hq * dim));
  lab::fill_bytes<<<1024, 256>>>(k, num_pages * page_bytes, lab::Fill::kE4m3, 1u);
  lab::fill_bytes<<<1024, 256>>>(v, num_pages * page_bytes, lab::Fill::kE4m3, 2u);
  lab::fill_bytes<<<256, 256>>>(q, rows * hq * dim, lab::Fill::kE4m3, 3u);
  CHECK(cudaGetLastError());

  // Selections [hkv, B * seqlen_q, topk]: the token's own block last, history ascending.
  std::vector<int32_t> q2k(static_cast<size_t>(hkv) * rows * topk, -1);
  int64_t token_pages = 0;
  for (int h = 0; h < hkv; ++h) {
    for (int b = 0; b < batch; ++b) {
      const int blocks = (lengths[b] + page - 1) / page;
      for (int t = 0; t < seqlen_q; ++t) {
        const int own = (lengths[b] - seqlen_q + t) / page;
        std::vector<int32_t> history;
        for (int i = 0; i < own; ++i) history.push_back(i);
        for (int i = static_cast<int>(history.size()) - 1; i > 0; --i) {
          std::swap(history[i], history[next() % (i + 1)]);
        }
        history.resize(std::min<size_t>(history.size(), topk - 1));
        std::sort(history.begin(), history.end());
        history.push_back(std::min(own, blocks - 1));
        int32_t* row = &q2k[((static_cast<size_t>(h) * rows) + b * seqlen_q + t) * topk];
        std::copy(history.begin(), history.end(), row);
        token_pages += static_cast<int64_t>(history.size());
      }
    }
  }
  const std::vector<int32_t> table = lab::shuffled_pages(num_pages);

  msa::DecodeAttentionArgs base{};
  base.q = q;
  base.k = k;
  base.v = v;
  base.q_fp8 = base.kv_fp8 = true;
  base.q2k_indices = lab::device_copy(q2k);
  base.topk = topk;
  base.page_table = lab::device_copy(table);
  base.page_table_width = pages_per_request;
  base.seqused_k = lab::device_copy(lengths);
  base.batch = batch;
  base.seqlen_q = seqlen_q;
  base.num_qo_heads = hq;
  base.num_kv_heads = hkv;
  base.num_pages = num_pages;
  base.softmax_scale = 1.f / std::sqrt(static_cast<float>(dim));
  std::vector<int32_t> ones(batch, 1), indptr(batch + 1);
  for (int b = 0; b <= batch; ++b) indptr[b] = b;
  base.num_splits = lab::device_copy(ones);
  base.merge_indptr = lab::device_copy(indptr);

  // Work items: a request's 128-row tile (page chunks), or its 8 one-token tiles (slot chunks).
  auto plan = [&](msa::DecodeAttentionArgs& a, int tile_rows) {
    const int tiles = seqlen_q * group / tile_rows;
    std::vector<int32_t> req, kv, qo;
    for (int b = 0; b < batch; ++b) {
      for (int t = 0; t < tiles; ++t) {
        req.push_back(b);
        kv.push_back(0);
        qo.push_back(t);
      }
    }
    a.request_indices = lab::device_copy(req);
    a.kv_tile_indices = lab::device_copy(kv);
    a.qo_tile_indices = lab::device_copy(qo);
    a.num_work = static_cast<int>(req.size());
    a.qo_tile_rows = tile_rows;
    a.kv_chunk_size = tile_rows == seqlen_q * group ? pages_per_request : topk;
  };
  struct Form {
    const char* name;
    int tile_rows;
    void (*set)(msa::DecodeAttentionArgs&);
  };
  const Form forms[] = {
      {"ping-pong, e4m3 P.V, 128-row tiles", 128,
       [](msa::DecodeAttentionArgs& a) { a.warpgroup = a.pingpong = a.pv_fp8 = true; }},
      {"direct, 16-row query tiles", 16,
       [](msa::DecodeAttentionArgs& a) { a.split_keys = a.direct_fp8 = true; }},
      {"token warps, each warp widening, 128-row tiles", 128,
       [](msa::DecodeAttentionArgs& a) { a.token_warps = msa::kTwPerWarp; }},
  };
  const int64_t out_elems = rows * hq * dim;
  __nv_bfloat16* reference = nullptr;
  float* diff = lab::device_zeros<float>(1);
  const double bytes = 2.0 * token_pages * page * dim;   // per (token, KV head) selected page
#if defined(MSA_LAB_WIDEN_BY_ALU) && MSA_LAB_WIDEN_BY_ALU > 0
  const char* widening = MSA_LAB_WIDEN_BY_ALU == 1 ? "; direct and token warps widen K and V by "
                                                     "integer ops"
                                                   : "; direct and token warps widen K by "
                                                     "integer ops";
#else
  const char* widening = "";
#endif
  std::printf("sparse decode, B %d, %d keys%s, MTP %d x G %d, top-%d, e4m3: %.1f MB of selected "
              "K/V (token-pages)%s\n", batch, keys, ragged ? " (ragged, 0.75-1.25x)" : "",
              seqlen_q, group, topk, bytes / 1e6, widening);
  for (const Form& form : forms) {
    msa::DecodeAttentionArgs a = base;
    plan(a, form.tile_rows);
    form.set(a);
    CHECK(cudaMalloc(&a.out, out_elems * 2));
    const float ms = lab::mean_ms([&] { return msa::launch_decode_attention(a, nullptr); });
    float max_diff = 0.f;
    if (reference == nullptr) {
      reference = static_cast<__nv_bfloat16*>(a.out);
    } else {
      CHECK(cudaMemset(diff, 0, sizeof(float)));
      max_abs_diff<<<256, 256>>>(reference, static_cast<const __nv_bfloat16*>(a.out), out_elems,
                                 diff);
      CHECK(cudaMemcpy(&max_diff, diff, sizeof(float), cudaMemcpyDeviceToHost));
    }
    std::printf("%-58s %8.1f us  %5.2f TB/s of token-pages  max |O - ping-pong O| %.3g\n",
                form.name, ms * 1e3, bytes / (ms * 1e-3) / 1e12, max_diff);
  }
#ifdef MSA_LAB_TW_TIMELINE
  // The last token-warps launch's stamps of CTA 0 (pages past its stream stay 0).
  using msa::kTwConsumers;
  using msa::kTwLabPages;
  static long long tl[kTwConsumers + 1][kTwLabPages][3];
  static int computed[kTwConsumers][kTwLabPages];
  CHECK(cudaMemcpyFromSymbol(tl, msa::lab_tw_timeline, sizeof(tl)));
  CHECK(cudaMemcpyFromSymbol(computed, msa::lab_tw_computed, sizeof(computed)));
  int pages = 0;
  while (pages < kTwLabPages && tl[kTwConsumers][pages][2] != 0) ++pages;
  std::printf("token warps, CTA 0: %d pages stamped (of its stream's first %d)\n", pages,
              kTwLabPages);
  for (int w = 0; w < kTwConsumers; ++w) {
    double wait = 0.0, work = 0.0;
    int own = 0;
    for (int p = 0; p < pages; ++p) {
      wait += tl[w][p][1] - tl[w][p][0];
      if (computed[w][p]) {
        work += tl[w][p][2] - tl[w][p][1];
        ++own;
      }
    }
    std::printf("  warp %d: %2d own pages, full wait %.0f cycles a page, compute %.0f a page, "
                "span %lld\n", w, own, pages ? wait / pages : 0.0, own ? work / own : 0.0,
                pages ? tl[w][pages - 1][2] - tl[w][0][0] : 0ll);
  }
  double empty_wait = 0.0, issue = 0.0;
  for (int p = 0; p < pages; ++p) {
    empty_wait += tl[kTwConsumers][p][1] - tl[kTwConsumers][p][0];
    issue += tl[kTwConsumers][p][2] - tl[kTwConsumers][p][1];
  }
  if (pages) {
    std::printf("  producer: empty wait %.0f cycles a page, issue %.0f\n", empty_wait / pages,
                issue / pages);
  }
#endif
  return 0;
}
