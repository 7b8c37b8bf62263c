"""Bad input to build_k2q_csr / sparse_atten_func raises the contract's error class, naming the
argument, before any launch (contract §1 "Errors")."""

import pytest
import torch

import msa
from msa_testing import cu_seqlens

FP8 = torch.float8_e4m3fn


def _good():
    torch.manual_seed(0)
    q_lens, k_lens = [100, 60], [300, 200]
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    q2k = torch.full((2, 160, 4), -1, dtype=torch.int32)
    q2k[:, :, 0] = 0
    row_ptr, q_idx = msa.build_k2q_csr(q2k, cu_q, cu_k, 128, total_k=500)
    args = dict(q=torch.randn(160, 8, 128).bfloat16(), k=torch.randn(500, 2, 128).bfloat16(),
                v=torch.randn(500, 2, 128).bfloat16(), k2q_row_ptr=row_ptr, k2q_q_indices=q_idx,
                topK=4)
    kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=100, max_seqlen_k=300)
    return args, kwargs, q2k


def _paged(args, kwargs):
    args["k"] = torch.randn(6, 2, 128, 128).bfloat16()
    args["v"] = torch.randn(6, 2, 128, 128).bfloat16()
    kwargs["page_table"] = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    kwargs["seqused_k"] = torch.tensor([300, 200], dtype=torch.int32)


ATTN_CASES = [
    # (id, mutate(args, kwargs), error, argument named in the message)
    ("q fp16", lambda a, k: a.update(q=a["q"].half()), TypeError, "q"),
    ("q fp32", lambda a, k: a.update(q=a["q"].float()), TypeError, "q"),
    ("q not a tensor", lambda a, k: a.update(q=[1, 2]), TypeError, "q"),
    ("q rank 2", lambda a, k: a.update(q=a["q"][:, 0]), ValueError, "q"),
    ("q head dim 64", lambda a, k: a.update(q=a["q"][..., :64].contiguous()),
     NotImplementedError, "q"),
    ("q not contiguous", lambda a, k: a.update(q=a["q"].transpose(0, 1).contiguous()
                                                 .transpose(0, 1)), ValueError, "q"),
    ("k fp16", lambda a, k: a.update(k=a["k"].half(), v=a["v"].half()), TypeError, "k"),
    ("v dtype differs", lambda a, k: a.update(v=a["v"].to(FP8)), TypeError, "v"),
    ("fp8 q with bf16 kv", lambda a, k: a.update(q=a["q"].to(FP8)), TypeError, "k"),
    ("k head dim 64", lambda a, k: a.update(k=a["k"][..., :64].contiguous(),
                                             v=a["v"][..., :64].contiguous()),
     NotImplementedError, "k"),
    ("v shape differs", lambda a, k: a.update(v=a["v"][:400].contiguous()), ValueError, "v"),
    ("G = 3", lambda a, k: a.update(q=torch.randn(160, 6, 128).bfloat16()),
     NotImplementedError, "q"),
    ("G = 32", lambda a, k: a.update(q=torch.randn(160, 64, 128).bfloat16()),
     NotImplementedError, "q"),
    ("Hq not multiple", lambda a, k: a.update(q=torch.randn(160, 5, 128).bfloat16()),
     ValueError, "q"),
    ("topK 12", lambda a, k: a.update(topK=12), ValueError, "topK"),
    ("topK float", lambda a, k: a.update(topK=4.0), TypeError, "topK"),
    ("q_idx too short", lambda a, k: a.update(k2q_q_indices=a["k2q_q_indices"][:, :100]
                                              .contiguous()), ValueError, "k2q_q_indices"),
    ("q_idx int64", lambda a, k: a.update(k2q_q_indices=a["k2q_q_indices"].long()),
     TypeError, "k2q_q_indices"),
    ("row_ptr wrong heads", lambda a, k: a.update(k2q_row_ptr=a["k2q_row_ptr"][:1]
                                                  .contiguous()), ValueError, "k2q_row_ptr"),
    ("cu_seqlens_q int64", lambda a, k: k.update(cu_seqlens_q=k["cu_seqlens_q"].long()),
     TypeError, "cu_seqlens_q"),
    ("cu_seqlens mismatch", lambda a, k: k.update(cu_seqlens_k=cu_seqlens([300, 200, 5])),
     ValueError, "cu_seqlens_k"),
    ("cu_seqlens rank 2", lambda a, k: k.update(cu_seqlens_q=k["cu_seqlens_q"].view(1, -1)),
     ValueError, "cu_seqlens_q"),
    ("blk_kv 64", lambda a, k: k.update(blk_kv=64), ValueError, "blk_kv"),
    ("partial fp64", lambda a, k: k.update(partial_dtype=torch.float64), TypeError,
     "partial_dtype"),
    ("temperature lse alone", lambda a, k: k.update(return_temperature_lse=True), ValueError,
     "return_temperature_lse"),
    ("temperature 0", lambda a, k: k.update(lse_temperature_scale=0.0), ValueError,
     "lse_temperature_scale"),
    ("temperature inf", lambda a, k: k.update(lse_temperature_scale=float("inf")), ValueError,
     "lse_temperature_scale"),
    ("softmax_scale negative", lambda a, k: k.update(softmax_scale=-1.0), ValueError,
     "softmax_scale"),
    ("qk_dtype mismatch", lambda a, k: k.update(qk_dtype=FP8), TypeError, "qk_dtype"),
    ("pv_dtype fp16", lambda a, k: k.update(pv_dtype=torch.float16), TypeError, "pv_dtype"),
    ("seqused_k dense", lambda a, k: k.update(seqused_k=torch.tensor([1, 2], dtype=torch.int32)),
     ValueError, "seqused_k"),
    ("page_table dense", lambda a, k: k.update(page_table=torch.zeros(2, 3, dtype=torch.int32)),
     ValueError, "page_table"),
    ("paged without table", lambda a, k: (_paged(a, k), k.pop("page_table")), ValueError,
     "page_table"),
    ("page size 64", lambda a, k: (_paged(a, k), a.update(k=torch.randn(6, 2, 64, 128).bfloat16(),
                                                          v=torch.randn(6, 2, 64, 128).bfloat16())),
     ValueError, "k"),
    ("page_table int64", lambda a, k: (_paged(a, k), k.update(page_table=k["page_table"].long())),
     TypeError, "page_table"),
    ("page_table wrong batch", lambda a, k: (_paged(a, k), k.update(
        page_table=torch.zeros(3, 3, dtype=torch.int32))), ValueError, "page_table"),
    ("seqused_k wrong length", lambda a, k: (_paged(a, k), k.update(
        seqused_k=torch.tensor([1], dtype=torch.int32))), ValueError, "seqused_k"),
    ("out-of-range page id", lambda a, k: (_paged(a, k), k.update(
        page_table=torch.tensor([[0, 1, 99], [3, 4, 5]], dtype=torch.int32))), ValueError,
     "page_table"),
    ("incomplete schedule", lambda a, k: k.update(
        schedule=msa.interface.SparseAttentionSchedule(True, None, None)), ValueError,
     "schedule"),
    ("max_seqlen_q negative", lambda a, k: k.update(max_seqlen_q=-1), ValueError,
     "max_seqlen_q"),
    ("usable_SM_count -2", lambda a, k: k.update(usable_SM_count=-2), ValueError,
     "usable_SM_count"),
]


@pytest.mark.parametrize("name,mutate,error,arg", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_sparse_atten_func_rejects(name, mutate, error, arg):
    args, kwargs, _ = _good()
    mutate(args, kwargs)
    with pytest.raises(error) as info:
        msa.sparse_atten_func(**args, **kwargs)
    assert str(info.value).startswith(arg), str(info.value)


def test_good_inputs_pass_dense_and_paged():
    args, kwargs, _ = _good()
    assert msa.sparse_atten_func(**args, **kwargs).shape == (160, 8, 128)
    _paged(args, kwargs)
    assert msa.sparse_atten_func(**args, **kwargs).shape == (160, 8, 128)


CSR_CASES = [
    ("total_k missing", dict(total_k=None), ValueError, "total_k"),
    ("block size 64", dict(kv_block_size=64), ValueError, "kv_block_size"),
    ("q2k int64", dict(q2k=lambda q: q.long()), TypeError, "q2k_indices"),
    ("q2k rank 2", dict(q2k=lambda q: q[0]), ValueError, "q2k_indices"),
    ("q2k not contiguous", dict(q2k=lambda q: q.transpose(0, 1).contiguous().transpose(0, 1)),
     ValueError, "q2k_indices"),
    ("topK 5", dict(q2k=lambda q: q[..., :3].contiguous()), ValueError, "q2k_indices"),
    ("cu_seqlens_k shape", dict(cu_k=cu_seqlens([1, 2, 3])), ValueError, "cu_seqlens_k"),
    ("cu_seqlens_q float", dict(cu_q=torch.tensor([0.0, 160.0])), TypeError, "cu_seqlens_q"),
    ("schedule without hints", dict(return_schedule=True), ValueError, "max_seqlen_q"),
    ("total_rows negative", dict(total_rows=-1), ValueError, "total_rows"),
    ("qhead_per_kv 0", dict(qhead_per_kv=0), ValueError, "qhead_per_kv"),
]


@pytest.mark.parametrize("name,change,error,arg", CSR_CASES, ids=[c[0] for c in CSR_CASES])
def test_build_k2q_csr_rejects(name, change, error, arg):
    _, kwargs, q2k = _good()
    cu_q, cu_k = kwargs["cu_seqlens_q"], cu_seqlens([300, 200])
    change = dict(change)
    q2k = change.pop("q2k", lambda q: q)(q2k)
    cu_q = change.pop("cu_q", cu_q)
    cu_k = change.pop("cu_k", cu_k)
    block = change.pop("kv_block_size", 128)
    opts = dict(total_k=500)
    opts.update(change)
    with pytest.raises(error) as info:
        msa.build_k2q_csr(q2k, cu_q, cu_k, block, **opts)
    assert str(info.value).startswith(arg), str(info.value)
