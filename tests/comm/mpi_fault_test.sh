#!/bin/bash
# A lost or faulty MPI rank: runs mpi_fault_main under mpirun and checks that the job exits
# non-zero, within MAX_SECONDS, with output matching PATTERN (the rank and the collective).
# Usage: mpi_fault_test.sh MPIEXEC BINARY NP MODE PATTERN MAX_SECONDS [MPIEXEC ARGS...]
set -u
mpiexec=$1 binary=$2 np=$3 mode=$4 pattern=$5 max_seconds=$6
shift 6
start_ms=$(($(date +%s%N) / 1000000))
output=$(timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe "$@" -np "$np" "$binary" "$mode" 2>&1)
rc=$?
elapsed_ms=$(($(date +%s%N) / 1000000 - start_ms))
echo "$output"
echo "mpirun exited with $rc after ${elapsed_ms} ms"
# With orte_abort_on_non_zero_status 0, mpirun exits 0 whatever its ranks did; such a test sets
# FAULT_ANY_STATUS=1 and its pattern matches the "error:" line a rank prints before it exits 1.
if [ "$rc" -eq 0 ] && [ -z "${FAULT_ANY_STATUS:-}" ]; then echo "FAIL: the job exited 0"; exit 1; fi
if [ "$rc" -eq 124 ]; then echo "FAIL: the job hung"; exit 1; fi
if ! grep -Eq -- "$pattern" <<<"$output"; then echo "FAIL: no line matches: $pattern"; exit 1; fi
if [ "$elapsed_ms" -gt $((max_seconds * 1000)) ]; then echo "FAIL: took over ${max_seconds}s"; exit 1; fi
echo PASS
