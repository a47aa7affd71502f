#!/bin/bash
# The sharding planner (issue 19, docs/distributed.md "The automatic plan"):
#
#  1. The MLPerf DLRM-DCNv2 tables (26 tables, 4 of 40M rows, dim 128, rowwise Adagrad) on 8
#     ranks of 80 GB at global batch 65536, planned by `kiln plan` next to the table-row-wise
#     baseline and the plan TorchRec's rules choose, all scored by Kiln's model (H200 table):
#     predicted embedding step, memory imbalance, and the planner's own time; then 64 ranks.
#  2. The frequency-hybrid what-if on a Zipf sample (the synthetic stream): the link bytes that
#     replicating each table's hot rows saves.
#  3. The simulator against this machine: `kiln calibrate` measures it (under mpirun -np 2), then
#     `kiln plan --simulate` predicts the step of `mpirun -np N kiln train` and the same run is
#     timed (N = 2, 4; REPEATS interleaved runs, medians).
#  4. The simulator's MLPerf predictions (H100 table, bf16, batch 55296) on 8 and 16 x 8 GPUs
#     next to HugeCTR's MLPerf Training v4.0 results.
#
#   bench/plan.sh [BUILD_DIR] [REPEATS] [ROWS_CAP] [PER_RANK_BATCH] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
REPEATS=${2:-3}
ROWS_CAP=${3:-100000}
PER_RANK=${4:-2048}
STEPS=${5:-6}
KILN="$BUILD/tools/kiln"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
MODEL=models/dlrm_dcnv2.kiln
MLPERF=(--set rows_cap=40000000)

seconds() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$@"; }

echo "## 1. The MLPerf DLRM-DCNv2 plan (Kiln's cost model, built-in h200 table)"
for ranks in 8 64; do
  t0=$(date +%s.%N)
  "$KILN" plan "$MODEL" "${MLPERF[@]}" --ranks "$ranks" --ranks-per-node 8 --memory-per-rank 80G \
    --batch 65536 --compare > "$OUT/plan$ranks.txt"
  t1=$(date +%s.%N)
  echo
  echo "### $ranks ranks of 80 GB (8 a node), global batch 65536; kiln plan --compare took $(seconds "$t0" "$t1") s"
  echo
  python3 - "$OUT/plan$ranks.txt" <<'PY'
import sys
lines = open(sys.argv[1]).read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith("strategy"))
rows = [l.split(None, 5) for l in lines[start + 1:] if l.strip()]
by = {r[0]: r for r in rows}
print("| plan | predicted ms | search's speedup over it | memory imbalance | time imbalance | types |")
print("| --- | --- | --- | --- | --- | --- |")
for name in ("search", "greedy", "table_row_wise", "torchrec"):
    r = by[name]
    print(f"| {name} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5] if len(r) > 5 else ''} |")
PY
done
grep -E "^critical path|^imbalance" "$OUT/plan8.txt" || true

echo
echo "## 2. Frequency-hybrid tables on a Zipf sample (synthetic stream, 65536 samples, 8 ranks)"
echo
"$KILN" plan "$MODEL" "${MLPERF[@]}" --ranks 8 --ranks-per-node 8 --memory-per-rank 80G --batch 65536 \
  --data synthetic --data-samples 65536 > "$OUT/hybrid.txt"
sed -n '/^id frequencies/,$p' "$OUT/hybrid.txt"
echo
echo "The same within 16 GiB a rank (the search must then balance the memory):"
"$KILN" plan "$MODEL" "${MLPERF[@]}" --ranks 8 --ranks-per-node 8 --memory-per-rank 16G --batch 65536 \
  --data synthetic --data-samples 65536 > "$OUT/hybrid16.txt"
grep -E "^(hybrid|searched again|de-duplicated)" "$OUT/hybrid16.txt"
echo
echo "The whole step simulated (dense layers included), the plain search's plan and the hybrid plan that runs:"
for v in plain hybrid; do
  data=()
  [ "$v" = hybrid ] && data=(--data synthetic --data-samples 65536)
  "$KILN" plan "$MODEL" "${MLPERF[@]}" --ranks 8 --ranks-per-node 8 --memory-per-rank 80G --batch 65536 \
    "${data[@]}" --simulate > "$OUT/sim_$v.txt"
  echo "$v: $(grep -E '^predicted step' "$OUT/sim_$v.txt")"
done

echo
echo "## 2b. Hybrid tables and de-duplicated ids run: every table row_wise on 2 MPI ranks, plain, with the hot rows, and with the de-duplicated routes"
echo "##     kiln plan --data chose (rows_cap $ROWS_CAP, $PER_RANK samples a rank; $REPEATS interleaved runs)"
"$KILN" plan "$MODEL" --set rows_cap="$ROWS_CAP" --ranks 2 --batch $((2 * PER_RANK)) -o "$OUT/auto2.json" > /dev/null
python3 - "$OUT/auto2.json" "$OUT/rw2.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
plan = {"format": plan["format"], "ranks": 2,
        "tables": [{"table": t["table"], "sharding": "row_wise", "ranks": [0, 1]} for t in plan["tables"]]}
json.dump(plan, open(sys.argv[2], "w"))
PY
"$KILN" plan "$MODEL" --set rows_cap="$ROWS_CAP" --ranks 2 --batch $((2 * PER_RANK)) --plan "$OUT/rw2.json" \
  --data synthetic --data-samples 65536 -o "$OUT/rw2dedup.json" > "$OUT/rw2dedup.txt"
grep -E "^(hybrid|de-duplicated|runs)" "$OUT/rw2dedup.txt"
# The same hot rows without the de-duplicated routes kiln plan chose.
python3 - "$OUT/rw2dedup.json" "$OUT/rw2hot.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
for t in plan["tables"]:
    t.pop("dedup", None)
    t.pop("unique_share", None)
json.dump(plan, open(sys.argv[2], "w"))
PY
for rep in $(seq 1 "$REPEATS"); do
  for v in rw2 rw2hot rw2dedup; do
    "${MPI[@]}" -np 2 "$KILN" train "$MODEL" --set rows_cap="$ROWS_CAP" --batch $((2 * PER_RANK)) --steps "$STEPS" \
      --log-every 1 --threads 1 --plan "$OUT/$v.json" --metrics "$OUT/$v.$rep.jsonl" > "$OUT/$v.$rep.out" 2>&1 ||
      { cat "$OUT/$v.$rep.out"; exit 1; }
  done
done
python3 - "$OUT" "$REPEATS" <<'PY'
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
print("\nmeasured: bytes each rank sends a step over every collective (the dense layers' all-reduce, the same")
print("in both, included), median samples/s, the last step's loss (equal up to f32 rounding)\n")
print("| plan | bytes sent a step, a rank | samples/s (median) | loss at the last step |")
print("| --- | --- | --- | --- |")
for v, name in (("rw2", "row_wise"), ("rw2hot", "row_wise + hot rows"),
                ("rw2dedup", "row_wise + hot rows + de-duplicated ids (as kiln plan wrote it)")):
    rates, sent, loss = [], 0, 0
    for rep in range(1, repeats + 1):
        rows = [json.loads(l) for l in open(f"{out}/{v}.{rep}.jsonl")]
        steady = rows[2:] if len(rows) > 3 else rows[1:]
        rates.append(sum(r["samples_per_s"] for r in steady) / len(steady))
        sent, loss = rows[-1]["comm_bytes_per_step"], rows[-1]["loss"]
    print(f"| {name} | {sent / 2**20:.1f} MiB | {statistics.median(rates):.0f} | {loss:.5f} |")
PY

echo
echo "## 3. The simulator against this machine (rows_cap $ROWS_CAP, $PER_RANK samples a rank, one thread a rank)"
"${MPI[@]}" -np 2 "$KILN" calibrate --threads 1 --quick -o "$OUT/cal.json" > "$OUT/cal.out" 2>&1 ||
  { cat "$OUT/cal.out"; exit 1; }
for np in 2 4; do
  "$KILN" plan "$MODEL" --set rows_cap="$ROWS_CAP" --ranks "$np" --batch $((np * PER_RANK)) \
    --costs "$OUT/cal.json" --simulate > "$OUT/sim$np.txt"
done
for rep in $(seq 1 "$REPEATS"); do
  for np in 2 4; do
    "${MPI[@]}" -np "$np" "$KILN" train "$MODEL" --set rows_cap="$ROWS_CAP" --batch $((np * PER_RANK)) \
      --steps "$STEPS" --log-every 1 --threads 1 --metrics "$OUT/np$np.$rep.jsonl" \
      > "$OUT/np$np.$rep.out" 2> "$OUT/np$np.$rep.err" || { cat "$OUT/np$np.$rep.err"; exit 1; }
  done
done
python3 - "$OUT" "$PER_RANK" "$REPEATS" "$(nproc)" <<'PY'
import json, re, statistics, sys
out, per_rank, repeats, cores = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print(f"\nmachine: {cores} cores; medians of {repeats} interleaved runs; the first two steps left out\n")
print("| ranks | predicted ms/step | measured ms/step | predicted / measured |")
print("| --- | --- | --- | --- |")
for np in (2, 4):
    text = open(f"{out}/sim{np}.txt").read()
    predicted = float(re.search(r"predicted step: ([0-9.]+) ms", text).group(1))
    rates = []
    for rep in range(1, repeats + 1):
        rows = [json.loads(l) for l in open(f"{out}/np{np}.{rep}.jsonl")]
        steady = rows[2:] if len(rows) > 3 else rows[1:]
        rates.append(sum(r["samples_per_s"] for r in steady) / len(steady))
    measured = np * per_rank / statistics.median(rates) * 1e3
    print(f"| {np} | {predicted:.0f} | {measured:.0f} | {predicted / measured:.2f} |")
PY

echo
echo "## 4. MLPerf DLRM-DCNv2 predicted by the simulator (h100 table, bf16, Adagrad, batch 55296)"
sed 's/metrics = \[auc, accuracy\]/&\n    precision = bf16/' "$MODEL" > "$OUT/dcnv2_bf16.kiln"
for ranks in 8 128; do
  "$KILN" plan "$OUT/dcnv2_bf16.kiln" "${MLPERF[@]}" --ranks "$ranks" --ranks-per-node 8 --memory-per-rank 80G \
    --batch 55296 --target h100 --simulate > "$OUT/mlperf$ranks.txt"
done
python3 - "$OUT" <<'PY'
import re, sys
out = sys.argv[1]
# MLPerf Training v4.0, NVIDIA's HugeCTR submissions (DLRM-DCNv2): time to AUC 0.80287, throughput.
hugectr = {8: "13.8 M samples/s (243.1 s to AUC 0.80287)", 128: "65.0 M samples/s"}
samples_to_target = 243.1 * 13.8e6  # the samples HugeCTR's 8-GPU run trained to reach the target
print("\n| GPUs | Kiln predicted ms/step | samples/s | time for HugeCTR's samples | HugeCTR v4.0 |")
print("| --- | --- | --- | --- | --- |")
for ranks in (8, 128):
    text = open(f"{out}/mlperf{ranks}.txt").read()
    m = re.search(r"predicted step: ([0-9.]+) ms, ([0-9.e+]+) samples/s", text)
    ms, rate = float(m.group(1)), float(m.group(2))
    print(f"| {ranks} | {ms:.1f} | {rate / 1e6:.2f} M | {samples_to_target / rate:.0f} s | {hugectr[ranks]} |")
PY
