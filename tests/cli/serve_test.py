#!/usr/bin/env python3
"""End-to-end tests of `kiln serve` on loopback (docs/serving.md).

A small DLRM trains 10 steps (checkpoint C10, update file of step 10) and 10 more (checkpoint
C20, update of step 20). Then:
- every endpoint of the protocol answers; /metrics has the counters; versioned paths, the
  repository, model configuration and statistics extensions answer as the protocol says, and what
  a server of one fixed model cannot do (load with a config, unload) gets the error form;
- concurrent clients each get their own samples' scores, equal bit for bit to `kiln predict` on
  the same checkpoint, and requests really merge into batches;
- a server whose tables sit in RocksDB behind a 1% cache and a 2% host tier (LFU) gives the same
  scores, and its persistent tier is read;
- the store of an import interrupted halfway is refused by serve, naming the cause;
- a published update is applied while serving: every response equals predict of the version it
  names, and the version moves from 10 to 20 between batches only; a FIFO of an update's name
  in the folder is skipped, and a copy whose tail is not yet written is refused by its checksum;
- malformed requests get a 4xx with a message and do not disturb others, nor do clients that
  stall halfway through a request;
- SIGTERM drains in-flight requests and exits 0; a missing or corrupt store is an error at start.

usage: serve_test.py KILN MODELS_DIR WORK_DIR
"""
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

SET = ["--set", "rows_cap=3000"]
MODEL = "dlrm"


def fail(msg):
    sys.exit("FAIL: " + msg)


def run(cmd, expect_ok=True):
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(r.stdout[-3000:])
    if expect_ok and r.returncode != 0:
        fail(f"exit {r.returncode}")
    return r


def f32(x):
    return struct.unpack("f", struct.pack("f", float(x)))[0]


class Server:
    def __init__(self, kiln, model, args, sets=None, name=None):
        # A compiled executable (model None) takes neither MODEL nor --set.
        if model is None:
            cmd = [kiln, "serve", "--port", "0"] + args
        else:
            cmd = [kiln, "serve", model, "--port", "0"] + (SET if sets is None else sets) + args
        print(" ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.proc.kill()
            fail(f"no 'listening on' line: {line!r} {self.proc.stderr.read()}")
        self.port = int(line.strip().rsplit(":", 1)[1])
        self.model = name or os.path.splitext(os.path.basename(model))[0]

    def request(self, method, path, body=None, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def infer(self, body, model=None):
        model = model or self.model
        status, data = self.request("POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
        return status, json.loads(data) if data else None

    def metrics(self):
        status, data = self.request("GET", "/metrics")
        if status != 200:
            fail(f"/metrics: {status}")
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail("the server did not stop within 60 s of SIGTERM")
        err = self.proc.stderr.read()
        print(err[-2000:])
        return code


def predict(kiln, model, ckpt, work, name):
    out = os.path.join(work, name)
    run([kiln, "predict", model, "--checkpoint", ckpt, "--data", "synthetic", "--samples", "192",
         "--batch", "64", "-o", out] + SET)
    with open(out) as f:
        return [f32(x) for x in f.read().split()]


def check_scores(responses, expected_by_version, what):
    for i, (status, body) in responses.items():
        if status != 200:
            fail(f"{what}: request {i} got {status}: {body}")
        version = int(body["model_version"])
        want = expected_by_version[version][i]
        got = f32(body["outputs"][0]["data"][0])
        if got != want:
            fail(f"{what}: sample {i} scored {got!r} at version {version}; kiln predict says {want!r}")


def concurrent(server, bodies, clients):
    out = {}
    lock = threading.Lock()

    def worker(k):
        for i in range(k, len(bodies), clients):
            r = server.infer(bodies[i])
            with lock:
                out[i] = r

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def check_extensions(s, bodies, expected, answered, samples):
    """The protocol's calls beyond live/ready/metadata/infer, over plain HTTP: versioned paths, the
    repository, model configuration and statistics extensions, and the error form of what a server
    of one model fixed at start cannot do. `answered` requests of `samples` samples in all were
    scored before, none failed."""

    def get(method, path, want, body=None):
        status, data = s.request(method, path, body)
        try:
            doc = json.loads(data)
        except ValueError:
            fail(f"{method} {path}: {status} with a body that is not JSON: {data[:300]!r}")
        if status != want:
            fail(f"{method} {path}: {status}, expected {want}: {doc}")
        if want != 200:
            if not isinstance(doc, dict) or not isinstance(doc.get("error"), str):
                fail(f"{method} {path}: {status} without the protocol's {{\"error\": ...}}: {doc}")
            print(f"{method} {path}: {status} {doc['error']}")
        return doc

    v2 = get("GET", "/v2", 200)
    for ext in ("model_repository", "model_configuration", "statistics"):
        if ext not in v2["extensions"]:
            fail(f"GET /v2 does not list the {ext} extension: {v2}")
    # Versioned paths: the served version answers as the unversioned path does; another is a 404.
    meta = get("GET", f"/v2/models/{MODEL}", 200)
    if get("GET", f"/v2/models/{MODEL}/versions/10", 200) != meta:
        fail("the metadata of /versions/10 differs from the model's")
    get("GET", f"/v2/models/{MODEL}/versions/10/ready", 200)
    get("GET", f"/v2/models/{MODEL}/versions/11", 404)
    get("GET", f"/v2/models/{MODEL}/versions/9/ready", 404)
    get("GET", f"/v2/models/{MODEL}/versions/ten", 400)
    get("GET", f"/v2/models/nope/versions/10", 404)
    # The model configuration extension.
    config = get("GET", f"/v2/models/{MODEL}/config", 200)
    if get("GET", f"/v2/models/{MODEL}/versions/10/config", 200) != config:
        fail("the config of /versions/10 differs from the model's")
    inputs = {i["name"]: i for i in config["input"]}
    if (config["name"] != MODEL or config["max_batch_size"] != 64 or set(inputs) != {i["name"] for i in meta["inputs"]}
            or inputs["dense"] != {"name": "dense", "data_type": "TYPE_FP32", "dims": [13]}
            or inputs["cats.0"]["data_type"] != "TYPE_INT64" or not inputs["label"].get("optional")
            or [o["name"] for o in config["output"]] != ["score"]
            or config["dynamic_batching"]["max_queue_delay_microseconds"] != 20000
            or config["instance_group"] != [{"count": 2}]):
        fail(f"model config: {config}")
    get("GET", "/v2/models/nope/config", 404)
    get("GET", f"/v2/models/{MODEL}/versions/11/config", 404)
    # The repository: the one model, ready; loading it again leaves it loaded; nothing else loads or
    # unloads.
    want_index = [{"name": MODEL, "version": "10", "state": "READY"}]
    for body in (None, b"{}", b'{"ready": true}'):
        if get("POST", "/v2/repository/index", 200, body) != want_index:
            fail(f"repository index ({body}): not {want_index}")
    get("POST", "/v2/repository/index", 400, b"{not json")
    get("POST", "/v2/repository/index", 400, b'{"ready": "yes"}')
    get("POST", f"/v2/repository/models/{MODEL}/load", 200, b"{}")
    get("POST", f"/v2/repository/models/{MODEL}/load", 501, b'{"parameters": {"config": "{}"}}')
    get("POST", "/v2/repository/models/nope/load", 404, b"{}")
    get("POST", f"/v2/repository/models/{MODEL}/unload", 501, b'{"parameters": {"unload_dependents": false}}')
    get("POST", "/v2/repository/models/nope/unload", 404)
    get("GET", "/v2/repository/index", 404)
    get("GET", f"/v2/models/{MODEL}/versions/10/nothing", 404)
    # Statistics: what was scored so far, then one more request at the versioned path.
    stats = get("GET", f"/v2/models/{MODEL}/stats", 200)
    if get("GET", "/v2/models/stats", 200)["model_stats"][0]["inference_count"] != samples:
        fail("the statistics of all models differ from the model's")
    (m,) = stats["model_stats"]
    inf = m["inference_stats"]
    if (m["name"] != MODEL or m["version"] != "10" or m["inference_count"] != samples
            or inf["success"]["count"] != answered or inf["fail"]["count"] != 0
            or inf["queue"]["count"] != answered or inf["compute_infer"]["count"] != answered
            or not 0 < m["execution_count"] < answered
            or sum(b["compute_infer"]["count"] for b in m["batch_stats"]) != m["execution_count"]
            or sum(b["batch_size"] * b["compute_infer"]["count"] for b in m["batch_stats"]) != samples
            or inf["success"]["ns"] <= 0 or inf["compute_infer"]["ns"] <= 0
            or abs(m["last_inference"] / 1000 - time.time()) > 600):
        fail(f"statistics after {answered} requests of {samples} samples: {m}")
    if s.metrics()["kiln_batches_total"] != m["execution_count"]:
        fail("execution_count is not kiln_batches_total")
    status, body = s.infer(bodies[7], f"{MODEL}/versions/10")
    if status != 200 or body["model_version"] != "10" or f32(body["outputs"][0]["data"][0]) != expected[10][7]:
        fail(f"infer at /versions/10: {status} {body}")
    status, body = s.infer(bodies[7], f"{MODEL}/versions/20")
    if status != 404 or "version" not in body.get("error", ""):
        fail(f"infer at /versions/20: {status} {body}, expected 404 naming the version")
    status, body = s.infer("{not json")
    if status != 400:
        fail(f"a bad request: {status}")
    (after,) = get("GET", f"/v2/models/{MODEL}/versions/10/stats", 200)["model_stats"]
    if (after["inference_count"] != samples + 1 or after["inference_stats"]["success"]["count"] != answered + 1
            or after["inference_stats"]["fail"]["count"] != 1 or after["execution_count"] != m["execution_count"] + 1
            or after["last_inference"] < m["last_inference"]):
        fail(f"statistics after one more request and a bad one: {after}")
    get("GET", "/v2/models/nope/stats", 404)
    get("GET", f"/v2/models/{MODEL}/versions/11/stats", 404)
    print("protocol extensions: versioned paths, config, repository and statistics answer as specified")


def main():
    kiln, models, work = sys.argv[1:4]
    model = os.path.join(models, "dlrm.kiln")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ckpt, c10, publish = (os.path.join(work, d) for d in ("ckpt", "c10", "publish"))
    train = [kiln, "train", model, "--batch", "64", "--checkpoint", ckpt, "--publish", publish,
             "--publish-every", "10", "--seed", "3"] + SET
    run(train + ["--steps", "10"])
    shutil.copytree(ckpt, c10)
    run(train + ["--steps", "20", "--resume"])
    updates = sorted(os.listdir(publish))
    if updates != ["update-000000000010.safetensors", "update-000000000020.safetensors"]:
        fail(f"published {updates}")
    expected = {10: predict(kiln, model, c10, work, "p10.txt"), 20: predict(kiln, model, ckpt, work, "p20.txt")}
    if expected[10] == expected[20]:
        fail("training did not change the scores")
    reqs = os.path.join(work, "requests.jsonl")
    run([kiln, "data", "requests", model, "--data", "synthetic", "--samples", "192", "--batch", "1", "-o", reqs] + SET)
    with open(reqs) as f:
        bodies = f.read().splitlines()
    if len(bodies) != 192:
        fail(f"{len(bodies)} request bodies")

    # 1. Endpoints, batching, exact scores, bad requests, SIGTERM.
    s = Server(kiln, model, ["--checkpoint", c10, "--max-batch", "64", "--max-queue-delay-us", "20000",
                             "--instances", "2", "--cache-fraction", "0.05", "--max-request-bytes", "200000"])
    for path, want in [("/v2/health/live", 200), ("/v2/health/ready", 200), ("/v2", 200),
                       (f"/v2/models/{MODEL}", 200), (f"/v2/models/{MODEL}/ready", 200),
                       ("/v2/models/nope", 404), ("/v2/models/nope/ready", 404), ("/nothing", 404)]:
        status, data = s.request("GET", path)
        if status != want:
            fail(f"GET {path}: {status}, expected {want}: {data}")
    meta = json.loads(s.request("GET", f"/v2/models/{MODEL}")[1])
    names = {i["name"] for i in meta["inputs"]}
    if "dense" not in names or meta["outputs"][0]["name"] != "score" or meta["versions"] != ["10"]:
        fail(f"model metadata: {meta}")
    responses = concurrent(s, bodies, 16)
    check_scores(responses, expected, "concurrent clients")
    m = s.metrics()
    if m["kiln_batches_total"] >= len(bodies) or m["kiln_samples_total"] != len(bodies):
        fail(f"requests did not merge: {m['kiln_batches_total']} batches for {len(bodies)} requests")
    print(f"batching: {len(bodies)} requests in {m['kiln_batches_total']:.0f} batches")
    if m['kiln_requests_total{code="200"}'] != len(bodies):
        fail("kiln_requests_total does not count the answered requests")
    # A request of 4 samples gets its 4 scores, in order.
    good = json.loads(bodies[0])
    multi = {"id": "four", "inputs": []}
    for inp in good["inputs"]:
        parts = [json.loads(bodies[i])["inputs"] for i in range(4)]
        data = [v for p in parts for x in p if x["name"] == inp["name"] for v in x["data"]]
        shape = [4] + inp["shape"][1:]
        multi["inputs"].append({"name": inp["name"], "shape": shape, "datatype": inp["datatype"], "data": data})
    status, body = s.infer(json.dumps(multi))
    if status != 200 or body.get("id") != "four" or [f32(x) for x in body["outputs"][0]["data"]] != expected[10][:4]:
        fail(f"a 4-sample request: {status} {body}")
    check_extensions(s, bodies, expected, len(bodies) + 1, len(bodies) + 4)

    def bad(name, body, want, model=MODEL):
        status, resp = s.infer(body, model)
        if status != want or not resp or "error" not in resp:
            fail(f"{name}: got {status} {resp}, expected {want} with an error message")
        print(f"{name}: {status} {resp['error']}")

    def with_input(name, **changes):
        b = json.loads(bodies[0])
        for x in b["inputs"]:
            if x["name"] == name:
                x.update(changes)
        return json.dumps(b)

    bad("bad json", "{not json", 400)
    bad("not an object", "[1, 2]", 400)
    bad("unknown model", bodies[0], 404, model="nope")
    bad("wrong shape", with_input("dense", shape=[1, 12]), 400)
    bad("wrong dtype", with_input("dense", datatype="INT64"), 400)
    bad("id out of range", with_input("cats.0", data=[10**9]), 400)
    bad("negative id", with_input("cats.3", data=[-1]), 400)
    bad("too few values", with_input("dense", data=[0.5]), 400)
    bad("a string value", with_input("dense", data=["x"] * 13), 400)
    bad("missing input", json.dumps({"inputs": [x for x in good["inputs"] if x["name"] != "dense"]}), 400)
    bad("unknown input", json.dumps({"inputs": good["inputs"] + [{"name": "zz", "shape": [1], "datatype": "FP32", "data": [1]}]}), 400)
    big = dict(multi)
    big["inputs"] = [dict(x, shape=[65] + x["shape"][1:], data=x["data"][:1] * (65 * (len(x["data"]) // 4)))
                     for x in multi["inputs"]]
    bad("over --max-batch", json.dumps(big), 400)
    bad("body over --max-request-bytes", json.dumps({"inputs": [], "pad": "x" * 300000}), 413)
    status, body = s.infer(bodies[5])
    if status != 200 or f32(body["outputs"][0]["data"][0]) != expected[10][5]:
        fail("a good request after the bad ones")
    # Slow clients: connections that send half a request and stall hold an HTTP thread each, never
    # the batcher; everyone else is answered at once.
    slow = []
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 5000\r\n\r\n{{\"inputs\": [".encode())
        slow.append(sock)
    t0 = time.time()
    check_scores(concurrent(s, bodies[:32], 4), {10: expected[10]}, "beside stalled clients")
    if time.time() - t0 > 3:
        fail(f"stalled clients slowed the others: 32 requests took {time.time() - t0:.1f} s")
    for sock in slow:
        sock.close()
    print(f"slow clients: 32 requests answered in {time.time() - t0:.2f} s beside 3 stalled connections")
    # SIGTERM while requests are in flight: each is answered, then the server exits 0.
    inflight = {}
    threads = []
    for k in range(8):
        t = threading.Thread(target=lambda k=k: inflight.__setitem__(k, s.infer(bodies[k])))
        t.start()
        threads.append(t)
    time.sleep(0.005)
    code = s.stop()
    for t in threads:
        t.join()
    if code != 0:
        fail(f"SIGTERM: exit {code}")
    for k, (status, body) in inflight.items():
        if status == 200 and f32(body["outputs"][0]["data"][0]) != expected[10][k]:
            fail("a request answered during the drain has a wrong score")
    print(f"drain: {sum(1 for v in inflight.values() if v[0] == 200)} of 8 in-flight requests answered, exit 0")

    # 2. Tables in RocksDB behind small cache and host tiers; live updates on top.
    store = os.path.join(work, "store")
    r = run([kiln, "store", "import", c10, store, "--model", model] + SET)
    # An import interrupted halfway (killed by the file size limit as RocksDB writes rows) leaves a
    # store that serve refuses, naming the cause. The checkpoint says step 0, the version a new
    # store starts at: serve used to take such a store and answer 500 on every request.
    c0 = os.path.join(work, "c0.safetensors")
    with open(os.path.join(c10, "checkpoint.safetensors"), "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header["__metadata__"]["step"] = "0"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(c0, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + blob[8 + n:])
    interrupted = os.path.join(work, "interrupted")
    r = subprocess.run(["bash", "-c", 'ulimit -f 512; exec "$@"', "bash", kiln, "store", "import", c0, interrupted,
                        "--model", model] + SET, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode == 0 or not os.path.exists(os.path.join(interrupted, "CURRENT")):
        fail(f"the import under ulimit -f 512 was not stopped halfway (exit {r.returncode}): {r.stdout[-2000:]}")
    try:
        r = subprocess.run([kiln, "serve", model, "--checkpoint", c0, "--store", interrupted, "--port", "0"] + SET,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        fail("kiln serve started on the store of an interrupted import")
    if r.returncode != 1 or "is incomplete: the kiln store import that made it did not finish" not in r.stdout:
        fail(f"kiln serve on the store of an interrupted import: exit {r.returncode}: {r.stdout[-2000:]}")
    print("interrupted import: refused by serve")
    watch = os.path.join(work, "watch")
    os.makedirs(watch)
    s = Server(kiln, model, ["--checkpoint", c10, "--store", store, "--cache-fraction", "0.01",
                             "--host-fraction", "0.02", "--eviction", "lfu", "--watch", watch,
                             "--poll-ms", "20", "--max-queue-delay-us", "2000"])
    check_scores(concurrent(s, bodies, 8), expected, "tiered store")
    m = s.metrics()
    persistent_hits = sum(v for k, v in m.items() if k.startswith("kiln_embedding_hits_total") and 'tier="persistent"' in k)
    if persistent_hits == 0:
        fail("the persistent tier was never read")
    cache_rate, host_rate = (m['kiln_embedding_hit_rate{tier="%s"}' % t] for t in ("cache", "host"))
    print(f"tiers: hit rates cache {cache_rate:.3f} host {host_rate:.3f}, {persistent_hits:.0f} rows from RocksDB")
    # Publish step 20 while clients run: each answer equals predict at the version it names.
    # A fifth client names version 10 in its path: it gets version 10's scores or 404, never 20's.
    stop = threading.Event()
    seen = []
    pinned = []

    def client(k):
        i = k
        while not stop.is_set():
            status, body = s.infer(bodies[i % len(bodies)])
            seen.append((i % len(bodies), status, body))
            i += 4

    def pinned_client():
        i = 0
        while not stop.is_set():
            pinned.append((i % len(bodies),) + s.infer(bodies[i % len(bodies)], f"{MODEL}/versions/10"))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=pinned_client))
    for t in threads:
        t.start()
    time.sleep(0.2)
    # A FIFO of an update's name is skipped (opening it blocked the watcher, then shutdown), and a
    # copy at its full size whose tail is not yet written is refused by its checksum, not applied.
    os.mkfifo(os.path.join(watch, "update-000000000015.safetensors"))
    with open(os.path.join(publish, "update-000000000020.safetensors"), "rb") as f:
        whole = f.read()
    errors_before = s.metrics().get("kiln_update_errors_total", 0)
    torn = whole[:-64] + bytes(64)  # what a reader sees of a file extended to its size
    if torn == whole:
        fail("the update's last 64 bytes are zeros: the torn copy would equal the whole one")
    with open(os.path.join(watch, "update-000000000020.safetensors"), "wb") as f:
        f.write(torn)
    time.sleep(0.5)
    m = s.metrics()
    if m["kiln_model_version"] != 10 or m.get("kiln_update_errors_total", 0) <= errors_before:
        stop.set()  # the clients end, so the failure does not wait on them
        fail("an update whose tail is not yet written was not refused: version %s, %s update errors"
             % (m["kiln_model_version"], m.get("kiln_update_errors_total")))
    # As the trainer publishes: written beside its place, then renamed into it.
    shutil.copy(os.path.join(publish, "update-000000000020.safetensors"), os.path.join(watch, "incoming.tmp"))
    os.rename(os.path.join(watch, "incoming.tmp"), os.path.join(watch, "update-000000000020.safetensors"))
    deadline = time.time() + 30
    while s.metrics()["kiln_model_version"] != 20:
        if time.time() > deadline:
            fail("the update was not applied within 30 s")
        time.sleep(0.05)
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    versions = [int(b["model_version"]) for _, st, b in seen if st == 200]
    if 10 not in versions or 20 not in versions:
        fail(f"the clients did not see both versions: {sorted(set(versions))}")
    for i, status, body in seen:
        check_scores({i: (status, body)}, expected, "during the update")
    check_scores(concurrent(s, bodies, 4), {20: expected[20], 10: [None] * len(bodies)}, "after the update")
    if s.stop() != 0:
        fail("the store server did not exit 0")
    print(f"updates: {len(seen)} answers during the switch, {versions.count(10)} at version 10, "
          f"{versions.count(20)} at version 20, each equal to predict of its version")
    for i, status, body in pinned:
        if status == 404 and "version" in (body or {}).get("error", ""):
            continue
        if status == 200 and body["model_version"] != "10":
            fail(f"a request at /versions/10 was scored at version {body['model_version']}")
        check_scores({i: (status, body)}, {10: expected[10]}, "a request at /versions/10 during the update")
    if not pinned or pinned[-1][1] != 404:
        fail(f"requests at /versions/10 after the update to 20 are not refused: {pinned[-1:]}")
    print(f"updates: {sum(1 for p in pinned if p[1] == 200)} requests at /versions/10 scored at 10, "
          f"{sum(1 for p in pinned if p[1] == 404)} refused with 404")
    # The store now holds version 20: it serves checkpoint 20 and refuses checkpoint 10.
    s = Server(kiln, model, ["--checkpoint", ckpt, "--store", store, "--cache-fraction", "0.01",
                             "--host-fraction", "0.02"])
    check_scores(concurrent(s, bodies[:32], 4), {20: expected[20]}, "restarted on the updated store")
    s.stop()
    r = run([kiln, "serve", model, "--checkpoint", c10, "--store", store] + SET, expect_ok=False)
    if r.returncode == 0 or "version 20" not in r.stdout:
        fail("a store of another version than the checkpoint must be refused")
    # 3. Batching options: a preferred size dispatches at once; a request past its timeout gets 504.
    s = Server(kiln, model, ["--checkpoint", c10, "--max-batch", "64", "--max-queue-delay-us", "5000000",
                             "--preferred-batch-sizes", "4", "--request-timeout-ms", "60000"])
    t0 = time.time()
    check_scores(concurrent(s, bodies[:4], 4), {10: expected[10]}, "preferred batch size")
    if time.time() - t0 > 2.5:
        fail(f"4 requests with --preferred-batch-sizes 4 waited {time.time() - t0:.1f} s (the queue delay is 5 s)")
    if s.metrics()['kiln_batch_size_bucket{le="4"}'] < 1:
        fail("no batch of 4")
    s.stop()
    s = Server(kiln, model, ["--checkpoint", c10, "--max-queue-delay-us", "300000", "--request-timeout-ms", "50"])
    status, body = s.infer(bodies[0])
    if status != 504 or "request-timeout-ms" not in body["error"]:
        fail(f"a request past --request-timeout-ms: {status} {body}")
    s.stop()
    print("batching options: preferred size dispatched at once, timeout answered 504")

    # 4. A model with hashed crosses: the crossed tables stay in the session, the rest are served.
    wd = os.path.join(models, "wide_deep.kiln")
    wd_set = ["--set", "rows_cap=2000", "--set", "crosses=1"]
    wd_ckpt = os.path.join(work, "wd")
    run([kiln, "train", wd, "--batch", "64", "--steps", "5", "--checkpoint", wd_ckpt] + wd_set)
    wd_scores = os.path.join(work, "wd.txt")
    run([kiln, "predict", wd, "--checkpoint", wd_ckpt, "--data", "synthetic", "--samples", "64", "--batch", "64",
         "-o", wd_scores] + wd_set)
    with open(wd_scores) as f:
        wd_expected = [f32(x) for x in f.read().split()]
    wd_reqs = os.path.join(work, "wd.jsonl")
    run([kiln, "data", "requests", wd, "--data", "synthetic", "--samples", "64", "-o", wd_reqs] + wd_set)
    with open(wd_reqs) as f:
        wd_bodies = f.read().splitlines()
    s = Server(kiln, wd, ["--checkpoint", wd_ckpt, "--cache-fraction", "0.1"], sets=wd_set)
    check_scores(concurrent(s, wd_bodies, 4), {0: [None] * 64, 5: wd_expected}, "wide & deep with crosses")
    s.stop()
    print("wide & deep with crosses: scores equal kiln predict")

    # 5. A compiled executable serves too: with its embedded weights, and with a checkpoint.
    exe = os.path.join(work, "dlrm_server")
    run([kiln, "compile", model, "--serve", "--device", "cpu", "--checkpoint", c10, "-o", exe] + SET)
    s = Server(exe, None, ["--cache-fraction", "0.1"], name=MODEL)
    check_scores(concurrent(s, bodies[:64], 4), {10: expected[10]}, "./NAME serve, embedded weights")
    if s.stop() != 0:
        fail("./NAME serve did not exit 0")
    s = Server(exe, None, ["--checkpoint", ckpt, "--store", store, "--cache-fraction", "0.01",
                           "--host-fraction", "0.02"], name=MODEL)
    check_scores(concurrent(s, bodies[:64], 4), {20: expected[20]}, "./NAME serve --store")
    s.stop()
    print("./NAME serve: scores equal kiln predict")

    # 6. Bad stores are errors at start.
    r = run([kiln, "serve", model, "--checkpoint", c10, "--store", os.path.join(work, "none")] + SET, expect_ok=False)
    if r.returncode == 0 or "none" not in r.stdout:
        fail("a missing store must be a clear error")
    junk = os.path.join(work, "junk")
    os.makedirs(junk)
    with open(os.path.join(junk, "CURRENT"), "w") as f:
        f.write("garbage\n")
    r = run([kiln, "serve", model, "--checkpoint", c10, "--store", junk] + SET, expect_ok=False)
    if r.returncode == 0 or "junk" not in r.stdout:
        fail("a corrupt store must be a clear error")
    r = run([kiln, "serve", model, "--checkpoint", c10, "--host-fraction", "0.5"] + SET, expect_ok=False)
    if r.returncode != 2:
        fail("--host-fraction without --store is a usage error")
    print("PASS")


if __name__ == "__main__":
    main()
