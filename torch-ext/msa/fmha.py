"""The fmha-style plan/run API of upstream ``fmha_sm100`` (contract §2.1, §2.2, §2.4).

Engine flow: a dense "proxy" pass with ``output_maxscore`` gives per-128-token-tile max scores,
``sparse_topk_select`` turns them into ``kv_block_indexes``, and a sparse pass attends over the
selected blocks only.

* :func:`fmha_sm100_plan` (alias :func:`fmha_plan`) reads the per-request lengths on the host
  and returns ``(has_mixed_prefill, split, batch_size, decode_plan, prefill_plan)``.
* :func:`fmha_sm100` (alias :func:`fmha`) runs a plan: dense, paged or sparse attention, the
  max-score output, or both.
* :func:`sparse_fmha_plan` / :func:`sparse_fmha` are the bridge from the fmha API to
  :func:`msa.sparse_atten_func` (plans carrying ``"MM-SA-Nv": True``).

Semantics shared by every path (contract §0): key j of request b is visible to its batch-local
query i iff ``j < kv_len[b]`` and, if causal, ``j <= i + qo_offset[b]`` (default qo_offset =
kv_len - q_len), and in sparse mode iff also ``j // page_size`` is among the query's selected
blocks for that KV head. Logits are ``sm_scale * q_scale * k_scale * <q, k>`` (sm_scale default
128**-0.5); the output is multiplied by ``v_scale * o_scale``. The sparse bridge applies the
four FP8 scales the same way (contract D5: folded into softmax_scale and the output), where
upstream's bridge ignores them.

Plans are plain dicts. Keys clients read: ``"MM-SA-Nv"``, ``"qo_segment_offsets"`` (cumulative
query lengths; ``pack_factor`` is always 1 here, so ``[-1] // pack_factor`` is the token count),
``"kv_page_indptr"`` (cumulative pages, paged plans), ``"kv_segment_offsets"`` /
``"cu_seqlens_k"`` (cumulative KV lengths), ``"total_rows"`` (sum of ceil(kv_len / page_size),
or of ceil(kv_len / 128) without paging) and ``"predicted_speedup"`` (see
:func:`_split_kv_estimate`). Other keys are private. Planning reads lengths on the host (it
synchronizes); device tensors of a plan live on the plan's device and are moved to q's device
at run time when they differ.

Dispatch: ``_backend.choose("fmha_dense", ...)`` for O (with or without max-score, dense or
block-selected); ``_backend.choose("fmha_max_score", ...)`` for the max-score-only proxy pass,
whose reference is :func:`msa.block_max_scores` (imported lazily from ``.indexer``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import _backend
from ._common import sm_count
from ._common import to_device as _to
from ._validation import (check_page_table, FP8, HEAD_DIM, SUPPORTED_QHEAD_PER_KV, SUPPORTED_TOPK, check_head_dim,
                          check_page_ids, check_qhead_per_kv, check_same_device, check_scale,
                          check_shape, check_tensor, check_topk, host_int64,
                          value_checks_requested)
from .interface import build_k2q_csr, sparse_atten_func
from .reference.dense_attention import (dense_attention_reference, dense_token_kv,
                                        paged_token_kv)

logger = logging.getLogger("msa")

BF16 = torch.bfloat16
TILE = 128                         # max-score tile and sparse-bridge block size
SPARSE_PREFILL_MIN_Q = 32          # sparse plans: q_len above this is "prefill" (the bridge)
DENSE_PREFILL_MIN_Q = 128          # dense plans: q_len above this is "prefill"
MAX_SCORE_ELEMENT_LIMIT = 1 << 31
SPARSE_KERNEL_MODES = ("auto", "prefill", "decode")
MAX_KV_SPLITS = 64

_PLAN_OPTIONS = dict(num_kv_heads=-1, num_kv_splits=-1, page_size=-1, output_maxscore=False,
                     kv_block_num=-1, usable_SM_count=-1, causal=True, sparse_kernel_mode="auto",
                     use_fp8_kvcache=False, device=None, stream=None)
_RUN_OPTIONS = dict(sm_scale=None, q_scale=None, k_scale=None, v_scale=None, o_scale=None,
                    output_maxscore=True, output_o=True, check_input_valid=False)

IntOrTensor = Union[int, torch.Tensor, None]


# ---------------------------------------------------------------------------------------------
# Host-side helpers
# ---------------------------------------------------------------------------------------------

def _host_lengths(name: str, lengths) -> List[int]:
    """[B] integer tensor (any device) or sequence of ints -> host list of ints >= 0."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or \
                lengths.dtype == torch.bool:
            raise TypeError(f"{name}: dtype {lengths.dtype} is not supported; expected an "
                            "integer tensor (int32 or int64)")
        if lengths.dim() != 1:
            raise ValueError(f"{name}: expected shape [B], got {list(lengths.shape)}")
        values = [int(x) for x in lengths.tolist()]
    elif isinstance(lengths, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in lengths):
            raise TypeError(f"{name}: expected ints")
        values = list(lengths)
    else:
        raise TypeError(f"{name}: expected a [B] integer tensor, got {type(lengths).__name__}")
    if not values:
        raise ValueError(f"{name}: expected at least one request")
    if min(values) < 0:
        raise ValueError(f"{name}: lengths must be >= 0, got {min(values)}")
    return values


def _host_offsets(name: str, qo_offset, batch: int, default: List[int]) -> List[int]:
    """None -> default; int -> broadcast; [B] (or [1]) integer tensor / sequence -> host list."""
    if qo_offset is None:
        return list(default)
    if isinstance(qo_offset, bool):
        raise TypeError(f"{name}: expected an int or a [B] integer tensor, got bool")
    if isinstance(qo_offset, int):
        return [qo_offset] * batch
    if isinstance(qo_offset, torch.Tensor):
        if qo_offset.dtype.is_floating_point or qo_offset.dtype == torch.bool:
            raise TypeError(f"{name}: dtype {qo_offset.dtype} is not supported; expected an "
                            "integer tensor")
        values = [int(x) for x in qo_offset.reshape(-1).tolist()]
    elif isinstance(qo_offset, (list, tuple)):
        values = [int(x) for x in qo_offset]
    else:
        raise TypeError(f"{name}: expected an int or a [B] integer tensor, got "
                        f"{type(qo_offset).__name__}")
    if len(values) == 1 and batch > 1:
        values = values * batch
    if len(values) != batch:
        raise ValueError(f"{name}: expected {batch} offsets (one per request), got {len(values)}")
    return values


def _cumsum(values: Sequence[int]) -> List[int]:
    out = [0]
    for x in values:
        out.append(out[-1] + int(x))
    return out


def _i32(values: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


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


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def _check_int(name: str, value, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def _check_heads(num_qo_heads, num_kv_heads) -> Tuple[int, int]:
    """num_kv_heads -1 means "take Hkv from k at run time"."""
    _check_int("num_qo_heads", num_qo_heads, minimum=1)
    _check_int("num_kv_heads", num_kv_heads)
    if num_kv_heads == 0 or num_kv_heads < -1:
        raise ValueError(f"num_kv_heads: must be -1 or >= 1, got {num_kv_heads}")
    if num_kv_heads > 0 and num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    return num_qo_heads, num_kv_heads


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


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------

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
    num_qo_heads, num_kv_heads = _check_heads(opts["num_qo_heads"], opts["num_kv_heads"])
    _check_bool("split_prefill_decode", split_prefill_decode)
    causal = _check_bool("causal", opts["causal"])
    output_maxscore = _check_bool("output_maxscore", opts["output_maxscore"])
    _check_bool("use_fp8_kvcache", opts["use_fp8_kvcache"])
    kv_block_num = _check_int("kv_block_num", opts["kv_block_num"])
    page_size = _check_int("page_size", opts["page_size"])
    num_kv_splits = _check_int("num_kv_splits", opts["num_kv_splits"])
    usable_sm = _check_int("usable_SM_count", opts["usable_SM_count"], minimum=-1)
    mode = opts["sparse_kernel_mode"]
    if mode not in SPARSE_KERNEL_MODES:
        raise ValueError(f"sparse_kernel_mode: expected one of {SPARSE_KERNEL_MODES}, got "
                         f"{mode!r}")
    sparse = kv_block_num > 0
    if sparse and page_size <= 0:
        raise ValueError("page_size: sparse mode (kv_block_num > 0) needs paged KV "
                         f"(page_size > 0), got {page_size}")

    q_lens = _host_lengths("qo_segment_lens", qo_segment_lens)
    kv_lens = _host_lengths("kv_segment_lens", kv_segment_lens)
    batch = len(q_lens)
    if len(kv_lens) != batch:
        raise ValueError(f"kv_segment_lens: has {len(kv_lens)} requests, qo_segment_lens "
                         f"{batch}")
    offsets = _host_offsets("qo_offset", qo_offset, batch,
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
        return _bridge_plan(q_lens, kv_lens, offsets, num_qo_heads=num_qo_heads,
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
    cu_q, cu_k = _cumsum(q_lens), _cumsum(kv_lens)
    cu_q_t, cu_k_t = _i32(cu_q, device), _i32(cu_k, device)
    splits, speedup = _split_kv_estimate(q_lens, kv_lens, offsets, causal, num_qo_heads,
                                         sm_count(device, usable_SM_count), num_kv_splits)
    plan = {
        "MM-SA-Nv": False,
        "mode": "sparse_decode" if sparse else "dense",
        "sparse": sparse,
        "batch": len(q_lens),
        "qo_segment_lens": _i32(q_lens, device),
        "kv_segment_lens": _i32(kv_lens, device),
        "qo_segment_offsets": cu_q_t,
        "cu_seqlens_q": cu_q_t,
        "kv_segment_offsets": cu_k_t,
        "cu_seqlens_k": cu_k_t,
        "kv_page_indptr": _i32(_cumsum(pages), device) if paged else None,
        "qo_offset": _i32(offsets, device),
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
        plan["sparse_bridge"] = _bridge_plan(
            q_lens, kv_lens, offsets, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            num_kv_splits=num_kv_splits, page_size=page_size, output_maxscore=False,
            kv_block_num=kv_block_num, causal=True, usable_SM_count=usable_SM_count,
            use_fp8_kvcache=use_fp8_kvcache, device=device, check_groups=False)
    return plan


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
    q_lens = _host_lengths("qo_segment_lens", qo_segment_lens)
    kv_lens = _host_lengths("kv_segment_lens", kv_segment_lens)
    if len(kv_lens) != len(q_lens):
        raise ValueError(f"kv_segment_lens: has {len(kv_lens)} requests, qo_segment_lens "
                         f"{len(q_lens)}")
    offsets = _host_offsets("qo_offset", qo_offset, len(q_lens),
                            [k - q for q, k in zip(q_lens, kv_lens)])
    device = qo_segment_lens.device if isinstance(qo_segment_lens, torch.Tensor) else \
        torch.device("cpu")
    return _bridge_plan(q_lens, kv_lens, offsets, num_qo_heads=num_qo_heads,
                        num_kv_heads=num_kv_heads, num_kv_splits=num_kv_splits,
                        page_size=page_size, output_maxscore=output_maxscore,
                        kv_block_num=kv_block_num, causal=causal,
                        usable_SM_count=usable_SM_count, use_fp8_kvcache=use_fp8_kvcache,
                        device=device)


def _bridge_plan(q_lens, kv_lens, offsets, *, num_qo_heads, num_kv_heads, num_kv_splits,
                 page_size, output_maxscore, kv_block_num, causal, usable_SM_count,
                 use_fp8_kvcache, device, check_groups: bool = True) -> dict:
    num_qo_heads, num_kv_heads = _check_heads(num_qo_heads, num_kv_heads)
    check_topk("kv_block_num", kv_block_num)
    _check_int("page_size", page_size)
    if page_size < 1:
        raise ValueError(f"page_size: the sparse bridge needs paged KV (page_size >= 1), got "
                         f"{page_size}")
    if page_size != TILE:
        raise NotImplementedError(f"page_size: the sparse bridge supports page_size {TILE} "
                                  f"only, got {page_size}")
    if _check_bool("output_maxscore", output_maxscore):
        raise NotImplementedError("output_maxscore: the sparse bridge emits no max-score; plan "
                                  "the proxy pass without kv_block_num")
    if not _check_bool("causal", causal):
        raise NotImplementedError("causal: the sparse bridge supports causal=True only")
    _check_int("num_kv_splits", num_kv_splits)
    _check_int("usable_SM_count", usable_SM_count, minimum=-1)
    _check_bool("use_fp8_kvcache", use_fp8_kvcache)
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
    cu_q, cu_k = _cumsum(q_lens), _cumsum(kv_lens)
    cu_q_t, cu_k_t = _i32(cu_q, device), _i32(cu_k, device)
    return {
        "MM-SA-Nv": True,
        "mode": "sparse_prefill",
        "sparse": True,
        "batch": len(q_lens),
        "qo_segment_lens": _i32(q_lens, device),
        "kv_segment_lens": _i32(kv_lens, device),
        "cu_seqlens_q": cu_q_t,
        "qo_segment_offsets": cu_q_t,
        "cu_seqlens_k": cu_k_t,
        "kv_segment_offsets": cu_k_t,
        "kv_page_indptr": _i32(_cumsum(pages), device),
        "seqused_k": _i32(seqused, device),
        "qo_offset": _i32(offsets, device),
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


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class FmhaDenseCall:
    """One validated dense / block-selected fmha call, as every backend receives it."""
    q: torch.Tensor                        # [total_q, Hq, 128] bf16 | e4m3
    k: torch.Tensor                        # dense [total_k, Hkv, 128] | paged [P, Hkv, ps, 128]
    v: torch.Tensor
    plan: dict
    qo_offset: torch.Tensor                # [B] int32 on q's device
    host_qo_offset: Optional[List[int]]    # the same on the host when known without a sync
    page_table: Optional[torch.Tensor]     # [B, max_pages] int32 (paged)
    kv_block_indexes: Optional[torch.Tensor]   # [total_q, Hkv, kv_block_num] int32 (sparse)
    logit_scale: float                     # sm_scale * q_scale * k_scale
    output_scale: float                    # v_scale * o_scale
    want_o: bool
    max_k_tiles: int                       # > 0: emit max-score [Hq, max_k_tiles, total_q]
    out_dtype: torch.dtype

    @property
    def paged(self) -> bool:
        return self.k.dim() == 4

    @property
    def mode(self) -> int:
        """Upstream mode code: 0 sparse, 1 O + max-score, 2 max-score only, 3 O only."""
        if self.kv_block_indexes is not None:
            return 0
        if self.max_k_tiles > 0:
            return 1 if self.want_o else 2
        return 3

    def features(self) -> dict:
        return dict(q_dtype=self.q.dtype, k_dtype=self.k.dtype, paged=self.paged,
                    page_size=self.k.shape[2] if self.paged else -1,
                    causal=self.plan["causal"], mode=self.mode,
                    qhead_per_kv=self.q.shape[1] // self.k.shape[1],
                    num_qo_heads=self.q.shape[1], num_kv_heads=self.k.shape[1],
                    work_items=self.work_items,
                    kv_splits=int(self.plan.get("num_kv_splits", 1) or 1))

    @property
    def q_tiles(self) -> int:
        """128-query tiles of the longest request, at least 1 (a query-outer grid's x extent)."""
        return max(-(-int(self.plan.get("max_seqlen_q", 0)) // TILE), 1)

    @property
    def work_items(self) -> int:
        """(128-query tile, q head, request) items of a query-outer kernel grid."""
        return self.q_tiles * self.q.shape[1] * int(self.plan.get("batch", 1))


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
    _check_qkv(q, k, v)
    output_o = _check_bool("output_o", opts["output_o"])
    output_maxscore = _check_bool("output_maxscore", opts["output_maxscore"])
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
        _check_out(out, q, out_dtype)
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
        _check_plan_dict("plan_info", plan_info)
        return False, 0, plan_info["batch"], plan_info, None
    if not isinstance(plan_info, (tuple, list)) or len(plan_info) != 5:
        raise TypeError("plan_info: expected the 5-tuple returned by fmha_sm100_plan")
    mixed, split, batch, decode, prefill = plan_info
    _check_plan_dict("plan_info[3]", decode)
    if mixed:
        _check_plan_dict("plan_info[4]", prefill)
    return bool(mixed), int(split), int(batch), decode, prefill


def _check_plan_dict(name, plan):
    if not isinstance(plan, dict) or "MM-SA-Nv" not in plan or "host_qo_lens" not in plan:
        raise TypeError(f"{name}: expected a plan from fmha_sm100_plan or sparse_fmha_plan")


def _check_qkv(q, k, v):
    check_tensor("q", q, dtypes=(BF16, FP8), ndim=3)
    check_head_dim("q", q.shape[2])
    check_tensor("k", k, dtypes=(BF16, FP8), ndim=(3, 4))
    check_tensor("v", v, dtypes=(BF16, FP8), ndim=(3, 4))
    if v.dtype != k.dtype:
        raise TypeError(f"v: dtype {v.dtype} differs from k's {k.dtype}")
    if q.dtype == FP8 and k.dtype != FP8:
        raise TypeError("k: e4m3 q needs e4m3 K/V (bf16 q may use bf16 or e4m3 K/V)")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {list(v.shape)} differs from k's {list(k.shape)}")
    check_head_dim("k", k.shape[-1])
    check_same_device(q=q, k=k, v=v)


def _check_out(out, q, out_dtype):
    check_tensor("out", out, dtypes=(out_dtype,), ndim=3)
    check_shape("out", out, (q.shape[0], q.shape[1], HEAD_DIM))
    check_same_device(q=q, out=out)


def _scales(opts) -> Tuple[float, float]:
    sm_scale = check_scale("sm_scale", opts["sm_scale"])
    sm_scale = HEAD_DIM ** -0.5 if sm_scale is None else sm_scale
    factors = [check_scale(n, opts[n]) for n in ("q_scale", "k_scale", "v_scale", "o_scale")]
    q_scale, k_scale, v_scale, o_scale = [1.0 if f is None else f for f in factors]
    return sm_scale * q_scale * k_scale, v_scale * o_scale


def _override_offsets(plan, q_offset_override, device) -> Tuple[torch.Tensor, Optional[List]]:
    """(device [B] int32 offsets, host list when known without a device read)."""
    batch = plan["batch"]
    if q_offset_override is None:
        return _to(plan["qo_offset"], device), plan["host_qo_offset"]
    if isinstance(q_offset_override, bool):
        raise TypeError("q_offset_override: expected an int or a [B] integer tensor")
    if isinstance(q_offset_override, int):
        host = [q_offset_override] * batch
        return _i32(host, device), host
    check_tensor("q_offset_override", q_offset_override,
                 dtypes=(torch.int32, torch.int64), ndim=1)
    if q_offset_override.numel() not in (1, batch):
        raise ValueError(f"q_offset_override: expected shape [{batch}], got "
                         f"{list(q_offset_override.shape)}")
    t = q_offset_override.to(device, torch.int32).expand(batch).contiguous()
    return t, None


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
    logit_scale, output_scale = _scales(opts)
    qo_offset, host_offset = _override_offsets(plan, q_offset_override, device)

    # KV layout.
    if k.dim() == 4:
        if plan["page_size"] > 0 and k.shape[2] != plan["page_size"]:
            raise ValueError(f"k: page size {k.shape[2]} differs from the plan's "
                             f"{plan['page_size']}")
        if page_table is None:
            page_table = _page_table_from_indices(kv_indices, plan, k.shape[2], k.shape[0],
                                                  device, check_input_valid)
        else:
            _check_page_table(page_table, plan, k.shape[2], device, k.shape[0],
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
        kv_block_indexes = _kv_head_block_indexes(kv_block_indexes, plan, total_q, hq, hkv,
                                                  device)
        if check_input_valid:
            _validate_block_indexes(kv_block_indexes, plan["host_qo_lens"],
                                    plan["host_kv_lens"], k.shape[2])
        bridge = plan.get("sparse_bridge")
        if bridge is not None and hq // hkv in SUPPORTED_QHEAD_PER_KV and \
                _offsets_fit_bridge(plan, host_offset):
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
        _check_out(out, q, out_dtype)
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
    return None, (native(call) if native is not None else _max_score_via_indexer(call))


def fmha_dense_reference(call: FmhaDenseCall, compute_dtype=torch.float32):
    """The reference backend of "fmha_dense": (O [total_q, Hq, 128] out_dtype or None,
    max_score [Hq, max_k_tiles, total_q] fp32 or None)."""
    plan = call.plan
    host_offset = call.host_qo_offset
    if host_offset is None:
        host_offset = [int(x) for x in call.qo_offset.tolist()]
    kv = _token_kv(call)
    p_quant = FP8 if call.v.dtype == FP8 else None
    o, ms = dense_attention_reference(
        call.q, kv, plan["host_qo_lens"], plan["host_kv_lens"], host_offset,
        causal=plan["causal"], logit_scale=call.logit_scale, output_scale=call.output_scale,
        want_o=call.want_o, max_k_tiles=call.max_k_tiles, selection=call.kv_block_indexes,
        selection_block=call.k.shape[2] if call.paged else TILE, p_quant_dtype=p_quant,
        compute_dtype=compute_dtype)
    return (None if o is None else o.to(call.out_dtype)), ms


def _token_kv(call: FmhaDenseCall):
    plan = call.plan
    if not call.paged:
        return dense_token_kv(call.k, call.v, plan["host_kv_lens"])
    table = call.page_table.to("cpu", torch.int64)
    return paged_token_kv(call.k, call.v, plan["host_kv_lens"], list(table))


def _max_score_via_indexer(call: FmhaDenseCall) -> torch.Tensor:
    """Max-score-only reference: msa.block_max_scores with scale sm_scale*q_scale*k_scale.

    FP8 inputs are widened to bf16 (exact for e4m3). Paged K whose page size is not 128 is
    gathered into dense rows first, since block_max_scores pages by 128-token blocks.
    """
    from .indexer import block_max_scores   # lazy: the indexer module is optional here

    plan = call.plan
    device = call.q.device
    q_idx = call.q if call.q.dtype == BF16 else call.q.to(BF16)
    k_idx = call.k if call.k.dtype == BF16 else call.k.to(BF16)
    cu_q = _to(plan["cu_seqlens_q"], device)
    cu_k = _to(plan["cu_seqlens_k"], device)
    kwargs = dict(max_seqlen_q=plan["max_seqlen_q"], max_seqlen_k=max(plan["max_seqlen_k"], 1),
                  scale=call.logit_scale, causal=plan["causal"],
                  qo_offset=call.qo_offset if plan["causal"] else None,
                  max_k_tiles=call.max_k_tiles)
    if call.paged and call.k.shape[2] == TILE:
        kwargs.update(page_table=call.page_table,
                      seqused_k=_to(plan["kv_segment_lens"], device))
    elif call.paged:
        kv = _token_kv(call)
        rows = [kv.gather(b, 0, n)[0] for b, n in enumerate(plan["host_kv_lens"])]
        k_idx = torch.cat(rows, 0).to(BF16)
    return block_max_scores(q_idx, k_idx, cu_q, cu_k, **kwargs)


def _page_table_from_indices(kv_indices, plan, page_size, num_pages, device,
                             check_input_valid) -> torch.Tensor:
    """Flat kv_indices (request after request) -> [B, max_pages] int32 page table on device.
    Unused slots hold 0 (never read: they lie past the request's length)."""
    if kv_indices is None:
        raise ValueError("kv_indices: paged K/V need kv_indices (or a page_table on "
                         "sparse-prefill plans)")
    check_tensor("kv_indices", kv_indices, dtypes=(torch.int32,), ndim=1)
    pages = [-(-n // page_size) for n in plan["host_kv_lens"]]
    need = sum(pages)
    if kv_indices.shape[0] < need:
        raise ValueError(f"kv_indices: has {kv_indices.shape[0]} entries but the requests need "
                         f"{need} pages")
    if check_input_valid and need:
        host = kv_indices[:need].to("cpu", torch.int64)
        if int(host.min()) < 0 or int(host.max()) >= num_pages:
            raise ValueError(f"kv_indices: values must lie in [0, {num_pages})")
    table = torch.zeros(plan["batch"], max(max(pages), 1), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = kv_indices[start:start + n].to(device)
        start += n
    return table


def _check_page_table(page_table, plan, page_size, device, num_pages, check_input_valid):
    need = max(-(-n // page_size) for n in plan["host_kv_lens"])
    check_page_table(page_table, plan["batch"], min_pages=need)
    if page_table.device != device:
        raise ValueError(f"page_table: is on {page_table.device} but q is on {device}")
    if check_input_valid:
        check_page_ids("page_table", host_int64(t=page_table)["t"],
                       torch.tensor(plan["host_kv_lens"], dtype=torch.int64), page_size,
                       num_pages)


def _kv_head_block_indexes(kv_block_indexes, plan, total_q, hq, hkv, device) -> torch.Tensor:
    """[T, Hkv | Hq, n] -> [T, Hkv, n] (with Hq rows, every G-th head row is used)."""
    check_tensor("kv_block_indexes", kv_block_indexes, dtypes=(torch.int32,), ndim=3)
    if kv_block_indexes.device != device:
        raise ValueError(f"kv_block_indexes: is on {kv_block_indexes.device} but q is on "
                         f"{device}")
    t, h, n = kv_block_indexes.shape
    if t != total_q or n != plan["kv_block_num"] or h not in (hkv, hq):
        raise ValueError(f"kv_block_indexes: expected shape [{total_q}, {hkv} or {hq}, "
                         f"{plan['kv_block_num']}], got {list(kv_block_indexes.shape)}")
    if h == hkv:
        return kv_block_indexes
    return kv_block_indexes[:, ::hq // hkv]


def _validate_block_indexes(kv_block_indexes, q_lens, kv_lens, page_size) -> None:
    """check_input_valid: ids >= 0 strictly ascending, -1 only at the tail, ids below the
    request's page count (ceil(kv_len / page_size))."""
    sel = kv_block_indexes.to("cpu", torch.int64)
    if sel.numel() == 0:
        return
    valid = sel != -1
    if bool((sel < -1).any()):
        raise ValueError("kv_block_indexes: entries must be block ids >= 0 or -1")
    if bool((valid[..., 1:] & ~valid[..., :-1]).any()):
        raise ValueError("kv_block_indexes: -1 padding must sit at the tail of each row")
    both = valid[..., 1:] & valid[..., :-1]
    if bool((both & (sel[..., 1:] <= sel[..., :-1])).any()):
        raise ValueError("kv_block_indexes: valid entries must be strictly ascending")
    pages = torch.tensor([-(-n // page_size) for n in kv_lens], dtype=torch.int64)
    limit = torch.repeat_interleave(pages, torch.tensor(q_lens, dtype=torch.int64))
    if bool((valid & (sel >= limit.view(-1, 1, 1))).any()):
        raise ValueError("kv_block_indexes: an id is out of range for its request's page count")


def _offsets_fit_bridge(plan, host_offset) -> bool:
    """The bridge expresses offsets as seqused_k = q_len + offset <= kv_len; an override that
    cannot be read without a sync, or does not fit, takes the block-selected dense path."""
    if host_offset is None:
        return False
    return all(0 <= q + o <= k for q, k, o in
               zip(plan["host_qo_lens"], plan["host_kv_lens"], host_offset))


# ---------------------------------------------------------------------------------------------
# The sparse bridge
# ---------------------------------------------------------------------------------------------

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

    O is bf16. Visibility and math are those of fmha_sm100's sparse mode (see module doc).
    """
    _check_plan_dict("plan_info", plan_info)
    if not plan_info["MM-SA-Nv"]:
        raise ValueError("plan_info: not a sparse-prefill plan (use fmha_sm100)")
    if kv_block_indexes is None:
        raise ValueError("kv_block_indexes: sparse_fmha needs the selected blocks")
    _check_qkv(q, k, v)
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
    logit_scale, output_scale = _scales(dict(sm_scale=sm_scale, q_scale=q_scale,
                                             k_scale=k_scale, v_scale=v_scale, o_scale=o_scale))
    selection = _kv_head_block_indexes(kv_block_indexes, plan, total_q, hq, hkv, device)
    check_input_valid = value_checks_requested(check_input_valid)
    if check_input_valid:
        _validate_block_indexes(selection, plan["host_qo_lens"], plan["host_kv_lens"],
                                plan["page_size"])
    q2k = selection.permute(1, 0, 2).contiguous()                 # [Hkv, total_q, n]

    if page_table is not None:                                    # wins over kv_indices
        _check_page_table(page_table, plan, plan["page_size"], device, k.shape[0],
                          check_input_valid)
    else:
        page_table = _page_table_from_indices(kv_indices, plan, plan["page_size"], k.shape[0],
                                              device, check_input_valid)
    seqused_k = _to(plan["seqused_k"], device)
    if q_offset_override is not None:
        offsets, host = _override_offsets(plan, q_offset_override, device)
        if host is not None and not _offsets_fit_bridge(plan, host):
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
        _check_out(out, q, BF16)
        out.copy_(result)
        return out, None
    return result, None


# Hardware-neutral names (the same functions).
fmha_plan = fmha_sm100_plan
fmha = fmha_sm100
