#!/bin/bash
# kiln serve on loopback (docs/serving.md): DLRM-DCNv2 at rows_cap ROWS_CAP, driven by wrk at
# requests of 1 and 256 samples, with every row in memory (cache fraction 1) and with the tables
# in RocksDB behind a 20% or 5% cache and a 25% host tier. Per setting: QPS, samples/s and
# p50/p99/p99.9 latency at saturation, p99 at about 80% of saturation, the cache hit rate, and the
# serving overhead against kiln predict's raw throughput. Prints a markdown table last.
#
#   bench/serve.sh BUILD_DIR [OUT_DIR]
#
# Environment (defaults): ROWS_CAP (1000000; 20000 for a quick run), THREADS (kiln's threads,
# nproc), REQ_SAMPLES (samples in the request bodies, 16384), PREDICT_SAMPLES (16384), DURATION
# (one saturation run, 10s), STEP_DURATION (one run of the load ladder, 5s), WARMUP (5s),
# SAT_CONN_1 and SAT_CONN_256 (wrk connections at saturation for requests of 1 and 256 samples,
# 64 and 8).
#
# Saturation is a closed loop of many connections. Debian's wrk 4.1 has no constant-rate -R, so
# "~80% load" is the largest connection count of 1, 2, 4, ... whose QPS stays at or below 80% of
# saturation (the first one if none does); its p99 is reported with the load it reached. wrk runs
# one thread on the same cores as the server, so on a small machine the served samples/s
# understate what the server does alone.
#
# The machine is shared and noisy: one run of this script is one sample. Figures count only as
# medians of several runs, interleaved with the runs they are compared with.
#
# At the default rows_cap the tables are about 3.7 GB: the checkpoint and the store take about
# 8 GB of OUT_DIR (a temporary directory, removed at the end, if not given), and cache fraction 1
# (the host tier plus a full cache) about 8 GB of memory.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
BUILD=${1:?usage: bench/serve.sh BUILD_DIR [OUT_DIR]}
KILN="$(realpath "$BUILD/tools/kiln")"
MODEL="$(realpath models/dlrm_dcnv2.kiln)"
NAME=dlrm_dcnv2
ROWS_CAP=${ROWS_CAP:-1000000}
THREADS=${THREADS:-$(nproc)}
REQ_SAMPLES=${REQ_SAMPLES:-16384}
PREDICT_SAMPLES=${PREDICT_SAMPLES:-16384}
DURATION=${DURATION:-10s}
STEP_DURATION=${STEP_DURATION:-5s}
WARMUP=${WARMUP:-5s}
SAT_CONN_1=${SAT_CONN_1:-64}
SAT_CONN_256=${SAT_CONN_256:-8}
SET=(--set rows_cap="$ROWS_CAP")
if [ $# -ge 2 ]; then OUT=$(realpath -m "$2"); mkdir -p "$OUT"; KEEP=1; else OUT=$(mktemp -d); KEEP=0; fi
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill -KILL "$SERVER_PID" 2> /dev/null || true; fi
  if [ "$KEEP" = 0 ]; then rm -rf "$OUT"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM
log() { echo "serve.sh: $*" >&2; }
for tool in wrk curl awk; do
  command -v "$tool" > /dev/null || { log "needs $tool (Debian: apt-get install $tool)"; exit 1; }
done
[ -x "$KILN" ] || { log "no kiln at $KILN"; exit 1; }
# quiet LOG CMD...: runs CMD into LOG; on failure shows the end of LOG and stops.
quiet() {
  local out=$1
  shift
  "$@" > "$out" 2>&1 || { tail -n 20 "$out" >&2; log "failed: $*"; exit 1; }
}

# POSTs the bodies of a file (one per line, the argument after --) round-robin, each wrk thread
# from its own place; done() prints one line: requests, duration (us), p50, p99, p99.9 latency
# (us), non-2xx answers, socket errors and timeouts.
cat > "$OUT/infer.lua" << 'LUA'
local threads = 0
function setup(thread)
  thread:set("first", threads)
  threads = threads + 1
end
function init(args)
  reqs = {}
  local headers = {["Content-Type"] = "application/json"}
  for line in io.lines(args[1]) do
    if #line > 0 then reqs[#reqs + 1] = wrk.format("POST", nil, headers, line) end
  end
  i = (first or 0) * 7919 % #reqs + 1
end
function request()
  local r = reqs[i]
  i = i % #reqs + 1
  return r
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %.0f %.0f %.0f %d %d\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), e.status,
    e.connect + e.read + e.write + e.timeout))
end
LUA

log "training 20 steps at rows_cap $ROWS_CAP, importing the store, writing request bodies"
rm -rf "$OUT/ckpt" "$OUT/store"
quiet "$OUT/train.log" "$KILN" train "$MODEL" "${SET[@]}" --steps 20 --batch 256 --threads "$THREADS" \
  --checkpoint "$OUT/ckpt"
quiet "$OUT/import.log" "$KILN" store import "$OUT/ckpt" "$OUT/store" --model "$MODEL" "${SET[@]}"
for b in 1 256; do
  quiet "$OUT/requests.log" "$KILN" data requests "$MODEL" "${SET[@]}" --data synthetic \
    --samples "$REQ_SAMPLES" --batch "$b" -o "$OUT/requests_$b.jsonl"
done

# Raw predict: kiln predict's own rate (reading and scoring, start-up left out), at the batch the
# server computes at saturation.
log "kiln predict: $PREDICT_SAMPLES samples at batch 256"
quiet "$OUT/predict.log" "$KILN" predict "$MODEL" "${SET[@]}" --checkpoint "$OUT/ckpt" --data synthetic \
  --samples "$PREDICT_SAMPLES" --batch 256 --threads "$THREADS" -o "$OUT/scores.txt"
predict_rate=$(sed -n 's/.*s, \([0-9]*\) samples\/s).*/\1/p' "$OUT/predict.log" | tail -1)
[ -n "$predict_rate" ] || predict_rate=nan

# start_server FRACTION: starts kiln serve in the background; sets SERVER_PID, PORT and URL.
start_server() {
  local tiers=()
  if [ "$1" != 1.0 ]; then tiers=(--store "$OUT/store" --host-fraction 0.25); fi
  : > "$OUT/serve.out"
  "$KILN" serve "$MODEL" "${SET[@]}" --checkpoint "$OUT/ckpt" --port 0 --threads "$THREADS" \
    --http-threads 256 --max-queue-delay-us 2000 --cache-fraction "$1" "${tiers[@]}" > "$OUT/serve.out" 2> "$OUT/serve_$1.err" &
  SERVER_PID=$!
  PORT=""
  for _ in $(seq 1200); do
    PORT=$(sed -n 's/^listening on .*:\([0-9][0-9]*\)$/\1/p' "$OUT/serve.out")
    if [ -n "$PORT" ]; then break; fi
    kill -0 "$SERVER_PID" 2> /dev/null || { tail -n 20 "$OUT/serve_$1.err" >&2; log "kiln serve died"; exit 1; }
    sleep 0.5
  done
  [ -n "$PORT" ] || { log "kiln serve printed no 'listening on' line in 600 s"; exit 1; }
  URL="http://127.0.0.1:$PORT/v2/models/$NAME/infer"
  local code
  code=$(head -n 1 "$OUT/requests_1.jsonl" | curl -s -o "$OUT/first.json" -w '%{http_code}' \
    -H 'Content-Type: application/json' --data-binary @- "$URL")
  if [ "$code" != 200 ] || ! grep -q '"score"' "$OUT/first.json"; then
    log "the first request got $code: $(head -c 300 "$OUT/first.json")"
    exit 1
  fi
}
# stop_server: SIGTERM, and the server must drain and exit 0 within 60 s.
stop_server() {
  local rc=0
  kill -TERM "$SERVER_PID"
  for _ in $(seq 120); do kill -0 "$SERVER_PID" 2> /dev/null || break; sleep 0.5; done
  if kill -0 "$SERVER_PID" 2> /dev/null; then log "kiln serve still runs 60 s after SIGTERM"; exit 1; fi
  wait "$SERVER_PID" || rc=$?
  SERVER_PID=""
  [ "$rc" = 0 ] || { log "kiln serve exited $rc after SIGTERM"; exit 1; }
}
# run_wrk CONNECTIONS DURATION BATCH: prints "QPS p50_us p99_us p99.9_us errors" (QPS of 2xx).
run_wrk() {
  local out res
  out=$(wrk -t 1 -c "$1" -d "$2" --timeout 60s -s "$OUT/infer.lua" "$URL" -- "$OUT/requests_$3.jsonl") ||
    { log "wrk failed: $out"; return 1; }
  echo "$out" >> "$OUT/wrk.log"
  res=$(echo "$out" | awk '/^RESULT/ { printf "%.1f %s %s %s %d\n", ($2 - $7 - $8) / ($3 / 1e6), $4, $5, $6, $7 + $8 }')
  [ -n "$res" ] || { log "no RESULT line from wrk: $out"; return 1; }
  echo "$res"
}
ms() { awk -v u="$1" 'BEGIN { printf "%.2f", u / 1000 }'; }

ROWS=()
for frac in 1.0 0.2 0.05; do
  log "serving at cache fraction $frac"
  start_server "$frac"
  run_wrk 4 "$WARMUP" 256 > /dev/null
  for b in 1 256; do
    if [ "$b" = 1 ]; then sat=$SAT_CONN_1; else sat=$SAT_CONN_256; fi
    res=$(run_wrk "$sat" "$DURATION" "$b")
    read -r qps p50 p99 p999 err <<< "$res"
    [ "$err" = 0 ] || log "warning: $err failed requests at saturation (fraction $frac, batch $b)"
    best="" c=1
    while [ "$c" -lt "$sat" ]; do
      res=$(run_wrk "$c" "$STEP_DURATION" "$b")
      under=$(awk -v q="${res%% *}" -v s="$qps" 'BEGIN { print (q <= 0.8 * s) ? 1 : 0 }')
      if [ -z "$best" ] || [ "$under" = 1 ]; then best="$c $res"; fi
      [ "$under" = 1 ] || break
      c=$((c * 2))
    done
    read -r lc lqps _ lp99 _ _ <<< "$best"
    rate=$(awk -v q="$qps" -v b="$b" 'BEGIN { printf "%.0f", q * b }')
    load=$(awk -v q="$lqps" -v s="$qps" 'BEGIN { v = s > 0 ? 100 * q / s : 0; printf "%.0f", v }')
    overhead=$(awk -v r="$rate" -v p="$predict_rate" 'BEGIN { if (p == "nan" || p <= 0) print "?"; else printf "%.0f%%", 100 * (1 - r / p) }')
    ROWS+=("| $frac | $b | $qps | $rate | $(ms "$p50") / $(ms "$p99") / $(ms "$p999") | $(ms "$lp99") ($lc conn., ${load}%) | HIT | $overhead |")
  done
  hit=$(curl -s "http://127.0.0.1:$PORT/metrics" | awk '$1 == "kiln_embedding_hit_rate{tier=\"cache\"}" { printf "%.3f", $2 }')
  for k in "${!ROWS[@]}"; do ROWS[k]=${ROWS[k]/| HIT |/| ${hit:-?} |}; done
  stop_server
done

echo "DLRM-DCNv2 rows_cap=$ROWS_CAP, $THREADS thread(s), loopback; kiln predict at batch 256: $predict_rate samples/s"
echo "(fractions below 1: RocksDB store, host fraction 0.25; one run: quote medians of interleaved runs)"
echo
echo "| cache fraction | request batch | QPS | samples/s | p50 / p99 / p99.9 ms | p99 at ~80% load, ms | cache hit rate (server's run) | overhead vs predict |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${ROWS[@]}"
