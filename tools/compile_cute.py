#!/usr/bin/env python3
"""Compile every shipped CuTe-DSL kernel variant ahead of time for sm_90a (no GPU needed).

For each variant of cute_kernels.variants.shipped_variants(): cute.compile with fake tensors and
the TVM-FFI ABI, export_to_c, link into `<name>.so`, and record it in `manifest.json`. The output
directory (default .artifacts/, git-ignored) is what tools/build_variant.py --cute-artifacts
copies into `<variant>/_artifacts/`, and what MSA_CUTE_ARTIFACTS points the runtime at.

  python tools/compile_cute.py                 # all variants -> .artifacts/
  python tools/compile_cute.py --check         # + ptxas -v on the PTX; fail on any spill,
                                               #   on serialized warpgroup MMAs (C7514) or on a
                                               #   setmaxnreg split over the launch registers
  python tools/compile_cute.py --only g16 --no-export --check   # quick CI-style check

Exit status 1 if any variant fails to compile or (with --check) spills registers, has its
warpgroup MMAs serialized by ptxas or asks setmaxnreg for more registers than it launched with.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
MANIFEST_FORMAT = 1


def find_ptxas() -> str:
    found = shutil.which("ptxas")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/ptxas",):
        if os.path.exists(candidate):
            return candidate
    try:
        import triton  # the triton wheel bundles a ptxas
        candidate = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError("ptxas not found (install the CUDA toolkit or set PATH)")


def ptxas_report(ptx: Path, arch: str = "sm_90a") -> dict:
    """Registers and spill bytes of every entry in `ptx` (max over entries), and whether ptxas
    serialized the warpgroup MMAs (C7514: a non-wgmma instruction touches an in-flight
    accumulator, so every wgmma waits for the previous one; a software pipeline built that way
    measured 15 % slower than no pipeline at all)."""
    proc = subprocess.run([find_ptxas(), f"-arch={arch}", "-v", str(ptx), "-o", os.devnull],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx.name}:\n{proc.stderr[-2000:]}")
    text = proc.stderr + proc.stdout
    spills = [int(a) + int(b) for a, b in
              re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
    registers = max(regs, default=0)
    return {"registers": registers, "spill_bytes": max(spills, default=0),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in text,
            "register_split_excess": register_split_excess(ptx.read_text(), registers)}


def register_split_excess(ptx_text: str, launch_registers: int) -> int:
    """Registers by which a warp-specialized kernel's setmaxnreg split overdraws its CTA's
    launch allocation (0 when it fits or the kernel has no split). setmaxnreg only moves
    registers inside that allocation (launch registers x threads): if one producer warpgroup at
    its .dec count plus every other warpgroup at its .inc count need more, the consumers'
    setmaxnreg.inc waits forever (the e4m3 FMHA ws forms hung so at 80 / 216 with 168 x 384)."""
    incs = [int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx_text)]
    if not incs:
        return 0
    decs = [int(n) for n in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx_text)]
    ntid = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?",
                     ptx_text)
    if ntid is None:
        raise RuntimeError("setmaxnreg in a kernel without .reqntid / .maxntid")
    threads = 1
    for n in ntid.groups():
        threads *= int(n or 1)
    producer = max(decs, default=launch_registers)
    need = 128 * producer + (threads - 128) * max(incs)
    return max(0, need - launch_registers * threads)


def sources_digest() -> str:
    """sha256 over the CuTe kernel sources, this script and the DSL version: a manifest whose
    digest matches was compiled from exactly these sources (tools/build_variant.py reuses it)."""
    import hashlib
    kernels_dir = Path(__file__).resolve().parents[1] / "torch-ext" / "msa" / "cute_kernels"
    h = hashlib.sha256()
    for path in sorted(kernels_dir.glob("*.py")) + [Path(__file__).resolve()]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    from importlib import metadata
    h.update(metadata.version("nvidia-cutlass-dsl").encode())
    return h.hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / ".artifacts"), help="output directory")
    parser.add_argument("--check", action="store_true",
                        help="run ptxas -v on each PTX and fail on register spills, serialized "
                             "wgmmas or a setmaxnreg split the launch registers cannot hold")
    parser.add_argument("--only", action="append", default=[],
                        help="compile only variants whose name contains this (repeatable)")
    parser.add_argument("--update", action="store_true",
                        help="with --only: merge the compiled variants into the manifest already "
                             "in --out (the others are kept; the digest is reset to these sources, "
                             "so check first that the others' PTX is unchanged: "
                             "tools/ptx_fingerprint.py)")
    parser.add_argument("--no-export", action="store_true",
                        help="compile (and check) only; write no .so / manifest")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "torch-ext"))
    import cutlass
    from cute_kernels.build import TARGET_ARCH, compile_variant
    from cute_kernels.variants import shipped_variants
    from msa._native import cute_runtime

    variants = [v for v in shipped_variants()
                if not args.only or any(s in v.name for s in args.only)]
    if not variants:
        print("no variant matches --only", file=sys.stderr)
        return 1
    out_dir = Path(args.out)
    if not args.no_export:
        out_dir.mkdir(parents=True, exist_ok=True)
    # The runtime loads these binaries only where arch, platform, DSL version and kernel
    # sources match (msa._native.cute_runtime.artifacts_mismatch).
    manifest = {"format": MANIFEST_FORMAT, "arch": TARGET_ARCH,
                "platform": cute_runtime.host_platform(),
                "cutlass_dsl_version": getattr(cutlass, "__version__", "unknown"),
                "kernel_sources_digest": cute_runtime.kernel_sources_digest(),
                "abi": "tvm-ffi", "variants": {}}
    if args.update:
        if not args.only or args.no_export:
            print("--update needs --only and an export", file=sys.stderr)
            return 1
        old = json.loads((out_dir / "manifest.json").read_text())
        identity = ("format", "arch", "platform", "cutlass_dsl_version")
        if any(old.get(key, manifest[key]) != manifest[key] for key in identity):
            print("--update: the manifest in --out was built for another format, arch, "
                  "platform or DSL version", file=sys.stderr)
            return 1
        manifest["variants"] = old["variants"]
    rows, failures = [], 0
    with tempfile.TemporaryDirectory(prefix="msa_cute_") as tmp:
        for variant in variants:
            name = variant.name
            dump = Path(tmp) / name
            t0 = time.time()
            row = {"name": name, "seconds": 0.0, "registers": "-", "spill_bytes": "-",
                   "status": "ok"}
            try:
                compiled = compile_variant(variant, dump_dir=str(dump) if args.check else None)
                if args.check:
                    ptx = sorted(dump.glob("*.ptx"))
                    if not ptx:
                        raise RuntimeError("no PTX was kept")
                    report = ptxas_report(ptx[0])
                    row.update(report)
                    if report["spill_bytes"] > 0:
                        row["status"] = "SPILL"
                        failures += 1
                    elif report["register_split_excess"] > 0:
                        row["status"] = (f"SETMAXNREG OVERDRAW by {report['register_split_excess']}"
                                         " registers (the consumers' setmaxnreg.inc would hang)")
                        failures += 1
                    elif report["wgmma_serialized"]:
                        row["status"] = "WGMMA-SERIALIZED (ptxas C7514)"
                        failures += 1
                if not args.no_export:
                    shipped = cute_runtime.export_variant(compiled, name, out_dir,
                                                          require_shared=True)
                    manifest["variants"][name] = {
                        "file": shipped.name, "function": name,
                        "kind": type(variant).__name__, **variant.__dict__}
            except Exception as exc:  # report every variant, fail at the end
                row["status"] = f"ERROR: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                failures += 1
            row["seconds"] = round(time.time() - t0, 1)
            rows.append(row)
            print(f"{name:<48} {row['seconds']:>6}s regs={row['registers']} "
                  f"spill={row['spill_bytes']} {row['status']}", flush=True)
    if not args.no_export:
        shipped = {v.name for v in shipped_variants()}
        manifest["variants"] = {n: e for n, e in manifest["variants"].items() if n in shipped}
        if not failures and (not args.only or (args.update
                                               and shipped <= set(manifest["variants"]))):
            manifest["sources_digest"] = sources_digest()
        (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    print(f"\n{len(rows)} variants, {failures} failed"
          + ("" if args.no_export else f"; artifacts in {out_dir}"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
