#!/usr/bin/env bash
# One command for the `run` tool on the H200: build, the `gpu` tests, then R1 (table last).
# Carry .devdeps and .device (../shared/device/fetch-deps.sh fills them; copy
# ../shared/bench/dlrm_torch.py into .device/). Logs go under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
source .device/env.sh
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-$PWD/build-gpu/kernel-cache}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 &&
  cmake --build build-gpu -j16 >"$OUT/build.log" 2>&1 ||
  { echo "BUILD FAILED"; tail -40 "$OUT/build.log" "$OUT/cmake.log"; exit 1; }
echo "build ok"
timeout 420 ctest --test-dir build-gpu -L gpu --output-on-failure -j4 >"$OUT/ctest_gpu.log" 2>&1
echo "gpu tests: exit $?"; grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest_gpu.log" | tail -25
OUT=$OUT bench/r1_gpu.sh build-gpu 2>&1 | tee "$OUT/r1_table.txt"
