"""Compile one kernel variant with fake tensors (no GPU needed), for AOT export or JIT use.

Every size that varies between calls (tokens, heads, pages, batch, work items, topK) is a
symbolic int, so one compiled variant serves every problem shape. The compiled object uses the
TVM-FFI calling convention: call it with torch tensors, Python scalars and, last, the CUDA
stream. The argument order is the one documented in sparse_prefill_sm90.py / combine.py.
"""

from __future__ import annotations

import os
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .block_max_score_sm90 import BlockMaxScoreSm90
from .combine import SparseCombineSm90
from .fmha_sm90 import FmhaSm90MaxScore, FmhaSm90Split
from .fmha_sm90_ws import FmhaSm90Ws
from .sparse_prefill_sm90 import SparsePrefillSm90
from .sparse_prefill_sm90_wgmma import SparsePrefillSm90Wgmma
from .sparse_prefill_sm90_ws import SparsePrefillSm90Ws
from .variants import (FMHA_FORMS, INDEXER_FORMS, SPARSE_FORMS, AttentionVariant,
                       BlockMaxScoreVariant, CombineVariant, FmhaVariant)

TARGET_ARCH = "sm_90a"
# The kernel classes the serving tables' Form.kernel names.
KERNELS = {cls.__name__: cls for cls in (
    BlockMaxScoreSm90, FmhaSm90MaxScore, FmhaSm90Split, FmhaSm90Ws, SparsePrefillSm90,
    SparsePrefillSm90Wgmma, SparsePrefillSm90Ws)}
_DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
           "e4m3": cutlass.Float8E4M3FN}
# q_idx / k_idx element types of the indexer (see variants.INDEX_DTYPES).
_INDEX_DTYPES = {"bfloat16": cutlass.BFloat16, "e4m3": cutlass.Float8E4M3FN}
# (q, k/v) element types of each attention dtype / FP8 mode (see variants.FP8_MODES).
_QKV_DTYPES = {
    "bfloat16": (cutlass.BFloat16, cutlass.BFloat16),
    "bf16_kv_e4m3": (cutlass.BFloat16, cutlass.Float8E4M3FN),
    "e4m3_pv_bf16": (cutlass.Float8E4M3FN, cutlass.Float8E4M3FN),
    "e4m3": (cutlass.Float8E4M3FN, cutlass.Float8E4M3FN),
}


def _tensor(dtype, shape, align=16):
    """Row-major fake tensor; int entries are static, cute.sym_int() entries are dynamic."""
    order = tuple(reversed(range(len(shape))))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


def _dyn():
    return cute.sym_int()


def _index(shape):
    return _tensor(cutlass.Int32, shape, align=4)


def attention_args(variant: AttentionVariant):
    q_dtype, kv_dtype = _QKV_DTYPES[variant.dtype]
    partial = _DTYPES[variant.partial_dtype]
    hkv, hq, total_q = _dyn(), _dyn(), _dyn()
    if variant.paged:
        kv_shape = (_dyn(), hkv, 128, 128)
    else:
        kv_shape = (_dyn(), hkv, 128)
    return [
        _tensor(q_dtype, (total_q, hq, 128)),               # q
        _tensor(kv_dtype, kv_shape), _tensor(kv_dtype, kv_shape),  # k, v
        _index((_dyn(),)), _index((_dyn(),)),               # cu_seqlens_q, cu_seqlens_k
        _index((_dyn(),)),                                  # kv_lens
        _index((_dyn(), _dyn())),                           # page_table
        _index((_dyn(), _dyn())), _index((_dyn(), _dyn())),  # k2q_row_ptr, qsplit
        _index((_dyn(), 6)), _index((1,)),                  # metadata, work_count
        _tensor(partial, (_dyn(), total_q, hq, 128)),       # o_partial
        _tensor(cutlass.Float32, (_dyn(), total_q, hq), align=4),   # lse_partial
        _tensor(cutlass.Float32, (_dyn(), total_q, hq), align=4),   # lse_t_partial
        cutlass.Float32(1.0), cutlass.Float32(1.0),         # softmax_scale, inv_temperature
        cutlass.Int32(0), cutlass.Int32(0),                 # causal, want_lse_t
    ] + trailing_args(SPARSE_FORMS[variant.form]) + [make_fake_stream()]


def trailing_args(form):
    """Fake values of the launch arguments `form`'s kernel takes last (Form.trailing_args)."""
    fakes = dict(item_counter=lambda: _index((1,)), num_ctas=lambda: cutlass.Int32(132))
    return [fakes[name]() for name in form.trailing_args]


def combine_args(variant: CombineVariant):
    partial = _DTYPES[variant.partial_dtype]
    total_q, hq = _dyn(), _dyn()
    return [
        _tensor(partial, (_dyn(), total_q, hq, 128)),       # o_partial
        _tensor(cutlass.Float32, (_dyn(), total_q, hq), align=4),   # lse_partial
        _tensor(cutlass.Float32, (_dyn(), total_q, hq), align=4),   # lse_t_partial
        _index((_dyn(), _dyn())),                           # split_counts
        _tensor(cutlass.BFloat16, (total_q, hq, 128)),      # out
        _tensor(cutlass.Float32, (total_q, hq), align=4),   # lse
        _tensor(cutlass.Float32, (total_q, hq), align=4),   # lse_t
        cutlass.Int32(0),                                   # want_lse_t
        make_fake_stream(),
    ]


def block_max_score_args(variant: BlockMaxScoreVariant):
    """Argument order of BlockMaxScoreSm90.__call__ (see block_max_score_sm90.py)."""
    dtype = _INDEX_DTYPES[variant.dtype]
    total_q, batch = _dyn(), _dyn()
    k_shape = (_dyn(), 1, 128, 128) if variant.paged else (_dyn(), 1, 128)
    return [
        _tensor(dtype, (total_q, variant.num_heads, 128)),  # q_idx
        _tensor(dtype, k_shape),                            # k_idx (one shared key head)
        _index((_dyn(),)), _index((_dyn(),)),               # cu_seqlens_q, cu_seqlens_k
        _index((batch,)), _index((batch,)),                 # k_lens, causal offsets
        _index((_dyn(), _dyn())),                           # page_table
        _tensor(cutlass.Float32, (variant.num_heads, _dyn(), total_q), align=4),   # out
        cutlass.Float32(1.0), cutlass.Int32(1),             # scale, causal
        cutlass.Int32(1), cutlass.Int32(1),                 # grid_q_tiles, key_splits
        make_fake_stream(),
    ]


def fmha_args(variant: FmhaVariant):
    """Argument order of FmhaSm90.__call__ (see fmha_sm90.py; FmhaSm90Split replaces o by
    o_partial and lse_partial and takes num_splits last)."""
    dtype = _DTYPES[variant.dtype]
    total_q, hq, hkv, batch = _dyn(), _dyn(), _dyn(), _dyn()
    kv_shape = (_dyn(), hkv, 128, 128) if variant.paged else (_dyn(), hkv, 128)
    v_shape, table_shape = kv_shape, (_dyn(), _dyn())
    form = FMHA_FORMS[variant.form]
    if form.options.get("v_transposed"):
        # V transposed ahead: Vt [blocks, Hkv, 128 channels, 128 keys']; page_table [2, B, W]
        # (K's pages, then each key block's Vt block).
        v_shape, table_shape = (_dyn(), hkv, 128, 128), (2, _dyn(), _dyn())
    split = form.kernel == "FmhaSm90Split"
    max_score = form.kernel == "FmhaSm90MaxScore"
    if split:
        splits = _dyn()
        outputs = [_tensor(cutlass.Float32, (splits, total_q, hq, 128)),      # o_partial
                   _tensor(cutlass.Float32, (splits, total_q, hq), align=4)]  # lse_partial
    else:
        outputs = [_tensor(cutlass.BFloat16, (total_q, hq, 128))]  # o (bf16 for e4m3 q too)
    return [
        _tensor(dtype, (total_q, hq, 128)),                 # q
        _tensor(dtype, kv_shape), _tensor(dtype, v_shape),   # k, v
    ] + outputs + [
        _index((_dyn(),)), _index((_dyn(),)),               # cu_seqlens_q, cu_seqlens_k
        _index((batch,)), _index((batch,)),                 # kv_lens, qo_offset
        _index(table_shape),                                # page_table
        cutlass.Float32(1.0), cutlass.Float32(1.0),         # logit_scale_log2, output_scale
        cutlass.Int32(1), cutlass.Int32(1),                 # causal, grid_q_tiles
    ] + ([_tensor(cutlass.Float32, (hq, _dyn(), total_q)),  # max_score [Hq, tiles, total_q]
          cutlass.Float32(1.0)] if max_score else []) + (
        [cutlass.Int32(2)] if split else []) + trailing_args(form) + [make_fake_stream()]


def attention_kernel(variant: AttentionVariant):
    """The kernel object of a sparse attention variant: its form's kernel class
    (variants.SPARSE_FORMS) with the form's options."""
    form = SPARSE_FORMS[variant.form]
    partial = _DTYPES[variant.partial_dtype]
    if not form.builds(variant.dtype, variant.qhead_per_kv, variant.partial_dtype):
        raise NotImplementedError(f"{variant.name}: form {form.name} is not built for it")
    cls = KERNELS[form.kernel]
    if cls is SparsePrefillSm90:
        return cls(variant.qhead_per_kv, variant.paged, partial)
    mode = "bf16" if variant.dtype == "bfloat16" else variant.dtype
    return cls(variant.qhead_per_kv, variant.paged, partial, mode=mode, **form.options)


def compile_variant(variant, *, dump_dir: Optional[str] = None):
    """cute.compile one variant for sm_90a with the TVM-FFI ABI. With dump_dir, the PTX is kept
    there (the directory is created: the DSL silently skips a missing one)."""
    os.environ.setdefault("CUTE_DSL_ARCH", TARGET_ARCH)
    options = f"--enable-tvm-ffi --gpu-arch={TARGET_ARCH}"
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir={os.path.abspath(dump_dir)}"
    if isinstance(variant, AttentionVariant):
        kernel = attention_kernel(variant)
        return cute.compile(kernel, *attention_args(variant), options=options)
    if isinstance(variant, CombineVariant):
        kernel = SparseCombineSm90(_DTYPES[variant.partial_dtype])
        return cute.compile(kernel, *combine_args(variant), options=options)
    if isinstance(variant, BlockMaxScoreVariant):
        form = INDEXER_FORMS[variant.form]
        kernel = KERNELS[form.kernel](variant.num_heads, variant.paged,
                                      _INDEX_DTYPES[variant.dtype], **form.options)
        return cute.compile(kernel, *block_max_score_args(variant), options=options)
    if isinstance(variant, FmhaVariant):
        form = FMHA_FORMS[variant.form]
        if variant.dtype not in form.dtypes:
            raise NotImplementedError(f"{variant.name}: form {form.name} is built for "
                                      f"{', '.join(form.dtypes)}")
        kernel = KERNELS[form.kernel](variant.paged, _DTYPES[variant.dtype], **form.options)
        return cute.compile(kernel, *fmha_args(variant), options=options)
    raise TypeError(f"variant: unknown kind {type(variant).__name__}")
