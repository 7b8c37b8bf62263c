"""msa: MiniMax Sparse Attention as a Hugging Face Hub kernel.

An indexer scores every 128-token KV block per query, top-k keeps 16 blocks per query and KV head
(the query's own block forced), and block-sparse attention runs only over those blocks. Native
Hopper (SM90) kernels serve the calls they support; every public function also runs through an
exact PyTorch reference, on any device. ``msa._backend`` decides per call and logs which ran.

Importing this package never initializes CUDA.
"""

from . import _native  # registers the native kernels available in this build (lazy, no CUDA)
from . import layers  # kernels layers for transformers' MiniMax-M3 (kernels.kernelize looks here)
from .decode import SparseDecodePagedAttentionWrapper, sparse_decode_atten_func
from .decode_indexer import DecodeIndexerPlan, decode_indexer_topk, make_decode_indexer_plan
from .decode_step import MSADecodeStepWrapper
from .fmha import (fmha, fmha_plan, fmha_sm100, fmha_sm100_plan, sparse_fmha, sparse_fmha_plan)
from .fp4_indexer_interface import fp4_indexer_block_scores
from .indexer import block_max_scores
from .interface import (SparseK2qCsrBuilderSm100, build_k2q_csr, sparse_atten_func)
from .nvfp4_attention import sparse_atten_nvfp4_kv_func
from .prefill import MsaPrefillPagedWrapper, msa_prefill
from .quantize import (Nvfp4QuantizedTensor, dequantize_nvfp4_128x4_to_bf16,
                       nvfp4_global_scale_from_amax, quantize_bf16_to_nvfp4_128x4,
                       quantize_kv_bf16_to_nvfp4_128x4, swizzle_nvfp4_scale_to_128x4)
from .topk import sparse_topk_select
from ._warmup import warmup
from ._native import compiled_ops as _compiled_ops

if _compiled_ops.ops is not None:
    # A built variant (it has _ops.py): torch.compile sees the native calls as custom ops. A
    # second copy of the same build in one process reuses the ops the first copy defined.
    if not hasattr(_compiled_ops.ops, "sparse_atten_func"):
        from . import _custom_ops  # noqa: F401
    from . import _compile_entries  # noqa: F401

__version__ = "0.1.1"

__all__ = [
    "sparse_atten_func",
    "sparse_atten_nvfp4_kv_func",
    "sparse_decode_atten_func",
    "SparseDecodePagedAttentionWrapper",
    "fp4_indexer_block_scores",
    "build_k2q_csr",
    "SparseK2qCsrBuilderSm100",
    "Nvfp4QuantizedTensor",
    "quantize_bf16_to_nvfp4_128x4",
    "quantize_kv_bf16_to_nvfp4_128x4",
    "dequantize_nvfp4_128x4_to_bf16",
    "swizzle_nvfp4_scale_to_128x4",
    "nvfp4_global_scale_from_amax",
]

# Additive names (contract §2): the fmha plan/run API, top-k selection, the indexer, the
# end-to-end prefill (one call, or planned over a paged cache), the decode step (fused decode
# indexer + top-k, its shared plan, the step wrapper), and the ``layers`` module that
# ``kernels.kernelize`` reads. Not in __all__, which stays exactly the upstream list.
__all_additive__ = [
    "fmha_sm100_plan", "fmha_sm100", "fmha_plan", "fmha", "sparse_topk_select",
    "sparse_fmha_plan", "sparse_fmha", "block_max_scores", "msa_prefill",
    "MsaPrefillPagedWrapper", "decode_indexer_topk", "make_decode_indexer_plan",
    "DecodeIndexerPlan", "MSADecodeStepWrapper", "layers", "warmup",
]
