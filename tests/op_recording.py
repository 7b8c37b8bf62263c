"""Calling the public functions eagerly through their custom ops, as a compiled graph runs them,
and recording each op call, so torch.library.opcheck can check the ops on real arguments
(tests/test_torch_compile.py on the CPU, tests/test_hub_variant_gpu.py on the native path)."""

import importlib

import torch


def record_custom_op_calls(package, monkeypatch):
    """Patch `package` (a loaded msa build) so every dispatcher goes through its custom op,
    whose implementation then dispatches eagerly; returns the list that collects
    (op name, op, args) per call."""
    backend = importlib.import_module(f"{package.__name__}._backend")
    entries = importlib.import_module(f"{package.__name__}._compile_entries")
    calls, inside_op, namespace = [], [], entries.ops

    class Recorder:
        def __getattr__(self, name):
            op = getattr(namespace, name)

            def record(*args):
                calls.append((name, op, args))
                inside_op.append(name)
                try:
                    return op(*args)
                finally:
                    inside_op.pop()
            return record

    monkeypatch.setattr(backend, "compile_entry",
                        lambda op: None if inside_op else backend._compile_entries.get(op))
    monkeypatch.setattr(entries, "ops", Recorder())
    return calls


def check_recorded_ops(package, calls):
    """Every custom op was called, and each call passes opcheck: schema (declared mutations
    only), fake vs real outputs, AOT tracing with dynamic shapes."""
    entries = importlib.import_module(f"{package.__name__}._compile_entries")
    assert {name for name, _op, _args in calls} == set(entries.CUSTOM_OPS.values())
    for _name, op, args in calls:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                    "test_aot_dispatch_dynamic"))
