"""CuTe-DSL kernels of msa (need nvidia-cutlass-dsl to compile; shipped precompiled in builds).

This is the subpackage ``msa.cute_kernels`` (the top-level ``cute_kernels`` link points here, so
the Nix build ships these sources). Import it only lazily: it imports ``cutlass``."""
