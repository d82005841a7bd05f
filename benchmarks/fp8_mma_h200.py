"""FP8 or BF16 MMA inside the W8A8 / W4A8 tiles: what each costs, and which one sums the e4m3 products exactly.

The W8A8 projections (kernels.fp8_linear) and W4A8 experts (kernels.grouped_moe_a8) multiply e4m3 activations by
e4m3 weights 32 channels at a time (group_dot). Every product is exact in fp32, but Hopper's FP8 wgmma sums them with
limited precision, so a kernel tile on wgmma (64 or more rows) gives other numbers than one on mma.sync (the swapped
decode tiles) or the reference. The tiles' ``mma`` option upcasts both operands to fp16 (exact) for the FP16 MMA.
One run, on one GPU:
1. a bare K = 32 / 64 tl.dot of e4m3 tiles against fp64, by instruction (wgmma at 64 rows and 4 warps, mma.sync
   below or with 1 warp), FP8 operands or upcast to fp16 / bf16: the error over the sum of |products|;
2. the release's dense FP8 projections (w4a8_h200.DENSE) at M = 1..512 and the routed experts of one EP rank of the
   release proxy at T = 8..2048 tokens (1..256 rows an expert), each with mma "fp8" and "fp16": device ms (CUDA
   graphs, weights rotating past L2), achieved TB/s over the weight bytes against the copy ceiling, and the error
   against the torch reference with the same activation rounding (dense: also the largest error over the sum of
   |products| of its output element).

    python benchmarks/fp8_mma_h200.py --out benchmarks/results/fp8-mma-h100

Prints a table, then one JSON line (the summary); writes fp8_mma.json under --out.
"""

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from w4a8_h200 import DENSE, INTER, N_EXP, TOPK, D, Run, ceilings, expert_set, rel, timer  # noqa: E402

DENSE_M = (1, 8, 32, 64, 128, 256, 512)
MOE_TOKENS = (8, 64, 256, 512, 1024, 2048)  # x 6 / 48: 1, 8, 32, 64, 128, 256 rows an expert
MMAS = ("fp8", "fp16")


def probe(torch) -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, UP: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        if UP == 1:
            a, b = a.to(tl.float16), b.to(tl.float16)
        if UP == 2:
            a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))

    out, g = {}, torch.Generator(device="cuda").manual_seed(0)
    for m in (16, 64):
        for k in (32, 64):
            a = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)
            b = (torch.randn(k, 64, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)
            exact, mag = a.double() @ b.double(), a.double().abs() @ b.double().abs()
            for warps in (1, 4):
                for up, name in enumerate(("fp8", "fp16", "bf16")):
                    c = torch.empty(m, 64, device="cuda")
                    ptx = dot_kernel[(1,)](a, b, c, m, 64, k, up, num_warps=warps).asm["ptx"]
                    ins = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "other"
                    err = (c.double() - exact).abs() / mag
                    key = f"M={m} K={k} warps={warps} {name}"
                    out[key] = {"instruction": ins, "max_err_of_sum_abs": float(err.max()),
                                "exact_fraction": float((err == 0).double().mean())}  # fmt: skip
                    print(f"probe {key}: {out[key]}", flush=True)
    return out


def dense_part(run: Run, torch, ceil: dict) -> dict:
    from dsserve.kernels import fp8_linear as F
    from dsserve.layers.quant import quant_fp8_block

    ms_of, g, out = timer(torch, False), torch.Generator(device="cuda").manual_seed(2), {}
    for name, n, k, groups in DENSE:
        nbytes = n * k + math.ceil(n / 32) * math.ceil(k / 32)
        copies = max(2, min(64, math.ceil((160 << 20) / nbytes)))  # > L2 (50 MB) in all
        ws = [
            tuple(
                t.view(torch.uint8) for t in quant_fp8_block(torch.randn(n, k, device="cuda", generator=g) * 0.02, 32)
            )
            for _ in range(copies)
        ]
        w_abs = ((ws[0][0] & 0x7F), ws[0][1])  # |w|: the e4m3 sign bit cleared
        for m in DENSE_M:
            if run.over(f"dense {name} M={m}"):
                continue
            x = torch.randn(m, groups * k, device="cuda", generator=g).bfloat16()
            ref = F.fp8_linear_w8a8_ref(x.float(), *ws[0], 32, groups=groups)
            mag = F.fp8_linear_w8a8_ref(x.float().abs(), *w_abs, 32, groups=groups)  # sum of |products| an output
            row = out[f"{name} M={m}"] = {"N": n, "K": k, "groups": groups, "M": m, "weight_bytes": nbytes}
            for mma in MMAS:
                cfg = {"mma": mma}

                def go(cfg=cfg, x=x, ws=ws, ref=ref, mag=mag):
                    got = F.fp8_linear(x.float(), *ws[0], 32, act_quant=True, groups=groups, config=cfg)
                    r = {"rel_err": rel(got, ref), "max_err_of_sum_abs": float(((got - ref).abs() / mag).max())}
                    fn = lambda i: F.fp8_linear(x, *ws[i % len(ws)], 32, act_quant=True, groups=groups, config=cfg)  # noqa: E731
                    ms = ms_of(fn, copies)
                    r.update(
                        ms=ms, TBps=nbytes / ms / 1e9, of_copy_bw=nbytes / ms / 1e6 / ceil.get("copy_GBps", math.nan)
                    )
                    return r

                row[mma] = run.attempt(f"dense {name} M={m} {mma}", go, {})
            row["fp16_over_fp8_time"] = row["fp16"].get("ms", math.nan) / row["fp8"].get("ms", math.nan)
            print(f"dense {name} M={m}: " + _fmt(row), flush=True)
    return out


def moe_part(run: Run, torch, ceil: dict) -> dict:
    from dsserve.kernels import grouped_moe as G

    copies, sets, out = 2, 4, {}
    exs = expert_set(torch, G, "cuda", D, INTER, N_EXP, copies)
    per_expert = sum(w[0].numel() + s[0].numel() for w, s in exs[0]._pairs())
    ms_of, g = timer(torch, False), torch.Generator(device="cuda").manual_seed(1)
    for t in MOE_TOKENS:
        if run.over(f"moe T={t}"):
            continue
        xs = [torch.randn(t, D, device="cuda", generator=g).bfloat16() for _ in range(sets)]
        ids = [torch.rand(t, N_EXP, device="cuda", generator=g).argsort(1)[:, :TOPK] for _ in range(sets)]
        ws = [torch.rand(t, TOPK, device="cuda", generator=g) for _ in range(sets)]
        wbytes = sum(i.unique().numel() for i in ids) / sets * per_expert
        ref = G.routed_experts_ref(xs[0].float(), ids[0], ws[0], exs[0], 10.0, act_quant=True)
        row = out[f"T={t}"] = {"rows_an_expert": t * TOPK / N_EXP, "bytes": wbytes}
        for mma in MMAS:
            cfg = {"mma": mma}

            def go(cfg=cfg, ref=ref, xs=xs, ids=ids, ws=ws, wbytes=wbytes):
                got = G.routed_experts(xs[0].float(), ids[0], ws[0], exs[0], 10.0, act_quant=True, config=cfg)
                r = {"rel_err": rel(got, ref)}
                fn = lambda i: G.routed_experts(  # noqa: E731
                    xs[i % sets], ids[i % sets], ws[i % sets], exs[i % copies], 10.0, act_quant=True, config=cfg
                )
                ms = ms_of(fn, sets * copies)
                r.update(ms=ms, TBps=wbytes / ms / 1e9, of_copy_bw=wbytes / ms / 1e6 / ceil.get("copy_GBps", math.nan))
                return r

            row[mma] = run.attempt(f"moe T={t} {mma}", go, {})
        row["fp16_over_fp8_time"] = row["fp16"].get("ms", math.nan) / row["fp8"].get("ms", math.nan)
        print(f"moe T={t}: " + _fmt(row), flush=True)
    return out


def _fmt(row: dict) -> str:
    return (
        ", ".join(
            f"{m} {v['ms'] * 1e3:.1f} us {v['TBps']:.2f} TB/s rel {v['rel_err']:.1e}"
            for m in MMAS
            if "ms" in (v := row.get(m, {}))
        )
        + f"; fp16/fp8 time {row['fp16_over_fp8_time']:.3f}"
    )


def plot(res: dict, png: str) -> None:
    """Left: the FP16 MMA's time over the FP8 MMA's by rows (dense projections) and rows an expert (experts). Right:
    each path's error against the reference with the same activation rounding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    series = {name: [] for name, *_ in DENSE}
    for r in res["dense"].values():
        series[next(n for n, nn, kk, g in DENSE if (nn, kk, g) == (r["N"], r["K"], r["groups"]))].append(r)
    for name, rs in series.items():
        ax.plot([r["M"] for r in rs], [r["fp16_over_fp8_time"] for r in rs], "o-", label=name, alpha=0.7)
        for mma, style in (("fp8", "x--"), ("fp16", "o-")):
            label = f"dense, mma {mma}" if name == "wq_a" else None
            errs = [r[mma].get("rel_err", math.nan) for r in rs]
            bx.plot([r["M"] for r in rs], errs, style, alpha=0.4, color="C0" if mma == "fp8" else "C1", label=label)
    moe = list(res["moe"].values())
    ax.plot([r["rows_an_expert"] for r in moe], [r["fp16_over_fp8_time"] for r in moe], "ks-", label="experts (x)")
    for mma, style in (("fp8", "x--"), ("fp16", "o-")):
        bx.plot([r["rows_an_expert"] for r in moe], [r[mma].get("rel_err", math.nan) for r in moe], style, color="k",
                alpha=0.8 if mma == "fp8" else 0.4, label=f"experts, mma {mma}")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="rows M (x: rows an expert)", ylabel="time, fp16 MMA / fp8 MMA",
           title=f"W8A8 / W4A8 tiles ({res['meta'].get('device', '')})")  # fmt: skip
    bx.set(xscale="log", yscale="log", xlabel="rows M (experts: rows an expert)", ylabel="rel err vs reference",
           title="error, same activation rounding")  # fmt: skip
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/fp8-mma-h100")
    p.add_argument("--budget-s", type=float, default=200, help="skip the timings left after this many seconds")
    p.add_argument("--replot", default="", help="only redraw the PNG beside this fp8_mma.json")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), os.path.join(os.path.dirname(a.replot), "fp8_mma.png"))
        return
    import torch

    from dsserve.bench.provenance import run_meta

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (Hopper: the FP8 wgmma this measures)")
    run, t0 = Run(a.budget_s), time.time()
    ceil = run.res["ceilings"] = run.attempt("ceilings", lambda: ceilings(torch), {})
    run.res["meta"] = run_meta(ceilings=ceil)
    run.res["probe"] = run.attempt("probe", lambda: probe(torch), {})
    run.res["dense"] = run.attempt("dense", lambda: dense_part(run, torch, ceil), {})
    run.res["moe"] = run.attempt("moe", lambda: moe_part(run, torch, ceil), {})
    run.res["meta"]["wall_s"] = time.time() - t0
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_mma.json"), "w") as f:
        json.dump(run.res, f, indent=1)
    run.attempt("plot", lambda: plot(run.res, os.path.join(a.out, "fp8_mma.png")))
    ratios = [r["fp16_over_fp8_time"] for part in ("dense", "moe") for r in run.res[part].values()]
    ratios = [r for r in ratios if r == r]
    print(f"{'shape':<24} {'fp8 us':>9} {'fp16 us':>9} {'fp16/fp8':>9} {'fp8 rel':>9} {'fp16 rel':>9}")
    for part in ("dense", "moe"):
        for key, r in run.res[part].items():
            f8, f16 = r.get("fp8", {}), r.get("fp16", {})
            cells = [v.get(f, math.nan) * s for f, s in (("ms", 1e3), ("rel_err", 1)) for v in (f8, f16)]
            print(f"{part + ' ' + key:<24} {cells[0]:>9.1f} {cells[1]:>9.1f} {r['fp16_over_fp8_time']:>9.3f} "
                  f"{cells[2]:>9.1e} {cells[3]:>9.1e}")  # fmt: skip
    print(json.dumps({"fp16_over_fp8_time_max": max(ratios, default=None),
                      "fp16_over_fp8_time_median": sorted(ratios)[len(ratios) // 2] if ratios else None,
                      "errors": len(run.res["errors"]), "skipped": len(run.res["skipped"])}))  # fmt: skip


if __name__ == "__main__":
    main()
