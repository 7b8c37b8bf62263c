"""Packaging: build.toml, the local variant build (tools/build_variant.py) and loading the built
variants through the Hugging Face `kernels` loader, as a user would (CPU only).

The variants are built once per module into a temporary repository layout
(<tmp>/repo/build/<variant>/) with a random build id, so the ops namespace / module name never
collides with another build loaded in the same process.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

# Offline before huggingface_hub / kernels are imported (they read it at import time).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
PACKAGE_DIR = ROOT / "torch-ext" / "msa"
REPO_ID = "MiniMaxAI/msa"

if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
import build_variant  # noqa: E402

from msa_testing import CONTRACT_ALL  # noqa: E402
EXPECTED_CUDA_VARIANT = "torch-cuda"     # built with --no-compile below
EXPECTED_LOADED_VARIANT = "torch-cpu" if torch.version.cuda is None else EXPECTED_CUDA_VARIANT


def run_build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / "build_variant.py"), *args],
                          capture_output=True, text=True, timeout=300)


def fresh_id() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def built_repo(tmp_path_factory):
    """A repository-shaped folder holding build/torch-cuda and build/torch-cpu."""
    repo = tmp_path_factory.mktemp("msa-kernel-repo")
    build_id = fresh_id()
    proc = run_build("--out", str(repo / "build"), "--no-compile", "--id", build_id)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return repo, build_id


@pytest.fixture(scope="module")
def loaded_kernel(built_repo):
    """The package as `kernels.get_local_kernel(Path(repo))` imports it."""
    import kernels

    repo, _ = built_repo
    return kernels.get_local_kernel(repo)


# ---------------------------------------------------------------------------------------------
# build.toml and the files kernel-builder owns
# ---------------------------------------------------------------------------------------------

def test_build_toml_has_required_settings():
    import tomllib

    config = tomllib.loads((ROOT / "build.toml").read_text())
    general = config["general"]
    assert general["name"] == "msa" and general["version"] == 0 and general["edition"] == 5
    assert general["license"] == "MIT" and general["backends"] == ["cuda"]
    assert general["upstream"] == "https://github.com/MiniMax-AI/MSA"
    assert general["python-depends"] == ["tvm-ffi"]
    assert general["hub"] == {"repo-id": REPO_ID, "branch": "v0"}
    assert general["cuda"]["minver"] == "12.8"
    assert general["cuda"]["python-depends"] == ["nvidia-cutlass-dsl"]
    assert config["torch"]["src"] == ["torch-ext/torch_binding.cpp", "torch-ext/torch_binding.h"]
    assert {"py", "json", "so"} <= set(config["torch"]["pyext"])
    kernel = config["kernel"]["msa"]
    assert kernel["backend"] == "cuda"
    assert kernel["cuda-capabilities"] == ["8.0+PTX", "8.9", "9.0a", "10.0a", "12.0"]
    assert kernel["depends"] == ["torch"] and kernel["include"] == ["torch-ext"]
    # Every CUDA source and header of csrc/ is built (a file left out fails the Nix build).
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cu*"))
    assert sorted(kernel["src"]) == sources and "csrc/decode_indexer.cu" in sources


def test_build_toml_passes_the_kernels_parser_and_dependency_allow_list():
    """The parser kernel-builder shares with `kernels` (unknown keys are errors), and the
    python-depends allow-list that `kernels` ships (an unknown name fails the build)."""
    kernels = pytest.importorskip("kernels")
    rust = pytest.importorskip("kernels._rust")   # absent from the GPU host's carried wheel
    Backend, Build = rust.Backend, rust.Build

    build = Build.open(ROOT)
    assert build.general.backends == [Backend.CUDA]
    allow = json.loads((Path(kernels.__file__).parent / "python_depends.json").read_text())
    config = build_variant.load_config(ROOT)
    assert set(config.general_python_depends) <= set(allow["general"])
    assert set(config.cuda_python_depends) <= set(allow["backends"]["cuda"])


def test_repository_does_not_hold_files_that_kernel_builder_generates():
    """`kernel-builder create-pyproject` (run by the Nix build without --force) refuses to
    overwrite these; _ops.py is generated per variant."""
    generated = ["setup.py", "pyproject.toml", "CMakeLists.txt", "torch-ext/registration.h",
                 "torch-ext/msa/_ops.py", "metadata-cuda.json", "metadata-cpu.json"]
    git = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others",
                          "--exclude-standard", "--", *generated],
                         capture_output=True, text=True)
    if git.returncode == 0:
        present = git.stdout.split()
    else:   # not a git checkout
        present = [p for p in generated if (ROOT / p).exists()]
    assert present == []


def test_flake_uses_gen_kernel_flake_outputs():
    flake = (ROOT / "flake.nix").read_text()
    assert 'kernel-builder.url = "github:huggingface/kernels"' in flake
    assert "kernel-builder.lib.genKernelFlakeOutputs" in flake and "inherit self;" in flake


def test_license_is_mit_with_third_party_notices():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the msa authors" in text
    assert "Third-party notices" in text
    for name in ("PyTorch", "BSD-3-Clause", "nvidia-cutlass-dsl", "apache-tvm-ffi",
                 "Apache License 2.0"):
        assert name in text


# ---------------------------------------------------------------------------------------------
# Package sources
# ---------------------------------------------------------------------------------------------

def absolute_msa_imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "msa" or alias.name.startswith("msa."):
                    yield f"{path.relative_to(ROOT)}:{node.lineno} import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "msa" or node.module.startswith("msa."):
                yield f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import ..."


def test_package_uses_only_relative_imports_of_itself():
    """The loader registers the package as sys.modules[metadata.id], not as `msa`."""
    # Symlinked subpackages are followed too: they are part of the importable source tree.
    files = sorted(Path(d) / f for d, _, names in os.walk(PACKAGE_DIR, followlinks=True)
                   for f in names if f.endswith(".py"))
    assert files
    offenders = [hit for f in files for hit in absolute_msa_imports(f)]
    assert offenders == []


TORCH_LIBRARY_DECORATORS = {"custom_op", "triton_op", "register_kernel", "register_fake",
                            "register_vmap", "register_torch_dispatch"}


def _called_name(call: ast.Call):
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def test_torch_library_decorators_use_the_namespace_prefix():
    """The Nix build's torch-ops-check: a top-level function/class decorated with a
    torch.library registration must name its op through add_op_namespace_prefix(...)."""
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and deco.args
                        and _called_name(deco) in TORCH_LIBRARY_DECORATORS):
                    first = deco.args[0]
                    if not (isinstance(first, ast.Call)
                            and _called_name(first) == "add_op_namespace_prefix"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert offenders == []


# ---------------------------------------------------------------------------------------------
# Naming and the build script's pieces
# ---------------------------------------------------------------------------------------------

def test_variant_and_namespace_names():
    assert build_variant.torch_cuda_variant_name(
        "2.11.0+cu130", "13.0", True, "x86_64-linux") == "torch211-cxx11-cu130-x86_64-linux"
    assert build_variant.torch_cuda_variant_name(
        "2.9.1", "12.8", True, "aarch64-linux") == "torch29-cxx11-cu128-aarch64-linux"
    assert build_variant.ops_name("msa", "cuda", "1a2b3c4") == "_msa_cuda_1a2b3c4"
    assert len(build_variant.random_id()) == 13
    with pytest.raises(build_variant.ConfigError, match="--id"):
        build_variant.build_id(ROOT, "bad-id")


def test_gencode_flags_for_arch_specific_capabilities():
    import cuda_extension

    assert cuda_extension.gencode_flags(["9.0a", "10.0a"]) == [
        "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a"]
    assert cuda_extension.gencode_flags(["12.0+PTX"]) == [
        "-gencode=arch=compute_120,code=[sm_120,compute_120]"]


# sha256 of kernel-builder's kernel-builder/src/pyproject/templates/torch/_ops.py.in
# (huggingface/kernels 8ac69fc), the file CMake configures into every compiled variant.
KERNEL_BUILDER_OPS_TEMPLATE_SHA256 = (
    "933e544bcbad82151547591748831765cc21b6d55564055989859ccbe905a0d7")


def test_compiled_variant_ops_module_is_kernel_builders_template_verbatim():
    import hashlib

    template = build_variant.KERNEL_BUILDER_OPS_TEMPLATE
    assert hashlib.sha256(template.encode()).hexdigest() == KERNEL_BUILDER_OPS_TEMPLATE_SHA256
    source = build_variant.ops_module_source("_msa_cuda_1a2b3c4", compiled=True)
    assert source == template.replace("@OPS_NAME@", "_msa_cuda_1a2b3c4")
    # Nothing but ops and add_op_namespace_prefix: the package may rely on nothing else.
    tree = ast.parse(source)
    defined = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets}
    defined |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert defined == {"ops", "add_op_namespace_prefix"}
    noarch = build_variant.ops_module_source("_msa_cpu_1a2b3c4", compiled=False)
    assert noarch == template.replace("@OPS_NAME@", "_msa_cpu_1a2b3c4").replace(
        "from . import _msa_cpu_1a2b3c4\n", "")
    namespace = {}
    exec(compile(noarch, "_ops", "exec"), namespace)
    assert namespace["add_op_namespace_prefix"]("f") == "_msa_cpu_1a2b3c4::f"
    assert namespace["ops"] is getattr(torch.ops, "_msa_cpu_1a2b3c4")


def test_package_reads_nothing_from_ops_but_the_template_names():
    """The package imports only ``ops`` / ``add_op_namespace_prefix`` from _ops, and every
    compiled op it calls is one csrc defines (torch_binding.cpp) and compiled_ops lists."""
    binding = (ROOT / "torch-ext" / "torch_binding.cpp").read_text()
    defined = re.findall(r'ops\.def\(\s*"(\w+)\(', binding)
    compiled_ops = _source_module("_native.compiled_ops")
    assert sorted(defined) == sorted(compiled_ops.CSRC_OPS)
    imported, called = set(), set()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        # compiled_ops inspects the namespace itself; _compile_entries calls the package's own
        # custom ops there (tests/test_torch_compile.py checks those).
        if path.name in ("compiled_ops.py", "_compile_entries.py"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_ops") \
                    and node.level > 0:
                imported |= {a.name for a in node.names}
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "ops"):
                called.add(node.attr)
    assert imported <= {"ops", "add_op_namespace_prefix"}, imported
    assert called and called <= set(defined), called - set(defined)


def _source_module(name):
    """A submodule of the source-tree package (imported as tests/conftest.py set it up)."""
    return importlib.import_module(f"msa.{name}")


def test_missing_csrc_files_give_a_clear_error(tmp_path):
    (tmp_path / "build.toml").write_text((ROOT / "build.toml").read_text())
    config = build_variant.load_config(tmp_path)
    with pytest.raises(build_variant.ConfigError,
                       match=r"csrc/build_k2q_csr\.cu.*torch-ext/torch_binding\.cpp"):
        build_variant.kernel_sources(config, tmp_path)


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch")
def test_require_compiled_fails_on_cpu_torch(tmp_path):
    # An empty --cute-artifacts folder: the CuTe kernels are not what this checks, and compiling
    # all of them (build_variant's default) takes minutes on a 2-core machine.
    (tmp_path / "no-artifacts").mkdir()
    proc = run_build("--out", str(tmp_path / "build"), "--require-compiled", "--id", fresh_id(),
                     "--cute-artifacts", str(tmp_path / "no-artifacts"))
    assert proc.returncode == 1
    assert "not a CUDA build" in proc.stderr
    # The noarch variants are still written.
    assert (tmp_path / "build" / "torch-cuda" / "metadata.json").is_file()


def test_cute_artifacts_and_stale_variants(tmp_path):
    artifacts = tmp_path / "artifacts"
    (artifacts / "sm90").mkdir(parents=True)
    (artifacts / "manifest.json").write_text('{"kernels": []}')
    (artifacts / "sm90" / "kernel.so").write_bytes(os.urandom(64))
    (artifacts / "notes.txt").write_text("not shipped")
    out = tmp_path / "build"
    stale = out / "torch211-cxx11-cu130-x86_64-linux"
    stale.mkdir(parents=True)
    (stale / "metadata.json").write_text('{"name": "msa"}')
    foreign = out / "torch-universal"
    foreign.mkdir()
    (foreign / "metadata.json").write_text('{"name": "other"}')

    proc = run_build("--out", str(out), "--no-compile", "--id", fresh_id(),
                     "--cute-artifacts", str(artifacts))
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists() and foreign.exists()
    shipped = out / "torch-cuda" / "_artifacts"
    assert (shipped / "manifest.json").read_text() == '{"kernels": []}'
    assert (shipped / "sm90" / "kernel.so").read_bytes() == \
        (artifacts / "sm90" / "kernel.so").read_bytes()
    assert not (shipped / "notes.txt").exists() and "notes.txt skipped" in proc.stderr
    assert not (out / "torch-cpu" / "_artifacts").exists()


# ---------------------------------------------------------------------------------------------
# The built variants
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,backend", [("torch-cuda", "cuda"), ("torch-cpu", "cpu")])
def test_variant_layout_and_metadata(built_repo, variant, backend):
    repo, build_id = built_repo
    path = repo / "build" / variant
    metadata = json.loads((path / "metadata.json").read_text())
    ops = f"_msa_{backend}_{build_id}"
    assert metadata["name"] == "msa" and metadata["id"] == ops
    assert metadata["version"] == 0 and metadata["license"] == "MIT"
    assert metadata["backend"] == {"type": backend}      # noarch: no archs, any device
    expected_deps = ["tvm-ffi", "nvidia-cutlass-dsl"] if backend == "cuda" else ["tvm-ffi"]
    assert metadata["python-depends"] == expected_deps
    # Flat layout: every package file at the same relative path, plus the generated _ops.py.
    sources = {p.relative_to(PACKAGE_DIR) for p in build_variant.package_files(PACKAGE_DIR)
               if p.suffix == ".py"}
    shipped = {p.relative_to(path) for p in path.rglob("*.py") if "__pycache__" not in p.parts}
    assert shipped == sources | {Path("_ops.py")}
    assert not list(path.glob("*.so"))
    assert (path / "_ops.py").read_text() == build_variant.ops_module_source(ops, compiled=False)

    kernels_rust = pytest.importorskip("kernels._rust")
    parsed = kernels_rust.Metadata.read_from_file(path / "metadata.json")
    assert parsed.id == ops and parsed.python_depends == expected_deps


def test_get_local_kernel_loads_the_package(built_repo, loaded_kernel):
    repo, build_id = built_repo
    module = loaded_kernel
    assert Path(module.__file__).parent == repo / "build" / EXPECTED_LOADED_VARIANT
    assert module.__all__ == CONTRACT_ALL
    for name in CONTRACT_ALL:
        assert hasattr(module, name), name
    ops_module = importlib.import_module(f"{module.__name__}._ops")
    assert ops_module.add_op_namespace_prefix("f") == f"{module.__name__}::f"
    compiled_ops = importlib.import_module(f"{module.__name__}._native.compiled_ops")
    assert compiled_ops.ops is ops_module.ops
    reason = compiled_ops.missing_reason(*compiled_ops.CSRC_OPS)
    assert reason is not None and "run_build_k2q_csr" in reason and module.__name__ in reason


def _stand_in_library(ops: str) -> str:
    """Python source that registers, under `ops`, every op torch_binding.cpp defines with the
    same schema (no kernels): what importing _msa_cuda_<id>.abi3.so does, minus the CUDA."""
    binding = (ROOT / "torch-ext" / "torch_binding.cpp").read_text()
    schemas = []
    for call in re.findall(r'ops\.def\(((?:\s*"[^"]*")+)\s*\)', binding):
        schemas.append("".join(re.findall(r'"([^"]*)"', call)))
    return ("import torch\n"
            f"_lib = torch.library.Library({ops!r}, 'DEF')\n"
            + "".join(f"_lib.define({schema!r})\n" for schema in schemas))


def test_compiled_template_variant_serves_every_csrc_op(tmp_path):
    """A variant whose _ops.py is kernel-builder's compiled template, verbatim: the package
    finds every compiled op through ``ops`` and each native csrc op's ``supports`` accepts (on
    a CPU torch the library is a stand-in registering the same schemas)."""
    build_id = fresh_id()
    proc = run_build("--out", str(tmp_path / "build"), "--no-compile", "--id", build_id)
    assert proc.returncode == 0, proc.stderr
    variant = tmp_path / "build" / "torch-cuda"
    ops = f"_msa_cuda_{build_id}"
    (variant / "_ops.py").write_text(build_variant.ops_module_source(ops, compiled=True))
    (variant / f"{ops}.py").write_text(_stand_in_library(ops))
    # As kernels' importer does (the loader itself refuses a CUDA variant's dependencies on a
    # CPU torch): the package under its metadata id.
    spec = importlib.util.spec_from_file_location(ops, variant / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[ops] = module
    spec.loader.exec_module(module)
    native = importlib.import_module(f"{ops}._native")
    assert native.compiled_ops.missing_reason(*native.compiled_ops.CSRC_OPS) is None
    assert native.csr_builder.supports() is None
    assert native.topk_cuda.supports(topk=16) is None
    assert native.decode_cuda.supports(seqlen_q=1, qhead_per_kv=16) is None
    assert native.compiled_ops.has(native.fmha_sm90.TRANSPOSE_V_OP)


def test_local_kernels_override_with_get_kernel(built_repo, loaded_kernel, monkeypatch):
    import kernels

    repo, _ = built_repo
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO_ID}={repo}")
    module = kernels.get_kernel(REPO_ID, version=0, trust_remote_code=[REPO_ID])
    assert Path(module.__file__).parent == repo / "build" / EXPECTED_LOADED_VARIANT
    assert module.__all__ == CONTRACT_ALL
    assert callable(module.build_k2q_csr) and callable(module.sparse_atten_func)


def test_loading_does_not_initialize_cuda(built_repo):
    """In a fresh interpreter: the loader plus the package import leave CUDA uninitialized."""
    repo, _ = built_repo
    code = (
        "import json, sys; from pathlib import Path; import torch, kernels\n"
        "m = kernels.get_local_kernel(Path(sys.argv[1]))\n"
        "print(json.dumps({'cuda': torch.cuda.is_initialized(), 'all': m.__all__}))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code, str(repo)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"cuda": False, "all": CONTRACT_ALL}


@pytest.mark.gpu
@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_compiled_variant_builds_and_loads(tmp_path):
    """On a CUDA host with nvcc: the arch variant compiles (sm_90a only, to keep it short),
    registers the csrc ops under its namespace and imports without initializing CUDA."""
    build_id = fresh_id()
    (tmp_path / "no-artifacts").mkdir()      # csrc only: no CuTe compile (minutes)
    proc = run_build("--out", str(tmp_path / "build"), "--require-compiled",
                     "--cuda-capabilities", "9.0a", "--id", build_id,
                     "--cute-artifacts", str(tmp_path / "no-artifacts"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    variant = tmp_path / "build" / build_variant.torch_cuda_variant_name(
        torch.__version__, torch.version.cuda, bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    ops = f"_msa_cuda_{build_id}"
    assert (variant / f"{ops}.abi3.so").is_file()
    assert json.loads((variant / "metadata.json").read_text())["backend"] == {
        "type": "cuda", "archs": ["9.0a"]}
    code = (
        "import importlib, importlib.util, json, sys, torch\n"
        "name, path = sys.argv[1], sys.argv[2]\n"
        "spec = importlib.util.spec_from_file_location(name, path + '/__init__.py')\n"
        "m = importlib.util.module_from_spec(spec); sys.modules[name] = m\n"
        "spec.loader.exec_module(m)\n"
        "o = importlib.import_module(name + '._ops')\n"
        "c = importlib.import_module(name + '._native.compiled_ops')\n"
        "print(json.dumps({'cuda': torch.cuda.is_initialized(),\n"
        "  'compiled': c.missing_reason(*c.CSRC_OPS) is None,\n"
        "  'ops': sorted(n for n in torch._C._dispatch_get_all_op_names()\n"
        "                if n.startswith(name + '::'))}))\n")
    loaded = subprocess.run([sys.executable, "-c", code, ops, str(variant)],
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    result = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert result["cuda"] is False and result["compiled"] is True
    assert {f"{ops}::{name}" for name in _source_module("_native.compiled_ops").CSRC_OPS} \
        <= set(result["ops"])
    assert (variant / "_ops.py").read_text() == build_variant.ops_module_source(ops, True)


# ---------------------------------------------------------------------------------------------
# Smoke call through the loaded module
# ---------------------------------------------------------------------------------------------

BLOCK = 128


def random_q2k(lengths, hkv, topk, generator):
    """[Hkv, total_q, topK] int32: own block forced, random other blocks, -1 at random slots."""
    rows = []
    for length in lengths:
        n_blocks = -(-length // BLOCK)
        for i in range(length):
            for _h in range(hkv):
                others = [b for b in torch.randperm(n_blocks, generator=generator).tolist()
                          if b != i // BLOCK]
                chosen = [i // BLOCK] + others[: int(torch.randint(0, topk, (1,),
                                                                   generator=generator))]
                chosen = chosen[:topk] + [-1] * (topk - len(chosen[:topk]))
                perm = torch.randperm(topk, generator=generator).tolist()
                rows.append([chosen[p] for p in perm])
    total_q = sum(lengths)
    q2k = torch.tensor(rows, dtype=torch.int32).view(total_q, hkv, topk)
    return q2k.permute(1, 0, 2).contiguous()


def dense_reference(q, k, v, q2k, lengths, scale):
    """float64 attention over the selected blocks, causal bottom-right; O and LSE."""
    total_q, hq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = torch.zeros(total_q, hq, dim, dtype=torch.float64)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64)
    start = 0
    for length in lengths:
        sl = slice(start, start + length)
        pos = torch.arange(length)
        causal = pos.view(-1, 1) >= pos.view(1, -1)           # q_len == k_len
        for h in range(hq):
            kv_head = h // group
            sel = q2k[kv_head, sl].long()                       # [len, topK]
            key_block = (pos // BLOCK).view(1, 1, -1)
            selected = (sel.unsqueeze(-1) == key_block).any(1)  # [len, len]
            mask = selected & causal
            scores = (q[sl, h].double() @ k[sl, kv_head].double().T) * scale
            scores = scores.masked_fill(~mask, -math.inf)
            lse[sl, h] = torch.logsumexp(scores, dim=-1)
            out[sl, h] = torch.softmax(scores, dim=-1) @ v[sl, kv_head].double()
        start += length
    return out, lse


def test_smoke_call_through_loaded_module(loaded_kernel, seed):
    module = loaded_kernel
    sparse_index_utils = importlib.import_module(f"{module.__name__}.sparse_index_utils")
    generator = torch.Generator().manual_seed(seed)
    lengths, hkv, group, topk, dim = [130, 257], 1, 2, 4, 128
    total = sum(lengths)
    cu = torch.tensor([0, lengths[0], total], dtype=torch.int32)
    q2k = random_q2k(lengths, hkv, topk, generator)
    q = torch.randn(total, hkv * group, dim, generator=generator).to(torch.bfloat16)
    k = torch.randn(total, hkv, dim, generator=generator).to(torch.bfloat16)
    v = torch.randn(total, hkv, dim, generator=generator).to(torch.bfloat16)

    row_ptr, q_idx = module.build_k2q_csr(q2k, cu, cu, BLOCK, total_k=total,
                                          max_seqlen_k=max(lengths), max_seqlen_q=max(lengths),
                                          qhead_per_kv=group)
    ref_row_ptr, ref_q_idx = sparse_index_utils.build_k2q_csr_torch_reference(
        q2k, cu, cu, BLOCK, total_rows=row_ptr.shape[1] - 1)
    assert torch.equal(row_ptr, ref_row_ptr)
    used = int(row_ptr[0, -1])
    assert used == int((q2k >= 0).sum())
    assert torch.equal(q_idx[:, :used], ref_q_idx[:, :used])

    scale = dim ** -0.5
    out, lse = module.sparse_atten_func(
        q, k, v, row_ptr, q_idx, topk, cu_seqlens_q=cu, cu_seqlens_k=cu,
        max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), blk_kv=BLOCK, causal=True,
        softmax_scale=scale, return_softmax_lse=True)
    assert out.shape == (total, hkv * group, dim) and out.dtype == torch.bfloat16
    want_out, want_lse = dense_reference(q, k, v, q2k, lengths, scale)
    torch.testing.assert_close(out.double(), want_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-4)
