#!/usr/bin/env python3
"""End-to-end: `kiln train` one model at a tiny size on synthetic data or on a small
Criteo-format TSV file written here, and check that the loss fell and that the held-out AUC
(`--eval-every`: synthetic data's held-out stream, or a second TSV file of the same hidden task)
rose.

usage: models_train_test.py KILN MODEL_FILE synthetic|tsv WORK_DIR
"""
import json
import math
import os
import random
import subprocess
import sys

STEPS = 150
# The sequence models learn the synthetic sequence task more slowly: after 150 steps BST's
# held-out AUC is at times within noise of its first evaluation.
STEPS_FOR = {"din": 300, "bst": 300}
BATCH = 64
EVAL_EVERY = 25
EVAL_SAMPLES = 8192
# The last evaluation's AUC must beat the first one's (at step EVAL_EVERY) by this much. Measured
# with seeds 1, 2, 3, 5, 7 and 11 (of the synthetic data, or added to the TSV's), the smallest
# rise was BST's 0.032 (of 0.032 to 0.064), then DLRM on TSV's 0.047; at most 15 s a run.
AUC_RISE = 0.015
# Tiny tables and, where the model has params for them, narrow embeddings.
TINY = {"dlrm": ["emb_dim=8", "top=[64, 32, 1]"],
        "dlrm_dcnv2": ["emb_dim=8", "cross_rank=16", "top=[64, 32, 1]", "hot=1"],
        "dcn": ["emb_dim=4", "cross_layers=2"],
        "deepfm": ["emb_dim=4", "deep_widths=[64, 32, 1]"],
        "wide_deep": ["deep_widths=[64, 32, 1]"],
        "shared_tables": ["emb_dim=8", "top=[64, 32, 1]"]}


def write_tsv(files, seed):
    """Criteo layout: label, 13 integer features, 26 hex categorical features. The label depends
    on a few categorical values and on the first integer feature, so a model can learn it; some
    fields are left empty, as in the real data. `files` is [(path, lines), ...]: one hidden task,
    different samples in each file (a training file and a held-out one)."""
    rng = random.Random(seed)
    vocab = [[rng.getrandbits(32) for _ in range(12)] for _ in range(26)]
    score = {}
    for path, lines in files:
        write_tsv_lines(path, lines, rng, vocab, score)


def write_tsv_lines(path, lines, rng, vocab, score):
    with open(path, "w") as f:
        for _ in range(lines):
            ints = [str(rng.randrange(0, 200)) if rng.random() > 0.1 else "" for _ in range(13)]
            cats = [rng.choice(vocab[j]) if rng.random() > 0.05 else None for j in range(26)]
            z = 0.0
            for j in range(4):
                if cats[j] is not None:
                    z += score.setdefault((j, cats[j]), rng.gauss(0, 1.5))
            z += 0.8 * (math.log1p(int(ints[0])) - 2.5) if ints[0] else 0.0
            label = 1 if rng.random() < 1 / (1 + math.exp(-z)) else 0
            hexes = ["%08x" % c if c is not None else "" for c in cats]
            f.write("\t".join([str(label)] + ints + hexes) + "\n")


def main():
    kiln, model_file, data, work = sys.argv[1:5]
    model = os.path.splitext(os.path.basename(model_file))[0]
    steps = STEPS_FOR.get(model, STEPS)
    os.makedirs(work, exist_ok=True)
    metrics = os.path.join(work, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [kiln, "train", model_file, "--steps", str(steps), "--batch", str(BATCH), "--log-every", "1",
           "--metrics", metrics, "--threads", "1", "--set", "rows_cap=64"]
    for s in TINY.get(model, []):
        cmd += ["--set", s]
    if data == "tsv":
        tsv, held_out = os.path.join(work, "train.tsv"), os.path.join(work, "eval.tsv")
        write_tsv([(tsv, steps * BATCH), (held_out, EVAL_SAMPLES)], seed=len(model))
        cmd += ["--data", tsv, "--eval-data", held_out]
    else:
        cmd += ["--data", "synthetic", "--seed", "3", "--eval-samples", str(EVAL_SAMPLES)]
    cmd += ["--eval-every", str(EVAL_EVERY)]
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(r.stdout)
    if r.returncode != 0:
        sys.exit(f"FAIL: kiln train exited with {r.returncode}")
    with open(metrics) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    losses = [rec["loss"] for rec in recs]
    if len(losses) < 10:
        sys.exit(f"FAIL: expected a loss per step, got {len(losses)} lines")
    if not all(math.isfinite(x) for x in losses):
        sys.exit(f"FAIL: non-finite loss: {losses}")
    # Per-batch losses are noisy: compare the means of the first and last eighth.
    k = max(3, len(losses) // 8)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"{model} on {data}: mean loss of the first {k} steps {first:.4f}, of the last {k} {last:.4f}")
    if not last < first - 0.01:
        sys.exit("FAIL: the loss did not fall")
    check_auc_rose(model, data, steps, [rec for rec in recs if "eval_loss" in rec])


def check_auc_rose(model, data, steps, evals):
    """A model with a prediction has an AUC per evaluation (`auc`, or `auc.<task>` for each task
    of a multi-task model): the last must beat the first by AUC_RISE."""
    if len(evals) < steps // EVAL_EVERY:
        sys.exit(f"FAIL: expected an evaluation every {EVAL_EVERY} steps, got {len(evals)}")
    keys = sorted(k for k in evals[-1] if k == "auc" or k.startswith("auc."))
    if not keys:
        print(f"{model} on {data}: no prediction, no AUC to check")
        return
    for key in keys:
        a0, a1 = evals[0].get(key, math.nan), evals[-1][key]
        print(f"{model} on {data}: held-out {key} {a0:.4f} at step {evals[0]['step']}, "
              f"{a1:.4f} at step {evals[-1]['step']} (rise {a1 - a0:+.4f}, needed {AUC_RISE})")
        if not (math.isfinite(a0) and math.isfinite(a1) and a1 > a0 + AUC_RISE):
            sys.exit(f"FAIL: the held-out {key} did not rise by {AUC_RISE}")


if __name__ == "__main__":
    main()
