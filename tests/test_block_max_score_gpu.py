"""Native indexer block max-scores against a float64 reference: the SM90 CuTe-DSL wgmma kernel,
and (the cases with a `tier` parameter) the portable tier's csrc kernel, forced on any GPU.

Every case runs with MSA_BACKEND=native (a fallback raises) and checks
msa._backend.last_backend ("sm90", or "portable").

Checks per case, on fresh random varlen inputs (lengths not multiples of 128, requests with
q_len > k_len whose early rows see nothing, an empty request, rows past cu_seqlens_q[-1] that no
request owns): the output is poisoned with NaN first, so every element must be written; the
-inf pattern equals the reference's exactly; finite values satisfy
    |native - ref64| <= 1e-2 * max(|ref64|, scale * sqrt(128))
(the relative error bound of the brief; scale * sqrt(128) is the typical |q.k| of these unit
normal inputs, which keeps near-zero maxima from making the relative error meaningless).

Benchmark mode (GPU): python tests/test_block_max_score_gpu.py --bench
  prints TFLOP/s = 2 * H * 128 * (causally visible pairs) / time of the native kernel and of
  the naive torch indexer (einsum score matrix + causal mask + 128-block max) at N = 8k, 32k.
"""

import math
import os
import sys

import pytest
import torch

if __name__ == "__main__":   # benchmark mode: import the package from the source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "torch-ext"))
import msa
from msa import _backend
from msa.indexer import chunk_block_max_scores
from msa.reference.max_score import block_max_scores_reference
from msa_testing import compiled_variant_with, cu_seqlens, nan_tensor, use_tier

BLOCK = 128
HEAD_DIM = 128


def _record_launches(native, monkeypatch):
    """The list the names of the launched CuTe variants are appended to."""
    launched = []
    real_launch = native.cute_runtime.launch
    monkeypatch.setattr(native.cute_runtime, "launch",
                        lambda name, *a: (launched.append(name), real_launch(name, *a))[1])
    return launched


def _native_module():
    from msa._native import block_max_score_sm90   # registers "block_max_scores" for sm90
    return block_max_score_sm90


def _random_lengths(gen, causal):
    """Four requests: varied lengths (never multiples of 128), one with q_len > k_len, one
    empty query side."""
    q_lens, k_lens = [], []
    for b in range(4):
        k = int(torch.randint(150, 2600, (1,), generator=gen))
        if k % BLOCK == 0:
            k += 45
        if b == 1:
            q = k + int(torch.randint(1, 300, (1,), generator=gen))   # early rows see nothing
        elif b == 3:
            q = 0
        else:
            q = int(torch.randint(1, k + 1, (1,), generator=gen))
        q_lens.append(q)
        k_lens.append(k)
    return q_lens, k_lens


def _paginate(k_dense, k_lens, gen, device):
    """Dense [total_k, 1, 128] -> shuffled pages [pages, 1, 128, 128] with spare junk pages,
    and a page table whose entries past each request's pages are junk (-5)."""
    n_pages = [-(-kl // BLOCK) for kl in k_lens]
    total_pages = sum(n_pages) + 3
    perm = torch.randperm(total_pages, generator=gen)
    pages = torch.randn(total_pages, 1, BLOCK, HEAD_DIM, generator=gen).to(torch.bfloat16)
    table = torch.full((len(k_lens), max(n_pages) + 2), -5, dtype=torch.int32)
    start, used = 0, 0
    for b, (kl, npg) in enumerate(zip(k_lens, n_pages)):
        for beta in range(npg):
            page = int(perm[used])
            used += 1
            table[b, beta] = page
            n = min(BLOCK, kl - beta * BLOCK)
            pages[page, 0, :n] = k_dense[start + beta * BLOCK:start + beta * BLOCK + n, 0]
        start += kl
    return pages.to(device), table.to(device)


def _offset_for(case, q_lens, k_lens, gen, device):
    """None (bottom-right), an int, or a [B] tensor: cycled over the cases (causal only)."""
    kind = case % 3
    if kind == 0:
        return None
    if kind == 1:
        return int(torch.randint(-200, 400, (1,), generator=gen))
    shift = torch.randint(-300, 300, (len(q_lens),), generator=gen)
    return (torch.tensor(k_lens) - torch.tensor(q_lens) + shift).to(torch.int64).to(device)


def _check(got, want, scale):
    want = want.to(got.device)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not torch.isnan(got).any(), \
        f"NaN at {int(torch.isnan(got).sum())} elements (unwritten outputs)"
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    mismatch = inf_got != inf_want
    assert not mismatch.any(), (f"-inf pattern differs at {int(mismatch.sum())} elements, "
                                f"first {mismatch.nonzero()[0].tolist()}")
    assert bool((got[inf_got] < 0).all()), "+inf in the output"
    fin = ~inf_want
    diff = (got[fin].double() - want[fin]).abs()
    bound = 1e-2 * torch.clamp(want[fin].abs(), min=scale * math.sqrt(HEAD_DIM))
    if diff.numel():
        worst = (diff / bound).max().item()
        assert worst <= 1.0, f"max |err| / bound = {worst:.3f} (max |err| {diff.max():.3e})"


CASES = [(h, paged, causal) for h in (1, 2, 4, 8) for paged in (False, True)
         for causal in (False, True)]


# The Hopper kernel on SM90; the portable tier (csrc warp-MMA kernel) on any GPU, forced
# on SM90 (MSA_NATIVE_TIER=portable), where it is validated by proxy.
TIER_PARAMS = [pytest.param("hopper", marks=pytest.mark.sm90), "portable"]


def _use_tier(tier, monkeypatch):
    """The _backend family the test's native calls must report (see msa_testing.use_tier)."""
    if tier == "portable":
        compiled_variant_with("block_max_score_portable")
    else:
        _native_module()
    return use_tier(tier, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("num_heads,paged,causal", CASES)
def test_block_max_scores_native_matches_float64(num_heads, paged, causal, tier, seed,
                                                monkeypatch, native_hooks):
    family = _use_tier(tier, monkeypatch)
    native_hooks.poison()
    case = CASES.index((num_heads, paged, causal))
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    q_lens, k_lens = _random_lengths(gen, causal)
    orphan_rows = 5 if case % 2 else 0          # q rows past cu_seqlens_q[-1]: stay -inf
    total_q, total_k = sum(q_lens) + orphan_rows, sum(k_lens)
    q = (torch.randn(total_q, num_heads, HEAD_DIM, generator=gen)).to(torch.bfloat16)
    k = (torch.randn(total_k, 1, HEAD_DIM, generator=gen)).to(torch.bfloat16)
    cu_q, cu_k = cu_seqlens(q_lens, device), cu_seqlens(k_lens, device)
    scale = (1.0, HEAD_DIM ** -0.5, 0.37)[case % 3]
    offset = _offset_for(case, q_lens, k_lens, gen, device) if causal else None
    max_k = max(k_lens)
    # Sometimes a wider tile axis than needed (extra -inf tiles), sometimes a narrower one
    # (tiles past it are not computed).
    max_k_tiles = max(1, -(-max_k // BLOCK) + (2, 0, -3)[case % 3])
    kwargs = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max_k, scale=scale, causal=causal,
                  qo_offset=offset, max_k_tiles=max_k_tiles)
    q_dev = q.to(device)
    if paged:
        k_in, table = _paginate(k, k_lens, gen, device)
        seqused = torch.tensor(k_lens, dtype=torch.int32, device=device)
        args = (q_dev, k_in, cu_q, cu_k)
        kwargs.update(page_table=table, seqused_k=seqused)
    else:
        k_in = k.to(device)
        args = (q_dev, k_in, cu_q, cu_k)

    monkeypatch.setenv("MSA_BACKEND", "native")
    got = msa.block_max_scores(*args, **kwargs)
    torch.cuda.synchronize()
    monkeypatch.delenv("MSA_BACKEND")
    assert _backend.last_backend("block_max_scores") == family

    want = block_max_scores_reference(
        q_dev, k_in, cu_q, cu_k, max_k_tiles=max_k_tiles, scale=scale, causal=causal,
        qo_offset=offset, page_table=kwargs.get("page_table"),
        seqused_k=kwargs.get("seqused_k"), compute_dtype=torch.float64)
    print(f"H={num_heads} paged={paged} causal={causal} offset={type(offset).__name__} "
          f"q_lens={q_lens} k_lens={k_lens} tiles={max_k_tiles}")
    _check(got, want, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("num_heads", (1, 8))
def test_block_max_scores_native_long_request_and_small_grid(num_heads, tier, seed,
                                                            monkeypatch, native_hooks):
    """One long request with max_seqlen_q understated (1): the kernel's grid-stride loop over
    query tiles must still cover every row; plus a second request of one token."""
    family = _use_tier(tier, monkeypatch)
    native_hooks.poison()
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    q_lens, k_lens = [3001, 1], [3001 + 77, 300]
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    k = torch.randn(sum(k_lens), 1, HEAD_DIM, generator=gen).to(torch.bfloat16)
    q, k = q.to(device), k.to(device)
    cu_q, cu_k = cu_seqlens(q_lens, device), cu_seqlens(k_lens, device)
    tiles = -(-max(k_lens) // BLOCK)
    monkeypatch.setenv("MSA_BACKEND", "native")
    got = msa.block_max_scores(q, k, cu_q, cu_k, max_seqlen_q=1, max_seqlen_k=max(k_lens),
                               scale=1.0, causal=True, max_k_tiles=tiles)
    torch.cuda.synchronize()
    monkeypatch.delenv("MSA_BACKEND")
    assert _backend.last_backend("block_max_scores") == family
    want = block_max_scores_reference(q, k, cu_q, cu_k, max_k_tiles=tiles, scale=1.0,
                                      causal=True, compute_dtype=torch.float64)
    _check(got, want, 1.0)


KEY_SPLIT_CASES = [(dtype, paged, causal) for dtype in ("bf16", "e4m3")
                   for paged in (False, True) for causal in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("dtype,paged,causal", KEY_SPLIT_CASES)
def test_block_max_scores_key_splits_equal_the_unsplit_call(dtype, paged, causal, tier, seed,
                                                           monkeypatch, native_hooks):
    """msa.prefill's key splits (CTAs per query tile along its key tiles, the kernels' grid z)
    give the unsplit call's scores bit for bit, for split counts below, near and above the
    tiles a query tile sees (splits past them have nothing to compute); poisoned outputs, rows
    no request owns, and the float64 bound."""
    family = _use_tier(tier, monkeypatch)
    native_hooks.poison()
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    q_lens, k_lens = _random_lengths(gen, causal)
    q_lens[0], k_lens[0] = 300, 9000 + 37          # a short chunk against a long prefix
    total_q = sum(q_lens) + 3                        # three rows no request owns
    num_heads = 4
    wide = torch.float8_e4m3fn if dtype == "e4m3" else torch.bfloat16
    q = torch.randn(total_q, num_heads, HEAD_DIM, generator=gen).to(wide).to(device)
    k = torch.randn(sum(k_lens), 1, HEAD_DIM, generator=gen).to(torch.bfloat16)
    cu_q, cu_k = cu_seqlens(q_lens, device), cu_seqlens(k_lens, device)
    tiles = -(-max(k_lens) // BLOCK)
    kwargs = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), scale=0.37,
                  causal=causal, max_k_tiles=tiles)
    if paged:
        pages, table = _paginate(k, k_lens, gen, device)
        k_in = pages.to(wide)
        kwargs.update(page_table=table,
                      seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device))
        args = (q, k_in, cu_q, None)
    else:
        k_in = k.to(wide).to(device)
        args = (q, k_in, cu_q, cu_k)
    monkeypatch.setenv("MSA_BACKEND", "native")
    unsplit = chunk_block_max_scores(*args, **kwargs)
    for splits in (2, 3, 17, 200):
        got = chunk_block_max_scores(*args, key_splits=splits, **kwargs)
        torch.cuda.synchronize()
        assert _backend.last_backend("block_max_scores") == family
        assert torch.equal(got, unsplit), (
            f"{splits} splits: {int((got != unsplit).sum())} elements differ")
    monkeypatch.delenv("MSA_BACKEND")
    want = block_max_scores_reference(
        q, k_in, cu_q, cu_k, max_k_tiles=tiles, scale=0.37, causal=causal,
        page_table=kwargs.get("page_table"), seqused_k=kwargs.get("seqused_k"),
        compute_dtype=torch.float64)
    _check(unsplit, want, 0.37)


E4M3_CASES = [(h, paged, causal) for h in (1, 4, 8) for paged in (False, True)
              for causal in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("num_heads,paged,causal", E4M3_CASES)
def test_block_max_scores_e4m3_native_matches_float64(num_heads, paged, causal, tier, seed,
                                                      monkeypatch, native_hooks):
    """e4m3 q_idx / k_idx (the fp8 indexer): the reference computes on the same e4m3 values in
    float64, so only the kernel's fp32 accumulation differs (the portable tier widens e4m3 to
    f16 exactly); same bound as bf16."""
    family = _use_tier(tier, monkeypatch)
    native_hooks.poison()
    case = E4M3_CASES.index((num_heads, paged, causal))
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    q_lens, k_lens = _random_lengths(gen, causal)
    e4m3 = torch.float8_e4m3fn
    q = (2 * torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=gen)).to(e4m3)
    k = (2 * torch.randn(sum(k_lens), 1, HEAD_DIM, generator=gen)).to(torch.bfloat16)
    cu_q, cu_k = cu_seqlens(q_lens, device), cu_seqlens(k_lens, device)
    scale = (1.0, HEAD_DIM ** -0.5)[case % 2]
    kwargs = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), scale=scale,
                  causal=causal, max_k_tiles=-(-max(k_lens) // BLOCK))
    if paged:
        pages, table = _paginate(k, k_lens, gen, device)
        k_in = pages.to(e4m3)
        kwargs.update(page_table=table,
                      seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device))
    else:
        k_in = k.to(e4m3).to(device)
    q_dev = q.to(device)
    monkeypatch.setenv("MSA_BACKEND", "native")
    got = msa.block_max_scores(q_dev, k_in, cu_q, cu_k, **kwargs)
    torch.cuda.synchronize()
    monkeypatch.delenv("MSA_BACKEND")
    assert _backend.last_backend("block_max_scores") == family
    want = block_max_scores_reference(
        q_dev, k_in, cu_q, cu_k, max_k_tiles=kwargs["max_k_tiles"], scale=scale, causal=causal,
        page_table=kwargs.get("page_table"), seqused_k=kwargs.get("seqused_k"),
        compute_dtype=torch.float64)
    print(f"e4m3 H={num_heads} paged={paged} causal={causal} q_lens={q_lens} k_lens={k_lens}")
    _check(got, want, 2 * 2 * scale)   # |q|, |k| ~ 2: typical |q.k| ~ 4 sqrt(128) scale


DECODE_CASES = [(h, seqlen_q, dtype) for h in (1, 4, 8) for seqlen_q in (1, 4, 8)
                for dtype in ("bf16", "e4m3") if h * seqlen_q <= 64]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("num_heads,seqlen_q,dtype", DECODE_CASES)
def test_block_max_scores_decode_native_matches_float64(num_heads, seqlen_q, dtype, seed,
                                                        monkeypatch, native_hooks):
    """The decode indexer: 1-8 new tokens per request against a paged index-K cache (ragged
    lengths up to ~20k, shuffled pages, an empty request), bottom-right causal. Runs the decode
    variant (one warpgroup, K tiles split across CTAs) and checks that it was the one launched."""
    native = _native_module()
    native_hooks.poison()
    launched = _record_launches(native, monkeypatch)
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    k_lens = [int(torch.randint(1, 20000, (1,), generator=gen)) for _ in range(5)] + [0, 129]
    q_lens = [seqlen_q if kl > 0 else 0 for kl in k_lens]
    elem = torch.float8_e4m3fn if dtype == "e4m3" else torch.bfloat16
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=gen).to(elem).to(device)
    k = torch.randn(sum(k_lens), 1, HEAD_DIM, generator=gen).to(torch.bfloat16)
    pages, table = _paginate(k, k_lens, gen, device)
    pages = pages.to(elem)
    cu_q, cu_k = cu_seqlens(q_lens, device), cu_seqlens(k_lens, device)
    seqused = torch.tensor(k_lens, dtype=torch.int32, device=device)
    tiles = -(-max(k_lens) // BLOCK)
    monkeypatch.setenv("MSA_BACKEND", "native")
    got = msa.block_max_scores(q, pages, cu_q, cu_k, max_seqlen_q=seqlen_q,
                               max_seqlen_k=max(k_lens), scale=HEAD_DIM ** -0.5, causal=True,
                               page_table=table, seqused_k=seqused, max_k_tiles=tiles)
    torch.cuda.synchronize()
    monkeypatch.delenv("MSA_BACKEND")
    assert launched and launched[-1].endswith("_decode"), launched
    want = block_max_scores_reference(q, pages, cu_q, cu_k, max_k_tiles=tiles,
                                      scale=HEAD_DIM ** -0.5, causal=True, page_table=table,
                                      seqused_k=seqused, compute_dtype=torch.float64)
    print(f"decode H={num_heads} seqlen_q={seqlen_q} {dtype} k_lens={k_lens}")
    _check(got, want, HEAD_DIM ** -0.5)


# ----------------------------------------------------------------------------------------------
# Tensors of 2^31 elements or more (64-bit row offsets in the kernel)
# ----------------------------------------------------------------------------------------------

ELEMENTS_2_31 = 2 ** 31


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("num_heads,decode_q", [(4, None), (8, 2)])
def test_block_max_scores_paged_pool_past_2_31_elements(num_heads, decode_q, seed,
                                                        monkeypatch, native_hooks):
    """e4m3 index-K pool of more than 2^31 elements (2^17 pages of [1, 128, 128] below the
    boundary, ~2.1 GB, NaN) whose used pages all lie past the 2^31-element boundary (the decode
    benchmark's B = 32 x 512k cache has exactly 2^31 elements): the page offset must be 64-bit
    (it was page << 14 in 32 bits: every stride of k is static). Prefill variant (H = 4) and
    decode variant (H = 8, 2 new tokens). The output must equal the same kernel's output on a
    compact pool of the used pages exactly, and the float64 reference on those pages."""
    native = _native_module()
    native_hooks.poison()
    launched = _record_launches(native, monkeypatch)
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    e4m3 = torch.float8_e4m3fn
    if decode_q is None:
        q_lens, k_lens = _random_lengths(gen, True)
    else:
        k_lens = [int(torch.randint(1, 6000, (1,), generator=gen)) for _ in range(4)] + [0]
        q_lens = [decode_q if kl > 0 else 0 for kl in k_lens]
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=gen).to(e4m3).to(device)
    k = torch.randn(sum(k_lens), 1, HEAD_DIM, generator=gen).to(torch.bfloat16)
    pages, table = _paginate(k, k_lens, gen, device)
    pages = pages.to(e4m3)
    boundary = ELEMENTS_2_31 // (BLOCK * HEAD_DIM)         # first page at element 2^31
    pool = nan_tensor((boundary + pages.shape[0], 1, BLOCK, HEAD_DIM), e4m3, device)
    pool[boundary:] = pages
    assert pool.numel() > ELEMENTS_2_31
    pool_table = torch.where(table >= 0, table + boundary, table)   # junk entries stay junk
    cu_q, cu_k = cu_seqlens(q_lens, device), cu_seqlens(k_lens, device)
    scale = HEAD_DIM ** -0.5
    kwargs = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), scale=scale,
                  causal=True, seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
                  max_k_tiles=-(-max(k_lens) // BLOCK))
    monkeypatch.setenv("MSA_BACKEND", "native")
    got = msa.block_max_scores(q, pool, cu_q, cu_k, page_table=pool_table, **kwargs)
    torch.cuda.synchronize()
    del pool
    compact = msa.block_max_scores(q, pages, cu_q, cu_k, page_table=table, **kwargs)
    torch.cuda.synchronize()
    monkeypatch.delenv("MSA_BACKEND")
    assert _backend.last_backend("block_max_scores") == "sm90"
    assert len(launched) == 2 and launched[0] == launched[1], launched
    assert launched[0].endswith("_decode") == (decode_q is not None), launched
    print(f"pool past 2^31: H={num_heads} decode_q={decode_q} q_lens={q_lens} k_lens={k_lens}")
    assert torch.equal(got, compact), "the pool past 2^31 elements changes the result"
    want = block_max_scores_reference(
        q, pages, cu_q, cu_k, max_k_tiles=kwargs["max_k_tiles"], scale=scale, causal=True,
        page_table=table, seqused_k=kwargs["seqused_k"], compute_dtype=torch.float64)
    _check(got, want, scale)


@pytest.mark.gpu
@pytest.mark.sm90
def test_block_max_scores_dense_rows_and_output_past_2_31_elements(seed, monkeypatch,
                                                                  native_hooks):
    """Dense e4m3 q_idx [total_q, 8, 128] and k_idx [total_k, 1, 128] of more than 2^31
    elements each (~2.1 GB apiece) and an output of more than 2^31 elements (~10.7 GB): request
    0 owns the first 2^21 query rows but no key, request 1 the first 2^24 keys but no query
    (both regions NaN), so every q and k row the computed requests read lies past the 2^31-element
    boundary (H = 8 makes the q strides static: row << 10 in 32 bits before the fix); a wide tile
    axis (max_k_tiles = 160) puts their output past 2^31 elements too. Request 0's rows see no
    key: all -inf. The rest must equal the kernel's output on compact inputs exactly and the
    float64 reference."""
    native = _native_module()
    native_hooks.poison()
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    e4m3 = torch.float8_e4m3fn
    num_heads, tiles = 8, 160
    lead_q = ELEMENTS_2_31 // (num_heads * HEAD_DIM)        # 2^21 rows
    lead_k = ELEMENTS_2_31 // HEAD_DIM                      # 2^24 keys
    q_lens, k_lens = _random_lengths(gen, True)
    q_small = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=gen).to(e4m3).to(device)
    k_small = torch.randn(sum(k_lens), 1, HEAD_DIM, generator=gen).to(e4m3).to(device)
    q = nan_tensor((lead_q + sum(q_lens), num_heads, HEAD_DIM), e4m3, device)
    q[lead_q:] = q_small
    k = nan_tensor((lead_k + sum(k_lens), 1, HEAD_DIM), e4m3, device)
    k[lead_k:] = k_small
    scale = HEAD_DIM ** -0.5
    common = dict(scale=scale, causal=True, max_k_tiles=tiles)
    monkeypatch.setenv("MSA_BACKEND", "native")
    got = msa.block_max_scores(q, k, cu_seqlens([lead_q, 0] + q_lens, device),
                               cu_seqlens([0, lead_k] + k_lens, device), max_seqlen_q=lead_q,
                               max_seqlen_k=lead_k, **common)
    torch.cuda.synchronize()
    assert _backend.last_backend("block_max_scores") == "sm90"
    del q, k
    assert got.numel() > ELEMENTS_2_31
    assert bool(torch.isneginf(got[:, :, :lead_q]).all()), "request 0 sees no key: all -inf"
    got = got[:, :, lead_q:].contiguous()
    torch.cuda.empty_cache()
    cu_q, cu_k = cu_seqlens(q_lens, device), cu_seqlens(k_lens, device)
    compact = msa.block_max_scores(q_small, k_small, cu_q, cu_k, max_seqlen_q=max(q_lens),
                                   max_seqlen_k=max(k_lens), **common)
    torch.cuda.synchronize()
    monkeypatch.delenv("MSA_BACKEND")
    print(f"rows past 2^31: q_lens={q_lens} k_lens={k_lens}")
    assert torch.equal(got, compact), "rows past 2^31 elements change the result"
    want = block_max_scores_reference(q_small, k_small, cu_q, cu_k, compute_dtype=torch.float64,
                                      **common)
    _check(got, want, scale)


# ----------------------------------------------------------------------------------------------
# CPU: the kernel compiles for sm_90a without spills (full list: tools/compile_cute.py --check)
# ----------------------------------------------------------------------------------------------

def test_variant_names_match_the_manifest_names():
    """The runtime names artifacts without importing cutlass; both sides must agree."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sys.path.insert(0, root)
    from cute_kernels.variants import BlockMaxScoreVariant, shipped_variants
    names = {v.name for v in shipped_variants() if isinstance(v, BlockMaxScoreVariant)}
    native = _native_module()
    assert names == ({native.variant_name(h, paged, dtype) for h in native.SUPPORTED_HEADS
                      for paged in (False, True) for dtype in native._DTYPE_NAMES}
                     | {native.variant_name(h, True, dtype, form="decode")
                        for h in native.SUPPORTED_HEADS for dtype in native._DTYPE_NAMES})


def test_block_max_variant_compiles_for_sm90a_without_spills(tmp_path):
    """Compiles the H = 4 paged variant (M3's shape) for sm_90a with fake tensors and checks the
    PTX: 8 m64n128k16 wgmmas (one per 16-wide k step), 512 threads, no register spills."""
    import importlib.util
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("nvidia-cutlass-dsl is not installed")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sys.path.insert(0, root)
    sys.path.insert(0, os.path.join(root, "tools"))
    try:
        import compile_cute
        compile_cute.find_ptxas()
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        from cute_kernels.build import compile_variant
        from cute_kernels.variants import by_name
    except (ImportError, FileNotFoundError, RuntimeError) as exc:   # runtime-only DSL, no CTK
        pytest.skip(f"cannot compile CuTe kernels here: {exc}")
    compile_variant(by_name("block_max_score_sm90_bfloat16_h4_paged"), dump_dir=str(tmp_path))
    ptx = sorted(tmp_path.glob("*.ptx"))
    assert ptx, "the DSL kept no PTX"
    text = ptx[0].read_text()
    assert ".target sm_90a" in text
    assert text.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 8
    assert ".reqntid 512" in text
    assert "fence.proxy.async.shared::cta" in text
    report = compile_cute.ptxas_report(ptx[0])
    assert report["spill_bytes"] == 0, report
    assert 0 < report["registers"] <= 128, report     # 512 threads: at most 128 registers


# ----------------------------------------------------------------------------------------------
# Benchmark mode
# ----------------------------------------------------------------------------------------------

def _naive_indexer(q_idx, k_idx, scale):
    """The textbook indexer on one sequence: [H, n, n] bf16 score matrix, causal mask, max per
    128-key block -> [H, ceil(n/128), n] fp32. Memory grows as n^2 (out of memory past 32k)."""
    n, num_heads, _ = q_idx.shape
    tiles = -(-n // BLOCK)
    keys = torch.nn.functional.pad(k_idx[:, 0], (0, 0, 0, tiles * BLOCK - n))
    scores = torch.einsum("qhd,kd->hqk", q_idx * scale, keys)
    pos = torch.arange(tiles * BLOCK, device=q_idx.device)
    scores.masked_fill_(pos.view(1, 1, -1) > pos[:n].view(1, -1, 1), float("-inf"))
    return scores.view(num_heads, n, tiles, BLOCK).amax(-1).float().transpose(1, 2)


def _time_ms(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def bench(sizes=(8192, 32768), num_heads=4, scale=1.0):
    """Prints native vs naive TFLOP/s for one causal sequence per size (M3: H_idx = 4)."""
    _native_module()
    device = torch.device("cuda")
    torch.manual_seed(0)
    for n in sizes:
        q = torch.randn(n, num_heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
        k = torch.randn(n, 1, HEAD_DIM, device=device, dtype=torch.bfloat16)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        flops = 2 * num_heads * HEAD_DIM * (n * (n + 1) // 2)

        def native():
            return msa.block_max_scores(q, k, cu, cu, max_seqlen_q=n, max_seqlen_k=n,
                                        scale=scale, causal=True)
        os.environ["MSA_BACKEND"] = "native"
        ms = _time_ms(native)
        del os.environ["MSA_BACKEND"]
        line = (f"N={n} H={num_heads}: native {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s "
                f"(backend {_backend.last_backend('block_max_scores')})")
        try:
            naive_ms = _time_ms(lambda: _naive_indexer(q, k, scale), iters=3)
            got, want = native(), _naive_indexer(q, k, scale)
            ok = torch.equal(torch.isinf(got), torch.isinf(want))
            err = (got - want).nan_to_num(0.0, 0.0, 0.0).abs().max().item()
            line += (f"; naive torch {naive_ms:.2f} ms {flops / naive_ms / 1e9:.1f} TFLOP/s, "
                     f"speedup {naive_ms / ms:.1f}x (max |diff| {err:.3e}, -inf equal {ok})")
        except torch.OutOfMemoryError:
            line += "; naive torch: out of memory"
        torch.cuda.empty_cache()
        print(line, flush=True)


if __name__ == "__main__" and "--bench" in sys.argv:
    bench()


def test_decode_key_splits_cover_two_waves_with_at_least_two_tiles_each():
    """CPU: the decode variant's grid x (K-tile chunks per request)."""
    native = _native_module()
    assert native.decode_key_splits(1, 64, 132) == 32          # capped by 2 tiles per CTA
    assert native.decode_key_splits(1, 4096, 132) == 264       # two waves for one request
    assert native.decode_key_splits(32, 1024, 132) == 9        # ceil(264 / 32)
    assert native.decode_key_splits(512, 1024, 132) == 1
    assert native.decode_key_splits(4, 1, 132) == 1            # at least one CTA


def test_launch_limits_refuse_int32_counts_not_tensor_sizes():
    """CPU: run() refuses, before any launch and naming the argument, the counts the kernel
    keeps in int32 (max_k_tiles * 256 rows of -inf fill; max_pages * 128 as the key length of a
    paged call without seqused_k); tensors of 2^31 elements or more are served (64-bit row
    offsets), e.g. the decode benchmark's index-K cache of 32 x 512k tokens."""
    from msa.indexer import BlockMaxScoreCall
    native = _native_module()
    e4m3 = torch.float8_e4m3fn
    q = torch.randn(3, 4, HEAD_DIM).to(e4m3)
    # k_idx of 2^31 + 2^14 elements without the memory (a broadcast view; run() refuses before
    # it would read it).
    k = torch.randn(1, 1, 1, 1).to(e4m3).expand(2 ** 17 + 1, 1, BLOCK, HEAD_DIM)
    seqused = torch.tensor([200], dtype=torch.int32)

    def call(max_k_tiles, table_width, seqused_k):
        table = torch.randint(0, 2 ** 17, (1, table_width), dtype=torch.int32)
        return BlockMaxScoreCall(q_idx=q, k_idx=k, cu_seqlens_q=torch.tensor([0, 3]).int(),
                                 cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=200,
                                 max_k_tiles=max_k_tiles, scale=1.0, causal=True,
                                 qo_offset=None, page_table=table, seqused_k=seqused_k)

    with pytest.raises(NotImplementedError, match=r"^max_k_tiles: .* = 2147483648 does not fit"):
        native.run(call(2 ** 23, 2, seqused))
    with pytest.raises(NotImplementedError, match=r"^page_table: .* = 2147483648 does not fit"):
        native.run(call(2, 2 ** 24, None))
    assert k.numel() > 2 ** 31
    served = call(2 ** 23 - 1, 2 ** 24, seqused)                       # all counts fit: served
    native.check_launch_limits(served.max_k_tiles, served.page_table, served.seqused_k)
