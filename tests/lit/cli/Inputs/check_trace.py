"""Checks a `kiln train --trace` file against the run's `--profile` table (standard library only).

usage: check_trace.py TRACE.json PROFILE_OUTPUT FIRST LAST [RANKS]

The file must parse as a Chrome trace ({"traceEvents": [...]}); every track with events must be
named by an "M" event; the host's step events must be exactly steps FIRST..LAST; every other event
must fall inside those steps; and the kernel/GEMM event names must be the op names --profile printed.
With RANKS (kiln train --ranks N), all of that holds for every rank's own tracks (pid = rank): rank 0
prints the profile, and every rank of a symmetric plan runs the same op kinds.
"""
import json
import re
import sys


def fail(message):
    print("check_trace: " + message)
    sys.exit(1)


def main():
    trace_path, profile_path, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ranks = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    with open(trace_path) as f:
        doc = json.load(f)
    all_events = doc["traceEvents"]
    pids = sorted({e["pid"] for e in all_events if e["ph"] == "X"})
    if pids != list(range(ranks)):
        fail("events of ranks %r, want ranks 0 to %d" % (pids, ranks - 1))
    for rank in range(ranks):
        check_rank([e for e in all_events if e["pid"] == rank], profile_path, first, last)


def check_rank(events, profile_path, first, last):
    complete = [e for e in events if e["ph"] == "X"]
    named_threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    named_processes = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    for e in complete:
        for key in ("name", "cat", "ts", "dur", "pid", "tid"):
            if key not in e:
                fail("event without '%s': %r" % (key, e))
        if (e["pid"], e["tid"]) not in named_threads:
            fail("track pid %d tid %d has no thread_name" % (e["pid"], e["tid"]))
        if e["pid"] not in named_processes:
            fail("rank %d has no process_name" % e["pid"])

    steps = [e for e in complete if e["cat"] == "host" and e["name"].startswith("step ")]
    numbers = sorted(e["args"]["step"] for e in steps)
    if numbers != list(range(first, last + 1)):
        fail("step events %r, want steps %d to %d" % (numbers, first, last))
    for e in complete:
        if "step" in e.get("args", {}) and not first <= e["args"]["step"] <= last:
            fail("%s of step %d lies outside the window" % (e["name"], e["args"]["step"]))
    begin = min(e["ts"] for e in complete if e["tid"] == 0)
    end = max(e["ts"] + e["dur"] for e in complete if e["tid"] == 0)
    ops = [e for e in complete if e["cat"] in ("kernel", "gemm")]
    if not ops:
        fail("no kernel or gemm events")
    for e in ops:
        if e["ts"] < begin or e["ts"] + e["dur"] > end:
            fail("%s at %f is outside the traced steps [%f, %f]" % (e["name"], e["ts"], begin, end))
        if (e["cat"] == "gemm") != (e["name"] == "kiln.matmul"):
            fail("%s has category %s" % (e["name"], e["cat"]))

    with open(profile_path) as f:
        profiled = set(re.findall(r"^  (kiln\.\w+) ", f.read(), re.M))
    traced = {e["name"] for e in ops}
    if traced != profiled:
        fail("traced ops %s differ from the profiled ops %s" % (sorted(traced), sorted(profiled)))
    print("trace ok: %d events, steps %d-%d, %d op kinds" % (len(complete), first, last, len(traced)))


main()
