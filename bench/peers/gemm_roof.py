"""The machine's measured GEMM roof, with torch: the best GFLOP/s of C = A B in f32 and bf16.

Shapes (M x K x N): square 2048 and 4096, and a DLRM-like 4096 x 3456 x 1024 (a batch of 4096
through the first top-MLP layer of R1). Each shape runs a few untimed products, then --reps
timed ones; a shape's figure is its best single product, the roof the best over the shapes.
Prints `ROOF {json}`: f32_gflops, bf16_gflops (the roofs) and every shape's figure.

  python bench/peers/gemm_roof.py --threads 2
"""
import argparse
import json
import sys
import time

import torch

SHAPES = [(2048, 2048, 2048), (4096, 4096, 4096), (4096, 3456, 1024)]


def best_gflops(m, k, n, dtype, reps, warmup):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    c = torch.empty(m, n, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2.0 * m * k * n / best / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="timed products per shape and dtype")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtypes", default="f32,bf16",
                    help="comma-separated: f32, bf16 (leave bf16 out on a CPU without bf16 instructions, where "
                         "torch's bf16 products run at a few GFLOP/s and take many minutes)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = dict(threads=a.threads, torch=torch.__version__, cpu=torch.backends.cpu.get_cpu_capability(), shapes={})
    wanted = set(a.dtypes.split(","))
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        if name not in wanted:
            continue
        best = 0.0
        for m, k, n in SHAPES:
            g = best_gflops(m, k, n, dtype, a.reps, a.warmup)
            out["shapes"][f"{name}_{m}x{k}x{n}"] = round(g, 1)
            best = max(best, g)
        out[f"{name}_gflops"] = round(best, 1)
    print("ROOF " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
