"""Runs `kiln train --ranks 2 --threads 2` under small limits on a user's processes and threads
(ulimit -u 2 to 12) and checks that each run either trains or fails with an error that names the limit:
never std::terminate (exit 134), a signal, or a hang (standard library only).

usage: thread_limit.py KILN MODEL

RLIMIT_NPROC does not bind root, so as root each run drops to the user nobody (setpriv); where
that cannot be done, or the limit binds nowhere, it prints `skipped: WHY` and exits 0. Otherwise
it prints one line per limit and `checked N limits, F failed with the message, S trained`.
"""
import os
import resource
import shutil
import subprocess
import sys

NOBODY = 65534


def main():
    kiln, model = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if not setpriv:
            print("skipped: root is not bound by ulimit -u, and there is no setpriv to drop to nobody")
            return
        # nobody must run no process of its own, or the limit counts those too.
        busy = subprocess.run(["pgrep", "-u", str(NOBODY)], capture_output=True, text=True).stdout.split()
        if busy:
            print("skipped: the user nobody runs processes %s, which ulimit -u would count" % " ".join(busy))
            return
        prefix = [setpriv, "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY, "--clear-groups", "--inh-caps=-all"]
    else:
        print("skipped: not root, so the limit would count this user's other processes")
        return
    # nobody must be able to run the binary and read the model.
    probe = subprocess.run(prefix + [kiln, "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        print("skipped: the user nobody cannot run %s: %s" % (kiln, probe.stderr.strip()[:200]))
        return
    failed = trained = 0
    bad = []
    for limit in range(2, 13):
        cmd = prefix + [kiln, "train", model, "--steps", "2", "--batch", "16", "--ranks", "2", "--threads", "2"]

        def limited(n=limit):
            resource.setrlimit(resource.RLIMIT_NPROC, (n, n))

        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/", preexec_fn=limited)
        except subprocess.TimeoutExpired:
            bad.append("ulimit -u %d: no exit within 120 s" % limit)
            continue
        err = r.stderr
        if r.returncode == 0:
            trained += 1
            print("ulimit -u %d: trained" % limit)
        elif r.returncode == 1 and "terminate called" not in err and "ulimit -u" in err:
            failed += 1
            line = next(l for l in err.splitlines() if "ulimit -u" in l)
            print("ulimit -u %d: %s" % (limit, line))
        else:
            bad.append("ulimit -u %d: exit %d:\n%s" % (limit, r.returncode, err[-2000:]))
    for b in bad:
        print("BAD " + b)
    print("checked %d limits, %d failed with the message, %d trained" % (failed + trained + len(bad), failed, trained))
    sys.exit(1 if bad else 0)


main()
