import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from dsserve.bench.device_timing import graph_ms
from dsserve.kernels.moe_permute import expert_tiles_kernel, expert_tiles_ref

res = {}
g = torch.Generator(device="cuda").manual_seed(0)
for t in (1, 8, 32, 42):
    ids = [torch.rand(t, 48, device="cuda", generator=g).argsort(1)[:, :6] for _ in range(4)]
    for i in ids:
        for pe in (True, False):
            o, tl_ = expert_tiles_kernel(i, 48, 16, pe)
            ro, rt = expert_tiles_ref(i, 48, 16)
            assert torch.equal(o, ro) and torch.equal(tl_, rt), (t, pe)
    row = {str(pe): graph_ms(lambda j: expert_tiles_kernel(ids[j % 4], 48, 16, pe), 4) * 1e3 for pe in (True, False)}
    res[f"T={t} pairs={6 * t}"] = row
    print(t, row, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "expert_tiles_ab.json"), "w"), indent=1)
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from dsserve.bench.device_timing import graph_ms
from dsserve.kernels.moe_permute import expert_tiles_kernel, expert_tiles_ref

res = json.load(open("scratch/expert_tiles_ab.json")) if os.path.exists("scratch/expert_tiles_ab.json") else {}
g = torch.Generator(device="cuda").manual_seed(1)
for t in (64, 128, 170):
    ids = [torch.rand(t, 48, device="cuda", generator=g).argsort(1)[:, :6] for _ in range(4)]
    for i in ids:
        o, tl_ = expert_tiles_kernel(i, 48, 16, True)
        ro, rt = expert_tiles_ref(i, 48, 16)
        assert torch.equal(o, ro) and torch.equal(tl_, rt), t
    row = {
        "True": graph_ms(lambda j: expert_tiles_kernel(ids[j % 4], 48, 16, True), 4) * 1e3,
        "torch": graph_ms(lambda j: expert_tiles_ref(ids[j % 4], 48, 16), 4) * 1e3,
    }
    res[f"T={t} pairs={6 * t}"] = row
    print(t, row, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "expert_tiles_ab.json"), "w"), indent=1)
