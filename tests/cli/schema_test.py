"""Schemas (issue 17): a user's TSV with 3 labels, 20 dense, 40 categorical and two list columns
trains with no code change, evaluates per task, predicts one column per task, reads the same as
CSV; bad lines are located errors, and `kiln check --data` and `kiln train` agree on a file.

usage: schema_test.py KILN MODEL.kiln"""
import math
import os
import random
import sys
import tempfile

from aot_common import fail, ok, refused, run

KILN, MODEL = sys.argv[1], sys.argv[2]
COLUMNS = (["click", "like", "share"] + ["d%d" % i for i in range(20)] + ["c%d" % i for i in range(40)] +
           ["history", "tags"])


def write(path, n, seed, sep="\t"):
    """n samples whose labels depend on dense columns, categorical ids and the history list (an
    independent hidden model: each task its own)."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        f.write(sep.join(COLUMNS) + "\n")
        for _ in range(n):
            d = [rnd.gauss(0, 1) for _ in range(20)]
            c = [rnd.randrange(60) for _ in range(40)]
            hist = [rnd.randrange(200) for _ in range(rnd.randrange(0, 9))]
            tags = [rnd.randrange(200) for _ in range(rnd.randrange(1, 5))]
            ys = []
            for t in range(3):
                z = 1.5 * d[t] - 1.0 * d[t + 5] + (1.5 if c[t] % 3 == 0 else -0.75)
                z += 1.0 if any(h % 4 == t for h in hist) else -0.5
                ys.append(1 if rnd.random() < 1 / (1 + math.exp(-z)) else 0)
            lists = [",".join(map(str, hist)), ",".join(map(str, tags))]
            if sep == ",":
                lists = ['"%s"' % l for l in lists]
            f.write(sep.join([str(y) for y in ys] + ["%.5f" % v for v in d] + [str(v) for v in c] + lists) + "\n")


with tempfile.TemporaryDirectory() as tmp:
    train, held = os.path.join(tmp, "train.tsv"), os.path.join(tmp, "held.tsv")
    write(train, 20000, 1)
    write(held, 2000, 2)
    out, _ = ok([KILN, "check", MODEL, "--data", train])
    if "data ok (1000 samples read)" not in out:
        fail("check --data", out)

    ck = os.path.join(tmp, "ck")
    out, err = ok([KILN, "train", MODEL, "--data", train, "--batch", "128", "--epochs", "4", "--checkpoint", ck,
                   "--eval-data", held, "--eval-every", "250", "--metrics", os.path.join(tmp, "m.jsonl")])
    if "eval auc click" not in out + err:
        fail("the progress line shows no per-task AUC", out, err)
    out, _ = ok([KILN, "eval", MODEL, "--checkpoint", ck, "--data", held])
    got = dict(l.split(": ") for l in out.strip().splitlines())
    print(out)
    for task in ["click", "like", "share"]:
        auc = float(got["auc." + task])
        if not 0.72 < auc < 1.0:
            fail("held-out AUC of %s is %.4f, expected above 0.72" % (task, auc), out)
    if got["samples"] != "2000":
        fail("eval read %s samples" % got["samples"], out)
    with open(os.path.join(tmp, "m.jsonl")) as f:
        if '"auc.share"' not in f.read():
            fail("the metrics file has no per-task AUC")

    # predict: one line per sample, three tab-separated probabilities.
    pred = os.path.join(tmp, "p.tsv")
    ok([KILN, "predict", MODEL, "--checkpoint", ck, "--data", held, "-o", pred])
    lines = open(pred).read().splitlines()
    if len(lines) != 2000 or any(len(l.split("\t")) != 3 for l in lines):
        fail("predict wrote %d lines, the first %r" % (len(lines), lines[:1]))

    # The same samples as CSV (quoted lists) evaluate exactly the same.
    csv = os.path.join(tmp, "held.csv")
    write(csv, 2000, 2, sep=",")
    out_csv, _ = ok([KILN, "eval", MODEL, "--checkpoint", ck, "--data", csv])
    if out_csv != out:
        fail("CSV and TSV of the same samples evaluate differently", out, out_csv)

    # Bad lines: located (file:line:col), skipped and counted, or fatal with --strict.
    bad = os.path.join(tmp, "bad.tsv")
    rows = open(held).read().splitlines()
    r2 = rows[2].split("\t"); r2[1] = "2"
    r3 = rows[3].split("\t"); r3[-2] = ",".join(["1"] * 9)
    with open(bad, "w") as f:
        f.write("\n".join([rows[0], rows[1], "\t".join(r2), "\t".join(r3)] + rows[4:50]) + "\n")
    refused([KILN, "check", MODEL, "--data", bad],
            r"bad.tsv:3:\d+: error: label 'like' of input 'labels' must be 0 or 1, got '2'")
    refused([KILN, "check", MODEL, "--data", bad],
            r"bad.tsv:4:\d+: error: categorical column 'history' of input 'lists.0' holds more than its bound of 8")
    refused([KILN, "train", MODEL, "--data", bad, "--strict", "--steps", "2"], r"bad.tsv:3:\d+: error: label 'like'")
    nohead = os.path.join(tmp, "nohead.tsv")
    with open(nohead, "w") as f:
        f.write("\n".join(rows[1:10]) + "\n")
    refused([KILN, "check", MODEL, "--data", nohead], r"nohead.tsv:1:1: error: the header line has no column 'click'")

    # A model without columns(...) reads the Criteo layout: 20 dense columns are refused by check
    # --data and by train alike, with the same message.
    wide = os.path.join(tmp, "wide.kiln")
    with open(wide, "w") as f:
        f.write("model wide {\n  dim B\n  input dense: f32[B, 20]\n  input label: f32[B]\n"
                "  logit = mlp(dense, [8, 1], last = identity)\n  output logit\n"
                "  train {\n    loss = bce_with_logits(logit, label)\n    optimizer = sgd(lr = 0.1)\n  }\n}\n")
    message = r"input 'dense': reads 20 dense features, but the Criteo layout has 13"
    refused([KILN, "check", wide, "--data", train], message)
    refused([KILN, "train", wide, "--data", train, "--steps", "1"], message)
    ok([KILN, "train", wide, "--steps", "3"])  # synthetic data makes any number of dense features
print("PASS")
