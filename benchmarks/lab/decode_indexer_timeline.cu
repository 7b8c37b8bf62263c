// Timeline of the fused decode indexer + top-k (a GPU diagnostic, no TSV): where a page's cycles
// go in each warp of work item 0, from clock64 stamps (the MSA_LAB_TIMELINE hooks in
// csrc/decode_indexer.cu). One shared index-K head, pages shuffled, every request the same
// length, synthetic values; the plan kernel splits the history blocks as in a decode step.
//
//   nvcc -arch=sm_90a -O3 -std=c++17 -Icsrc -Itorch-ext -DMSA_LAB_TIMELINE \
//       -o /tmp/idx_timeline benchmarks/lab/decode_indexer_timeline.cu
//   /tmp/idx_timeline [e4m3|e4m3-tma|nvfp4|bf16] [batch=32] [keys=131072] [seqlen_q=1]
//                     [heads=4] [offer-warp] [butterfly]
//
// e4m3-tma: e4m3 pages as one TMA copy each into swizzled stages (tma_pages) instead of every
// thread's cp.asyncs. offer-warp: calls of 17-32 rows run the offer-warp form (a ninth warp
// holds the lists and offers; its stamps are the last warp's). butterfly: the merge of each
// request's chunk lists as a butterfly (the kernel's butterfly_merge).
// Add -DMSA_LAB_CALL_PHASES for the last call's phases over every CTA (prologue, page loop,
// count-in, the merge's loads and rounds; entries and exits on the common clock);
// -DMSA_LAB_NO_MERGE leaves the merge out. Add -DMSA_LAB_NO_LOADS for the same kernel without
// its copies (the loop's own rate, without DRAM), -DMSA_LAB_NO_OFFERS without its offers,
// -DMSA_LAB_WIDEN_BY_ALU=1 with e4m3 keys widened by integer ops instead of F2FP
// (csrc/decode_indexer.cu). Prints the indexer's time per call (the plan update timed apart)
// and its bytes per second, then per warp the mean cycles of each phase of a page (its copies'
// wait, the CTA barrier, issuing the copies kStages - 1 pages ahead, the offer of the previous
// page's scores, the scoring) over pages 8 .. 55 of work item 0.
#include "../../csrc/decode_indexer.cu"
#include "lab_common.cuh"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef MSA_LAB_CALL_PHASES
// The last call's phases over its CTAs (MSA_LAB_CALL_PHASES in csrc/decode_indexer.cu): the
// mean and max cycles of each phase, the merging CTAs' apart, and on the common clock how far
// apart the CTAs start and how long after the last page loop ends the last merge does.
void print_call_phases(int capacity, const int32_t* d_work, const int32_t* d_requests,
                       int batch) {
  const int ctas = std::min(capacity, msa::kLabMaxCtas);
  static long long clk[msa::kLabMaxCtas][msa::kLabCallMarks];
  static long long ns[msa::kLabMaxCtas][2];
  CHECK(cudaMemcpyFromSymbol(clk, msa::lab_call_clock, sizeof(clk)));
  CHECK(cudaMemcpyFromSymbol(ns, msa::lab_call_ns, sizeof(ns)));
  std::vector<int32_t> work(2 * capacity), requests(3 * batch);
  CHECK(cudaMemcpy(work.data(), d_work, work.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(requests.data(), d_requests, requests.size() * 4, cudaMemcpyDeviceToHost));
  struct Stat { double sum = 0, max = 0; int n = 0;
    void add(double v) { sum += v; max = std::max(max, v); ++n; }
    double mean() const { return n ? sum / n : 0.0; } };
  const auto live = [&](int c) {
    const int b = work[2 * c], chunk = work[2 * c + 1];
    return b >= 0 && b < batch && chunk >= 0 && chunk < requests[3 * b + 1];
  };
  // The SM clock, from the CTAs' own spans on both clocks (entry to exit: mark 5 in a merging
  // CTA, mark 3 in the others).
  double span_cycles = 0.0, span_ns_total = 0.0;
  for (int c = 0; c < ctas; ++c) {
    if (!live(c)) continue;
    span_cycles += clk[c][clk[c][5] != 0 ? 5 : 3] - clk[c][0];
    span_ns_total += ns[c][1] - ns[c][0];
  }
  const double cycles_per_ns = span_ns_total > 0 ? span_cycles / span_ns_total : 1.0;
  Stat prologue, pages, count_in, loads, rounds, span_ns;
  long long first_entry = 0, last_entry = 0, last_loop_end = 0, last_exit = 0;
  bool any = false;
  for (int c = 0; c < ctas; ++c) {
    if (!live(c)) continue;
    const long long* t = clk[c];
    prologue.add(t[1] - t[0]);
    pages.add(t[2] - t[1]);
    count_in.add(t[3] - t[2]);
    if (t[5] != 0) {   // the request's merging CTA
      loads.add(t[4] - t[3]);
      rounds.add(t[5] - t[4]);
    }
    span_ns.add(ns[c][1] - ns[c][0]);
    // The CTA's loop end on the common clock, from its entry and its own cycles.
    const long long loop_end = ns[c][0] + static_cast<long long>((t[2] - t[0]) / cycles_per_ns);
    if (!any) { first_entry = last_entry = ns[c][0]; any = true; }
    first_entry = std::min(first_entry, ns[c][0]);
    last_entry = std::max(last_entry, ns[c][0]);
    last_loop_end = std::max(last_loop_end, loop_end);
    last_exit = std::max(last_exit, ns[c][1]);
  }
  std::printf("call phases over %d CTAs (cycles, mean / max): prologue %.0f / %.0f, pages %.0f / "
              "%.0f, count-in %.0f / %.0f; merging CTAs (%d): lists loaded %.0f / %.0f, rounds and "
              "stores %.0f / %.0f\n",
              pages.n, prologue.mean(), prologue.max, pages.mean(), pages.max, count_in.mean(),
              count_in.max, loads.n, loads.mean(), loads.max, rounds.mean(), rounds.max);
  std::printf("common clock (ns; SM clock %.2f GHz from the spans): entries spread over %lld, a CTA's span %.0f mean / %.0f max, "
              "first entry to last page loop end ~%lld, to last exit %lld\n",
              cycles_per_ns, last_entry - first_entry, span_ns.mean(), span_ns.max, last_loop_end - first_entry,
              last_exit - first_entry);
}
#endif

int main(int argc, char** argv) {
  const char* format = argc > 1 ? argv[1] : "e4m3";
  const int batch = argc > 2 ? std::atoi(argv[2]) : 32;
  const int keys = argc > 3 ? std::atoi(argv[3]) : 131072;
  const int seqlen_q = argc > 4 ? std::atoi(argv[4]) : 1;
  const int heads = argc > 5 ? std::atoi(argv[5]) : 4;
  const int k_format =
      std::strcmp(format, "bf16") == 0 ? 0 : (std::strcmp(format, "nvfp4") == 0 ? 2 : 1);
  const bool tma_pages = std::strcmp(format, "e4m3-tma") == 0;
  bool offer_warp = false, butterfly_merge = false;   // options after the heads, any order
  for (int i = 6; i < argc; ++i) {
    offer_warp = offer_warp || std::strcmp(argv[i], "offer-warp") == 0;
    butterfly_merge = butterfly_merge || std::strcmp(argv[i], "butterfly") == 0;
  }
  const int dim = 128, page = 128, topk = 16;
  const int pages_per_request = (keys + page - 1) / page;
  const int64_t num_pages = static_cast<int64_t>(batch) * pages_per_request;
  const int64_t row_bytes = k_format == 0 ? 2 * dim : (k_format == 1 ? dim : dim / 2);
  const int64_t page_bytes = page * row_bytes;

  uint8_t *k = nullptr, *k_scale = nullptr, *q = nullptr;
  CHECK(cudaMalloc(&k, num_pages * page_bytes));
  const lab::Fill key_fill =
      k_format == 0 ? lab::Fill::kBf16 : (k_format == 1 ? lab::Fill::kE4m3 : lab::Fill::kAnyByte);
  lab::fill_bytes<<<1024, 256>>>(k, num_pages * page_bytes, key_fill, 1u);
  if (k_format == 2) {
    CHECK(cudaMalloc(&k_scale, num_pages * page * (dim / 16)));
    lab::fill_bytes<<<1024, 256>>>(k_scale, num_pages * page * (dim / 16), lab::Fill::kE4m3Scale,
                                   2u);
  }
  const int rows = seqlen_q * heads;
  const int64_t q_bytes = static_cast<int64_t>(batch) * rows * dim * (k_format == 0 ? 2 : 1);
  CHECK(cudaMalloc(&q, q_bytes));
  lab::fill_bytes<<<256, 256>>>(q, q_bytes, k_format == 0 ? lab::Fill::kBf16 : lab::Fill::kE4m3,
                                3u);
  CHECK(cudaGetLastError());

  const std::vector<int32_t> table = lab::shuffled_pages(num_pages);
  std::vector<int32_t> lengths(batch, keys);

  int device = 0, sms = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int capacity = 2 * sms + batch;   // make_decode_indexer_plan's default grid
  const int list_capacity = 16;

  msa::DecodeIndexerPlanArgs p{};
  p.seqused_k = lab::device_copy(lengths);
  p.batch = batch;
  p.capacity = capacity;
  p.work = lab::device_zeros<int32_t>(2 * capacity);
  p.requests = lab::device_zeros<int32_t>(3 * batch);
  p.chunk_pages = lab::device_zeros<int32_t>(1);

  msa::DecodeIndexerArgs a{};
  a.q = q;
  a.q_fp8 = k_format != 0;
  a.k = k;
  a.k_format = k_format;
  a.tma_pages = tma_pages;
  a.offer_warp = offer_warp;
  a.butterfly_merge = butterfly_merge;
  a.k_scale = k_scale;
  a.k_scale_linear = true;
  a.num_pages = num_pages;
  a.page_table = lab::device_copy(table);
  a.page_table_width = pages_per_request;
  a.seqused_k = p.seqused_k;
  a.batch = batch;
  a.seqlen_q = seqlen_q;
  a.num_heads = heads;
  a.out_head_repeat = 1;
  a.topk = topk;
  a.scale = 1.f;
  a.work = p.work;
  a.requests = p.requests;
  a.chunk_pages = p.chunk_pages;
  a.capacity = capacity;
  a.partials =
      lab::device_zeros<int32_t>(static_cast<int64_t>(capacity) * rows * list_capacity * 2);
  a.list_capacity = list_capacity;
  a.out = lab::device_zeros<int32_t>(static_cast<int64_t>(heads) * batch * seqlen_q * topk);

  CHECK(msa::launch_decode_indexer_plan(p, nullptr));
  const float ms = lab::mean_ms([&] { return msa::launch_decode_indexer_topk(a, nullptr); });
  int chunk = 0;
  CHECK(cudaMemcpy(&chunk, p.chunk_pages, sizeof(int), cudaMemcpyDeviceToHost));
  const double bytes =
      static_cast<double>(num_pages) * (page_bytes + (k_format == 2 ? page * (dim / 16) : 0));
#ifdef MSA_LAB_NO_LOADS
  const char* mode = "no loads";
#else
  const char* mode = "pages read";
#endif
  std::printf("decode indexer %s, B %d, %d keys, %d rows a request, %d SMs, grid %d, chunks of "
              "%d pages, %s: %.1f us per call (plan apart), %.2f TB/s of index keys\n",
              format, batch, keys, rows, sms, capacity, chunk, mode, ms * 1e3,
              bytes / (ms * 1e-3) / 1e12);

  using msa::kLabMarks;
  using msa::kLabPages;
  // Warps of the launch: the eight scoring warps, and the offer warp where the form has one.
  const int warps = offer_warp && seqlen_q * heads > 16 && seqlen_q * heads <= 32
                        ? msa::kLabWarps : msa::kWarps;
  static long long tl[msa::kLabWarps][kLabPages][kLabMarks];
  CHECK(cudaMemcpyFromSymbol(tl, msa::lab_timeline, sizeof(tl)));
  const int first = 8, last = kLabPages - 8;   // pages first .. last - 1 (page + 1 read)
  if (chunk < kLabPages) {
    std::printf("(work item 0 has %d pages: fewer than the %d the means take)\n", chunk,
                kLabPages);
  }
  auto mean = [&](int warp, int to, int from, int next_page) {
    double sum = 0.0;
    for (int i = first; i < last; ++i) sum += tl[warp][i + next_page][to] - tl[warp][i][from];
    return sum / (last - first);
  };
  for (int w = 0; w < warps; ++w) {
    std::printf("warp %d (cycles per page): copies' wait %.0f, barrier %.0f, issue %.0f, "
                "offer %.0f, score %.0f, period %.0f\n",
                w, mean(w, 1, 0, 0), mean(w, 2, 1, 0), mean(w, 3, 2, 0), mean(w, 4, 3, 0),
                mean(w, 5, 4, 0), mean(w, 0, 0, 1));
  }
  // The barrier's exit spread: how far apart the warps leave it (all should be within a few
  // cycles), and which warp arrives last (the one the others wait for).
  double last_arrival[msa::kLabWarps] = {};
  for (int i = first; i < last; ++i) {
    long long latest = 0;
    int who = 0;
    for (int w = 0; w < warps; ++w) {
      if (tl[w][i][1] > latest) {
        latest = tl[w][i][1];
        who = w;
      }
    }
    last_arrival[who] += 1.0;
  }
  std::printf("last to reach the barrier (pages of %d):", last - first);
  for (int w = 0; w < warps; ++w) std::printf(" w%d %.0f", w, last_arrival[w]);
  std::printf("\n");
#ifdef MSA_LAB_CALL_PHASES
  print_call_phases(capacity, p.work, p.requests, batch);
#endif
  return 0;
}
