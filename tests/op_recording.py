"""Calling the public functions eagerly through their custom ops, as a compiled graph runs them,
and recording each op call, so torch.library.opcheck can check the ops on real arguments
(tests/test_torch_compile.py on the CPU, tests/test_hub_variant_gpu.py on the native path)."""

import importlib

import torch


class OpCallRecording:
    """While active, every dispatcher of `package` (a loaded msa build) goes through its custom
    op, whose implementation then dispatches eagerly, and each op call is kept in ``calls`` as
    (op name, op, args). It stands in for the op namespace the compile entries call."""

    def __init__(self, package, monkeypatch):
        self._backend = importlib.import_module(f"{package.__name__}._backend")
        self._entries = importlib.import_module(f"{package.__name__}._compile_entries")
        self._namespace = self._entries.ops
        self._original_entry = self._backend.compile_entry
        self._monkeypatch = monkeypatch
        self._inside = []
        self.calls = []
        monkeypatch.setattr(self._backend, "compile_entry", self._entry)
        monkeypatch.setattr(self._entries, "ops", self)

    def _entry(self, op):
        return None if self._inside else self._backend._compile_entries.get(op)

    def __getattr__(self, name):
        op = getattr(self._namespace, name)

        def record(*args):
            self.calls.append((name, op, args))
            self._inside.append(name)
            try:
                return op(*args)
            finally:
                self._inside.pop()
        return record

    def check(self):
        """Stop recording, then: every custom op was called, and each call passes opcheck
        (schema with its declared mutations only, fake vs real outputs, AOT tracing with
        dynamic shapes)."""
        self._monkeypatch.setattr(self._backend, "compile_entry", self._original_entry)
        self._monkeypatch.setattr(self._entries, "ops", self._namespace)
        assert {name for name, _op, _args in self.calls} == \
            set(self._entries.CUSTOM_OPS.values())
        for _name, op, args in self.calls:
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                        "test_aot_dispatch_dynamic"))
