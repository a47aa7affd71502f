#!/bin/bash
# Sets up a fresh Debian machine for Kiln: installs the Debian packages the build and tests
# use, configures build/ and builds the `kiln` binary. With --deps-only, installs packages and
# stops.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake            # compiler and build
  lld                              # a faster linker for the ~80 executables (CMakeLists.txt)
  libfmt-dev                       # formatting (fmt)
  libgtest-dev libgmock-dev        # GoogleTest
  llvm-14-tools python3            # FileCheck and lit, for the IR tests
  python3-venv                     # the venv of the tritonclient test (tests/cli/serve_tritonclient_test.py)
  libdnnl-dev                      # oneDNN: the CPU GEMMs (docs/dependencies.md)
  nlohmann-json3-dev               # JSON: safetensors headers (untrusted input), metrics lines
  clang-14 libclang-rt-14-dev      # libFuzzer for the fuzz tests (tests/fuzz)
  mlir-19-tools                    # mlir-opt-19, to check our IR text parses as MLIR
  openmpi-bin libopenmpi-dev       # MPI ranks (runtime/comm) and the mpirun tests
  libcpp-httplib-dev               # HTTP for kiln serve (docs/serving.md)
  zlib1g-dev                       # kiln serve inflates gzip request bodies under a bound
  librocksdb-dev                   # the persistent tier of the serving embedding store
  wrk                              # load generator of bench/serve.sh
)

missing=()
for p in "${PACKAGES[@]}"; do
  [[ "$p" == \#* ]] && continue
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${missing[@]}"
fi
[ "${1:-}" = "--deps-only" ] && exit 0

# The `kiln` binary first, so that the main job starts within minutes on a fresh machine; the
# test command (README) builds the rest: the tests, the benchmarks, the AOT runners.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)" --target kiln
