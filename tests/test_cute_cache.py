"""Where CuTe kernel binaries come from (msa._native.cute_runtime) and the warm-up (msa.warmup):
shipped artifacts only when they match this host and package, else the persistent JIT cache,
else a logged compile that fills the cache. CPU only: compiling needs nvidia-cutlass-dsl but
no GPU, and loading an exported kernel needs no GPU either (launching does: the GPU tests).

The small combine kernels stand in for every variant (they compile in seconds).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

import msa  # noqa: E402
from msa._native import cute_runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["sparse_combine_sm90_pf32", "sparse_combine_sm90_pbf16"]


@pytest.fixture
def fresh_runtime(tmp_path, monkeypatch):
    """An empty JIT cache, no shipped artifacts, nothing loaded yet in this process."""
    (tmp_path / "no-artifacts").mkdir()
    monkeypatch.setenv(cute_runtime.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cute_runtime.ARTIFACTS_ENV, str(tmp_path / "no-artifacts"))
    for state in ("_functions", "_origins", "_manifest_cache", "_artifacts_reason_cache"):
        monkeypatch.setattr(cute_runtime, state, {})
    return tmp_path


def _manifest(tmp_path, **changes):
    """A manifest as tools/compile_cute.py writes it for this host and package, changed."""
    data = {"format": 1, "arch": cute_runtime.TARGET_ARCH,
            "platform": cute_runtime.host_platform(),
            "cutlass_dsl_version": cute_runtime.dsl_version(),
            "kernel_sources_digest": cute_runtime.kernel_sources_digest(), "abi": "tvm-ffi",
            "variants": {SMALL[0]: {"file": f"{SMALL[0]}.so", "function": SMALL[0]}}}
    data.update(changes)
    directory = tmp_path / "artifacts"
    directory.mkdir(exist_ok=True)
    (directory / "manifest.json").write_text(json.dumps(data))
    (directory / f"{SMALL[0]}.so").write_bytes(b"\x7fELF")
    return directory


def test_target_arch_is_the_one_the_kernels_compile_for():
    from msa.cute_kernels import build
    assert cute_runtime.TARGET_ARCH == build.TARGET_ARCH


def test_matching_artifacts_are_used(fresh_runtime, monkeypatch):
    monkeypatch.setenv(cute_runtime.ARTIFACTS_ENV, str(_manifest(fresh_runtime)))
    assert cute_runtime.artifacts_unusable_reason() is None
    assert cute_runtime.has_artifact(SMALL[0]) and not cute_runtime.has_artifact(SMALL[1])


@pytest.mark.parametrize("field,value,words", [
    ("cutlass_dsl_version", "0.0.1", "built with nvidia-cutlass-dsl 0.0.1"),
    ("arch", "sm_100a", "built for sm_100a"),
    ("platform", "aarch64-linux", "built for aarch64-linux"),
    ("kernel_sources_digest", "0" * 64, "other kernel sources"),
])
def test_mismatched_artifacts_are_refused_with_one_warning(fresh_runtime, monkeypatch, caplog,
                                                           field, value, words):
    monkeypatch.setenv(cute_runtime.ARTIFACTS_ENV,
                       str(_manifest(fresh_runtime, **{field: value})))
    with caplog.at_level(logging.WARNING, logger="msa"):
        assert words in cute_runtime.artifacts_unusable_reason()
        assert not cute_runtime.has_artifact(SMALL[0])
        assert not cute_runtime.has_artifact(SMALL[0])
    warnings = [r for r in caplog.records if "not using the precompiled" in r.getMessage()]
    assert len(warnings) == 1 and words in warnings[0].getMessage()


def test_artifacts_without_the_dsl_need_an_explicit_runtime(fresh_runtime, monkeypatch):
    monkeypatch.setenv(cute_runtime.ARTIFACTS_ENV, str(_manifest(fresh_runtime)))
    monkeypatch.setattr(cute_runtime, "dsl_version", lambda: None)
    monkeypatch.delenv(cute_runtime.RUNTIME_ENV, raising=False)
    assert "is not installed" in cute_runtime.artifacts_unusable_reason()
    monkeypatch.setattr(cute_runtime, "_artifacts_reason_cache", {})
    monkeypatch.setenv(cute_runtime.RUNTIME_ENV, "/opt/libcute_dsl_runtime.so")
    assert cute_runtime.artifacts_unusable_reason() is None


def test_cache_directory_is_keyed_by_arch_platform_dsl_and_sources(fresh_runtime, monkeypatch):
    directory = cute_runtime.cache_dir()
    assert directory.parent == fresh_runtime / "cache"
    for part in (cute_runtime.TARGET_ARCH, cute_runtime.host_platform(),
                 cute_runtime.dsl_version(), cute_runtime.kernel_sources_digest()[:16]):
        assert part in directory.name
    monkeypatch.setattr(cute_runtime, "dsl_version", lambda: "9.9.9")
    assert cute_runtime.cache_dir() != directory
    monkeypatch.setenv(cute_runtime.CACHE_ENV, "off")
    assert cute_runtime.cache_dir() is None
    monkeypatch.delenv(cute_runtime.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(fresh_runtime / "xdg"))
    assert cute_runtime.cache_root() == fresh_runtime / "xdg" / "msa" / "cute"


def test_run_time_compile_is_logged_and_cached(fresh_runtime, caplog):
    with caplog.at_level(logging.INFO, logger="msa"):
        fn = cute_runtime.get_function(SMALL[0])
    assert callable(fn) and cute_runtime.origins() == {SMALL[0]: "compiled"}
    compiling = [r for r in caplog.records
                 if r.levelno == logging.WARNING and "compiling CuTe kernel" in r.getMessage()]
    assert len(compiling) == 1 and SMALL[0] in compiling[0].getMessage()
    assert "msa.warmup()" in compiling[0].getMessage()
    entry = cute_runtime.cached_file(SMALL[0])
    assert entry is not None and entry.parent == cute_runtime.cache_dir()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]   # no temp left


def test_object_file_entry_without_a_linker(fresh_runtime, monkeypatch):
    """No C compiler: the entry is the exported object, loaded by the DSL's in-memory linker."""
    monkeypatch.setattr(cute_runtime.shutil, "which", lambda _name: None)
    entry, _compiled = cute_runtime.compile_into_cache(SMALL[1])
    assert entry.suffix == ".o" and cute_runtime.cached_file(SMALL[1]) == entry
    assert callable(cute_runtime.load_binary(entry, SMALL[1]))


def _first_loads(env, names):
    """In a fresh process: load `names` and report where each came from and whether the log
    said a kernel was compiled."""
    code = (
        "import json, logging, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'torch-ext')!r})\n"
        "records = []\n"
        "class Keep(logging.Handler):\n"
        "    def emit(self, record): records.append(record.getMessage())\n"
        "logging.getLogger('msa').addHandler(Keep()); logging.getLogger('msa').setLevel(10)\n"
        "from msa._native import cute_runtime\n"
        "for name in sys.argv[1:]: cute_runtime.get_function(name)\n"
        "print(json.dumps({'origins': cute_runtime.origins(),\n"
        "                  'compiled': [m for m in records if 'compiling' in m]}))\n")
    proc = subprocess.run([sys.executable, "-c", code, *names], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_warmup_fills_the_cache_and_a_new_process_compiles_nothing(fresh_runtime):
    summary = msa.warmup(SMALL, arch=cute_runtime.TARGET_ARCH, workers=2, progress=False)
    assert sorted(summary["compiled"]) == sorted(SMALL) and summary["failed"] == {}
    assert summary["cache_dir"] == str(cute_runtime.cache_dir())
    again = msa.warmup(SMALL, arch=cute_runtime.TARGET_ARCH, workers=2, progress=False)
    assert again["compiled"] == [] and sorted(again["cached"]) == sorted(SMALL)
    loaded = _first_loads(dict(os.environ), SMALL)
    assert loaded == {"origins": dict.fromkeys(SMALL, "cache"), "compiled": []}


def test_warmup_reports_a_failing_kernel(fresh_runtime, monkeypatch):
    """A worker's compile error is reported per variant, the others still compile."""
    from msa import _warmup
    monkeypatch.setattr(_warmup, "variant_names", lambda only=None: [SMALL[0], "no_such_kernel"])
    summary = msa.warmup(arch=cute_runtime.TARGET_ARCH, workers=1, progress=False)
    assert summary["compiled"] == [SMALL[0]]
    assert list(summary["failed"]) == ["no_such_kernel"]
    assert "KeyError" in summary["failed"]["no_such_kernel"]


def test_warmup_refuses_what_it_cannot_do(fresh_runtime, monkeypatch):
    with pytest.raises(ValueError, match="arch: the CuTe kernels target sm_90a"):
        msa.warmup(arch="sm_100a", progress=False)
    monkeypatch.setenv(cute_runtime.CACHE_ENV, "off")
    with pytest.raises(RuntimeError, match="JIT cache is disabled"):
        msa.warmup(arch="sm_90a", progress=False)
    if not __import__("torch").cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            msa.warmup(progress=False)


def test_compile_cute_manifest_records_what_the_runtime_checks(fresh_runtime):
    sys.path.insert(0, str(ROOT / "tools"))
    import compile_cute

    out = fresh_runtime / "aot"
    assert compile_cute.main(["--only", SMALL[0], "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert cute_runtime.artifacts_mismatch(manifest) is None
    assert manifest["kernel_sources_digest"] == cute_runtime.kernel_sources_digest()
    assert manifest["variants"][SMALL[0]]["file"] == f"{SMALL[0]}.so"


def test_bench_cute_cache_cpu_smoke(tmp_path):
    """benchmarks/bench_cute_cache.py on the CPU: the cold process compiles the load case's
    variant, the warm one loads it from the cache."""
    out = tmp_path / "cute_cache.tsv"
    env = dict(os.environ, MSA_COMMIT="smoketest", PYTHONPATH=str(ROOT / "torch-ext"))
    env.pop("MSA_PACKAGE_DIR", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cute_cache.py"),
                           "--device", "cpu", "--tiny", "--phases", "cold,warm",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = out.read_text().splitlines()
    header = lines[0].split("\t")
    rows = [dict(zip(header, line.split("\t"))) for line in lines[1:]]
    loads = {r["phase"]: r for r in rows if r["case"].startswith("load:")}
    assert (loads["cold"]["compiled"], loads["cold"]["from_cache"]) == ("1", "0")
    assert (loads["warm"]["compiled"], loads["warm"]["from_cache"]) == ("0", "1")
