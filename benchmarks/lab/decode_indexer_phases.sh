#!/usr/bin/env bash
# The fused decode indexer's call phases at MTP 8 (e4m3 keys as TMA pages, four index heads),
# short to long contexts, in four builds of benchmarks/lab/decode_indexer_timeline.cu: as
# served (the acq_rel count-in), with the former sequentially consistent fences
# (-DMSA_LAB_SC_FENCES), without the merge (-DMSA_LAB_NO_MERGE), and with one 64-bit segment
# maximum a merge round (-DMSA_LAB_PACKED_MERGE). A GPU diagnostic (no
# TSV), e.g. as gpu_session.sh's MSA_EXTRA="bash benchmarks/lab/decode_indexer_phases.sh".
#
#   bash benchmarks/lab/decode_indexer_phases.sh ["B keys" ...]   (default: 32 x 4k, 8 x 4k,
#                                                                    128 x 4k, 32 x 10k, 32 x 100k)
set -u
flags="-arch=sm_90a -O3 -std=c++17 -Icsrc -Itorch-ext -DMSA_LAB_TIMELINE -DMSA_LAB_CALL_PHASES"
src=benchmarks/lab/decode_indexer_timeline.cu
# MSA_LAB_BIN: a folder of these binaries built elsewhere (nvcc -arch=sm_90a builds them on a
# machine without a GPU), e.g. carried to the device; the missing ones are built here (all of
# them, in a fresh folder, without it).
bin=${MSA_LAB_BIN:-$(mktemp -d)}
declare -A defines=([served]="" [scfence]=-DMSA_LAB_SC_FENCES [nomerge]=-DMSA_LAB_NO_MERGE
                    [packed]=-DMSA_LAB_PACKED_MERGE)
for build in "${!defines[@]}"; do
  # shellcheck disable=SC2086
  [ -x "$bin/idx_$build" ] || nvcc $flags ${defines[$build]} -o "$bin/idx_$build" "$src" &
done
wait
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=("32 4096" "8 4096" "128 4096" "32 10240" "32 102400")
for shape in "${shapes[@]}"; do
  for build in served scfence nomerge packed; do
    echo "== $build, B / keys: $shape"
    # shellcheck disable=SC2086
    timeout 30 "$bin/idx_$build" e4m3-tma $shape 8 4 | grep -v "^warp\|^last\|^(work"
  done
done
