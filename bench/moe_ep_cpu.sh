#!/bin/bash
# Communication overlap on the CPU: models/moe_lm.kiln trained on N = 1, 2 and 4 MPI ranks of one
# thread each, with expert parallelism over all of them (--ep N, where this kiln has the flag;
# data parallelism otherwise), once with the executor's overlap and once with --no-overlap
# (every collective waited on right after it is issued). Runs are interleaved (for each repeat:
# N = 1, 2, 4, each with and without overlap) and REPEATS of each are reduced to medians of the
# steady steps (the first two compile and touch memory). Reads `kiln train --metrics`:
# samples_per_s (a step's time is the global batch over it), comm_bytes_per_step and
# comm_wait_fraction (the share of the step this rank was blocked waiting on collectives).
#
#   bench/moe_ep_cpu.sh [BUILD_DIR] [GLOBAL_BATCH] [STEPS] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BATCH=${2:-16}
STEPS=${3:-16}
REPEATS=${4:-3}
KILN="$BUILD/tools/kiln"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
# Small enough that the 36 runs take a few minutes on two cores.
MODEL=(models/moe_lm.kiln --set T=32 --set d=64 --set ffn=64 --set experts=8)

ep_flag=0
if "$KILN" train --help 2>&1 | grep -qE -- '^ *--ep[= ]'; then ep_flag=1; fi

cores=$(nproc)
echo "machine: $cores cores; ranks beyond $cores share cores (each rank runs one thread)"
[ "$ep_flag" = 1 ] || echo "note: this kiln has no --ep; the ranks run data parallel"
for rep in $(seq 1 "$REPEATS"); do
  for np in 1 2 4; do
    for mode in overlap no-overlap; do
      flags=()
      [ "$mode" = no-overlap ] && flags+=(--no-overlap)
      [ "$ep_flag" = 1 ] && [ "$np" -gt 1 ] && flags+=(--ep "$np")
      run="$OUT/np$np.$mode.$rep"
      "${MPI[@]}" -np "$np" "$KILN" train "${MODEL[@]}" --batch "$BATCH" --steps "$STEPS" --log-every 1 \
        --threads 1 "${flags[@]}" --metrics "$run.jsonl" > "$run.out" 2> "$run.err" ||
        { cat "$run.err"; exit 1; }
    done
  done
done

python3 - "$OUT" "$BATCH" "$REPEATS" "$cores" "$ep_flag" <<'PY'
import json, statistics, sys
out, batch, repeats, cores, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"

def run(np, mode, rep):
    rows = [json.loads(l) for l in open(f"{out}/np{np}.{mode}.{rep}.jsonl")]
    steady = rows[2:] if len(rows) > 3 else rows[1:]
    step_s = statistics.median(batch / r["samples_per_s"] for r in steady)
    sent = statistics.median(r.get("comm_bytes_per_step", 0.0) for r in steady)
    wait_s = statistics.median(r.get("comm_wait_fraction", 0.0) * batch / r["samples_per_s"] for r in steady)
    return step_s, sent, wait_s

def medians(np, mode):
    runs = [run(np, mode, rep) for rep in range(1, repeats + 1)]
    return [statistics.median(r[i] for r in runs) for i in range(3)]

print(f"moe_lm (T=32, d=64, 8 experts, top-2), global batch {batch}, {'--ep N' if ep else 'data parallel'}, "
      f"one thread per rank, {cores} cores, medians of {repeats} interleaved runs")
print("| ranks | step ms (overlap) | step ms (--no-overlap) | KB sent/step/rank | "
      "ms waiting on collectives (overlap) | ms waiting (--no-overlap) |")
print("| --- | --- | --- | --- | --- | --- |")
for np in (1, 2, 4):
    step, sent, wait = medians(np, "overlap")
    step_b, _, wait_b = medians(np, "no-overlap")
    note = " (oversubscribed)" if np > cores else ""
    print(f"| {np}{note} | {1e3 * step:.1f} | {1e3 * step_b:.1f} | {sent / 1e3:.0f} | {1e3 * wait:.2f} | "
          f"{1e3 * wait_b:.2f} |")
PY
