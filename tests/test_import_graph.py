"""CPU: the package's layering, read from the source (every import, lazy ones included).

Layers, top to bottom; a module imports only its own layer or the layers below it:
  0  msa (the package __init__), msa.layers*         what users import
  1  the public API modules (msa.fmha, msa.interface, msa.indexer, ...)
  2  msa._native.*                                   glue: dispatch choices, launches
  3  msa._backend, msa._validation, msa._common, msa._stages, msa._ops, msa._fp4_format,
     msa.reference.*, msa.schedules.*, msa.sparse_index_utils,
     msa.src.* (upstream's paths, re-exports)        shared host code and references
  4  msa.cute_kernels.*                              kernel sources and their serving tables
The module graph has no cycles, function-level (lazy) imports included: a module that needs a
name from a module importing it takes it from a lower module both share. Inside cute_kernels, a kernel module (one that defines a
@cute.kernel) imports no other kernel module: shared building blocks live in helper modules,
and only build.py gathers the kernels. Artifact names are built only by
cute_kernels/variants.py.
"""

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "torch-ext" / "msa"
LOWER_LAYERS = {
    2: ("msa._native",),
    3: ("msa._backend", "msa._validation", "msa._common", "msa._stages", "msa._ops",
        "msa._fp4_format", "msa.reference", "msa.schedules", "msa.sparse_index_utils", "msa.src"),
    4: ("msa.cute_kernels",),
}
ARTIFACT_PREFIXES = ("fmha_sm90_", "sparse_prefill_sm90_", "sparse_combine_sm90_",
                     "block_max_score_sm90_")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module or ""


def _imports(modules):
    """module -> {(imported msa module, names imported from it)}, every import statement of the
    module (at module level or inside a function)."""
    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, path, node)
                if not target.startswith("msa"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:                       # from . import submodule
                        edges.add((sub, ""))
                    else:
                        edges.add((target, alias.name))
            elif isinstance(node, ast.Import):
                edges.update((a.name, "") for a in node.names if a.name.startswith("msa."))
        graph[module] = {(t, n) for t, n in edges if t in modules and t != module}
    return graph


def _layer(module: str) -> int:
    if module == "msa" or module.startswith("msa.layers"):
        return 0
    for layer, prefixes in LOWER_LAYERS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    return 1


def test_no_module_imports_a_layer_above_it():
    graph = _imports(_modules())
    upward = sorted(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
                    for m, edges in graph.items() for t, _ in edges if _layer(t) < _layer(m))
    assert not upward, "\n".join(upward)


def test_native_glue_imports_no_private_name_of_the_public_api():
    graph = _imports(_modules())
    private = sorted(f"{m}: {t}.{name}" for m, edges in graph.items()
                     if m.startswith("msa._native") for t, name in edges
                     if _layer(t) <= 1 and name.startswith("_"))
    assert not private, "\n".join(private)


def test_the_module_graph_has_no_cycles_lazy_imports_included():
    graph = {m: {t for t, _ in edges} for m, edges in _imports(_modules()).items()}
    # A package's __init__ is imported with any of its submodules: walk its edges too, but not
    # the implicit parent edge (a submodule "importing" its own package is not a cycle).
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_no_kernel_module_imports_another_kernel_module():
    modules = {m: p for m, p in _modules().items() if m.startswith("msa.cute_kernels.")}
    kernels = {m for m, p in modules.items() if "@cute.kernel" in p.read_text()}
    assert {"msa.cute_kernels.fmha_sm90", "msa.cute_kernels.fmha_sm90_ws",
            "msa.cute_kernels.combine"} <= kernels
    graph = _imports(modules)
    bad = sorted({f"{m} imports {t}" for m, edges in graph.items()
                  if m != "msa.cute_kernels.build" for t, _ in edges if t in kernels})
    assert not bad, "\n".join(bad)


def test_artifact_names_are_built_only_by_the_variants_module():
    """No string (or f-string) in the package starts an artifact name except in
    cute_kernels/variants.py, whose variant classes' ``name`` is the one place."""
    found = []
    for module, path in _modules().items():
        if module == "msa.cute_kernels.variants":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            head = node
            if isinstance(node, ast.JoinedStr):
                head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and \
                    head.value.startswith(ARTIFACT_PREFIXES):
                found.append(f"{module}:{node.lineno}: {head.value[:40]!r}")
    assert not found, "\n".join(found)
