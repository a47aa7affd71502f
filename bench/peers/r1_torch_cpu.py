"""R1-small's PyTorch peer on the CPU: one DLRM-DCNv2 training step as models/dlrm_dcnv2.kiln.

26 EmbeddingBag tables (sum pooling, dim 128, rows = min(MLPerf rows, rows_cap)), fixed
multi-hot sizes (the model file's `hot`), bottom MLP 13-512-256-128 (ReLU after each layer), three
DCNv2 low-rank cross layers x0 * (U (V x) + b) + x of rank 512, top MLP 1024-1024-512-256-1
(ReLU between, none after the last), BCE with logits. The optimizers are the model file's, with
ir/ops/optimizer.cc's formulas (eps 1e-8 both):
  dense:      Adagrad   s = 0.1 at first; s += g^2; p -= lr g / (sqrt(s) + eps)
  embeddings: row-wise  duplicates of a row summed first, then for each touched row
              s_r += mean(g_r^2); w_r -= lr g_r / (sqrt(s_r) + eps)   (s_r = 0 at first)
both with lr 0.01. The embedding update is done by hand over the tables' sparse gradients.

Modes: eager_f32, eager_bf16 (torch.autocast("cpu", bfloat16) around the dense part: the
embeddings and their update stay f32, as in the GPU peer), compile_f32 and compile_bf16
(torch.compile of the dense part, forward and backward; the compilation happens in the warm-up
steps and is not timed).

Prints `PEER {json}` with samples_per_s = batch / (median step time over the timed steps).

  python bench/peers/r1_torch_cpu.py --mode eager_f32 --batch 1024 --threads 2 --steps 6
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# models/dlrm_dcnv2.kiln's `rows` and `hot`.
ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956,
        405282, 10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152,
        12973, 108, 36]
HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
DIM = 128
CROSS_RANK = 512
BOTTOM = [512, 256, DIM]
TOP = [1024, 1024, 512, 256, 1]
LR = 0.01
EPS = 1e-8
DENSE_INIT_ACC = 0.1
MODES = ("eager_f32", "eager_bf16", "compile_f32", "compile_bf16")


def linear(n_in, n_out, bias=True):
    # Kiln's linear: xavier_uniform weight, zero bias.
    layer = nn.Linear(n_in, n_out, bias=bias)
    nn.init.xavier_uniform_(layer.weight)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


class Dense(nn.Module):
    """Everything after the lookups: bottom MLP, concat, cross layers, top MLP."""

    def __init__(self):
        super().__init__()
        sizes = [13] + BOTTOM
        self.bottom = nn.ModuleList(linear(a, b) for a, b in zip(sizes, sizes[1:]))
        width = DIM * (len(ROWS) + 1)  # 3456
        self.cross_v = nn.ModuleList(linear(width, CROSS_RANK, bias=False) for _ in range(3))
        self.cross_u = nn.ModuleList(linear(CROSS_RANK, width) for _ in range(3))
        sizes = [width] + TOP
        self.top = nn.ModuleList(linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, dense, pooled):
        h = dense
        for layer in self.bottom:
            h = F.relu(layer(h))  # mlp's `last` defaults to its act: the bottom ends in a ReLU
        x0 = torch.cat([h] + pooled, dim=1)
        x = x0
        for v, u in zip(self.cross_v, self.cross_u):
            x = x0 * u(v(x)) + x
        for i, layer in enumerate(self.top):
            x = layer(x)
            if i + 1 < len(self.top):
                x = F.relu(x)
        return x.squeeze(1)


class Tables(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.bags = nn.ModuleList()
        for n in rows:
            bag = nn.EmbeddingBag(n, DIM, mode="sum", sparse=True)
            bound = (1.0 / n) ** 0.5  # Kiln's table init: uniform +-sqrt(1/rows)
            nn.init.uniform_(bag.weight, -bound, bound)
            self.bags.append(bag)
        # Row-wise Adagrad's accumulators: one value per row, 0 at first.
        self.acc = [torch.zeros(n) for n in rows]

    def forward(self, ids):
        return [bag(i) for bag, i in zip(self.bags, ids)]

    @torch.no_grad()
    def rowwise_adagrad(self):
        for bag, acc in zip(self.bags, self.acc):
            g = bag.weight.grad  # sparse: one row of the pooled gradient per id occurrence
            # Combine the occurrences of each row (torch.unique + index_add is quicker here
            # than g.coalesce(), which does the same).
            rows, inverse = torch.unique(g._indices()[0], return_inverse=True)
            vals = torch.zeros(rows.numel(), DIM).index_add_(0, inverse, g._values())
            acc.index_add_(0, rows, vals.pow(2).mean(dim=1))
            step = acc.index_select(0, rows).sqrt_().add_(EPS).reciprocal_().mul_(-LR)
            bag.weight.index_add_(0, rows, vals * step.unsqueeze(1))
            bag.weight.grad = None


def make_dense_optimizer(params):
    kw = dict(lr=LR, eps=EPS, initial_accumulator_value=DENSE_INIT_ACC)
    try:
        return torch.optim.Adagrad(params, fused=True, **kw), "fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adagrad(params, foreach=True, **kw), "foreach"


def make_batches(n, batch, rows, gen):
    out = []
    for _ in range(n):
        dense = torch.randn(batch, 13, generator=gen)
        ids = [torch.randint(0, r, (batch, h), generator=gen) for r, h in zip(rows, HOT)]
        label = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append((dense, ids, label))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=MODES, default="eager_f32")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--rows-cap", type=int, default=100000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation included)")
    ap.add_argument("--batches", type=int, default=3, help="pre-generated batches, cycled")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    rows = [min(r, a.rows_cap) for r in ROWS]
    bf16 = a.mode.endswith("bf16")
    compiled = a.mode.startswith("compile")

    tables = Tables(rows)
    dense = Dense()
    opt, opt_kind = make_dense_optimizer(list(dense.parameters()))
    dense_fn = torch.compile(dense, dynamic=False) if compiled else dense
    batches = make_batches(a.batches, a.batch, rows, gen)

    def step(b):
        x, ids, label = b
        pooled = tables(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logit = dense_fn(x, pooled)
        loss = F.binary_cross_entropy_with_logits(logit.float(), label)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tables.rowwise_adagrad()
        return loss.detach()

    t0 = time.perf_counter()
    for i in range(a.warmup):
        step(batches[i % len(batches)])
    warm_s = time.perf_counter() - t0
    times, losses = [], []
    for i in range(a.steps):
        t = time.perf_counter()
        loss = step(batches[(a.warmup + i) % len(batches)])
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    med = statistics.median(times)
    out = dict(workload="r1_small", mode=a.mode, batch=a.batch, rows_cap=a.rows_cap, threads=a.threads,
               steps=a.steps, warmup=a.warmup, samples_per_s=round(a.batch / med, 1),
               ms_per_step=round(med * 1e3, 2), ms_min=round(min(times) * 1e3, 2),
               ms_max=round(max(times) * 1e3, 2), warmup_s=round(warm_s, 2), loss=round(losses[-1], 5),
               dense_optimizer=opt_kind, torch=torch.__version__)
    print("PEER " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
