#!/usr/bin/env python3
"""Lay out build/<variant>/ for the msa Hub kernel without Nix (development and CI glue).

    python tools/build_variant.py [--out build] [--no-compile] [--cute] [--cute-artifacts DIR]

Writes, as kernel-builder lays them out (flat variant directories, loadable with
``kernels.get_local_kernel(Path(repo))`` or ``LOCAL_KERNELS=MiniMaxAI/msa=<repo>``):

* the CUDA variant:
  - ``torch<MAJ><MIN>-cxx11-cu<XY>-<cpu>-linux`` when torch is a CUDA build, nvcc (same CUDA
    major, >= [general.cuda] minver) is found and csrc compiles: all package files, ``_ops.py``,
    ``metadata.json`` with the compiled archs, and ``_msa_cuda_<id>.abi3.so``;
  - otherwise the noarch ``torch-cuda`` (the same package without compiled ops; every call
    runs the PyTorch reference or a CuTe-DSL kernel);
  - plus the precompiled CuTe-DSL kernels in ``_artifacts/``: from ``--cute-artifacts DIR``, or
    compiled by tools/compile_cute.py into ``.artifacts/`` (reused while the kernel sources are
    unchanged) when nvidia-cutlass-dsl is installed and either this machine has an sm_90 GPU,
    where they run, or ``--cute`` asks for them. Elsewhere they are not compiled (minutes on a
    small CPU machine for nothing it can run): a GPU then compiles each kernel on first use
    into its JIT cache, or all at once with ``msa.warmup()``.
* ``torch-cpu``: the package with the PyTorch reference backend, for CPU-only machines.

Earlier msa variants in the output directory are removed first, so a stale compiled variant
can never shadow a fresh noarch one. Local builds use the host toolchain and are not
Hub-compliant: publish only with the Nix build (flake.nix, ``kernel-builder build-and-upload``).

Exit status: 0 on success (including a fallback to noarch after a failed compile, which is
reported on stderr), 1 when ``--require-compiled`` is given and no compiled variant was built,
2 for invalid configuration or arguments.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_extension  # noqa: E402  (sibling helper module)

REPO_ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS_DIR_NAME = "_artifacts"
DEFAULT_PYEXT = ("py", "pyi")
# Source subtrees whose git tree ids make up the build id (the ops namespace suffix).
ID_SOURCE_DIRS = ("csrc", "torch-ext")


class ConfigError(ValueError):
    """build.toml or the command line is unusable; the message names the setting."""


# ---------------------------------------------------------------------------------------------
# build.toml
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CudaComponent:
    """One ``[kernel.<name>]`` table with backend = "cuda"."""
    name: str
    src: List[str]
    include: List[str]
    capabilities: List[str]
    cuda_flags: List[str]
    cxx_flags: List[str]
    depends: List[str]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The parts of build.toml (edition 5) that a local build needs."""
    name: str
    version: int
    license: str
    backends: List[str]
    upstream: Optional[str]
    source: Optional[str]
    general_python_depends: List[str]
    cuda_python_depends: List[str]
    cuda_minver: Optional[str]
    torch_src: List[str]
    torch_include: List[str]
    torch_cxx_flags: List[str]
    pyext: List[str]
    cuda_components: List[CudaComponent]

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    def python_depends(self, backend: str) -> List[str]:
        """General plus backend-scoped dependencies, as metadata.json lists them."""
        extra = self.cuda_python_depends if backend == "cuda" else []
        return list(dict.fromkeys(self.general_python_depends + extra))

    @property
    def cuda_capabilities(self) -> List[str]:
        caps: List[str] = []
        for component in self.cuda_components:
            caps.extend(c for c in component.capabilities if c not in caps)
        return caps


def validate_with_kernels(root: Path, config: "KernelConfig") -> None:
    """When the `kernels` package is installed, check build.toml with the parser that
    kernel-builder shares with it (unknown keys are errors) and the python-depends names with
    its allow-list. Without `kernels` (e.g. a bare GPU host) only load_config's checks apply."""
    try:
        import kernels
        from kernels._rust import Build
    except ImportError:
        return
    try:
        Build.open(root)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    allow_path = Path(kernels.__file__).parent / "python_depends.json"
    if allow_path.is_file():
        allow = json.loads(allow_path.read_text())
        bad = [d for d in config.general_python_depends if d not in allow.get("general", {})]
        bad += [d for d in config.cuda_python_depends
                if d not in allow.get("backends", {}).get("cuda", {})]
        if bad:
            raise ConfigError(
                f"build.toml: python-depends {bad} are not in the kernels allow-list "
                f"(general: {sorted(allow.get('general', {}))}; [general.cuda]: "
                f"{sorted(allow.get('backends', {}).get('cuda', {}))})")


def load_config(root: Path) -> KernelConfig:
    """Parse ``root/build.toml``; raises ConfigError for a missing key or wrong edition."""
    path = root / "build.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"build.toml: not found in {root}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"build.toml: {exc}") from None
    general = data.get("general", {})
    for key in ("name", "version", "license", "backends"):
        if key not in general:
            raise ConfigError(f"build.toml: [general] {key} is required")
    if general.get("edition") != 5:
        raise ConfigError("build.toml: [general] edition must be 5")
    if "torch" not in data:
        raise ConfigError("build.toml: a [torch] section is required (AOT torch extension)")
    torch_section = data["torch"]
    cuda_general = general.get("cuda", {})
    components = []
    for name, table in sorted(data.get("kernel", {}).items()):
        if table.get("backend") != "cuda":
            continue
        components.append(CudaComponent(
            name=name, src=list(table.get("src", [])), include=list(table.get("include", [])),
            capabilities=list(table.get("cuda-capabilities", [])),
            cuda_flags=list(table.get("cuda-flags", [])),
            cxx_flags=list(table.get("cxx-flags", [])), depends=list(table.get("depends", []))))
    return KernelConfig(
        name=general["name"], version=int(general["version"]), license=general["license"],
        backends=list(general["backends"]),
        upstream=general.get("upstream"), source=general.get("source"),
        general_python_depends=list(general.get("python-depends", [])),
        cuda_python_depends=list(cuda_general.get("python-depends", [])),
        cuda_minver=cuda_general.get("minver"),
        torch_src=list(torch_section.get("src", [])),
        torch_include=list(torch_section.get("include", [])),
        torch_cxx_flags=list(torch_section.get("cxx-flags", [])),
        pyext=list(torch_section.get("pyext", DEFAULT_PYEXT)),
        cuda_components=components)


# ---------------------------------------------------------------------------------------------
# Naming: build id, ops namespace, variant directory
# ---------------------------------------------------------------------------------------------

def _git(root: Path, *args: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    except OSError:
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_source_id(root: Path) -> Optional[str]:
    """First 7 hex digits of the git tree id that HEAD's csrc/ and torch-ext/ form together.

    That is the id of a tree object holding exactly those two subtrees of HEAD (computed here,
    nothing is written to the repository), so it changes only when the compiled or shipped
    sources change. ``_dirty`` is appended when they differ from HEAD (modified, staged or
    untracked files). None outside a git checkout or when HEAD has neither directory.
    """
    listing = _git(root, "ls-tree", "HEAD", "--", *ID_SOURCE_DIRS)
    if not listing:
        return None
    body = b""
    for line in sorted(listing.splitlines(), key=lambda entry: entry.split("\t", 1)[1] + "/"):
        meta, name = line.split("\t", 1)
        mode, kind, oid = meta.split()
        if kind != "tree":
            continue
        body += f"40000 {name}".encode() + b"\0" + bytes.fromhex(oid)
    if not body:
        return None
    tree_id = hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()[:7]
    status = _git(root, "status", "--porcelain", "--", *ID_SOURCE_DIRS)
    return f"{tree_id}_dirty" if status else tree_id


def random_id() -> str:
    """13 lowercase base32 characters (64 random bits), as kernel-builder uses outside git."""
    return base64.b32encode(os.urandom(8)).decode().rstrip("=").lower()


def build_id(root: Path, override: Optional[str] = None) -> str:
    if override is not None:
        if not override or not all(c.isalnum() or c == "_" for c in override):
            raise ConfigError(f"--id: must be letters, digits or '_', got {override!r}")
        return override.lower()
    return git_source_id(root) or random_id()


def ops_name(python_name: str, backend: str, unique_id: str) -> str:
    """The op namespace, extension module name and metadata id: ``_msa_cuda_1a2b3c4``."""
    return f"_{python_name}_{backend}_{unique_id}"


def cpu_arch_and_os() -> str:
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    system = {"darwin": "darwin", "windows": "windows"}.get(platform.system().lower(), "linux")
    return f"{machine}-{system}"


def torch_cuda_variant_name(torch_version: str, cuda_version: str, cxx11_abi: bool,
                            arch_os: Optional[str] = None) -> str:
    """``torch211-cxx11-cu130-x86_64-linux`` for torch 2.11.x built with CUDA 13.0."""
    t_major, t_minor = cuda_extension.parse_version(torch_version)
    c_major, c_minor = cuda_extension.parse_version(cuda_version)
    arch_os = arch_os or cpu_arch_and_os()
    # Only Linux variants carry the C++ ABI tag (the loader compares it with
    # torch.compiled_with_cxx11_abi()).
    abi = ("cxx11-" if cxx11_abi else "cxx98-") if arch_os.endswith("-linux") else ""
    return f"torch{t_major}{t_minor}-{abi}cu{c_major}{c_minor}-{arch_os}"


# ---------------------------------------------------------------------------------------------
# Variant contents
# ---------------------------------------------------------------------------------------------

# kernel-builder's _ops.py for a compiled [torch] variant (its template _ops.py.in, @OPS_NAME@
# filled in by CMake's configure_file), reproduced byte for byte: the package must work with
# exactly this file, so the local build writes nothing else.
KERNEL_BUILDER_OPS_TEMPLATE = (
    "import torch\n"
    "from . import @OPS_NAME@\n"
    "ops = torch.ops.@OPS_NAME@\n"
    "\n"
    "def add_op_namespace_prefix(op_name: str):\n"
    '    """\n'
    "    Prefix op by namespace.\n"
    '    """\n'
    '    return f"@OPS_NAME@::{op_name}"\n')


def ops_module_source(ops: str, compiled: bool) -> str:
    """Text of the variant's ``_ops.py``: kernel-builder's template for a compiled variant; for
    a noarch one (local builds only: kernel-builder builds no noarch variant of a [torch]
    kernel) the same file without the library import, so ``ops`` is the variant's namespace
    holding no compiled op."""
    text = KERNEL_BUILDER_OPS_TEMPLATE.replace("@OPS_NAME@", ops)
    if not compiled:
        text = text.replace(f"from . import {ops}\n", "")
    return text


def variant_metadata(config: KernelConfig, ops: str, backend: str,
                     archs: Optional[Sequence[str]]) -> Dict[str, object]:
    """metadata.json content; ``archs`` only for a compiled CUDA variant (sorted, as
    kernel-builder writes them). A noarch variant omits them: it runs on any device."""
    metadata: Dict[str, object] = {"name": config.name, "id": ops, "version": config.version,
                                   "license": config.license}
    if config.upstream:
        metadata["upstream"] = config.upstream
    if config.source:
        metadata["source"] = config.source
    metadata["python-depends"] = config.python_depends(backend)
    metadata["kernel-depends"] = []
    backend_info: Dict[str, object] = {"type": backend}
    if archs:
        backend_info["archs"] = sorted(set(archs))
    metadata["backend"] = backend_info
    return metadata


def _extension_of(path: Path) -> str:
    return path.name.split(".", 1)[1] if "." in path.name else ""


def _matches_pyext(path: Path, pyext: Sequence[str]) -> bool:
    """kernel-builder copies ``*.<ext>`` for every pyext entry (``abi3.so`` ends in ``so``)."""
    return any(path.name.endswith("." + ext) for ext in pyext)


def package_files(package_dir: Path, warn=None) -> List[Path]:
    """All files under the package, as kernel-builder's CMake ``file(GLOB_RECURSE)`` sees them:
    symlinked files are included, symlinked directories are not descended into (policy
    CMP0009), so their contents never reach a Hub build. ``warn`` reports each such link."""
    found: List[Path] = []
    for dirpath, dirnames, filenames in os.walk(package_dir, followlinks=False):
        here = Path(dirpath)
        for name in list(dirnames):
            if (here / name).is_symlink():
                if warn is not None:
                    warn(f"{(here / name).relative_to(package_dir.parent)}: a symlinked "
                         "directory; kernel-builder does not follow it, so its files are not "
                         "shipped (make it a real directory to ship them)")
                dirnames.remove(name)
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        found.extend(here / name for name in filenames)
    return sorted(found)


def _copy_file(src: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, target)


def copy_package(package_dir: Path, dest: Path, pyext: Sequence[str], warn) -> int:
    """Copy every ``*.<pyext>`` file of the package, keeping subdirectories; returns the count.

    Skipped: __pycache__, symlinked directories (see package_files), a source ``_ops.py`` (the
    variant's is generated) and compiled ops libraries (``*.abi3.so`` at the package top)
    left in the source tree by an in-place build.
    """
    count = 0
    for src in package_files(package_dir, warn):
        rel = src.relative_to(package_dir)
        if not _matches_pyext(src, pyext):
            continue
        if rel == Path("_ops.py") or (len(rel.parts) == 1 and src.name.endswith(".abi3.so")):
            warn(f"{package_dir.name}/{rel}: skipped (generated per variant)")
            continue
        _copy_file(src, dest / rel)
        count += 1
    return count


def cute_kernels_run_here() -> bool:
    """Whether this machine has a GPU the CuTe-DSL kernels (sm_90a) run on."""
    import torch
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def cached_cute_artifacts(root: Path, warn) -> Optional[Path]:
    """<root>/.artifacts compiled from the current CuTe sources (tools/compile_cute.py), reused
    while its manifest's sources_digest matches; None when the DSL is missing or compiling fails."""
    import importlib.util
    if importlib.util.find_spec("cutlass") is None:
        return None
    sys.path.insert(0, str(root / "tools"))
    import compile_cute
    out = root / ".artifacts"
    manifest = out / "manifest.json"
    want = compile_cute.sources_digest()
    if manifest.is_file() and json.loads(manifest.read_text()).get("sources_digest") == want:
        return out
    print(f"compiling the CuTe-DSL kernels for sm_90a into {out} (tools/compile_cute.py)")
    proc = subprocess.run([sys.executable, str(root / "tools" / "compile_cute.py"),
                           "--out", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        warn("tools/compile_cute.py failed; the variant ships no CuTe kernels:\n"
             + proc.stdout[-2000:] + proc.stderr[-2000:])
        return None
    return out


def copy_artifacts(artifacts_dir: Path, dest: Path, pyext: Sequence[str], warn) -> int:
    """Copy precompiled CuTe-DSL kernels into ``dest`` (the variant's ``_artifacts/``).

    Only the file kinds build.toml's pyext ships (so the Nix build, which copies
    torch-ext/msa/_artifacts/ by pyext, produces the same variant); others are reported.
    """
    count = 0
    for src in sorted(artifacts_dir.rglob("*")):
        if not src.is_file() or "__pycache__" in src.parts:
            continue
        rel = src.relative_to(artifacts_dir)
        if not _matches_pyext(src, pyext):
            warn(f"--cute-artifacts: {rel} skipped (extension .{_extension_of(src)} is not in "
                 f"build.toml [torch] pyext {list(pyext)})")
            continue
        _copy_file(src, dest / rel)
        count += 1
    return count


def remove_previous_variants(out_dir: Path, kernel_name: str) -> List[str]:
    """Delete variant directories of this kernel (metadata.json name matches) in out_dir."""
    removed = []
    if not out_dir.is_dir():
        return removed
    for entry in sorted(out_dir.iterdir()):
        meta = entry / "metadata.json"
        if not (entry.is_dir() and meta.is_file()):
            continue
        try:
            name = json.loads(meta.read_text()).get("name")
        except (OSError, ValueError):
            continue
        if name == kernel_name:
            shutil.rmtree(entry)
            removed.append(entry.name)
    return removed


@dataclasses.dataclass
class VariantResult:
    name: str
    path: Path
    ops: str
    backend: str
    compiled: bool
    archs: Optional[List[str]]
    files: int


def write_variant(*, config: KernelConfig, root: Path, out_dir: Path, variant: str,
                  backend: str, ops: str, library: Optional[Path],
                  archs: Optional[Sequence[str]], artifacts_dir: Optional[Path],
                  warn) -> VariantResult:
    """Write one flat variant directory ``out_dir/variant``."""
    dest = out_dir / variant
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    package_dir = root / "torch-ext" / config.python_name
    copy_package(package_dir, dest, config.pyext, warn)
    if artifacts_dir is not None:
        artifacts_dest = dest / ARTIFACTS_DIR_NAME
        if artifacts_dest.exists():   # --cute-artifacts replaces the source tree's copy
            shutil.rmtree(artifacts_dest)
        copy_artifacts(artifacts_dir, artifacts_dest, config.pyext, warn)
    if library is not None:
        shutil.copy2(library, dest / f"{ops}.abi3.so")
    (dest / "_ops.py").write_text(ops_module_source(ops, compiled=library is not None))
    metadata = variant_metadata(config, ops, backend, archs if library is not None else None)
    (dest / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    files = sum(1 for p in dest.rglob("*") if p.is_file())
    return VariantResult(variant, dest, ops, backend, library is not None,
                         metadata["backend"].get("archs"), files)  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# Compilation decision
# ---------------------------------------------------------------------------------------------

def kernel_sources(config: KernelConfig, root: Path) -> cuda_extension.CudaSources:
    """The files to compile; raises ConfigError naming every listed file that is missing."""
    listed = [s for c in config.cuda_components for s in c.src] + list(config.torch_src)
    missing = [s for s in listed if not (root / s).is_file()]
    if missing:
        raise ConfigError("build.toml lists source files that do not exist: "
                          + ", ".join(missing) + " (write them, or build with --no-compile)")
    cuda_files = [root / s for c in config.cuda_components for s in c.src if s.endswith(".cu")]
    cxx_files = [root / s for s in config.torch_src if s.endswith((".cpp", ".cc", ".cxx"))]
    if not cxx_files:
        raise ConfigError("build.toml: [torch] src has no .cpp binding to compile")
    include_dirs = [root / "csrc"]
    for inc in [i for c in config.cuda_components for i in c.include] + config.torch_include:
        if root / inc not in include_dirs:
            include_dirs.append(root / inc)
    return cuda_extension.CudaSources(
        cuda_files=cuda_files, cxx_files=cxx_files, include_dirs=include_dirs,
        cuda_flags=[f for c in config.cuda_components for f in c.cuda_flags],
        cxx_flags=[f for c in config.cuda_components for f in c.cxx_flags]
        + config.torch_cxx_flags)


@dataclasses.dataclass
class CompileOutcome:
    library: Optional[Path]
    archs: List[str]
    reason: str            # why no library, or a summary of what was built


def try_compile(*, config: KernelConfig, root: Path, ops: str, torch_cuda: Optional[str],
                capabilities: Optional[Sequence[str]], work_dir: Path, jobs: int,
                verbose: bool) -> CompileOutcome:
    """Compile the CUDA extension when the environment can; never raises BuildError."""
    if torch_cuda is None:
        return CompileOutcome(None, [], "torch is not a CUDA build: csrc is not compiled")
    try:
        sources = kernel_sources(config, root)
        toolchain = cuda_extension.find_toolchain()
        nvcc_version = toolchain.cuda_version
        torch_major = cuda_extension.parse_version(torch_cuda)[0]
        if nvcc_version[0] != torch_major:
            raise cuda_extension.BuildError(
                f"nvcc: CUDA {nvcc_version[0]}.{nvcc_version[1]} does not match torch's CUDA "
                f"{torch_cuda} (the major versions must agree)")
        if config.cuda_minver and nvcc_version < cuda_extension.parse_version(config.cuda_minver):
            raise cuda_extension.BuildError(
                f"nvcc: CUDA {nvcc_version[0]}.{nvcc_version[1]} is older than build.toml "
                f"[general.cuda] minver {config.cuda_minver}")
        wanted = list(capabilities) if capabilities else config.cuda_capabilities
        archs = cuda_extension.supported_capabilities(toolchain, wanted)
        skipped = [c for c in wanted if c not in archs]
        if skipped:
            print(f"note: nvcc {nvcc_version[0]}.{nvcc_version[1]} cannot target {skipped}; "
                  "building without them", file=sys.stderr)
        library = cuda_extension.compile_extension(
            sources=sources, ops_name=ops, capabilities=archs, toolchain=toolchain,
            work_dir=work_dir, jobs=jobs, verbose=verbose)
        registered = cuda_extension.check_extension_loads(library, ops)
    except (ConfigError, cuda_extension.BuildError) as exc:
        return CompileOutcome(None, [], str(exc))
    summary = f"compiled for {archs}; registered ops: {', '.join(registered) or 'none'}"
    return CompileOutcome(library, archs, summary)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Build the msa kernel variants into <out>/<variant>/ without Nix.")
    parser.add_argument("--out", default="build",
                        help="output directory, relative to the repository root (default: build)")
    parser.add_argument("--no-compile", action="store_true",
                        help="compile nothing: no csrc (the CUDA variant is the noarch "
                             "torch-cuda) and no CuTe kernels unless --cute-artifacts is given")
    parser.add_argument("--cute", action="store_true",
                        help="compile the CuTe-DSL kernels for sm_90a and ship them even "
                             "without an sm_90 GPU here (default: only where they can run)")
    parser.add_argument("--cute-artifacts", metavar="DIR",
                        help="precompiled CuTe-DSL kernels to ship in <variant>/_artifacts/ "
                             "(default: compile them into .artifacts/ when the DSL is installed, "
                             "reused while the kernel sources are unchanged)")
    parser.add_argument("--require-compiled", action="store_true",
                        help="fail (exit 1) unless the compiled CUDA variant was built")
    parser.add_argument("--cuda-capabilities", metavar="LIST",
                        help="comma-separated subset of build.toml cuda-capabilities to compile "
                             "(e.g. 9.0a for a faster Hopper-only build), or X.Y+PTX for SASS "
                             "and PTX of any arch (8.0+PTX: the portable tier's proxy build)")
    parser.add_argument("--id", dest="unique_id",
                        help="build id of the ops namespace (default: git tree id, else random)")
    parser.add_argument("--root", default=str(REPO_ROOT),
                        help="kernel source root holding build.toml (default: this repository)")
    parser.add_argument("--keep-work", metavar="DIR",
                        help="keep objects and the generated header in DIR (default: a temp dir)")
    parser.add_argument("-j", "--jobs", type=int, default=0,
                        help="parallel compiler processes (default: all CPUs)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print compiler commands")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)

    warned = set()

    def warn(message: str) -> None:   # once per message, not once per variant
        if message not in warned:
            warned.add(message)
            print(f"warning: {message}", file=sys.stderr)

    root = Path(args.root).resolve()
    out_dir = Path(args.out)
    out_dir = out_dir if out_dir.is_absolute() else root / out_dir
    try:
        config = load_config(root)
        validate_with_kernels(root, config)
        if "cuda" not in config.backends:
            raise ConfigError("build.toml: [general] backends must include cuda")
        unique_id = build_id(root, args.unique_id)
        artifacts_dir = Path(args.cute_artifacts).resolve() if args.cute_artifacts else None
        if artifacts_dir is not None and not artifacts_dir.is_dir():
            raise ConfigError(f"--cute-artifacts: {artifacts_dir} is not a directory")
        capabilities = None
        if args.cuda_capabilities:
            capabilities = [c.strip() for c in args.cuda_capabilities.split(",") if c.strip()]
            # "X.Y+PTX" (compute_XY PTX besides sm_XY SASS) is a local validation build: the
            # H200 JIT-compiles the compute_80 PTX of the portable tier (docs/design-portable.md).
            unknown = [c for c in capabilities
                       if c not in config.cuda_capabilities and not c.endswith("+PTX")]
            if unknown:
                raise ConfigError(f"--cuda-capabilities: {unknown} are not in build.toml "
                                  f"cuda-capabilities {config.cuda_capabilities}")
        if not (root / "torch-ext" / config.python_name / "__init__.py").is_file():
            raise ConfigError(f"torch-ext/{config.python_name}/__init__.py: the package is missing")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch

    torch_cuda = torch.version.cuda
    cuda_ops = ops_name(config.python_name, "cuda", unique_id)
    cpu_ops = ops_name(config.python_name, "cpu", unique_id)

    if artifacts_dir is None and not args.no_compile:
        if args.cute or cute_kernels_run_here():
            artifacts_dir = cached_cute_artifacts(root, warn)
        else:
            print("CuTe-DSL kernels not precompiled: no sm_90 GPU here (--cute compiles them "
                  "anyway; on a GPU they compile on first use, or with msa.warmup())")
    if args.no_compile:
        outcome = CompileOutcome(None, [], "--no-compile given")
    else:
        work_parent = Path(args.keep_work).resolve() if args.keep_work else None
        with tempfile.TemporaryDirectory(prefix="msa-build-") as tmp:
            work_dir = work_parent or Path(tmp)
            outcome = try_compile(config=config, root=root, ops=cuda_ops, torch_cuda=torch_cuda,
                                  capabilities=capabilities, work_dir=work_dir, jobs=args.jobs,
                                  verbose=args.verbose)
            if outcome.library is not None:   # keep it past the temp dir's lifetime
                kept = out_dir / f".{cuda_ops}.abi3.so.tmp"
                out_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy2(outcome.library, kept)
                outcome.library = kept
        if outcome.library is None and torch_cuda is not None:
            print(f"error: the CUDA extension was not built: {outcome.reason}\n"
                  "error: falling back to the noarch torch-cuda variant (no compiled ops)",
                  file=sys.stderr)

    removed = remove_previous_variants(out_dir, config.name)
    if removed:
        print(f"removed previous variants: {', '.join(removed)}")

    results = []
    if outcome.library is not None:
        variant = torch_cuda_variant_name(torch.__version__, torch_cuda,
                                          bool(torch._C._GLIBCXX_USE_CXX11_ABI))
        results.append(write_variant(config=config, root=root, out_dir=out_dir, variant=variant,
                                     backend="cuda", ops=cuda_ops, library=outcome.library,
                                     archs=outcome.archs, artifacts_dir=artifacts_dir, warn=warn))
        outcome.library.unlink()
    else:
        results.append(write_variant(config=config, root=root, out_dir=out_dir,
                                     variant="torch-cuda", backend="cuda", ops=cuda_ops,
                                     library=None, archs=None, artifacts_dir=artifacts_dir,
                                     warn=warn))
    results.append(write_variant(config=config, root=root, out_dir=out_dir, variant="torch-cpu",
                                 backend="cpu", ops=cpu_ops, library=None, archs=None,
                                 artifacts_dir=None, warn=warn))

    for result in results:
        kind = f"compiled, archs {result.archs}" if result.compiled else "noarch, no compiled ops"
        print(f"built {result.path} ({kind}; ops namespace {result.ops}; {result.files} files)")
    if outcome.library is not None or torch_cuda is None or args.no_compile:
        print(f"cuda extension: {outcome.reason}")
    if args.require_compiled and not any(r.compiled for r in results):
        print(f"error: --require-compiled: no compiled CUDA variant ({outcome.reason})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
