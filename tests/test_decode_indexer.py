"""The fused decode indexer + top-k (msa.decode_indexer_topk), its plan and the decode step
wrapper, on the CPU (the reference backend) against an independent float64 oracle; NVFP4 index
keys against the package's own quantizer and dequantizer. The GPU file
(tests/test_decode_indexer_gpu.py) holds the native kernel to the same oracle."""

from __future__ import annotations

import random

import pytest
import torch

import msa
from msa import _backend
from msa.decode_indexer import plan_work_split

P = 128
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Inputs and the float64 oracle (dense gather, Python ranking)
# ---------------------------------------------------------------------------------------------

def make_index_batch(lens, seqlen_q, heads, fmt, *, spare=3, device="cpu", layout="128x4"):
    """Random index queries / keys, a shuffled page table (unused columns -1). fmt: "bf16",
    "e4m3" or "nvfp4" (quantized from bf16 by msa.quantize). Returns a dict of inputs plus
    "keys": the exact key values [pages, 128, 128] float64 the oracle uses."""
    batch = len(lens)
    width = max(max(-(-n // P) for n in lens), 1) + 1
    pages = batch * width + spare
    table = torch.randperm(pages)[: batch * width].view(batch, width).to(torch.int32)
    for b, n in enumerate(lens):
        table[b, -(-n // P):] = -1
    raw = torch.randn(pages, 1, P, 128)
    q = torch.randn(batch * seqlen_q, heads, 128)
    inputs = dict(page_table=table, seqused_k=torch.tensor(lens, dtype=torch.int32))
    if fmt == "nvfp4":
        quant = msa.quantize_bf16_to_nvfp4_128x4(raw.to(BF16))
        exact = msa.dequantize_nvfp4_128x4_to_bf16(quant, include_global_scale=False)
        keys = exact.double()[:, 0] * quant.global_scale.double()
        scale = quant.scale_128x4.reshape(-1)
        if layout == "linear":
            from msa.reference.decode_indexer import nvfp4_scale_offsets
            rows = torch.arange(pages * P)
            scale = scale[nvfp4_scale_offsets(rows, "128x4")].contiguous()   # [rows, 8]
        inputs.update(k_idx=quant.data, k_scale=scale, k_global_scale=quant.global_scale,
                      k_scale_layout=layout, q_idx=q.to(FP8))
    else:
        dtype = BF16 if fmt == "bf16" else FP8
        inputs.update(k_idx=raw.to(dtype), q_idx=q.to(dtype))
        keys = inputs["k_idx"].double()[:, 0]
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    return inputs, keys


def oracle(inputs, keys, seqlen_q, topk, scale=1.0):
    """float64 selection [H, B * Q, topk] and scores {(h, row, block): score}."""
    q = inputs["q_idx"].double().cpu()
    table = inputs["page_table"].cpu().long()
    lens = inputs["seqused_k"].cpu().tolist()
    heads = q.shape[1]
    out = torch.full((heads, q.shape[0], topk), -1, dtype=torch.int32)
    scores = {}
    for b, n in enumerate(lens):
        for i in range(seqlen_q):
            row = b * seqlen_q + i
            pos = n - seqlen_q + i
            own = pos // P if pos >= 0 else -1
            for h in range(heads):
                cand = []
                for blk in range(max(own, 0)):
                    s = (keys[int(table[b, blk])] @ q[row, h]).max().item() * scale
                    scores[h, row, blk] = s
                    cand.append((-s, blk))
                chosen = [blk for _s, blk in sorted(cand)[: topk - 1]]
                if own >= 0:
                    chosen.append(own)
                out[h, row, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out, scores


def ranked(scores_row, own, topk):
    """The contract's selection from one row's scores: topk - 1 best finite-or-+inf, ties to
    the lower id, then own."""
    cand = [(-float(s), i) for i, s in enumerate(scores_row.tolist())
            if s == s and s != float("-inf")]
    chosen = [i for _s, i in sorted(cand)[: topk - 1]]
    if own >= 0:
        chosen.append(own)
    return chosen + [-1] * (topk - len(chosen))


def own_blocks(inputs, seqlen_q):
    width = inputs["page_table"].shape[1]
    owns = []
    for n in inputs["seqused_k"].cpu().tolist():
        n = min(max(n, 0), width * P)
        owns += [(n - seqlen_q + i) // P if n - seqlen_q + i >= 0 else -1
                 for i in range(seqlen_q)]
    return owns


def check_selection(inputs, keys, seqlen_q, topk, out, scores, *, score_tol):
    """The selection contract against the float64 oracle, tie-aware: every candidate (and
    nothing else) scored within score_tol (relative, absolute below 1); the selection exactly
    the ranking of the call's own scores (ties to the lower id, then the own block); and the
    oracle's selection up to scores within 4 score_tol of its threshold (exact ties in the
    oracle's arithmetic fall either way in fp32)."""
    want, want_scores = oracle(inputs, keys, seqlen_q, topk)
    heads, rows = want.shape[0], want.shape[1]
    # 1. Block scores: every candidate (and nothing else) scored, within fp32 accumulation error.
    assert int(torch.isfinite(scores).sum()) == len(want_scores)
    for (h, r, blk), value in want_scores.items():
        got = float(scores[h, r, blk])
        assert abs(got - value) <= score_tol * max(1.0, abs(value)), ((h, r, blk), got, value)
    # 2. The selection is exactly the ranking of the kernel's own scores.
    owns = own_blocks(inputs, seqlen_q)
    for h in range(heads):
        for r in range(rows):
            assert out[h, r].tolist() == ranked(scores[h, r], owns[r], topk), (h, r)
    # 3. ... which is the oracle's up to near-ties.
    for h in range(heads):
        for r in range(rows):
            got, exp = out[h, r], want[h, r]
            assert int((got >= 0).sum()) == int((exp >= 0).sum()), (h, r, got, exp)
            hist_got = got[got >= 0][:-1].tolist()
            hist_exp = exp[exp >= 0][:-1].tolist()
            if not hist_exp:
                continue
            threshold = min(want_scores[h, r, b] for b in hist_exp)
            tol = 4 * score_tol * max(1.0, abs(threshold))
            assert all(want_scores[h, r, b] >= threshold - tol for b in hist_got), (h, r)
            must = [b for b in hist_exp if want_scores[h, r, b] > threshold + tol]
            assert set(must) <= set(hist_got), (h, r)


def run_indexer(inputs, seqlen_q, heads, topk, **kw):
    plan = msa.make_decode_indexer_plan(inputs["seqused_k"], seqlen_q=seqlen_q,
                                        num_index_heads=heads, topk=topk,
                                        max_seqlen_k=int(inputs["seqused_k"].max()) + 1)
    args = {k: v for k, v in inputs.items() if k not in ("seqused_k",)}
    return msa.decode_indexer_topk(plan=plan, **args, **kw)


def make_attention_inputs(inputs, seqlen_q, hkv, group):
    """Random q [B * seqlen_q, Hkv * G, 128] and paged K / V [pages, Hkv, 128, 128] of the index
    batch's dtype (bf16 or e4m3) and pool, for the step's attention."""
    dtype, device = inputs["k_idx"].dtype, inputs["k_idx"].device
    pages, batch = inputs["k_idx"].shape[0], inputs["seqused_k"].numel()
    k = torch.randn(pages, hkv, P, 128, device=device).to(dtype)
    v = torch.randn(pages, hkv, P, 128, device=device).to(dtype)
    q = torch.randn(batch * seqlen_q, hkv * group, 128, device=device).to(dtype)
    return q, k, v


LENS = [1, 129, 1000, 256, 77, 2050]


# ---------------------------------------------------------------------------------------------
# Reference vs oracle
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["bf16", "e4m3", "nvfp4"])
@pytest.mark.parametrize("seqlen_q,heads", [(1, 4), (8, 1), (3, 2)])
@pytest.mark.parametrize("topk", [4, 16])
def test_selection_matches_float64_oracle(seed, fmt, seqlen_q, heads, topk):
    inputs, keys = make_index_batch(LENS, seqlen_q, heads, fmt)
    out, scores = run_indexer(inputs, seqlen_q, heads, topk, return_scores=True)
    assert _backend.last_backend("decode_indexer_topk") == "reference"
    check_selection(inputs, keys, seqlen_q, topk, out, scores, score_tol=1e-4)


def test_nvfp4_linear_scale_layout_gives_the_same_selection(seed):
    lens, seqlen_q, heads, topk = [900, 3000], 2, 2, 8
    torch.manual_seed(seed)
    tiled, keys = make_index_batch(lens, seqlen_q, heads, "nvfp4")
    torch.manual_seed(seed)
    linear, _ = make_index_batch(lens, seqlen_q, heads, "nvfp4", layout="linear")
    a, scores = run_indexer(tiled, seqlen_q, heads, topk, return_scores=True)
    assert torch.equal(a, run_indexer(linear, seqlen_q, heads, topk))
    check_selection(tiled, keys, seqlen_q, topk, a, scores, score_tol=1e-4)


def test_nvfp4_dequantization_is_the_package_dequantizer(seed):
    raw = torch.randn(5, 1, P, 128).to(BF16)
    quant = msa.quantize_bf16_to_nvfp4_128x4(raw)
    ours = msa.reference.decode_indexer.dequantize_index_pages(
        quant.data, torch.tensor([4, 0, 2]), k_scale=quant.scale_128x4,
        k_global_scale=quant.global_scale, compute_dtype=torch.float64)
    theirs = msa.dequantize_nvfp4_128x4_to_bf16(quant, include_global_scale=False).double()
    theirs = theirs[[4, 0, 2], 0] * quant.global_scale.double()
    assert torch.equal(ours, theirs)


def test_contract_structure_ties_and_short_requests():
    """Equal scores break towards the lower block id; the own block is last among the valid
    ids; rows that see no history get only their own block; a request shorter than seqlen_q
    has rows with no block at all."""
    lens, seqlen_q, heads, topk = [5 * P + 3, 2], 4, 1, 4
    inputs, _ = make_index_batch(lens, seqlen_q, heads, "bf16")
    inputs["k_idx"].fill_(1.0)                      # every block scores the same
    out = run_indexer(inputs, seqlen_q, heads, topk)
    assert out[0, 0].tolist() == [0, 1, 2, 4]          # position 639: 3 lowest ids, own block 4
    assert out[0, 1].tolist() == [0, 1, 2, 5]          # position 640: own block 5
    assert out[0, 4].tolist() == [-1, -1, -1, -1]      # position -2: nothing
    assert out[0, 5].tolist() == [-1, -1, -1, -1]
    assert out[0, 6].tolist() == [0, -1, -1, -1]       # position 0: its own block only


def test_out_head_repeat_and_preallocated_out(seed):
    lens, seqlen_q, heads, topk = [700, 300], 2, 2, 8
    inputs, keys = make_index_batch(lens, seqlen_q, heads, "e4m3")
    out = torch.full((heads * 2, len(lens) * seqlen_q, topk), 7, dtype=torch.int32)
    got, scores = run_indexer(inputs, seqlen_q, heads, topk, out=out, return_scores=True)
    assert got is out
    once = out[::2]                                 # rows h * 2 + repeat
    check_selection(inputs, keys, seqlen_q, topk, once, scores, score_tol=1e-4)
    assert torch.equal(out, once.repeat_interleave(2, dim=0))


def test_bad_arguments_name_themselves():
    inputs, _ = make_index_batch([300], 2, 1, "bf16")
    plan = msa.make_decode_indexer_plan(inputs["seqused_k"], seqlen_q=2, num_index_heads=1,
                                        max_seqlen_k=300)
    base = dict(q_idx=inputs["q_idx"], k_idx=inputs["k_idx"], plan=plan,
                page_table=inputs["page_table"])
    with pytest.raises(TypeError, match="^plan"):
        msa.decode_indexer_topk(**dict(base, plan=object()))
    with pytest.raises(TypeError, match="^q_idx"):
        msa.decode_indexer_topk(**dict(base, q_idx=base["q_idx"].half()))
    with pytest.raises(ValueError, match="^q_idx"):
        msa.decode_indexer_topk(**dict(base, q_idx=base["q_idx"][:1]))
    with pytest.raises(ValueError, match="^k_idx"):
        msa.decode_indexer_topk(**dict(base, k_idx=base["k_idx"].expand(-1, 2, -1, -1)
                                       .contiguous()))
    with pytest.raises(ValueError, match="^k_scale"):
        msa.decode_indexer_topk(**dict(base, k_idx=torch.zeros(3, 1, P, 64, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="^k_scale"):
        msa.decode_indexer_topk(**base, k_scale=torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="^out"):
        msa.decode_indexer_topk(**base, out=torch.zeros(1, 2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="^scale"):
        msa.decode_indexer_topk(**base, scale=0.0)
    with pytest.raises(ValueError, match="^k_scale_layout"):
        msa.decode_indexer_topk(**base, k_scale_layout="tiled")
    with pytest.raises(NotImplementedError, match="^seqlen_q"):
        msa.make_decode_indexer_plan(inputs["seqused_k"], seqlen_q=17, num_index_heads=1,
                                     max_seqlen_k=300)
    with pytest.raises(NotImplementedError, match="^num_index_heads"):
        msa.make_decode_indexer_plan(inputs["seqused_k"], seqlen_q=16, num_index_heads=16,
                                     max_seqlen_k=300)
    with pytest.raises(ValueError, match="^topk"):
        msa.make_decode_indexer_plan(inputs["seqused_k"], seqlen_q=1, num_index_heads=1,
                                     max_seqlen_k=300, topk=12)


# ---------------------------------------------------------------------------------------------
# The plan's work split (host logic the native update kernel mirrors)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lens,capacity", [([1, 129, 100000, 0, 257], 40), ([200000], 265),
                                           ([4000] * 128, 392), ([1] * 7, 8)])
def test_work_split_covers_every_history_block_once(lens, capacity):
    work, requests, chunk = plan_work_split(lens, capacity)
    assert chunk >= 4
    assert int(requests[:, 1].sum()) <= capacity
    for b, n in enumerate(lens):
        history = (n - 1) // P if n > 0 else 0
        first, count = int(requests[b, 0]), int(requests[b, 1])
        assert count == max(1, -(-history // chunk))
        assert work[first:first + count, 0].tolist() == [b] * count
        assert work[first:first + count, 1].tolist() == list(range(count))
        covered = []
        for c in range(count):   # the kernel's ranges: the last chunk runs to the end
            end = history if c == count - 1 else min((c + 1) * chunk, history)
            covered += list(range(min(c * chunk, history), end))
        assert covered == list(range(history))
    assert (work[int(requests[:, 1].sum()):] == -1).all()


def test_work_split_takes_the_fewest_waves_times_pages():
    """A few work items past a wave of CTAs cost a whole chunk's time: with fewer requests than
    CTAs the chunk length minimizes ceil(items / spread) x chunk over every chunk length whose
    items fit the work array (brute force), e.g. ragged requests around 100k keys take one
    wave instead of one wave plus a few items."""
    rng = random.Random(20261203)
    cases = [([100000 + rng.randrange(-20000, 20000) for _ in range(32)], 264 + 32),
             ([4000 + rng.randrange(-900, 900) for _ in range(128)], 264 + 128)]
    for _ in range(60):
        batch = rng.randrange(1, 12)
        cases.append(([rng.randrange(0, 40 * P) for _ in range(batch)],
                      batch + rng.randrange(batch + 1, 30)))
    for lens, capacity in cases:
        history = [(n - 1) // P if n > 0 else 0 for n in lens]
        spread = capacity - len(lens)

        def items(c):
            return sum(max(1, -(-h // c)) for h in history)

        def cost(c):
            return -(-items(c) // spread) * c

        _, requests, chunk = plan_work_split(lens, capacity)
        assert int(requests[:, 1].sum()) == items(chunk) <= capacity
        best = min(cost(c) for c in range(4, max(history + [4]) + 1) if items(c) <= capacity)
        assert cost(chunk) == best, (lens, capacity, chunk)
    # The first case: one wave of 264 CTAs (the plain split ceil(total / 264) needs 2).
    _, requests, _ = plan_work_split(*cases[0])
    assert int(requests[:, 1].sum()) <= 264


def test_plan_update_follows_new_lengths():
    lens = torch.tensor([1000, 5], dtype=torch.int32)
    plan = msa.make_decode_indexer_plan(lens, seqlen_q=1, num_index_heads=1, max_seqlen_k=10**6,
                                        max_ctas=16)
    before = plan.requests.clone()
    lens.copy_(torch.tensor([900000, 5], dtype=torch.int32))
    plan.update()
    work, requests, chunk = plan_work_split(lens.tolist(), plan.capacity)
    assert torch.equal(plan.requests, requests) and torch.equal(plan.work, work)
    assert int(plan.chunk_pages) == chunk and not torch.equal(before, plan.requests)


# ---------------------------------------------------------------------------------------------
# The step wrapper
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["bf16", "e4m3"])
def test_step_wrapper_is_indexer_then_sparse_attention(seed, fmt):
    lens, seqlen_q, hkv, group, topk = [1000, 129, 300], 2, 2, 4, 4
    inputs, _keys = make_index_batch(lens, seqlen_q, hkv, fmt)
    q, k, v = make_attention_inputs(inputs, seqlen_q, hkv, group)
    step = msa.MSADecodeStepWrapper().plan(
        page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=seqlen_q,
        max_seqlen_k=1000, num_qo_heads=hkv * group, num_kv_heads=hkv, topk=topk)
    out, lse = step.update().run(q, k, v, inputs["q_idx"], inputs["k_idx"],
                                 return_softmax_lse=True)
    # The step's selection is the indexer's (checked against the float64 oracle above).
    selection = run_indexer(inputs, seqlen_q, hkv, topk)
    assert torch.equal(step.q2k_indices, selection)
    attention = msa.SparseDecodePagedAttentionWrapper().plan(
        page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=seqlen_q,
        max_seqlen_k=1000, q2k_indices=selection, num_qo_heads=hkv * group, num_kv_heads=hkv,
        enable_cuda_graph=True)
    assert torch.equal(out, attention.run(q, k, v))


@pytest.mark.parametrize("fmt", ["bf16", "e4m3"])
def test_step_wrapper_selects_every_block_of_short_requests(seed, fmt):
    """Requests of at most topk blocks: every visible block is selected whatever the scores, so
    the step writes that selection without scoring (ascending, the own block last, rows without
    keys all -1) and attends densely: its O is exactly the dense plan's, and sparse attention
    over the oracle's selection to the contract (float64 oracle; the two orders of summation
    may round one bf16 ulp apart)."""
    from test_decode import check_against_oracle, oracle as attention_oracle
    lens, seqlen_q, hkv, group, topk = [512, 129, 2, 300], 3, 2, 4, 4
    inputs, keys = make_index_batch(lens, seqlen_q, hkv, fmt)
    q, k, v = make_attention_inputs(inputs, seqlen_q, hkv, group)
    plan = dict(page_table=inputs["page_table"], seqused_k=inputs["seqused_k"],
                seqlen_q=seqlen_q, num_qo_heads=hkv * group, num_kv_heads=hkv, topk=topk)
    assert not msa.MSADecodeStepWrapper().plan(**plan, max_seqlen_k=topk * P + 1) \
        .selects_every_block
    step = msa.MSADecodeStepWrapper().plan(**plan, max_seqlen_k=topk * P)
    assert step.selects_every_block
    step.q2k_indices.fill_(7)                       # poisoned: every slot must be written
    out, lse = step.update().run(q, k, v, inputs["q_idx"], inputs["k_idx"],
                                 return_softmax_lse=True)
    selection = oracle(inputs, keys, seqlen_q, topk)[0]
    for h in range(hkv):
        for row in range(len(lens) * seqlen_q):
            got, want = step.q2k_indices[h, row].tolist(), selection[h, row].tolist()
            count = sum(i >= 0 for i in want)
            if count:   # the same blocks, history ascending, the own block last
                assert got[:count] == sorted(want[:count - 1]) + [want[count - 1]]
            assert got[count:] == [-1] * (topk - count)
    dense = msa.SparseDecodePagedAttentionWrapper().plan(
        page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=seqlen_q,
        max_seqlen_k=topk * P, num_qo_heads=hkv * group, num_kv_heads=hkv,
        enable_cuda_graph=True)
    torch.testing.assert_close(out, dense.run(q, k, v), rtol=0, atol=0)
    ref_out, ref_lse = attention_oracle(q, k, v, inputs["page_table"], inputs["seqused_k"],
                                        seqlen_q, selection)
    check_against_oracle(out, lse, ref_out, ref_lse, fp8_pv=q.dtype == torch.float8_e4m3fn)


def test_step_wrapper_shares_one_plan_and_checks_it():
    inputs, _ = make_index_batch([600, 900], 1, 1, "bf16")
    step = msa.MSADecodeStepWrapper().plan(
        page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=1,
        max_seqlen_k=900, num_qo_heads=16, num_kv_heads=4, num_index_heads=1)
    other = msa.MSADecodeStepWrapper().plan(
        page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=1,
        max_seqlen_k=900, num_qo_heads=16, num_kv_heads=4, num_index_heads=1,
        indexer_plan=step.indexer_plan)
    assert other.indexer_plan is step.indexer_plan
    with pytest.raises(ValueError, match="^indexer_plan"):
        msa.MSADecodeStepWrapper().plan(
            page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=2,
            max_seqlen_k=900, num_qo_heads=16, num_kv_heads=4, num_index_heads=1,
            indexer_plan=step.indexer_plan)
    with pytest.raises(ValueError, match="^num_index_heads"):
        msa.MSADecodeStepWrapper().plan(
            page_table=inputs["page_table"], seqused_k=inputs["seqused_k"], seqlen_q=1,
            max_seqlen_k=900, num_qo_heads=16, num_kv_heads=4, num_index_heads=3)
    with pytest.raises(RuntimeError, match="^run"):
        msa.MSADecodeStepWrapper().run(None, None, None, None, None)
