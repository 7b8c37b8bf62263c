#!/usr/bin/env bash
# The fused decode indexer's call phases at MTP 8 (e4m3 keys as TMA pages, four index heads),
# short to long contexts: the merge of each request's chunk lists in rounds of segment maxima
# (rounds) and as a butterfly (butterfly), and the call without the merge (nomerge, built with
# -DMSA_LAB_NO_MERGE), from benchmarks/lab/decode_indexer_timeline.cu. A GPU diagnostic (no
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
[ -x "$bin/idx_served" ] || nvcc $flags -o "$bin/idx_served" "$src" &
[ -x "$bin/idx_nomerge" ] || nvcc $flags -DMSA_LAB_NO_MERGE -o "$bin/idx_nomerge" "$src" &
wait
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=("32 4096" "8 4096" "128 4096" "32 10240" "32 102400")
for shape in "${shapes[@]}"; do
  for run in "rounds served" "butterfly served butterfly" "nomerge nomerge"; do
    read -r name build option <<< "$run"
    echo "== $name, B / keys: $shape"
    # shellcheck disable=SC2086
    timeout 30 "$bin/idx_$build" e4m3-tma $shape 8 4 ${option:-} | grep -v "^warp\|^last\|^(work"
  done
done
