#!/usr/bin/env python3
"""End-to-end: a multi-task model (models/mmoe.kiln: `loss = [a, b]`, `loss_weights`,
`prediction = [a, b]`) trains with its loss falling and both tasks' held-out AUC rising; each
task's train loss is in the progress line and the metrics file, and the logged total is the
weighted sum of the logged task losses; `kiln eval` prints each task's loss and AUC; `kiln
predict` writes one column per task; and malformed train blocks are located errors.

usage: multitask_test.py KILN MODELS_DIR WORK_DIR
"""
import json
import math
import os
import subprocess
import sys

STEPS = 600
BATCH = 128
WEIGHTS = (1.0, 0.5)  # models/mmoe.kiln's loss_weights


def run(cmd, expect_ok=True, merge=True):
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else None, text=True)
    print(r.stdout)
    if expect_ok and r.returncode != 0:
        sys.exit(f"FAIL: exit {r.returncode}")
    return r


def fail(msg):
    sys.exit("FAIL: " + msg)


def main():
    kiln, models, work = sys.argv[1:4]
    model = os.path.join(models, "mmoe.kiln")
    os.makedirs(work, exist_ok=True)
    metrics = os.path.join(work, "metrics.jsonl")
    ckpt = os.path.join(work, "ckpt")
    if os.path.exists(metrics):
        os.remove(metrics)
    r = run([kiln, "train", model, "--steps", str(STEPS), "--batch", str(BATCH), "--log-every", "25",
             "--eval-every", "50", "--metrics", metrics, "--checkpoint", ckpt, "--threads", "1", "--seed", "3",
             "--eval-samples", "8192"])
    progress = [l for l in r.stdout.splitlines() if l.startswith("step ")]
    if not progress or "(click " not in progress[-1] or " convert " not in progress[-1]:
        fail("the progress line does not show each task's loss")
    with open(metrics) as f:
        recs = [json.loads(l) for l in f if l.strip()]
    for rec in recs:
        if "loss.click" not in rec or "loss.convert" not in rec:
            fail(f"a metrics line lacks the task losses: {rec}")
        want = WEIGHTS[0] * rec["loss.click"] + WEIGHTS[1] * rec["loss.convert"]
        if abs(rec["loss"] - want) > 1e-4 * max(1.0, abs(want)):
            fail(f"the total loss {rec['loss']} is not {WEIGHTS[0]} * click + {WEIGHTS[1]} * convert = {want}")
    losses = [rec["loss"] for rec in recs]
    k = max(3, len(losses) // 6)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"mean loss of the first {k} logs {first:.4f}, of the last {k} {last:.4f}")
    if not last < first - 0.01:
        fail("the loss did not fall")
    evals = [rec for rec in recs if "auc.click" in rec]
    if len(evals) < 3:
        fail(f"expected an evaluation every 50 steps, got {len(evals)}")
    for task in ("click", "convert"):
        a0, a1 = evals[0]["auc." + task], evals[-1]["auc." + task]
        print(f"{task}: held-out AUC {a0:.4f} at step {evals[0]['step']}, {a1:.4f} at step {evals[-1]['step']}")
        if not (math.isfinite(a1) and a1 > a0 + 0.01 and a1 > 0.6):
            fail(f"the held-out AUC of {task} did not rise above 0.6 ({a0:.4f} -> {a1:.4f})")

    ev = run([kiln, "eval", model, "--checkpoint", ckpt, "--data", "synthetic", "--samples", "4096"]).stdout
    for key in ("auc.click", "auc.convert", "loss.click", "loss.convert"):
        if f"\n{key}: " not in "\n" + ev:
            fail(f"kiln eval does not print {key}")

    pred = run([kiln, "predict", model, "--checkpoint", ckpt, "--data", "synthetic", "--samples", "64"], merge=False).stdout
    rows = [l.split("\t") for l in pred.splitlines() if l.strip()]
    if len(rows) != 64 or any(len(row) != 2 for row in rows):
        fail("kiln predict should write 64 lines of 2 columns")
    if not all(0 < float(x) < 1 for row in rows for x in row):
        fail("predictions are probabilities")

    # Malformed train blocks: located errors from check, as from train.
    src = open(model).read()
    cases = [
        (src.replace("loss_weights = [1.0, 0.5]", "loss_weights = [1.0, 0.5, 2.0]"),
         "3 loss weights for 2 losses"),
        (src.replace("loss_weights = [1.0, 0.5]", "loss_weights = [1.0, -0.5]"), "loss weights must be finite and >= 0"),
        (src.replace("prediction = [ctr, cvr]", "prediction = [ctr]"), "prediction lists 1 task(s) but the label 'labels' has 2"),
        (src.replace("prediction = [ctr, cvr]", "prediction = [ctr, expert_out]"), "a task's prediction is one f32 logit per sample"),
    ]
    for i, (text, want) in enumerate(cases):
        bad = os.path.join(work, f"bad{i}.kiln")
        with open(bad, "w") as f:
            f.write(text)
        for cmd in (["check", bad], ["train", bad, "--steps", "1"]):
            r = run([kiln] + cmd, expect_ok=False)
            if r.returncode == 0 or want not in r.stdout or f"bad{i}.kiln:" not in r.stdout:
                fail(f"kiln {cmd[0]} should fail with a located '{want}'")
    print("ok")


if __name__ == "__main__":
    main()
