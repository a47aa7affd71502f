#!/usr/bin/env python3
"""Rewrites one metadata entry of a safetensors checkpoint in place (KEY VALUE), or removes it
(KEY with no VALUE): a hand-made damaged or foreign checkpoint for the tests.

usage: set_metadata.py CHECKPOINT KEY [VALUE]
"""
import json
import struct
import sys

path, key = sys.argv[1], sys.argv[2]
with open(path, "rb") as f:
    blob = f.read()
(n,) = struct.unpack("<Q", blob[:8])
header = json.loads(blob[8:8 + n])
if len(sys.argv) > 3:
    header["__metadata__"][key] = sys.argv[3]
else:
    header["__metadata__"].pop(key, None)
text = json.dumps(header, separators=(",", ":")).encode()
text += b" " * (-len(text) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + blob[8 + n:])
