#!/usr/bin/env python3
"""Kills a training run with SIGKILL at random times and resumes it, again and again; the final
checkpoint must be byte-identical to that of a run never interrupted.

usage: kill9_loop.py KILN MODEL DATA WORKDIR [KILLS]

Each attempt resumes from the last checkpoint (`--checkpoint-every 1`, so a kill may land in
the middle of a save, of the lock, of compilation or of a step) and is killed after a random
delay. What must hold: every attempt starts (a killed holder's lock is taken over, its
temporary files are removed), the final checkpoint equals the reference byte for byte, and the
directory holds nothing but the checkpoint and an empty lock file.
"""
import os
import random
import shutil
import subprocess
import sys
import time

kiln, model, data, work = sys.argv[1:5]
kills_wanted = int(sys.argv[5]) if len(sys.argv) > 5 else 20
steps = 4000
common = [kiln, "train", model, "--data", data, "--batch", "8", "--steps", str(steps), "--checkpoint-every", "1",
          "--log-every", "1000000"]


def run_to_end(directory, resume):
    args = common + ["--checkpoint", directory] + (["--resume"] if resume else [])
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"FAIL: {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done


def read(path):
    with open(path, "rb") as f:
        return f.read()


os.makedirs(work, exist_ok=True)
ref_dir, run_dir = os.path.join(work, "reference"), os.path.join(work, "killed")
start = time.monotonic()
run_to_end(ref_dir, resume=False)
full_run = time.monotonic() - start
reference = read(os.path.join(ref_dir, "checkpoint.safetensors"))

rng = random.Random(12)
kills = 0
attempts = 0
takeovers = 0
chains = 1
scale = 1.0  # of the delays; halved whenever a chain finishes before its kills are done
while kills < kills_wanted:
    attempts += 1
    if attempts > 4 * kills_wanted:
        sys.exit(f"FAIL: only {kills} of {attempts} attempts were still running when killed")
    resume = os.path.exists(os.path.join(run_dir, "checkpoint.safetensors"))
    args = common + ["--checkpoint", run_dir] + (["--resume"] if resume else [])
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Kills spread over a quarter of the run's length in all, so that twenty of them land before
    # it ends even when this machine runs faster now than for the reference: early ones hit
    # start-up, later ones steps and saves.
    time.sleep(rng.uniform(0.0, scale * full_run / kills_wanted / 2))
    if proc.poll() is None:
        proc.kill()
        kills += 1
    _, err = proc.communicate()
    if proc.returncode not in (0, -9):
        sys.exit(f"FAIL: attempt {attempts} exited {proc.returncode}:\n{err}")
    takeovers += "took over the lock" in err
    if proc.returncode == 0:
        # The chain finished before its kills were done (this machine got faster than it was for
        # the reference, as when other tests stop competing for its cores): what it ended with
        # must be the reference too. The rest of the kills go to a fresh chain, sooner.
        got = read(os.path.join(run_dir, "checkpoint.safetensors"))
        if got != reference:
            sys.exit(f"FAIL: chain {chains} ended after {kills} kills with a checkpoint that differs from the "
                     f"uninterrupted run's ({len(got)} vs {len(reference)} bytes)")
        shutil.rmtree(run_dir)
        chains += 1
        scale /= 2

final = run_to_end(run_dir, resume=os.path.exists(os.path.join(run_dir, "checkpoint.safetensors")))
takeovers += "took over the lock" in final.stderr
got = read(os.path.join(run_dir, "checkpoint.safetensors"))
if got != reference:
    sys.exit(f"FAIL: after {kills} kills the final checkpoint differs from the uninterrupted run's "
             f"({len(got)} vs {len(reference)} bytes)")
left = sorted(os.listdir(run_dir))
if left != ["checkpoint.safetensors", "kiln.lock"] or os.path.getsize(os.path.join(run_dir, "kiln.lock")) != 0:
    sys.exit(f"FAIL: the checkpoint directory holds {left}")
print(f"kills: {kills}")
print(f"lock takeovers: {'some' if takeovers else 'none'}")
print("final checkpoint: identical to the uninterrupted run's")
print(f"directory: {' '.join(left)}")
