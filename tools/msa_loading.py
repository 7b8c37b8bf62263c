"""How scripts and tests import msa: a built variant (as the Hub loader would), or the source tree.

- ``import_variant_as_msa(dir)`` imports a built variant folder (build/<variant>, flat, with
  metadata.json) under the module name ``msa``, so ``import msa`` / ``from msa.x import y`` work.
- ``load_msa()`` picks, in order: ``MSA_PACKAGE_DIR`` (a variant folder or a folder holding the
  ``msa`` package); the variant of ``<repo>/build`` that ``kernels.get_local_kernel`` resolves
  for this torch (the Hub loader's own choice); the source tree ``torch-ext/``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_variant_as_msa(variant_dir):
    variant_dir = Path(variant_dir).resolve()
    spec = importlib.util.spec_from_file_location(
        "msa", variant_dir / "__init__.py", submodule_search_locations=[str(variant_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["msa"] = module
    spec.loader.exec_module(module)
    return module


def load_msa(verbose: bool = True):
    chosen = os.environ.get("MSA_PACKAGE_DIR")
    if chosen and (Path(chosen) / "metadata.json").exists():
        module, where = import_variant_as_msa(chosen), chosen
    elif chosen:
        sys.path.insert(0, chosen)
        import msa as module
        where = chosen
    else:
        module = where = None
        if any((ROOT / "build").glob("*/metadata.json")):
            try:
                import kernels
                module = kernels.get_local_kernel(ROOT)
                where = os.path.dirname(module.__file__)
            except Exception as exc:  # no kernels package, or no variant fits this torch
                print(f"msa: local build not loadable ({exc}); using the source tree")
        if module is None:
            sys.path.insert(0, str(ROOT / "torch-ext"))
            import msa as module
            where = str(ROOT / "torch-ext" / "msa")
    if verbose:
        print(f"msa: loaded from {where}")
    return module
