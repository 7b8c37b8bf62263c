"""The sparse bridge (contract §2.4): fmha plans whose sparse attention runs through
:func:`msa.build_k2q_csr` and :func:`msa.sparse_atten_func`.

:func:`sparse_fmha_plan` plans a block-sparse prefill over 128-token pages; :func:`sparse_fmha`
turns the fmha-style selection ``kv_block_indexes`` [total_q, Hkv, n] into the q2k layout,
builds the k2q CSR and its schedule, and runs the sparse attention. The four FP8 scales are
applied as the dense path applies them (contract D5: folded into softmax_scale and the output).
"""

from __future__ import annotations

import torch

from .._common import to_device as _to
from .._validation import check_qhead_per_kv, check_topk, value_checks_requested
from ..interface import build_k2q_csr, sparse_atten_func
from .validation import (BF16, TILE, IntOrTensor, call_scales, check_block_index_values,
                         check_bool, check_heads, check_int, check_out, check_plan_dict,
                         check_plan_page_table, check_qkv, host_lengths, host_offsets,
                         int32_tensor, kv_head_block_indexes, override_offsets,
                         page_table_from_indices, prefix_sums)


def sparse_fmha_plan(qo_segment_lens, kv_segment_lens, num_qo_heads, num_kv_heads=-1,
                     qo_offset: IntOrTensor = None, num_kv_splits=-1, page_size=-1,
                     output_maxscore=False, kv_block_num=-1, causal=True, usable_SM_count=-1,
                     use_fp8_kvcache=False) -> dict:
    """Plan a block-sparse prefill through :func:`msa.sparse_atten_func` (contract §2.4).

    Args:
      qo_segment_lens, kv_segment_lens: [B] integer tensors; the plan's tensors live on
        qo_segment_lens' device.
      num_qo_heads, num_kv_heads (-1: taken from k at run time).
      qo_offset: int or [B]; seqused_k = q_len + qo_offset (default kv_len); must satisfy
        0 <= q_len + qo_offset <= kv_len (ValueError).
      page_size: must be 128 (the paged block size of sparse_atten_func).
      kv_block_num: selected blocks per token, in {4, 8, 16, 32}.
      output_maxscore must be False and causal True (NotImplementedError otherwise).
      num_kv_splits, use_fp8_kvcache: accepted for API compatibility.
      usable_SM_count: <= 0 builds the attention schedule with the CSR; > 0 lets
        sparse_atten_func build one limited to that many SMs.

    Returns a dict with "MM-SA-Nv": True, device cu_seqlens_q / cu_seqlens_k / seqused_k, the
    host ints total_k and total_rows (exact: sum of ceil(kv_len / 128)), and the fields the
    fmha dispatcher reads ("qo_segment_offsets", "kv_page_indptr", "kv_segment_offsets",
    "pack_factor" = 1, "predicted_speedup" = 1.0).
    """
    q_lens = host_lengths("qo_segment_lens", qo_segment_lens)
    kv_lens = host_lengths("kv_segment_lens", kv_segment_lens)
    if len(kv_lens) != len(q_lens):
        raise ValueError(f"kv_segment_lens: has {len(kv_lens)} requests, qo_segment_lens "
                         f"{len(q_lens)}")
    offsets = host_offsets("qo_offset", qo_offset, len(q_lens),
                           [k - q for q, k in zip(q_lens, kv_lens)])
    device = qo_segment_lens.device if isinstance(qo_segment_lens, torch.Tensor) else \
        torch.device("cpu")
    return bridge_plan(q_lens, kv_lens, offsets, num_qo_heads=num_qo_heads,
                       num_kv_heads=num_kv_heads, num_kv_splits=num_kv_splits,
                       page_size=page_size, output_maxscore=output_maxscore,
                       kv_block_num=kv_block_num, causal=causal,
                       usable_SM_count=usable_SM_count, use_fp8_kvcache=use_fp8_kvcache,
                       device=device)


def bridge_plan(q_lens, kv_lens, offsets, *, num_qo_heads, num_kv_heads, num_kv_splits,
                page_size, output_maxscore, kv_block_num, causal, usable_SM_count,
                use_fp8_kvcache, device, check_groups: bool = True) -> dict:
    num_qo_heads, num_kv_heads = check_heads(num_qo_heads, num_kv_heads)
    check_topk("kv_block_num", kv_block_num)
    check_int("page_size", page_size)
    if page_size < 1:
        raise ValueError(f"page_size: the sparse bridge needs paged KV (page_size >= 1), got "
                         f"{page_size}")
    if page_size != TILE:
        raise NotImplementedError(f"page_size: the sparse bridge supports page_size {TILE} "
                                  f"only, got {page_size}")
    if check_bool("output_maxscore", output_maxscore):
        raise NotImplementedError("output_maxscore: the sparse bridge emits no max-score; plan "
                                  "the proxy pass without kv_block_num")
    if not check_bool("causal", causal):
        raise NotImplementedError("causal: the sparse bridge supports causal=True only")
    check_int("num_kv_splits", num_kv_splits)
    check_int("usable_SM_count", usable_SM_count, minimum=-1)
    check_bool("use_fp8_kvcache", use_fp8_kvcache)
    if check_groups and num_kv_heads > 0:
        check_qhead_per_kv(num_qo_heads, num_kv_heads, name="num_qo_heads",
                           kv_name="KV heads of num_kv_heads")
    seqused = []
    for b, (q, k, o) in enumerate(zip(q_lens, kv_lens, offsets)):
        if not 0 <= q + o <= k:
            raise ValueError(f"qo_offset: request {b} has q_len {q} + qo_offset {o} outside "
                             f"[0, kv_len {k}]; the sparse bridge cannot clip keys at kv_len")
        seqused.append(q + o)
    pages = [-(-k // page_size) for k in kv_lens]
    cu_q, cu_k = prefix_sums(q_lens), prefix_sums(kv_lens)
    cu_q_t, cu_k_t = int32_tensor(cu_q, device), int32_tensor(cu_k, device)
    return {
        "MM-SA-Nv": True,
        "mode": "sparse_prefill",
        "sparse": True,
        "batch": len(q_lens),
        "qo_segment_lens": int32_tensor(q_lens, device),
        "kv_segment_lens": int32_tensor(kv_lens, device),
        "cu_seqlens_q": cu_q_t,
        "qo_segment_offsets": cu_q_t,
        "cu_seqlens_k": cu_k_t,
        "kv_segment_offsets": cu_k_t,
        "kv_page_indptr": int32_tensor(prefix_sums(pages), device),
        "seqused_k": int32_tensor(seqused, device),
        "qo_offset": int32_tensor(offsets, device),
        "max_seqlen_q": max(q_lens),
        "max_qo_len": max(q_lens),
        "max_seqlen_k": max(kv_lens),
        "total_q": cu_q[-1],
        "total_k": cu_k[-1],
        "total_pages": sum(pages),
        "total_rows": sum(pages),
        "max_k_tiles": -1,
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "page_size": page_size,
        "blk_kv": page_size,
        "kv_block_num": kv_block_num,
        "causal": True,
        "num_kv_splits": num_kv_splits,
        "predicted_speedup": 1.0,
        "pack_factor": 1,
        "usable_SM_count": usable_SM_count,
        "use_fp8_kvcache": use_fp8_kvcache,
        "host_qo_lens": list(q_lens),
        "host_kv_lens": list(kv_lens),
        "host_qo_offset": list(offsets),
    }


def sparse_fmha(q, k, v, plan_info, out=None, max_score=None, sm_scale=None, q_scale=None,
                k_scale=None, v_scale=None, o_scale=None, kv_indices=None,
                output_maxscore=True, output_o=True, kv_block_indexes=None,
                q_offset_override: IntOrTensor = None, check_input_valid=False,
                page_table=None):
    """Run a :func:`sparse_fmha_plan` plan through msa.build_k2q_csr + msa.sparse_atten_func
    (contract §2.4). Returns (out, None): the bridge emits no max-score.

    Args:
      q: [total_q, Hq, 128] bf16 or e4m3; k, v: paged [pages, Hkv, 128, 128] (bf16, or e4m3;
        e4m3 q needs e4m3 K/V). Hq / Hkv in {1, 2, 4, 8, 16} (NotImplementedError otherwise).
      kv_block_indexes (required, ValueError if None): [total_q, Hkv or Hq, kv_block_num]
        int32 block ids, -1 = empty slot (with Hq rows every G-th row is used).
      page_table: [B, max_pages] int32; takes precedence over kv_indices [sum pages] int32.
      q_offset_override: int or [B]; seqused_k becomes q_len + override.
      sm_scale (128**-0.5), q_scale, k_scale, v_scale, o_scale (1.0): softmax_scale =
        sm_scale*q_scale*k_scale, output times v_scale*o_scale (contract D5).
      out: optional [total_q, Hq, 128] bf16 buffer the result is copied into.
      max_score, output_maxscore, output_o: accepted for API compatibility; O is always
        computed.
      check_input_valid: validate kv_block_indexes (ascending, -1 tail, in range), the pages
        (kv_indices / page_table) and, through build_k2q_csr and sparse_atten_func, the rest;
        MSA_CHECK_INPUTS=1 turns it on for every call.

    O is bf16. Visibility and math are those of fmha_sm100's sparse mode (see :mod:`msa.fmha`).
    """
    check_plan_dict("plan_info", plan_info)
    if not plan_info["MM-SA-Nv"]:
        raise ValueError("plan_info: not a sparse-prefill plan (use fmha_sm100)")
    if kv_block_indexes is None:
        raise ValueError("kv_block_indexes: sparse_fmha needs the selected blocks")
    check_qkv(q, k, v)
    device = q.device
    plan = plan_info
    total_q, hq = q.shape[0], q.shape[1]
    if total_q != plan["total_q"]:
        raise ValueError(f"q: has {total_q} tokens but the plan covers {plan['total_q']}")
    if hq != plan["num_qo_heads"]:
        raise ValueError(f"q: has {hq} heads but the plan was built for {plan['num_qo_heads']}")
    if k.dim() != 4:
        raise ValueError("k: the sparse bridge needs paged K/V [pages, Hkv, 128, 128]")
    hkv = k.shape[1]
    if plan["num_kv_heads"] > 0 and plan["num_kv_heads"] != hkv:
        raise ValueError(f"k: has {hkv} heads but the plan was built for "
                         f"{plan['num_kv_heads']}")
    group = check_qhead_per_kv(hq, hkv)
    if k.shape[2] != plan["page_size"]:
        raise ValueError(f"k: page size {k.shape[2]} differs from the plan's "
                         f"{plan['page_size']}")
    logit_scale, output_scale = call_scales(dict(sm_scale=sm_scale, q_scale=q_scale,
                                                 k_scale=k_scale, v_scale=v_scale, o_scale=o_scale))
    selection = kv_head_block_indexes(kv_block_indexes, plan, total_q, hq, hkv, device)
    check_input_valid = value_checks_requested(check_input_valid)
    if check_input_valid:
        check_block_index_values(selection, plan["host_qo_lens"], plan["host_kv_lens"],
                                 plan["page_size"])
    q2k = selection.permute(1, 0, 2).contiguous()                 # [Hkv, total_q, n]

    if page_table is not None:                                    # wins over kv_indices
        check_plan_page_table(page_table, plan, plan["page_size"], device, k.shape[0],
                              check_input_valid)
    else:
        page_table = page_table_from_indices(kv_indices, plan, plan["page_size"], k.shape[0],
                                             device, check_input_valid)
    seqused_k = _to(plan["seqused_k"], device)
    if q_offset_override is not None:
        offsets, host = override_offsets(plan, q_offset_override, device)
        if host is not None and not offsets_fit_bridge(plan, host):
            raise ValueError("q_offset_override: q_len + offset must lie in [0, kv_len] for "
                             "every request")
        seqused_k = (_to(plan["qo_segment_lens"], device) + offsets).to(torch.int32)
    cu_q = _to(plan["cu_seqlens_q"], device)
    cu_k = _to(plan["cu_seqlens_k"], device)
    usable_sm = int(plan["usable_SM_count"])
    csr = build_k2q_csr(q2k, cu_q, cu_k, TILE, total_k=max(plan["total_k"], 1),
                        max_seqlen_k=max(plan["max_seqlen_k"], 1),
                        max_seqlen_q=max(plan["max_seqlen_q"], 1),
                        total_rows=max(plan["total_rows"], 1), qhead_per_kv=group,
                        return_schedule=usable_sm <= 0, check_input_valid=check_input_valid)
    row_ptr, q_idx = csr[0], csr[1]
    schedule = csr[2] if usable_sm <= 0 else None
    result = sparse_atten_func(q, k, v, row_ptr, q_idx, plan["kv_block_num"],
                               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=max(plan["max_seqlen_q"], 1),
                               max_seqlen_k=max(plan["max_seqlen_k"], 1), blk_kv=TILE,
                               causal=True, softmax_scale=logit_scale, page_table=page_table,
                               seqused_k=seqused_k, schedule=schedule,
                               usable_SM_count=usable_sm, check_input_valid=check_input_valid)
    if output_scale != 1.0:
        result = (result.float() * output_scale).to(BF16)
    if out is not None:
        check_out(out, q, BF16)
        out.copy_(result)
        return out, None
    return result, None


def offsets_fit_bridge(plan, host_offset) -> bool:
    """The bridge expresses offsets as seqused_k = q_len + offset <= kv_len; an override that
    cannot be read without a sync, or does not fit, takes the block-selected dense path."""
    if host_offset is None:
        return False
    return all(0 <= q + o <= k for q, k, o in
               zip(plan["host_qo_lens"], plan["host_kv_lens"], host_offset))
