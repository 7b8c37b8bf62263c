"""NVFP4 quantization helpers (contract §1.6) and sparse_atten_nvfp4_kv_func (§1.3), on CPU.

The checks are written from the contract: an independent unpacking of the nibbles and of the
128x4 tile offsets, nearest-grid-point checks in float64, and attention compared with
sparse_atten_func run on the dequantized bf16 K/V.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import msa
from msa.interface import build_k2q_csr, sparse_atten_func
from msa.quantize import (Nvfp4QuantizedTensor, dequantize_nvfp4_128x4_to_bf16,
                          nvfp4_global_scale_from_amax, quantize_bf16_to_nvfp4_128x4,
                          quantize_kv_bf16_to_nvfp4_128x4, swizzle_nvfp4_scale_to_128x4)

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# Independent decoders (written from the contract text)
# ---------------------------------------------------------------------------------------------

def tile_offset(row: int, col: int, cols: int) -> int:
    tiles_n = (cols + 3) // 4
    return ((row // 128) * tiles_n + col // 4) * 512 + (row % 32) * 16 \
        + ((row % 128) // 32) * 4 + col % 4


def logical_scale_bytes(tiled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    flat = tiled.reshape(-1).view(torch.uint8) if tiled.dtype != torch.uint8 else tiled.reshape(-1)
    idx = torch.tensor([[tile_offset(r, c, cols) for c in range(cols)] for r in range(rows)])
    return flat[idx]


def e2m1_from_nibbles(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> float64 [..., 2n]: low nibble first."""
    b = data.to(torch.int64)
    codes = torch.stack((b % 16, b // 16), dim=-1).reshape(*data.shape[:-1], -1)
    mag = GRID[codes % 8]
    return torch.where(codes >= 8, -mag, mag)


def decode_nvfp4_f64(qx: Nvfp4QuantizedTensor, with_global: bool = True) -> torch.Tensor:
    rows, cols = qx.logical_scale_shape
    scales = logical_scale_bytes(qx.scale_128x4, rows, cols).view(torch.float8_e4m3fn).double()
    vals = e2m1_from_nibbles(qx.data.reshape(rows, -1))
    x = vals * scales.repeat_interleave(16, dim=1)
    if with_global:
        x = x * qx.global_scale.double().reshape(-1)[0]
    return x.reshape(qx.original_shape)


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(64, 128), (48, 2, 128), (2, 2, 128, 128), (16, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_matches_nvfp4_recipe(seed, shape, dtype):
    # Blocks of very different magnitude, one all-zero block, and negative values.
    x = torch.randn(shape, dtype=torch.float64) * torch.exp(2 * torch.randn(*shape[:-1], 1))
    x.view(-1, shape[-1])[0, :16] = 0.0
    x = x.to(dtype)
    q = quantize_bf16_to_nvfp4_128x4(x)
    rows, cols = math.prod(shape[:-1]), shape[-1] // 16

    assert isinstance(q, Nvfp4QuantizedTensor)
    assert q.data.dtype == torch.uint8 and tuple(q.data.shape) == (*shape[:-1], shape[-1] // 2)
    assert q.scale_128x4.dtype == torch.uint8
    assert tuple(q.scale_128x4.shape) == (-(-rows // 128) * 128, -(-cols // 4) * 4)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.numel() == 1
    assert q.logical_scale_shape == (rows, cols) and tuple(q.original_shape) == tuple(shape)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.data = q.data

    xb = x.double().reshape(rows, cols, 16)
    amax = xb.abs().max()
    g = float(q.global_scale)
    assert g == pytest.approx(float(amax) / 2688.0, rel=1e-6)

    # Block scales: E4M3 of amax_block / 6 / global (at most 1 E4M3 step off from float64).
    scale_bytes = logical_scale_bytes(q.scale_128x4, rows, cols)
    want = (xb.abs().amax(-1) / 6.0 / g).clamp(max=448.0).float().to(torch.float8_e4m3fn)
    diff = (scale_bytes.to(torch.int64) - want.view(torch.uint8).to(torch.int64)).abs()
    assert int(diff.max()) <= 1
    assert int(scale_bytes[0, 0]) == 0            # the all-zero block

    # Padding bytes of the tiled buffer stay 0.
    used = torch.zeros(q.scale_128x4.numel(), dtype=torch.bool)
    used[torch.tensor([tile_offset(r, c, cols) for r in range(rows) for c in range(cols)])] = True
    assert int(q.scale_128x4.reshape(-1)[~used].abs().max() if (~used).any() else 0) == 0

    # Every element is the E2M1 grid point nearest to x / (scale * global) (saturating at 6).
    s = scale_bytes.view(torch.float8_e4m3fn).double() * g                  # [rows, cols]
    vals = e2m1_from_nibbles(q.data.reshape(rows, -1)).reshape(rows, cols, 16)
    live = s > 0
    target = torch.where(live.unsqueeze(-1), xb / torch.where(live, s, 1.0).unsqueeze(-1), 0.0)
    target = target.clamp(-6.0, 6.0)
    best = (target.abs().unsqueeze(-1) - GRID).abs().min(-1).values
    # Slack for the fp32 division x / (scale * global) landing exactly on a midpoint.
    assert torch.all((target - vals).abs() <= best + 1e-6 * target.abs() + 1e-9)
    assert torch.all(vals[~live] == 0)

    # Round trip: per block the error is at most half the widest E2M1 gap (1.0) times the
    # decode scale amax_block / 6, up to the E4M3 rounding of the scale (relative 2**-4, or
    # absolute 2**-10 * global for subnormal / flushed scales), plus the final bf16 rounding.
    y = dequantize_nvfp4_128x4_to_bf16(q).double().reshape(rows, cols, 16)
    block_amax = xb.abs().amax(-1, keepdim=True)
    bound = block_amax / 6.0 * (1 + 2 ** -3) + 6.0 * g * 2 ** -10 + y.abs() * 2 ** -8
    assert torch.all((y - xb).abs() <= bound)
    # And the dequantized tensor is exactly the float64 decode, rounded once to bf16.
    assert torch.equal(dequantize_nvfp4_128x4_to_bf16(q),
                       decode_nvfp4_f64(q).to(torch.bfloat16))


def test_e2m1_ties_round_to_even(seed):
    from msa.reference.fp4 import e2m1_codes_from_scaled
    mags = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, 0.2499, 0.2501])
    want = torch.tensor([0, 2, 2, 4, 4, 6, 6, 7, 7, 0, 1])
    sign = torch.where(torch.rand(mags.shape) < 0.5, -1.0, 1.0)
    codes = e2m1_codes_from_scaled(mags * sign).long()
    assert torch.equal(codes % 8, want)
    assert torch.equal(codes >= 8, (sign < 0) & (want > 0))


def test_dequantize_without_global_scale(seed):
    x = torch.randn(32, 256, dtype=torch.bfloat16) * 3
    q = quantize_bf16_to_nvfp4_128x4(x)
    raw = dequantize_nvfp4_128x4_to_bf16(q, include_global_scale=False)
    assert torch.equal(raw.double(), decode_nvfp4_f64(q, with_global=False))  # exact in bf16
    assert torch.allclose(raw.double() * float(q.global_scale),
                          dequantize_nvfp4_128x4_to_bf16(q).double(), rtol=2 ** -7, atol=0)


def test_quantize_kv_returns_one_tensor_per_input(seed):
    k = torch.randn(64, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(64, 2, 128, dtype=torch.bfloat16) * 10
    kq, vq = quantize_kv_bf16_to_nvfp4_128x4(k, v)
    assert torch.equal(kq.data, quantize_bf16_to_nvfp4_128x4(k).data)
    assert torch.equal(vq.scale_128x4, quantize_bf16_to_nvfp4_128x4(v).scale_128x4)
    assert float(vq.global_scale) == pytest.approx(float(v.abs().max()) / 2688, rel=1e-6)


def test_global_scale_from_amax(seed):
    amax = torch.rand(3) * 100
    out = nvfp4_global_scale_from_amax(amax)
    assert out.dtype == torch.float32 and torch.allclose(out, amax / 2688.0)
    assert float(nvfp4_global_scale_from_amax(2688.0)) == 1.0


@pytest.mark.parametrize("rows,cols", [(200, 8), (128, 4), (5, 5), (300, 12)])
def test_swizzle_offsets_match_formula(seed, rows, cols):
    scale = torch.randint(1, 256, (rows, cols), dtype=torch.uint8)
    tiled = swizzle_nvfp4_scale_to_128x4(scale, rows=rows, cols=cols)
    prow, pcol = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert tiled.shape == (prow, pcol) and tiled.dtype == torch.uint8
    flat = tiled.reshape(-1)
    expected = torch.zeros(prow * pcol, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            expected[tile_offset(r, c, cols)] = scale[r, c]
    assert torch.equal(flat, expected)
    # A flat input of rows*cols elements and the float8 dtype are accepted too.
    typed = swizzle_nvfp4_scale_to_128x4(scale.reshape(-1).view(torch.float8_e4m3fn),
                                         rows=rows, cols=cols)
    assert typed.dtype == torch.float8_e4m3fn and torch.equal(typed.view(torch.uint8), tiled)


def test_quantize_bad_inputs(seed):
    good = torch.randn(32, 128, dtype=torch.bfloat16)
    cases = [
        (lambda: quantize_bf16_to_nvfp4_128x4(good.float()), TypeError, "x:"),
        (lambda: quantize_bf16_to_nvfp4_128x4(good[0]), ValueError, "x:"),
        (lambda: quantize_bf16_to_nvfp4_128x4(good[:, :120]), ValueError, "x:"),
        (lambda: quantize_bf16_to_nvfp4_128x4(good[:24]), ValueError, "x:"),
        (lambda: quantize_kv_bf16_to_nvfp4_128x4(good, good[:8]), ValueError, "v:"),
        (lambda: quantize_kv_bf16_to_nvfp4_128x4(good.half().float(), good), TypeError, "k:"),
        (lambda: dequantize_nvfp4_128x4_to_bf16(good), TypeError, "qx:"),
        (lambda: swizzle_nvfp4_scale_to_128x4(torch.ones(10, 8, dtype=torch.uint8), rows=10,
                                              cols=4), ValueError, "scale:"),
        (lambda: swizzle_nvfp4_scale_to_128x4(torch.ones(10, 8), rows=10, cols=8), TypeError,
         "scale:"),
    ]
    for fn, exc, prefix in cases:
        with pytest.raises(exc) as info:
            fn()
        assert str(info.value).startswith(prefix), str(info.value)


# ---------------------------------------------------------------------------------------------
# sparse_atten_nvfp4_kv_func
# ---------------------------------------------------------------------------------------------

def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _random_q2k(q_lens, k_lens, hkv, topk, causal):
    total_q = sum(q_lens)
    q2k = torch.full((hkv, total_q, topk), -1, dtype=torch.int32)
    row = 0
    for ql, kl in zip(q_lens, k_lens):
        nblk = -(-kl // 128)
        for i in range(ql):
            last = nblk if not causal else max(0, min(nblk, (i + kl - ql) // 128 + 1))
            for h in range(hkv):
                n = min(last, topk - int(torch.randint(0, 2, ())))
                slots = torch.randperm(topk)[:n]                 # -1 holes anywhere
                q2k[h, row + i, slots] = torch.randperm(last)[:n].to(torch.int32)
        row += ql
    return q2k


def _pow2_global(qx: Nvfp4QuantizedTensor, exponent: int) -> Nvfp4QuantizedTensor:
    """A power-of-two global scale keeps the dequantized bf16 K/V exact."""
    return dataclasses.replace(qx, global_scale=torch.tensor([2.0 ** exponent]))


def _make_case(paged, hkv, g, topk, causal):
    q_lens, k_lens = (21, 40), (176, 400)           # total_k * Hkv stays a multiple of 16
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q = torch.randn(sum(q_lens), hkv * g, 128, dtype=torch.bfloat16)
    q2k = _random_q2k(q_lens, k_lens, hkv, topk, causal)
    row_ptr, q_idx = build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=sum(k_lens))
    case = dict(q=q, row_ptr=row_ptr, q_idx=q_idx, topk=topk, kw=dict(
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens), causal=causal))
    if paged:
        blocks = [-(-n // 128) for n in k_lens]
        pages = sum(blocks) + 2                     # spare pages nobody references
        perm = torch.randperm(pages).to(torch.int32)
        table = torch.zeros(len(k_lens), max(blocks), dtype=torch.int32)
        used = 0
        for b, n in enumerate(blocks):
            table[b, :n] = perm[used:used + n]
            used += n
        shape = (pages, hkv, 128, 128)
        case["kw"].update(page_table=table, seqused_k=torch.tensor(k_lens, dtype=torch.int32))
    else:
        shape = (sum(k_lens), hkv, 128)
    k = torch.randn(shape, dtype=torch.bfloat16) * 2
    v = torch.randn(shape, dtype=torch.bfloat16) * 5
    case["kq"], case["vq"] = quantize_kv_bf16_to_nvfp4_128x4(k, v)
    return case


def _run_nvfp4(case, q=None, **extra):
    kq, vq = case["kq"], case["vq"]
    return msa.sparse_atten_nvfp4_kv_func(
        case["q"] if q is None else q, kq.data, vq.data, kq.scale_128x4, vq.scale_128x4,
        kq.global_scale, vq.global_scale, case["row_ptr"], case["q_idx"], case["topk"],
        **case["kw"], **extra)


def _run_bf16(case, q=None, **extra):
    return sparse_atten_func(
        case["q"] if q is None else q, dequantize_nvfp4_128x4_to_bf16(case["kq"]),
        dequantize_nvfp4_128x4_to_bf16(case["vq"]), case["row_ptr"], case["q_idx"],
        case["topk"], **case["kw"], **extra)


@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("topk", [4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_nvfp4_kv_equals_dequantized_bf16(seed, paged, g, topk, causal):
    case = _make_case(paged, 2, g, topk, causal)
    case["kq"], case["vq"] = _pow2_global(case["kq"], -7), _pow2_global(case["vq"], -5)
    out, lse = _run_nvfp4(case, return_softmax_lse=True)
    ref, ref_lse = _run_bf16(case, return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == case["q"].shape
    # With power-of-two global scales both paths see the same fp32 K/V values (V's global
    # scale commutes exactly with the per-block bf16 rounding), so the results are identical.
    assert torch.equal(out, ref)
    assert torch.equal(lse, ref_lse)
    if causal:   # (half the cases, to keep the suite fast)
        # An e4m3 query runs the same math on its (exactly representable) values.
        q8 = case["q"].float().clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(_run_nvfp4(case, q=q8), _run_bf16(case, q=q8.to(torch.bfloat16)))


@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
def test_nvfp4_kv_real_global_scales_and_temperature(seed, paged):
    case = _make_case(paged, 2, 2, 8, True)
    out, lse, lse_t = _run_nvfp4(case, return_softmax_lse=True, return_temperature_lse=True,
                                 lse_temperature_scale=2.0, partial_dtype=torch.float32)
    ref, ref_lse, ref_lse_t = _run_bf16(case, return_softmax_lse=True,
                                        return_temperature_lse=True, lse_temperature_scale=2.0,
                                        partial_dtype=torch.float32)
    # The bf16 path rounds K/V * global to bf16 once; the NVFP4 path keeps them in fp32. Both
    # round O to bf16, so allow a couple of bf16 ulps of each row's largest entry.
    row_max = ref.float().abs().amax(-1, keepdim=True)
    assert torch.all((out.float() - ref.float()).abs() <= 2e-2 * (ref.float().abs() + row_max))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)
    torch.testing.assert_close(lse_t[finite], ref_lse_t[finite], atol=2e-2, rtol=1e-3)


def test_nvfp4_kv_without_global_scales(seed):
    case = _make_case(False, 2, 1, 4, False)
    kq, vq = case["kq"], case["vq"]
    out = msa.sparse_atten_nvfp4_kv_func(
        case["q"], kq.data, vq.data, kq.scale_128x4, vq.scale_128x4, None, None,
        case["row_ptr"], case["q_idx"], 4, **case["kw"])
    ref = sparse_atten_func(
        case["q"], dequantize_nvfp4_128x4_to_bf16(kq, include_global_scale=False),
        dequantize_nvfp4_128x4_to_bf16(vq, include_global_scale=False), case["row_ptr"],
        case["q_idx"], 4, **case["kw"])
    assert torch.equal(out, ref)


def test_nvfp4_kv_bad_inputs(seed):
    case = _make_case(False, 2, 1, 4, False)
    kq, vq = case["kq"], case["vq"]
    args = dict(q=case["q"], k=kq.data, v=vq.data, k_scale_128x4=kq.scale_128x4,
                v_scale_128x4=vq.scale_128x4, k_global_scale=kq.global_scale,
                v_global_scale=vq.global_scale)

    def call(**change):
        a = {**args, **change}
        return msa.sparse_atten_nvfp4_kv_func(
            a["q"], a["k"], a["v"], a["k_scale_128x4"], a["v_scale_128x4"], a["k_global_scale"],
            a["v_global_scale"], case["row_ptr"], case["q_idx"], 4, **case["kw"])

    cases = [
        (dict(k=kq.data.view(torch.int8)), TypeError, "k:"),
        (dict(k=dequantize_nvfp4_128x4_to_bf16(kq), v=dequantize_nvfp4_128x4_to_bf16(vq)),
         TypeError, "k:"),
        (dict(q=case["q"].half()), TypeError, "q:"),
        (dict(k_scale_128x4=kq.scale_128x4.float()), TypeError, "k_scale_128x4:"),
        (dict(v_scale_128x4=vq.scale_128x4[:-128]), ValueError, "v_scale_128x4:"),
        (dict(k_scale_128x4=kq.scale_128x4.t()), ValueError, "k_scale_128x4:"),
        (dict(k_global_scale=kq.global_scale.double()), TypeError, "k_global_scale:"),
        (dict(v_global_scale=torch.empty(0)), ValueError, "v_global_scale:"),
        (dict(k=torch.cat([kq.data, kq.data], -1), v=torch.cat([vq.data, vq.data], -1)),
         ValueError, "k:"),
    ]
    for change, exc, prefix in cases:
        with pytest.raises(exc) as info:
            call(**change)
        assert str(info.value).startswith(prefix), str(info.value)


@pytest.mark.gpu
def test_quantize_and_attention_on_cuda_match_cpu(seed):
    x = torch.randn(64, 2, 128, dtype=torch.bfloat16) * 3
    q_cpu = quantize_bf16_to_nvfp4_128x4(x)
    q_gpu = quantize_bf16_to_nvfp4_128x4(x.cuda())
    assert q_gpu.data.is_cuda and q_gpu.scale_128x4.is_cuda and q_gpu.global_scale.is_cuda
    assert torch.equal(q_gpu.data.cpu(), q_cpu.data)
    assert torch.equal(q_gpu.scale_128x4.cpu(), q_cpu.scale_128x4)
    assert torch.equal(dequantize_nvfp4_128x4_to_bf16(q_gpu).cpu(),
                       dequantize_nvfp4_128x4_to_bf16(q_cpu))

    case = _make_case(True, 2, 4, 8, True)
    ref, ref_lse = _run_nvfp4(case, return_softmax_lse=True)
    moved = {key: (val.cuda() if isinstance(val, torch.Tensor) else val)
             for key, val in case.items()}
    moved["kw"] = {key: (val.cuda() if isinstance(val, torch.Tensor) else val)
                   for key, val in case["kw"].items()}
    for name in ("kq", "vq"):
        qx = case[name]
        moved[name] = dataclasses.replace(qx, data=qx.data.cuda(),
                                          scale_128x4=qx.scale_128x4.cuda(),
                                          global_scale=qx.global_scale.cuda())
    out, lse = _run_nvfp4(moved, return_softmax_lse=True)
    assert out.is_cuda and out.dtype == torch.bfloat16
    row_max = ref.float().abs().amax(-1, keepdim=True)
    err = (out.cpu().float() - ref.float()).abs()
    assert torch.all(err <= 2e-2 * (ref.float().abs() + row_max))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.cpu()[finite], ref_lse[finite], atol=1e-3, rtol=1e-3)
