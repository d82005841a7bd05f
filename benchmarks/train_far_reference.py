"""A plain PyTorch yardstick for the far lookup (issue 10): multi-query associative recall with random filler between
the pairs and the questions, in a transformer with full attention, or shaped like V4.1's encoder/decoder (CED).

    DEVICE=cuda MODE=ced FILL=64 python benchmarks/train_far_reference.py 100000 1e-3 12

Arguments: steps, lr, layers. Environment: MODE (full: every layer attends every earlier row; ced: layers below S see
a window of W rows, layer S also publishes one RMS-normed latent per row, as the tiny model's ratio-1 KV source, and
the layers above it attend their window plus every published latent up to their row), S (default 6), W (default 32),
PAIRS (default 6; keys and values from 90 ids each), FILL (filler tokens, default 64), FMIN (draw each sequence's filler
from [FMIN, FILL]; default FILL), FRAMP=START,END (a curriculum: the filler's upper bound grows from FMIN at step START
to FILL at END), B (batch, default 64), D and H (width and heads; default 256 and 4, heads of 64), TIME (seconds, then
stop), EVERY (log every so many steps, default 20), DEVICE, SEED. Each layer: pre-norm K = V attention (one latent of
64, RoPE on the last 16 channels, de-rotated output) and a GELU MLP of 2 x D. Not dsserve's model: it tells what is
hard for any transformer of this size from what is hard for ours. Prints the loss on the asked values (and on those
whose pair lies W or more rows back: "far"), then one JSON line.
"""

import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

SEED = int(os.environ.get("SEED", "0"))
torch.manual_seed(SEED)
torch.set_default_device(os.environ.get("DEVICE", "cpu"))
MODE, W, S = os.environ.get("MODE", "ced"), int(os.environ.get("W", "32")), int(os.environ.get("S", "6"))
FILL = int(os.environ.get("FILL", "64"))
FMIN = int(os.environ.get("FMIN", str(FILL)))
RAMP = [int(v) for v in os.environ.get("FRAMP", "0,0").split(",")]
B, PAIRS, V = int(os.environ.get("B", "64")), int(os.environ.get("PAIRS", "6")), 90
TIME, EVERY = float(os.environ.get("TIME", "1e9")), int(os.environ.get("EVERY", "20"))
steps, lr, layers = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
d, H, hd, rd = int(os.environ.get("D", "256")), int(os.environ.get("H", "4")), 64, 16
if MODE not in ("full", "ced") or not 0 <= FMIN <= FILL or not S < layers:
    sys.exit("want MODE full or ced, 0 <= FMIN <= FILL, S < layers")


def make(rng, fill):
    """(ids padded to the longest filler, asked: a value to guess, far: its pair W or more rows back): the sequences of
    train_mqar.py, written out here so that the yardstick imports nothing of dsserve."""
    keys = rng.sample(range(100, 100 + V), PAIRS)
    vals = [100 + V + rng.randrange(V) for _ in keys]
    ids, asked = [0], [False]
    for k, v in zip(keys, vals):
        ids += [k, v]
        asked += [False, False]
    ids += [400 + rng.randrange(500) for _ in range(fill)]
    asked += [False] * fill
    far = [False] * len(ids)
    for i in rng.sample(range(PAIRS), PAIRS):
        far += [False, len(ids) + 1 - (2 + 2 * i) >= W]
        ids += [keys[i], vals[i]]
        asked += [False, True]
    pad = 1 + 4 * PAIRS + FILL - len(ids)
    return ids + [1] * pad, asked + [False] * pad, far + [False] * pad


def filler_bound(step):
    if RAMP[1] <= 0:
        return FILL
    return FMIN + round((FILL - FMIN) * min(1.0, max(0.0, (step - RAMP[0]) / max(1, RAMP[1] - RAMP[0]))))


def rope(x, inverse=False):  # x [B, T, ..., hd]: rotate the last rd channels by position
    T = x.shape[1]
    ang = torch.arange(T)[:, None] * 10000 ** (-torch.arange(0, rd, 2) / rd)
    ang = -ang if inverse else ang
    shape = (1, T) + (1,) * (x.dim() - 3) + (rd // 2,)
    c, s = ang.cos().view(shape), ang.sin().view(shape)
    t = x[..., -rd:].unflatten(-1, (rd // 2, 2))
    a, b = t[..., 0], t[..., 1]
    return torch.cat((x[..., :-rd], torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)), -1)


class Attn(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i
        self.q, self.o = nn.Linear(d, H * hd, bias=False), nn.Linear(H * hd, d, bias=False)
        self.kv, self.kvn = nn.Linear(d, hd, bias=False), nn.RMSNorm(hd)
        if MODE == "ced" and i == S:  # the KV source: its published latent, apart from its window's
            self.g, self.gn = nn.Linear(d, hd, bias=False), nn.RMSNorm(hd)

    def forward(self, x, published):
        n, T, _ = x.shape
        q = rope(self.q(x).view(n, T, H, hd))
        kv = rope(self.kvn(self.kv(x)))
        t = torch.arange(T)
        causal = t[None, :] <= t[:, None]
        keys, mask = kv, causal
        if MODE == "ced":
            if self.i == S:
                published = rope(self.gn(self.g(x)))
            mask = causal & (t[None, :] > t[:, None] - W)
            if self.i >= S:
                keys, mask = torch.cat((kv, published), 1), torch.cat((mask, causal), 1)
        att = (torch.einsum("bthd,bsd->bhts", q, keys) / 8).masked_fill(~mask, -1e9).softmax(-1)
        o = rope(torch.einsum("bhts,bsd->bthd", att, keys), inverse=True)
        return self.o(o.reshape(n, T, H * hd)), published


class Layer(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.n1, self.n2, self.a = nn.RMSNorm(d), nn.RMSNorm(d), Attn(i)
        self.f = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, published):
        y, published = self.a(self.n1(x), published)
        x = x + y
        return x + self.f(self.n2(x)), published


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, d)
        self.ls = nn.ModuleList(Layer(i) for i in range(layers))
        self.n, self.out = nn.RMSNorm(d), nn.Linear(d, 1000)

    def forward(self, x):
        h, published = self.emb(x), None
        for layer in self.ls:
            h, published = layer(h, published)
        return self.out(self.n(h))


m = Model()
opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
rng, curve, far_curve, t0, st = random.Random(SEED), [], [], time.time(), 0
while st < steps and time.time() - t0 < TIME:
    batch = [make(rng, rng.randint(FMIN, filler_bound(st))) for _ in range(B)]
    x = torch.tensor([b[0] for b in batch])
    w, far = torch.tensor([b[1] for b in batch])[:, 1:].float(), torch.tensor([b[2] for b in batch])[:, 1:].float()
    for g in opt.param_groups:
        g["lr"] = lr * min(1, (st + 1) / 20)
    ce = F.cross_entropy(m(x)[:, :-1].reshape(-1, 1000), x[:, 1:].reshape(-1), reduction="none").view(B, -1)
    loss = (ce * w).sum() / w.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    if st % EVERY == 0:
        far_ce = round(float((ce.detach() * far).sum() / far.sum()), 3) if far.sum() else None
        curve.append([st, round(loss.item(), 3)])
        far_curve.append([st, far_ce, filler_bound(st)])
        print(MODE, st, curve[-1][1], far_curve[-1][1], round(time.time() - t0), flush=True)
    st += 1
print(
    json.dumps(
        {
            "mode": MODE,
            "fill": FILL,
            "fmin": FMIN,
            "framp": RAMP,
            "W": W,
            "S": S,
            "layers": layers,
            "batch": B,
            "lr": lr,
            "seed": SEED,
            "steps": st,
            "seconds": time.time() - t0,
            "curve": curve,
            "far_curve": far_curve,
        }
    )
)
