"""Dense FMHA through the fmha plan/run API (issue 6) next to cuDNN SDPA and SDPA's flash
backend, measured in the same run.

Cases: one sequence of N tokens, causal and non-causal, (Hq, Hkv) in {(64, 4), (32, 8)}, bf16,
dense K/V and paged K/V (128-token pages, shuffled); plus the max-score-only proxy pass
(output_o=False, num_kv_heads=1); and, with --decode, decode-like plans (B requests of q
queries against kv keys, causal bottom-right) on the split-KV form next to the unsplit kernel
(no SDPA peer: its causal mask is top-left). TFLOP/s = 4 * D * Hq * (visible query-key pairs) /
time, with N^2 / 2 pairs for causal and N^2 otherwise.

    python benchmarks/bench_fmha.py --out benchmarks/results/fmha_h200.tsv [--allow-unvalidated]

A kernel form not yet validated on hardware (validated=False in the serving table) is passed
by; --allow-unvalidated times it anyway (the backend column then says "sm90-unvalidated").

Each case (peers included) first runs back to back for --steady-ms (default 1000) so that it is
timed at the clock its own power draw settles to (the H200 power-caps a bf16 FMHA, not an e4m3
one: docs/design-fmha.md); the note column records that warm-up and the median SM clock and
power sampled during the measurement. --steady-ms 0 times with do_bench's own short warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (ClockSampler, TsvWriter, add_common_args, apply_preset,  # noqa: E402
                     forcing, free_memory, load_msa, parse_names, parse_sizes, ran_form,
                     reference_too_slow, setup, time_ms)

D = 128
COLUMNS = ("mode", "n", "hq", "hkv", "causal", "layout", "impl", "backend", "latency_ms",
           "tflops", "speedup_vs_cudnn", "note")


def to_pages(k: torch.Tensor, v: torch.Tensor, gen: torch.Generator):
    """[N, Hkv, D] -> shuffled pages [P, Hkv, 128, D] and kv_indices [P] (one request)."""
    n, hkv, _ = k.shape
    pages = -(-n // 128)
    perm = torch.randperm(pages, generator=gen, device="cpu").to(k.device)
    kp = torch.zeros(pages, hkv, 128, D, dtype=k.dtype, device=k.device)
    vp = torch.zeros_like(kp)
    pad = pages * 128 - n
    kk = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(pages, 128, hkv, D)
    vv = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(pages, 128, hkv, D)
    kp[perm] = kk.transpose(1, 2)
    vp[perm] = vv.transpose(1, 2)
    return kp, vp, perm.to(torch.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="4k,8k,32k,128k")
    ap.add_argument("--heads", default="64x4,32x8", help="Hq x Hkv pairs")
    ap.add_argument("--causal", default="1,0")
    ap.add_argument("--layouts", default="dense,paged")
    ap.add_argument("--peers", default="cudnn,flash", help="SDPA backends timed alongside")
    ap.add_argument("--max-score-seqs", default="32k,128k",
                    help="N of the max-score-only pass (Hq=4 index heads, Hkv=1)")
    ap.add_argument("--dtypes", default="bf16",
                    help="q/k/v dtypes: bf16, fp8 (e4m3 q/k/v, bf16 O; impl msa.fmha[e4m3])")
    ap.add_argument("--forms", default="served",
                    help="kernel forms to time side by side: served (what the serving table "
                         "picks for the call) and the O-only forms of FMHA_FORMS (wsu, wsup, "
                         "wsuts, wsutps); impl msa.fmha[<form that ran>]; a (dtype, form) pair "
                         "that does not exist is skipped; the fmha_form hook is set per row")
    ap.add_argument("--allow-unvalidated", action="store_true",
                    help="time the gated native kernel (backend column says so)")
    ap.add_argument("--decode", default="",
                    help="decode-like plans 'BxQxKV,...' (e.g. 1x1x32k,1x128x128k): split-KV "
                         "vs unsplit ('' to skip)")
    add_common_args(ap, rep_ms=200, steady_ms=1000)
    args = ap.parse_args(argv)
    if args.tiny:
        apply_preset(args, ap, seqs="300", heads="4x2", max_score_seqs="300", rep_ms=5,
                     peers="")
    elif args.quick:
        apply_preset(args, ap, seqs="8k,32k", heads="64x4", max_score_seqs="32k")
    if args.allow_unvalidated:
        os.environ["MSA_UNVALIDATED_KERNELS"] = "1"
    device = setup(args)
    msa = load_msa()
    dtype_names = parse_names(args.dtypes)
    if set(dtype_names) - {"bf16", "fp8"}:
        ap.error(f"--dtypes {args.dtypes}: bf16 and fp8 are the choices")
    form_names = parse_names(args.forms)
    # O-only forms per --dtypes name: the package's serving table (plain Python, also in builds
    # without native kernels).
    table = import_module(f"{msa.__name__}.cute_kernels.variants").FMHA_FORMS
    o_forms = {name: [f for f, form in table.items() if dtype in form.dtypes
                      and form.kernel == "FmhaSm90Ws"]
               for name, dtype in (("bf16", "bfloat16"), ("fp8", "e4m3"))}
    known = {"served", *o_forms["bf16"], *o_forms["fp8"]}
    if set(form_names) - known:
        ap.error(f"--forms {args.forms}: the choices are {', '.join(sorted(known))}")
    # (dtype, form) rows for the forms each dtype has.
    runs = [(d, f) for d in dtype_names for f in form_names if f == "served" or f in o_forms[d]]
    tsv = TsvWriter(args.out, COLUMNS, device, formats={"tflops": ".1f",
                                                         "speedup_vs_cudnn": ".2f"})
    gen = torch.Generator(device="cpu").manual_seed(torch.initial_seed() % (1 << 62))
    for n in parse_sizes(args.seqs):
        for pair in parse_names(args.heads):
            hq, hkv = (int(x) for x in pair.split("x"))
            q = torch.randn(n, hq, D, device=device, dtype=torch.bfloat16)
            k = torch.randn(n, hkv, D, device=device, dtype=torch.bfloat16)
            v = torch.randn(n, hkv, D, device=device, dtype=torch.bfloat16)
            for causal in (c == "1" for c in parse_names(args.causal)):
                pairs = n * (n + 1) // 2 if causal else n * n
                flops = 4 * D * hq * pairs
                peer_ms = {}
                for peer in parse_names(args.peers):
                    timed = time_sdpa(peer, q, k, v, causal, device, args)
                    if timed is None:
                        continue
                    ms, note = timed
                    peer_ms[peer] = ms
                    tsv.write(mode="o", n=n, hq=hq, hkv=hkv, causal=int(causal),
                              layout="dense", impl=f"sdpa_{peer}", backend=peer,
                              latency_ms=ms, tflops=flops / ms / 1e9, note=note)
                for layout in parse_names(args.layouts):
                    kw = {}
                    k_in, v_in = k, v
                    if layout == "paged":
                        k_in, v_in, kv_indices = to_pages(k, v, gen)
                        kw["kv_indices"] = kv_indices
                    plan = msa.fmha_plan(torch.tensor([n]), torch.tensor([n]), hq, hkv,
                                         causal=causal, page_size=128 if layout == "paged"
                                         else -1, device=device)
                    for dtype_name, form in runs:
                        if dtype_name == "fp8":
                            q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k_in, v_in))

                            def call():
                                return msa.fmha(q8, k8, v8, plan, output_maxscore=False, **kw)
                        else:
                            def call():
                                return msa.fmha(q, k_in, v_in, plan, output_maxscore=False,
                                                **kw)
                        with forcing(msa, fmha_form=form):
                            call()
                            backend = msa._backend.last_backend("fmha_dense")
                            if reference_too_slow(backend, n, device, args,
                                                  f"fmha {layout} N={n}"):
                                continue
                            ran = ran_form(msa, "fmha_dense") if backend == "sm90" else None
                            if ran is not None and not table[ran].validated:
                                backend = "sm90-unvalidated"
                            ms, note = time_with_clock(call, device, args)
                        cudnn = peer_ms.get("cudnn")
                        impl = "msa.fmha[e4m3]" if dtype_name == "fp8" else "msa.fmha"
                        if ran is not None:
                            impl += f"[{ran}]"
                        tsv.write(mode="o", n=n, hq=hq, hkv=hkv, causal=int(causal),
                                  layout=layout, impl=impl, backend=backend, latency_ms=ms,
                                  tflops=flops / ms / 1e9,
                                  speedup_vs_cudnn=(cudnn / ms) if cudnn else None,
                                  note=note)
            free_memory(device)

    # The max-score-only proxy pass: 4 index heads against one shared key head.
    for n in parse_sizes(args.max_score_seqs):
        q = torch.randn(n, 4, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(n, 1, D, device=device, dtype=torch.bfloat16)
        plan = msa.fmha_plan(torch.tensor([n]), torch.tensor([n]), 4, 1, output_maxscore=True,
                             device=device)

        def score():
            return msa.fmha(q, k, k, plan, output_o=False)
        score()
        backend = msa._backend.last_backend("fmha_max_score")
        if reference_too_slow(backend, n, device, args, f"fmha max-score N={n}"):
            continue
        ms, note = time_with_clock(score, device, args)
        flops = 2 * D * 4 * (n * (n + 1) // 2)
        tsv.write(mode="max_score", n=n, hq=4, hkv=1, causal=1, layout="dense",
                  impl="msa.fmha", backend=backend, latency_ms=ms, tflops=flops / ms / 1e9,
                  note=f"2*D*H*pairs {note}".strip())
        free_memory(device)
    if args.decode:
        bench_decode_like(msa, args, tsv, device)


def bench_decode_like(msa, args, tsv, device):
    """--decode "BxQxKV,...": one row per dtype for the unsplit kernel and one for the split-KV
    form with the planner's split count (rows only when the planner splits)."""
    for spec in parse_names(args.decode):
        b, ql, kv = (parse_sizes(x)[0] for x in spec.split("x"))
        hq, hkv = 64, 4
        pairs = b * sum(kv - ql + i + 1 for i in range(ql))
        for dtype_name in parse_names(args.dtypes):
            dtype = torch.float8_e4m3fn if dtype_name == "fp8" else torch.bfloat16
            q = torch.randn(b * ql, hq, D, device=device).to(dtype)
            k = torch.randn(b * kv, hkv, D, device=device).to(dtype)
            v = torch.randn(b * kv, hkv, D, device=device).to(dtype)
            plan = msa.fmha_plan(torch.full((b,), ql), torch.full((b,), kv), hq, hkv,
                                 causal=True, device=device)
            splits = plan[3]["num_kv_splits"]
            if splits <= 1:
                print(f"skip decode {spec} {dtype_name}: the planner does not split", flush=True)
                continue
            for form in ("unsplit", "split"):
                call = lambda: msa.fmha(q, k, v, plan, output_maxscore=False)   # noqa: E731
                with forcing(msa, fmha_split_kv=None if form == "split" else False):
                    call()
                    ms, note = time_with_clock(call, device, args)
                impl = "msa.fmha" + ("[e4m3]" if dtype_name == "fp8" else "")
                impl += f"[split={splits}]" if form == "split" else "[unsplit]"
                tsv.write(mode="decode", n=kv, hq=hq, hkv=hkv, causal=1, layout="dense",
                          impl=impl, backend=msa._backend.last_backend("fmha_dense"),
                          latency_ms=ms, tflops=4 * D * hq * pairs / ms / 1e9,
                          note=f"B={b} q={ql} {note}".strip())
            free_memory(device)


def time_with_clock(fn, device, args):
    """(time_ms of fn with args' --rep-ms / --steady-ms, the row's TSV note: the steady warm-up
    and the SM clock and power the measurement ran at; empty on the CPU)."""
    with ClockSampler() as clocks:
        ms = time_ms(fn, device, args.rep_ms, steady_ms=args.steady_ms)
    if device.type != "cuda":
        return ms, ""
    return ms, f"steady={args.steady_ms}ms {clocks.note()}".strip()


def time_sdpa(peer: str, q, k, v, causal: bool, device, args):
    """time_with_clock of dense SDPA with one backend (cudnn or flash) on [1, H, N, D] views
    (K/V expanded to Hq heads); None (with a note) when the backend refuses the shape."""
    if device.type != "cuda":
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[peer]
    g = q.shape[1] // k.shape[1]
    qq = q.transpose(0, 1).unsqueeze(0)
    kk = k.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
    vv = v.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel([backend]):
        try:
            return time_with_clock(lambda: sdpa(qq, kk, vv, is_causal=causal), device, args)
        except RuntimeError as exc:
            print(f"skip sdpa {peer} N={q.shape[0]}: {str(exc).splitlines()[0]}", flush=True)
            return None


if __name__ == "__main__":
    main()
