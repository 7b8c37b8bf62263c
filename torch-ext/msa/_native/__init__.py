"""Native kernels of this build. Each submodule registers its ops with ``msa._backend`` at
import; registration must not initialize CUDA or import the CuTe DSL (artifacts load lazily).
Which kernel form serves a call comes from the serving tables in cute_kernels/variants.py
(_native/serving.py picks it once, in the op's ``supports``); a form not yet proven on hardware
is marked ``validated=False`` there and passed by unless ``MSA_UNVALIDATED_KERNELS=1``. Test and
benchmark hooks live in ``debug`` (context managers)."""

from . import (block_max_score_portable, block_max_score_sm90, csr_builder,  # noqa: F401
               decode_cuda, decode_indexer_cuda, fmha_sm90, sparse_prefill_portable,
               sparse_prefill_sm90, topk_cuda)
