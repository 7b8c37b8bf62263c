"""Test setup: import the package from the source tree (torch-ext/), or from a built variant
folder when MSA_TEST_PACKAGE_DIR points at one (build/<variant>, imported as ``msa``); GPU-marked
tests skip cleanly without CUDA."""

import contextlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_variant = os.environ.get("MSA_TEST_PACKAGE_DIR")
if _variant:
    sys.path.insert(0, str(ROOT / "tools"))
    from msa_loading import import_variant_as_msa
    import_variant_as_msa(_variant)
else:
    sys.path.insert(0, str(ROOT / "torch-ext"))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    is_sm90 = has_cuda and torch.cuda.get_device_capability()[0] == 9
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "sm90" in item.keywords and not is_sm90:
            item.add_marker(pytest.mark.skip(reason="needs an SM90 GPU"))


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure), so inputs differ between runs;
    MSA_TEST_SEED=<printed seed> replays a failure's inputs."""
    replay = os.environ.get("MSA_TEST_SEED")
    s = int(replay) if replay else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


@pytest.fixture
def native_hooks():
    """msa._native.debug's hooks for the rest of one test, undone after it:
    native_hooks.force(fmha_form="wsup", ...), native_hooks.poison() (NaN-filled outputs),
    native_hooks.last_variant(op)."""
    from msa._native import debug
    with contextlib.ExitStack() as stack:
        yield SimpleNamespace(
            force=lambda **hooks: stack.enter_context(debug.forcing(**hooks)),
            poison=lambda: stack.enter_context(debug.poisoned_outputs()),
            last_variant=debug.last_variant)
