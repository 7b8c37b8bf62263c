"""Native kernels of this build. Each submodule registers its ops with ``msa._backend`` at
import; registration must not initialize CUDA or import the CuTe DSL (artifacts load lazily).
Kernels not yet proven on hardware register too, but their ``supports`` refuses every call
through ``_backend.unvalidated_reason`` until their GPU test passes (then flip their flag)."""

from . import (block_max_score_sm90, csr_builder, decode_cuda,  # noqa: F401
               decode_indexer_cuda, fmha_sm90, sparse_prefill_sm90, topk_cuda)
