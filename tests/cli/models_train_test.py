#!/usr/bin/env python3
"""End-to-end: `kiln train` one model at a tiny size on synthetic data or on a small
Criteo-format TSV file written here, and check that the loss fell.

usage: models_train_test.py KILN MODEL_FILE synthetic|tsv WORK_DIR
"""
import json
import math
import os
import random
import subprocess
import sys

STEPS = 150
BATCH = 64
# Tiny tables and, where the model has params for them, narrow embeddings.
TINY = {"dlrm": ["emb_dim=8", "top=[64, 32, 1]"],
        "dlrm_dcnv2": ["emb_dim=8", "cross_rank=16", "top=[64, 32, 1]", "hot=1"],
        "dcn": ["emb_dim=4", "cross_layers=2"],
        "deepfm": ["emb_dim=4", "deep_widths=[64, 32, 1]"],
        "wide_deep": ["deep_widths=[64, 32, 1]"],
        "shared_tables": ["emb_dim=8", "top=[64, 32, 1]"]}


def write_tsv(path, lines, seed):
    """Criteo layout: label, 13 integer features, 26 hex categorical features. The label depends
    on a few categorical values and on the first integer feature, so a model can learn it; some
    fields are left empty, as in the real data."""
    rng = random.Random(seed)
    vocab = [[rng.getrandbits(32) for _ in range(12)] for _ in range(26)]
    score = {}
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
    os.makedirs(work, exist_ok=True)
    metrics = os.path.join(work, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [kiln, "train", model_file, "--steps", str(STEPS), "--batch", str(BATCH), "--log-every", "1",
           "--metrics", metrics, "--threads", "1", "--set", "rows_cap=64"]
    for s in TINY.get(model, []):
        cmd += ["--set", s]
    if data == "tsv":
        tsv = os.path.join(work, "train.tsv")
        write_tsv(tsv, STEPS * BATCH, seed=len(model))
        cmd += ["--data", tsv]
    else:
        cmd += ["--data", "synthetic", "--seed", "3"]
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(r.stdout)
    if r.returncode != 0:
        sys.exit(f"FAIL: kiln train exited with {r.returncode}")
    with open(metrics) as f:
        losses = [json.loads(line)["loss"] for line in f if line.strip()]
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


if __name__ == "__main__":
    main()
