"""M1-small's PyTorch peer on the CPU: one MoE layer as models/moe_layer.kiln's defaults.

B tokens x: [B, 512]; router weight [8, 512] (no bias), logits = x W^T in f32; each token picks
its top-2 experts by logit and weighs them by the softmax over those two logits (Kiln's
moe_router with score = softmax, pre_softmax = false: renormalized among the chosen, as Mixtral;
docs/moe.md). Each expert is a SwiGLU FFN: h = x fc1[e] ([512, 2*1792], gate then up),
a = silu(h_gate) * h_up, y_e = a fc2[e] ([1792, 512]). The output sums prob * y_e over a token's
experts in f32. loss = mse(y, target) (mean over all elements), SGD lr 0.01 (p -= lr g) on the
router and both expert weights. Parameters start normal(0, 0.02) as in Kiln. x is an input, not
a parameter: no gradient is computed for it (nor does Kiln's step need one).

The experts run as a loop over experts (argsort of the routed slots, index_select of each
expert's tokens, index_add_ of its weighted output), dropless.

Modes: eager_f32, eager_bf16 (torch.autocast("cpu", bfloat16) around the expert GEMMs; routing
stays f32), compile_f32 and compile_bf16: torch.compile of the router and of one expert's
work (gather, FFN, weighting) with a dynamic token count, so that the same compiled code serves
every expert whatever its share; the loop and the expert counts stay in Python. Compilation
happens in the warm-up steps and is not timed.

Prints `PEER {json}` with tokens_per_s = tokens / (median step time over the timed steps).

  python bench/peers/moe_torch_cpu.py --mode eager_f32 --tokens 1024 --threads 2 --steps 10
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

MODES = ("eager_f32", "eager_bf16", "compile_f32", "compile_bf16")


def route(x, w_router, topk):
    """probs [N, k] (softmax over the chosen logits), experts [N, k], all in f32."""
    logits = x.float() @ w_router.float().t()
    top_logits, experts = logits.topk(topk, dim=-1)
    return top_logits.softmax(dim=-1), experts


def expert_contrib(x, idx, gate, w1, w2):
    """One expert's output for its tokens idx, weighted by their gate, in f32: [n, H]."""
    xe = x.index_select(0, idx)
    h = xe @ w1
    g, u = h.chunk(2, dim=-1)
    y = (F.silu(g) * u) @ w2
    return y.float() * gate.unsqueeze(1)


class MoE:
    def __init__(self, hidden, ffn, experts, topk, gen):
        def normal(*shape):
            return (torch.randn(*shape, generator=gen) * 0.02).requires_grad_()

        self.topk, self.experts = topk, experts
        self.w_router = normal(experts, hidden)
        self.fc1 = normal(experts, hidden, 2 * ffn)
        self.fc2 = normal(experts, ffn, hidden)
        self.params = [self.w_router, self.fc1, self.fc2]
        self.route = route
        self.expert = expert_contrib

    def compile(self):
        self.route = torch.compile(route, dynamic=False)
        self.expert = torch.compile(expert_contrib, dynamic=True)

    def __call__(self, x, bf16):
        with torch.autocast("cpu", enabled=False):
            probs, experts = self.route(x, self.w_router, self.topk)
        slots = experts.reshape(-1)  # slot s = n * k + j
        order = slots.argsort(stable=True)  # expert-major, token order within an expert
        counts = torch.bincount(slots, minlength=self.experts).tolist()
        tokens = order // self.topk
        gates = probs.reshape(-1).index_select(0, order)
        out = torch.zeros(x.shape, dtype=torch.float32)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            idx, gate = tokens[start:start + c], gates[start:start + c]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                contrib = self.expert(x, idx, gate, self.fc1[e], self.fc2[e])
            out.index_add_(0, idx, contrib)
            start += c
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=MODES, default="eager_f32")
    ap.add_argument("--tokens", "--batch", dest="tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1792)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    ap.add_argument("--batches", type=int, default=3, help="pre-generated batches, cycled")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    bf16 = a.mode.endswith("bf16")
    layer = MoE(a.hidden, a.ffn, a.experts, a.topk, gen)
    if a.mode.startswith("compile"):
        layer.compile()
    batches = [(torch.randn(a.tokens, a.hidden, generator=gen), torch.randn(a.tokens, a.hidden, generator=gen))
               for _ in range(a.batches)]
    lr = 0.01

    def step(b):
        x, target = b
        y = layer(x, bf16)
        loss = F.mse_loss(y, target)
        for p in layer.params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in layer.params:
                p.add_(p.grad, alpha=-lr)
        return loss.detach()

    t0 = time.perf_counter()
    for i in range(a.warmup):
        step(batches[i % len(batches)])
    warm_s = time.perf_counter() - t0
    times = []
    loss = None
    for i in range(a.steps):
        t = time.perf_counter()
        loss = step(batches[(a.warmup + i) % len(batches)])
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    out = dict(workload="m1_small", mode=a.mode, tokens=a.tokens, hidden=a.hidden, ffn=a.ffn, experts=a.experts,
               topk=a.topk, threads=a.threads, steps=a.steps, warmup=a.warmup,
               tokens_per_s=round(a.tokens / med, 1), ms_per_step=round(med * 1e3, 2),
               ms_min=round(min(times) * 1e3, 2), ms_max=round(max(times) * 1e3, 2), warmup_s=round(warm_s, 2),
               loss=round(float(loss), 6), torch=torch.__version__)
    print("PEER " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
