#!/usr/bin/env python3
"""`kiln compile --emit lib` end to end (issue 16): a C program, built here by the system's C
compiler against NAME.h and libNAME.so, copied with the library alone into an empty folder and
run with a clean environment, predicts and trains exactly as `kiln` does.

Usage: capi_test.py KILN MODEL CLIENT_SOURCE
MODEL is of the Criteo layout with one id per feature and 200 rows per table (tests' tiny model).
Checks:
  - predictions through the C API (batches of 64, the last one short) equal `kiln predict`'s on the
    same checkpoint and the same samples (written by the client as a Criteo TSV file), bit for bit;
    two more handles predicting at once on two threads equal the first;
  - embedded weights (--checkpoint at compile time) predict the same with no weights file;
  - ten training steps through the C API leave every tensor (parameters and optimizer state)
    byte-identical to `kiln train`'s on the same data, and kiln loads the C API's checkpoint;
  - bad arguments are error codes with messages (a NaN or an infinity among the inputs too), and so
    is misuse of handles: threads out of range, a double destroy, calls after it, one handle shared
    by threads (destroyed meanwhile too); the
    library exports only the kiln_* functions;
    ldd lists nothing of CUDA, MPI or fmt.
"""
import json
import os
import shutil
import struct
import sys
import tempfile

from aot_common import clean_env, fail, ok

KILN, MODEL, CLIENT = (os.path.abspath(a) for a in sys.argv[1:4])
MAX_BATCH = 64
ID_BOUND = "200"








def tensors(path):
    """name -> (dtype, shape, bytes) of a safetensors file, parsed here."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def read(path):
    with open(path) as f:
        return f.read()


compiler = shutil.which("cc") or shutil.which("gcc")
if not compiler:
    fail("no C compiler (cc or gcc) to build the client")

with tempfile.TemporaryDirectory() as work:
    build, embedded, alone, home = (os.path.join(work, d) for d in ("build", "embedded", "alone", "home"))
    for d in (build, embedded, alone, home):
        os.mkdir(d)
    train = ["--threads", "1", "--seed", "3"]
    ok([KILN, "train", MODEL, "--batch", str(MAX_BATCH), "--steps", "12", "--checkpoint",
        os.path.join(work, "ref")] + train)
    ref_ckpt = os.path.join(work, "ref", "checkpoint.safetensors")
    compile_lib = [KILN, "compile", MODEL, "--emit", "lib", "--device", "cpu", "--max-batch", str(MAX_BATCH)]
    _, err = ok(compile_lib + ["-o", os.path.join(build, "model")])
    if "libmodel.so" not in err:
        fail("kiln compile --emit lib printed no summary", err)
    header = read(os.path.join(build, "model.h"))
    for key in ("#define MODEL_MAX_BATCH %d" % MAX_BATCH, "#define MODEL_NUM_INPUTS 28",
                "#define MODEL_INPUT_DENSE 0", "#define MODEL_INPUT_CATS_25 26", "kiln_predict", "KILN_AOT_API_VERSION"):
        if key not in header:
            fail("model.h lacks %r" % key, header)
    ok(compile_lib + ["-o", os.path.join(embedded, "model"), "--checkpoint", ref_ckpt])

    client = os.path.join(build, "client")
    ok([compiler, "-std=c11", "-O2", "-Wall", "-Werror", CLIENT, "-I", build, "-L", build, "-lmodel", "-lm",
        "-lpthread", "-Wl,-rpath,$ORIGIN", "-o", client])
    shutil.copy2(client, os.path.join(alone, "client"))
    shutil.copy2(os.path.join(build, "libmodel.so"), os.path.join(alone, "libmodel.so"))
    clean = clean_env(home)

    def client_ok(args):
        return ok(["./client"] + args, cwd=alone, env=clean)

    # What the library links: system libraries only, and it exports the C API alone.
    out, _ = ok(["ldd", os.path.join(alone, "libmodel.so")])
    for banned in ("cuda", "nvrtc", "cublas", "nccl", "libmpi", "libfmt", "not found"):
        if banned in out:
            fail("ldd of libmodel.so lists %r" % banned, out)
    out, _ = ok(["nm", "-D", "--defined-only", os.path.join(alone, "libmodel.so")])
    exported = [line.split()[-1] for line in out.splitlines() if line.split()[1:2] and line.split()[1] in "TDBW"]
    foreign = [s for s in exported if not s.startswith("kiln_")]
    if foreign or "kiln_predict" not in exported:
        fail("libmodel.so should export only kiln_*: %s" % foreign[:10], out)

    # Prediction: 1000 samples in batches of 64 (the last one short), against kiln predict.
    client_ok(["predict", ref_ckpt, "samples.tsv", "scores", "1000", str(MAX_BATCH), ID_BOUND])
    ok([KILN, "predict", MODEL, "--checkpoint", ref_ckpt, "--batch", str(MAX_BATCH), "--threads", "1",
        "--data", os.path.join(alone, "samples.tsv"), "-o", os.path.join(work, "ref.scores")])
    if read(os.path.join(alone, "scores")) != read(os.path.join(work, "ref.scores")):
        fail("the C API's predictions differ from kiln predict's")

    # Embedded weights: no weights file, the same predictions.
    shutil.copy2(os.path.join(embedded, "libmodel.so"), os.path.join(alone, "libmodel.so"))
    client_ok(["predict", "-", "samples.tsv", "scores.embedded", "1000", str(MAX_BATCH), ID_BOUND])
    if read(os.path.join(alone, "scores.embedded")) != read(os.path.join(work, "ref.scores")):
        fail("predictions from the embedded weights differ from kiln predict's")
    shutil.copy2(os.path.join(build, "libmodel.so"), os.path.join(alone, "libmodel.so"))

    # Training: 10 steps of 64 in order from seeded parameters, against kiln train on that file.
    client_ok(["train", "-", "train.tsv", "capi_ckpt", "640", str(MAX_BATCH), ID_BOUND, "3"])
    ok([KILN, "train", MODEL, "--data", os.path.join(alone, "train.tsv"), "--batch", str(MAX_BATCH), "--steps",
        "10", "--checkpoint", os.path.join(work, "kiln_ckpt")] + train)
    got = tensors(os.path.join(alone, "capi_ckpt", "checkpoint.safetensors"))
    want = tensors(os.path.join(work, "kiln_ckpt", "checkpoint.safetensors"))
    if sorted(got) != sorted(want):
        fail("the C API's checkpoint holds %s, kiln's %s" % (sorted(got), sorted(want)))
    for name in want:
        if got[name] != want[name]:
            fail("after 10 steps '%s' differs from kiln train's" % name)
    # kiln reads what the C API saved.
    ok([KILN, "eval", MODEL, "--checkpoint", os.path.join(alone, "capi_ckpt"), "--batch", str(MAX_BATCH),
        "--data", "synthetic", "--samples", "256"])

    out, err = client_ok(["errors"])
    for what in ("missing weights", "batch over the max", "NaN dense input", "infinite dense input", "NaN label",
                 "id out of range", "unwritable save"):
        if what not in out:
            fail("the error checks did not report %r" % what, out, err)

    # Misuse of handles (issue 35): error codes with messages, never a crash or a read of freed memory.
    out, err = client_ok(["misuse"])
    for what in ("threads out of range (-5)", "threads out of range (100000)", "double destroy",
                 "use after destroy (predict)", "use after destroy (accessors)", "not a handle",
                 "shared handle:", "shared handle destroyed meanwhile:"):
        if what not in out:
            fail("the misuse checks did not report %r" % what, out, err)

print("PASS")
