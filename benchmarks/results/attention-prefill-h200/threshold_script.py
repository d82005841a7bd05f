"""Rows from which the prefill kernel (+ bf16 key tables, unpack included) beats the general kernel."""

import json
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, ".")
import dsserve.kernels.sparse_attention as SA
import dsserve.kernels.sparse_attention_prefill as P
from dsserve.kernels.kv_unpack import unpack_rows
from dsserve.kv.formats import MAIN_FP4, SWA_FP8

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda"
H, D, R, W, K = 64, 512, 64, 128, 512
torch.manual_seed(0)
n_main, slots = 32768, 64
wpool = SWA_FP8.pack(torch.randn(slots * W, D, device=DEV))
mpool = MAIN_FP4.pack(torch.randn(n_main, D, device=DEV))
res = []
for T in (128, 256, 512, 1024, 2048, 4096):
    t = torch.arange(T, device=DEV)
    old = torch.where(torch.arange(W, device=DEV)[None, :] > t[:, None], torch.arange(W, device=DEV)[None, :], -1).to(
        torch.int32
    )
    sel = torch.rand(T, n_main, device=DEV).argsort(1)[:, :K].to(torch.int32)
    q = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)
    ang = torch.rand(T, R // 2, device=DEV)
    fresh = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
    first = torch.zeros(T, device=DEV, dtype=torch.int32)
    sink = torch.randn(H, device=DEV)
    keys = int(((old >= 0).sum(1) + (t + 1).clamp(max=W) + K).sum())
    flops = 4 * H * D * keys

    def general():
        P.PREFILL_MIN_ROWS = 1 << 30
        return SA.sparse_attention(
            q, ang.cos(), ang.sin(), wpool, "fp8", old, fresh, first, mpool, "fp4", sel, sink, D**-0.5
        )

    def tables():
        P.PREFILL_MIN_ROWS = 1
        wt = unpack_rows(wpool, "fp8", torch.arange(wpool.shape[0], device=DEV, dtype=torch.int32)).view(torch.uint8)
        mt = unpack_rows(mpool, "fp4", torch.arange(n_main, device=DEV, dtype=torch.int32)).view(torch.uint8)
        return SA.sparse_attention(
            q, ang.cos(), ang.sin(), wt, "bf16", old, fresh, first, mt, "bf16", sel, sink, D**-0.5
        )

    def packed():
        P.PREFILL_MIN_ROWS = 1
        return SA.sparse_attention(
            q, ang.cos(), ang.sin(), wpool, "fp8", old, fresh, first, mpool, "fp4", sel, sink, D**-0.5
        )

    row = {"T": T}
    a = general().float()
    for name, fn in (("general", general), ("tables", tables), ("packed", packed)):
        err = float((fn().float() - a).norm() / a.norm())
        ms = triton.testing.do_bench(fn, rep=100, return_mode="median")
        row[name + "_ms"], row[name + "_TFLOPs"], row[name + "_err"] = ms, flops / ms / 1e9, err
    uw = triton.testing.do_bench(
        lambda: unpack_rows(mpool, "fp4", torch.arange(n_main, device=DEV, dtype=torch.int32)),
        rep=50,
        return_mode="median",
    )
    row["unpack_main_32k_ms"] = uw
    row["unpack_GBps"] = n_main * (288 + 1024) / uw / 1e6
    print(row, flush=True)
    res.append(row)
json.dump(res, open(f"{OUT}/attn_threshold.json", "w"), indent=1)
