#!/usr/bin/env python3
"""`kiln compile` on a GPU (issue 16; ctest label gpu; exit 77, a skip, without one): the CUDA
payload runs without NVRTC being loaded, and equals kiln's own GPU run within the gpu tests'
tolerances.

Usage: aot_gpu_test.py KILN MODEL [--set NAME=VALUE ...]
Checks, with --device cuda:
  - ./NAME train's loss trajectory and eval AUC (1000 samples: the short last batch runs on the
    payload's CPU Program) equal kiln train's within 1e-4;
  - the loader opens the driver and never libnvrtc (LD_DEBUG=libs);
  - a batch other than the compiled one trains with a clear error.
"""
import os
import re
import shutil
import sys
import tempfile

from aot_common import clean_env, fail, ok, run

KILN, MODEL = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
SETS = sys.argv[3:]
MAX_BATCH = 64








def losses(text):
    return [float(x) for x in re.findall(r"loss ([0-9.eE+-]+)", text)]


rc, _, _ = run(["nvidia-smi", "-L"]) if shutil.which("nvidia-smi") else (1, "", "")
if rc != 0:
    print("SKIP: no GPU")
    sys.exit(77)

with tempfile.TemporaryDirectory() as work:
    exe = os.path.join(work, "model")
    ok([KILN, "compile", MODEL, "-o", exe, "--max-batch", str(MAX_BATCH)] + SETS)
    clean = clean_env(work)
    # 1000 held-out samples in batches of 64: the short last one runs on the CPU Program.
    train = ["--steps", "12", "--threads", "1", "--seed", "3", "--log-every", "1", "--device", "cuda",
             "--eval-every", "12", "--eval-samples", "1000"]
    ref_out, ref_err = ok([KILN, "train", MODEL, "--batch", str(MAX_BATCH)] + train + SETS)
    env = dict(clean, LD_DEBUG="libs")
    got_out, got_err = ok([exe, "train"] + train, cwd=work, env=env)
    if "libnvrtc" in got_out + got_err:
        fail("./model train --device cuda loaded NVRTC", got_err)
    if "libcuda" not in got_out + got_err:
        fail("./model train --device cuda never opened the driver (did it run on the GPU?)", got_err)
    want, got = losses(ref_out + ref_err), losses(got_out + got_err)
    if len(want) < 12 or len(got) != len(want) or any(abs(a - b) > 1e-4 for a, b in zip(want, got)):
        fail("./model train --device cuda: losses %s, kiln train's %s" % (got, want))
    want_auc = re.findall(r"auc[ :=]+([0-9.]+)", ref_out + ref_err)
    got_auc = re.findall(r"auc[ :=]+([0-9.]+)", got_out + got_err)
    if not want_auc or len(got_auc) != len(want_auc) or any(
            abs(float(a) - float(b)) > 1e-4 for a, b in zip(want_auc, got_auc)):
        fail("eval AUC %s, kiln's %s" % (got_auc, want_auc))
    rc, out, err = run([exe, "train", "--batch", "32", "--steps", "1", "--device", "cuda"], cwd=work, env=clean)
    if rc <= 0 or "compiled for batch %d" % MAX_BATCH not in out + err:
        fail("training at another batch on the GPU should be a clear error", out, err)

print("PASS")
