"""Native kernels of this build. Each submodule registers its ops with ``msa._backend`` at
import; registration must not initialize CUDA or import the CuTe DSL (artifacts load lazily)."""

from . import csr_builder, sparse_prefill_sm90, topk_cuda  # noqa: F401
