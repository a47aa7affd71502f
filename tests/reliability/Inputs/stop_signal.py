#!/usr/bin/env python3
"""SIGTERM and SIGINT during `kiln train`, as a scheduler's preemption and Ctrl-C send them.

usage: stop_signal.py KILN MODEL WORKDIR

What must hold, on one rank and on two:
- one signal: the run stops after the step under way, saves that step's checkpoint, says which
  step it holds, and exits with 128 + the signal; the directory holds no temporary file, the
  checkpoint's metadata names that step, and --resume continues from it;
- two signals in a row (the second while the first one's checkpoint is being written, when it
  lands in time): the run ends at once; whatever it left, the directory holds no temporary file
  and --resume continues from a whole checkpoint.
"""
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

kiln, model, work = sys.argv[1:4]


def fail(message):
    sys.exit("FAIL: " + message)


def checkpoint_step(directory, ranks):
    if ranks > 1:
        with open(os.path.join(directory, "checkpoint.index.json")) as f:
            return int(json.load(f)["step"])
    with open(os.path.join(directory, "checkpoint.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return int(json.loads(f.read(n))["__metadata__"]["step"])


def temporaries(directory):
    return [n for n in os.listdir(directory) if ".tmp." in n]


def start(directory, ranks, rows, extra=()):
    args = [kiln, "train", model, "--set", "rows_cap=%d" % rows, "--batch", "8", "--steps", "1000000",
            "--log-every", "5", "--checkpoint", directory, "--ranks", str(ranks)] + list(extra)
    # A child of a background shell may start with SIGINT ignored; this one must see it.
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(proc, pattern, what):
    lines = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    proc.kill()
    fail("no %s line:\n%s" % (what, "".join(lines)))


def resume_continues(directory, ranks, rows, held):
    done = subprocess.run([kiln, "train", model, "--set", "rows_cap=%d" % rows, "--batch", "8", "--steps",
                           str(held + 3), "--checkpoint", directory, "--resume", "--ranks", str(ranks)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if done.returncode != 0 or "resumed from" not in done.stderr or "at step %d" % held not in done.stderr:
        fail("--resume after the stop (step %d) exited %d:\n%s" % (held, done.returncode, done.stderr))
    if checkpoint_step(directory, ranks) != held + 3:
        fail("the resumed run did not save step %d" % (held + 3))


def one_signal(sig, ranks):
    name = signal.Signals(sig).name
    directory = os.path.join(work, "%s-%d" % (name, ranks))
    proc = start(directory, ranks, rows=200)
    lines = wait_for(proc, r"^step \d+", "progress")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    err = "".join(lines) + err
    if proc.returncode != 128 + sig:
        fail("%s on %d rank(s): exit %d, not %d:\n%s" % (name, ranks, proc.returncode, 128 + sig, err))
    m = re.search(r"stopped by %s after step (\d+) of 1000000: the checkpoint in \S+ holds step (\d+)" % name, err)
    if not m or m.group(1) != m.group(2):
        fail("%s on %d rank(s): no line saying which step the checkpoint holds:\n%s" % (name, ranks, err))
    held = int(m.group(1))
    if temporaries(directory):
        fail("%s on %d rank(s) left %s" % (name, ranks, temporaries(directory)))
    if checkpoint_step(directory, ranks) != held:
        fail("%s on %d rank(s): the checkpoint holds step %d, the run said %d" %
             (name, ranks, checkpoint_step(directory, ranks), held))
    resume_continues(directory, ranks, 200, held)
    print("%s, %d rank(s): stopped at a step, its checkpoint saved, exit %d, resumed" % (name, ranks, 128 + sig))


def two_signals(ranks):
    # Tables big enough that a save takes a while: the second signal lands in it when it can.
    rows = 400000
    directory = os.path.join(work, "twice-%d" % ranks)
    proc = start(directory, ranks, rows, ["--checkpoint-every", "5"])
    lines = wait_for(proc, r"^step \d+", "progress")
    proc.send_signal(signal.SIGTERM)
    lines += wait_for(proc, r"SIGTERM: stopping after step", "stopping")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    err = "".join(lines) + err
    if proc.returncode not in (-signal.SIGTERM, 128 + signal.SIGTERM):
        fail("two SIGTERMs on %d rank(s): exit %d:\n%s" % (ranks, proc.returncode, err))
    if temporaries(directory):
        fail("two SIGTERMs on %d rank(s) left %s" % (ranks, temporaries(directory)))
    held = checkpoint_step(directory, ranks)
    resume_continues(directory, ranks, rows, held)
    how = "ended at once" if proc.returncode < 0 else "the save had finished"
    print("two SIGTERMs, %d rank(s): no temporary file left, resumed" % ranks)
    sys.stderr.write("(two SIGTERMs, %d rank(s): %s)\n" % (ranks, how))


os.makedirs(work, exist_ok=True)
one_signal(signal.SIGTERM, 1)
one_signal(signal.SIGINT, 1)
one_signal(signal.SIGTERM, 2)
two_signals(1)
two_signals(2)
