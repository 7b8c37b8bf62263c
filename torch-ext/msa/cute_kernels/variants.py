"""The serving tables of the CuTe-DSL op families and the variants a build ships (pure Python:
no cutlass import).

One table per op family lists its kernel forms: what each is compiled for (dtypes, head groups,
partial dtypes, KV layouts), its kernel class and constructor options, and when dispatch picks
it (in words, and as a predicate over the call's features). Everything else reads these tables:
shipped_variants() (what tools/compile_cute.py compiles), build.py (the kernel object of a
variant), the native dispatch (msa._native.*: the form a call runs, through serving_form), the
runtime loader (artifact names), tests and benchmarks (the forms to exercise).

A variant is fixed only by what changes the generated code (head group, KV layout, element
dtypes, form); every size (tokens, pages, work items, batch) is a runtime value. Artifact names
are built only by the variant classes' ``name``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from .geometry import BLOCK_N as KV_BLOCK
from .geometry import HEAD_DIM  # noqa: F401  (the head dim every variant is built for)

LAYOUTS = ("dense", "paged")
QHEAD_PER_KV = (1, 2, 4, 8, 16)
SPARSE_DTYPES = ("bfloat16", "bf16_kv_e4m3", "e4m3_pv_bf16", "e4m3")     # see FP8_MODES
PARTIAL_DTYPES = ("float32", "bfloat16", "float16", "e4m3")     # every contract partial dtype
# The sparse kernels' Q/K/V dtype modes (no scale factors):
#   bfloat16      bf16 q/k/v
#   bf16_kv_e4m3  bf16 q, e4m3 k/v (staged to bf16 in shared memory), bf16 P.V
#   e4m3_pv_bf16  e4m3 q/k/v, e4m3 QK^T, V staged to bf16, bf16 P.V (pv_dtype=bf16)
#   e4m3          e4m3 q/k/v, e4m3 QK^T, P rounded to e4m3 in registers, e4m3 P.V
FP8_MODES = ("bf16_kv_e4m3", "e4m3_pv_bf16", "e4m3")
WGMMA_PARTIAL_DTYPES = ("bfloat16", "float16", "e4m3")
# Head groups whose query rows fill whole 1 KB swizzle atoms (the sparse TMA forms' Q boxes).
WS_GROUPS = (8, 16)
INDEX_HEADS = (1, 2, 4, 8)                   # index query heads H of block_max_scores
INDEX_DTYPES = ("bfloat16", "e4m3")          # q_idx / k_idx element types (the same for both)
FMHA_DTYPES = ("bfloat16", "e4m3")           # dense FMHA q/k/v element types (O is bf16)
# Dense FMHA: calls of more (query tile, head, request) work items than this run on the
# non-persistent forms, whose concurrent CTAs share one KV head's K / V in L2.
PERSISTENT_MAX_ITEMS = 4096
# (dtype mode, partial dtype) pairs the three-consumer sparse form serves: measured faster than
# the two-consumer form at 32k and 128k keys.
WS3W_PAIRS = frozenset({("e4m3", "bfloat16"), ("e4m3", "e4m3"), ("bfloat16", "bfloat16")})
# The indexer's decode form holds this many (query, head) rows per request (one warpgroup).
INDEXER_DECODE_ROWS = 64


# Launch arguments a kernel class takes after its op family's common ones, in this order
# (build.py makes their fake values, the native glue the real ones): "item_counter", one int32
# the caller zeroes, from which persistent CTAs fetch work items; "num_ctas", the SM count
# (persistent forms launch min(items, num_ctas) CTAs; the other forms of the class ignore both).
TRAILING_ARGS: Dict[str, Tuple[str, ...]] = {
    "SparsePrefillSm90Ws": ("item_counter", "num_ctas"),
    "FmhaSm90Ws": ("num_ctas",),
}


def _always(**_features) -> bool:
    return True


@dataclasses.dataclass(frozen=True, eq=False)
class Form:
    """One compiled kernel form of an op family (a row of a serving table)."""
    name: str                            # how tests, benchmarks and debug.forcing name it
    kernel: str                          # the kernel class (build.py) that compiles it
    dtypes: Tuple[str, ...]              # q/k/v dtypes or dtype modes it is compiled for
    serves: str                          # when dispatch picks it, in words
    # The same as a predicate over the call's dtype, group, partial, layout and features.
    when: Callable[..., bool] = _always
    options: Mapping[str, object] = dataclasses.field(default_factory=dict)   # kernel options
    groups: Tuple[int, ...] = ()         # head groups G it exists for (() = every G)
    partials: Tuple[str, ...] = ()       # partial dtypes it exists for (() = not applicable)
    layouts: Tuple[str, ...] = LAYOUTS
    suffix: Optional[str] = None         # the artifact name's suffix (default "_" + name)
    # False: built but not yet proven on an H200; dispatch passes it by unless
    # MSA_UNVALIDATED_KERNELS=1 (msa._backend.unvalidated_ok), and benchmarks label it. It
    # ships where it would serve, so its GPU tests can run it.
    validated: bool = True

    @property
    def trailing_args(self) -> Tuple[str, ...]:
        """The launch arguments its kernel takes after the family's common ones, in order
        (TRAILING_ARGS)."""
        return TRAILING_ARGS.get(self.kernel, ())

    @property
    def name_suffix(self) -> str:
        return f"_{self.name}" if self.suffix is None else self.suffix

    def builds(self, dtype: str, group: Optional[int] = None,
               partial: Optional[str] = None, layout: Optional[str] = None) -> bool:
        """Whether this form is compiled for the given dtype (and head group, partial dtype,
        layout where given)."""
        return (dtype in self.dtypes
                and (group is None or not self.groups or group in self.groups)
                and (partial is None or not self.partials or partial in self.partials)
                and (layout is None or layout in self.layouts))


def serving_form(table: Mapping[str, Form], dtype: str, *, group: Optional[int] = None,
                 partial: Optional[str] = None, layout: Optional[str] = None,
                 unvalidated_ok: bool = False, forced: Optional[str] = None,
                 exclude: Tuple[str, ...] = (), **features) -> Optional[Form]:
    """The form of `table` that serves a call: `forced` (a test / benchmark hook) when it is
    built for the call, else the first form in table order that is built for it, serves its
    features (Form.when) and is validated (or unvalidated_ok); None when no form does. Forms
    named in `exclude` are passed by (e.g. one whose artifact is missing)."""
    if forced is not None:
        if forced not in table:
            raise ValueError(f"forced form {forced!r}: the forms are {', '.join(table)}")
        if forced not in exclude and table[forced].builds(dtype, group, partial, layout):
            return table[forced]
    for form in table.values():
        if (form.name not in exclude and form.builds(dtype, group, partial, layout)
                and (form.validated or unvalidated_ok)
                and form.when(dtype=dtype, group=group, partial=partial, layout=layout,
                              **features)):
            return form
    return None


def forms_with(table: Mapping[str, Form], option: str) -> Tuple[str, ...]:
    """The names of the forms whose kernel `option` is set."""
    return tuple(name for name, form in table.items() if form.options.get(option))


def _table(*forms: Form) -> Dict[str, Form]:
    return {form.name: form for form in forms}


# ---- dense FMHA (op "fmha_dense"; features: with_score, kv_splits, causal, work_items) --------
# FMHA_CALLS: values of the run-time features that reach every choice of FMHA_FORMS (what
# shipped_variants() asks the table about); likewise SPARSE_CALLS, INDEXER_CALLS.
FMHA_CALLS = dict(with_score=(False, True), kv_splits=(1, 2), causal=(False, True),
                  work_items=(1, PERSISTENT_MAX_ITEMS + 1))
FMHA_FORMS = _table(
    Form("maxscore", "FmhaSm90MaxScore", ("bfloat16",),
         "O and the max-score output (mode 1): the plain block loop (two warpgroups, a "
         "two-stage cp.async K/V ring), writing each row's scaled max per key block",
         when=lambda with_score, **_: with_score),
    Form("split", "FmhaSm90Split", FMHA_DTYPES,
         "O-only plans the planner splits (num_kv_splits > 1: few query tiles, long keys): the "
         "plain block loop over one key range per CTA, fp32 partial rows + LSE, then the fp32 "
         "combine",
         when=lambda with_score, kv_splits, **_: not with_score and kv_splits > 1),
    Form("wsup", "FmhaSm90Ws", ("bfloat16",),
         "bf16 causal O-only calls of at most PERSISTENT_MAX_ITEMS work items: the "
         "warp-specialized kernel on persistent CTAs (min(items, SMs) CTAs walk the items, the "
         "producer loads Q by TMA)",
         when=lambda with_score, causal, work_items, **_: (
             not with_score and causal and work_items <= PERSISTENT_MAX_ITEMS),
         options=dict(persistent=True)),
    Form("wsu", "FmhaSm90Ws", ("bfloat16",),
         "every other bf16 O-only call: the warp-specialized kernel (TMA producer warp, two "
         "ping-pong consumer warpgroups, static K/V stages), one CTA per query tile",
         when=lambda with_score, **_: not with_score),
    Form("wsutps", "FmhaSm90Ws", ("e4m3",),
         "e4m3 O-only calls of at most PERSISTENT_MAX_ITEMS work items: wsup's persistent CTAs, "
         "V transposed ahead by the fmha_transpose_v_e4m3 op, P's row sums on the tensor core",
         when=lambda with_score, work_items, **_: (
             not with_score and work_items <= PERSISTENT_MAX_ITEMS),
         options=dict(v_transposed=True, mma_row_sum=True, persistent=True)),
    Form("wsuts", "FmhaSm90Ws", ("e4m3",),
         "every other e4m3 O-only call: wsu with V transposed ahead and P's row sums on the "
         "tensor core",
         when=lambda with_score, **_: not with_score,
         options=dict(v_transposed=True, mma_row_sum=True)),
)

# ---- sparse prefill attention (op "sparse_atten"; dtype: the dtype mode) ----------------------
# The persistent forms (CTAs take work items from a queue; the producer warpgroup loads the
# next item's K / V under this one's tiles; three consumers). Through the production pipeline
# on an H100, same process:
# * wsp3w (bf16, O staged over each tile's Q stage), against ws3w (48fd7df): 0.78-0.92x on the
#   11 production cases of <= 1024 queries, 0.93-0.96x at 1.4k-2.7k queries (1.00x at 1.6k /
#   18k), 0.99-1.01x on the 7.5k-16k chunks: it serves calls of <= FEW_CALL_QUERIES queries.
#   With two consumers (and O tiles) it was 1-5 % slower everywhere.
# * wsp3we (e4m3, O tiles, V transposed by the producer instead of the consumers), against ws3w
#   (d0c5e11, sparse route): 0.66-0.83x on the 11 cases of <= 1024 queries, 0.80-0.96x at
#   1.4k-10k, 1.00x at 16k / 47.7k; against the one-consumer, two-CTAs-an-SM ws1c that served
#   e4m3 calls of few queries 0.79-0.88x: it serves every e4m3 call it is built for.
# SPARSE_CALLS' call_size: "few" (at most FEW_CALL_QUERIES queries) or "many".
FEW_CALL_QUERIES = 4096
SPARSE_CALLS: Dict[str, tuple] = dict(call_size=("many", "few"))
SPARSE_FORMS = _table(
    Form("wsp3w", "SparsePrefillSm90Ws", ("bfloat16",),
         "calls of <= FEW_CALL_QUERIES queries at G 16 with bf16 q/k/v and bf16 partials: the "
         "TMA warp-specialized kernel, persistent (a CTA an SM takes work items from a queue, "
         "an atomic counter; the producer warpgroup loads the next item's K and V into a "
         "second stage while this item's tiles run), three consumer warpgroups and 6 Q "
         "stages, each tile's O staged over its own Q stage (no O tiles: Q 96 KB + K/V 128 KB)",
         when=lambda call_size="many", **_: call_size == "few",
         options=dict(consumers=3, q_stages=6, mma_regs=152, producer_regs=56,
                      persistent=True, o_in_q_stage=True),
         groups=(16,), partials=("bfloat16",)),
    Form("wsp3we", "SparsePrefillSm90Ws", ("e4m3",),
         "calls at G 16 with all-e4m3 q/k/v and bf16 partials: wsp3w's queue, K/V ring and "
         "three consumers, with O tiles (an e4m3 Q stage cannot hold a bf16 O tile) and V "
         "transposed by the producer warpgroup (raw rows by cp.async, then each thread's own "
         "chunks into the stage's Vt): Q 48 KB + K/V 64 KB + raw V 16 KB + O 48 KB",
         options=dict(consumers=3, q_stages=6, mma_regs=152, producer_regs=56,
                      persistent=True),
         groups=(16,), partials=("bfloat16",)),
    Form("ws3w", "SparsePrefillSm90Ws", ("bfloat16", "e4m3"),
         "G 8 / 16, bf16 or all-e4m3 q/k/v, the (dtype, partial dtype) pairs of WS3W_PAIRS: the "
         "TMA warp-specialized kernel with three consumer warpgroups and 6 Q stages",
         when=lambda dtype, partial, **_: (dtype, partial) in WS3W_PAIRS,
         options=dict(consumers=3, q_stages=6, mma_regs=152),
         groups=WS_GROUPS, partials=WGMMA_PARTIAL_DTYPES),
    Form("ws", "SparsePrefillSm90Ws", ("bfloat16", "e4m3"),
         "the other G 8 / 16 calls with bf16 or all-e4m3 q/k/v and 16-bit or e4m3 partials: "
         "the TMA warp-specialized kernel, two consumer warpgroups",
         groups=WS_GROUPS, partials=WGMMA_PARTIAL_DTYPES),
    Form("wgmma", "SparsePrefillSm90Wgmma", ("bfloat16",) + FP8_MODES,
         "every other call with 16-bit or e4m3 partials: one warpgroup, wgmma from shared "
         "memory, two CTAs per SM",
         partials=WGMMA_PARTIAL_DTYPES, suffix=""),
    Form("mma", "SparsePrefillSm90", ("bfloat16",),
         "bf16 q/k/v with fp32 partials: warp-level mma.sync, 128-row tiles",
         partials=("float32",), suffix=""),
)

# ---- indexer block max-scores (op "block_max_scores"; feature: rows_per_request) --------------
INDEXER_CALLS = dict(rows_per_request=(1, INDEXER_DECODE_ROWS + 1))
INDEXER_FORMS = _table(
    Form("decode", "BlockMaxScoreSm90", INDEX_DTYPES,
         "paged index keys and at most INDEXER_DECODE_ROWS (query, head) rows per request: one "
         "warpgroup per CTA, each request's key tiles split over CTAs",
         when=lambda rows_per_request, **_: rows_per_request <= INDEXER_DECODE_ROWS,
         options=dict(split_keys=True), layouts=("paged",)),
    Form("prefill", "BlockMaxScoreSm90", INDEX_DTYPES,
         "every other call: 256 (query, head) rows per CTA, four warpgroups",
         suffix=""),
)


def _short(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype, dtype)


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    """One compiled sparse attention kernel: S = QK^T, single-block softmax, P.V per work
    item. dtype is "bfloat16" or one of FP8_MODES; form a name of SPARSE_FORMS."""
    qhead_per_kv: int
    paged: bool
    partial_dtype: str = "float32"
    dtype: str = "bfloat16"
    form: str = "mma"

    @property
    def name(self) -> str:
        layout = "paged" if self.paged else "dense"
        return (f"sparse_prefill_sm90_{self.dtype}_g{self.qhead_per_kv}_{layout}"
                f"_p{_short(self.partial_dtype)}{SPARSE_FORMS[self.form].name_suffix}")


@dataclasses.dataclass(frozen=True)
class CombineVariant:
    """One compiled combine kernel: log-sum-exp merge of the per-block partial outputs."""
    partial_dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"sparse_combine_sm90_p{_short(self.partial_dtype)}"


@dataclasses.dataclass(frozen=True)
class BlockMaxScoreVariant:
    """One compiled indexer kernel: per (query, index head, 128-key tile) max of scale * q.k,
    H index heads against one shared index-key head (Hk = 1); form a name of INDEXER_FORMS."""
    num_heads: int
    paged: bool
    dtype: str = "bfloat16"
    form: str = "prefill"

    @property
    def name(self) -> str:
        layout = "paged" if self.paged else "dense"
        return (f"block_max_score_sm90_{self.dtype}_h{self.num_heads}_{layout}"
                f"{INDEXER_FORMS[self.form].name_suffix}")


@dataclasses.dataclass(frozen=True)
class FmhaVariant:
    """One compiled dense FMHA forward kernel (the native fmha_dense backend): any GQA group and
    causality at run time, dense or paged (page size 128) K/V; form a name of FMHA_FORMS."""
    paged: bool
    dtype: str = "bfloat16"
    form: str = "wsu"

    @property
    def name(self) -> str:
        layout = "paged" if self.paged else "dense"
        return f"fmha_sm90_{self.dtype}_{layout}{FMHA_FORMS[self.form].name_suffix}"


def served_forms(table: Mapping[str, Form], calls: Mapping[str, tuple], dtype: str,
                 group: Optional[int] = None, partial: Optional[str] = None,
                 layout: Optional[str] = None) -> List[str]:
    """The names of the forms of `table` that serve some call of these compile-time properties
    (one per combination of the run-time feature values in `calls`), with and without the
    unvalidated forms (a gated form ships beside the validated one it would displace)."""
    names: List[str] = []
    for values, unvalidated_ok in itertools.product(itertools.product(*calls.values()),
                                                    (False, True)):
        form = serving_form(table, dtype, group=group, partial=partial, layout=layout,
                            unvalidated_ok=unvalidated_ok, **dict(zip(calls, values)))
        if form is not None and form.name not in names:
            names.append(form.name)
    return names


def shipped_variants() -> List[object]:
    """Every variant a build ships: exactly the forms the serving tables pick for some call
    (tools/compile_cute.py compiles this list; a form that no call reaches is not shipped)."""
    out: List[object] = []
    for dtype, layout, g, partial in itertools.product(SPARSE_DTYPES, LAYOUTS, QHEAD_PER_KV,
                                                       PARTIAL_DTYPES):
        out.extend(AttentionVariant(g, layout == "paged", partial, dtype, form)
                   for form in served_forms(SPARSE_FORMS, SPARSE_CALLS, dtype, g, partial,
                                            layout))
    out.extend(CombineVariant(p) for p in PARTIAL_DTYPES)
    for dtype, layout, heads in itertools.product(INDEX_DTYPES, LAYOUTS, INDEX_HEADS):
        out.extend(BlockMaxScoreVariant(heads, layout == "paged", dtype, form)
                   for form in served_forms(INDEXER_FORMS, INDEXER_CALLS, dtype, layout=layout))
    for dtype, layout in itertools.product(FMHA_DTYPES, LAYOUTS):
        out.extend(FmhaVariant(layout == "paged", dtype, form)
                   for form in served_forms(FMHA_FORMS, FMHA_CALLS, dtype, layout=layout))
    return out


def by_name(name: str):
    for variant in shipped_variants():
        if variant.name == name:
            return variant
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def _forms_by_name() -> Dict[str, str]:
    return {variant.name: getattr(variant, "form", "") for variant in shipped_variants()}


def form_of(name: str) -> Optional[str]:
    """The serving-table form of a shipped variant's artifact name (None for other names)."""
    return _forms_by_name().get(name)
