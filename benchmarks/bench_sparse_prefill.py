"""MSA sparse prefill on one GPU against FlexAttention (same selection) and cuDNN dense causal SDPA.

Configuration (MiniMax-M3): Hq=64, Hkv=4, D=128, block 128, topK=16 with the query's own block
forced. Selection patterns:
  random     every query picks 15 uniformly random earlier blocks (per KV head);
  clustered  the queries of one 128-token block share 13 blocks and pick 2 of their own, as real
             indexers produce;
  shared     the queries of one 128-token block share all 15 (FlexAttention's best case: its
             BlockMask is exact at 128x128 granularity).
Effective TFLOP/s = 4 * D * Hq * (selected, causally visible query-key pairs) / time; dense
causal TFLOP/s = 4 * D * Hq * N^2 / 2 / time. Peers are measured in the same run.

    python benchmarks/bench_sparse_prefill.py --out benchmarks/results/sparse_prefill_h200.tsv
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TsvWriter, forcing, load_msa, native_tier, ran_form  # noqa: E402
HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
COLUMNS = ("case", "lengths", "pattern", "dtype", "impl", "backend", "latency_ms", "eff_tflops",
           "visible_pairs", "speedup_vs_flex")




def selection(n: int, pattern: str, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """[Hkv, n, TOPK] int32 block ids: own block + 15 earlier ones (fewer early on), -1 tail."""
    nblk = -(-n // BLOCK)
    own = torch.arange(n, device=device) // BLOCK
    if pattern == "random":
        score = torch.rand(HKV, n, nblk, generator=gen, device=device, dtype=torch.float16)
    elif pattern == "clustered":
        nqb = nblk
        shared = torch.rand(HKV, nqb, nblk, generator=gen, device=device, dtype=torch.float16)
        score = shared.repeat_interleave(BLOCK, dim=1)[:, :n]
        # Each query lifts 2 random blocks of its own above the shared ones.
        pick = torch.randint(0, 1 << 30, (HKV, n, 2), generator=gen, device=device)
        pick = pick % own.clamp_min(1).view(1, -1, 1)
        score.scatter_(2, pick, 2.0)
    elif pattern == "shared":
        # All queries of a 128-token block share their 15 blocks (the anchor's FlexAttention
        # configuration: selection per KV head and 128-query block).
        shared = torch.rand(HKV, nblk, nblk, generator=gen, device=device, dtype=torch.float16)
        score = shared.repeat_interleave(BLOCK, dim=1)[:, :n].contiguous()
    else:
        raise ValueError(f"pattern: {pattern}")
    blk = torch.arange(nblk, device=device)
    score.masked_fill_(blk.view(1, 1, -1) > own.view(1, -1, 1), float("-inf"))
    score.scatter_(2, own.view(1, -1, 1).expand(HKV, n, 1), float("inf"))
    k = min(TOPK, nblk)
    val, idx = score.topk(k, dim=-1)
    idx = torch.where(torch.isinf(val) & (val < 0), -1, idx).int()
    if k < TOPK:
        idx = torch.cat([idx, idx.new_full((HKV, n, TOPK - k), -1)], -1)
    return idx.contiguous()


E4M3 = torch.float8_e4m3fn
DTYPE_MODES = {   # name -> (q, k, v) -> (q, k, v, pv_dtype)
    "bf16": lambda q, k, v: (q, k, v, None),
    "fp8": lambda q, k, v: (q.to(E4M3), k.to(E4M3), v.to(E4M3), E4M3),
    "fp8_pv_bf16": lambda q, k, v: (q.to(E4M3), k.to(E4M3), v.to(E4M3), torch.bfloat16),
    "bf16q_fp8kv": lambda q, k, v: (q, k.to(E4M3), v.to(E4M3), None),
}


# --partials name -> partial_dtype of sparse_atten_func (rows of other than bf16 are labelled
# "<dtype>_p<name>").
PARTIALS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "e4m3": E4M3}


def sparse_forms(msa):
    """The package's sparse serving table (cute_kernels.variants.SPARSE_FORMS)."""
    from importlib import import_module
    return import_module(f"{msa.__name__}.cute_kernels.variants").SPARSE_FORMS


def visible_pairs(q2k: torch.Tensor) -> int:
    """Sum over (KV head, query) of visible keys in its selected blocks (causal, N % 128 any)."""
    n = q2k.shape[1]
    i = torch.arange(n, device=q2k.device).view(1, -1, 1)
    own = i // BLOCK
    per = torch.where(q2k < own, BLOCK, torch.where(q2k == own, i % BLOCK + 1, 0))
    return int(torch.where(q2k >= 0, per, 0).sum())


def dense_selection_mask(q2k: torch.Tensor, h: int) -> torch.Tensor:
    n = q2k.shape[1]
    nblk = -(-n // BLOCK)
    sel = torch.zeros(n, nblk + 1, dtype=torch.bool, device=q2k.device)
    sel.scatter_(1, torch.where(q2k[h] >= 0, q2k[h], nblk).long(), True)
    return sel[:, :nblk]


def flex_per_group(q, k, v, q2k):
    """FlexAttention with the exact selection: one call per KV head group (the selection is
    shared by the group's G query heads), a BlockMask built from the per-128-query union of
    selected blocks (full blocks where all 128 queries chose a strictly earlier block)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    n = q.shape[2]
    nblk = -(-n // BLOCK)
    flex = torch.compile(flex_attention, dynamic=False)
    calls = []
    for h in range(HKV):
        sel = dense_selection_mask(q2k, h)
        pad = nblk * BLOCK - n
        sel_p = torch.nn.functional.pad(sel, (0, 0, 0, pad))
        per_qb = sel_p.view(nblk, BLOCK, nblk)
        union = per_qb.any(1)
        qb = torch.arange(nblk, device=q.device)
        full = per_qb.all(1) & (qb.view(1, -1) < qb.view(-1, 1))
        partial = union & ~full

        def to_idx(m):
            cnt = m.sum(-1, dtype=torch.int32)
            order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).int()
            return cnt.view(1, 1, -1), order.view(1, 1, nblk, nblk)

        def mask_mod(b, hh, qi, kv, sel=sel):
            return sel[qi, kv // BLOCK] & (kv <= qi)

        kv_num, kv_idx = to_idx(partial)
        full_num, full_idx = to_idx(full)
        bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                      mask_mod=mask_mod, seq_lengths=(n, n))
        g = HQ // HKV
        calls.append((q[:, h * g:(h + 1) * g], k[:, h:h + 1], v[:, h:h + 1], bm))

    def run():
        return [flex(qq, kk, vv, block_mask=bm, enable_gqa=True) for qq, kk, vv, bm in calls]
    return run


def bench(fn, rep_ms=400):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=100, rep=rep_ms, return_mode="median")




def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqs", default="8192,32768,65536,131072")
    ap.add_argument("--varlen", default="32768,16384,8269,4396",
                    help="lengths of the varlen batch case ('' to skip)")
    ap.add_argument("--patterns", default="random,clustered")
    ap.add_argument("--dtypes", default="bf16,fp8_pv_bf16,bf16q_fp8kv,fp8",
                    help="bf16; fp8 (e4m3 q/k/v, e4m3 P.V); fp8_pv_bf16 (e4m3 q/k/v, bf16 P.V); "
                         "bf16q_fp8kv (bf16 q, e4m3 k/v)")
    ap.add_argument("--partials", default="bf16",
                    help="partial_dtype of each msa run: bf16, fp16, fp32, e4m3 (comma list)")
    ap.add_argument("--forms", default="served",
                    help="attention kernel forms to time side by side: served (what the serving "
                         "table picks) or a form of SPARSE_FORMS (mma, wgmma, ws, ws3w; the "
                         "sparse_form debug hook); impl "
                         "msa_attention[<form>] unless served; a form that does not run the "
                         "call is skipped")
    ap.add_argument("--impls", default="attention,csr+attention",
                    help="msa rows: attention (prebuilt CSR and schedule), csr+attention")
    ap.add_argument("--tiers", default="hopper",
                    help="native tiers to time side by side: hopper (what the GPU's family "
                         "serves) and portable (the csrc warp-MMA tier, MSA_NATIVE_TIER=portable "
                         "with its gate open; docs/design-portable.md): impl "
                         "msa_attention[portable], attention only (the CSR and schedule are "
                         "built by the served tier)")
    ap.add_argument("--allow-unvalidated", action="store_true",
                    help="also time kernels still gated as unvalidated (backend column says so)")
    ap.add_argument("--peers", default="flex,cudnn")
    ap.add_argument("--out", default=None, help="TSV path (appended; header written if new)")
    ap.add_argument("--rep-ms", type=int, default=400)
    args = ap.parse_args()

    if args.allow_unvalidated:
        os.environ["MSA_UNVALIDATED_KERNELS"] = "1"
    msa = load_msa()
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    tsv = TsvWriter(args.out, COLUMNS, torch.device("cuda"),
                    formats={"eff_tflops": ".1f", "speedup_vs_flex": ".2f"})

    def row(case, lens, pattern, dtype, impl, backend, ms, tflops, pairs, speedup):
        tsv.write(case=case, lengths=lens, pattern=pattern, dtype=dtype, impl=impl,
                  backend=backend, latency_ms=ms, eff_tflops=tflops, visible_pairs=pairs,
                  speedup_vs_flex=speedup)

    cases = [("single", [int(s)]) for s in args.seqs.split(",") if s]
    if args.varlen:
        cases.append(("varlen", [int(s) for s in args.varlen.split(",")]))
    for case, lens in cases:
        total = sum(lens)
        for pattern in args.patterns.split(","):
            sels = [selection(n, pattern, gen) for n in lens]
            q2k = torch.cat(sels, 1).contiguous()
            pairs = sum(visible_pairs(s) for s in sels)
            flops = 4 * D * (HQ // HKV) * pairs
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                              device="cuda")
            q = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16)
            flex_ms = None
            if "flex" in args.peers:
                runs = []
                for s, n, off in zip(sels, lens, cu.tolist()):
                    sl = slice(off, off + n)
                    runs.append(flex_per_group(q[sl].transpose(0, 1).unsqueeze(0),
                                               k[sl].transpose(0, 1).unsqueeze(0),
                                               v[sl].transpose(0, 1).unsqueeze(0), s))
                flex_ms = bench(lambda: [r() for r in runs], args.rep_ms)
                row(case, lens, pattern, "bf16", "flex_attention", "triton", flex_ms,
                    flops / flex_ms / 1e9, pairs, 1.0)
            msa_runs = [(dtype, partial, form, tier) for tier in args.tiers.split(",")
                        for dtype in args.dtypes.split(",")
                        for partial in args.partials.split(",")
                        for form in (args.forms.split(",") if tier == "hopper" else ["served"])]
            for dtype, partial, form, tier in msa_runs:
                qq, kk, vv, pv_dtype = DTYPE_MODES[dtype](q, k, v)
                kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                          max_seqlen_k=max(lens), causal=True, pv_dtype=pv_dtype,
                          partial_dtype=PARTIALS[partial])
                label = dtype if partial == "bf16" else f"{dtype}_p{partial}"
                row_ptr, q_idx, sched = msa.build_k2q_csr(
                    q2k, cu, cu, 128, total_k=total, max_seqlen_k=max(lens),
                    max_seqlen_q=max(lens), qhead_per_kv=HQ // HKV, return_schedule=True)
                with forcing(msa, sparse_form=form), native_tier(tier):
                    msa.sparse_atten_func(qq, kk, vv, row_ptr, q_idx, TOPK, schedule=sched,
                                          **kw)
                backend = msa._backend.last_backend("sparse_atten")
                if tier == "portable" and backend != "portable":
                    print(f"skip msa {label} [portable]: the portable tier does not serve it",
                          flush=True)
                    continue
                if backend == "portable" and not msa._backend.PORTABLE_VALIDATED:
                    backend += "-unvalidated"
                ran = ran_form(msa, "sparse_atten") if backend == "sm90" else None
                if form != "served" and ran != form:
                    print(f"skip msa {label} [{form}]: that form does not serve it", flush=True)
                    continue
                if ran is not None and not sparse_forms(msa)[ran].validated:
                    backend += "-unvalidated"
                if backend == "reference" and total > 8192:
                    print(f"skip msa {label} {case} {lens}: reference backend only", flush=True)
                    continue
                timed = []

                def full_call():
                    rp, qi = msa.build_k2q_csr(q2k, cu, cu, 128, total_k=total,
                                               max_seqlen_k=max(lens), max_seqlen_q=max(lens),
                                               qhead_per_kv=HQ // HKV)
                    return msa.sparse_atten_func(qq, kk, vv, rp, qi, TOPK, **kw)
                with forcing(msa, sparse_form=form), native_tier(tier):
                    if "attention" in args.impls.split(","):
                        timed.append(("msa_attention", bench(
                            lambda: msa.sparse_atten_func(qq, kk, vv, row_ptr, q_idx, TOPK,
                                                          schedule=sched, **kw), args.rep_ms)))
                    if "csr+attention" in args.impls.split(",") and tier == "hopper":
                        timed.append(("msa_csr+attention", bench(full_call, args.rep_ms)))
                suffix = "" if form == "served" else f"[{form}]"
                if tier != "hopper":
                    suffix = f"[{tier}]"
                for impl, ms in timed:
                    row(case, lens, pattern, label, impl + suffix, backend, ms,
                        flops / ms / 1e9, pairs, (flex_ms / ms) if flex_ms else None)
        if "cudnn" in args.peers:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            ms_total = 0.0
            dense_flops = 0
            for n in lens:
                qd = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16)
                kd = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16)
                kd = kd.repeat_interleave(HQ // HKV, 1)
                vd = torch.randn_like(kd)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    ms_total += bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qd, kd, vd, is_causal=True), args.rep_ms)
                dense_flops += 4 * D * HQ * n * n // 2
                del qd, kd, vd
            row(case, lens, "dense", "bf16", "cudnn_sdpa_causal", "cudnn", ms_total,
                dense_flops / ms_total / 1e9, None, None)
        torch.cuda.empty_cache()



if __name__ == "__main__":
    main()
