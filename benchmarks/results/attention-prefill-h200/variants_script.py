"""Prefill sparse attention: the general kernel vs the bf16-key prefill kernel (in-kernel decode or bf16 tables)."""

import json
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, ".")
import dsserve.kernels.sparse_attention as SA
import dsserve.kernels.sparse_attention_prefill as P
from dsserve.kv.formats import BF16_ROWS, MAIN_FP4, SWA_FP8

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda"
H, D, R, W, K, T = 64, 512, 64, 128, 512, 8192
torch.manual_seed(0)
res = {"device": torch.cuda.get_device_name()}
a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
ms = triton.testing.do_bench(lambda: a @ a, rep=200, return_mode="median")
res["bf16_TFLOPs"] = 2 * 8192**3 / ms / 1e9
print("bf16 matmul", res["bf16_TFLOPs"], flush=True)


def case(kind):
    t = torch.arange(T, device=DEV)
    if kind == "cold":
        n_main = T // 4
        vis = (t // 4 + 1).clamp(max=n_main)
        old = torch.full((T, W), -1, device=DEV, dtype=torch.int32)
    else:
        n_main = 32768
        vis = torch.full((T,), n_main, device=DEV)
        old = (torch.arange(W, device=DEV)[None, :].expand(T, W) + 0).to(torch.int32).contiguous()
        # row t sees old positions > t - W: ring rows [t+1, W) of the previous chunk's last W
        keep = torch.arange(W, device=DEV)[None, :] > t[:, None]
        old = torch.where(keep, old, -1).to(torch.int32)
    r = torch.rand(T, n_main, device=DEV)
    r = torch.where(torch.arange(n_main, device=DEV)[None, :] < vis[:, None], r, 2.0)
    sel = r.argsort(1)[:, :K].to(torch.int32)
    sel = torch.where(torch.arange(K, device=DEV)[None, :] < vis[:, None], sel, -1).to(torch.int32)
    del r
    wvals = torch.randn(W, D, device=DEV)
    mvals = torch.randn(n_main, D, device=DEV)
    q = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)
    ang = torch.rand(T, R // 2, device=DEV) * 6.28
    fresh = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
    first = torch.zeros(T, device=DEV, dtype=torch.int32)
    sink = torch.randn(H, device=DEV)
    keys = (old >= 0).sum(1) + (t + 1).clamp(max=W) + (sel >= 0).sum(1)
    pools = {"fp8": SWA_FP8.pack(wvals), "fp4": MAIN_FP4.pack(mvals)}
    return dict(
        q=q,
        cos=ang.cos(),
        sin=ang.sin(),
        old=old,
        fresh=fresh,
        first=first,
        sel=sel,
        sink=sink,
        wvals=wvals,
        mvals=mvals,
        pools=pools,
        keys=int(keys.sum()),
    )


for kind in ("cold", "hit"):
    c = case(kind)
    flops = 4 * H * D * c["keys"]
    base = (c["q"], c["cos"], c["sin"])
    fp = (
        c["pools"]["fp8"],
        "fp8",
        c["old"],
        c["fresh"],
        c["first"],
        c["pools"]["fp4"],
        "fp4",
        c["sel"],
        c["sink"],
        D**-0.5,
    )
    P.PREFILL_MIN_ROWS = 1 << 30
    ref = SA.sparse_attention_ref(*base, *fp, out_dtype=torch.float32)

    def run_general():
        P.PREFILL_MIN_ROWS = 1 << 30
        return SA.sparse_attention(*base, *fp)

    # bf16 tables: dequant cost (torch unpack of the ring and the sequence's main entries)
    wb = lambda: BF16_ROWS.pack(SWA_FP8.unpack(c["pools"]["fp8"], torch.bfloat16))
    mb = lambda: BF16_ROWS.pack(MAIN_FP4.unpack(c["pools"]["fp4"], torch.bfloat16))
    wpool_b, mpool_b = wb(), mb()
    deq_ms = triton.testing.do_bench(lambda: (wb(), mb()), rep=100, return_mode="median")
    ref_b = SA.sparse_attention_ref(
        *base,
        wpool_b,
        "bf16",
        c["old"],
        c["fresh"],
        c["first"],
        mpool_b,
        "bf16",
        c["sel"],
        c["sink"],
        D**-0.5,
        out_dtype=torch.float32,
    )
    variants = {"general": (run_general, ref)}
    for wf, mf, pw, pm, r_ in (
        ("fp8", "fp4", c["pools"]["fp8"], c["pools"]["fp4"], ref),
        ("bf16", "bf16", wpool_b, mpool_b, ref_b),
    ):
        for bn, st in ((32, 1), (64, 1), (64, 2), (32, 3)):

            def run(bn=bn, st=st, pw=pw, pm=pm, wf=wf, mf=mf):
                out = torch.empty(T, H, D, device=DEV, dtype=torch.bfloat16)
                return P.sparse_attention_prefill(
                    *base,
                    pw,
                    SA._FMT_CODE[wf],
                    c["old"],
                    c["fresh"],
                    c["first"],
                    pm,
                    SA._FMT_CODE[mf],
                    c["sel"],
                    c["sink"].float(),
                    D**-0.5,
                    out,
                    block_n=bn,
                    stages=st,
                )

            variants[f"prefill_{wf}_{mf}_n{bn}_s{st}"] = (run, r_)
    for name, (fn, r_) in variants.items():
        try:
            out = fn().float()
            err = float((out - r_).norm() / r_.norm())
            ms = triton.testing.do_bench(fn, rep=200, return_mode="median")
            row = {"case": kind, "variant": name, "ms": ms, "TFLOPs": flops / ms / 1e9, "rel_err": err}
        except Exception as e:  # noqa
            row = {"case": kind, "variant": name, "error": repr(e)[:300]}
        print(row, flush=True)
        res.setdefault("rows", []).append(row)
    res.setdefault("dequant_ms", {})[kind] = deq_ms
    print("dequant (torch) ms", deq_ms, flush=True)
    json.dump(res, open(f"{OUT}/attn_prefill.json", "w"), indent=1)
