"""The progress lines' losses (5 decimals) against the metrics file's, step by step."""
import json
import re
import sys

shown = {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+)/\d+ \|.*\| loss ([0-9.]+)", open(sys.argv[1]).read(), re.M)}
written = {r["step"]: "%.5f" % r["loss"] for r in map(json.loads, open(sys.argv[2]))}
if not shown or shown != written:
    print("progress lines %s differ from the metrics file %s" % (sorted(shown.items()), sorted(written.items())))
    sys.exit(1)
print("%d progress lines agree with the metrics file" % len(shown))
