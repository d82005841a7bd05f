"""A plain PyTorch transformer to compare learnability with (issue 10): how many steps until a keyed in-context lookup
forms, and which part of the tiny model's attention block slows it. Not dsserve's model: a yardstick beside it.

    OMP_NUM_THREADS=2 VAR=mqa_kv_ours OURS=qlora TASK=mqar B=64 python benchmarks/train_mqar_reference.py 600 1e-3 12

Arguments: steps, lr, layers. Environment: TASK (repeat: a random string twice; repeat_var: with 0-8 random tokens
between; mqar: key-value pairs then the keys again, loss on the values), VAR (mha_abs: learned absolute positions;
mha_rope; mqa_kv: one K = V head, RMS-normed, RoPE on the last RD channels, de-rotated output, as the tiny model;
mqa_kv_ours: mqa_kv plus the parts of the tiny model's block listed in OURS: qlora (q = wq_b(rms(wq_a x)), rank QR,
default 96), sink (a per-head logit in the softmax's denominator), wo (grouped low-rank output, 2 groups of rank 64)),
QN=0 (the q LoRA without its RMSNorm: a probe), QLR (a learning-rate multiplier for the query's weights), QAI (a scale
on wq_a's init), QNW (the q RMSNorm's weight at the start, default 1), B (batch, default 16), HALF (tokens a half;
mqar: HALF / 2 pairs), RD (RoPE channels, default 16), DEVICE (default cpu), SEED (default 0).
d = 256, 4 heads of 64, a GELU MLP of 512, pre-norm residuals. Prints the loss every
20 steps, then one JSON line.
"""

import json
import os
import random
import sys

import torch
import torch.nn.functional as F
from torch import nn

SEED = int(os.environ.get("SEED", "0"))
torch.manual_seed(SEED)
TASK = os.environ.get("TASK", "repeat")
VAR = os.environ.get("VAR", "mha_abs")
OURS = os.environ.get("OURS", "qlora,sink,wo").split(",")
V, half, B, steps, lr, layers = 200, 12, 16, int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
half = int(os.environ.get("HALF", str(half)))
B = int(os.environ.get("B", str(B)))
d, H, hd, rd = 256, 4, 64, int(os.environ.get("RD", "16"))


def make(rng):
    if TASK == "repeat_var":
        h = [100 + rng.randrange(V) for _ in range(half)]
        fill = [400 + rng.randrange(300) for _ in range(rng.randrange(9))]
        pad = 8 - len(fill)
        return [0] + h + fill + h + [1] * pad, [False] * (1 + half + len(fill)) + [True] * half + [False] * pad
    if TASK == "repeat":
        h = [100 + rng.randrange(V) for _ in range(half)]
        return [0] + h * 2, [False] * (1 + half) + [True] * half
    n = half // 2
    if TASK in ("farkey", "restate"):
        keys = rng.sample(range(100, 100 + V), n)
        vals = [300 + rng.randrange(V) for _ in keys]
        ids, comp = [0], [False]
        for k, v in zip(keys, vals):
            ids += [k, 90, v, 91]
            comp += [False] * 4
        for i in rng.sample(range(n), n):
            if TASK == "restate":
                ids += [keys[i], 90, vals[i], 91]
                comp += [False, False, True, False]
            else:
                ids += [keys[i], 92, 93, 94, vals[i], 91]
                comp += [False] * 4 + [True, False]
        return ids, comp
    keys = rng.sample(range(100, 100 + V), n)
    vals = [100 + V + rng.randrange(V) for _ in range(n)]
    ids, comp = [0], [False]
    for k, v in zip(keys, vals):
        ids += [k, v]
        comp += [False, False]
    for i in rng.sample(range(n), n):
        ids += [keys[i], vals[i]]
        comp += [False, True]
    return ids, comp


def rope(x, inverse=False):  # x [B, T, ..., hd]: rotate the last rd channels by position
    T = x.shape[1]
    f = 10000 ** (-torch.arange(0, rd, 2, device=x.device) / rd)
    ang = torch.arange(T, device=x.device)[:, None] * f
    if inverse:
        ang = -ang
    shape = (1, T) + (1,) * (x.dim() - 3) + (rd // 2,)
    c, s = ang.cos().view(shape), ang.sin().view(shape)
    t = x[..., -rd:].unflatten(-1, (rd // 2, 2))
    a, b = t[..., 0], t[..., 1]
    return torch.cat((x[..., :-rd], torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)), -1)


class Attn(nn.Module):
    def __init__(s):
        super().__init__()
        s.q = nn.Linear(d, H * hd, bias=False)
        s.o = nn.Linear(H * hd, d, bias=False)
        if VAR.startswith("mqa_kv"):
            s.kv = nn.Linear(d, hd, bias=False)
            s.kvn = nn.RMSNorm(hd)
        if VAR == "mqa_kv_ours":
            QR = int(os.environ.get("QR", "96"))
            s.qa = nn.Linear(d, QR, bias=False)
            s.qn = nn.RMSNorm(QR)
            s.q = nn.Linear(QR if "qlora" in OURS else d, H * hd, bias=False)
            s.sink = nn.Parameter(0.5 * torch.randn(H))
            with torch.no_grad():
                s.qa.weight.mul_(float(os.environ.get("QAI", "1")))
                s.qn.weight.fill_(float(os.environ.get("QNW", "1")))
            s.woa = nn.Parameter(torch.randn(2, 64, 128) / 128**0.5)
            s.o = nn.Linear(128 if "wo" in OURS else H * hd, d, bias=False)
        else:
            s.k = nn.Linear(d, H * hd, bias=False)
            s.v = nn.Linear(d, H * hd, bias=False)

    def forward(s, x):
        Bq, T, _ = x.shape
        q = (
            (s.q(s.qn(s.qa(x))) if os.environ.get("QN", "1") == "1" else s.q(s.qa(x)))
            if VAR == "mqa_kv_ours" and "qlora" in OURS
            else s.q(x)
        ).view(Bq, T, H, hd)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if VAR.startswith("mqa_kv"):
            kv = s.kvn(s.kv(x))
            kv = rope(kv)  # [B, T, hd]
            q = rope(q)
            att = torch.einsum("bthd,bsd->bhts", q, kv) / 8
            att = att.masked_fill(~mask, -1e9)
            if VAR == "mqa_kv_ours" and "sink" in OURS:
                att = torch.cat((att, s.sink[None, :, None, None].expand(Bq, H, T, 1)), -1).softmax(-1)[..., :-1]
            else:
                att = att.softmax(-1)
            o = torch.einsum("bhts,bsd->bthd", att, kv)
            o = rope(o, inverse=True)
            if VAR == "mqa_kv_ours" and "wo" in OURS:
                u = torch.einsum("btgi,goi->btgo", o.reshape(Bq, T, 2, 128), s.woa)
                return s.o(u.reshape(Bq, T, 128))
        else:
            k = s.k(x).view(Bq, T, H, hd)
            v = s.v(x).view(Bq, T, H, hd)
            if VAR == "mha_rope":
                q, k = rope(q), rope(k)
            att = torch.einsum("bthd,bshd->bhts", q, k) / 8
            att = att.masked_fill(~mask, -1e9).softmax(-1)
            o = torch.einsum("bhts,bshd->bthd", att, v)
        return s.o(o.reshape(Bq, T, H * hd))


class Layer(nn.Module):
    def __init__(s):
        super().__init__()
        s.n1, s.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        s.a = Attn()
        s.f = nn.Sequential(nn.Linear(d, 512), nn.GELU(), nn.Linear(512, d))

    def forward(s, x):
        x = x + s.a(s.n1(x))
        return x + s.f(s.n2(x))


class M(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(1000, d)
        s.pos = nn.Embedding(128, d)
        s.ls = nn.ModuleList(Layer() for _ in range(layers))
        s.n = nn.RMSNorm(d)
        s.out = nn.Linear(d, 1000)

    def forward(s, x):
        h = s.emb(x) + (s.pos(torch.arange(x.shape[1], device=x.device)) if VAR == "mha_abs" else 0)
        for l in s.ls:
            h = l(h)
        return s.out(s.n(h))


DEVICE = os.environ.get("DEVICE", "cpu")
m = M().to(DEVICE)
qp = [p for n, p in m.named_parameters() if ".a.qa." in n or ".a.qn." in n or (".a.q." in n and VAR == "mqa_kv_ours")]
rest = [p for p in m.parameters() if all(p is not q for q in qp)]
QLR = float(os.environ.get("QLR", "1"))
opt = torch.optim.AdamW(
    [{"params": rest, "mult": 1.0}, {"params": qp, "mult": QLR}], lr=lr, betas=(0.9, 0.95), weight_decay=0.01
)
print("q params", len(qp), "lr mult", QLR, flush=True)
rng = random.Random(SEED)
curve = []
for st in range(steps):
    bb = [make(rng) for _ in range(B)]
    x = torch.tensor([b[0] for b in bb], device=DEVICE)
    cm = torch.tensor([b[1] for b in bb], device=DEVICE)
    for g in opt.param_groups:
        g["lr"] = g["mult"] * lr * min(1, (st + 1) / 20)
    lo = m(x)[:, :-1]
    tg = x[:, 1:]
    w = cm[:, 1:].float()
    loss = (F.cross_entropy(lo.reshape(-1, 1000), tg.reshape(-1), reduction="none") * w.reshape(-1)).sum() / w.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    if st % 20 == 0 or st == steps - 1:
        curve.append([st, round(loss.item(), 3)])
        print(VAR, st, curve[-1][1], flush=True)
print(
    json.dumps(
        {
            "task": TASK,
            "var": VAR,
            "ours": OURS if VAR == "mqa_kv_ours" else [],
            "seed": SEED,
            "batch": B,
            "steps": steps,
            "lr": lr,
            "layers": layers,
            "curve": curve,
        }
    )
)
