// Timeline of the decode kernel's ping-pong form (a GPU diagnostic, no TSV): where a page's
// cycles go, per actor, from clock64 stamps of CTA (0, 0) (the MSA_LAB_TIMELINE hooks in
// csrc/decode_attention.cu). Dense paged decode, MTP 8 at G 16 (one 128-row tile per request and
// KV head), pages shuffled, synthetic values; every request one chunk (no split, no merge).
//
//   nvcc -arch=sm_90a -O3 -std=c++17 -Icsrc -Itorch-ext -DMSA_LAB_TIMELINE \
//       -o /tmp/pp_timeline benchmarks/lab/decode_pp_timeline.cu
//   /tmp/pp_timeline [bf16|e4m3|e4m3-pv8] [batch=32] [keys=100000] [pp|persistent]
//                    [uniform|ragged]
//
// e4m3-pv8: the e4m3 form with P.V on e4m3 wgmma (K and V pages by TMA, the producer's four
// warps transposing V; the K stream's stamps are thread 0's copies of each page).
// persistent: the persistent form (one CTA per SM over equal page shares, its merge launched
// after it) instead of one work item per request and KV head; ragged: request lengths uniform
// in [0.75, 1.25] x keys (the production protocol's spread) instead of all equal. The
// persistent form also lists CTA 0's first turns one by one (a piece's trailing turn and
// finalize show as the gap before the next piece's first turn).
//
// Add -DMSA_LAB_NO_LOADS for the same kernel with every page zero-filled instead of read (the
// pipeline's own rate, without DRAM); the softmax hooks of csrc/decode_attention.cu bound and
// try cheaper softmaxes: -DMSA_LAB_EXP_ON_FMA=n (n of every 16 probabilities by a polynomial on
// the FMA pipe), -DMSA_LAB_NO_EXP (no exponentials), -DMSA_LAB_NO_SOFTMAX (no page softmax). Prints the call's time and bytes per second, then per
// consumer warpgroup the mean cycles of each phase of a turn (data wait, turn wait, issue,
// wgmma wait, softmax) and per stream the mean cycles of its empty wait and issue, over turns
// 8 .. 63 (the ring is full by then). Without -DMSA_LAB_TIMELINE only the call's time is printed:
// the kernel as the package builds it (the stamps cost registers), for A/Bs of its code.
#include "../../csrc/decode_attention.cu"
#include "lab_common.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  const bool pv_fp8 = argc > 1 && std::strcmp(argv[1], "e4m3-pv8") == 0;
  const bool fp8 = pv_fp8 || (argc > 1 && std::strcmp(argv[1], "e4m3") == 0);
  const int batch = argc > 2 ? std::atoi(argv[2]) : 32;
  const int keys = argc > 3 ? std::atoi(argv[3]) : 100000;
  const bool persistent = argc > 4 && std::strcmp(argv[4], "persistent") == 0;
  const bool ragged = argc > 5 && std::strcmp(argv[5], "ragged") == 0;
  const int seqlen_q = 8, hq = 64, hkv = 4, dim = 128, page = 128;
  std::vector<int32_t> lengths(batch, keys);
  uint64_t lcg = 2718281828ull;
  for (int b = 0; b < batch && ragged; ++b) {
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    lengths[b] = static_cast<int32_t>(keys * (0.75 + 0.5 * ((lcg >> 11) * 0x1.0p-53)));
  }
  int max_len = 0;
  int64_t total_len = 0;
  for (int b = 0; b < batch; ++b) {
    max_len = std::max(max_len, lengths[b]);
    total_len += lengths[b];
  }
  const int pages_per_request = (max_len + page - 1) / page;
  const int64_t num_pages = static_cast<int64_t>(batch) * pages_per_request;
  const int elem = fp8 ? 1 : 2;

  const int64_t page_bytes = static_cast<int64_t>(hkv) * page * dim * elem;
  uint8_t *k = nullptr, *v = nullptr, *q = nullptr;
  CHECK(cudaMalloc(&k, num_pages * page_bytes));
  CHECK(cudaMalloc(&v, num_pages * page_bytes));
  const int64_t q_bytes = static_cast<int64_t>(batch) * seqlen_q * hq * dim * elem;
  CHECK(cudaMalloc(&q, q_bytes));
  const lab::Fill fill = fp8 ? lab::Fill::kE4m3 : lab::Fill::kBf16;
  lab::fill_bytes<<<1024, 256>>>(k, num_pages * page_bytes, fill, 1u);
  lab::fill_bytes<<<1024, 256>>>(v, num_pages * page_bytes, fill, 2u);
  lab::fill_bytes<<<256, 256>>>(q, q_bytes, fill, 3u);
  CHECK(cudaGetLastError());

  // Shuffled pages, one chunk and one qo tile per request.
  const std::vector<int32_t> table = lab::shuffled_pages(num_pages);
  std::vector<int32_t> ones(batch, 1), zeros(batch, 0), indptr(batch + 1);
  std::vector<int32_t> requests(batch);
  for (int b = 0; b < batch; ++b) requests[b] = b;
  for (int b = 0; b <= batch; ++b) indptr[b] = b;

  msa::DecodeAttentionArgs a{};
  a.q = q;
  a.k = k;
  a.v = v;
  a.q_fp8 = a.kv_fp8 = fp8;
  a.page_table = lab::device_copy(table);
  a.page_table_width = pages_per_request;
  a.seqused_k = lab::device_copy(lengths);
  a.batch = batch;
  a.seqlen_q = seqlen_q;
  a.num_qo_heads = hq;
  a.num_kv_heads = hkv;
  a.num_pages = num_pages;
  a.request_indices = lab::device_copy(requests);
  a.kv_tile_indices = lab::device_copy(zeros);
  a.qo_tile_indices = lab::device_copy(zeros);
  a.qo_tile_rows = 128;
  a.num_splits = lab::device_copy(ones);
  a.merge_indptr = lab::device_copy(indptr);
  a.num_work = batch;
  a.kv_chunk_size = pages_per_request;
  a.split_kv = false;
  CHECK(cudaMalloc(&a.out, static_cast<int64_t>(batch) * seqlen_q * hq * dim * 2));
  a.softmax_scale = 1.f / std::sqrt(static_cast<float>(dim));
  a.warpgroup = true;
  a.pingpong = true;
  a.pv_fp8 = pv_fp8;
  if (persistent) {
    int device = 0, sms = 0;
    CHECK(cudaGetDevice(&device));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    a.persistent = true;
    a.num_work = sms;
    a.num_partial_slots = 2 * static_cast<int64_t>(sms);
    CHECK(cudaMalloc(&a.request_pages, (batch + 1) * sizeof(int64_t)));
    CHECK(cudaMalloc(&a.o_partial, a.num_partial_slots * seqlen_q * hq * dim * sizeof(float)));
    CHECK(cudaMalloc(&a.lse_partial, a.num_partial_slots * seqlen_q * hq * sizeof(float)));
  }

  const float ms = lab::mean_ms([&] { return msa::launch_decode_attention(a, nullptr); });
  const double bytes = 2.0 * total_len * hkv * dim * elem;
#ifdef MSA_LAB_NO_LOADS
  const char* mode = "no loads (pages zero-filled)";
#else
  const char* mode = "pages read";
#endif
  std::printf("ping-pong%s %s, B %d, %d keys%s, MTP %d, %s: %.1f us per call%s, %.2f TB/s of "
              "K/V\n", persistent ? " (persistent)" : "",
              pv_fp8 ? "e4m3 (e4m3 P.V)" : fp8 ? "e4m3" : "bf16", batch, keys,
              ragged ? " (ragged, 0.75-1.25x)" : "", seqlen_q, mode, ms * 1e3,
              persistent ? " (its merge included)" : "", bytes / (ms * 1e-3) / 1e12);

#ifdef MSA_LAB_TIMELINE
  using msa::kLabMarks;
  using msa::kLabTurns;
  static long long tl[4][kLabTurns][kLabMarks];
  CHECK(cudaMemcpyFromSymbol(tl, msa::lab_timeline, sizeof(tl)));
  const int first = 8, last = kLabTurns - 1;   // turns first .. last - 1 (t + 1 read)
  auto mean = [&](int actor, int to, int from, int next_turn) {
    double sum = 0.0;
    for (int t = first; t < last; ++t) sum += tl[actor][t + next_turn][to] - tl[actor][t][from];
    return sum / (last - first);
  };
  for (int c = 0; c < 2; ++c) {
    std::printf("consumer %d (cycles per turn): data wait %.0f, turn wait %.0f, issue %.0f, "
                "wgmma wait %.0f, softmax %.0f, period %.0f\n",
                c, mean(2 + c, 1, 0, 0), mean(2 + c, 2, 1, 0), mean(2 + c, 3, 2, 0),
                mean(2 + c, 4, 3, 0), mean(2 + c, 5, 4, 0), mean(2 + c, 0, 0, 1));
  }
  for (int s = 0; s < 2; ++s) {   // e4m3 K is copied raw like bf16's; e4m3 V is widened
    if (pv_fp8 && s == 1) {
      std::printf("V^T stream (cycles per page, the four producer warps): empty wait %.0f, "
                  "raw page wait %.0f, transpose %.0f, period %.0f\n",
                  mean(s, 1, 0, 0), mean(s, 2, 1, 0), mean(s, 3, 2, 0), mean(s, 0, 0, 1));
    } else if (fp8 && s == 1) {
      std::printf("%s stream (cycles per page): next reference %.0f, empty wait %.0f, "
                  "widen (its quarters' waits included) %.0f, period %.0f\n",
                  s == 0 ? "K" : "V", mean(s, 1, 0, 0), mean(s, 2, 1, 0), mean(s, 3, 2, 0),
                  mean(s, 0, 0, 1));
    } else {
      std::printf("%s stream (cycles per page): empty wait %.0f, issue %.0f, period %.0f\n",
                  s == 0 ? "K" : "V", mean(s, 1, 0, 0), mean(s, 2, 1, 0), mean(s, 0, 0, 1));
    }
  }
  // How early a page's copies were issued before consumer 0 went past its data wait.
  double lead_k = 0.0, lead_v = 0.0;
  for (int t = first; t < last; ++t) {
    lead_k += tl[2][t][1] - tl[0][t][2];
    lead_v += tl[2][t + 1][1] - tl[1][t][fp8 ? 3 : 2];
  }
  if (!persistent) {
    std::printf("lead (cycles from the stream's last stamp of a page to consumer 0's use): "
                "K %.0f, V %.0f\n", lead_k / (last - first), lead_v / (last - first));
    return 0;
  }
  // The persistent form's turns are counted across pieces (pages + 1 turns a piece), so the
  // stream's page t is not turn t's: the lead is left out; instead CTA 0's turns one by one.
  std::printf("CTA 0's turns (consumer 0): data wait, turn wait, issue, wgmma wait, softmax; "
              "gap to the next turn (a finalize and the next piece's Q wait where one ends)\n");
  for (int t = 0; t < kLabTurns - 1; ++t) {
    const long long* m = tl[2][t];
    if (m[0] == 0 || tl[2][t + 1][0] == 0) break;
    std::printf("  turn %2d: %5lld %5lld %5lld %5lld %5lld | %5lld\n", t, m[1] - m[0],
                m[2] - m[1], m[3] - m[2], m[4] - m[3], m[5] - m[4], tl[2][t + 1][0] - m[5]);
  }
#endif
  return 0;
}
