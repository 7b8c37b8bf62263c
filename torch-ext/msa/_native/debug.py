"""Test and benchmark hooks of the native glue, as context managers.

Production code only reads them: with no ``forcing`` / ``poisoned_outputs`` block open, every
call runs what the serving tables pick and nothing is filled before a launch.

    from msa._native import debug
    with debug.forcing(fmha_form="wsup", fmha_split_kv=False), debug.poisoned_outputs():
        msa.fmha(...)
    debug.last_variant("fmha_dense")          # the artifact the last fmha call launched

Hooks (``forcing`` keywords):
  fmha_form          a form of cute_kernels.variants.FMHA_FORMS: serves every O-only fmha call
                     it is built for (others run their served form)
  fmha_split_kv      False: plans with num_kv_splits > 1 run unsplit
  sparse_form        a form of SPARSE_FORMS: serves every sparse attention call it is built for
  persistent_ctas    an int: the CTA count persistent CuTe kernels launch instead of the SM
                     count (few CTAs, so each takes many work items from its queue)
  decode_split_keys  False: the decode kernel never splits a page's keys across warps
  decode_direct_fp8  False: split-keys decode tiles with e4m3 q and K/V take the bf16-staged path
  decode_warpgroup   True: the decode kernel's warpgroup (wgmma) form runs every tile it can
                     (q and K/V of one dtype); False: it runs none
  decode_pingpong    True: warpgroup-form calls (q and K/V of one dtype) take its ping-pong
                     form (producer + two consumer warpgroups); False: they never do
  decode_persistent  True: ping-pong calls whose plan has the persistent form take it (dense
                     calls, schedule.persistent_ctas); False: they run the plan's work items
  decode_pv_fp8      True: e4m3 ping-pong / persistent calls run P.V on e4m3 wgmma (V^T
                     tiles); False: on f16 wgmma (V widened)
  decode_token_warps True: sparse decode calls of e4m3 q and K/V with tiles of > 16 rows take
                     the token-warps form (a warp per 16 rows, only its tokens' pages; also by
                     its name, "per_warp"); False: the warpgroup forms
  decode_indexer_tma True: the decode indexer's e4m3 index pages arrive as TMA copies (sm_90+);
                     False: as every thread's cp.asyncs
  decode_indexer_offer_warp  True: decode indexer calls of 17-32 rows a request run the
                     offer-warp form (a ninth warp holds the candidate lists); False: warp 0
                     offers and scores
  decode_indexer_butterfly_merge  True: the decode indexer merges a request's chunk lists as a
                     butterfly of bitonic merges over each row's lanes; False: in topk - 1
                     rounds of segment maxima
  topk_staged        True: sparse_topk_select calls of the staged kernel's shapes
                     (topk_cuda.staged_applies) run it (a warp per row); False: the
                     lane-per-query kernels
  topk_staged_wide   True: staged calls past 768 blocks take it where the CTA's queries leave
                     room (topk_cuda.VALIDATED_STAGED_WIDE); False: the lane-per-query kernels
  csr_counting_sort  True: build_k2q_csr calls of the counting sort's sizes
                     (csr_builder.counting_sort_applies) take it; False: the radix sort
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional

HOOKS = ("fmha_form", "fmha_split_kv", "sparse_form", "persistent_ctas", "decode_split_keys",
         "decode_direct_fp8", "decode_warpgroup", "decode_pingpong", "decode_persistent",
         "decode_pv_fp8", "decode_token_warps", "decode_indexer_tma",
         "decode_indexer_offer_warp", "decode_indexer_butterfly_merge", "topk_staged",
         "topk_staged_wide", "csr_counting_sort")

_forced: Dict[str, object] = {}
_poison = [False]
_last_variant: Dict[str, str] = {}


@contextlib.contextmanager
def forcing(**hooks) -> Iterator[None]:
    """Set the named hooks (see the module docstring) for the block; None leaves one unset."""
    unknown = set(hooks) - set(HOOKS)
    if unknown:
        raise TypeError(f"forcing: unknown hooks {sorted(unknown)}; the hooks are "
                        f"{', '.join(HOOKS)}")
    saved = dict(_forced)
    _forced.update({name: value for name, value in hooks.items() if value is not None})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def forced(name: str) -> Optional[object]:
    """The value a `forcing` block set for hook `name`, else None."""
    return _forced.get(name)


def gate(name: str, served: bool) -> bool:
    """A kernel form's switch: the value a `forcing` block set for hook `name` (as a bool),
    else `served` (what the serving tables pick)."""
    value = _forced.get(name)
    return served if value is None else bool(value)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Native launches fill their outputs and workspaces with NaN first (a row the kernel does
    not write then shows)."""
    saved = _poison[0]
    _poison[0] = True
    try:
        yield
    finally:
        _poison[0] = saved


def poison() -> bool:
    """Whether a `poisoned_outputs` block is open."""
    return _poison[0]


def record(op: str, variant: str) -> None:
    """Note the artifact a native launch of `op` ran (last_variant reads it)."""
    _last_variant[op] = variant


def last_variant(op: str) -> Optional[str]:
    """The artifact name of the most recent native launch of `op` in this process."""
    return _last_variant.get(op)
