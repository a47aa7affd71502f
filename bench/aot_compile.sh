#!/bin/bash
# Ahead-of-time compile time of workload R1's training step (models/dlrm_dcnv2.kiln at batch
# 16384, as bench/r1_bench runs it) with NVRTC: cold (no disk cache) for one arch (sm_90) and for
# three (sm_80, sm_90 CUBIN + compute_90 PTX) on 1, 2 and all cores, next to the executor's
# former path (every kernel in one NVRTC program on one thread), and a rerun on a warm cache.
# Needs NVRTC, no GPU.
#
#   bench/aot_compile.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BENCH="$BUILD/bench/aot_bench"
[ -x "$BENCH" ] || cmake --build "$BUILD" --target aot_bench -j"$(nproc)" > /dev/null
CACHE=$(mktemp -d)
trap 'rm -rf "$CACHE"' EXIT
CORES=$(nproc)
THREADS="1 2"
[ "$CORES" -gt 2 ] && THREADS="$THREADS $CORES"

run() {  # label, then aot_bench flags
  local label=$1
  shift
  local line
  line=$("$BENCH" "$@" | grep '^KILN ')
  python3 - "$label" "${line#KILN }" <<'PY'
import json, sys
label, r = sys.argv[1], json.loads(sys.argv[2])
print(f"| {label} | {r['archs']} | {r['threads']} | {r['programs']} | {r.get('images', 1)} | "
      f"{r['image_bytes'] / 1e6:.2f} | {r['seconds']:.2f} |")
PY
}

echo "R1 training step, batch 16384, $CORES cores"
echo "| run | archs | threads | programs | images | MB | seconds |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
run "one program (former JIT)" --single 1 --archs sm_90
for t in $THREADS; do run "cold, 1 arch" --archs sm_90 --ptx 0 --threads "$t"; done
for t in $THREADS; do run "cold, 3 archs" --archs sm_80,sm_90 --ptx 1 --threads "$t"; done
run "fill the cache" --archs sm_80,sm_90 --ptx 1 --threads "$CORES" --cache-dir "$CACHE"
run "warm cache" --archs sm_80,sm_90 --ptx 1 --threads "$CORES" --cache-dir "$CACHE"
