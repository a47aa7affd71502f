#!/usr/bin/env python3
"""Checks the IR text form over every .mlir file under a folder (each `// -----` chunk alone).

  roundtrip: print(parse(x)) == print(parse(print(parse(x)))), through `kiln opt`.
  mlir-opt:  `mlir-opt-19 --allow-unregistered-dialect` accepts our printed IR, and what it
             prints back (generic form, numbered values) parses with `kiln opt` again.
             Exits 77 (ctest SKIP_RETURN_CODE) when mlir-opt-19 is not installed.

Chunks that fail to parse are skipped only in files whose RUN lines expect failure (`not`);
anywhere else a parse failure is a test failure.
"""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys

SKIP = 77


def chunks(text):
    parts, current = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith("// -----"):
            parts.append("".join(current))
            current = []
        else:
            current.append(line)
    parts.append("".join(current))
    return [p for p in parts if re.search(r"func\.func|module", p)]


def run(cmd, text):
    p = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--mlir-opt", default=None, help="also check with this mlir-opt")
    args = ap.parse_args()

    mlir_opt = None
    if args.mlir_opt:
        mlir_opt = shutil.which(args.mlir_opt)
        if not mlir_opt:
            print(f"{args.mlir_opt} not found: skipping")
            return SKIP

    files = sorted(pathlib.Path(args.root).rglob("*.mlir"))
    failures, checked = [], 0
    for f in files:
        text = f.read_text()
        expects_errors = re.search(r"RUN:.*\bnot\b", text) is not None
        for i, chunk in enumerate(chunks(text)):
            where = f"{f}#{i}"
            rc, once, err = run([args.kiln, "opt", "-"], chunk)
            if rc != 0:
                if not expects_errors:
                    failures.append(f"{where}: does not parse:\n{err}")
                continue
            checked += 1
            rc, twice, err = run([args.kiln, "opt", "-"], once)
            if rc != 0:
                failures.append(f"{where}: printed IR does not parse again:\n{err}\n{once}")
            elif twice != once:
                failures.append(f"{where}: print(parse(print(parse(x)))) differs:\n{once}\n---\n{twice}")
            if mlir_opt:
                rc, mlir_out, err = run([mlir_opt, "--allow-unregistered-dialect"], once)
                if rc != 0:
                    failures.append(f"{where}: mlir-opt rejects our IR:\n{err}\n{once}")
                    continue
                rc, _, err = run([args.kiln, "opt", "-"], mlir_out)
                if rc != 0:
                    failures.append(f"{where}: kiln cannot read mlir-opt's output:\n{err}\n{mlir_out}")
    for msg in failures:
        print(msg, file=sys.stderr)
    print(f"{checked} chunks from {len(files)} files checked, {len(failures)} failures")
    if checked == 0:
        print("no .mlir file was checked", file=sys.stderr)
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
