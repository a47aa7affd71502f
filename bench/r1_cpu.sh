#!/bin/bash
# Workload R1 (../shared/bench/WORKLOADS.md: DLRM-DCNv2, 26 tables of dim 128) at small scale and
# the MoE layer M1-small on the CPU, Kiln against the PyTorch peer in the same run.
#
#   bench/r1_cpu.sh [BUILD_DIR] [ROUNDS=3] [THREADS=2]
#   bench/r1_cpu.sh --kiln-only [BUILD_DIR] [BATCH] [STEPS] [ROWS_CAP] [THREADS]   # Kiln alone, one run
#
# Configurations, each a fresh process, interleaved round by round (every configuration once per
# round, then the next round), ROUNDS rounds; the table gives each one's median over the rounds
# and the min..max:
#   R1-small: models/dlrm_dcnv2.kiln, rows_cap 1e5, batch 1024 and 4096, the model file's
#             optimizers (Adagrad, row-wise Adagrad for the tables);
#   M1-small: models/moe_layer.kiln's defaults (1024 tokens, hidden 512, 8 SwiGLU experts of
#             1792, top-2), mse loss, SGD;
#   Kiln f32, Kiln bf16 (`--precision bf16`; n/a where the binary has no such flag), PyTorch
#   eager f32, eager with bf16 autocast, torch.compile f32 and bf16 (bench/peers/*.py: the same
#   models, optimizers and threads; torch.compile's compilation is left out of the timing).
# PyTorch comes from PyPI into a venv outside the repository (bench/peer_venv.sh;
# KILN_PEER_VENV moves it). The GEMM roof (bench/peers/gemm_roof.py: torch's best f32 and bf16
# GFLOP/s on square 2048, 4096 and 4096x3456x1024 products) is measured once, first.
#
# A Kiln run's rate is the median of its per-step samples/s (`--log-every 1 --metrics`) without
# its first two steps (lowering, first touch of memory); a PyTorch run's is batch / the median
# step time over its timed steps, after its warm-up steps. Steps per run (env):
#   R1_KILN_STEPS_1024 (10), R1_KILN_STEPS_4096 (6): total, the first two dropped
#   R1_TORCH_STEPS_1024 (6), R1_TORCH_STEPS_4096 (3), R1_TORCH_WARMUP (2)
#   MOE_KILN_STEPS (16), MOE_TORCH_STEPS (10), MOE_TORCH_WARMUP (3)
#   ROWS_CAP (100000), BATCHES ("1024 4096"), WORKLOADS ("r1 moe"), LOG_DIR (a new folder in /tmp),
#   RUN_TIMEOUT (900 s per run), PRECISIONS ("f32 bf16" where /proc/cpuinfo lists avx512_bf16 or
#   amx_bf16, else "f32": on a CPU without bf16 instructions neither Kiln nor PyTorch runs bf16
#   natively (Kiln widens to f32, torch's bf16 products crawl at a few GFLOP/s), so the bf16
#   rows and the bf16 roof would measure emulation, for an hour; the table says so instead).
#
# M1-small's tokens: the peer draws x and target standard normal. models/moe_layer.kiln as it is
# reads the Criteo layout on synthetic data: x and target both get the same Criteo-like dense
# values (log(1 + E*scale) >= 0, the same columns for both inputs), on which the router sends
# nearly every token to one expert (`moe cv` ~1.7). So Kiln trains a copy of the model file in the
# log folder whose two inputs bind columns (`columns("x{}")`, `columns("t{}")`): synthetic data
# then draws every column standard normal, as the peer's, and routing is about as balanced as the
# peer's (cv < 0.1). MOE_KILN_DATA=criteo trains models/moe_layer.kiln itself.
#
# Run it on an otherwise idle machine: PyTorch's OpenMP threads slow down far more than Kiln's
# pool when another process takes a core (several-fold on 2 cores), which would flatter Kiln.
#
# FLOPs for the roof fraction (the GEMM work of a training step, forward + backward):
#   R1: 1.58 TFLOP per step at batch 16384, i.e. about 96.4 MFLOP per sample: the bottom MLP,
#       three cross layers and the top MLP are 16.03 M multiply-adds per sample forward
#       (13*512 + 512*256 + 256*128 + 3*2*3456*512 + 3456*1024 + 1024*1024 + 1024*512 + 512*256
#       + 256), so 32.06 MFLOP forward and twice that backward (input and weight gradients): 96.2
#       MFLOP from the GEMMs alone; the table uses WORKLOADS.md's 1.58 TFLOP / 16384.
#   M1-small: H = 512 hidden, F = 1792 FFN, k = 2 experts per token, E = 8. Per routed slot the
#       forward is fc1 (H x 2F: 2*H*2F = 4HF FLOP) and fc2 (F x H: 2HF), 6HF in all. Backward:
#       fc1's weight gradient 4HF, fc2's weight gradient 2HF and its input gradient 2HF; fc1's
#       input gradient (4HF) is not needed, since x is an input of the model and no parameter
#       precedes it (neither Kiln nor the peer computes it). So 14HF per slot, 28HF per token =
#       28 * 512 * 1792 = 25.69 MFLOP, plus the router (x W_r^T forward and its weight
#       gradient: 4HE = 16 kFLOP): 25.71 MFLOP per token. (WORKLOADS.md's M1 figure counts 3x
#       the forward, 36HF per token, as for a layer inside a model whose input needs a gradient.)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--kiln-only" ]; then
  # The former single-run measurement: samples/s and achieved GFLOP/s of one Kiln run.
  shift
  BUILD=${1:-build}
  BATCH=${2:-1024}
  STEPS=${3:-12}
  ROWS_CAP=${4:-100000}
  THREADS=${5:-$(nproc)}
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
  "$BUILD/tools/kiln" train models/dlrm_dcnv2.kiln --set rows_cap="$ROWS_CAP" \
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
  exit 0
fi

BUILD=${1:-build}
ROUNDS=${2:-3}
THREADS=${3:-2}
KILN="$BUILD/tools/kiln"
ROWS_CAP=${ROWS_CAP:-100000}
BATCHES=${BATCHES:-"1024 4096"}
WORKLOADS=${WORKLOADS:-"r1 moe"}
R1_KILN_STEPS_1024=${R1_KILN_STEPS_1024:-10}
R1_KILN_STEPS_4096=${R1_KILN_STEPS_4096:-6}
R1_TORCH_STEPS_1024=${R1_TORCH_STEPS_1024:-6}
R1_TORCH_STEPS_4096=${R1_TORCH_STEPS_4096:-3}
R1_TORCH_WARMUP=${R1_TORCH_WARMUP:-2}
MOE_TOKENS=1024
MOE_KILN_STEPS=${MOE_KILN_STEPS:-16}
MOE_TORCH_STEPS=${MOE_TORCH_STEPS:-10}
MOE_TORCH_WARMUP=${MOE_TORCH_WARMUP:-3}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/kiln-r1-cpu.XXXXXX)}
mkdir -p "$LOG_DIR"
RESULTS="$LOG_DIR/results.tsv"
: > "$RESULTS"
echo "r1_cpu: logs in $LOG_DIR" >&2
started=$(date +%s)

if [ -z "${PRECISIONS:-}" ]; then
  if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then PRECISIONS="f32 bf16"; else PRECISIONS="f32"; fi
fi
case " $PRECISIONS " in *" bf16 "*) BF16=1 ;; *) BF16=0 ;; esac
if [ "$BF16" = 0 ]; then
  echo "r1_cpu: bf16 left out (PRECISIONS=\"$PRECISIONS\"; this CPU's flags: $(grep -m1 -owE 'avx512_bf16|amx_bf16|avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '))" >&2
fi

PY=$(bench/peer_venv.sh | tail -n 1)
cat "$(dirname "$(dirname "$PY")")/.kiln-peer-ready" > "$LOG_DIR/venv.txt" 2>/dev/null || true
MOE_MODEL=models/moe_layer.kiln
if [ "${MOE_KILN_DATA:-normal}" != criteo ]; then
  MOE_MODEL="$LOG_DIR/moe_layer_normal.kiln"
  sed -e 's|^\( *input x: f32\[B, hidden\]\)|\1 columns("x{}")|' \
      -e 's|^\( *input target: f32\[B, hidden\]\)|\1 columns("t{}")|' models/moe_layer.kiln > "$MOE_MODEL"
  if [ "$(grep -c 'columns(' "$MOE_MODEL")" != 2 ]; then
    echo "r1_cpu: could not bind columns in a copy of models/moe_layer.kiln: Kiln's M1-small reads the Criteo layout" >&2
    MOE_MODEL=models/moe_layer.kiln
  fi
fi
if [ ! -x "$KILN" ]; then
  echo "r1_cpu: no $KILN: the Kiln rows will be n/a" >&2
fi

# steps_for KIND WORKLOAD BATCH -> "STEPS WARMUP"
steps_for() {
  case "$1/$2" in
    kiln/r1) eval "echo \${R1_KILN_STEPS_$3:-6} 0" ;;
    torch/r1) eval "echo \${R1_TORCH_STEPS_$3:-3} \$R1_TORCH_WARMUP" ;;
    kiln/moe) echo "$MOE_KILN_STEPS 0" ;;
    torch/moe) echo "$MOE_TORCH_STEPS $MOE_TORCH_WARMUP" ;;
  esac
}

# rate_of KIND FILE: the run's samples (tokens) per second, or nothing.
rate_of() {
  python3 - "$1" "$2" <<'PY' 2>/dev/null || true
import json, statistics, sys
kind, path = sys.argv[1], sys.argv[2]
if kind == "kiln":
    rows = [json.loads(l) for l in open(path) if l.strip()]
    rates = [r["samples_per_s"] for r in rows if r.get("samples_per_s")]
    steady = rates[2:] if len(rates) > 2 else rates[-1:]  # the first steps pay for lowering and first touch
    print(f"{statistics.median(steady):.1f}")
else:
    for line in open(path):
        if line.startswith("PEER "):
            r = json.loads(line[5:])
            print(r.get("samples_per_s", r.get("tokens_per_s")))
PY
}

declare -A BROKEN  # configurations that failed once: not run again, n/a in the table

# run_one ROUND WORKLOAD BATCH CONFIG: one process; appends "workload batch config round rate
# log" to $RESULTS (rate n/a on failure).
run_one() {
  local round=$1 wl=$2 batch=$3 cfg=$4
  local key="$wl/$batch/$cfg" tag="${wl}_b${batch}_${cfg}_r${round}"
  local log="$LOG_DIR/$tag.log" rate="" kind steps warmup
  case "$cfg" in kiln_*) kind=kiln ;; *) kind=torch ;; esac
  read -r steps warmup <<< "$(steps_for "$kind" "$wl" "$batch")"
  if [ -n "${BROKEN[$key]:-}" ]; then
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$wl" "$batch" "$cfg" "$round" "n/a" "${BROKEN[$key]}" >> "$RESULTS"
    return
  fi
  local cmd=()
  if [ "$kind" = kiln ]; then
    if [ ! -x "$KILN" ]; then
      BROKEN[$key]="(no $KILN)"
      printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$wl" "$batch" "$cfg" "$round" "n/a" "${BROKEN[$key]}" >> "$RESULTS"
      return
    fi
    cmd=("$KILN" train)
    if [ "$wl" = r1 ]; then cmd+=(models/dlrm_dcnv2.kiln --set rows_cap="$ROWS_CAP"); else cmd+=("$MOE_MODEL"); fi
    cmd+=(--batch "$batch" --steps "$steps" --log-every 1 --threads "$THREADS" --metrics "$LOG_DIR/$tag.metrics.jsonl")
    if [ "$cfg" = kiln_bf16 ]; then cmd+=(--precision bf16); fi
    rm -f "$LOG_DIR/$tag.metrics.jsonl"
  else
    local mode=${cfg#torch_}
    if [ "$wl" = r1 ]; then
      cmd=("$PY" bench/peers/r1_torch_cpu.py --batch "$batch" --rows-cap "$ROWS_CAP")
    else
      cmd=("$PY" bench/peers/moe_torch_cpu.py --tokens "$batch")
    fi
    cmd+=(--mode "$mode" --threads "$THREADS" --steps "$steps" --warmup "$warmup")
  fi
  echo "\$ ${cmd[*]}" > "$log"
  local t0 rc=0
  t0=$(date +%s)
  timeout "$RUN_TIMEOUT" "${cmd[@]}" >> "$log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    if [ "$kind" = kiln ]; then rate=$(rate_of kiln "$LOG_DIR/$tag.metrics.jsonl"); else rate=$(rate_of torch "$log"); fi
  fi
  if [ -z "$rate" ]; then
    if [ "$rc" = 124 ]; then
      BROKEN[$key]="(timed out after $RUN_TIMEOUT s: $tag.log)"
    elif [ "$cfg" = kiln_bf16 ] && grep -qi 'precision' "$log" && grep -qiE 'unknown|unrecognized' "$log"; then
      BROKEN[$key]="(this kiln has no --precision flag)"
    else
      BROKEN[$key]="(failed: exit $rc, $tag.log)"
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$wl" "$batch" "$cfg" "$round" "n/a" "${BROKEN[$key]}" >> "$RESULTS"
    echo "r1_cpu: round $round $wl batch $batch $cfg: FAILED (exit $rc; see $log)" >&2
    return
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$wl" "$batch" "$cfg" "$round" "$rate" "$tag.log" >> "$RESULTS"
  echo "r1_cpu: round $round $wl batch $batch $cfg: $rate/s ($(( $(date +%s) - t0 )) s)" >&2
}

ROOF_DTYPES=f32
[ "$BF16" = 1 ] && ROOF_DTYPES=f32,bf16
"$PY" bench/peers/gemm_roof.py --threads "$THREADS" --dtypes "$ROOF_DTYPES" > "$LOG_DIR/roof.log" 2>&1 || true
ROOF=$(sed -n 's/^ROOF //p' "$LOG_DIR/roof.log")
if [ -z "$ROOF" ]; then
  echo "r1_cpu: the roof measurement failed (see $LOG_DIR/roof.log)" >&2
  ROOF='{}'
fi
echo "r1_cpu: roof $ROOF" >&2

CONFIGS="kiln_f32 torch_eager_f32 torch_compile_f32"
[ "$BF16" = 1 ] && CONFIGS="kiln_f32 kiln_bf16 torch_eager_f32 torch_eager_bf16 torch_compile_f32 torch_compile_bf16"
for round in $(seq 1 "$ROUNDS"); do
  for wl in $WORKLOADS; do
    if [ "$wl" = r1 ]; then batches=$BATCHES; else batches=$MOE_TOKENS; fi
    for batch in $batches; do
      for cfg in $CONFIGS; do
        run_one "$round" "$wl" "$batch" "$cfg"
      done
    done
  done
done

"$KILN" version > "$LOG_DIR/kiln_version.txt" 2>&1 || true
python3 - "$RESULTS" "$ROOF" "$THREADS" "$ROUNDS" "$ROWS_CAP" "$(( $(date +%s) - started ))" "$LOG_DIR/kiln_version.txt" "$BF16" <<'PY' | tee "$LOG_DIR/table.md"
import json, statistics, sys
from collections import OrderedDict
results, roof, threads, rounds, cap, secs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
kiln_cpu = [l.strip() for l in open(sys.argv[7]) if l.startswith("cpu:")]
# GEMM FLOPs of one training step per sample (token): see the derivations at the top of r1_cpu.sh.
FLOPS = {"r1": 1.58e12 / 16384, "moe": 28 * 512 * 1792 + 4 * 512 * 8}
NAMES = {"r1": "R1-small", "moe": "M1-small"}
CFG = OrderedDict([("kiln_f32", "Kiln f32"), ("kiln_bf16", "Kiln bf16"), ("torch_eager_f32", "PyTorch eager f32"),
                   ("torch_eager_bf16", "PyTorch eager bf16 autocast"), ("torch_compile_f32", "PyTorch compile f32"),
                   ("torch_compile_bf16", "PyTorch compile bf16 autocast")])
runs = OrderedDict()
notes = {}
for line in open(results):
    wl, batch, cfg, rnd, rate, note = line.rstrip("\n").split("\t")
    runs.setdefault((wl, int(batch)), OrderedDict()).setdefault(cfg, [])
    if rate != "n/a":
        runs[(wl, int(batch))][cfg].append(float(rate))
    else:
        notes[(wl, int(batch), cfg)] = note
f32, bf16 = roof.get("f32_gflops"), roof.get("bf16_gflops")
pct = lambda gf, r: f"{100 * gf / r:.0f}%" if r else "n/a"
gflops = lambda r: f"{r:.0f} GFLOP/s" if r else "n/a"
print(f"GEMM roof ({threads} threads, torch {roof.get('torch', 'n/a')}): f32 {gflops(f32)}, bf16 {gflops(bf16)}; "
      f"{rounds} rounds, rows_cap {cap}, {secs} s in all" + (f"; Kiln {kiln_cpu[0]}" if kiln_cpu else ""))
if sys.argv[8] != "1":
    print("bf16 not measured: this CPU has no AVX512-BF16 or AMX, so bf16 would run as emulation on both sides "
          "(PRECISIONS=\"f32 bf16\" measures it anyway).")
print()
print("| workload | batch | config | median samples/s (M1: tokens/s) | min..max | x PyTorch best f32 | x PyTorch best bf16 | GFLOP/s | % f32 roof | % bf16 roof |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for (wl, batch), cfgs in runs.items():
    med = {c: statistics.median(v) for c, v in cfgs.items() if v}
    best32 = max([med[c] for c in ("torch_eager_f32", "torch_compile_f32") if c in med], default=None)
    best16 = max([med[c] for c in ("torch_eager_bf16", "torch_compile_bf16") if c in med], default=None)
    for c, label in CFG.items():
        if c not in cfgs:
            continue
        if c not in med:
            print(f"| {NAMES[wl]} | {batch} | {label} | n/a | {notes.get((wl, batch, c), '')} | | | | | |")
            continue
        m, v = med[c], cfgs[c]
        gf = m * FLOPS[wl] / 1e9
        r32 = f"{m / best32:.2f}" if best32 else "n/a"
        r16 = f"{m / best16:.2f}" if best16 else "n/a"
        rate = f"{m:.0f}"
        print(f"| {NAMES[wl]} | {batch} | {label} | {rate} | {min(v):.0f}..{max(v):.0f} | {r32} | {r16} | {gf:.1f} "
              f"| {pct(gf, f32)} | {pct(gf, bf16)} |")
PY
echo "r1_cpu: logs and table in $LOG_DIR" >&2
