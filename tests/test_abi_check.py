"""tools/abi_check.py (kernel-builder's ABI policy over shipped .so files) fails a shared object
that needs a newer glibc than manylinux_2_28 or uses the non-limited Python API, and passes a
plain one. Skipped where kernel-abi-check or a C compiler is missing (CI installs the former
from requirements.txt)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kernel_abi_check")
ROOT = Path(__file__).resolve().parents[1]
CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="needs a C compiler")

PLAIN = "int msa_answer(void) { return 42; }\n"
# pthread_mutex_clocklock entered glibc in 2.30, after manylinux_2_28's 2.28.
NEW_GLIBC = ("#define _GNU_SOURCE\n#include <pthread.h>\n#include <time.h>\n"
             "int lock(pthread_mutex_t *m, const struct timespec *t) {\n"
             "  return pthread_mutex_clocklock(m, CLOCK_MONOTONIC, t); }\n")


def _shared(tmp_path, name, source):
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(src), "-lpthread"], check=True)
    return out


def _run(*paths):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "abi_check.py"), *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def test_plain_shared_object_passes(tmp_path):
    proc = _run(_shared(tmp_path, "plain", PLAIN))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 shared objects, 0 violating" in proc.stdout


def test_newer_glibc_symbol_fails_and_is_named(tmp_path):
    good = _shared(tmp_path, "plain", PLAIN)
    bad = _shared(tmp_path, "clocklock", NEW_GLIBC)
    proc = _run(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"ok   {good}" in proc.stdout and f"FAIL {bad}" in proc.stdout
    assert "pthread_mutex_clocklock" in proc.stdout and "GLIBC" in proc.stdout


def test_nothing_to_check_is_an_error(tmp_path):
    assert _run(tmp_path).returncode == 2
