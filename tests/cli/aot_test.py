#!/usr/bin/env python3
"""`kiln compile` end to end (issue 16): the executable, copied alone into an empty folder and run
with a clean environment, trains, evaluates and predicts exactly as `kiln` does on the same model.

Usage: aot_test.py KILN MODEL [--set NAME=VALUE ...]
Checks, on the CPU:
  - `./NAME train` writes a checkpoint byte-identical to `kiln train`'s (same batch, steps, seed);
  - `./NAME eval` and `./NAME predict` print exactly what `kiln eval`/`kiln predict` print on that
    checkpoint, with a short last batch (the Program planned for the max batch, rebound);
  - embedded weights (--checkpoint at compile time) predict without --checkpoint, the same;
  - ldd lists only system libraries, nothing of CUDA, MPI or fmt; NVRTC is never loaded;
  - --device all (the default) adds the CUDA kernels for sm_80, sm_90 and PTX, built without a GPU;
  - a batch over --max-batch, --set, a compiled-out function, a damaged, truncated or missing
    payload: a clear error and a non-zero exit, never a crash.
"""
import os
import re
import shutil
import sys
import tempfile

from aot_common import clean_env, fail, ok, refused, run, same_file

KILN, MODEL = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
SETS = sys.argv[3:]
MAX_BATCH = 64
STEPS = "12"












with tempfile.TemporaryDirectory() as work:
    build = os.path.join(work, "build")
    alone = os.path.join(work, "alone")
    home = os.path.join(work, "home")
    for d in (build, alone, home):
        os.mkdir(d)
    exe = os.path.join(build, "model")
    out, err = ok([KILN, "compile", MODEL, "-o", exe, "--device", "cpu", "--max-batch", str(MAX_BATCH)] + SETS)
    if "wrote " not in err:
        fail("kiln compile printed no summary", out, err)
    # Alone in an empty folder, with nothing of the environment (no KILN_*, no HOME cache).
    shutil.copy2(exe, os.path.join(alone, "model"))
    clean = clean_env(home)
    runner = ["./model"]

    def alone_ok(args):
        return ok(runner + args, cwd=alone, env=clean)

    info, _ = alone_ok(["info"])
    for key in ("max batch: %d" % MAX_BATCH, "payload: version", "functions: train, eval, predict", "inputs:",
                "parameters:", "devices: cpu"):
        if key not in info:
            fail("info lacks %r" % key, info)

    # Each command's help is the runner's own: no MODEL.kiln, no compiler flags, and --batch
    # defaulting to the batch it was compiled for (the flags are parsed once, as the runner's).
    for command in ("train", "eval", "predict"):
        text, _ = alone_ok([command, "--help"])
        if not text.startswith("usage: model %s" % command):
            fail("./model %s --help does not name the runner" % command, text)
        if "MODEL.kiln" in text or "--set=" in text or "--disable-pass" in text:
            fail("./model %s --help offers the compiler's arguments" % command, text)
        if not re.search(r"--batch=B\s+samples per step \(default: %d\)" % MAX_BATCH, text):
            fail("./model %s --help: --batch does not default to the compiled batch" % command, text)

    # Training: byte-identical checkpoints.
    train = ["--steps", STEPS, "--threads", "1", "--seed", "3"]
    ok([KILN, "train", MODEL, "--batch", str(MAX_BATCH), "--checkpoint", os.path.join(work, "ref")] + train + SETS)
    alone_ok(["train", "--checkpoint", "ckpt"] + train)
    ref_ckpt = os.path.join(work, "ref", "checkpoint.safetensors")
    if not same_file(ref_ckpt, os.path.join(alone, "ckpt", "checkpoint.safetensors")):
        fail("./model train's checkpoint differs from kiln train's")

    # Evaluation and prediction: 1000 samples in batches of 64, the last one short.
    data = ["--data", "synthetic", "--samples", "1000", "--threads", "1"]
    ref_eval, _ = ok([KILN, "eval", MODEL, "--checkpoint", ref_ckpt, "--batch", str(MAX_BATCH)] + data + SETS)
    got_eval, _ = alone_ok(["eval", "--checkpoint", "ckpt"] + data)
    if got_eval != ref_eval:
        fail("./model eval differs from kiln eval", got_eval, ref_eval)
    ref_pred = os.path.join(work, "ref.scores")
    ok([KILN, "predict", MODEL, "--checkpoint", ref_ckpt, "--batch", str(MAX_BATCH), "-o", ref_pred] + data + SETS)
    alone_ok(["predict", "--checkpoint", "ckpt", "-o", "scores"] + data)
    if not same_file(ref_pred, os.path.join(alone, "scores")):
        fail("./model predict differs from kiln predict")
    # A batch smaller than the max runs too, with the same scores.
    alone_ok(["predict", "--checkpoint", "ckpt", "--batch", "10", "-o", "scores10"] + data)
    ok([KILN, "predict", MODEL, "--checkpoint", ref_ckpt, "--batch", "10", "-o", ref_pred + "10"] + data + SETS)
    if not same_file(ref_pred + "10", os.path.join(alone, "scores10")):
        fail("./model predict --batch 10 differs from kiln predict --batch 10")

    # Embedded weights: no --checkpoint needed, the same scores.
    weighted = os.path.join(build, "weighted")
    ok([KILN, "compile", MODEL, "-o", weighted, "--device", "cpu", "--max-batch", str(MAX_BATCH), "--checkpoint",
        ref_ckpt] + SETS)
    shutil.copy2(weighted, os.path.join(alone, "weighted"))
    ok(["./weighted", "predict", "-o", "scores_w"] + data, cwd=alone, env=clean)
    if not same_file(ref_pred, os.path.join(alone, "scores_w")):
        fail("embedded weights predict otherwise than the checkpoint they came from")
    if "embedded" not in ok(["./weighted", "info"], cwd=alone, env=clean)[0]:
        fail("info does not say the weights are embedded")

    # Only system libraries; nothing of CUDA, MPI or fmt. oneDNN (the CPU GEMMs) brings its OpenMP
    # runtime and, in Debian's build, the OpenCL ICD loader of its GPU engine (never used).
    allowed = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libstdc++", "libgcc_s", "libdnnl", "libgomp",
               "libOpenCL", "libpthread", "libdl.so")
    for exe_name in ("model", "weighted"):
        ldd, _ = ok(["ldd", os.path.join(alone, exe_name)])
        for line in ldd.splitlines():
            lib = line.strip().split(" ")[0]
            if lib and not lib.startswith(allowed) and not lib.startswith("/lib"):
                fail("ldd of %s lists %s" % (exe_name, lib), ldd)
    # NVRTC is never opened (the loader's own record of every library it loads).
    env = dict(clean, LD_DEBUG="libs")
    _, out, err = run(runner + ["predict", "--checkpoint", "ckpt", "-o", "scores_d"] + data, cwd=alone, env=env)
    if "libnvrtc" in out + err:
        fail("the runner loaded NVRTC", err[-3000:])

    # --device all, the default: the CUDA kernels too, compiled by NVRTC (no GPU needed), and the
    # CPU side unchanged. On a machine without a GPU, --device cuda is a clear error.
    _, err = ok([KILN, "compile", MODEL, "-o", os.path.join(alone, "full"), "--max-batch", str(MAX_BATCH)] + SETS)
    if not re.search(r"compiled \d+ CUDA kernels for sm_80, sm_90, compute_90", err):
        fail("kiln compile --device all did not compile the CUDA kernels", err)
    info, _ = ok(["./full", "info"], cwd=alone, env=clean)
    for key in ("devices: cpu, cuda", "cuda architectures: sm_80, sm_90, compute_90"):
        if key not in info:
            fail("info lacks %r" % key, info)
    ok(["./full", "predict", "--checkpoint", "ckpt", "-o", "scores_full"] + data, cwd=alone, env=clean)
    if not same_file(ref_pred, os.path.join(alone, "scores_full")):
        fail("the --device all executable predicts otherwise on the CPU")
    if not os.path.exists("/dev/nvidia0"):
        refused(["./full", "train", "--steps", "1", "--device", "cuda"], r"--device cuda", cwd=alone, env=clean)
    refused([KILN, "compile", MODEL, "-o", os.path.join(build, "x"), "--arch", "sm_80,sm_90,compute_80"] + SETS,
            r"PTX is emitted for the newest architecture \(compute_90\)")
    refused([KILN, "compile", MODEL, "-o", os.path.join(build, "x"), "--arch", "sm_9x"] + SETS, r"sm_9x")

    # Bad input: clear errors, non-zero exits, no crashes.
    refused(runner + ["predict", "--checkpoint", "ckpt", "--batch", str(MAX_BATCH + 1)] + data,
            r"over the %d samples this model was compiled for" % MAX_BATCH, cwd=alone, env=clean)
    refused(runner + ["train", "--set", "x=1"], r"fixed when it was compiled", cwd=alone, env=clean)
    refused(runner + ["frobnicate"], r"unknown command 'frobnicate'", cwd=alone, env=clean)
    refused(runner + ["eval"] + data, r"--checkpoint DIR is required", cwd=alone, env=clean)
    predict_only = os.path.join(alone, "predict_only")
    ok([KILN, "compile", MODEL, "-o", predict_only, "--device", "cpu", "--functions", "predict"] + SETS)
    refused(["./predict_only", "train"], r"compiled without 'train'", cwd=alone, env=clean)
    with open(exe, "rb") as f:
        good = f.read()
    damaged = os.path.join(alone, "damaged")
    for what, bytes_, pattern in (
            ("a flipped byte in the payload", good[:len(good) - 200] + bytes([good[-200] ^ 0x40]) + good[-199:],
             r"checksum|damaged"),
            ("a truncated file", good[:len(good) - 1000], r"no Kiln payload"),
            ("a flipped footer version", good[:-12] + bytes([good[-12] ^ 2]) + good[-11:], r"payload version")):
        with open(damaged, "wb") as f:
            f.write(bytes_)
        os.chmod(damaged, 0o755)
        refused(["./damaged", "info"], pattern, cwd=alone, env=clean)
    runner_bin = os.path.join(os.path.dirname(KILN), "kiln-runner")
    refused([runner_bin, "info"], r"no Kiln payload", cwd=alone, env=clean)
    refused([KILN, "compile", MODEL, "-o", os.path.join(build, "x"), "--max-batch", "0"], r"--max-batch must be positive")
    refused([KILN, "compile", MODEL, "-o", os.path.join(build, "x"), "--functions", "serve"], r"not one of train")
    refused([KILN, "compile", MODEL], r"-o NAME is required")

print("PASS")
