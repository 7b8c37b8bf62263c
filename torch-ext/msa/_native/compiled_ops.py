"""The compiled CUDA ops of this build (csrc/, registered by torch-ext/torch_binding.cpp).

A built variant carries ``_ops.py`` as kernel-builder generates it: ``ops`` (the
``torch.ops._msa_<backend>_<id>`` namespace) and ``add_op_namespace_prefix``. A compiled variant's
``_ops.py`` first imports ``_msa_cuda_<id>.abi3.so``, which registers the ops; a noarch variant's
namespace is empty. So whether an op is compiled in is asked of ``ops`` itself, op by op. The
source tree has no ``_ops.py`` (kernel-builder generates it), hence no compiled ops.

A variant whose ``_ops.py`` exists but cannot import its library fails ``import msa`` loudly:
silently running the reference instead would hide a broken build.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional, Tuple

import torch

_PACKAGE = __name__.rsplit(".", 2)[0]          # "msa" or the loader's unique module name
_OPS_MODULE = f"{_PACKAGE}._ops"


def _load_ops_module():
    try:
        return importlib.import_module(_OPS_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != _OPS_MODULE:          # _ops.py is there but its library is not
            raise
        return None


ops_module = _load_ops_module()
# The op namespace of this build, or None in the source tree.
ops = ops_module.ops if ops_module is not None else None
# Every op csrc/ defines (torch_binding.cpp); tests check the two lists agree.
CSRC_OPS = ("run_build_k2q_csr", "run_build_k2q_csr_with_schedule", "sparse_topk_select",
            "sparse_decode_attention", "fmha_transpose_v_e4m3", "decode_indexer_topk",
            "decode_indexer_plan_update", "sparse_prefill_portable", "sparse_combine_portable",
            "block_max_score_portable", "csrc_image")
# The csrc translation unit (csrc/<unit>.cu) each kernel op's code lives in.
UNIT_OF_OP = {"run_build_k2q_csr": "build_k2q_csr",
              "run_build_k2q_csr_with_schedule": "build_k2q_csr",
              "sparse_topk_select": "sparse_topk_select",
              "sparse_decode_attention": "decode_attention",
              "fmha_transpose_v_e4m3": "fmha_transpose_v",
              "decode_indexer_topk": "decode_indexer",
              "decode_indexer_plan_update": "decode_indexer",
              "sparse_prefill_portable": "sparse_prefill_portable",
              "sparse_combine_portable": "sparse_prefill_portable",
              "block_max_score_portable": "block_max_score_portable"}
_present: Dict[str, bool] = {}
# (device index, unit) -> None (the loaded module runs the unit there) or why it cannot.
_image: Dict[Tuple[int, str], Optional[str]] = {}


def has(name: str) -> bool:
    """Whether compiled op `name` is registered in this build's namespace (cached)."""
    found = _present.get(name)
    if found is None:
        found = _present[name] = ops is not None and hasattr(ops, name)
    return found


def missing_reason(*names: str) -> Optional[str]:
    """None when every named compiled op is in this build, else the reason it is not."""
    absent = [n for n in names if not has(n)]
    if not absent:
        return None
    if ops is None:
        where = "the source tree has no _ops.py (no compiled extension)"
    else:
        where = f"this variant's op namespace {ops.name} has none"
    return (f"the compiled msa CUDA op {absent[0]} is not built into this package ({where}; "
            "a compiled variant ships _msa_cuda_<id>.abi3.so)")


def image_reason(device: torch.device, *names: str) -> Optional[str]:
    """None when every named compiled op is in this build and the loaded module has an image of
    its csrc unit that `device` runs, else the reason. A build compiles csrc for the
    ``cuda-capabilities`` of build.toml only: on a GPU those do not cover, a launch would fail
    with "no kernel image", so the ops of the families a build may not cover (the portable tier,
    SM100) ask here first. Asked of the driver once per device and unit."""
    missing = missing_reason(*names, "csrc_image")
    if missing is not None:
        return missing
    index = device.index if device.index is not None else torch.cuda.current_device()
    for unit in dict.fromkeys(UNIT_OF_OP[name] for name in names):
        key = (index, unit)
        if key not in _image:
            _image[key] = _unit_image_reason(unit, index)
        if _image[key] is not None:
            return _image[key]
    return None


def image_check(*names: str) -> Callable[[torch.device], Optional[str]]:
    """The device check of a registration whose kernels are the named compiled ops
    (``_backend.register_native(..., device_check=...)``)."""
    return lambda device: image_reason(device, *names)


def _unit_image_reason(unit: str, index: int) -> Optional[str]:
    binary, ptx, error = ops.csrc_image(unit, index)
    major, minor = torch.cuda.get_device_capability(index)
    if not error and binary // 10 == major and binary <= 10 * major + minor:
        return None
    found = error or (f"the driver picked sm_{binary} code (compute_{ptx}), which this device "
                      f"cannot run")
    return (f"this build has no image of csrc/{unit}.cu that compute capability "
            f"{major}.{minor} runs ({found}); build.toml's cuda-capabilities must cover "
            f"{major}.{minor} (an \"X.Y+PTX\" entry covers every capability from X.Y on)")
