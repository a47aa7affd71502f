#!/usr/bin/env bash
# Workload R1 on the GPU: Kiln (bench/r1_bench) and the PyTorch peer (dlrm_torch.py: eager and
# torch.compile, bf16 autocast) in the same run on the same GPU, then one table.
#   bench/r1_gpu.sh [BUILD_DIR]        (default build-gpu; logs under $OUT or /tmp)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
LOG=${OUT:-/tmp}/r1
mkdir -p "$LOG"
PEER=.device/dlrm_torch.py
[ -f "$PEER" ] || PEER=../shared/bench/dlrm_torch.py

if [ ! -x "$BUILD/bench/r1_bench" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$LOG/cmake.log" 2>&1 &&
    cmake --build "$BUILD" -j"$(nproc)" --target r1_bench >"$LOG/build.log" 2>&1 ||
    { echo "r1_gpu: building r1_bench failed, see $LOG/build.log"; tail -20 "$LOG/build.log"; exit 1; }
fi

echo "== kiln (log: $LOG/kiln.log)"
timeout 150 "$BUILD/bench/r1_bench" --rows-cap 1000000 --batch 16384 --steps 20 >"$LOG/kiln.log" 2>&1
echo "   exit $?"; tail -15 "$LOG/kiln.log"
echo "== kiln without fusion (log: $LOG/kiln_nofusion.log)"
timeout 120 "$BUILD/bench/r1_bench" --rows-cap 1000000 --batch 16384 --steps 20 --disable-pass fusion >"$LOG/kiln_nofusion.log" 2>&1
echo "   exit $?"; grep KILN "$LOG/kiln_nofusion.log"; cat "$LOG/kiln_nofusion.log" >>"$LOG/kiln.log"
echo "== kiln f32 GEMMs (log: $LOG/kiln_f32.log)"
timeout 120 "$BUILD/bench/r1_bench" --rows-cap 1000000 --batch 16384 --steps 20 --precision f32 >"$LOG/kiln_f32.log" 2>&1
echo "   exit $?"; grep KILN "$LOG/kiln_f32.log"; cat "$LOG/kiln_f32.log" >>"$LOG/kiln.log"
echo "== pytorch peer $PEER (log: $LOG/torch.log)"
if [ -f "$PEER" ]; then
  CAP=1000000 B=16384 timeout 240 python3 "$PEER" >"$LOG/torch.log" 2>&1
  echo "   exit $?"; grep -E "RESULT|FAILED|torch" "$LOG/torch.log" | tail -5
else
  echo "   no peer script (copy ../shared/bench/dlrm_torch.py into .device/)" | tee "$LOG/torch.log"
fi

python3 - "$LOG/kiln.log" "$LOG/torch.log" <<'PY'
import json, sys
def results(path, tag):
    out = []
    for line in open(path, errors="replace"):
        if line.startswith(tag + " "):
            try: out.append(json.loads(line[len(tag) + 1:]))
            except ValueError: pass
    return out
k = results(sys.argv[1], "KILN")
t = results(sys.argv[2], "RESULT")
eager = next((r for r in t if not r["compiled"] and r["amp"]), None)
comp = next((r for r in t if r["compiled"] and r["amp"]), None)
FLOOR, BW, PEAK = 3.3, 4.3, 786.0
print("\nR1: DLRM-DCNv2, rows_cap 1000000, batch 16384, SGD, one GPU")
print("| run | ms/step | samples/s | vs eager | vs torch.compile | floor/ms |")
print("| --- | --- | --- | --- | --- | --- |")
def row(name, ms):
    e = f"{eager['ms_per_step'] / ms:.2f}x" if eager else "-"
    c = f"{comp['ms_per_step'] / ms:.2f}x" if comp else "-"
    print(f"| {name} | {ms:.2f} | {16384 / ms * 1e3 / 1e6:.2f} M | {e} | {c} | {FLOOR / ms:.0%} |")
for r in k: row(f"kiln {r.get('precision', 'f32')}, CUDA graph, fusion {'on' if r.get('fusion', True) else 'off'}", r["ms_per_step"])
if k and "ms_per_step_serial" in k[0]: row(f"kiln {k[0].get('precision', 'f32')}, inputs uploaded in series (run())", k[0]["ms_per_step_serial"])
if not k: print("| kiln | FAILED (see kiln.log) | | | | |")
for r in t: row(f"pytorch {'compile' if r['compiled'] else 'eager'} {'bf16' if r['amp'] else 'fp32'}", r["ms_per_step"])
if k:
    p = k[0]
    print(f"\nkiln profile (eager launches, ms): gemm {p['profile_ms']['gemm']:.2f}, embedding fwd {p['profile_ms']['emb_fwd']:.2f}, "
          f"embedding bwd+update {p['profile_ms']['emb_bwd']:.2f}, other {p['profile_ms']['other']:.2f}; "
          f"{p['kernels']} kernels + {p['gemms']} GEMMs")
    print(f"embedding fwd {p['emb_fwd_tbps']:.2f} TB/s = {p['emb_fwd_tbps'] / BW:.0%} of {BW} TB/s; "
          f"bwd {p['emb_bwd_tbps']:.2f} TB/s = {p['emb_bwd_tbps'] / BW:.0%}; "
          f"GEMM {p['gemm_tflops']:.0f} TFLOP/s = {p['gemm_tflops'] / PEAK:.0%} of {PEAK:.0f}")
    print(f"loss {p['loss_first']:.4f} -> {p['loss_last']:.4f}; setup {p['setup_s']:.0f} s; {p['device']}")
PY
