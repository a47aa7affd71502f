"""Checks `kiln predict` on Inputs/dense_out.kiln (whose prediction is twice the dense features,
[B, 13]) against the TSV it read (standard library only).

usage: check_dense_out.py DATA.tsv SCORES.txt

Every input line must have one output line: 13 tab-separated values, each twice log(1 + x) of the
line's dense column (an empty or negative field reads as 0), or 13 'nan' for a line whose label is
not 0 or 1 (a malformed line). Prints 'ok N lines, M nan'.
"""
import math
import struct
import sys


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def fail(message):
    print("check_dense_out: " + message)
    sys.exit(1)


def main():
    data = open(sys.argv[1]).read().splitlines()
    scores = open(sys.argv[2]).read().splitlines()
    if len(scores) != len(data):
        fail("%d output lines for %d input lines" % (len(scores), len(data)))
    nan = 0
    for n, (line, out) in enumerate(zip(data, scores), 1):
        fields = line.split("\t")
        values = out.split("\t")
        if len(values) != 13:
            fail("line %d: %d values, not 13: %r" % (n, len(values), out))
        if fields[0] not in ("0", "1"):
            if values != ["nan"] * 13:
                fail("line %d is malformed, but its output is %r" % (n, out))
            nan += 1
            continue
        for j in range(13):
            field = fields[1 + j]
            x = 0.0 if field == "" or int(field) < 0 else f32(math.log1p(int(field)))
            want = 2 * x
            got = float(values[j])
            if abs(got - want) > 1e-6 * max(1.0, abs(want)):
                fail("line %d column %d: %r, expected %r" % (n, j + 1, got, want))
    print("ok %d lines, %d nan" % (len(scores), nan))


main()
