"""Where MXFP4 decode GEMMs lose bandwidth: formats x T on the tile path, and a raw stream of the same bytes."""

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from dsserve.bench.device_timing import graph_ms
from dsserve.kernels import grouped_moe as G

D, INTER, E, K = 5120, 2304, 48, 6
OUT = os.environ.get("OUT", "/tmp")
res = {}


@triton.jit
def _stream(w_ptr, o_ptr, n_rows, ROW: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, STEPS: tl.constexpr):
    # each program sums a [BR, ROW] strip in [BR, BC] tiles (the grouped kernels' weight-tile shape)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros((BR, BC), tl.int32)
    for t in range(STEPS):
        c = t * BC + tl.arange(0, BC)
        acc += tl.load(w_ptr + r[:, None].to(tl.int64) * ROW + c[None, :]).to(tl.int32)
    tl.store(o_ptr + tl.program_id(0), tl.sum(acc))


g = torch.Generator(device="cuda").manual_seed(0)
dense = [torch.randn(E, o, i, device="cuda", generator=g) * i**-0.5 for o, i in ((INTER, D), (INTER, D), (D, INTER))]
for fmt in ("mxfp4", "fp8", "bf16"):
    exs = [G.ExpertWeights.from_dense(*dense, fmt) for _ in range(2)]
    per = sum(w[0].numel() * w.element_size() + (s[0].numel() if s is not None else 0) for w, s in exs[0]._pairs())
    for t in (1, 8, 32):
        xs = [torch.randn(t, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4)]
        ids = [torch.rand(t, E, device="cuda", generator=g).argsort(1)[:, :K] for _ in range(4)]
        ws = [torch.rand(t, K, device="cuda", generator=g) for _ in range(4)]
        used = sum(i.unique().numel() for i in ids) / 4
        for label, cfg in (
            ("tiles", {"path": "tiles"}),
            ("tiles-st3", {"path": "tiles", "num_stages": 3}),
            ("own", {"path": "tiles", "scaled": False}),
        ):
            if label == "own" and fmt != "mxfp4":
                continue
            try:
                ms = graph_ms(
                    lambda i: G.routed_experts(xs[i % 4], ids[i % 4], ws[i % 4], exs[i % 2], 10.0, config=cfg), 8
                )
                res[f"{fmt} T={t} {label}"] = {"us": ms * 1e3, "GBps": used * per / ms / 1e6}
            except Exception as e:
                res[f"{fmt} T={t} {label}"] = repr(e)[:200]
            print(f"{fmt} T={t} {label}", res[f"{fmt} T={t} {label}"], flush=True)
    del exs
# raw stream of 48 experts' MXFP4 bytes (w1 + w3 + w2: 3 x 2304 rows of 2560 B), tiles [BR, BC]
w = torch.randint(0, 255, (2, E * 3 * INTER, D // 2), dtype=torch.uint8, device="cuda", generator=g)
for br, bc, nw in ((64, 64, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 128, 8)):
    rows = w.shape[1]
    o = torch.empty(rows // br, dtype=torch.int32, device="cuda")
    ms = graph_ms(
        lambda i: _stream[(rows // br,)](
            w[i % 2], o, rows, ROW=D // 2, BR=br, BC=bc, STEPS=(D // 2) // bc, num_warps=nw
        ),
        2,
    )
    res[f"stream BR={br} BC={bc} w={nw}"] = {"us": ms * 1e3, "GBps": w[0].numel() / ms / 1e6}
    print(f"stream BR={br} BC={bc} w={nw}", res[f"stream BR={br} BC={bc} w={nw}"], flush=True)
json.dump(res, open(os.path.join(OUT, "diag.json"), "w"), indent=1)
