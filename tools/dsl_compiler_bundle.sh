#!/usr/bin/env bash
# dsl_compiler_bundle.sh [DIR] [PYVER]
#
# Makes DIR (default: .dsl-compiler, git-ignored) holding what a GPU host without network needs
# to COMPILE CuTe-DSL kernels (the JIT path of msa._native.cute_runtime, msa.warmup,
# benchmarks/bench_cute_cache.py), on top of what tools/gpu_session.sh already installs there
# (the pure-Python nvidia-cutlass-dsl wheels from .whl/ into /tmp/msa-site, the DSL runtime and
# apache-tvm-ffi from .gpu-runtime/):
#   dsl-compiler.tar.xz   the nvidia-cutlass-dsl-libs-cu12 wheel of the local DSL version, built
#                         for PYVER (default 3.12), minus its runtime library (.gpu-runtime has
#                         it): the compiler extension, xz -9e (~50 MB instead of the wheel's 92)
#   cuda_bindings-*.whl, cuda_pathfinder-*.whl   the DSL imports cuda.bindings; installed only
#                         when the host lacks it
#   setup.sh              on the GPU host: `bash DIR/setup.sh [SITE]` unpacks into SITE (default
#                         /tmp/msa-site, the --target directory gpu_session.sh installs into),
#                         puts $MSA_CUTE_RUNTIME where the DSL looks for its runtime, and checks
#                         that `import cutlass.cute` works
# Size: ~56 MB, within one device call's 64 MiB carry but not together with .gpu-runtime and
# .whl; carry DIR alone in a first call (git-ignored files persist while the machine stays warm),
# then the others (the recipe: benchmarks/bench_cute_cache.py).
set -euo pipefail
dir=${1:-.dsl-compiler}
pyver=${2:-3.12}
py=${PYTHON:-python3}
tag=cp${pyver/./}
dslver=$("$py" -c "import importlib.metadata as m; print(m.version('nvidia-cutlass-dsl'))")
cbver=$("$py" -c "import importlib.metadata as m; print(m.version('cuda-bindings'))")
cpver=$("$py" -c "import importlib.metadata as m; print(m.version('cuda-pathfinder'))")
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() {
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$1" "$2" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
download "$work" "nvidia-cutlass-dsl-libs-cu12==$dslver"
rm -f "$dir"/cuda_bindings-*.whl "$dir"/cuda_pathfinder-*.whl
download "$dir" "cuda-bindings==$cbver"
download "$dir" "cuda-pathfinder==$cpver"
mkdir "$work/tree"
(cd "$work/tree" && unzip -q "$work"/nvidia_cutlass_dsl_libs_cu12-*-"$tag"-*.whl \
  && rm -f nvidia_cutlass_dsl/cu12/lib/libcute_dsl_runtime.so \
  && rm -rf nvidia_cutlass_dsl/cu12/lib/stubs)
echo "compressing the compiler (xz -9e, a few minutes)"
tar -C "$work/tree" -cf - . | xz -T0 -9e > "$dir/dsl-compiler.tar.xz"
cat > "$dir/setup.sh" <<'SH'
# Usage on the GPU host, after tools/gpu_session.sh installed the DSL wheels into SITE:
#   bash path/to/setup.sh [SITE]      (SITE default /tmp/msa-site; needs MSA_CUTE_RUNTIME set)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
site=${1:-/tmp/msa-site}
mkdir -p "$site"
xz -dc "$here/dsl-compiler.tar.xz" | tar -C "$site" -xf -
lib="$site/nvidia_cutlass_dsl/cu12/lib"
mkdir -p "$lib"
if [ ! -f "$lib/libcute_dsl_runtime.so" ]; then
  cp "${MSA_CUTE_RUNTIME:?set MSA_CUTE_RUNTIME (eval \"\$(bash .gpu-runtime/setup.sh)\")}" "$lib/"
fi
if ! python3 -c "import cuda.bindings.driver" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$here"/cuda_pathfinder-*.whl "$here"/cuda_bindings-*.whl
fi
PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}" \
  python3 -c "import cutlass, cutlass.cute; print('CuTe-DSL compiler', cutlass.__version__, 'ready')"
SH
du -sh "$dir" | cut -f1 | xargs -I{} echo "bundle $dir: {} (nvidia-cutlass-dsl $dslver compiler for $tag)"
