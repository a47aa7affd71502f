#!/bin/bash
# Makes the Python venv that the CPU benchmark's PyTorch peers (bench/peers/*.py) run in, in a
# scratch folder outside the repository, and prints the path of its python on the last line of
# stdout. Run again, it finds the venv ready and only prints that path.
#
#   bench/peer_venv.sh            # venv in ${KILN_PEER_VENV:-$HOME/.cache/kiln-peer-venv}
#   KILN_PEER_TORCH='torch==2.15.0' bench/peer_venv.sh   # pin the version
#
# torch comes from PyPI's own client. PyTorch's CPU-only index (no CUDA libraries, ~200 MB) is
# tried first when it can be reached; otherwise plain PyPI, whose Linux wheel is the CUDA build
# and pulls the nvidia-* packages (a few GB) along, though the peers never use them. pip's output
# goes to install.log in the venv; progress lines go to stderr.
set -euo pipefail
VENV=${KILN_PEER_VENV:-$HOME/.cache/kiln-peer-venv}
TORCH_SPEC=${KILN_PEER_TORCH:-torch}
CPU_INDEX=https://download.pytorch.org/whl/cpu
PY="$VENV/bin/python"
STAMP="$VENV/.kiln-peer-ready"

if [ -x "$PY" ] && [ -f "$STAMP" ]; then
  echo "$PY"
  exit 0
fi

say() { echo "peer_venv: $*" >&2; }
BASE_PY=${KILN_PEER_BASE_PYTHON:-python3}
LOG="$VENV/install.log"
t0=$(date +%s)

if [ ! -x "$PY" ]; then
  say "creating $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$BASE_PY" -m venv "$VENV"
fi
: > "$LOG"
"$PY" -m pip install --quiet --upgrade pip >> "$LOG" 2>&1 || say "pip upgrade failed (going on with the venv's pip)"

# Reachable at all? A short look at the index page, so that an unreachable host costs seconds,
# not pip's retries.
reachable() {
  "$PY" - "$1" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).read(1)
PY
}

INDEX=""
if reachable "$CPU_INDEX"; then
  say "installing $TORCH_SPEC from the CPU-only index $CPU_INDEX"
  if "$PY" -m pip install --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple \
       "$TORCH_SPEC" numpy >> "$LOG" 2>&1; then
    INDEX=$CPU_INDEX
  else
    say "the CPU-only index failed (see $LOG); trying PyPI"
  fi
else
  say "$CPU_INDEX cannot be reached; installing $TORCH_SPEC from PyPI (the CUDA build: a few GB)"
fi
if [ -z "$INDEX" ]; then
  if ! "$PY" -m pip install "$TORCH_SPEC" numpy >> "$LOG" 2>&1; then
    say "pip install failed; the end of $LOG:"
    tail -n 20 "$LOG" >&2
    exit 1
  fi
  INDEX=pypi
fi

# The peers need eager CPU math and torch.compile's C++ backend (a C++ compiler on PATH).
if ! "$PY" - >> "$LOG" 2>&1 <<'PY'; then
import torch
a = torch.randn(64, 64)
assert torch.allclose(a @ torch.eye(64), a)
print("torch", torch.__version__, "threads", torch.get_num_threads())
PY
  say "torch does not import or compute in $VENV; the end of $LOG:"
  tail -n 20 "$LOG" >&2
  exit 1
fi
version=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
size=$(du -sh "$VENV" 2>/dev/null | cut -f1)
printf 'index=%s\ntorch=%s\nsize=%s\nseconds=%s\n' "$INDEX" "$version" "$size" "$(( $(date +%s) - t0 ))" > "$STAMP"
say "torch $version from $INDEX, venv $size, $(( $(date +%s) - t0 )) s"
echo "$PY"
