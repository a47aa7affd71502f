#!/usr/bin/env python3
"""`kiln serve` against hostile and broken clients on loopback (issue 35, docs/serving.md).

A small DLRM trains 2 steps; servers of its checkpoint are then checked for:
1. a port in use: a second server on it exits 1 naming the port (no SO_REUSEPORT sharing);
2. --max-request-bytes bounds the decoded body, while it is read: a gzip body that inflates past
   it and a chunked body past it get 413 (the chunked one before its end arrives); gzip, deflate
   and chunked bodies within it are served; an encoding it cannot bound gets 415;
3. slow clients: 20 connections trickling header lines do not hold up other clients; a request
   whose headers or body do not arrive within --header-timeout-ms / --body-timeout-ms gets 408
   and its connection is closed; connections past --max-connections get 503; SIGTERM exits
   within a bound while idle, trickling and half-sent connections are open;
4. non-finite inputs: FP32 1e40 (inf as float32) and 1e400 (inf as a double) get 400;
5. status codes: invalid UTF-8, a numeric datatype, a binary-tensor request, INT8 300, UINT64
   ids of 2^63 and 2^64 - 1 (named as sent) get 400, as do two Content-Length headers, a negative one, Transfer-Encoding beside Content-Length and
   a folded header line; a transfer coding other than chunked gets 501.

usage: serve_hardening_test.py KILN MODELS_DIR WORK_DIR
"""
import gzip
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib

SET = ["--set", "rows_cap=3000"]
MODEL = "dlrm"


class Failure(Exception):
    pass


def fail(msg):
    raise Failure(msg)


def run(cmd):
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout[-3000:])
        fail(f"exit {r.returncode}")
    return r


class Server:
    def __init__(self, kiln, model, args, port="0"):
        cmd = [kiln, "serve", model, "--port", port] + SET + args
        print(" ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.proc.kill()
            fail(f"no 'listening on' line: {line!r} {self.proc.stderr.read()}")
        self.port = int(line.strip().rsplit(":", 1)[1])

    def infer(self, body, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        c.request("POST", f"/v2/models/{MODEL}/infer", body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def stop(self, within):
        """SIGTERM; the exit code, failing unless the process is gone within `within` seconds."""
        t0 = time.time()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            fail(f"the server did not exit within {within} s of SIGTERM: {self.proc.stderr.read()[-2000:]}")
        print(f"SIGTERM: exit {code} after {time.time() - t0:.2f} s")
        return code

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def connect(self):
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


def read_response(sock, timeout=10):
    """(status, headers dict, body) of one response on `sock`, or None if it closed first."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


def raw(server, data, timeout=10):
    """Sends `data` on a fresh connection; the response's status and JSON body."""
    with server.connect() as sock:
        sock.sendall(data)
        r = read_response(sock, timeout)
    if r is None:
        fail(f"no response to {data[:200]!r}")
    status, _, body = r
    return status, body


def expect_error(what, status, body, want):
    try:
        message = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        fail(f"{what}: got {status} with a body that is not a JSON error: {body[:300]!r}")
    if status != want:
        fail(f"{what}: got {status} ({message}), expected {want}")
    print(f"{what}: {status} {message}")


def closed_within(sock, seconds):
    """Reads until the server closes `sock`; the status it answered first (or None), else fails."""
    deadline = time.time() + seconds
    sock.settimeout(0.2)
    data = b""
    while time.time() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None
        data += chunk
    fail(f"the server kept the connection open {seconds} s (it sent {data[:200]!r})")


def post_head(extra, length=None):
    h = f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if length is not None:
        h += f"Content-Length: {length}\r\n"
    return (h + extra + "\r\n").encode()


def chunked(data, size=4096):
    out = b""
    for i in range(0, len(data), size):
        part = data[i:i + size]
        out += b"%x\r\n" % len(part) + part + b"\r\n"
    return out + b"0\r\n\r\n"


def check_port(kiln, model, ckpt, s, good, bodies, want):
    print(f"a second server on port {s.port}", flush=True)
    second = subprocess.Popen([kiln, "serve", model, "--checkpoint", ckpt, "--port", str(s.port)] + SET,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = second.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        second.kill()
        out, err = second.communicate()
    if second.returncode != 1 or "listening on" in out or str(s.port) not in err:
        fail(f"a second server on port {s.port}: exit {second.returncode}, stdout {out!r}, stderr {err[-500:]!r}")
    print(f"port in use: exit 1, {err.strip().splitlines()[-1]}")


def check_body_limits(kiln, model, ckpt, s, good, bodies, want):
    for name, encode in [("gzip", gzip.compress), ("deflate", zlib.compress)]:
        status, data = s.infer(encode(good), {"Content-Encoding": name})
        if status != 200 or json.loads(data)["outputs"][0]["data"] != want:
            fail(f"a {name} request: {status} {data[:300]!r}")
    pad = json.dumps({"inputs": [], "pad": "x" * 5_000_000}).encode()
    bomb = gzip.compress(pad)
    print(f"gzip: {len(bomb)} bytes inflating to {len(pad)}")
    status, data = s.infer(bomb, {"Content-Encoding": "gzip"})
    expect_error("gzip body inflating over --max-request-bytes", status, data, 413)
    status, data = s.infer(good, {"Content-Encoding": "br"})
    expect_error("an encoding the server cannot bound", status, data, 415)
    status, data = raw(s, post_head("Transfer-Encoding: chunked\r\n") + chunked(good, 100))
    if status != 200 or json.loads(data)["outputs"][0]["data"] != want:
        fail(f"a chunked request: {status} {data[:300]!r}")
    status, data = raw(s, post_head("Transfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n") +
                       chunked(gzip.compress(good), 100))
    if status != 200 or json.loads(data)["outputs"][0]["data"] != want:
        fail(f"a chunked gzip request: {status} {data[:300]!r}")
    # 250 KB of chunks and no last chunk: the 413 comes while the body is still arriving.
    with s.connect() as sock:
        sock.sendall(post_head("Transfer-Encoding: chunked\r\n") + chunked(b"x" * 250_000)[:-5])
        r = read_response(sock, timeout=5)
    if r is None:
        fail("a chunked body over --max-request-bytes: the connection closed without an answer")
    expect_error("chunked body over --max-request-bytes, unfinished", r[0], r[2], 413)
    status, data = raw(s, post_head("Transfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n") + chunked(bomb))
    expect_error("chunked gzip body inflating over --max-request-bytes", status, data, 413)
    status, data = raw(s, post_head("", 300000))
    expect_error("Content-Length over --max-request-bytes", status, data, 413)


def check_non_finite(kiln, model, ckpt, s, good, bodies, want):
    def with_dense(text):
        b = json.loads(bodies[0])
        for x in b["inputs"]:
            if x["name"] == "dense":
                x["data"] = ["@"] + x["data"][1:]
        return json.dumps(b).replace('"@"', text).encode()

    status, data = s.infer(with_dense("1e40"))
    expect_error("FP32 1e40", status, data, 400)
    status, data = s.infer(with_dense("1e400"))
    expect_error("1e400", status, data, 400)
    status, data = s.infer(with_dense("-1e39"))
    expect_error("FP32 -1e39", status, data, 400)


def check_status_codes(kiln, model, ckpt, s, good, bodies, want):
    status, data = s.infer(good.replace(b'"dense"', b'"dense\xff"'))
    expect_error("invalid UTF-8", status, data, 400)
    status, data = s.infer(b'{"inputs": [], "id": "\xc3\x28"}')
    expect_error("invalid UTF-8 in the id", status, data, 400)

    def with_input(name, **changes):
        b = json.loads(bodies[0])
        for x in b["inputs"]:
            if x["name"] == name:
                x.update(changes)
        return json.dumps(b).encode()

    status, data = s.infer(with_input("dense", datatype=5))
    expect_error("a numeric datatype", status, data, 400)
    status, data = s.infer(with_input("cats.0", datatype="INT8", data=[300]))
    expect_error("INT8 300", status, data, 400)
    status, data = s.infer(with_input("cats.0", datatype="UINT32", data=[2 ** 32]))
    expect_error("UINT32 2^32", status, data, 400)
    # Ids of 2^63 or more (in UINT64's range, beyond the table's rows) are named as sent: they
    # printed as -9223372036854775808, a cast of a double past int64.
    # (2^64 - 1 rounds to 2^64 as a double, past UINT64's range: that message names it too.)
    for sent, want in ((2 ** 63, "id %d at position 0 is out of range [0, " % 2 ** 63),
                       (2 ** 64 - 1, "value %d at position 0 is out of the range of UINT64" % (2 ** 64 - 1))):
        status, data = s.infer(with_input("cats.0", datatype="UINT64", data=[sent]))
        expect_error("UINT64 id %d" % sent, status, data, 400)
        message = json.loads(data)["error"]
        if want not in message:
            fail(f"UINT64 id {sent}: the message does not name the value as sent: {message}")
    header = json.dumps({"inputs": [{"name": "dense", "shape": [1, 13], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 52}}]}).encode()
    status, data = s.infer(header + b"\x00\xff" * 26, {"Inference-Header-Content-Length": str(len(header))})
    expect_error("a binary-tensor request", status, data, 400)
    status, data = raw(s, post_head(f"Content-Length: {len(good)}\r\n", len(good)) + good)
    expect_error("two Content-Length headers", status, data, 400)
    status, data = raw(s, post_head("", "-5") + good)
    expect_error("Content-Length: -5", status, data, 400)
    status, data = raw(s, post_head("", "1e3") + good)
    expect_error("Content-Length: 1e3", status, data, 400)
    status, data = raw(s, post_head("Transfer-Encoding: chunked\r\n", len(good)) + chunked(good))
    expect_error("Transfer-Encoding beside Content-Length", status, data, 400)
    status, data = raw(s, post_head("Transfer-Encoding: gzip, chunked\r\n") + chunked(good))
    expect_error("Transfer-Encoding: gzip, chunked", status, data, 501)
    status, data = raw(s, post_head("X-Folded: a\r\n b\r\n", len(good)) + good)
    expect_error("a folded header line", status, data, 400)
    status, data = s.infer(good)
    if status != 200:
        fail(f"a good request after the bad ones: {status}")


def check_slow_clients(kiln, model, ckpt, s, good, bodies, want):
    """20 connections sending a header line every second hold no thread the others need (the
    default connection settings)."""
    s = Server(kiln, model, ["--checkpoint", ckpt])
    try:
        stop_trickling = threading.Event()
        tricklers = [s.connect() for _ in range(20)]

        def trickle():
            for sock in tricklers:
                sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\n".encode())
            k = 0
            while not stop_trickling.wait(1.0):
                for sock in tricklers:
                    try:
                        sock.sendall(f"X-Slow-{k}: {k}\r\n".encode())
                    except OSError:
                        pass
                k += 1

        t = threading.Thread(target=trickle)
        t.start()
        try:
            time.sleep(1.5)
            t0 = time.time()
            result = {}
            worker = threading.Thread(target=lambda: result.setdefault("r", s.infer(good)))
            worker.daemon = True
            worker.start()
            worker.join(timeout=3)
            if "r" not in result or result["r"][0] != 200:
                fail(f"20 trickling connections held up a good request: {result.get('r')} after "
                     f"{time.time() - t0:.1f} s")
            print(f"beside 20 trickling connections a request was answered in {time.time() - t0:.2f} s")
        finally:
            stop_trickling.set()
            t.join()
            for sock in tricklers:
                sock.close()

        if s.stop(within=10) != 0:
            fail("SIGTERM after the slow clients: exit not 0")
    finally:
        s.kill()


def check_timeouts_and_cap(kiln, model, ckpt, s, good, bodies, want):
    """--header-timeout-ms, --body-timeout-ms and --max-connections, short for the test; SIGTERM
    with slow connections open."""
    s = Server(kiln, model, ["--checkpoint", ckpt, "--header-timeout-ms", "1000", "--body-timeout-ms", "1000",
                             "--max-connections", "8"])
    try:
        with s.connect() as sock:  # a header line every 0.3 s: 408 after about 1 s
            t0 = time.time()
            sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\n".encode())
            stop_trickling = threading.Event()

            def slow_headers():
                k = 0
                while not stop_trickling.wait(0.3):
                    try:
                        sock.sendall(f"X-Slow-{k}: {k}\r\n".encode())
                    except OSError:
                        return
                    k += 1

            t = threading.Thread(target=slow_headers)
            t.start()
            try:
                code = closed_within(sock, 4)
            finally:
                stop_trickling.set()
                t.join()
            if code != 408:
                fail(f"headers past --header-timeout-ms: answered {code}, expected 408")
            print(f"headers past --header-timeout-ms: 408 and closed after {time.time() - t0:.2f} s")
        with s.connect() as sock:  # the headers and half the body, then nothing: 408 after about 1 s
            t0 = time.time()
            sock.sendall(post_head("", len(good)) + good[:len(good) // 2])
            code = closed_within(sock, 4)
            if code != 408:
                fail(f"a body past --body-timeout-ms: answered {code}, expected 408")
            print(f"a body past --body-timeout-ms: 408 and closed after {time.time() - t0:.2f} s")
        idle = [s.connect() for _ in range(8)]
        time.sleep(0.3)
        with s.connect() as sock:
            r = read_response(sock, timeout=5)
            if r is None:
                fail("a connection past --max-connections was closed without an answer")
            expect_error("a connection past --max-connections", r[0], r[2], 503)
        for sock in idle:
            sock.close()
        time.sleep(0.3)
        status, data = s.infer(good)
        if status != 200:
            fail(f"a request once the idle connections closed: {status} {data[:200]!r}")
        # SIGTERM with an idle keep-alive connection, one half through its headers and one half
        # through its body: the server exits 0 within the body timeout.
        keep = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        keep.request("POST", f"/v2/models/{MODEL}/infer", body=good, headers={"Content-Type": "application/json"})
        keep.getresponse().read()
        half_head = s.connect()
        half_head.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n".encode())
        half_body = s.connect()
        half_body.sendall(post_head("", len(good)) + good[:10])
        time.sleep(0.2)
        if s.stop(within=3) != 0:
            fail("SIGTERM with slow connections open: exit not 0")
        for sock in (half_head, half_body):
            sock.close()
        keep.close()
    finally:
        s.kill()


def main():
    kiln, models, work = sys.argv[1:4]
    model = os.path.join(models, "dlrm.kiln")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ckpt = os.path.join(work, "ckpt")
    run([kiln, "train", model, "--batch", "64", "--steps", "2", "--checkpoint", ckpt, "--seed", "3"] + SET)
    reqs = os.path.join(work, "requests.jsonl")
    run([kiln, "data", "requests", model, "--data", "synthetic", "--samples", "4", "-o", reqs] + SET)
    with open(reqs) as f:
        bodies = f.read().splitlines()
    good = bodies[0].encode()

    s = Server(kiln, model, ["--checkpoint", ckpt, "--max-request-bytes", "200000"])
    status, data = s.infer(good)
    if status != 200:
        fail(f"a good request: {status} {data[:300]!r}")
    want = json.loads(data)["outputs"][0]["data"]

    checks = [check_port, check_body_limits, check_non_finite, check_status_codes, check_slow_clients,
              check_timeouts_and_cap]
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
    failed = []
    for check in checks:
        if only and check.__name__[len("check_"):] not in only:
            continue
        print(f"== {check.__name__}", flush=True)
        try:
            check(kiln, model, ckpt, s, good, bodies, want)
        except Failure as e:
            print(f"FAIL: {check.__name__}: {e}", flush=True)
            failed.append(check.__name__)
    if s.stop(within=10) != 0:
        failed.append("the server's exit code")
    if failed:
        sys.exit(f"FAIL: {', '.join(failed)}")
    print("PASS")


if __name__ == "__main__":
    main()
