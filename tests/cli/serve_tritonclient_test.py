#!/usr/bin/env python3
"""`kiln serve` driven by tritonclient, the Python client of the KServe v2 protocol (issue 35,
docs/serving.md).

The client is pip-installed into a venv of the build folder (made once, then reused); where venv or
pip (the network) is unavailable the test prints why and exits 77, which CTest reports as skipped.
The plain-HTTP checks of the same endpoints (serve_test.py) run regardless.

A small DLRM trains 2 steps; a server of its checkpoint is then called through every call of
tritonclient.http.InferenceServerClient: health, server and model metadata, readiness and
metadata at the served version (and a wrong one), the model config, the repository index, load
and unload (the error form, as kiln serves one model fixed at start), inference (scores equal to
`kiln predict` on the same checkpoint, unversioned and at the served version, one and several
samples a request, async_infer too; a wrong version and binary tensors raise
InferenceServerException with the server's message), statistics that grow by the inferences made,
and the extensions kiln serve lacks (trace, logging, shared memory) raising with the error form.

usage: serve_tritonclient_test.py KILN MODELS_DIR WORK_DIR VENV_DIR
"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

SET = ["--set", "rows_cap=3000"]
MODEL = "dlrm"
SKIP = 77  # SKIP_RETURN_CODE in tests/cli/CMakeLists.txt
IN_VENV = "KILN_TRITONCLIENT_VENV"


def fail(msg):
    sys.exit("FAIL: " + msg)


def skip(why):
    print(f"skipped: {why}", flush=True)
    sys.exit(SKIP)


def run(cmd):
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout[-3000:])
        fail(f"exit {r.returncode}")
    return r


def f32(x):
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def venv_python(venv):
    """The venv's python with tritonclient[http] importable: made (or mended) here when need be.
    Skips the test where venv or pip cannot provide it."""
    python = os.path.join(venv, "bin", "python")
    probe = [python, "-c", "import tritonclient.http, numpy"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        print(f"reusing {venv}")
        return python
    if not os.path.exists(python):
        r = subprocess.run([sys.executable, "-m", "venv", venv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            skip(f"{sys.executable} -m venv failed (on Debian, install python3-venv): {r.stdout.strip()[-500:]}")
    # Short network timeouts: an unreachable index fails within a minute or two, not at CTest's limit.
    cmd = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--timeout", "20",
           "--retries", "2", "tritonclient[http]"]
    print(" ".join(cmd), flush=True)
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=420)
    except subprocess.TimeoutExpired:
        skip("pip install tritonclient[http] took over 420 s")
    if r.returncode != 0:
        skip(f"pip install tritonclient[http] failed (no network or index?): {r.stdout.strip()[-800:]}")
    if subprocess.run(probe, capture_output=True).returncode != 0:
        fail("tritonclient was installed but does not import")
    return python


class Server:
    def __init__(self, kiln, model, args):
        cmd = [kiln, "serve", model, "--port", "0"] + SET + args
        print(" ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.proc.kill()
            fail(f"no 'listening on' line: {line!r} {self.proc.stderr.read()}")
        self.port = int(line.strip().rsplit(":", 1)[1])

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail("the server did not stop within 60 s of SIGTERM")
        print(self.proc.stderr.read()[-2000:])
        return code


def client_checks(kiln, models, work):
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException, triton_to_np_dtype

    model = os.path.join(models, "dlrm.kiln")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ckpt = os.path.join(work, "ckpt")
    run([kiln, "train", model, "--batch", "64", "--steps", "2", "--checkpoint", ckpt, "--seed", "3"] + SET)
    scores = os.path.join(work, "scores.txt")
    run([kiln, "predict", model, "--checkpoint", ckpt, "--data", "synthetic", "--samples", "64", "--batch", "64",
         "-o", scores] + SET)
    with open(scores) as f:
        expected = [f32(x) for x in f.read().split()]
    bodies = {}
    for batch in (1, 4):
        reqs = os.path.join(work, f"requests{batch}.jsonl")
        run([kiln, "data", "requests", model, "--data", "synthetic", "--samples", "16", "--batch", str(batch),
             "-o", reqs] + SET)
        with open(reqs) as f:
            bodies[batch] = [json.loads(line) for line in f.read().splitlines()]

    def inputs_of(body, binary=False):
        out = []
        for x in body["inputs"]:
            i = httpclient.InferInput(x["name"], x["shape"], x["datatype"])
            data = np.array(x["data"], dtype=triton_to_np_dtype(x["datatype"])).reshape(x["shape"])
            i.set_data_from_numpy(data, binary_data=binary)
            out.append(i)
        return out

    def raises(what, call, words):
        try:
            call()
        except InferenceServerException as e:
            if words not in e.message():
                fail(f"{what}: raised {e.message()!r}, which does not say {words!r}")
            print(f"{what}: InferenceServerException: {e.message()}")
            return
        fail(f"{what}: no InferenceServerException")

    s = Server(kiln, model, ["--checkpoint", ckpt, "--max-batch", "64", "--max-queue-delay-us", "500"])
    try:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{s.port}", concurrency=4, network_timeout=60.0)
        version = "2"
        if not (c.is_server_live() and c.is_server_ready() and c.is_model_ready(MODEL)
                and c.is_model_ready(MODEL, version)):
            fail("not live and ready")
        if c.is_model_ready(MODEL, "3") or c.is_model_ready("nope"):
            fail("ready at a version or a model it does not serve")
        server = c.get_server_metadata()
        if server["name"] != "kiln" or "statistics" not in server["extensions"]:
            fail(f"server metadata: {server}")
        meta = c.get_model_metadata(MODEL)
        if meta["versions"] != [version] or meta != c.get_model_metadata(MODEL, version):
            fail(f"model metadata: {meta}")
        raises("metadata at version 3", lambda: c.get_model_metadata(MODEL, "3"), "no version '3'")
        raises("metadata of another model", lambda: c.get_model_metadata("nope"), "unknown model 'nope'")
        config = c.get_model_config(MODEL, version)
        if (config["name"] != MODEL or config["max_batch_size"] != 64
                or {i["name"] for i in config["input"]} != {i["name"] for i in meta["inputs"]}):
            fail(f"model config: {config}")
        raises("config at version 3", lambda: c.get_model_config(MODEL, "3"), "no version '3'")
        index = c.get_model_repository_index()
        if index != [{"name": MODEL, "version": version, "state": "READY"}]:
            fail(f"repository index: {index}")
        c.load_model(MODEL)  # loaded since start: stays so
        raises("load of another model", lambda: c.load_model("nope"), "cannot load 'nope'")
        raises("load with a config", lambda: c.load_model(MODEL, config='{"max_batch_size": 8}'), "cannot reload")
        raises("unload", lambda: c.unload_model(MODEL), "cannot unload")
        if not c.is_model_ready(MODEL):
            fail("not ready after load and unload")
        # Extensions kiln serve does not implement: the error form, naming the call.
        for what, call in [
                ("trace settings", lambda: c.get_trace_settings()),
                ("model trace settings", lambda: c.update_trace_settings(MODEL, {"trace_level": ["TIMESTAMPS"]})),
                ("log settings", lambda: c.get_log_settings()),
                ("log settings update", lambda: c.update_log_settings({"log_info": True})),
                ("system shared memory", lambda: c.get_system_shared_memory_status()),
                ("system shared memory registration", lambda: c.register_system_shared_memory("r", "/k", 64)),
                ("system shared memory unregistration", lambda: c.unregister_system_shared_memory()),
                ("CUDA shared memory", lambda: c.get_cuda_shared_memory_status()),
                ("CUDA shared memory registration", lambda: c.register_cuda_shared_memory("r", "aGFuZGxl", 0, 64)),
                ("CUDA shared memory unregistration", lambda: c.unregister_cuda_shared_memory("r"))]:
            raises(what, call, "no such endpoint")

        before = c.get_inference_statistics(MODEL)["model_stats"][0]
        # One sample a request, unversioned and at the served version, with a request id.
        requests = samples = 0
        for i, body in enumerate(bodies[1]):
            r = c.infer(MODEL, inputs_of(body), model_version=version if i % 2 else "", request_id=f"r{i}")
            got = r.as_numpy("score")
            response = r.get_response()
            if got.shape != (1,) or f32(got[0]) != expected[i] or response["id"] != f"r{i}" \
                    or response["model_version"] != version:
                fail(f"sample {i}: {response}; kiln predict says {expected[i]!r}")
            requests, samples = requests + 1, samples + 1
        # Four samples a request, scores in order.
        for k, body in enumerate(bodies[4]):
            got = [f32(x) for x in c.infer(MODEL, inputs_of(body), model_version=version).as_numpy("score")]
            if got != expected[4 * k:4 * k + 4]:
                fail(f"request {k} of 4 samples: {got}; kiln predict says {expected[4 * k:4 * k + 4]}")
            requests, samples = requests + 1, samples + 4
        # async_infer: the same endpoint, from the client's pool of greenlets.
        pending = [c.async_infer(MODEL, inputs_of(body)) for body in bodies[1][:4]]
        got = [f32(p.get_result().as_numpy("score")[0]) for p in pending]
        if got != expected[:4]:
            fail(f"async_infer: {got}; kiln predict says {expected[:4]}")
        requests, samples = requests + 4, samples + 4
        print(f"infer: {requests} requests, {samples} scores equal to kiln predict")
        raises("infer at version 3", lambda: c.infer(MODEL, inputs_of(bodies[1][0]), model_version="3"),
               "no version '3'")
        raises("infer of another model", lambda: c.infer("nope", inputs_of(bodies[1][0])), "unknown model")
        raises("binary tensors", lambda: c.infer(MODEL, inputs_of(bodies[1][0], binary=True)),
               "binary tensor extension")

        after = c.get_inference_statistics(MODEL, version)["model_stats"][0]
        if c.get_inference_statistics()["model_stats"] != [after]:
            fail("the statistics of all models are not the model's alone")
        grown = {k: after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"]
                 for k in ("success", "fail", "queue", "compute_infer")}
        if (after["name"] != MODEL or after["version"] != version
                or after["inference_count"] - before["inference_count"] != samples
                or grown != {"success": requests, "fail": 1, "queue": requests, "compute_infer": requests}
                or not 0 < after["execution_count"] - before["execution_count"] <= requests
                or after["last_inference"] <= 0 or after["inference_stats"]["success"]["ns"] <= 0):
            fail(f"statistics after {requests} requests of {samples} samples and one failure: "
                 f"{before} -> {after}")
        print(f"statistics: {after['inference_count']} inferences in {after['execution_count']} executions")
        raises("statistics of another model", lambda: c.get_inference_statistics("nope"), "unknown model")
        raises("statistics at version 3", lambda: c.get_inference_statistics(MODEL, "3"), "no version '3'")
        c.close()
    finally:
        code = s.stop()
    if code != 0:
        fail(f"SIGTERM: exit {code}")
    print("PASS")


def main():
    kiln, models, work, venv = sys.argv[1:5]
    if os.environ.get(IN_VENV) != "1":
        # Setting up the client, then this script again under the venv's python, which has it.
        python = venv_python(venv)
        os.environ[IN_VENV] = "1"
        sys.stdout.flush()
        os.execv(python, [python, os.path.abspath(__file__)] + sys.argv[1:])
    client_checks(kiln, models, work)


if __name__ == "__main__":
    main()
