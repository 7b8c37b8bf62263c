#!/usr/bin/env bash
# Compile every csrc/*.cu for every arch the package declares (build.toml cuda-capabilities: the
# portable tier's sm_80, sm_89, sm_100a, sm_120 and Hopper's sm_90a) into an object file, without
# torch, and print the ptxas resource usage (registers, spills, shared memory) per arch. Fails on
# any compile error or warning.
#
#   tools/check_csrc.sh                         # 80 89 90a 100a 120
#   MSA_CHECK_ARCHS="90a" tools/check_csrc.sh   # one arch (faster)
#   MSA_CHECK_THREADS=4                         # archs nvcc compiles in parallel (default 2)
#
# The .cu files must not include torch headers (only torch-ext/torch_binding.cpp does); this
# check enforces that. Skips with exit 0 when nvcc is not installed (CPU-only CI images).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "${NVCC}" && -x /usr/local/cuda/bin/nvcc ]]; then
  NVCC=/usr/local/cuda/bin/nvcc
fi
if [[ -z "${NVCC}" ]]; then
  echo "check_csrc: nvcc not found; skipping" >&2
  exit 0
fi

ARCHS="${MSA_CHECK_ARCHS:-80 89 90a 100a 120}"
THREADS="${MSA_CHECK_THREADS:-2}"
OUT_DIR="$(mktemp -d)"
trap 'rm -rf "${OUT_DIR}"' EXIT

if grep -nE '#\s*include\s*[<"](torch|ATen|c10)/' "${ROOT}"/csrc/*.cu "${ROOT}"/csrc/*.cuh; then
  echo "check_csrc: csrc/ must not include torch headers (only torch-ext/torch_binding.cpp may)" >&2
  exit 1
fi

gencode=()
for arch in ${ARCHS}; do
  gencode+=("-gencode" "arch=compute_${arch},code=sm_${arch}")
done

status=0
for src in "${ROOT}"/csrc/*.cu; do
  name="$(basename "${src}" .cu)"
  echo "== ${name}.cu (${ARCHS})"
  log="${OUT_DIR}/${name}.log"
  if ! "${NVCC}" -std=c++17 -O3 -lineinfo -Xptxas -v -Werror all-warnings --threads "${THREADS}" \
      -I"${ROOT}/csrc" -I"${ROOT}/torch-ext" "${gencode[@]}" \
      -c "${src}" -o "${OUT_DIR}/${name}.o" >"${log}" 2>&1; then
    cat "${log}" >&2
    echo "check_csrc: ${name}.cu FAILED" >&2
    status=1
    continue
  fi
  # One line per kernel and arch: demangled name, arch, registers, shared memory, spills.
  awk '
    /Compiling entry function/ {
      match($0, /\047[^\047]+\047/); fn = substr($0, RSTART + 1, RLENGTH - 2)
      arch = ""; if (match($0, /for \047sm_[0-9a-z]+\047/)) arch = substr($0, RSTART + 5, RLENGTH - 6)
    }
    /bytes spill stores/ { spill = $0; sub(/^ +/, "", spill) }
    /Used [0-9]+ registers/ { sub(/^ptxas info +: +/, ""); printf "%s\t%s\t%s | %s\n", fn, arch, $0, spill }
  ' "${log}" | c++filt -p | awk -F'\t' '{ printf "  %-52.52s %-8s %s\n", $1, $2, $3 }'
  if grep -qE '[1-9][0-9]* bytes spill (stores|loads)' "${log}"; then
    echo "  note: register spills above" >&2
  fi
done

# The torch binding (torch-ext/torch_binding.cpp) is only built on a GPU host (it needs a CUDA
# torch); a CPU torch ships the same headers, so check it compiles here: syntax and types, with
# the one CUDA-build-generated header stubbed. Skipped when python has no torch.
PY="${PYTHON:-python3}"
if TORCH_INC="$("${PY}" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null)"; then
  echo "== torch_binding.cpp (syntax, $(${PY} -c 'import torch; print(torch.__version__)') headers)"
  mkdir -p "${OUT_DIR}/stub/c10/cuda/impl"
  echo "#pragma once" > "${OUT_DIR}/stub/c10/cuda/impl/cuda_cmake_macros.h"
  PY_INC="$("${PY}" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  CUDA_INC="$(dirname "$(dirname "$(readlink -f "${NVCC}")")")/include"
  [[ -f "${CUDA_INC}/cuda_runtime_api.h" ]] || CUDA_INC=/usr/local/cuda/include
  if ! g++ -std=c++17 -fsyntax-only -DTORCH_EXTENSION_NAME=_msa_check \
      -I"${ROOT}/torch-ext" -I"${ROOT}/tools" -I"${OUT_DIR}/stub" -I"${PY_INC}" \
      -I"${TORCH_INC}" -I"${TORCH_INC}/torch/csrc/api/include" -I"${CUDA_INC}" \
      "${ROOT}/torch-ext/torch_binding.cpp" > "${OUT_DIR}/binding.log" 2>&1; then
    cat "${OUT_DIR}/binding.log" >&2
    echo "check_csrc: torch_binding.cpp FAILED" >&2
    status=1
  else
    echo "  ok"
  fi
fi
exit "${status}"
