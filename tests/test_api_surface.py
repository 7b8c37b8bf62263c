"""The public surface clients rely on (contract §1 and §2): names, submodule paths, docstrings,
and that importing the package leaves CUDA alone."""

import importlib
import inspect

import torch

import msa
from msa_testing import CONTRACT_ALL
ADDITIVE = ["fmha_sm100_plan", "fmha_sm100", "fmha_plan", "fmha", "sparse_topk_select",
            "sparse_fmha_plan", "sparse_fmha", "block_max_scores", "msa_prefill",
            "decode_indexer_topk", "make_decode_indexer_plan", "DecodeIndexerPlan",
            "MSADecodeStepWrapper", "warmup"]
SUBMODULE_NAMES = {
    "msa.interface": ["sparse_atten_func", "build_k2q_csr", "SparseK2qCsrBuilderSm100"],
    "msa.sparse_index_utils": ["build_k2q_csr_torch_reference", "q2k_to_k2q", "k2q_to_q2k"],
    "msa.src.sm100.prepare_scheduler": ["prepare_sparse_fwd_schedule_and_split",
                                        "SparseAttentionSchedule"],
    "msa.fp4_indexer_interface": ["fp4_indexer_block_scores"],
    "msa.src.sm100.fp4_indexer": ["normalize_fp4_format"],
    "msa.src.sm100.decode_schedule": ["build_decode_schedule", "DecodeSchedule"],
    "msa.quantize": ["quantize_bf16_to_nvfp4_128x4", "Nvfp4QuantizedTensor"],
}


def test_all_is_exactly_the_contract_list():
    assert msa.__all__ == CONTRACT_ALL
    assert msa.__version__ == "0.1.1"


def test_every_public_name_exists_and_documents_shapes():
    for name in CONTRACT_ALL + ADDITIVE:
        obj = getattr(msa, name)
        doc = inspect.getdoc(obj) or ""
        assert len(doc) > 80, f"{name}: docstring too thin"
        if callable(obj) and not inspect.isclass(obj) and name not in (
                "nvfp4_global_scale_from_amax",):
            assert "[" in doc, f"{name}: docstring states no shapes"


def test_fmha_names_are_aliases():
    assert msa.fmha is msa.fmha_sm100 or msa.fmha.__wrapped__ is msa.fmha_sm100 or \
        inspect.signature(msa.fmha) == inspect.signature(msa.fmha_sm100)
    assert inspect.signature(msa.fmha_plan) == inspect.signature(msa.fmha_sm100_plan)


def test_submodule_paths_clients_import():
    for module, names in SUBMODULE_NAMES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), f"{module}.{name}"


def test_signatures_keep_contract_defaults():
    sig = inspect.signature(msa.sparse_atten_func)
    assert sig.parameters["blk_kv"].default == 128
    assert sig.parameters["causal"].default is False
    assert sig.parameters["partial_dtype"].default is torch.bfloat16
    assert sig.parameters["usable_SM_count"].default == -1
    sig = inspect.signature(msa.build_k2q_csr)
    assert sig.parameters["qhead_per_kv"].default == 1
    assert sig.parameters["return_schedule"].default is False
    sig = inspect.signature(msa.sparse_decode_atten_func)
    assert sig.parameters["causal"].default is True


def test_import_does_not_initialize_cuda():
    assert not torch.cuda.is_initialized()
