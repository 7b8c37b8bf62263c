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

The package splits by concern: :mod:`.plan` (planning), :mod:`.run` (running a plan and the
dispatch), :mod:`.bridge` (the sparse bridge's plan and run), :mod:`.call` (the validated call
the backends receive), :mod:`.reference` (the reference backends) and :mod:`.validation`
(argument checks shared by the others).

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
``msa.fmha.plan._split_kv_estimate``). Other keys are private. Planning reads lengths on the
host (it synchronizes); device tensors of a plan live on the plan's device and are moved to q's
device at run time when they differ.

Dispatch: ``_backend.choose("fmha_dense", ...)`` for O (with or without max-score, dense or
block-selected); ``_backend.choose("fmha_max_score", ...)`` for the max-score-only proxy pass,
whose reference is :func:`msa.block_max_scores`.
"""

from .bridge import sparse_fmha, sparse_fmha_plan
from .call import FmhaDenseCall
from .plan import fmha_sm100_plan
from .reference import fmha_dense_reference
from .run import fmha_sm100, run_fmha_dense

# Hardware-neutral names (the same functions).
fmha_plan = fmha_sm100_plan
fmha = fmha_sm100

__all__ = ["fmha_sm100_plan", "fmha_plan", "fmha_sm100", "fmha", "sparse_fmha_plan",
           "sparse_fmha", "FmhaDenseCall", "run_fmha_dense", "fmha_dense_reference"]
