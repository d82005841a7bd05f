import json
import math
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from dsserve.bench.device_timing import graph_ms
from dsserve.kernels import fp8_linear as F
from dsserve.layers.quant import quant_fp8_block

DENSE = {
    "wq_a": (1280, 5120, 1),
    "wq_b": (32768, 1280, 1),
    "wkv": (512, 5120, 1),
    "wo_a": (8192, 4096, 8),
    "wo_b": (5120, 8192, 1),
    "shared_w13": (4608, 5120, 1),
    "shared_w2": (5120, 2304, 1),
    "indexer_wq_b": (4096, 1280, 1),
}
res = {}
for name, (n, k, g) in DENSE.items():
    copies = max(2, math.ceil(120e6 / (n * k)))
    ws = [quant_fp8_block(torch.randn(n, k, device="cuda") * 0.02, 32) for _ in range(copies)]
    for m in (24, 32, 64):
        x = torch.randn(m, g * k, device="cuda", dtype=torch.bfloat16)
        row = {}
        for rows in (16, 64):
            F.IN_KERNEL_SPLIT_ROWS = rows
            row[rows] = graph_ms(lambda i: F.fp8_linear(x, *ws[i % copies], 32, groups=g), copies) * 1e3
        res[f"{name} M={m}"] = row
        print(name, m, {r: round(v, 1) for r, v in row.items()}, flush=True)
for m in (24, 32, 64):
    print(
        "total M=%d" % m, {r: round(sum(v[r] for kk, v in res.items() if kk.endswith(f"M={m}")), 1) for r in (16, 64)}
    )
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "splitrows.json"), "w"), indent=1)
