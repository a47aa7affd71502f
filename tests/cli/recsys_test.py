#!/usr/bin/env python3
"""End-to-end: the recommendation builtins of docs/language.md through the kiln binary.

- two towers (models/two_tower.kiln), with and without the log-Q correction: in-batch softmax
  trains with the loss falling and held-out recall@10 rising well above chance, reported in the
  progress line, the metrics file, train's summary and `kiln eval`;
- running state: the item tower's batch norm statistics and the log-Q estimator's state are in
  the checkpoint, moved from their initial values, and `kiln eval` of the checkpoint scores what
  the training run's last evaluation scored;
- crosses: Wide & Deep with --set crosses=1 compiles kiln.hash_cross, trains with the loss falling;
  a cross read by a table of another size is a located error.

usage: recsys_test.py KILN MODELS_DIR WORK_DIR
"""
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys

BATCH = 128


def run(cmd, expect_ok=True):
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if expect_ok and r.returncode != 0:
        print(r.stdout)
        print(r.stderr)
        sys.exit(f"FAIL: exit {r.returncode}")
    return r


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mean(xs):
    return sum(xs) / len(xs)


def safetensors_names(path):
    """The tensor names of a safetensors file: its header is 8 bytes of length, then JSON."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return header, n + 8


def tensor_values(path, name):
    header, base = safetensors_names(path)
    entry = header[name]
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + begin)
        raw = f.read(end - begin)
    assert entry["dtype"] == "F32", entry
    return [x[0] for x in struct.iter_unpack("<f", raw)]


def two_tower(kiln, models, work, logq):
    model = os.path.join(models, "two_tower.kiln")
    ckpt = os.path.join(work, f"tt_ckpt_{logq}")
    metrics = os.path.join(work, f"tt_metrics_{logq}.jsonl")
    shutil.rmtree(ckpt, ignore_errors=True)
    if os.path.exists(metrics):
        os.remove(metrics)
    common = ["--data", "synthetic", "--batch", str(BATCH), "--threads", "1", "--seed", "3",
              "--set", "users=2000", "--set", "items=500", "--set", f"logq={logq}"]
    r = run([kiln, "train", model, "--steps", "400", "--eval-every", "100", "--eval-samples", "4096",
             "--log-every", "1", "--metrics", metrics, "--checkpoint", ckpt] + common)
    rows = read_metrics(metrics)
    losses = [m["loss"] for m in rows]
    recalls = [m["recall@10"] for m in rows if "recall@10" in m]
    print(f"two_tower logq={logq}: recall@10 at each evaluation {recalls}")
    if len(recalls) < 4:
        sys.exit(f"FAIL: expected recall@10 at each of 4 evaluations, got {recalls}")
    if not all(math.isfinite(x) for x in losses):
        sys.exit("FAIL: non-finite loss")
    k = len(losses) // 8
    print(f"loss {mean(losses[:k]):.4f} -> {mean(losses[-k:]):.4f}")
    if not mean(losses[-k:]) < mean(losses[:k]) - 0.2:
        sys.exit(f"FAIL: the loss did not fall: {mean(losses[:k]):.4f} -> {mean(losses[-k:]):.4f}")
    # Chance is 10/128 ~ 0.08: the towers must learn the hidden categories.
    if not (recalls[-1] > 0.2 and recalls[-1] > recalls[0] + 0.05):
        sys.exit(f"FAIL: recall@10 did not rise well above chance: {recalls}")
    if "| eval recall@10 " not in r.stderr:
        sys.exit("FAIL: the progress line does not show recall@10")
    m = re.search(r"^eval recall@10: ([0-9.]+)$", r.stdout, re.M)
    if not m or abs(float(m.group(1)) - recalls[-1]) > 1e-6:
        sys.exit(f"FAIL: train's summary does not end with the last recall@10 {recalls[-1]}: {r.stdout}")

    # The running statistics of batch norm and the log-Q estimator's state are in the checkpoint,
    # moved from their initial values...
    file = os.path.join(ckpt, "checkpoint.safetensors")
    header, _ = safetensors_names(file)
    bn_mean = [n for n in header if n.endswith(".running_mean")]
    bn_var = [n for n in header if n.endswith(".running_var")]
    if not bn_mean or not bn_var:
        sys.exit(f"FAIL: no batch norm running statistics in the checkpoint: {sorted(header)}")
    if all(v == 0 for v in tensor_values(file, bn_mean[0])) or all(v == 1 for v in tensor_values(file, bn_var[0])):
        sys.exit("FAIL: the running statistics never moved")
    freq = [n for n in header if n.endswith(".frequency")]
    if logq == 1:
        if not freq:
            sys.exit(f"FAIL: no frequency estimator state in the checkpoint: {sorted(header)}")
        state = tensor_values(file, freq[0])
        last, period = state[0::2], state[1::2]
        seen = [p for p in period if p > 0]
        if not seen or max(last) != 400:
            sys.exit(f"FAIL: the estimator saw no items or not up to step 400: last max {max(last)}")
        print(f"estimator: {len(seen)} of {len(period)} items seen, periods {min(seen):.2f} .. {max(seen):.1f} steps")
    elif freq:
        sys.exit("FAIL: logq=0 keeps a frequency estimator")
    # ... and kiln eval of the checkpoint (which reads them) scores what training's last
    # evaluation scored, on the same held-out samples.
    e = run([kiln, "eval", model, "--checkpoint", ckpt, "--samples", "4096"] + common)
    m = re.search(r"^recall@10: ([0-9.eE+-]+)$", e.stdout, re.M)
    if not m or abs(float(m.group(1)) - recalls[-1]) > 1e-6:
        sys.exit(f"FAIL: kiln eval's recall@10 is not the training's last {recalls[-1]}: {e.stdout}")
    return recalls[-1]


def crosses(kiln, models, work):
    model = os.path.join(models, "wide_deep.kiln")
    d = run([kiln, "dump", model, "--set", "crosses=1", "--set", "rows_cap=64", "--set", "deep_widths=[32, 1]"])
    if d.stdout.count("kiln.hash_cross") < 2:
        sys.exit("FAIL: wide_deep --set crosses=1 has no two kiln.hash_cross ops:\n" + d.stdout[:2000])
    metrics = os.path.join(work, "wd_metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run([kiln, "train", model, "--data", "synthetic", "--steps", "150", "--batch", "64", "--log-every", "1",
         "--metrics", metrics, "--threads", "1", "--seed", "3", "--set", "crosses=1", "--set", "rows_cap=64",
         "--set", "deep_widths=[64, 32, 1]"])
    losses = [m["loss"] for m in read_metrics(metrics)]
    k = len(losses) // 8
    if not mean(losses[-k:]) < mean(losses[:k]) - 0.01:
        sys.exit("FAIL: wide_deep with crosses: the loss did not fall")

    bad = os.path.join(work, "bad_cross.kiln")
    with open(bad, "w") as f:
        f.write("model bad {\n"
                "  dim B\n"
                "  input cats: ids[B, 3]\n"
                "  input label: f32[B]\n"
                "  t = embeddings(rows = 50, dim = 4)\n"
                "  logit = sum(t(cross_ids(cats[0], cats[1], buckets = 64)), axis = 1, keepdims = true)\n"
                "  output logit\n"
                "  train {\n"
                "    loss = bce_with_logits(logit, label)\n"
                "    optimizer = sgd(lr = 0.1)\n"
                "  }\n"
                "}\n")
    r = run([kiln, "check", bad], expect_ok=False)
    if r.returncode == 0 or "bad_cross.kiln:6:" not in r.stderr or "64 buckets" not in r.stderr:
        sys.exit(f"FAIL: a cross into a table of another size is not a located error: {r.stderr}")


def main():
    kiln, models, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    with_logq = two_tower(kiln, models, work, 1)
    without = two_tower(kiln, models, work, 0)
    print(f"held-out recall@10 after 400 steps: {with_logq:.4f} with the log-Q correction, {without:.4f} without")
    crosses(kiln, models, work)
    print("PASS")


if __name__ == "__main__":
    main()
