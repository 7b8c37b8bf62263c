"""Planning an fmha run (contract §2.1): :func:`fmha_sm100_plan` reads the per-request
lengths on the host and builds the plan dicts (see :mod:`msa.fmha` for the keys clients read).

Sparse sub-plans of prefill length go to the bridge's plan (:mod:`.bridge`); a sparse decode
sub-plan carries one too when the bridge can serve it.
"""

from __future__ import annotations

import logging
from typing import Tuple

import torch

from .._common import sm_count
from .._validation import SUPPORTED_TOPK
from .bridge import bridge_plan
from .validation import (TILE, IntOrTensor, check_bool, check_heads, check_int, host_lengths,
                         host_offsets, int32_tensor, prefix_sums)

logger = logging.getLogger("msa")

SPARSE_PREFILL_MIN_Q = 32          # sparse plans: q_len above this is "prefill" (the bridge)
DENSE_PREFILL_MIN_Q = 128          # dense plans: q_len above this is "prefill"
MAX_SCORE_ELEMENT_LIMIT = 1 << 31
SPARSE_KERNEL_MODES = ("auto", "prefill", "decode")
MAX_KV_SPLITS = 64

_PLAN_OPTIONS = dict(num_kv_heads=-1, num_kv_splits=-1, page_size=-1, output_maxscore=False,
                     kv_block_num=-1, usable_SM_count=-1, causal=True, sparse_kernel_mode="auto",
                     use_fp8_kvcache=False, device=None, stream=None)


def fmha_sm100_plan(qo_segment_lens, kv_segment_lens, *args, qo_offset: IntOrTensor = None,
                    split_prefill_decode: bool = True, **kwargs):
    """Plan an fmha run for a batch of requests (contract §2.1). Reads the lengths on the host.

    Args:
      qo_segment_lens, kv_segment_lens: [B] integer tensors (any device): query and KV length
        of each request.
      *args: ``num_qo_heads`` and optionally ``num_kv_heads``.
      qo_offset: int or [B] causal offsets (query i sees keys j <= i + qo_offset[b]); default
        kv_len - q_len (bottom-right).
      split_prefill_decode: split a short-then-long batch at the first q_len above 32 (sparse)
        or 128 (dense) into a decode and a prefill sub-plan.
      Keyword options: num_kv_heads=-1 (-1: taken from k at run time), num_kv_splits=-1 (auto),
        page_size=-1 (> 0: paged KV), output_maxscore=False, kv_block_num=-1 (> 0: sparse
        mode, that many selected blocks per token), usable_SM_count=-1, causal=True,
        sparse_kernel_mode='auto' ('prefill' | 'decode'), use_fp8_kvcache=False,
        device=None (the plan's device), stream=None (accepted; unused).

    Sparse sub-plans whose max q_len is above 32 (mode 'auto') or any sparse sub-plan (mode
    'prefill') go to the bridge (:func:`sparse_fmha_plan`). The max-score width is
    max_k_tiles = ceil(ceil(max_kv/128)/128)*128; when Hq * max_k_tiles * total_q exceeds 2^31
    the max-score output is disabled with a logged warning.

    Returns (has_mixed_prefill, split, batch_size, decode_plan, prefill_plan); without a split,
    (False, 0, B, plan, None).
    """
    if len(args) > 2:
        raise TypeError(f"fmha_sm100_plan: takes num_qo_heads[, num_kv_heads] positionally, got "
                        f"{len(args)} extra positional arguments")
    unknown = set(kwargs) - set(_PLAN_OPTIONS) - {"num_qo_heads"}
    if unknown:
        raise TypeError(f"fmha_sm100_plan: unexpected keyword arguments {sorted(unknown)}")
    opts = dict(_PLAN_OPTIONS)
    opts.update(kwargs)
    if args:
        if "num_qo_heads" in kwargs:
            raise TypeError("num_qo_heads: given positionally and by keyword")
        opts["num_qo_heads"] = args[0]
    if len(args) == 2:
        if "num_kv_heads" in kwargs:
            raise TypeError("num_kv_heads: given positionally and by keyword")
        opts["num_kv_heads"] = args[1]
    if "num_qo_heads" not in opts:
        raise TypeError("num_qo_heads: missing (fmha_sm100_plan(q_lens, kv_lens, num_qo_heads))")
    num_qo_heads, num_kv_heads = check_heads(opts["num_qo_heads"], opts["num_kv_heads"])
    check_bool("split_prefill_decode", split_prefill_decode)
    causal = check_bool("causal", opts["causal"])
    output_maxscore = check_bool("output_maxscore", opts["output_maxscore"])
    check_bool("use_fp8_kvcache", opts["use_fp8_kvcache"])
    kv_block_num = check_int("kv_block_num", opts["kv_block_num"])
    page_size = check_int("page_size", opts["page_size"])
    num_kv_splits = check_int("num_kv_splits", opts["num_kv_splits"])
    usable_sm = check_int("usable_SM_count", opts["usable_SM_count"], minimum=-1)
    mode = opts["sparse_kernel_mode"]
    if mode not in SPARSE_KERNEL_MODES:
        raise ValueError(f"sparse_kernel_mode: expected one of {SPARSE_KERNEL_MODES}, got "
                         f"{mode!r}")
    sparse = kv_block_num > 0
    if sparse and page_size <= 0:
        raise ValueError("page_size: sparse mode (kv_block_num > 0) needs paged KV "
                         f"(page_size > 0), got {page_size}")

    q_lens = host_lengths("qo_segment_lens", qo_segment_lens)
    kv_lens = host_lengths("kv_segment_lens", kv_segment_lens)
    batch = len(q_lens)
    if len(kv_lens) != batch:
        raise ValueError(f"kv_segment_lens: has {len(kv_lens)} requests, qo_segment_lens "
                         f"{batch}")
    offsets = host_offsets("qo_offset", qo_offset, batch,
                           [k - q for q, k in zip(q_lens, kv_lens)])
    device = _resolve_device(opts["device"], qo_segment_lens)
    common = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                  num_kv_splits=num_kv_splits, page_size=page_size,
                  output_maxscore=output_maxscore, kv_block_num=kv_block_num,
                  usable_SM_count=usable_sm, causal=causal, sparse_kernel_mode=mode,
                  use_fp8_kvcache=opts["use_fp8_kvcache"], device=device)

    threshold = SPARSE_PREFILL_MIN_Q if sparse else DENSE_PREFILL_MIN_Q
    split = 0
    if split_prefill_decode and max(q_lens) > threshold:
        split = next(i for i, n in enumerate(q_lens) if n > threshold)
    if split > 0:
        decode = _plan_part(q_lens[:split], kv_lens[:split], offsets[:split], **common)
        prefill = _plan_part(q_lens[split:], kv_lens[split:], offsets[split:], **common)
        return True, split, batch, decode, prefill
    return False, 0, batch, _plan_part(q_lens, kv_lens, offsets, **common), None


def _plan_part(q_lens, kv_lens, offsets, *, num_qo_heads, num_kv_heads, num_kv_splits,
               page_size, output_maxscore, kv_block_num, usable_SM_count, causal,
               sparse_kernel_mode, use_fp8_kvcache, device) -> dict:
    sparse = kv_block_num > 0
    max_q = max(q_lens)
    if sparse and (sparse_kernel_mode == "prefill" or
                   (sparse_kernel_mode == "auto" and max_q > SPARSE_PREFILL_MIN_Q)):
        return bridge_plan(q_lens, kv_lens, offsets, num_qo_heads=num_qo_heads,
                           num_kv_heads=num_kv_heads, num_kv_splits=num_kv_splits,
                           page_size=page_size, output_maxscore=output_maxscore,
                           kv_block_num=kv_block_num, causal=causal,
                           usable_SM_count=usable_SM_count, use_fp8_kvcache=use_fp8_kvcache,
                           device=device)
    total_q, max_kv = sum(q_lens), max(kv_lens)
    max_k_tiles = _max_k_tiles(max_kv) if output_maxscore else -1
    if output_maxscore and num_qo_heads * max_k_tiles * total_q > MAX_SCORE_ELEMENT_LIMIT:
        logger.warning("msa.fmha_sm100_plan: max-score output disabled: %d heads x %d tiles x "
                       "%d queries exceeds 2^31 elements", num_qo_heads, max_k_tiles, total_q)
        max_k_tiles = -1
    paged = page_size > 0
    pages = [-(-k // page_size) for k in kv_lens] if paged else None
    cu_q, cu_k = prefix_sums(q_lens), prefix_sums(kv_lens)
    cu_q_t, cu_k_t = int32_tensor(cu_q, device), int32_tensor(cu_k, device)
    splits, speedup = _split_kv_estimate(q_lens, kv_lens, offsets, causal, num_qo_heads,
                                         sm_count(device, usable_SM_count), num_kv_splits)
    plan = {
        "MM-SA-Nv": False,
        "mode": "sparse_decode" if sparse else "dense",
        "sparse": sparse,
        "batch": len(q_lens),
        "qo_segment_lens": int32_tensor(q_lens, device),
        "kv_segment_lens": int32_tensor(kv_lens, device),
        "qo_segment_offsets": cu_q_t,
        "cu_seqlens_q": cu_q_t,
        "kv_segment_offsets": cu_k_t,
        "cu_seqlens_k": cu_k_t,
        "kv_page_indptr": int32_tensor(prefix_sums(pages), device) if paged else None,
        "qo_offset": int32_tensor(offsets, device),
        "total_q": total_q,
        "total_k": cu_k[-1],
        "total_pages": sum(pages) if paged else 0,
        "total_rows": sum(pages) if paged else sum(-(-k // TILE) for k in kv_lens),
        "max_qo_len": max_q,
        "max_seqlen_q": max_q,
        "max_seqlen_k": max_kv,
        "max_k_tiles": max_k_tiles,
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "page_size": page_size,
        "kv_block_num": kv_block_num,
        "causal": causal,
        "num_kv_splits": splits,
        "predicted_speedup": speedup,
        "pack_factor": 1,
        "usable_SM_count": usable_SM_count,
        "use_fp8_kvcache": use_fp8_kvcache,
        "host_qo_lens": list(q_lens),
        "host_kv_lens": list(kv_lens),
        "host_qo_offset": list(offsets),
        "sparse_bridge": None,
    }
    # A sparse decode sub-plan runs through the bridge too when the bridge can serve it (so it
    # reaches the native sparse kernels); otherwise through the block-selected dense path.
    if (sparse and causal and page_size == TILE and kv_block_num in SUPPORTED_TOPK and
            all(0 <= q + o <= k for q, k, o in zip(q_lens, kv_lens, offsets))):
        plan["sparse_bridge"] = bridge_plan(
            q_lens, kv_lens, offsets, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            num_kv_splits=num_kv_splits, page_size=page_size, output_maxscore=False,
            kv_block_num=kv_block_num, causal=True, usable_SM_count=usable_SM_count,
            use_fp8_kvcache=use_fp8_kvcache, device=device, check_groups=False)
    return plan


def _resolve_device(device, lengths) -> torch.device:
    """Explicit device; else the lengths' device when it is not the CPU; else the current CUDA
    device when there is one (upstream's default); else the CPU."""
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if isinstance(lengths, torch.Tensor) and lengths.device.type != "cpu":
        return lengths.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _max_k_tiles(max_kv: int) -> int:
    """ceil(ceil(max_kv / 128) / 128) * 128: the tile axis rounded up to a multiple of 128."""
    return -(-(-(-max_kv // TILE)) // TILE) * TILE


def _split_kv_estimate(q_lens, kv_lens, offsets, causal, num_heads, num_ctas,
                       requested_splits) -> Tuple[int, float]:
    """Returns (num_kv_splits, predicted_speedup).

    Work model: one item per (request, 128-query tile, query head) costing its visible 128-key
    tiles. Without splitting, the makespan is max(longest item, total / SMs); with s splits the
    longest item shrinks to ceil(longest / s) plus one tile of combine work. predicted_speedup
    is the ratio of the two makespans. With num_kv_splits=-1 (auto) the split count is chosen
    by the model and the speedup is >= 1.0 (1.0: no split, or no work); a forced
    num_kv_splits > 1 may predict < 1.0. It is a planning estimate (the benchmark reports it);
    results never depend on it.
    """
    costs = []
    for q_len, kv_len, off in zip(q_lens, kv_lens, offsets):
        for t in range(-(-q_len // TILE)):
            q_end = min((t + 1) * TILE, q_len)
            eff = min(q_end + off, kv_len) if causal else kv_len
            costs.append(-(-max(eff, 0) // TILE))
    total = sum(costs) * num_heads
    longest = max(costs, default=0)
    if total == 0:
        return max(requested_splits, 1), 1.0
    balanced = -(-total // num_ctas)
    unsplit = max(longest, balanced)
    if requested_splits > 0:
        splits = requested_splits
    else:
        splits = min(MAX_KV_SPLITS, max(1, -(-longest // balanced)))
    if splits <= 1:
        return 1, 1.0
    split_time = max(-(-longest // splits), balanced) + 1
    speedup = unsplit / split_time
    if requested_splits <= 0 and speedup <= 1.0:
        return 1, 1.0
    return splits, speedup
