"""Host-side work schedules, hardware-neutral (torch only, no kernels, no CUDA at import).

* :mod:`.csr_rows`: how the k2q CSR packs its rows (request, KV block) and their counts.
* :mod:`.sparse`: the sparse attention schedule (work items over CSR rows, combine slots), its
  sizing model, the reference builder and the capture-safe tensor-op builder. The native CUDA
  builder (``csrc/build_k2q_csr.cu``) fills the same tensors.
* :mod:`.decode`: the split-KV schedule of paged decode.

``msa.src.sm100.prepare_scheduler`` re-exports :mod:`.sparse` under upstream's import path.
"""
