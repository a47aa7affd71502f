#!/bin/bash
# Ahead-of-time compile on the CPU (issue 16, docs/aot.md), on R1's model at rows_cap 20000:
# compile time, executable size with and without weights, start-up to the first prediction
# (the executable with embedded weights, with --checkpoint, and kiln predict's compile-then-run,
# interleaved, REPS times each, medians) and predictions per second through the C API at batch
# 1 and 256 (medians of REPS runs). The NVRTC side (kernels per architecture) is
# bench/aot_compile.sh.
#
#   bench/aot_cpu.sh [BUILD_DIR] [ROWS_CAP] [REPS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROWS_CAP=${2:-20000}
REPS=${3:-3}
THREADS=${4:-1}
KILN="$(realpath "$BUILD/tools/kiln")"
MODEL="$(realpath models/dlrm_dcnv2.kiln)"
SRC="$(pwd)"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
cd "$OUT"
SET=(--set rows_cap="$ROWS_CAP")

"$KILN" train "$MODEL" "${SET[@]}" --steps 2 --batch 256 --checkpoint ckpt > /dev/null 2>&1
seconds() {
  local t0 t1
  t0=$(date +%s.%N)
  "$@" > /dev/null 2>&1 || { echo "failed: $*" >&2; return 1; }
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
median() { tr ' ' '\n' | sed '/^$/d' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

compile_s="" compile_w_s=""
for _ in $(seq "$REPS"); do
  compile_s+=" $(seconds "$KILN" compile "$MODEL" "${SET[@]}" --device cpu -o dcn)"
  compile_w_s+=" $(seconds "$KILN" compile "$MODEL" "${SET[@]}" --device cpu -o dcn_w --checkpoint ckpt)"
done
size() { stat -c %s "$1"; }
runner=$(size "$(dirname "$KILN")/kiln-runner")

first=(--data synthetic --samples 1 --batch 1 --threads "$THREADS" -o scores)
emb_s="" exe_s="" kiln_s=""
for _ in $(seq "$REPS"); do
  emb_s+=" $(seconds ./dcn_w predict "${first[@]}")"
  exe_s+=" $(seconds ./dcn predict "${first[@]}" --checkpoint ckpt)"
  kiln_s+=" $(seconds "$KILN" predict "$MODEL" "${SET[@]}" "${first[@]}" --checkpoint ckpt)"
done

"$KILN" compile "$MODEL" "${SET[@]}" --device cpu --emit lib --checkpoint ckpt -o model > /dev/null 2>&1
cc -std=c11 -O2 "$SRC/bench/aot_capi_bench.c" -I. -L. -lmodel -Wl,-rpath,"$OUT" -o capi_bench
rate1="" rate256="" us1=""
for _ in $(seq "$REPS"); do
  line=$(./capi_bench 1 2 "$THREADS"); rate1+=" $(echo "$line" | awk '{print $8}')"; us1+=" $(echo "$line" | awk '{print $10}')"
  rate256+=" $(./capi_bench 256 2 "$THREADS" | awk '{print $8}')"
done

ms() { echo "$1 * 1000" | bc | xargs printf "%.0f"; }
mb() { echo "scale=1; $1 / 1000000" | bc; }
# R1's dense part: 96.4 MFLOP per sample forward + backward, about a third of it forward.
gflops=$(echo "scale=1; $(echo "$rate256" | median) * 96.4 / 3 / 1000" | bc)
echo "| AOT, dlrm_dcnv2 rows_cap=$ROWS_CAP, CPU, $THREADS thread(s) | median of $REPS |"
echo "| --- | --- |"
echo "| kiln compile (cpu) | $(ms "$(echo "$compile_s" | median)") ms |"
echo "| kiln compile (cpu) --checkpoint | $(ms "$(echo "$compile_w_s" | median)") ms |"
echo "| executable without weights | $(mb "$(size dcn)") MB (runtime $(mb "$runner") MB) |"
echo "| executable with weights | $(mb "$(size dcn_w)") MB |"
echo "| libmodel.so with weights | $(mb "$(size libmodel.so)") MB |"
echo "| start-up to first prediction: embedded weights | $(ms "$(echo "$emb_s" | median)") ms |"
echo "| start-up to first prediction: ./dcn --checkpoint | $(ms "$(echo "$exe_s" | median)") ms |"
echo "| start-up to first prediction: kiln predict (compile, then run) | $(ms "$(echo "$kiln_s" | median)") ms |"
echo "| C API predictions/s, batch 1 | $(echo "$rate1" | median) ($(echo "$us1" | median) us/call) |"
echo "| C API predictions/s, batch 256 | $(echo "$rate256" | median) ($gflops GFLOP/s of the forward) |"
