#!/usr/bin/env python3
"""`mpirun -np N kiln train` against one rank, and a rank killed mid-run.

Usage: train_mpi_test.py MPIEXEC KILN MODEL MODE N [FLAG...]
  same  N MPI ranks (automatic plan, then every table row_wise) log the loss trajectory of one
        rank, and eval AUC and loss equal one rank's.
  ep    a MoE model on N MPI ranks at --ep 1, --ep N (and --ep 2 for N = 4): each logs the loss
        trajectory of one rank, the final train loss within its last printed digit.
  kill  rank 1 of N is killed (SIGKILL) after the first checkpoint: the survivors exit non-zero
        within the comm timeout, naming the lost rank, and the last complete checkpoint loads.
The FLAGs go to every `kiln train` (e.g. `--ep 2`, `--set d=32`); its `--set`s to `kiln eval` too.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

MPIEXEC, KILN, MODEL, MODE, N = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
FLAGS = sys.argv[6:]
MPI = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np", str(N)]
TRAIN = ["train", MODEL, "--batch", "48", "--threads", "1"] + FLAGS
# The model's sizes, which a checkpoint's evaluation needs as well.
SETS = [a for i, a in enumerate(FLAGS) if a == "--set" or (i > 0 and FLAGS[i - 1] == "--set")]


def run(cmd, timeout=300):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout


def losses(text):
    return re.findall(r"\| loss ([0-9.]+)", text)


def results(text):
    return {k: v for k, v in re.findall(r"^(final train loss|eval loss|eval auc): ([0-9.]+)$", text, re.M)}


def fail(message, output=""):
    print(output)
    print("FAIL:", message)
    sys.exit(1)


def same():
    flags = ["--steps", "20", "--log-every", "5", "--eval-every", "10", "--eval-samples", "1024"]
    rc, one = run([KILN] + TRAIN + flags)
    if rc != 0:
        fail("the single-rank run failed", one)
    for extra in ([], ["--sharding", "row_wise"], ["--sharding", "table_wise"]):
        rc, many = run(MPI + [KILN] + TRAIN + flags + extra)
        if rc != 0:
            fail("mpirun -np %d %s failed" % (N, " ".join(extra)), many)
        if losses(many) != losses(one) or results(many) != results(one):
            fail("N = %d %s differs from one rank:\n%s\n--- one rank:\n%s" % (N, extra, many, one))
        if many.count("trained ") != 1:
            fail("more than rank 0 printed", many)
        print("same as one rank on %d MPI ranks %s: %s" % (N, " ".join(extra) or "(automatic plan)", results(many)))


def final_loss(text):
    m = re.search(r"^final train loss: ([0-9.]+)$", text, re.M)
    return float(m.group(1)) if m else None


def ep():
    """Expert parallelism: the experts spread over groups of the MPI ranks compute what one rank
    computes. Sums over ranks go in another order, so the six-digit final loss may differ by one
    in its last place; the five-digit progress losses must not."""
    flags = ["--steps", "20", "--log-every", "5"]
    rc, one = run([KILN] + TRAIN + flags)
    if rc != 0:
        fail("the single-rank run failed", one)
    for size in sorted({1, 2, N} if N % 2 == 0 else {1, N}):
        rc, many = run(MPI + [KILN] + TRAIN + flags + ["--ep", str(size)])
        if rc != 0:
            fail("mpirun -np %d --ep %d failed" % (N, size), many)
        a, b = final_loss(many), final_loss(one)
        if losses(many) != losses(one) or a is None or b is None or abs(a - b) > 1.5e-6:
            fail("N = %d --ep %d differs from one rank:\n%s\n--- one rank:\n%s" % (N, size, many, one))
        if many.count("trained ") != 1:
            fail("more than rank 0 printed", many)
        if size > 1 and "ep max/mean" not in many:
            fail("the progress line lacks the EP ranks' balance", many)
        print("same as one rank on %d MPI ranks at --ep %d: %s" % (N, size, losses(many)))


def rank_pids(launcher):
    """The kiln processes mpirun started, by MPI rank."""
    pids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/environ" % pid, "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            with open("/proc/%s/stat" % pid) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == launcher and b"OMPI_COMM_WORLD_RANK" in env:
            pids[int(env[b"OMPI_COMM_WORLD_RANK"])] = int(pid)
    return pids


def kill():
    timeout = 5
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        # The launcher must not end the job itself when a rank dies: the survivors notice.
        cmd = MPI[:1] + ["--mca", "orte_abort_on_non_zero_status", "0"] + MPI[1:] + [KILN] + TRAIN + [
            "--steps", "100000", "--checkpoint", ckpt, "--checkpoint-every", "5", "--comm-timeout", str(timeout),
            "--sharding", "row_wise"]
        log_path = os.path.join(d, "log")
        log = open(log_path, "w")
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        output = lambda: open(log_path).read()
        index = os.path.join(ckpt, "checkpoint.index.json")
        deadline = time.time() + 120
        while not os.path.exists(index) and time.time() < deadline and job.poll() is None:
            time.sleep(0.1)
        pids = rank_pids(job.pid)
        if not os.path.exists(index) or 1 not in pids:
            job.kill()
            fail("no checkpoint or no rank 1 to kill (ranks %s)" % pids, output())
        killed = time.time()
        os.kill(pids[1], signal.SIGKILL)
        # The survivors must exit on their own. (OpenMPI 4.1's mpirun told not to abort may then
        # linger after its last rank is gone: it is ended here.)
        survivors = [pid for rank, pid in pids.items() if rank != 1]
        while any(os.path.exists("/proc/%d" % p) and open("/proc/%d/stat" % p).read().split()[2] != "Z"
                  for p in survivors) and time.time() < killed + timeout * 6 + 20:
            time.sleep(0.1)
        took = time.time() - killed
        job.kill()
        job.wait()
        log.close()
        text = output()
        if took >= timeout * 6 + 20:
            fail("the survivors hung", text)
        # Each survivor names the rank that does not answer.
        for rank in pids:
            if rank != 1 and not re.search(r"rank %d: error: .*rank 1 did not arrive" % rank, text):
                fail("rank %d did not name rank 1" % rank, text)
        rc, ev = run([KILN, "eval", MODEL, "--checkpoint", ckpt, "--data", "synthetic"] + SETS)
        # A classifier reports its AUC, a language model its perplexity.
        if rc != 0 or ("auc" not in ev and "perplexity" not in ev):
            fail("the last checkpoint does not load", ev)
        print(text)
        print("survivors stopped %.1f s after rank 1 was killed; the last checkpoint loads" % took)


{"same": same, "ep": ep, "kill": kill}[MODE]()
print("PASS")
