"""`kiln calibrate`, end to end: `--quick -o FILE` writes a kiln-costs-1 table of plausible rates
(a memory rate between 0.1 GB/s and 1 TB/s, every efficiency in (0, 1], the grid's axes, the
link between machines kept from passes/costs/cpu.json), and its printed summary agrees with the
file; without -o nothing is written; bad flags are usage errors (exit 2) before anything runs.

usage: calibrate_test.py KILN SOURCE_DIR WORK_DIR
"""
import json
import os
import re
import shutil
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aot_common import fail, ok, run  # noqa: E402

ROW_BYTES = [32, 64, 128, 256, 512, 1024]
POOLING = [1, 4, 16, 64, 256]
KIB, MIB = 1024, 1024 * 1024
QUICK_MESSAGES = [KIB, 4 * KIB, 64 * KIB, MIB, 4 * MIB]


def is_efficiency(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1


def check_table(path, text_out, source_dir):
    try:
        with open(path) as f:
            t = json.load(f)
    except (OSError, ValueError) as e:
        fail("%s does not parse as JSON: %s" % (path, e), text_out)
    if t.get("format") != "kiln-costs-1":
        fail("format is %r, not kiln-costs-1" % t.get("format"))
    if t.get("target") != "cpu-calibrated":
        fail("target is %r, not the default cpu-calibrated" % t.get("target"))
    mem = t["memory"]
    if not 1e8 <= mem["device_bytes_per_s"] <= 1e12:
        fail("device_bytes_per_s %g outside [1e8, 1e12]" % mem["device_bytes_per_s"])
    if not 1e8 <= mem["host_bytes_per_s"] <= 1e12:
        fail("host_bytes_per_s %g outside [1e8, 1e12]" % mem["host_bytes_per_s"])
    if mem["pcie_bytes_per_s"] != 0:
        fail("pcie_bytes_per_s should be 0 without a GPU measured, got %g" % mem["pcie_bytes_per_s"])

    le = t["lookup_efficiency"]
    if le["row_bytes"] != ROW_BYTES or le["pooling"] != POOLING:
        fail("lookup axes %r x %r" % (le["row_bytes"], le["pooling"]))
    if len(le["values"]) != len(ROW_BYTES) or any(len(r) != len(POOLING) for r in le["values"]):
        fail("lookup values are not %dx%d: %r" % (len(ROW_BYTES), len(POOLING), le["values"]))
    for r in le["values"]:
        for v in r:
            if not is_efficiency(v):
                fail("lookup efficiency %r outside (0, 1]" % v)

    ae = t["all_to_all_efficiency"]
    if ae["message_bytes"] != QUICK_MESSAGES:
        fail("all_to_all message sizes %r, want %r" % (ae["message_bytes"], QUICK_MESSAGES))
    if len(ae["values"]) != len(QUICK_MESSAGES) or not all(is_efficiency(v) for v in ae["values"]):
        fail("all_to_all efficiencies %r" % ae["values"])
    # The link rate is the best size's rate: that size's efficiency is 1.
    if max(ae["values"]) != 1:
        fail("the best all_to_all efficiency should be 1, got %r" % ae["values"])

    intra = t["links"]["intra_node"]
    if not 1e6 <= intra["bytes_per_s"] <= 1e13:
        fail("intra_node bytes_per_s %g implausible" % intra["bytes_per_s"])
    if not 0 < intra["latency_s"] < 1:
        fail("intra_node latency_s %g implausible" % intra["latency_s"])
    with open(os.path.join(source_dir, "passes", "costs", "cpu.json")) as f:
        cpu = json.load(f)
    if t["links"]["inter_node"] != cpu["links"]["inter_node"]:
        fail("inter_node %r should be the built-in cpu table's %r" % (t["links"]["inter_node"],
                                                                      cpu["links"]["inter_node"]))
    src = t.get("source", "")
    for want in (socket.gethostname(), "--quick", "inter_node", "cpu"):
        if want not in src:
            fail("source does not mention %r: %r" % (want, src))
    return t


def main():
    kiln, source_dir, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out_path = os.path.join(work, "costs.json")

    out, err = ok([kiln, "calibrate", "--quick", "-o", out_path], timeout=120)
    for want in ("measuring memory", "measuring lookups", "measuring all_to_all", "lookup efficiency",
                 "all_to_all (2 in-process ranks)", "wrote " + out_path):
        if want not in out:
            fail("the output lacks %r" % want, out, err)
    if os.path.exists(out_path + ".tmp"):
        fail("the temporary file %s.tmp was left behind" % out_path)
    t = check_table(out_path, out, source_dir)

    # The summary prints the file's figures.
    m = re.search(r"^memory: ([0-9.]+) GB/s", out, re.M)
    if not m or abs(float(m.group(1)) - t["memory"]["device_bytes_per_s"] / 1e9) > 0.006:
        fail("the summary's memory rate disagrees with the file's %g" % t["memory"]["device_bytes_per_s"], out)
    for rb, row in zip(ROW_BYTES, t["lookup_efficiency"]["values"]):
        line = re.search(r"^ *%d((?: +[0-9.]+){%d})$" % (rb, len(POOLING)), out, re.M)
        if not line:
            fail("no lookup row for %d bytes in the summary" % rb, out)
        printed = [float(x) for x in line.group(1).split()]
        if any(abs(a - b) > 0.0006 for a, b in zip(printed, row)):
            fail("lookup row %d: printed %r, written %r" % (rb, printed, row), out)

    # Without -o: the summary, and nothing written. --name and --threads are taken.
    before = sorted(os.listdir(work))
    out, err = ok([kiln, "calibrate", "--quick", "--threads", "1", "--name", "box"], timeout=120, cwd=work)
    if "nothing written" not in out:
        fail("without -o the output should say nothing was written", out, err)
    if "wrote" in out or sorted(os.listdir(work)) != before:
        fail("without -o a file was written", out, err)
    if "copy of 64 MiB on 1 thread," not in out:
        fail("--threads 1 not used", out)

    # Usage errors: exit 2, a message naming the flag, before any measurement.
    for args, pattern in ((["--bogus"], r"bogus"),
                          (["--ranks", "1"], r"--ranks"),
                          (["--threads", "0"], r"--threads"),
                          (["--threads", "many"], r"threads"),
                          (["--name", ""], r"--name"),
                          (["--device", "tpu"], r"--device must be cpu or cuda"),
                          (["-o", os.path.join(work, "no", "such", "dir", "c.json")], r"cannot write"),
                          (["extra_positional"], r"error")):
        rc, o, e = run([kiln, "calibrate", "--quick"] + args, timeout=60)
        if rc != 2:
            fail("kiln calibrate %s: exit %d, want 2 (a usage error)" % (" ".join(args), rc), o, e)
        if not re.search(pattern, e):
            fail("kiln calibrate %s: no message matching %r" % (" ".join(args), pattern), o, e)
        if "measuring" in o:
            fail("kiln calibrate %s measured before refusing its flags" % " ".join(args), o)
    # --device cuda: without a GPU, a clear error (exit 1) and nothing written; with one, GPU 0's
    # table (the gpu tests check its rates).
    gpu_out = os.path.join(work, "gpu.json")
    rc, o, e = run([kiln, "calibrate", "--quick", "--device", "cuda", "-o", gpu_out], timeout=600)
    if rc == 0:
        with open(gpu_out) as f:
            t = json.load(f)
        if not t["target"].endswith("-calibrated") or "--device cuda" not in t["source"]:
            fail("--device cuda wrote %r / %r" % (t["target"], t["source"][:80]), o, e)
        if not 1e10 <= t["memory"]["device_bytes_per_s"] <= 1e13:
            fail("GPU device_bytes_per_s %g outside [1e10, 1e13]" % t["memory"]["device_bytes_per_s"], o)
        if not all(is_efficiency(v) for r in t["lookup_efficiency"]["values"] for v in r):
            fail("GPU lookup efficiencies %r" % t["lookup_efficiency"]["values"], o)
    elif rc != 1 or "no CUDA GPU to calibrate" not in e or os.path.exists(gpu_out):
        fail("kiln calibrate --device cuda without a GPU: exit %d, want 1 with a reason and no file" % rc, o, e)
    print("PASS")


if __name__ == "__main__":
    main()
