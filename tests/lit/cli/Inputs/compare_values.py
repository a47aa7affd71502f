"""Compares numbers two tool outputs print: each NAME's value in A against the same NAME's in B,
to a relative tolerance. NAMEs are read as `NAME: VALUE` lines or as `"NAME":VALUE` fields of
JSON lines (every occurrence, in order).

usage: compare_values.py A B TOLERANCE NAME...
"""
import re
import sys


def values(path, name):
    text = open(path).read()
    found = re.findall(r'^%s: ([-+0-9.eE]+|nan|inf)$' % re.escape(name), text, re.M)
    found += re.findall(r'"%s":([-+0-9.eE]+)' % re.escape(name), text)
    return [float(v) for v in found]


def main():
    a_path, b_path, tolerance, names = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:]
    bad = 0
    for name in names:
        a, b = values(a_path, name), values(b_path, name)
        if not a or len(a) != len(b):
            print("%s: %d value(s) in %s, %d in %s" % (name, len(a), a_path, len(b), b_path))
            bad += 1
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            if abs(x - y) > tolerance * max(abs(x), abs(y), 1e-12):
                print("%s[%d]: %r vs %r" % (name, i, x, y))
                bad += 1
    if bad:
        sys.exit(1)
    print("equal within %g: %s" % (tolerance, ", ".join(names)))


main()
