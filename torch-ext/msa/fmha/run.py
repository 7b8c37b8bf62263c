"""Running an fmha plan (contract §2.2): :func:`fmha_sm100` checks the call against its plan,
runs each sub-plan (a mixed plan's decode and prefill halves, then concatenated) and hands a
dense or block-selected sub-plan to the backend ``_backend`` chooses (:func:`run_fmha_dense`);
bridge sub-plans go to :func:`msa.fmha.bridge.sparse_fmha`.
"""

from __future__ import annotations

import torch

from .. import _backend
from .._validation import (SUPPORTED_QHEAD_PER_KV, check_same_device, check_shape,
                           check_tensor, value_checks_requested)
from .bridge import offsets_fit_bridge, sparse_fmha
from .call import FmhaDenseCall
from .reference import fmha_dense_reference, max_score_reference
from .validation import (BF16, IntOrTensor, call_scales, check_block_index_values, check_bool,
                         check_out, check_plan_dict, check_plan_page_table, check_qkv,
                         kv_head_block_indexes, override_offsets, page_table_from_indices)

_RUN_OPTIONS = dict(sm_scale=None, q_scale=None, k_scale=None, v_scale=None, o_scale=None,
                    output_maxscore=True, output_o=True, check_input_valid=False)


def fmha_sm100(q, k, v, plan_info, kv_indices=None, kv_block_indexes=None,
               q_offset_override: IntOrTensor = None, out=None, max_score=None, page_table=None,
               **kwargs):
    """Run an fmha plan (contract §2.2). Returns (out | None, max_score | None).

    Args:
      q: [total_q, Hq, 128] bf16 or float8_e4m3fn.
      k, v: dense [total_k, Hkv, 128] or paged HND [pages, Hkv, page_size, 128]; bf16 or e4m3
        (e4m3 q needs e4m3 K/V).
      plan_info: the tuple from :func:`fmha_sm100_plan` (a single plan dict is also accepted).
      kv_indices: [sum of pages] int32 physical page ids, request after request (paged KV);
        sliced per request by the plan's kv_page_indptr.
      kv_block_indexes: sparse plans only: [total_q, Hkv or Hq, kv_block_num] int32 selected
        block (page) ids, -1 = empty slot; with Hq rows every G-th row is used. Any order is
        accepted at run time (contract D1/D3).
      q_offset_override: int or [B] causal offsets replacing the plan's.
      out: optional [total_q, Hq, 128] output buffer (bf16).
      max_score: optional [Hq, max_k_tiles, total_q] fp32 buffer.
      page_table: [B, max_pages] int32; only for plans with a sparse-prefill (bridge) sub-plan,
        where it takes precedence over kv_indices (ValueError otherwise).
      kwargs: sm_scale=None (128**-0.5), q_scale, k_scale, v_scale, o_scale (1.0),
        output_maxscore=True, output_o=True, check_input_valid=False.

    O = softmax(sm_scale*q_scale*k_scale * q.k over visible keys) V * v_scale * o_scale in bf16
    (q's dtype for bf16 q); a row that meets a NaN or +inf score is NaN, never the empty row's
    0. max_score[hq, tile, t] = max over the visible keys of the 128-token
    tile of sm_scale*q_scale*k_scale * <q_t, k_j> (-inf where none is visible; contract D15):
    the same values as :func:`msa.block_max_scores` with that scale. It is produced only when
    the plan was built with output_maxscore and the plan is not sparse; otherwise it is None
    and O is always produced. output_o=False with output_maxscore=False raises ValueError.
    Mixed plans run both halves and concatenate (max-score tiles beyond a half's width are
    -inf). check_input_valid=True (or MSA_CHECK_INPUTS=1 for a whole run) additionally
    enforces strictly ascending kv_block_indexes rows with -1 only at the tail and ids below
    the request's page count, in-range kv_indices / page_table entries for every page holding
    keys and, for the sparse bridge, every value build_k2q_csr and sparse_atten_func check.
    Unchecked, the kernels skip pages outside the pool (never read out of bounds).
    """
    unknown = set(kwargs) - set(_RUN_OPTIONS)
    if unknown:
        raise TypeError(f"fmha_sm100: unexpected keyword arguments {sorted(unknown)}")
    opts = dict(_RUN_OPTIONS)
    opts.update(kwargs)
    mixed, split, batch, decode, prefill = _unpack_plan_info(plan_info)
    subplans = (decode, prefill) if mixed else (decode,)
    if page_table is not None and not any(p["MM-SA-Nv"] for p in subplans):
        raise ValueError("page_table: only plans with a sparse-prefill (bridge) sub-plan accept "
                         "a page_table; pass kv_indices")
    check_qkv(q, k, v)
    output_o = check_bool("output_o", opts["output_o"])
    output_maxscore = check_bool("output_maxscore", opts["output_maxscore"])
    if not output_o and not output_maxscore:
        raise ValueError("output_o: output_o and output_maxscore cannot both be False")
    opts["output_o"], opts["output_maxscore"] = output_o, output_maxscore
    out_dtype = BF16
    if not mixed:
        return _run_subplan(q, k, v, decode, kv_indices=kv_indices,
                            kv_block_indexes=kv_block_indexes,
                            q_offset_override=q_offset_override, out=out, max_score=max_score,
                            page_table=page_table, opts=opts)

    # Mixed: decode requests [0, split), prefill requests [split, B); run each, then merge.
    decode_nnz = decode["total_q"]
    if q.shape[0] != decode_nnz + prefill["total_q"]:
        raise ValueError(f"q: has {q.shape[0]} tokens but the plan covers "
                         f"{decode_nnz + prefill['total_q']}")
    parts = []
    for idx, plan in enumerate((decode, prefill)):
        rows = slice(0, decode_nnz) if idx == 0 else slice(decode_nnz, None)
        reqs = slice(0, split) if idx == 0 else slice(split, None)
        if k.dim() == 4:
            k_part, v_part = k, v
            page_split = decode["total_pages"] if decode["kv_page_indptr"] is not None else \
                decode["total_rows"]
            kvi = None if kv_indices is None else \
                (kv_indices[:page_split] if idx == 0 else kv_indices[page_split:])
        else:
            kv_split = decode["total_k"]
            k_part = k[:kv_split] if idx == 0 else k[kv_split:]
            v_part = v[:kv_split] if idx == 0 else v[kv_split:]
            kvi = kv_indices
        pt = None
        if page_table is not None and (plan["MM-SA-Nv"] or kvi is None):
            pt = page_table[reqs]
        if isinstance(q_offset_override, torch.Tensor) and q_offset_override.numel() == batch:
            override = q_offset_override.reshape(-1)[reqs]
        else:
            override = q_offset_override
        kbi = None if kv_block_indexes is None else kv_block_indexes[rows]
        parts.append(_run_subplan(q[rows], k_part, v_part, plan, kv_indices=kvi,
                                  kv_block_indexes=kbi, q_offset_override=override, out=None,
                                  max_score=None, page_table=pt, opts=opts))
    (o_dec, ms_dec), (o_pre, ms_pre) = parts
    combined_o = None
    if o_dec is not None and o_pre is not None:
        combined_o = torch.cat([o_dec, o_pre], dim=0)
    if out is not None and combined_o is not None:
        check_out(out, q, out_dtype)
        out.copy_(combined_o)
        combined_o = out
    combined_ms = None
    if ms_dec is not None or ms_pre is not None:
        width = max(ms.shape[1] for ms in (ms_dec, ms_pre) if ms is not None)
        combined_ms = torch.full((q.shape[1], width, q.shape[0]), float("-inf"),
                                 dtype=torch.float32, device=q.device)
        if ms_dec is not None:
            combined_ms[:, :ms_dec.shape[1], :decode_nnz] = ms_dec
        if ms_pre is not None:
            combined_ms[:, :ms_pre.shape[1], decode_nnz:] = ms_pre
        if max_score is not None:
            check_tensor("max_score", max_score, dtypes=(torch.float32,), ndim=3)
            check_shape("max_score", max_score, tuple(combined_ms.shape))
            max_score.copy_(combined_ms)
            combined_ms = max_score
    return combined_o, combined_ms


def _unpack_plan_info(plan_info):
    if isinstance(plan_info, dict):
        check_plan_dict("plan_info", plan_info)
        return False, 0, plan_info["batch"], plan_info, None
    if not isinstance(plan_info, (tuple, list)) or len(plan_info) != 5:
        raise TypeError("plan_info: expected the 5-tuple returned by fmha_sm100_plan")
    mixed, split, batch, decode, prefill = plan_info
    check_plan_dict("plan_info[3]", decode)
    if mixed:
        check_plan_dict("plan_info[4]", prefill)
    return bool(mixed), int(split), int(batch), decode, prefill


def _run_subplan(q, k, v, plan, *, kv_indices, kv_block_indexes, q_offset_override, out,
                 max_score, page_table, opts):
    if plan["MM-SA-Nv"]:
        return sparse_fmha(q, k, v, plan, out=out, max_score=max_score,
                           sm_scale=opts["sm_scale"], q_scale=opts["q_scale"],
                           k_scale=opts["k_scale"], v_scale=opts["v_scale"],
                           o_scale=opts["o_scale"], kv_indices=kv_indices,
                           output_maxscore=opts["output_maxscore"], output_o=opts["output_o"],
                           kv_block_indexes=kv_block_indexes,
                           q_offset_override=q_offset_override,
                           check_input_valid=opts["check_input_valid"], page_table=page_table)
    device = q.device
    total_q, hq = q.shape[0], q.shape[1]
    hkv = k.shape[1]
    if q.shape[0] != plan["total_q"]:
        raise ValueError(f"q: has {q.shape[0]} tokens but the plan covers {plan['total_q']}")
    if plan["num_qo_heads"] != hq:
        raise ValueError(f"q: has {hq} heads but the plan was built for {plan['num_qo_heads']}")
    if plan["num_kv_heads"] > 0 and plan["num_kv_heads"] != hkv:
        raise ValueError(f"k: has {hkv} heads but the plan was built for "
                         f"{plan['num_kv_heads']}")
    if hkv <= 0 or hq % hkv != 0:
        raise ValueError(f"q: {hq} query heads are not a multiple of the {hkv} KV heads of k")
    check_input_valid = value_checks_requested(opts["check_input_valid"])
    logit_scale, output_scale = call_scales(opts)
    qo_offset, host_offset = override_offsets(plan, q_offset_override, device)

    # KV layout.
    if k.dim() == 4:
        if plan["page_size"] > 0 and k.shape[2] != plan["page_size"]:
            raise ValueError(f"k: page size {k.shape[2]} differs from the plan's "
                             f"{plan['page_size']}")
        if page_table is None:
            page_table = page_table_from_indices(kv_indices, plan, k.shape[2], k.shape[0],
                                                 device, check_input_valid)
        else:
            check_plan_page_table(page_table, plan, k.shape[2], device, k.shape[0],
                                  check_input_valid)
    else:
        if kv_indices is not None:
            raise ValueError("kv_indices: given with dense k [total_k, Hkv, D]; paged K/V are "
                             "[pages, Hkv, page_size, D]")
        if k.shape[0] != plan["total_k"]:
            raise ValueError(f"k: has {k.shape[0]} tokens but the plan's KV lengths sum to "
                             f"{plan['total_k']}")

    # Sparse selection.
    if plan["sparse"]:
        if kv_block_indexes is None:
            raise ValueError("kv_block_indexes: a sparse plan (kv_block_num > 0) needs it")
        if k.dim() != 4:
            raise ValueError("k: sparse mode needs paged K/V [pages, Hkv, page_size, D]")
        kv_block_indexes = kv_head_block_indexes(kv_block_indexes, plan, total_q, hq, hkv,
                                                 device)
        if check_input_valid:
            check_block_index_values(kv_block_indexes, plan["host_qo_lens"],
                                     plan["host_kv_lens"], k.shape[2])
        bridge = plan.get("sparse_bridge")
        if bridge is not None and hq // hkv in SUPPORTED_QHEAD_PER_KV and \
                offsets_fit_bridge(plan, host_offset):
            return sparse_fmha(q, k, v, bridge, out=out, sm_scale=opts["sm_scale"],
                               q_scale=opts["q_scale"], k_scale=opts["k_scale"],
                               v_scale=opts["v_scale"], o_scale=opts["o_scale"],
                               kv_block_indexes=kv_block_indexes,
                               q_offset_override=q_offset_override, page_table=page_table)
    elif kv_block_indexes is not None:
        raise ValueError("kv_block_indexes: given but the plan was built without kv_block_num")

    # Output modes (upstream: no max-score in sparse mode or when the plan has none).
    max_k_tiles = plan["max_k_tiles"]
    want_o = opts["output_o"]
    if plan["sparse"] or not opts["output_maxscore"] or max_k_tiles <= 0:
        max_k_tiles, want_o = -1, True
    out_dtype = BF16
    if out is not None and want_o:
        check_out(out, q, out_dtype)
    if max_score is not None and max_k_tiles > 0:
        check_tensor("max_score", max_score, dtypes=(torch.float32,), ndim=3)
        check_shape("max_score", max_score, (hq, max_k_tiles, total_q))
        check_same_device(q=q, max_score=max_score)

    call = FmhaDenseCall(q=q, k=k, v=v, plan=plan, qo_offset=qo_offset,
                         host_qo_offset=host_offset, page_table=page_table,
                         kv_block_indexes=kv_block_indexes if plan["sparse"] else None,
                         logit_scale=logit_scale, output_scale=output_scale, want_o=want_o,
                         max_k_tiles=max_k_tiles, out_dtype=out_dtype)
    o, ms = run_fmha_dense(call)
    if o is not None and out is not None:
        out.copy_(o)
        o = out
    if ms is not None and max_score is not None:
        max_score.copy_(ms)
        ms = max_score
    return o, ms


def run_fmha_dense(call: FmhaDenseCall):
    """(O or None, max-score or None) of a validated call on the backend _backend chooses."""
    entry = _backend.compile_entry("fmha_dense")
    if entry is not None:
        return entry(call)
    if call.want_o:
        _name, native = _backend.choose("fmha_dense", call.q.device, **call.features())
        return native(call) if native is not None else fmha_dense_reference(call)
    _name, native = _backend.choose("fmha_max_score", call.q.device, **call.features())
    return None, (native(call) if native is not None else max_score_reference(call))
