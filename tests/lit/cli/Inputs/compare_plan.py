"""Checks that the plan `kiln train --ranks N` printed is the plan.json `kiln plan -o` wrote: each
table's sharding, ranks, hot-row count and de-duplication.

usage: compare_plan.py PLAN.json TRAIN_STDERR
"""
import json
import re
import sys


def main():
    plan = json.load(open(sys.argv[1]))
    want = {}
    for t in plan["tables"]:
        want[t["table"]] = (t["sharding"], ",".join(str(r) for r in t["ranks"]), len(t.get("hot_rows", [])),
                            bool(t.get("dedup", False)))
    got = {}
    for line in open(sys.argv[2]):
        m = re.match(r"^  (\S+)\s+(\w+) ([0-9,]+)( hot (\d+))?( dedup)?$", line.rstrip("\n"))
        if m:
            got[m.group(1)] = (m.group(2), m.group(3), int(m.group(5) or 0), m.group(6) is not None)
    if got != want:
        print("plans differ:\n  kiln plan:  %s\n  kiln train: %s" % (sorted(want.items()), sorted(got.items())))
        sys.exit(1)
    print("same plan: %d tables, %d hybrid, %d de-duplicated" % (
        len(got), sum(1 for v in got.values() if v[2] > 0), sum(1 for v in got.values() if v[3])))


main()
