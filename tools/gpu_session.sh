#!/usr/bin/env bash
# One call on a GPU host (the H200 device machine): build the CUDA variant (csrc ops + the
# precompiled CuTe kernels), run the GPU tests against that build, then the benchmarks.
#
#   bash tools/gpu_session.sh [ARTIFACTS_DIR] [tests|bench|all|none] [extra benchmark args...]
#   MSA_GPU_TESTS="files or node ids" ("file@N": N pytest-xdist workers for that file;
#   "file~EXPR" or "file@N~EXPR": -k EXPR, one word, for that file alone)
#   MSA_PYTEST_ARGS="-x ..." (split on spaces; replaces the
#   default -q, so "-v -rf" lists every test's outcome as it runs)
#   MSA_PYTEST_K="a or b" (one -k expression)  MSA_SANITIZE=1 (memcheck stage; MSA_SANITIZE_ONLY
#   picks its sections, see tools/sanitize_cases.py)
#   MSA_BENCH_IF_GREEN=1 (skip the benchmarks when a test failed)  MSA_EXTRA="cmd"
#   MSA_BENCH_ARGS_<name>="..." (arguments of benchmarks/bench_<name>.py alone)
#   MSA_BENCH_UNVALIDATED=1 (the benchmarks may run gated kernels: with MSA_BENCH_IF_GREEN, a
#   kernel whose test just passed on this host is timed in the same call)
#   MSA_REQUIRE_GPU=H200 (exit 2 before the build unless nvidia-smi's name contains it)
#   MSA_CALL_SECONDS=570 (every stage's timeout cut to what is left of it)
#   MSA_TEST_HANG_SECONDS=150 (pytest's faulthandler_timeout: a hung test's stacks in the log)
#   MSA_CUDA_CAPS=8.0+PTX (csrc built as sm_80 SASS + compute_80 PTX, which the H200 JIT-compiles:
#   the portable tier's proxy build; default 9.0a)
#
# Expects, carried from the dev machine (all git-ignored): .gpu-runtime/ (made by
# shared/tools/gpu-runtime-bundle.sh: the CuTe-DSL runtime + apache-tvm-ffi), ARTIFACTS_DIR
# (tools/compile_cute.py output) and .whl/ (kernels 0.16.x + kernels-data + tomlkit for
# transformers 5.17, and the pure-Python nvidia-cutlass-dsl wheels so the declared dependency is
# importable; its 87 MB compiler flavour stays behind: the AOT kernels need only the runtime).
# Logs and TSV go to $OUT (at most 8 files come back from the device tool: gpu.txt, build.log,
# tests.log, bench.log and one TSV per benchmark).
set -uo pipefail
# The device tool kills a call at its timeout and then returns only what $OUT already holds:
# every stage's timeout is cut to what is left of MSA_CALL_SECONDS (set it a little under the
# call's timeout_s), so a hung test or benchmark still leaves time for the later stages' logs.
deadline=$(( SECONDS + ${MSA_CALL_SECONDS:-570} ))
within() {   # within DEFAULT [RESERVE]: DEFAULT, or the seconds left before the deadline less
             # RESERVE (at least 10)
  local left=$(( deadline - SECONDS - ${2:-0} ))
  [ "$left" -lt 10 ] && left=10
  echo $(( $1 < left ? $1 : left ))
}
ART=${1:-.artifacts}
WHAT=${2:-all}
shift $(( $# > 2 ? 2 : $# ))
OUT=${OUT:-$PWD/.gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/msa-site \
  .whl/kernels-*.whl .whl/kernels_data-*.whl .whl/tomlkit-*.whl .whl/nvidia_cutlass_dsl*.whl
eval "$(bash .gpu-runtime/setup.sh)"
export PYTHONPATH="/tmp/msa-site:/tmp/msa-site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -n "${MSA_REQUIRE_GPU:-}" ] && ! grep -q -- "$MSA_REQUIRE_GPU" "$OUT/gpu.txt"; then
  # Measurements that only count on one kind of GPU (the issues' H200 bars): stop before the
  # build when another came, so the call costs seconds, not minutes.
  echo "not a $MSA_REQUIRE_GPU (MSA_REQUIRE_GPU): nothing run"
  exit 2
fi

if [ -f "$ART/manifest.json" ]; then
  # A manifest from other CuTe sources makes every kernel fall back to a just-in-time compile,
  # which this host cannot do (no DSL compiler): stop before the build instead (exit 3 of the
  # check; any other failure of it only warns).
  PYTHONPATH=torch-ext python3 -c "
import json, sys
from msa._native import cute_runtime
want = cute_runtime.kernel_sources_digest()
have = json.load(open(sys.argv[1])).get('kernel_sources_digest', '')
if have != want:
    print(f'error: {sys.argv[1]} was compiled from other CuTe sources (kernel_sources_digest '
          f'{have[:12]} vs {want[:12]}): tools/compile_cute.py --only ... --update')
    sys.exit(3)
" "$ART/manifest.json"
  case $? in
    0) ;;
    3) exit 1 ;;
    *) echo "warning: could not compare $ART's kernel_sources_digest with the sources" ;;
  esac
fi

echo "== build"
# A warm machine keeps build/ between calls: rebuild only when the sources, the artifacts or the
# capabilities changed.
stamp=$( { echo "${MSA_CUDA_CAPS:-9.0a}"; find csrc torch-ext tools/build_variant.py build.toml \
  "$ART" -type f 2>/dev/null | sort | xargs sha1sum; } | sha1sum | cut -d' ' -f1)
if [ -f build/.gpu-session-stamp ] && [ "$(cat build/.gpu-session-stamp)" = "$stamp" ]; then
  echo "build: unchanged since the last call on this machine, reused"
else
  rm -f build/.gpu-session-stamp
  python3 tools/build_variant.py --require-compiled --cuda-capabilities "${MSA_CUDA_CAPS:-9.0a}" \
    --cute-artifacts "$ART" \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  tail -3 "$OUT/build.log"
  echo "$stamp" > build/.gpu-session-stamp
fi
VARIANT=$(ls -d build/torch*-cu*-x86_64-linux | head -1)
echo "variant: $VARIANT"
if ls .whl/kernel_abi_check-*.whl > /dev/null 2>&1; then
  # kernel-builder's ABI policy (informative here: a local build uses the host toolchain).
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/msa-site \
    .whl/kernel_abi_check-*.whl
  python3 tools/abi_check.py "$VARIANT" >> "$OUT/build.log" 2>&1
  tail -1 "$OUT/build.log"
fi
status=0

if [ -n "${MSA_SANITIZE:-}" ]; then
  # compute-sanitizer memcheck over a representative set of native calls
  # (tools/sanitize_cases.py), in the background while the tests run.
  echo "== compute-sanitizer memcheck (background)"
  ( timeout "$(within ${MSA_SANITIZE_TIMEOUT:-400} 60)" compute-sanitizer --tool memcheck --error-exitcode 9 \
      --print-limit 20 python3 tools/sanitize_cases.py "$PWD/$VARIANT" > "$OUT/sanitizer.log" 2>&1
    echo "sanitizer exit $?" >> "$OUT/sanitizer.log" ) &
  sanitizer_pid=$!
fi

if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  # One pytest process per test file, all at once: the float64 oracles are CPU-bound and the
  # host has 16 cores, so files run side by side; their logs are joined into tests.log.
  echo "== GPU tests against $VARIANT"
  rm -f /tmp/msa-tests-*.log                # a warm machine keeps the last call's logs
  entries=(${MSA_GPU_TESTS:-tests/test_sparse_prefill_gpu.py tests/test_transformers_gpu.py \
    tests/test_csrc_gpu.py tests/test_packaging.py})
  # Share the cores: every pytest process (each xdist worker, the sanitizer) would otherwise
  # start one torch thread per core, and 14 processes x 16 OpenMP threads on 16 cores stalled
  # the float64 oracles of every file past its timeout.
  processes=0
  [ -n "${MSA_SANITIZE:-}" ] && processes=1
  for entry in "${entries[@]}"; do
    entry=${entry%%~*}
    if [ "${entry%@*}" != "$entry" ]; then processes=$(( processes + ${entry##*@} ))
    else processes=$(( processes + 1 )); fi
  done
  threads=$(( $(nproc) / processes )); [ "$threads" -lt 1 ] && threads=1
  echo "$processes test processes, $threads torch threads each"
  test_timeout=$(within ${MSA_TEST_TIMEOUT:-420} 60)
  pids=()
  for entry in "${entries[@]}"; do
    # "file@N~EXPR": N pytest-xdist workers for that file (its float64 oracles are CPU-bound),
    # and -k EXPR (one word) for it alone in place of MSA_PYTEST_K.
    select=${MSA_PYTEST_K:-}
    if [ "${entry%%~*}" != "$entry" ]; then select=${entry#*~}; entry=${entry%%~*}; fi
    file=${entry%@*}
    workers=()
    [ "$file" != "$entry" ] && workers=(-n "${entry##*@}")
    log=/tmp/msa-tests-$(echo "${file#tests/}" | sed 's/\.py//; s/[^A-Za-z0-9_.-]/_/g').log
    # A test that hangs (a kernel waiting on a barrier or a vote forever) would leave only its
    # file's timeout as a sign: faulthandler dumps every thread's stack after
    # MSA_TEST_HANG_SECONDS in one test, which names it in the log.
    OMP_NUM_THREADS=$threads MSA_TEST_PACKAGE_DIR=$PWD/$VARIANT MSA_EXPECT_NATIVE=1 \
      timeout "$test_timeout" \
      python3 -m pytest -p no:cacheprovider -o faulthandler_timeout=${MSA_TEST_HANG_SECONDS:-150} \
      "$file" "${workers[@]}" ${MSA_PYTEST_ARGS:--q} \
      ${select:+-k "$select"} -s > "$log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for log in /tmp/msa-tests-*.log; do echo "===== $log"; cat "$log"; done > "$OUT/tests.log"
  grep -E "^=====|passed|failed|Error|error" "$OUT/tests.log" | tail -40
fi

if [ -n "${MSA_SANITIZE:-}" ]; then
  wait "$sanitizer_pid"
  echo "== sanitizer"; tail -12 "$OUT/sanitizer.log"
  grep -q "sanitizer exit 0" "$OUT/sanitizer.log" || status=1
fi

if [ -n "${MSA_EXTRA:-}" ]; then
  # A one-off command with the session's environment (e.g. a diagnostic script); $VARIANT is set.
  echo "== extra: $MSA_EXTRA"
  VARIANT=$VARIANT timeout "$(within ${MSA_EXTRA_TIMEOUT:-120} 15)" bash -c "$MSA_EXTRA" > "$OUT/extra.log" 2>&1 \
    || echo "extra exit $?" >> "$OUT/extra.log"
  tail -30 "$OUT/extra.log"
fi

if [ -n "${MSA_BENCH_IF_GREEN:-}" ] && [ $status -ne 0 ]; then
  echo "== benchmarks skipped: the tests failed (MSA_BENCH_IF_GREEN)"
elif [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  # MSA_BENCHES picks the scripts (default: sparse prefill, indexer/top-k, end-to-end, decode;
  # name "fmha" to add bench_fmha.py); extra arguments go to the sparse prefill benchmark,
  # MSA_BENCH_EXTRA to the others ("--quick" for a short session).
  echo "== benchmarks"
  [ -n "${MSA_BENCH_UNVALIDATED:-}" ] && export MSA_UNVALIDATED_KERNELS=1
  : > "$OUT/bench.log"
  for bench in ${MSA_BENCHES:-sparse_prefill indexer_topk msa_prefill_e2e decode}; do
    # shellcheck disable=SC2206
    args=(${MSA_BENCH_EXTRA:-})
    [ "$bench" = sparse_prefill ] && args=("$@")
    # MSA_BENCH_ARGS_<name> (e.g. MSA_BENCH_ARGS_decode="--quick --batches 32") overrides.
    per_bench="MSA_BENCH_ARGS_${bench}"
    # shellcheck disable=SC2206
    [ -n "${!per_bench:-}" ] && args=(${!per_bench})
    echo "===== bench_$bench ${args[*]}" >> "$OUT/bench.log"
    MSA_PACKAGE_DIR=$PWD/$VARIANT MSA_COMMIT=${MSA_COMMIT:-unknown} timeout "$(within ${MSA_BENCH_TIMEOUT:-400} 15)" \
      python3 benchmarks/bench_$bench.py --out "$OUT/${bench}_h200.tsv" "${args[@]}" \
      > "$OUT/bench_$bench.tmp" 2>&1 || status=1
    tail -15 "$OUT/bench_$bench.tmp"
    if [ -s "$OUT/${bench}_h200.tsv" ] && [ -f "benchmarks/results/${bench}_h200.tsv" ]; then
      # Each case against its last committed row (slower by > 5 % is flagged, not failed).
      python3 benchmarks/compare_runs.py "$OUT/${bench}_h200.tsv" \
        --baseline "benchmarks/results/${bench}_h200.tsv" >> "$OUT/bench_$bench.tmp" 2>&1
      tail -1 "$OUT/bench_$bench.tmp"
    fi
    cat "$OUT/bench_$bench.tmp" >> "$OUT/bench.log" && rm -f "$OUT/bench_$bench.tmp"
  done
fi
exit $status
