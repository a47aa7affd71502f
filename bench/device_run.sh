#!/usr/bin/env bash
# The H200 session, for the `run` tool (at most 600 s a call): build, then the `gpu` tests, then
# R1 against the PyTorch peer, then M1 and M2 (one MoE layer) against ../shared/bench/moe_torch.py
# (loop over experts and torch._grouped_mm; copy it into .device/ too), tables last.
#   bench/device_run.sh [all|tests|bench]     (default all)
# With little device time, split it: `tests` first (builds), then `bench` in a second call while
# the machine is warm (it keeps build-gpu). Carry .devdeps and .device
# (../shared/device/fetch-deps.sh fills them; copy ../shared/bench/dlrm_torch.py into .device/).
# Logs go under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
source .device/env.sh
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-$PWD/build-gpu/kernel-cache}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
SECONDS=0
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 &&
  cmake --build build-gpu -j16 >"$OUT/build.log" 2>&1 ||
  { echo "BUILD FAILED"; tail -40 "$OUT/build.log" "$OUT/cmake.log"; exit 1; }
echo "build ok (${SECONDS} s)"
if [ "$PHASE" != bench ]; then
  SECONDS=0
  timeout 300 ctest --test-dir build-gpu -L gpu --output-on-failure --timeout 150 -j4 >"$OUT/ctest_gpu.log" 2>&1
  echo "gpu tests: exit $? (${SECONDS} s)"
  grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest_gpu.log" | tail -25
fi
if [ "$PHASE" != tests ]; then
  OUT=$OUT bench/r1_gpu.sh build-gpu 2>&1 | tee "$OUT/r1_table.txt"
  for w in m1 m2; do
    timeout 240 build-gpu/bench/moe_bench --workload "$w" --device cuda >"$OUT/moe_$w.log" 2>&1
    echo "moe_bench $w: exit $?"; grep -E "^\|" "$OUT/moe_$w.log"
  done
  if [ -f .device/moe_torch.py ]; then
    timeout 240 python3 .device/moe_torch.py >"$OUT/moe_torch.log" 2>&1
    echo "moe_torch.py: exit $?"; tail -8 "$OUT/moe_torch.log"
  fi
fi
