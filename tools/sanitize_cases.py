"""A representative set of native calls for `compute-sanitizer --tool memcheck` (GPU host).

    compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 tools/sanitize_cases.py build/<variant>

Every native op runs at least once on small ragged inputs: build_k2q_csr (+ schedule), sparse
prefill (bf16 dense/paged, fp32/bf16/fp16/e4m3 partials, G = 1 and 16, each FP8 mode, the
combine), sparse_topk_select (forced blocks, causal end, head reduce), block max-scores
(dense/paged), paged decode (dense/sparse, split and unsplit, every form) and the fused decode
indexer; the e4m3 indexer too. Inputs
include indices a caller may pass without host validation (the API never syncs to look at index values): q2k ids past the request's blocks
or negative, page-table entries out of range, seqused_k larger than the table. Kernels must skip
them, never touch memory outside their buffers. Kernel forms not yet validated are enabled here
on purpose (MSA_UNVALIDATED_KERNELS=1): memcheck is part of their validation. MSA_BACKEND=native,
so a
silent fallback cannot hide a kernel from the sanitizer. MSA_SANITIZE_ONLY (comma-separated
section names: sparse_prefill, csr, sparse_prefill_portable, topk, block_max, block_max_portable,
decode, decode_indexer, csrc_portable, fmha, prefill_production, malformed) runs a subset.
Section "csrc_portable" runs the CSR builder, top-k, decode and decode indexer cases on the
portable tier (MSA_NATIVE_TIER=portable: decode without its warpgroup form).

Section "malformed" replays tests/bad_input_table.py unchecked on the native kernels: every case
whose expectation is Invalid (garbage cu_seqlens, row pointers, ids, page tables, seqused_k,
short host hints), Skip (ids past their request) or NonFinite (NaN / Inf data), plus the valid
edge cases (Same), one call each; none may touch memory outside its buffers.
MSA_SANITIZE_FNS (comma-separated public names, e.g. "decode_indexer_topk,layers") limits it
to the cases of those functions (a name matches itself and "name.*").
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ["MSA_UNVALIDATED_KERNELS"] = "1"
os.environ["MSA_BACKEND"] = "native"
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))
from msa_loading import import_variant_as_msa  # noqa: E402

msa = import_variant_as_msa(sys.argv[1])
from msa import _backend  # noqa: E402
from msa.indexer import chunk_block_max_scores  # noqa: E402
from msa._native import (block_max_score_sm90, decode_cuda,  # noqa: E402,F401 (registers them)
                         decode_indexer_cuda, debug)

import test_sparse_prefill_gpu as prefill_cases  # noqa: E402
from test_block_max_score_gpu import _paginate as paginate_index_keys  # noqa: E402
import test_decode as decode_cases  # noqa: E402

BLOCK = 128
E4M3 = torch.float8_e4m3fn
ran = []


def expect_native(op, family="sm90"):
    torch.cuda.synchronize()
    backend = _backend.last_backend(op)
    assert backend == family, f"{op} ran on {backend}"
    ran.append(op if family == "sm90" else f"{op}[{family}]")


def to_dtype_mode(p, mode):
    """Convert the problem's q / k / v to a sparse prefill dtype mode ("bf16" or a name of
    cute_kernels.variants.FP8_MODES); returns the call's pv_dtype."""
    if mode != "bf16":
        p["k"], p["v"] = p["k"].to(E4M3), p["v"].to(E4M3)
    if mode in ("e4m3_pv_bf16", "e4m3"):
        p["q"] = p["q"].to(E4M3)
        return torch.bfloat16 if mode == "e4m3_pv_bf16" else E4M3
    return None


def sparse_prefill_cases(gen):
    """Every form of the sparse serving table on the calls it serves: "mma" (fp32 partials),
    "wgmma" (G 1-4, the bf16-Q FP8 modes), "ws", "ws3w", "wsp3w" and "wsp3we" (the
    warp-specialized TMA forms, G 8 / 16; the forms picked by call size are forced here, and
    the persistent forms also run on 3 CTAs, each taking many items from the queue)."""
    forms = set()
    for g, paged, causal, partial, mode, form in (
            (16, True, True, torch.float32, "bf16", "mma"),
            (1, False, False, torch.float32, "bf16", "mma"),
            (1, True, False, torch.bfloat16, "bf16", "wgmma"),
            (4, False, True, torch.bfloat16, "bf16_kv_e4m3", "wgmma"),
            (8, True, True, torch.bfloat16, "e4m3_pv_bf16", "wgmma"),
            (2, False, False, torch.bfloat16, "e4m3", "wgmma"),
            (4, True, True, E4M3, "bf16", "wgmma"),
            (16, True, True, E4M3, "bf16", "ws"), (8, False, True, torch.float16, "e4m3", "ws"),
            (8, True, False, torch.float16, "bf16", "ws"),
            (16, False, True, torch.bfloat16, "bf16", "ws3w"),
            (16, False, True, E4M3, "e4m3", "ws3w"), (8, True, True, E4M3, "e4m3", "ws3w"),
            (16, False, True, torch.bfloat16, "bf16", "wsp3w"),
            (16, True, False, torch.bfloat16, "bf16", "wsp3w"),
            (16, True, True, torch.bfloat16, "bf16", "wsp3w"),
            (16, False, True, torch.bfloat16, "e4m3", "wsp3we"),
            (16, True, False, torch.bfloat16, "e4m3", "wsp3we")):
        topk = 8
        p = prefill_cases._make_problem(g, topk, paged, causal, gen, torch.device("cuda"))
        q2k = p["q2k"]
        # Garbage the API cannot see without a sync: ids past the request and negative ids.
        q2k[0, 0, -1] = 1 << 20
        q2k[-1, -1, 0] = -9
        pv_dtype = to_dtype_mode(p, mode)
        if paged:
            p["page_table"][0, -1] = 1 << 24          # past the pool, beyond seqused_k's pages
        built = msa.build_k2q_csr(q2k, p["cu_q"], p["cu_k"], BLOCK, total_k=p["total_k"],
                                  max_seqlen_k=p["max_k"], max_seqlen_q=p["max_q"],
                                  qhead_per_kv=g, return_schedule=True)
        expect_native("build_k2q_csr")
        # The call-size forms (wsp3w: bf16 calls of few queries; ws3w past them) and the
        # persistent forms' stand-in ws3w are forced here whatever the random lengths add up
        # to; the paged persistent cases run on 3 CTAs.
        with debug.forcing(sparse_form=form if form in ("wsp3w", "wsp3we", "ws3w") else None,
                           persistent_ctas=3 if form.startswith("wsp") and paged else None):
            out, lse = msa.sparse_atten_func(
                p["q"], p["k"], p["v"], built[0], built[1], topk, cu_seqlens_q=p["cu_q"],
                cu_seqlens_k=p["cu_k"], max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"],
                causal=causal, softmax_scale=0.1, partial_dtype=partial,
                return_softmax_lse=True, page_table=p["page_table"],
                seqused_k=p["seqused_k"], schedule=built[2], pv_dtype=pv_dtype)
        expect_native("sparse_atten")
        ran = debug.last_variant("sparse_atten")
        assert ran.endswith(f"_{form}") or (form in ("mma", "wgmma") and
                                            not ran.endswith(("_ws", "_ws3w"))), (form, ran)
        forms.add(form)
        assert not torch.isnan(out).any()
        print(f"sparse prefill [{form}] {mode} G={g} paged={paged} causal={causal} "
              f"partial={partial}: ok")
    from msa.cute_kernels.variants import SPARSE_FORMS
    assert forms == set(SPARSE_FORMS), "a sparse form is missing from the memcheck cases"


def csr_cases(gen):
    """build_k2q_csr's two forms (the spread counting sort for small calls, the radix sort past
    its limits or forced), with and without a schedule, on ids the API cannot check without a
    sync (any int32) and a total_rows hint that drops rows."""
    device = torch.device("cuda")
    for q_lens, k_lens, total_rows in (([100, 1, 280], [5000, 130, 257], None),
                                       ([100], [2047 * BLOCK], 2047),
                                       ([1025, 3], [140000, 900], None),
                                       ([6] * 64, [3000] * 64, 30)):
        total_q = sum(q_lens)
        cu_q = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32,
                            device=device)
        cu_k = torch.tensor([0] + list(itertools.accumulate(k_lens)), dtype=torch.int32,
                            device=device)
        ids = torch.randint(-3, 2100, (4, total_q, 16), generator=gen, dtype=torch.int32)
        ids[:, ::7, 5] = torch.iinfo(torch.int32).max
        ids[:, ::5, 6] = torch.iinfo(torch.int32).min
        for schedule, counting_sort in itertools.product((True, False), (True, False)):
            with debug.forcing(csr_counting_sort=counting_sort):
                msa.build_k2q_csr(ids.to(device), cu_q, cu_k, BLOCK, total_k=sum(k_lens),
                                  max_seqlen_k=max(k_lens), max_seqlen_q=max(q_lens),
                                  total_rows=total_rows, qhead_per_kv=16,
                                  return_schedule=schedule)
            expect_native("build_k2q_csr")
            assert debug.last_variant("build_k2q_csr") == \
                ("counting_sort" if counting_sort else "radix_sort")
        torch.cuda.synchronize()
        print(f"build_k2q_csr {len(q_lens)} requests, {total_q} queries, total_rows "
              f"{total_rows}: ok")


def topk_cases(gen, family="sm90"):
    h, tiles, rows = 4, 300, 777
    scores = torch.randn(h, tiles, rows, generator=gen).cuda()
    scores[:, 200:, :5] = -float("inf")
    end = torch.randint(0, tiles, (rows,), generator=gen, dtype=torch.int32).cuda()
    for staged in (False, True):
        with debug.forcing(topk_staged=staged):
            for kw in (dict(), dict(force_begin_blocks=1, force_end_blocks=2,
                                    causal_end_block=end),
                       dict(head_reduce="max", num_out_heads=1)):
                msa.sparse_topk_select(scores, 16, **kw)
                expect_native("sparse_topk_select", family)
            assert debug.last_variant("sparse_topk_select") == \
                ("staged" if staged else "unstaged")
    # More than 64 candidates past the staged kernel's threshold (its arg-max rounds).
    scores[:, (torch.arange(tiles, device="cuda") % 32) < 16] += 100.0
    with debug.forcing(topk_staged=True):
        msa.sparse_topk_select(scores, 16)
    print(f"sparse_topk_select [{family}]: ok")


@contextlib.contextmanager
def portable_tier():
    """Dispatch to the portable tier for the block (MSA_NATIVE_TIER=portable)."""
    os.environ["MSA_NATIVE_TIER"] = "portable"
    try:
        yield
    finally:
        del os.environ["MSA_NATIVE_TIER"]


def block_max_cases(gen, family="sm90"):
    """The indexer on dense and paged keys (a page past the pool), rows past cu_seqlens_q[-1],
    unsplit and with key splits;
    family "portable": the portable tier's kernel (bf16 and e4m3) under MSA_NATIVE_TIER=portable,
    with an understated max_seqlen_q (its grid-stride loop)."""
    if family == "portable":
        with portable_tier():
            return _block_max_cases(gen, family)
    return _block_max_cases(gen, family)


def _block_max_cases(gen, family):
    q_lens, k_lens = [700, 1, 333], [900, 129, 333]
    for heads, paged, dtype in ((4, False, torch.bfloat16), (4, True, torch.bfloat16),
                                (1, True, torch.bfloat16), (8, False, torch.bfloat16),
                                (4, False, E4M3), (8, True, E4M3)):
        q = torch.randn(sum(q_lens) + 3, heads, 128, generator=gen).to(dtype).cuda()
        k = torch.randn(sum(k_lens), 1, 128, generator=gen).to(torch.bfloat16)
        cu_q = torch.tensor([0, 700, 701, 1034], dtype=torch.int32).cuda()
        cu_k = torch.tensor([0, 900, 1029, 1362], dtype=torch.int32).cuda()
        kw = dict(max_seqlen_q=700 if family == "sm90" else 5, max_seqlen_k=900, scale=0.1,
                  causal=True)
        if paged:
            pages, table = paginate_index_keys(k, k_lens, gen, torch.device("cuda"))
            table[0, -1] = 1 << 20                 # past the pool (the other junk is negative)
            args = (q, pages.to(dtype), cu_q, cu_k)
            kw.update(page_table=table, seqused_k=torch.tensor(k_lens, dtype=torch.int32).cuda())
        else:
            args = (q, k.to(dtype).cuda(), cu_q, cu_k)
        msa.block_max_scores(*args, **kw)
        expect_native("block_max_scores", family)
        # Key splits (msa.prefill's short chunks): fewer, about as many and more than the tiles.
        for splits in (3, 8, 40):
            chunk_block_max_scores(*args, key_splits=splits, **kw)
            expect_native("block_max_scores", family)
    # Decode-shaped (the decode variant: 1-4 rows per request, K tiles split across CTAs).
    k_lens = [3000, 1, 700]
    pages, table = paginate_index_keys(
        torch.randn(sum(k_lens), 1, 128, generator=gen).to(torch.bfloat16), k_lens, gen,
        torch.device("cuda"))
    q = torch.randn(9, 4, 128, generator=gen).to(torch.bfloat16).cuda()
    cu_q = torch.tensor([0, 4, 5, 9], dtype=torch.int32).cuda()
    msa.block_max_scores(q, pages, cu_q, cu_q, max_seqlen_q=4, max_seqlen_k=3000, scale=0.1,
                         causal=True, page_table=table,
                         seqused_k=torch.tensor(k_lens, dtype=torch.int32).cuda())
    expect_native("block_max_scores", family)
    print(f"block_max_scores [{family}]: ok")


def decode_run(lens, seqlen_q, group, dtypes, sparse, bad=False, family="sm90", **plan_kw):
    hkv = 2
    q_dtype, kv_dtype = decode_cases.DTYPES[dtypes]
    q, k, v, table, seqused_k = decode_cases.make_batch(lens, seqlen_q, hkv, group, q_dtype,
                                                         kv_dtype, device="cuda")
    q2k = decode_cases.random_q2k(lens, seqlen_q, hkv, 8).cuda() if sparse else None
    if bad:
        table[0, -1] = 1 << 30
        seqused_k = seqused_k.clone()
        seqused_k[0] = 1 << 30
        if q2k is not None:
            q2k[0, 0, 0] = 1 << 30
            q2k[1, 0, 1] = -5
        plan_kw.setdefault("max_seqlen_k", 4096)
    wrapper = msa.SparseDecodePagedAttentionWrapper()
    wrapper.plan(page_table=table, seqused_k=seqused_k, seqlen_q=seqlen_q,
                 max_seqlen_k=plan_kw.pop("max_seqlen_k", int(seqused_k.max()) + 1),
                 q2k_indices=q2k, num_qo_heads=hkv * group, num_kv_heads=hkv, **plan_kw)
    wrapper.run(q, k, v, return_softmax_lse=True)
    expect_native("sparse_decode_atten", family)


def decode_runs(family="sm90"):
    f = dict(family=family)
    decode_run([1, 129, 1000, 77], 1, 16, "fp8", False, fixed_split_size=1, **f)
    decode_run([1, 129, 1000, 77], 4, 4, "bf16", True, disable_split_kv=True, **f)
    decode_run([3000, 0, 640], 16, 16, "bf16q_fp8kv", True, **f)
    decode_run([1000, 500], 2, 4, "bf16", True, bad=True, enable_cuda_graph=True, **f)
    decode_run([1000, 500], 2, 4, "fp8", False, bad=True, enable_cuda_graph=True, **f)
    # Tiles of > 16 rows: the warpgroup form on SM90, the row form on the portable tier.
    decode_run([1, 129, 1000, 77], 8, 16, "bf16", True, fixed_split_size=1, **f)
    decode_run([70001, 3, 129], 8, 16, "bf16", False, **f)
    decode_run([1, 129, 1000, 77], 8, 16, "fp8", False, **f)
    decode_run([1000, 500], 8, 4, "fp8", True, bad=True, enable_cuda_graph=True, **f)
    # Query tiles of sparse multi-token decode: 16 rows (one token), 24 (a token and a half).
    decode_run([70001, 3, 129], 8, 16, "fp8", True, qo_tile_rows=16, **f)
    # The direct e4m3 form's tile ranges: 1600 one-token tiles (CTAs of 12+ tiles, one batch
    # each), then chunks of 3 slots (4x the tiles: several batches a CTA), corrupt entries too.
    lens = [(37 * i) % 2500 + 1 for i in range(100)]
    decode_run(lens, 8, 16, "fp8", True, qo_tile_rows=16, **f)
    decode_run(lens, 8, 16, "fp8", True, bad=True, enable_cuda_graph=True, qo_tile_rows=16,
               fixed_split_size=3, **f)
    decode_run([1000, 500], 8, 16, "bf16", True, bad=True, enable_cuda_graph=True,
               qo_tile_rows=24, **f)
    if family == "sm90":    # the ping-pong form (> 64 rows; one idle consumer at 32 rows)
        # fp8_pv8: the e4m3 P.V form (V transposed by the producer).
        forms = (("bf16", False), ("fp8", False), ("fp8", True))
        for dtypes, pv8 in forms:
            with debug.forcing(decode_warpgroup=True, decode_pingpong=True, decode_pv_fp8=pv8):
                decode_run([1, 129, 1000, 77], 8, 16, dtypes, True, fixed_split_size=1,
                           qo_tile_rows=128, **f)
                decode_run([70001, 3, 129], 8, 16, dtypes, False, **f)
                decode_run([1000, 500], 8, 4, dtypes, True, bad=True, enable_cuda_graph=True,
                           **f)
        # Its persistent form (dense, > 64 rows) and the merge launched after it: ragged and
        # empty requests, a request cut by many CTAs, two qo tiles, 80-row tiles, out-of-range
        # ids and a length past the table.
        for dtypes, pv8 in forms:
            with debug.forcing(decode_warpgroup=True, decode_pingpong=True,
                               decode_persistent=True, decode_pv_fp8=pv8):
                decode_run([70001, 0, 3, 129, 5000], 8, 16, dtypes, False, persistent=True, **f)
                decode_run([9000, 0, 640], 16, 16, dtypes, False, enable_cuda_graph=True,
                           persistent=True, **f)
                decode_run([3000, 17], 5, 16, dtypes, False, persistent=True, **f)
                decode_run([1000, 500], 8, 16, dtypes, False, bad=True, enable_cuda_graph=True,
                           persistent=True, **f)
        # The token-warps form (sparse e4m3 tiles of > 16 rows, pages by TMA): MTP 8 x G 16,
        # two tokens a warp (G 8), 80-row tiles, page-range chunks, a CTA range of several
        # batches, corrupt ids and a length past the table.
        for form in decode_cuda.TOKEN_WARPS_FORMS:
            with debug.forcing(decode_token_warps=form):
                decode_run([1, 129, 1000, 77], 8, 16, "fp8", True, fixed_split_size=1,
                           qo_tile_rows=128, **f)
                decode_run([70001, 0, 3, 129], 8, 8, "fp8", True, qo_tile_rows=128, **f)
                decode_run([3000, 17], 5, 16, "fp8", True, qo_tile_rows=128, **f)
                decode_run(lens * 3, 8, 16, "fp8", True, qo_tile_rows=128, **f)
                decode_run([1000, 500], 8, 16, "fp8", True, bad=True, enable_cuda_graph=True,
                           qo_tile_rows=128, **f)
    print(f"decode [{family}]: ok")


def decode_indexer_runs(family="sm90"):
    """The fused decode indexer + top-k: bf16 / e4m3 / NVFP4 (both scale layouts) keys, MTP
    rows (17-32 rows with and without the offer warp), many-chunk merges (rounds and
    butterfly), out-of-range page ids and lengths past the table."""
    import test_decode_indexer as indexer_cases
    for fmt, layout, seqlen_q, heads, topk, ctas, offer_warp, butterfly in (
            ("bf16", "128x4", 1, 4, 16, None, False, False),
            ("e4m3", "128x4", 8, 4, 16, 5, False, False),
            ("e4m3", "128x4", 8, 4, 16, 5, True, True),
            ("bf16", "128x4", 5, 4, 32, None, True, False),
            ("e4m3", "128x4", 8, 4, 32, 600, False, True),
            ("nvfp4", "128x4", 16, 8, 32, None, False, True),
            ("nvfp4", "linear", 3, 2, 4, 600, False, False)):
        inputs, _ = indexer_cases.make_index_batch([1, 129, 5000, 77, 300], seqlen_q, heads, fmt,
                                                   device="cuda", layout=layout)
        inputs["page_table"][2, 1] = 1 << 30
        inputs["seqused_k"][3] = 1 << 30
        plan = msa.make_decode_indexer_plan(inputs["seqused_k"], seqlen_q=seqlen_q,
                                            num_index_heads=heads, topk=topk, max_seqlen_k=5001,
                                            max_ctas=ctas)
        args = {k: v for k, v in inputs.items() if k != "seqused_k"}
        with debug.forcing(decode_indexer_offer_warp=offer_warp,
                           decode_indexer_butterfly_merge=butterfly):
            msa.decode_indexer_topk(plan=plan, return_scores=True, **args)
        expect_native("decode_indexer_topk", family)
        expect_native("decode_indexer_plan_update", family)
    print(f"decode_indexer [{family}]: ok")


def csrc_portable_cases(gen):
    """The csrc ops the portable tier shares with SM90, forced onto it (MSA_NATIVE_TIER=
    portable): a CSR + schedule build over garbage ids, then the top-k, decode and decode
    indexer cases above."""
    with portable_tier():
        p = prefill_cases._make_problem(16, 8, True, True, gen, torch.device("cuda"))
        p["q2k"][0, 0, -1] = 1 << 20
        p["q2k"][-1, -1, 0] = -9
        for schedule in (True, False):
            msa.build_k2q_csr(p["q2k"], p["cu_q"], p["cu_k"], BLOCK, total_k=p["total_k"],
                              max_seqlen_k=p["max_k"], max_seqlen_q=p["max_q"], qhead_per_kv=16,
                              return_schedule=schedule)
            expect_native("build_k2q_csr", "portable")
        topk_cases(gen, "portable")
        decode_runs("portable")
        decode_indexer_runs("portable")


def fmha_cases(gen):
    """Dense FMHA: dense and paged K/V, causal with an offset that leaves early rows empty;
    O-only calls once per O-only form of the serving table (bf16 wsu / wsup, e4m3 wsuts /
    wsutps), forced through the fmha_form debug hook; bf16 O + max-score; a split-KV plan."""
    from msa.cute_kernels.variants import FMHA_FORMS
    forms = {dtype: [name for name, form in FMHA_FORMS.items() if dtype in form.dtypes
                     and form.kernel == "FmhaSm90Ws"] for dtype in ("bfloat16", "e4m3")}
    for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("e4m3", torch.float8_e4m3fn)):
        for form in forms[dtype_name]:
            # Split-KV pinned off: the planner would split these small plans, and the split
            # form (its own case below) would then run instead of the form named here.
            with debug.forcing(fmha_form=form, fmha_split_kv=False):
                _fmha_o_cases(gen, dtype, with_max_score=form == forms[dtype_name][0]
                              and dtype == torch.bfloat16)
    _fmha_split_kv_case(gen)
    listed = ", ".join(f"{d}: {'/'.join(f)}" for d, f in forms.items())
    print(f"fmha: ok (forms {listed}; split-KV)")


def _fmha_inputs(gen, q_lens, kv_lens, dtype):
    """Random q [sum q_lens, 8, 128], k / v [sum kv_lens, 2, 128] of `dtype`, on the CPU."""
    draw = lambda n, h: torch.randn(n, h, 128, generator=gen).to(dtype)   # noqa: E731
    return draw(sum(q_lens), 8), draw(sum(kv_lens), 2), draw(sum(kv_lens), 2)


def _fmha_split_kv_case(gen):
    """A decode-like plan forced to 3 key splits (the split-KV kernel + the combine), paged."""
    from test_fmha import to_pages
    q_lens, kv_lens = [1, 33], [1500, 900]
    q, k, v = _fmha_inputs(gen, q_lens, kv_lens, torch.bfloat16)
    dev = torch.device("cuda")
    k_in, v_in, kv_indices, _ = to_pages(k, v, kv_lens, 128, gen)
    plan = msa.fmha_plan(torch.tensor(q_lens), torch.tensor(kv_lens), 8, 2, page_size=128,
                         num_kv_splits=3, device=dev)
    msa.fmha(q.to(dev), k_in.to(dev), v_in.to(dev), plan, output_maxscore=False,
             kv_indices=kv_indices.to(dev))
    expect_native("fmha_dense")
    assert debug.last_variant("fmha_dense").endswith("_split"), debug.last_variant("fmha_dense")


def _fmha_o_cases(gen, dtype, with_max_score):
    """O-only (and, with_max_score, O + max-score) calls on dense and paged K/V; e4m3 covers
    the V transpose op into the key-permuted V^T ahead of the kernel. The last request's offset (256) starts its query tiles on key blocks
    (its last tile's diagonal block also holds the kv_len tail)."""
    from test_fmha import to_pages
    q_lens, kv_lens = [1, 130, 300, 260], [200, 129, 900, 516]
    q, k, v = _fmha_inputs(gen, q_lens, kv_lens, dtype)
    dev = torch.device("cuda")
    for paged in (False, True):
        kw, k_in, v_in = {}, k, v
        if paged:
            k_in, v_in, kv_indices, _ = to_pages(k, v, kv_lens, 128, gen)
            kw["kv_indices"] = kv_indices.to(dev)
        for max_score in (False, True) if with_max_score else (False,):
            # O + max-score (mode 1): the max-score rows of every streamed block are written.
            plan = msa.fmha_plan(torch.tensor(q_lens), torch.tensor(kv_lens), 8, 2,
                                 qo_offset=torch.tensor([199, -5, 600, 256]),
                                 output_maxscore=max_score,
                                 page_size=128 if paged else -1, device=dev)
            msa.fmha(q.to(dev), k_in.to(dev), v_in.to(dev), plan, output_maxscore=max_score,
                     **kw)
            expect_native("fmha_dense")


def prefill_production_cases(gen):
    """msa.prefill's glue around the native ops: the paged wrapper in query chunks with the
    indexer's key splits (page-table columns past each request's pages hold out-of-range ids), and
    msa_prefill in query chunks (zero-query gap requests)."""
    dev = torch.device("cuda")
    draw = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16).to(dev)  # noqa
    q_lens, k_lens = (171, 5, 900), (9000, 700, 900)
    pages = [-(-n // BLOCK) for n in k_lens]
    n_pages = sum(pages)
    table = torch.full((len(pages), max(pages) + 2), n_pages + 7, dtype=torch.int32)
    perm = torch.randperm(n_pages, generator=gen).to(torch.int32)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = perm[start:start + count]
        start += count
    wrapper = msa.MsaPrefillPagedWrapper().plan(q_lens, k_lens, table.to(dev), num_qo_heads=64,
                                               num_kv_heads=4, max_chunk_tokens=256)
    assert max(wrapper.index_splits) > 1
    wrapper.run(draw(sum(q_lens), 64, 128), draw(n_pages, 4, BLOCK, 128),
                draw(n_pages, 4, BLOCK, 128), draw(sum(q_lens), 4, 128),
                draw(n_pages, 1, BLOCK, 128), return_lse=True)
    expect_native("block_max_scores")
    expect_native("sparse_atten")
    q_lens, k_lens = (1100, 300), (1100, 5000)
    cu_q = torch.tensor([0, 1100, 1400], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 1100, 6100], dtype=torch.int32, device=dev)
    msa.msa_prefill(draw(1400, 64, 128), draw(6100, 4, 128), draw(6100, 4, 128),
                    draw(1400, 4, 128), draw(6100, 1, 128), cu_q, cu_k, max_seqlen_q=1100,
                    max_seqlen_k=5000, workspace_bytes=1)
    expect_native("sparse_atten")


def sparse_prefill_portable_cases(gen):
    """The portable tier's sparse prefill (docs/design-portable.md), forced with
    MSA_NATIVE_TIER=portable: bf16 and the three FP8 modes (e4m3 K / V through registers, e4m3
    Q tiles widened per warp), dense / paged, both tiles' head groups, fp32 / bf16 / fp16 / e4m3
    partials, the garbage ids and pages of sparse_prefill_cases, then a schedule whose every
    index is out of range (heads, rows, requests, entries past the CSR, slots past the
    partials, a q_count of 2^30): the kernels must skip all of it."""
    for g, paged, causal, partial, mode in ((16, True, True, torch.float32, "bf16"),
                                            (1, False, False, torch.bfloat16, "bf16"),
                                            (4, True, False, torch.float16, "bf16"),
                                            (8, False, True, torch.bfloat16, "bf16"),
                                            (2, True, True, E4M3, "bf16"),
                                            (4, True, True, torch.bfloat16, "bf16_kv_e4m3"),
                                            (16, False, False, torch.float16, "e4m3_pv_bf16"),
                                            (8, True, False, E4M3, "e4m3"),
                                            (1, False, True, torch.bfloat16, "e4m3")):
        topk = 8
        p = prefill_cases._make_problem(g, topk, paged, causal, gen, torch.device("cuda"))
        pv_dtype = to_dtype_mode(p, mode)
        p["q2k"][0, 0, -1] = 1 << 20
        p["q2k"][-1, -1, 0] = -9
        if paged:
            p["page_table"][0, -1] = 1 << 24
        built = msa.build_k2q_csr(p["q2k"], p["cu_q"], p["cu_k"], BLOCK, total_k=p["total_k"],
                                  max_seqlen_k=p["max_k"], max_seqlen_q=p["max_q"],
                                  qhead_per_kv=g, return_schedule=True)
        expect_native("build_k2q_csr")
        schedule = built[2]
        bad = dataclasses.replace(
            schedule, scheduler_metadata=schedule.scheduler_metadata.clone(),
            qsplit_indices=schedule.qsplit_indices.clone())
        meta = bad.scheduler_metadata
        if meta.shape[0] >= 6:
            meta[0, 0] = 1 << 20                       # KV head
            meta[1, 1] = -3                            # CSR row
            meta[2, 4] = 77                            # request
            meta[3, 2] = 1 << 29                       # q_begin past the entries
            meta[4, 3] = 1 << 30                       # q_count
            meta[5, 5] = -1                            # KV block
        bad.qsplit_indices[0, :4] = 5 | (100 << 24)    # slots past the partials
        bad.qsplit_indices[-1, :4] = (1 << 24) - 1     # query past every request
        for sched in (schedule, bad):
            with portable_tier():
                out, lse = msa.sparse_atten_func(
                    p["q"], p["k"], p["v"], built[0], built[1], topk, cu_seqlens_q=p["cu_q"],
                    cu_seqlens_k=p["cu_k"], max_seqlen_q=p["max_q"], max_seqlen_k=p["max_k"],
                    causal=causal, softmax_scale=0.1, partial_dtype=partial,
                    return_softmax_lse=True, page_table=p["page_table"],
                    seqused_k=p["seqused_k"], schedule=sched, pv_dtype=pv_dtype)
                expect_native("sparse_atten", "portable")
            assert debug.last_variant("sparse_atten") == "sparse_prefill_portable"
            if sched is schedule:
                assert not torch.isnan(out).any()
        print(f"sparse prefill [portable] {mode} G={g} paged={paged} causal={causal} "
              f"partial={partial}: ok (and a garbage schedule)")


def malformed_cases(seed):
    """The bad-input table's native cases that launch kernels, unchecked (see the docstring)."""
    import bad_input_table as table
    os.environ["MSA_CHECK_INPUTS"] = "0"
    kinds = (table.Invalid, table.Skip, table.NonFinite, table.Same)
    fns = [f for f in os.environ.get("MSA_SANITIZE_FNS", "").split(",") if f]
    count = 0
    for case in table.CASES:
        if not case.ops or not isinstance(case.expect, kinds):
            continue
        if fns and not any(case.fn == f or case.fn.startswith(f + ".") for f in fns):
            continue
        made = case.make(torch.device("cuda"), torch.Generator().manual_seed(seed))
        made.call()
        if made.clean is not None:
            made.clean()
        torch.cuda.synchronize()
        ran.extend(case.ops)
        count += 1
    print(f"malformed: {count} bad-input table cases ok")


if __name__ == "__main__":
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator().manual_seed(seed)
    sections = {"sparse_prefill": lambda: sparse_prefill_cases(generator),
                "csr": lambda: csr_cases(generator),
                "sparse_prefill_portable": lambda: sparse_prefill_portable_cases(generator),
                "topk": lambda: topk_cases(generator),
                "block_max": lambda: block_max_cases(generator),
                "block_max_portable": lambda: block_max_cases(generator, "portable"),
                "decode": decode_runs,
                "decode_indexer": decode_indexer_runs,
                "csrc_portable": lambda: csrc_portable_cases(generator),
                "fmha": lambda: fmha_cases(generator),
                "prefill_production": lambda: prefill_production_cases(generator),
                "malformed": lambda: malformed_cases(seed)}
    # MSA_SANITIZE_ONLY="fmha,decode" runs those sections only (memcheck of one new kernel
    # without the ~400 s of the whole set).
    only = [name for name in os.environ.get("MSA_SANITIZE_ONLY", "").split(",") if name]
    unknown = sorted(set(only) - set(sections))
    if unknown:
        raise SystemExit(f"MSA_SANITIZE_ONLY: unknown sections {unknown}; known {list(sections)}")
    for name, run_section in sections.items():
        if not only or name in only:
            run_section()
    print("ran natively:", sorted(set(ran)))
