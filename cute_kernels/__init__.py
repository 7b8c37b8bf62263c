"""CuTe-DSL kernels of msa (need nvidia-cutlass-dsl to compile; shipped precompiled in builds).

Inside a built variant and in the source tree this folder is the subpackage ``msa.cute_kernels``
(torch-ext/msa/cute_kernels links here); import it only lazily, it imports ``cutlass``."""
