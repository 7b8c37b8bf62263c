"""Hub resolution without a network: ``kernels.get_kernel("MiniMaxAI/msa", version=0)`` finds
branch ``v0`` in a local Hugging Face cache laid out as huggingface_hub stores a downloaded
kernel repo, and a lock file pins the same commit (get_locked_kernel / load_kernel).

The cache (``HF_HUB_CACHE``) holds ``kernels--MiniMaxAI--msa/`` with ``refs/v0`` (the commit
id), ``snapshots/<commit>/build/<variant>/...`` (relative symlinks) and ``blobs/<git blob id>``;
the variants are a fresh local build (tools/build_variant.py --no-compile). Each check runs in a
fresh interpreter with ``HF_HUB_OFFLINE=1`` (huggingface_hub reads it at import).

``kernels lock`` itself needs the network (it lists the repo's refs and tree and asks the Hub
whether the publisher is trusted), so the lock file here is written with the serializer
``kernels lock`` uses (``KernelLocks.to_json``) for the commit the cache holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "MiniMaxAI/msa"


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_cache_with(cache: Path, build: Path, commit: str, branch: str = "v0") -> Path:
    """Lay `build`'s variants out in `cache` as huggingface_hub stores a downloaded repo."""
    storage = cache / ("kernels--" + REPO_ID.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    blobs = storage / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for src in sorted(build.rglob("*")):
        if not src.is_file() or "__pycache__" in src.parts:
            continue
        data = src.read_bytes()
        blob = blobs / _git_blob_id(data)
        blob.write_bytes(data)
        link = snapshot / "build" / src.relative_to(build)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / branch).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("msa-hub")
    build = tmp / "build"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "build_variant.py"), "--out",
                           str(build), "--no-compile", "--id", "h" + uuid.uuid4().hex[:10]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    commit = hashlib.sha1(uuid.uuid4().bytes).hexdigest()
    snapshot = hub_cache_with(tmp / "hf-cache", build, commit)
    return tmp, snapshot, commit


def offline(code: str, cache: Path, *args: str) -> dict:
    """Run `code` in a fresh interpreter against the cache, offline; it prints one JSON line."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_KERNELS", "KERNELS_CACHE", "HF_HOME", "HF_HUB_CACHE")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent / "hf"))
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOAD_AND_CALL = """
import json, sys, torch, kernels
msa = {load}
cu = torch.tensor([0, 200], dtype=torch.int32)
q2k = torch.zeros(1, 200, 4, dtype=torch.int32) - 1
q2k[0, :, 0] = torch.arange(200, dtype=torch.int32) // 128
row_ptr, q_idx = msa.build_k2q_csr(q2k, cu, cu, 128, total_k=200, max_seqlen_k=200,
                                   max_seqlen_q=200)
print(json.dumps({{"file": msa.__file__, "name": msa.__name__, "all": len(msa.__all__),
                  "entries": int(row_ptr[0, -1])}}))
"""


def test_get_kernel_version_0_resolves_branch_v0_offline(hub_cache):
    tmp, snapshot, commit = hub_cache
    result = offline(LOAD_AND_CALL.format(load=f"kernels.get_kernel({REPO_ID!r}, version=0)"),
                     tmp / "hf-cache")
    # A CPU torch selects the CPU variant; a CUDA torch the CUDA one (noarch: any capability).
    import torch
    variant = "torch-cpu" if torch.version.cuda is None else "torch-cuda"
    assert Path(result["file"]).parent == snapshot / "build" / variant
    assert result["entries"] == 200 and result["all"] == 13


def test_a_missing_version_fails_clearly_offline(hub_cache):
    tmp, _snapshot, _commit = hub_cache
    code = ("import json, kernels\n"
            "try:\n"
            f"    kernels.get_kernel({REPO_ID!r}, version=1)\n"
            "    print(json.dumps({'error': None}))\n"
            "except Exception as exc:\n"
            "    print(json.dumps({'error': f'{type(exc).__name__}: {exc}'}))\n")
    error = offline(code, tmp / "hf-cache")["error"]
    assert error is not None and "Version 1 not found" in error and "0" in error


def test_lock_file_round_trip_offline(hub_cache):
    """A lock pinning the cached commit (as `kernels lock` writes it) loads through both
    get_locked_kernel and load_kernel without touching the network."""
    tmp, snapshot, commit = hub_cache
    lock = tmp / "kernels.lock"
    code = (
        "import sys\n"
        "from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion\n"
        "dep = KernelDependency(repo_id=sys.argv[1], version=KernelVersion.Version(0))\n"
        "open(sys.argv[3], 'w').write(KernelLocks(locks={dep: KernelLock(commit=sys.argv[2])})"
        ".to_json())\n"
        "print('{}')\n")
    offline(code, tmp / "hf-cache", REPO_ID, commit, str(lock))
    assert json.loads(lock.read_text())
    for loader in ("get_locked_kernel", "load_kernel"):
        load = f"kernels.{loader}({REPO_ID!r}, lockfile=__import__('pathlib').Path({str(lock)!r}))"
        result = offline(LOAD_AND_CALL.format(load=load), tmp / "hf-cache")
        assert Path(result["file"]).parent.parent == snapshot / "build", loader
        assert result["entries"] == 200
