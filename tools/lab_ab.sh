#!/usr/bin/env bash
# A/B of a standalone CUDA lab (benchmarks/lab/*.cu) between a git revision and the working
# tree, on the same GPU in one call. The binaries are built here (nvcc compiles for sm_90a
# without a GPU) and carried in .device-carry/, so the device call only runs them.
#
#   bash tools/lab_ab.sh build REV LAB [nvcc flags...]   # here: .device-carry/ab/LAB_{base,new}
#   bash tools/lab_ab.sh run LAB "args 1" "args 2" ...    # there: both binaries, per argument set
#
# e.g. bash tools/lab_ab.sh build HEAD decode_pp_timeline -DMSA_LAB_TIMELINE, then a device call
# with carry [".device-carry"]: bash tools/lab_ab.sh run decode_pp_timeline "e4m3-pv8 32 4000".
set -euo pipefail
mode=${1:?build or run}
out=.device-carry/ab
case $mode in
  build)
    rev=${2:?a git revision}
    lab=${3:?a lab name (benchmarks/lab/NAME.cu)}
    shift 3
    base=$(mktemp -d)
    trap 'rm -rf "$base"' EXIT
    # The kernels from REV, the lab itself (the harness) from the working tree on both sides.
    git archive "$rev" csrc torch-ext | tar -x -C "$base"
    mkdir -p "$base/benchmarks" "$out"
    cp -r benchmarks/lab "$base/benchmarks/"
    compile() {  # source-root binary
      (cd "$1" && nvcc -arch=sm_90a -O3 -std=c++17 -Icsrc -Itorch-ext "${@:3}" \
         -o "$2" "benchmarks/lab/$lab.cu")
    }
    compile "$base" "$PWD/$out/${lab}_base" "$@" &
    base_pid=$!
    compile "$PWD" "$PWD/$out/${lab}_new" "$@" &
    new_pid=$!
    wait "$base_pid" && wait "$new_pid"
    echo "built $out/${lab}_base ($(git rev-parse --short "$rev")) and $out/${lab}_new (working tree)"
    ;;
  run)
    lab=${2:?a lab name}
    shift 2
    for args in "$@"; do
      for side in base new; do
        echo "### $side $args"
        # shellcheck disable=SC2086
        timeout 120 "$out/${lab}_$side" $args 2>&1 || echo "(exit $?)"
      done
    done
    ;;
  *)
    echo "usage: lab_ab.sh build REV LAB [nvcc flags] | run LAB ARGS..." >&2
    exit 2
    ;;
esac
