#!/usr/bin/env python3
"""bf16 training on the CPU keeps the model's accuracy: DLRM-DCNv2 on Criteo-like synthetic data,
trained 2000 steps with `--precision bf16` (GEMM operands and results in bf16, f32 accumulation,
f32 master weights) and with f32 from the same seed, reaches a held-out AUC within MAX_GAP of
f32's. The model is models/dlrm_dcnv2.kiln at a width 2 cores train in seconds (narrow
embeddings, a small top MLP; the bottom MLP and the three cross layers as they are).

usage: bf16_accuracy_test.py KILN MODEL_FILE WORK_DIR
"""
import os
import re
import subprocess
import sys

STEPS = 2000
BATCH = 128
EVAL_SAMPLES = 32768
SEED = 1
SMALL = ["rows_cap=5000", "emb_dim=16", "cross_rank=32", "top=[128, 64, 1]", "hot=1"]
# |AUC(bf16) - AUC(f32)| after STEPS steps; the issue asks for 0.002. Measured over seeds 1 to 5
# on the 2-core dev machine (AMD EPYC, AVX512-BF16; f32 AUCs 0.854 to 0.871): gaps 0.000026,
# 0.000036, 0.000158, 0.000049, 0.000012, so the bound holds with a 12x margin; both runs take
# about 16 s together.
MAX_GAP = 0.002


def train(kiln, model, work, precision):
    cmd = [kiln, "train", model, "--steps", str(STEPS), "--batch", str(BATCH), "--seed", str(SEED),
           "--eval-samples", str(EVAL_SAMPLES), "--eval-every", str(STEPS), "--threads", "2",
           "--precision", precision]
    for s in SMALL:
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"kiln train --precision {precision} failed ({out.returncode}):\n{out.stderr}")
    m = re.search(r"^eval auc: ([0-9.]+)$", out.stdout, re.M)
    if not m:
        sys.exit(f"no eval auc in:\n{out.stdout}")
    return float(m.group(1))


def main():
    kiln, model, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    f32 = train(kiln, model, work, "f32")
    bf16 = train(kiln, model, work, "bf16")
    gap = abs(bf16 - f32)
    print(f"eval auc: f32 {f32:.6f}, bf16 {bf16:.6f}, gap {gap:.6f} (at most {MAX_GAP})")
    if f32 < 0.6:
        sys.exit(f"f32 training did not learn the task (auc {f32:.4f}): the comparison means nothing")
    if gap > MAX_GAP:
        sys.exit(f"bf16 training's AUC is {gap:.6f} away from f32's, more than {MAX_GAP}")


if __name__ == "__main__":
    main()
