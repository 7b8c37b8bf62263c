"""Compile csrc/*.cu + the torch binding into the ops extension ``<ops_name>.abi3.so``.

A helper of tools/build_variant.py. It re-expresses, without CMake or kernel-builder, what
kernel-builder's generated build does for one CUDA variant:

* nvcc for every ``.cu`` of the ``[kernel.*]`` CUDA components, with torch's common nvcc flags
  (minus the ``__CUDA_NO_HALF*`` switches, as kernel-builder does), ``-DENABLE_FP8``, the
  component's ``cuda-flags`` and one ``-gencode`` per requested capability;
* the host compiler for the ``[torch] src`` binding (``.cpp``);
* defines ``TORCH_EXTENSION_NAME=<ops_name>``, ``CUDA_KERNEL``, ``USE_CUDA=1`` and
  ``Py_LIMITED_API=0x03090000`` (abi3: the module only uses the limited API, see
  tools/registration.h), C++17 for torch < 2.12 and C++20 from 2.12 on;
* a shared library linked against torch's own libraries (c10, c10_cuda, torch, torch_cpu,
  torch_cuda) and cudart only; never libtorch_python or libpython.

Nothing here imports a CUDA runtime or touches a GPU; ``check_extension_loads`` imports the
result in a child process (which needs a CUDA build of torch, not a GPU).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REGISTRATION_HEADER = HERE / "registration.h"
PY_LIMITED_API = "0x03090000"

# Link set: what the extension may depend on at run time (torch's libraries, plus cudart,
# which torch's wheel ships; see Toolchain.cudart_link_flags).
TORCH_LINK_LIBRARIES = ("c10", "c10_cuda", "torch", "torch_cpu", "torch_cuda")

# kernel-builder drops these from torch's COMMON_NVCC_FLAGS for CUDA >= 11.8: kernels may use
# the half/bfloat16 operators and conversions of cuda_fp16.h / cuda_bf16.h.
_DROPPED_TORCH_NVCC_FLAGS = {
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
}


class BuildError(RuntimeError):
    """The extension cannot be built; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """A CUDA toolkit (nvcc + headers + cudart) and a host C++ compiler."""
    nvcc: Path
    cuda_home: Path
    cuda_version: Tuple[int, int]
    cxx: str

    @property
    def include_dirs(self) -> List[Path]:
        """Toolkit headers, then those of pip's nvidia-* wheels (torch's CUDA headers include
        cusparse.h / cublas_v2.h, which a minimal toolkit may lack)."""
        dirs = [self.cuda_home / "include",
                self.cuda_home / "targets" / "x86_64-linux" / "include"]
        return [d for d in dirs if d.is_dir()] + pip_nvidia_dirs("include")

    @property
    def library_dirs(self) -> List[Path]:
        dirs = [self.cuda_home / "lib64", self.cuda_home / "lib",
                self.cuda_home / "targets" / "x86_64-linux" / "lib"]
        return [d for d in dirs if d.is_dir()]

    def cudart_link_flags(self) -> List[str]:
        """-lcudart from the toolkit, else the versioned libcudart.so.N of torch's pip
        nvidia-cuda-runtime wheel (which has no unversioned libcudart.so)."""
        for lib_dir in self.library_dirs:
            if (lib_dir / "libcudart.so").exists():
                return [f"-L{lib_dir}", "-lcudart"]
        for lib_dir in pip_nvidia_dirs("lib"):
            versioned = sorted(lib_dir.glob("libcudart.so.*"))
            if versioned:
                return [str(versioned[0])]
        raise BuildError(f"cudart: no libcudart.so under {self.cuda_home} or pip's nvidia "
                         "packages")


def pip_nvidia_dirs(kind: str) -> List[Path]:
    """``<site-packages>/nvidia/*/<kind>`` directories of installed nvidia-* wheels."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        for sub in sorted(Path(root).iterdir()):
            if (sub / kind).is_dir():
                found.append(sub / kind)
    return found


@dataclasses.dataclass(frozen=True)
class CudaSources:
    """What one extension is built from (paths absolute)."""
    cuda_files: List[Path]          # .cu, compiled by nvcc
    cxx_files: List[Path]           # .cpp of the torch binding, compiled by the host compiler
    include_dirs: List[Path]        # -I for both compilers (after the generated include dir)
    cuda_flags: List[str]           # extra nvcc flags (build.toml cuda-flags)
    cxx_flags: List[str]            # extra host flags (build.toml cxx-flags)


def parse_version(text: str) -> Tuple[int, int]:
    """'12.8' / '13.0.88' -> (12, 8)."""
    match = re.match(r"(\d+)\.(\d+)", text.strip())
    if not match:
        raise ValueError(f"version: cannot parse {text!r}")
    return int(match.group(1)), int(match.group(2))


def find_toolchain() -> Toolchain:
    """Locate nvcc ($CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc, PATH, /usr/local/cuda) and c++.

    Raises BuildError when there is no nvcc or host compiler.
    """
    candidates: List[Path] = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    nvcc = next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)
    if nvcc is None:
        raise BuildError("nvcc: not found (set CUDA_HOME or put nvcc on PATH)")
    nvcc = nvcc.resolve()
    out = _run_text([str(nvcc), "--version"])
    match = re.search(r"release (\d+\.\d+)", out)
    if not match:
        raise BuildError(f"nvcc: cannot read the CUDA version from `{nvcc} --version`")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise BuildError("CXX: no host C++ compiler found (install g++ or set CXX)")
    return Toolchain(nvcc=nvcc, cuda_home=nvcc.parent.parent,
                     cuda_version=parse_version(match.group(1)), cxx=cxx)


def nvcc_virtual_archs(toolchain: Toolchain) -> List[int]:
    """The compute capabilities nvcc can target, as integers (90, 100, ...)."""
    out = _run_text([str(toolchain.nvcc), "--list-gpu-arch"])
    return sorted({int(m) for m in re.findall(r"compute_(\d+)", out)})


def split_capability(capability: str) -> Tuple[int, str, bool]:
    """'9.0a' -> (90, 'a', False); '10.0' -> (100, '', False); '12.0+PTX' -> (120, '', True)."""
    match = re.fullmatch(r"(\d+)\.(\d)([af]?)(\+PTX)?", capability.strip())
    if not match:
        raise ValueError(f"cuda-capabilities: cannot parse {capability!r} (expected e.g. 9.0a)")
    number = int(match.group(1)) * 10 + int(match.group(2))
    return number, match.group(3), bool(match.group(4))


def supported_capabilities(toolchain: Toolchain, wanted: Sequence[str]) -> List[str]:
    """Keep the capabilities of `wanted` whose base arch this nvcc can compile for."""
    available = set(nvcc_virtual_archs(toolchain))
    return [cap for cap in wanted if split_capability(cap)[0] in available]


def gencode_flags(capabilities: Sequence[str]) -> List[str]:
    """One -gencode per capability: 9.0a -> arch=compute_90a,code=sm_90a (+PTX adds compute_)."""
    flags = []
    for cap in capabilities:
        number, suffix, ptx = split_capability(cap)
        arch = f"{number}{suffix}"
        code = f"[sm_{arch},compute_{arch}]" if ptx else f"sm_{arch}"
        flags.append(f"-gencode=arch=compute_{arch},code={code}")
    return flags


def torch_build_settings() -> Dict[str, object]:
    """Include/library dirs, C++ standard and ABI flag of the running torch."""
    import torch
    from torch.utils import cpp_extension

    torch_version = parse_version(torch.__version__)
    torch_dir = Path(torch.__file__).resolve().parent
    include = torch_dir / "include"
    return {
        "include_dirs": [include, include / "torch" / "csrc" / "api" / "include"],
        "library_dir": torch_dir / "lib",
        "cxx_std": "c++17" if torch_version < (2, 12) else "c++20",
        "cxx11_abi": int(bool(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "common_nvcc_flags": [f for f in cpp_extension.COMMON_NVCC_FLAGS
                              if f not in _DROPPED_TORCH_NVCC_FLAGS],
    }


def compile_extension(*, sources: CudaSources, ops_name: str, capabilities: Sequence[str],
                      toolchain: Toolchain, work_dir: Path, jobs: int = 0,
                      verbose: bool = False) -> Path:
    """Build ``work_dir/<ops_name>.abi3.so`` and return its path.

    Args:
      sources: what to compile (see CudaSources).
      ops_name: the unique module/op namespace, e.g. ``_msa_cuda_1a2b3c4``.
      capabilities: cuda-capabilities to emit SASS for, e.g. ["9.0a", "10.0a"].
      toolchain: from find_toolchain().
      work_dir: scratch directory for the generated header, objects and logs.
      jobs: parallel compiler processes (0 = number of CPUs).

    Raises BuildError with the compiler's output when a step fails.
    """
    if not capabilities:
        raise BuildError("cuda-capabilities: none of them can be compiled by this nvcc")
    settings = torch_build_settings()
    work_dir.mkdir(parents=True, exist_ok=True)
    generated_include = work_dir / "include"
    generated_include.mkdir(exist_ok=True)
    shutil.copyfile(REGISTRATION_HEADER, generated_include / "registration.h")

    python_include = Path(sysconfig.get_paths()["include"])
    includes = ([generated_include] + list(sources.include_dirs) + list(settings["include_dirs"])
                + toolchain.include_dirs + [python_include])
    include_flags = [f"-I{d}" for d in includes]
    defines = [f"-DTORCH_EXTENSION_NAME={ops_name}", "-DCUDA_KERNEL", "-DUSE_CUDA=1",
               f"-DPy_LIMITED_API={PY_LIMITED_API}",
               f"-D_GLIBCXX_USE_CXX11_ABI={settings['cxx11_abi']}"]
    std = f"-std={settings['cxx_std']}"
    # -fno-gnu-unique: keep template statics of this library from merging with another kernel's
    # (kernel-builder sets it for the same reason).
    host_flags = ["-fPIC", "-fno-gnu-unique"]

    commands: List[Tuple[Path, List[str]]] = []
    objects: List[Path] = []
    for index, src in enumerate(sources.cuda_files):
        obj = work_dir / f"{index:02d}_{src.stem}.cuda.o"
        cmd = ([str(toolchain.nvcc), "-c", str(src), "-o", str(obj), std, "-O3",
                *settings["common_nvcc_flags"], "-DENABLE_FP8", *defines, *include_flags,
                *gencode_flags(capabilities), f"--threads={max(1, len(capabilities))}",
                "-ccbin", toolchain.cxx]
               + [f"-Xcompiler={f}" for f in host_flags] + list(sources.cuda_flags))
        commands.append((obj, cmd))
        objects.append(obj)
    for index, src in enumerate(sources.cxx_files):
        obj = work_dir / f"{index:02d}_{src.stem}.cxx.o"
        cmd = ([toolchain.cxx, "-c", str(src), "-o", str(obj), std, "-O3", *host_flags,
                *defines, *include_flags] + list(sources.cxx_flags))
        commands.append((obj, cmd))
        objects.append(obj)

    workers = jobs if jobs > 0 else (os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        failures = [err for err in pool.map(lambda oc: _run_step(oc[1], verbose), commands) if err]
    if failures:
        raise BuildError("compilation failed:\n" + "\n\n".join(failures))

    output = work_dir / f"{ops_name}.abi3.so"
    link = ([toolchain.cxx, "-shared", "-o", str(output), *map(str, objects),
             f"-L{settings['library_dir']}"]
            + [f"-l{lib}" for lib in TORCH_LINK_LIBRARIES] + toolchain.cudart_link_flags())
    error = _run_step(link, verbose)
    if error:
        raise BuildError("linking failed:\n" + error)
    return output


_LOAD_CHECK = r"""
import importlib.machinery, importlib.util, sys
import torch
name, path = sys.argv[1], sys.argv[2]
loader = importlib.machinery.ExtensionFileLoader(name, path)
spec = importlib.util.spec_from_file_location(name, path, loader=loader)
module = importlib.util.module_from_spec(spec)
loader.exec_module(module)
ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(name + "::"))
print("\n".join(ops))
print("cuda initialized:", torch.cuda.is_initialized(), file=sys.stderr)
"""


def check_extension_loads(library: Path, ops_name: str) -> List[str]:
    """Import the built library in a fresh interpreter; return the ops it registered.

    Raises BuildError when the import fails (undefined symbols, wrong PyInit name, ...).
    """
    proc = subprocess.run([sys.executable, "-c", _LOAD_CHECK, ops_name, str(library)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{library.name}: importing the built extension failed:\n"
                         f"{proc.stdout}{proc.stderr}")
    return [line for line in proc.stdout.splitlines() if line.strip()]


def _run_text(cmd: List[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise BuildError(f"{cmd[0]}: cannot run ({exc})") from exc
    if proc.returncode != 0:
        raise BuildError(f"{shlex.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def _run_step(cmd: List[str], verbose: bool) -> Optional[str]:
    """Run one compiler/linker command; None on success, else a report with its output."""
    if verbose:
        print("+", shlex.join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        return f"$ {shlex.join(cmd)}\n{exc}"
    if proc.returncode != 0:
        return f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}".rstrip()
    if verbose and (proc.stdout or proc.stderr):
        print(proc.stdout + proc.stderr, end="", flush=True)
    return None
