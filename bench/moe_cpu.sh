#!/bin/bash
# Workloads M1 and M2 (../shared/bench/WORKLOADS.md) scaled to the CPU: 1024 tokens, hidden 512,
# FFN and experts in the workloads' ratios (M1: FFN 1792, 8 experts, top-2; M2: FFN 352, 64
# experts, top-6). Kiln's training step of models/moe_layer.kiln runs interleaved with the
# loop-over-experts baseline of bench/moe_bench.cc (same BLAS, same threads); medians of R rounds.
#
#   bench/moe_cpu.sh [BUILD_DIR] [THREADS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
THREADS=${2:-$(nproc)}
ROUNDS=${3:-5}
for w in m1 m2; do
  "$BUILD/bench/moe_bench" --workload "$w" --threads "$THREADS" --rounds "$ROUNDS" --iters 2 | grep -v '^KILN'
  echo
done
