"""The decode kernels' lane-by-lane fragment models (tools/lab/model_decode_*_fragments.py) run
on the CPU: each replays a form's shared-memory layouts and register fragments with the
hardware's conventions, checks the products exactly and that a mutation of its key or channel
order is caught (each model asserts; a failure raises)."""
import runpy
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1] / "tools" / "lab"


@pytest.mark.parametrize("model", ["model_decode_pv_fragments.py",
                                   "model_decode_token_warps_fragments.py",
                                   "model_decode_indexer_nvfp4.py"])
def test_fragment_model_holds(model, capsys):
    runpy.run_path(str(LAB / model), run_name="__main__")
    assert "caught" in capsys.readouterr().out
