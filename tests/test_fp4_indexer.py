"""fp4_indexer_block_scores and its scale-layout helpers (contract §1.5, §5.2), on CPU.

The oracle is an independent float64 dense computation written from the contract: decode the
public-layout FP4 (E2M1 table x block scale), gather each request's keys through kv_indices,
take q.k for every (head, query, key), mask, and reduce per 128-key page.
"""

from __future__ import annotations

import math

import pytest
import torch

from msa import fp4_indexer_block_scores
from msa.fp4_indexer_interface import (fp4_indexer_mma_scale_shape,
                                       fp4_indexer_mma_scale_storage_shape,
                                       fp4_indexer_mma_scale_storage_stride,
                                       fp4_indexer_mma_scale_stride,
                                       fp4_indexer_reorder_scales_for_mma_cute)
from msa.src.sm100.fp4_indexer import normalize_fp4_format

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
GROUPS = {"nvfp4": 8, "mxfp4": 4}


# ---------------------------------------------------------------------------------------------
# Inputs and the float64 oracle
# ---------------------------------------------------------------------------------------------

def random_scale_bytes(shape, fmt):
    """Moderate scales (as upstream's test): E4M3 bytes 16..88, E8M0 bytes 122..132."""
    lo, hi = (16, 89) if fmt == "nvfp4" else (122, 133)
    raw = torch.randint(lo, hi, shape, dtype=torch.uint8)
    return raw.view(torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu)


def decode_f64(packed, scale, fmt):
    """packed [..., 64] uint8 + public scales [..., G] -> float64 [..., 128]."""
    b = packed.to(torch.int64)
    codes = torch.stack((b & 15, b >> 4), -1).reshape(*packed.shape[:-1], 128)
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    vals = table[codes]
    raw = scale.view(torch.uint8).to(torch.float64)
    if fmt == "nvfp4":
        s = scale.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    else:
        s = 2.0 ** (raw - 127.0)
    return vals * s.repeat_interleave(128 // GROUPS[fmt], dim=-1)


def dense_oracle(case, fmt, causal, qo_offset=None, num_tiles=None, magnitude=False):
    """float64 per-page max of q.k; with magnitude=True, of |q|.|k| instead (the scale of the
    rounding error of a float32 dot product, which bounds the kernel's deviation)."""
    q = decode_f64(case["q"], case["q_scale"], fmt)          # [total_q, Hq, 128]
    k = decode_f64(case["k"], case["k_scale"], fmt)          # [pages, Hk, 128, 128]
    if magnitude:
        q, k = q.abs(), k.abs()
    hq, hk = q.shape[1], k.shape[1]
    q_lens, k_lens = case["q_lens"], case["k_lens"]
    tiles = num_tiles if num_tiles is not None else max(-(-n // 128) for n in k_lens)
    out = torch.full((hq, tiles, q.shape[0]), -math.inf, dtype=torch.float64)
    q0 = 0
    for b, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        npages = -(-kl // 128)
        first = int(case["cu_page_offsets"][b])
        pages = [int(p) for p in case["kv_indices"][first:first + npages]]
        keys = torch.cat([k[p] for p in pages], dim=1)[:, :kl]           # [Hk, kl, 128]
        keys = keys.repeat_interleave(hq // hk, dim=0)                    # [Hq, kl, 128]
        logits = torch.einsum("qhd,hkd->hqk", q[q0:q0 + ql], keys)       # [Hq, ql, kl]
        if causal:
            offset = kl - ql if qo_offset is None else int(qo_offset[b])
            visible = torch.arange(kl).view(1, -1) <= torch.arange(ql).view(-1, 1) + offset
            logits = logits.masked_fill(~visible, -math.inf)
        pad = npages * 128 - kl
        logits = torch.nn.functional.pad(logits, (0, pad), value=-math.inf)
        out[:, :npages, q0:q0 + ql] = logits.view(hq, ql, npages, 128).amax(-1).transpose(1, 2)
        q0 += ql
    return out


def make_case(fmt, batch, max_seqlen, hq, hk, q_lens=None, k_lens=None):
    if q_lens is None:
        q_lens = [max_seqlen] + [int(torch.randint(max_seqlen // 2, max_seqlen + 1, ()))
                                 for _ in range(batch - 1)]
        k_lens = [int(torch.randint(max_seqlen // 2, max_seqlen + 1, ()))
                  for _ in range(batch - 1)] + [max_seqlen]
    pages_per = [-(-n // 128) for n in k_lens]
    n_pages = sum(pages_per) + 1                     # one spare physical page nobody lists
    g = GROUPS[fmt]
    total_q = sum(q_lens)
    cu = lambda xs: torch.tensor([0] + list(torch.tensor(xs).cumsum(0)), dtype=torch.int32)
    return dict(
        q=torch.randint(0, 256, (total_q, hq, 64), dtype=torch.uint8),
        k=torch.randint(0, 256, (n_pages, hk, 128, 64), dtype=torch.uint8),
        q_scale=random_scale_bytes((total_q, hq, g), fmt),
        k_scale=random_scale_bytes((n_pages, hk, 128, g), fmt),
        cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens), cu_page_offsets=cu(pages_per),
        kv_indices=torch.randperm(n_pages)[:sum(pages_per)].to(torch.int32),
        q_lens=q_lens, k_lens=k_lens)


def run(case, fmt, *, causal=False, scale_layout="public", qo_offset=None, max_seqlen_k=None,
        q=None, k=None):
    q_scale, k_scale = case["q_scale"], case["k_scale"]
    if scale_layout == "preordered_mma":
        q_mma, k_mma = fp4_indexer_reorder_scales_for_mma_cute(q_scale, k_scale, fp4_format=fmt)
        q_scale, k_scale = q_mma.permute(5, 2, 4, 0, 1, 3), k_mma.permute(5, 2, 4, 0, 1, 3)
    return fp4_indexer_block_scores(
        case["q"] if q is None else q, case["k"] if k is None else k, q_scale, k_scale,
        case["cu_seqlens_q"], case["cu_seqlens_k"], case["cu_page_offsets"],
        max_seqlen_q=max(case["q_lens"]),
        max_seqlen_k=max(case["k_lens"]) if max_seqlen_k is None else max_seqlen_k,
        kv_indices=case["kv_indices"], fp4_format=fmt, causal=causal, qo_offset=qo_offset,
        scale_layout=scale_layout)


def assert_scores_close(out, ref, magnitude):
    """Within float32 dot-product rounding: |out - ref| <= 1e-5 |ref| + max(1e-3, g * M) where
    M is the page max of sum |q_i k_i| and g = 2 * 128 * 2^-24 (twice gamma_128)."""
    assert out.dtype == torch.float32 and tuple(out.shape) == tuple(ref.shape)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert torch.isfinite(out[finite]).all()
    err = (out[finite].double() - ref[finite]).abs()
    bound = 1e-5 * ref[finite].abs() + (2 * 128 * 2.0 ** -24 * magnitude[finite]).clamp_min(1e-3)
    assert (err <= bound).all(), float((err / bound).max())


# ---------------------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("scale_layout", ["public", "preordered_mma"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,max_seqlen,heads", [(1, 130, (2, 1)), (2, 257, (4, 2))])
def test_block_scores_match_float64_oracle(seed, fmt, scale_layout, causal, batch, max_seqlen,
                                           heads):
    case = make_case(fmt, batch, max_seqlen, *heads)
    out = run(case, fmt, causal=causal, scale_layout=scale_layout)
    assert_scores_close(out, dense_oracle(case, fmt, causal),
                        dense_oracle(case, fmt, causal, magnitude=True))


@pytest.mark.parametrize("batch,max_seqlen,heads", [(2, 130, (4, 2)), (1, 257, (2, 1))])
def test_block_scores_other_shapes(seed, batch, max_seqlen, heads):
    fmt = ["nvfp4", "mxfp4"][int(torch.randint(0, 2, ()))]
    case = make_case(fmt, batch, max_seqlen, *heads)
    for causal in (False, True):
        assert_scores_close(run(case, fmt, causal=causal, scale_layout="preordered_mma"),
                            dense_oracle(case, fmt, causal),
                            dense_oracle(case, fmt, causal, magnitude=True))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_block_scores_qo_offset_and_wide_output(seed, fmt):
    # Decode-like: a few queries against long keys, explicit offsets (one sees nothing at all).
    case = make_case(fmt, 3, None, 8, 2, q_lens=[1, 8, 3], k_lens=[257, 128, 300])
    qo_offset = torch.tensor([256, 60, -5], dtype=torch.int32)
    out = run(case, fmt, causal=True, qo_offset=qo_offset, max_seqlen_k=700)
    ref = dense_oracle(case, fmt, True, qo_offset=qo_offset, num_tiles=6)
    assert_scores_close(out, ref, dense_oracle(case, fmt, True, qo_offset=qo_offset,
                                               num_tiles=6, magnitude=True))
    assert torch.isneginf(out[:, 3:]).all()          # tiles past every request's keys
    assert torch.isneginf(out[:, :, 9:]).all()       # request 2 sees no key


def test_block_scores_packed_dtypes_agree(seed):
    case = make_case("nvfp4", 2, 257, 4, 1)
    base = run(case, "nvfp4")
    as_int8 = run(case, "nvfp4", q=case["q"].view(torch.int8), k=case["k"].view(torch.int8))
    assert torch.equal(as_int8, base)
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4x2 is not None:
        assert torch.equal(run(case, "nvfp4", q=case["q"].view(fp4x2), k=case["k"].view(fp4x2)),
                           base)


# ---------------------------------------------------------------------------------------------
# Scale layout helpers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_reorder_scales_for_mma_matches_public_layout(seed, fmt):
    g = GROUPS[fmt]
    total_q, hq, pages, hk = 257, 3, 5, 2
    q_scale = random_scale_bytes((total_q, hq, g), fmt)
    k_scale = random_scale_bytes((pages, hk, 128, g), fmt)
    q_mma, k_mma = fp4_indexer_reorder_scales_for_mma_cute(q_scale, k_scale, fp4_format=fmt)

    assert q_mma.dtype == q_scale.dtype and k_mma.dtype == k_scale.dtype
    assert tuple(q_mma.shape) == fp4_indexer_mma_scale_shape(total_q, hq, fp4_format=fmt)
    assert tuple(k_mma.shape) == fp4_indexer_mma_scale_shape(128, pages * hk, fp4_format=fmt)
    assert tuple(q_mma.stride()) == fp4_indexer_mma_scale_stride(total_q, hq, fp4_format=fmt)
    assert tuple(k_mma.stride()) == fp4_indexer_mma_scale_stride(128, pages * hk, fp4_format=fmt)
    rest_g = -(-g // 4)
    assert fp4_indexer_mma_scale_shape(total_q, hq, fp4_format=fmt) == (32, 4, 3, 4, rest_g, hq)
    for view, mn, l in ((q_mma, total_q, hq), (k_mma, 128, pages * hk)):
        storage = view.permute(5, 2, 4, 0, 1, 3)
        assert storage.is_contiguous()
        assert tuple(storage.shape) == fp4_indexer_mma_scale_storage_shape(mn, l, fp4_format=fmt)
        assert tuple(storage.stride()) == fp4_indexer_mma_scale_storage_stride(mn, l,
                                                                               fp4_format=fmt)
        assert storage.shape == (l, -(-mn // 128), rest_g, 32, 4, 4)

    # Byte-exact placement: public (row, head, group) -> [row%32, (row//32)%4, row//128,
    # group%4, group//4, head]; K rows are page tokens and L = page*Hk + head.
    qb, kb = q_mma.view(torch.uint8), k_mma.view(torch.uint8)
    r, h, gg = torch.meshgrid(torch.arange(total_q), torch.arange(hq), torch.arange(g),
                              indexing="ij")
    assert torch.equal(qb[r % 32, (r // 32) % 4, r // 128, gg % 4, gg // 4, h],
                       q_scale.view(torch.uint8))
    p, h, s, gg = torch.meshgrid(torch.arange(pages), torch.arange(hk), torch.arange(128),
                                 torch.arange(g), indexing="ij")
    assert torch.equal(kb[s % 32, (s // 32) % 4, 0, gg % 4, gg // 4, p * hk + h],
                       k_scale.view(torch.uint8))
    # Padding rows (257..383) are zero bytes.
    flat = q_mma.permute(5, 2, 4, 0, 1, 3).reshape(hq, -1).view(torch.uint8)
    assert int(flat.sum()) == int(q_scale.view(torch.uint8).to(torch.int64).sum())


def test_normalize_fp4_format(seed):
    spec = normalize_fp4_format("NVFP4")
    assert (spec.name, spec.sf_vec_size, spec.scale_groups) == ("nvfp4", 16, 8)
    assert spec.torch_scale_dtype == torch.float8_e4m3fn
    spec = normalize_fp4_format("mxfp4")
    assert (spec.name, spec.sf_vec_size, spec.scale_groups) == ("mxfp4", 32, 4)
    assert spec.torch_scale_dtype == torch.float8_e8m0fnu
    for bad in ("e2m1", "fp4", ""):
        with pytest.raises(ValueError, match="^fp4_format:"):
            normalize_fp4_format(bad)
    with pytest.raises(TypeError, match="^fp4_format:"):
        normalize_fp4_format(4)


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------

def test_block_scores_bad_inputs(seed):
    case = make_case("nvfp4", 2, 130, 4, 2)
    q, k = case["q"], case["k"]
    base = dict(q=q, k=k, q_scale=case["q_scale"], k_scale=case["k_scale"],
                cu_seqlens_q=case["cu_seqlens_q"], cu_seqlens_k=case["cu_seqlens_k"],
                cu_page_offsets=case["cu_page_offsets"], kv_indices=case["kv_indices"],
                fp4_format="nvfp4", causal=False, qo_offset=None, scale_layout="public",
                max_seqlen_k=max(case["k_lens"]))

    def call(**change):
        a = {**base, **change}
        return fp4_indexer_block_scores(
            a["q"], a["k"], a["q_scale"], a["k_scale"], a["cu_seqlens_q"], a["cu_seqlens_k"],
            a["cu_page_offsets"], max_seqlen_q=130, max_seqlen_k=a["max_seqlen_k"],
            kv_indices=a["kv_indices"], fp4_format=a["fp4_format"], causal=a["causal"],
            qo_offset=a["qo_offset"], scale_layout=a["scale_layout"])

    call()   # the baseline is valid
    cases = [
        (dict(q=q.float()), TypeError, "q_fp4:"),
        (dict(q=q[..., :32].contiguous()), ValueError, "q_fp4:"),
        (dict(k=k[:, :, :64].contiguous()), ValueError, "k_fp4:"),
        (dict(q=q[:, :3].contiguous(), q_scale=case["q_scale"][:, :3].contiguous()), ValueError,
         "q_fp4:"),
        (dict(fp4_format="e2m1"), ValueError, "fp4_format:"),
        (dict(scale_layout="swizzled"), ValueError, "scale_layout:"),
        (dict(q_scale=case["q_scale"].view(torch.uint8).float()), TypeError, "q_scale:"),
        (dict(q_scale=case["q_scale"][:, :, :4].contiguous()), ValueError, "q_scale:"),
        (dict(k_scale=case["k_scale"].view(torch.uint8).view(torch.float8_e8m0fnu)), TypeError,
         "k_scale:"),
        (dict(scale_layout="preordered_mma"), ValueError, "q_scale:"),
        (dict(cu_seqlens_k=case["cu_seqlens_k"].long()), TypeError, "cu_seqlens_k:"),
        (dict(cu_page_offsets=case["cu_page_offsets"][:2]), ValueError, "cu_page_offsets:"),
        (dict(kv_indices=None), ValueError, "kv_indices:"),
        (dict(qo_offset=torch.zeros(2, dtype=torch.int32)), ValueError, "qo_offset:"),
        (dict(causal=True, qo_offset=torch.zeros(3, dtype=torch.int32)), ValueError,
         "qo_offset:"),
        (dict(kv_indices=case["kv_indices"] + 100), ValueError, "kv_indices:"),
        (dict(max_seqlen_k=100), ValueError, "max_seqlen_k:"),
        (dict(cu_page_offsets=case["cu_page_offsets"] * 0), ValueError, "cu_page_offsets:"),
    ]
    for change, exc, prefix in cases:
        with pytest.raises(exc) as info:
            call(**change)
        assert str(info.value).startswith(prefix), (change.keys(), str(info.value))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_block_scores_on_cuda_match_oracle(seed, fmt):
    case = make_case(fmt, 2, 257, 4, 2)
    ref = dense_oracle(case, fmt, True)
    magnitude = dense_oracle(case, fmt, True, magnitude=True)
    moved = {key: (val.cuda() if isinstance(val, torch.Tensor) else val)
             for key, val in case.items()}
    for layout in ("public", "preordered_mma"):
        out = run(moved, fmt, causal=True, scale_layout=layout)
        assert out.is_cuda
        assert_scores_close(out.cpu(), ref, magnitude)
