#!/bin/bash
# Workload R1 (../shared/bench/WORKLOADS.md: DLRM-DCNv2, SGD, 26 tables of dim 128) at small
# scale on the CPU: samples/s and achieved GFLOP/s, to track over time. R1's dense part costs
# 1.58 TFLOP per step at batch 16384, i.e. about 96.4 MFLOP per sample (forward + backward).
#
#   bench/r1_cpu.sh [BUILD_DIR] [BATCH] [STEPS] [ROWS_CAP] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BATCH=${2:-1024}
STEPS=${3:-12}
ROWS_CAP=${4:-100000}
THREADS=${5:-$(nproc)}
KILN="$BUILD/tools/kiln"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# The model file trains with MLPerf's Adagrad / row-wise Adagrad; R1's peer uses SGD. Adagrad's
# step is about a quarter of a CPU step at small batches and less at large ones; the GEMMs
# dominate (`kiln train ... --profile` shows the split).
"$KILN" train models/dlrm_dcnv2.kiln --set rows_cap="$ROWS_CAP" \
  --batch "$BATCH" --steps "$STEPS" --log-every 1 --threads "$THREADS" \
  --metrics "$OUT/metrics.jsonl" > "$OUT/train.out" 2> "$OUT/train.err"

python3 - "$OUT/metrics.jsonl" "$BATCH" "$THREADS" "$ROWS_CAP" <<'PY'
import json, sys
path, batch, threads, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = [json.loads(l) for l in open(path)]
steady = rows[2:] if len(rows) > 4 else rows[1:]  # the first steps pay for lowering and first touch
rate = sum(r["samples_per_s"] for r in steady) / len(steady)
mflop_per_sample = 1.58e12 / 16384 / 1e6
print("| workload | batch | rows_cap | threads | samples/s | ms/step | GFLOP/s |")
print("| --- | --- | --- | --- | --- | --- | --- |")
print(f"| R1 small (CPU) | {batch} | {cap} | {threads} | {rate:.0f} | {batch / rate * 1e3:.1f} | {rate * mflop_per_sample / 1e3:.1f} |")
PY
