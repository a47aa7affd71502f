"""Runs kiln commands under small address-space limits (ulimit -v, 100 to 400 MB) and checks that
each one ends within 20 s (a BLAS that retried a failed allocation forever once spun at 100% CPU
here; oneDNN, failing to allocate inside a kernel's creation, crashed or hung) with exit 0, or
exit 1 and a message about memory: never a signal or a hang (standard library only).

usage: address_space.py KILN MODEL_DIR

Prints one line per run and `checked N runs, F failed with the message, S succeeded`.
"""
import resource
import subprocess
import sys
import time


def main():
    kiln, models = sys.argv[1], sys.argv[2]
    model = models + "/dlrm_dcnv2.kiln"
    commands = [
        ["version"],
        ["check", model],
        ["train", model, "--set", "rows_cap=1000", "--steps", "2", "--threads", "1"],
        ["train", model, "--set", "rows_cap=1000", "--steps", "2", "--threads", "2"],
        ["train", model, "--set", "rows_cap=1000", "--steps", "2", "--threads", "4"],
    ]
    bad, failed, succeeded = [], 0, 0
    for kb in range(100000, 400001, 50000):
        for args in commands:

            def limited(n=kb * 1024):
                resource.setrlimit(resource.RLIMIT_AS, (n, n))

            what = "ulimit -v %d: kiln %s" % (kb, " ".join(a if "/" not in a else a.rsplit("/", 1)[1] for a in args))
            t0 = time.monotonic()
            try:
                r = subprocess.run([kiln] + args, capture_output=True, text=True, timeout=20, preexec_fn=limited)
            except subprocess.TimeoutExpired:
                bad.append("%s: still running after 20 s" % what)
                continue
            seconds = time.monotonic() - t0
            err = r.stderr
            if r.returncode == 0:
                succeeded += 1
                print("%s: ok (%.1f s)" % (what, seconds))
            elif r.returncode == 1 and ("not enough memory" in err or "out of memory" in err):
                failed += 1
                line = next(l for l in err.splitlines() if "memory" in l)
                print("%s: %s" % (what, line[:200]))
            else:
                bad.append("%s: exit %d:\n%s" % (what, r.returncode, err[-1500:]))
    for b in bad:
        print("BAD " + b)
    print("checked %d runs, %d failed with the message, %d succeeded" % (failed + succeeded + len(bad), failed,
                                                                       succeeded))
    sys.exit(1 if bad else 0)


main()
