{
  description = "msa: MiniMax Sparse Attention as a Hugging Face Hub kernel (MiniMaxAI/msa)";

  # kernel-builder (now part of the huggingface/kernels monorepo) builds every compliant
  # variant from build.toml inside the Nix sandbox and runs its checks (layout, torch ops
  # namespace, manylinux_2_28 + abi3 ABI, get_kernel import without a GPU).
  #   kernel-builder build-and-copy -L     -> ./build/<variant>/
  #   kernel-builder build-and-upload      -> the Hub, branch v0 (general.version = 0)
  # Commit flake.lock: `self`'s git revision names the ops namespace and the provenance.
  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    { self, kernel-builder, ... }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
      # Extra Python packages for the dev/test shells only (never shipped with the kernel).
      pythonCheckInputs = ps: with ps; [ numpy ];
    };
}
