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
from typing import Dict, Optional

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
            "block_max_score_portable")
_present: Dict[str, bool] = {}


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
