#!/usr/bin/env python3
"""Test helper (standard library only) for sharded checkpoints, written independently of Kiln's
reader and writer from the format in docs/distributed.md.

  shard_checkpoint.py split IN.safetensors DIR RANKS
      Writes IN's tensors as a sharded checkpoint of RANKS ranks into DIR: tensor i (in file
      order) row-wise, column-wise, table-wise (on rank i % RANKS) or replicated (written by
      rank 0), in turn, with IN's metadata in the index.
  shard_checkpoint.py compare A.safetensors B.safetensors
      Exits 1 unless both hold the same tensors (name, dtype, shape, bytes) and metadata.
"""
import json
import os
import struct
import sys

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n :]
    tensors = []
    for name, e in header.items():
        b, end = e["data_offsets"]
        tensors.append((name, e["dtype"], e["shape"], body[b:end]))
    return tensors, meta


def write(path, tensors, meta):
    header = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors))


def box(raw, shape, esz, offset, extent):
    """The region [offset, offset + extent) of a row-major tensor, element by element."""
    out = bytearray()
    count = 1
    for e in extent:
        count *= e
    for i in range(count):
        rem, idx = i, []
        for e in reversed(extent):
            idx.append(rem % e)
            rem //= e
        idx.reverse()
        flat = 0
        for d, s in enumerate(shape):
            flat = flat * s + idx[d] + offset[d]
        out += raw[flat * esz : (flat + 1) * esz]
    return bytes(out)


def split_range(n, parts, i):
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (1 if i < extra else 0)


def split(src, out_dir, ranks):
    tensors, meta = read(src)
    step = int(meta.get("step", "0"))
    os.makedirs(out_dir, exist_ok=True)
    per_rank = [[] for _ in range(ranks)]
    entries = []
    for i, (name, dtype, shape, raw) in enumerate(tensors):
        esz = SIZES[dtype]
        kind = ["row_wise", "column_wise", "table_wise", "data_parallel"][i % 4]
        if kind == "column_wise" and len(shape) < 2:
            kind = "row_wise"
        if kind == "row_wise" and not shape:
            kind = "data_parallel"
        regions = []  # (rank, offset, extent)
        zero = [0] * len(shape)
        if kind in ("row_wise", "column_wise"):
            dim = 1 if kind == "column_wise" else 0
            for r in range(ranks):
                begin, size = split_range(shape[dim], ranks, r)
                offset, extent = list(zero), list(shape)
                offset[dim], extent[dim] = begin, size
                regions.append((r, offset, extent))
        else:
            regions.append((i % ranks if kind == "table_wise" else 0, zero, list(shape)))
        pieces = []
        for r, offset, extent in regions:
            per_rank[r].append((name, dtype, extent, box(raw, shape, esz, offset, extent)))
            pieces.append({"file": "shard-%08d-r%04d.safetensors" % (step, r), "name": name, "offset": offset,
                           "extent": extent})
        entries.append({"name": name, "dtype": dtype, "shape": shape, "pieces": pieces})
    for r in range(ranks):
        if per_rank[r]:
            write(os.path.join(out_dir, "shard-%08d-r%04d.safetensors" % (step, r)), per_rank[r],
                  {"step": str(step), "rank": str(r)})
    index = {"format": "kiln.sharded_checkpoint", "version": 1, "step": step, "ranks": ranks, "metadata": meta,
             "tensors": entries}
    with open(os.path.join(out_dir, "checkpoint.index.json"), "w") as f:
        json.dump(index, f)


def compare(a, b):
    ta, ma = read(a)
    tb, mb = read(b)
    if ma != mb:
        print("metadata differ: %r vs %r" % (ma, mb))
        return 1
    da = {t[0]: t[1:] for t in ta}
    db = {t[0]: t[1:] for t in tb}
    if da.keys() != db.keys():
        print("tensor names differ: %s" % sorted(set(da) ^ set(db)))
        return 1
    for name in da:
        if da[name] != db[name]:
            print("tensor %s differs" % name)
            return 1
    print("same %d tensors" % len(da))
    return 0


def close(a, b, tol):
    """The same f32 tensors within tol (relative, with an absolute floor of tol / 10): runs whose sums
    went in another order (several ranks against one)."""
    da = {t[0]: t[1:] for t in read(a)[0]}
    db = {t[0]: t[1:] for t in read(b)[0]}
    if da.keys() != db.keys():
        print("tensor names differ: %s" % sorted(set(da) ^ set(db)))
        return 1
    for name in sorted(da):
        (ta, sa, xa), (tb, sb, xb) = da[name], db[name]
        if ta != tb or sa != sb:
            print("tensor %s: %s %s vs %s %s" % (name, ta, sa, tb, sb))
            return 1
        va = struct.unpack("<%df" % (len(xa) // 4), xa)
        vb = struct.unpack("<%df" % (len(xb) // 4), xb)
        for i, (x, y) in enumerate(zip(va, vb)):
            if abs(x - y) > tol / 10 + tol * abs(y):
                print("tensor %s element %d: %r vs %r" % (name, i, x, y))
                return 1
    print("close %d tensors" % len(da))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "split":
        split(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    elif sys.argv[1] == "close":
        sys.exit(close(sys.argv[2], sys.argv[3], float(sys.argv[4])))
    else:
        sys.exit("unknown mode " + sys.argv[1])
