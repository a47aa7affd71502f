#!/bin/bash
# Workload R1-small (../shared/bench/WORKLOADS.md: DLRM-DCNv2, tables capped at ROWS_CAP) on 1, 2
# and 4 MPI ranks of one thread each, at one global batch: samples/s (global and per rank), the
# bytes a rank sends per step, and the fraction of its step spent in collectives. Every run is
# repeated REPEATS times, interleaved (1, 2, 4, 1, 2, 4, ...), and the medians reported. The
# automatic plan shards the tables (kiln plan shows it).
#
#   bench/scale_cpu.sh [BUILD_DIR] [GLOBAL_BATCH] [STEPS] [ROWS_CAP] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BATCH=${2:-4096}
STEPS=${3:-8}
ROWS_CAP=${4:-100000}
REPEATS=${5:-3}
KILN="$BUILD/tools/kiln"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)

cores=$(nproc)
echo "machine: $cores cores; ranks beyond $cores share cores (each rank runs one thread)"
for rep in $(seq 1 "$REPEATS"); do
  for np in 1 2 4; do
    "${MPI[@]}" -np "$np" "$KILN" train models/dlrm_dcnv2.kiln --set rows_cap="$ROWS_CAP" \
      --batch "$BATCH" --steps "$STEPS" --log-every 1 --threads 1 \
      --metrics "$OUT/np$np.$rep.jsonl" > "$OUT/np$np.$rep.out" 2> "$OUT/np$np.$rep.err" ||
      { cat "$OUT/np$np.$rep.err"; exit 1; }
  done
done

python3 - "$OUT" "$BATCH" "$REPEATS" "$ROWS_CAP" "$cores" <<'PY'
import json, statistics, sys
out, batch, repeats, cap, cores = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def run(np, rep):
    rows = [json.loads(l) for l in open(f"{out}/np{np}.{rep}.jsonl")]
    steady = rows[2:] if len(rows) > 4 else rows[1:]  # the first steps compile and touch memory
    mean = lambda k, d=0.0: sum(r.get(k, d) for r in steady) / len(steady)
    return mean("samples_per_s"), mean("comm_bytes_per_step"), mean("comm_wait_fraction")

base = None
print(f"R1-small: DLRM-DCNv2, rows_cap {cap}, global batch {batch}, one thread per rank, {cores} cores, "
      f"medians of {repeats} interleaved runs")
print("| ranks | samples/s | per rank | speedup | MB sent/step/rank | time in collectives |")
print("| --- | --- | --- | --- | --- | --- |")
for np in (1, 2, 4):
    runs = [run(np, rep) for rep in range(1, repeats + 1)]
    rate = statistics.median(r[0] for r in runs)
    sent = statistics.median(r[1] for r in runs)
    wait = statistics.median(r[2] for r in runs)
    base = base or rate
    note = " (oversubscribed)" if np > cores else ""
    print(f"| {np}{note} | {rate:.0f} | {rate / np:.0f} | {rate / base:.2f}x | {sent / 1e6:.2f} | {100 * wait:.0f}% |")
PY
