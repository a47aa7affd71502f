"""Issue 17, item 6 ("Memory up front") and item 8's bad_alloc case, end to end.

A model with one embedding table of 10^12 rows passed `kiln check`, then `kiln train` died of an
uncaught std::bad_alloc (exit 134) and `kiln dump --stats` printed peak_bytes: 542980, the
activations alone. Now dump --stats counts the table, and train stops at once, exit 1, naming it
and the shortfall; --memory-limit refuses a small model under a tiny limit and trains it under a
large one.

usage: memory_test.py KILN TINY_MODEL WORK_DIR
"""
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aot_common import fail, ok, run  # noqa: E402

HUGE = """model huge {
  dim B
  param rows = 1000000000000
  input dense: f32[B, 13]
  input cats:  ids[B, 1]
  input label: f32[B]
  t = embeddings(rows = [rows], dim = 128)
  logit = mlp(concat(dense, t(cats)), [16, 1], last = identity)
  output logit
  train {
    loss = bce_with_logits(logit, label)
    optimizer = adagrad(lr = 0.01)
    embedding_optimizer = %s
    metrics = [auc]
  }
}
"""

ROWS, DIM, F32 = 10**12, 128, 4
TABLE = ROWS * DIM * F32
DENSE = (16 * (13 + DIM) + 16 + 16 + 1) * F32  # the MLP 141 -> 16 -> 1
SAMPLE = 13 * 4 + 8 + 4  # dense f32, one i64 id, an f32 label


def stats(kiln, model, batch, *extra):
    out, _ = ok([kiln, "dump", model, "--stats", "--batch", str(batch)] + list(extra))
    values = {}
    for line in out.splitlines():
        key, _, value = line.partition(": ")
        if value.isdigit():
            values[key] = int(value)
    for key in ("param_bytes", "optimizer_bytes", "activation_peak_bytes", "workspace_bytes", "data_bytes",
                "peak_bytes"):
        if key not in values:
            fail("dump --stats has no %s" % key, out)
    return values, out


def refused_cleanly(cmd, timeout=60):
    start = time.monotonic()
    rc, out, err = run(cmd, timeout=timeout)
    seconds = time.monotonic() - start
    if rc != 1:  # 134 was the uncaught bad_alloc; a negative code a signal
        fail("%s: expected exit 1, got %d" % (" ".join(cmd), rc), out, err)
    if "bad_alloc" in err or "internal error" in err:
        fail("%s: an exception reached the boundary" % " ".join(cmd), out, err)
    return err, seconds


def main():
    kiln, tiny, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    huge = os.path.join(work, "huge.kiln")
    with open(huge, "w") as f:
        f.write(HUGE % "adagrad")

    # check: the model is valid; it says how much its weights are.
    out, _ = ok([kiln, "check", huge])
    if "ok (" not in out or "weights 466 TiB" not in out:
        fail("kiln check should pass and show the weights", out)

    # dump --stats counts the table and its accumulator (adagrad: one per element).
    s, out = stats(kiln, huge, 256)
    if s["param_bytes"] != TABLE + DENSE:
        fail("param_bytes %d, by hand %d" % (s["param_bytes"], TABLE + DENSE), out)
    if s["optimizer_bytes"] != TABLE + DENSE:
        fail("optimizer_bytes %d, by hand %d" % (s["optimizer_bytes"], TABLE + DENSE), out)
    if s["data_bytes"] != 6 * 256 * SAMPLE:
        fail("data_bytes %d, by hand %d" % (s["data_bytes"], 6 * 256 * SAMPLE), out)
    parts = sum(s[k] for k in ("param_bytes", "optimizer_bytes", "activation_peak_bytes", "workspace_bytes",
                               "data_bytes"))
    if s["peak_bytes"] != parts or not 0 < s["activation_peak_bytes"] < 10**7:
        fail("peak_bytes should be the sum of the kinds", out)

    # Each optimizer's state: rowwise_adagrad one f32 per row, adam two copies, sgd none.
    for optimizer, table_state in (("rowwise_adagrad", ROWS * F32), ("adam", 2 * TABLE), ("sgd", 0)):
        with open(os.path.join(work, "huge_%s.kiln" % optimizer), "w") as f:
            f.write(HUGE % optimizer)
        o, out = stats(kiln, os.path.join(work, "huge_%s.kiln" % optimizer), 256)
        if o["optimizer_bytes"] != table_state + DENSE:
            fail("%s: optimizer_bytes %d, by hand %d" % (optimizer, o["optimizer_bytes"], table_state + DENSE), out)

    # train stops before allocating: at once, exit 1, the table, the need and the shortfall.
    err, seconds = refused_cleanly([kiln, "train", huge, "--steps", "1", "--batch", "256"])
    m = re.search(r"the run needs \S+ \S+ \((\d+) bytes\), \S+ \S+ \((\d+) bytes\) are available: "
                  r"\S+ \S+ \((\d+) bytes\) short", err)
    if not m:
        fail("no need, availability and shortfall in the error", err)
    need, available, short = map(int, m.groups())
    if need != s["peak_bytes"] or short != need - available:
        fail("the error's need %d should be dump's peak_bytes %d and short %d = need - available" %
             (need, s["peak_bytes"], short), err)
    if 'parameter "t.0" f32[1000000000000, 128] (weights): 466 TiB (512000000000000 bytes)' not in err:
        fail("the error should name the table with its rows, dim and bytes", err)
    if seconds > 30:
        fail("the refusal took %.1f s: it should come before anything is allocated" % seconds, err)

    # Under --memory-limit (below what the machine has) the shortfall is exact: 1 GiB given.
    err, _ = refused_cleanly([kiln, "train", huge, "--steps", "1", "--batch", "256", "--memory-limit", "1G"])
    if "(%d bytes) short" % (s["peak_bytes"] - 2**30) not in err or "limit: --memory-limit" not in err:
        fail("--memory-limit 1G: the shortfall should be peak_bytes - 2^30", err)
    # eval (with a checkpoint to load) and a compiled runner refuse it the same way.
    ckpt = os.path.join(work, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    err, _ = refused_cleanly([kiln, "eval", huge, "--checkpoint", ckpt, "--data", "synthetic"])
    if 'parameter "t.0" f32[1000000000000, 128]' not in err:
        fail("kiln eval should name the table", err)
    runner = os.path.join(work, "huge_runner")
    ok([kiln, "compile", huge, "--device", "cpu", "-o", runner])
    err, _ = refused_cleanly([runner, "train", "--steps", "1"])
    if "not enough memory" not in err or 'parameter "t.0"' not in err:
        fail("the compiled runner should refuse the table too", err)

    # --memory-limit on a small model: refused under a tiny limit, trained at exactly peak_bytes,
    # refused one byte under it; a share of the machine is accepted.
    t, out = stats(kiln, tiny, 64)
    train = [kiln, "train", tiny, "--steps", "1", "--batch", "64"]
    err, _ = refused_cleanly(train + ["--memory-limit", "64k"])
    if "raise --memory-limit" not in err:
        fail("a run refused by --memory-limit should say to raise it", err)
    ok(train + ["--memory-limit", str(t["peak_bytes"])])
    err, _ = refused_cleanly(train + ["--memory-limit", str(t["peak_bytes"] - 1)])
    if "1 byte short" not in err:
        fail("one byte under peak_bytes should be 1 byte short", err)
    ok(train + ["--memory-limit", "90%"])
    err, _ = refused_cleanly(train + ["--memory-limit", "0.000001%"])
    if "--memory-limit 1e-06% of" not in err:
        fail("a percentage limit should say what it is a share of", err)
    rc, _, err = run(train + ["--memory-limit", "0%"])
    if rc != 2 or "a percentage must be in (0%, 100%]" not in err:
        fail("--memory-limit 0%% should be a usage error, got %d" % rc, err)
    print("ok")


if __name__ == "__main__":
    main()
