"""Would the sparse decode kernel serve short prefill chunks better than CSR + attention +
combine? (GPU diagnostic for issue 23, no TSV.)

A short chunk (a few hundred new queries against a long cached prefix, 27 % of MiniMax-M3's
production prefill calls) pays ~0.05 ms for the k2q CSR and schedule, ~0.03 ms for the combine
and a KV-outer attention whose blocks see few queries each (`prefill_production_h200.tsv`).
The decode kernel needs neither: it streams each request's selected pages once per qo tile and
writes O directly. Its batch here is the chunk folded into decode requests of S consecutive
queries (S = --seqlen-q: 1, or 8 / 16 with multi-token-prediction tiles): group g of request b
is the decode request "the S queries ending at its last one", with request b's page table and
seqused_k = that query's position + 1, so the decode kernel's causal rule (token t of S sees the
keys up to seqused_k - S + t) is the chunk's. A request whose chunk is not a multiple of S gets
one group ending at its last query that overlaps the one before (those rows run twice).

Per case and dtype, on the same slots (each its own paged caches and plan, rotated past the L2
like bench_prefill_production.py), the selection the pipeline made:
  pipeline     MsaPrefillPagedWrapper.run, the whole call (CUDA graph), and its CSR + attention
               + combine stages (the part the decode route replaces; the indexer and top-k stay)
  decode[S]    SparseDecodePagedAttentionWrapper.run on the folded batch (CUDA graph), and
               max |O_decode - O_pipeline| over the chunk's rows

    python benchmarks/lab/short_chunk_via_decode.py                # the short production cases
    python benchmarks/lab/short_chunk_via_decode.py --cases prefill_092e2734 --seqlen-q 1,8,16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
from _common import (free_memory, graph_us, load_msa, parse_names,  # noqa: E402
                     split_dtype_name)
from bench_prefill_production import PagedSlot, slot_count, stage_breakdown  # noqa: E402
from prefill_cases import load_cases, select_cases  # noqa: E402

SHORT_CHUNK = 700          # queries per call: the production table's short class


class Folded:
    """The decode route's batch for one slot: S-query groups of every request's chunk."""

    def __init__(self, msa, slot: PagedSlot, case, q2k: torch.Tensor, seqlen_q: int, args):
        rows, requests, ends = [], [], []
        offset = 0
        for b, (q_len, prefix) in enumerate(zip(case.query_lens, case.prefix_lens)):
            starts = list(range(0, q_len - seqlen_q + 1, seqlen_q))
            if q_len % seqlen_q:
                starts.append(q_len - seqlen_q)
            for start in starts:
                rows.extend(range(offset + start, offset + start + seqlen_q))
                requests.append(b)
                ends.append(prefix + start + seqlen_q)
            offset += q_len
        device = slot.q.device
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        # e4m3 rows move as uint8 (index_select of float8 is not on every backend)
        self.q = slot.q.view(torch.uint8).index_select(0, self.rows).view(slot.q.dtype)
        self.q2k = q2k.index_select(1, self.rows)
        self.page_table = slot.page_table.index_select(
            0, torch.tensor(requests, dtype=torch.long, device=device)).contiguous()
        self.seqused_k = torch.tensor(ends, dtype=torch.int32, device=device)
        self.out = torch.empty(self.q.shape, dtype=torch.bfloat16, device=device)
        self.k, self.v = slot.k_cache, slot.v_cache
        self.wrapper = msa.SparseDecodePagedAttentionWrapper().plan(
            page_table=self.page_table, seqused_k=self.seqused_k, seqlen_q=seqlen_q,
            max_seqlen_k=case.max_kv, q2k_indices=self.q2k, num_qo_heads=args.hq,
            num_kv_heads=args.hkv, enable_cuda_graph=True)

    def run(self):
        return self.wrapper.run(self.q, self.k, self.v, out=self.out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="case ids or prefixes (default: every case of "
                                                f"at most {SHORT_CHUNK} queries)")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--seqlen-q", default="1,8,16", help="queries per decode request")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--max-slots", type=int, default=16)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    msa = load_msa()
    cases = load_cases()
    cases = (select_cases(cases, args.cases) if args.cases
             else [c for c in cases if c.total_q <= SHORT_CHUNK])
    print("case\tB\tq\tmax_kv\tdtype\tslots\tpipeline_us\tcsr+attn+combine_us\tS\tdecode_us\t"
          "decode/replaced\tmax_abs_diff", flush=True)
    for case in cases:
        for dtype_name in parse_names(args.dtypes):
            dtype, partial = split_dtype_name(dtype_name)
            count = slot_count(case, args, dtype.itemsize, device)
            slots = [PagedSlot(msa, case, args, dtype, partial, device) for _ in range(count)]
            outs, sels = zip(*(slot.run(return_selection=True) for slot in slots))
            pipeline = graph_us([slot.run for slot in slots], device, args.replays)
            stages = stage_breakdown(msa, slots, args, device)
            replaced = 1e3 * sum(stages.get(s, 0.0) for s in ("csr", "attention", "combine"))
            head = [case.case_id, case.batch, case.total_q, case.max_kv, dtype_name, count,
                    f"{pipeline:.1f}", f"{replaced:.1f}"]
            for seqlen_q in map(int, parse_names(args.seqlen_q)):
                if min(case.query_lens) < seqlen_q:
                    print("\t".join(map(str, head + [seqlen_q, "skipped: a chunk is shorter"])))
                    continue
                folded = [Folded(msa, slot, case, sel, seqlen_q, args)
                          for slot, sel in zip(slots, sels)]
                diff = max((f.run().float() - out.index_select(0, f.rows).float())
                           .abs().max().item() for f, out in zip(folded, outs))
                decode = graph_us([f.run for f in folded], device, args.replays)
                print("\t".join(map(str, head + [seqlen_q, f"{decode:.1f}",
                                                 f"{decode / replaced:.2f}", f"{diff:.3e}"])),
                      flush=True)
                del folded
            del slots, outs, sels
            free_memory(device)


if __name__ == "__main__":
    main()
