"""W8A8 projections at 128-512 rows: split K (the default) against one split, in one run on one GPU.

From 65 rows the W8A8 kernel (kernels.fp8_linear) tiles 128 x 128 and used to run one K split: 10 programs for wq_a
at 128 rows on 132 SMs. Now it splits K where that at least triples the programs. For the release's FP8 projections
(w4a8_h200.DENSE but wq_b, whose 256 column tiles fill the SMs) at M = 128, 256, 512: device ms from CUDA graphs
(weights rotating past L2) with the default and with SPLIT_K 1, achieved TB/s over the weight bytes against the copy
ceiling of the same run, and both against the reference with the same activation rounding.

    python benchmarks/w8a8_split_h200.py --out benchmarks/results/w8a8-split-h200
    python benchmarks/w8a8_split_h200.py --replot benchmarks/results/w8a8-split-h200/w8a8_split.json   # the PNG

Prints a line a shape, then one JSON line (the summary); writes w8a8_split.json under --out.
"""

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

SHAPES = (("wq_a", 1280, 5120, 1), ("wkv", 512, 5120, 1), ("wo_b", 5120, 8192, 1), ("shared_w13", 4608, 5120, 1),
          ("wo_a", 8192, 4096, 8))  # fmt: skip
ROWS = (128, 256, 512)


def measure(torch) -> dict:
    from dsserve.bench.device_timing import graph_ms
    from dsserve.kernels import fp8_linear as F
    from dsserve.layers.quant import quant_fp8_block

    g, res = torch.Generator(device="cuda").manual_seed(0), {}
    for name, n, k, groups in SHAPES:
        nbytes = n * k
        copies = max(2, min(64, math.ceil((160 << 20) / nbytes)))  # > L2 in all
        ws = [
            tuple(
                t.view(torch.uint8) for t in quant_fp8_block(torch.randn(n, k, device="cuda", generator=g) * 0.02, 32)
            )
            for _ in range(copies)
        ]
        for m in ROWS:
            x = torch.randn(m, groups * k, device="cuda", generator=g).bfloat16()
            ref = F.fp8_linear_w8a8_ref(x.float(), *ws[0], 32, groups=groups)
            row = {}
            for label, cfg in (("split", None), ("one_split", {"SPLIT_K": 1})):
                got = F.fp8_linear(x.float(), *ws[0], 32, act_quant=True, groups=groups, config=cfg)
                fn = lambda i: F.fp8_linear(x, *ws[i % copies], 32, act_quant=True, groups=groups, config=cfg)  # noqa: E731
                ms = graph_ms(fn, copies, calls=max(20, copies))
                row[label] = {"us": ms * 1e3, "TBps": nbytes / ms / 1e9, "rel": float((got - ref).norm() / ref.norm())}
            row["speedup"] = row["one_split"]["us"] / row["split"]["us"]
            res[f"{name} M={m}"] = row
            print(f"{name} M={m}: split {row['split']['us']:.1f} us, one split {row['one_split']['us']:.1f} us, "
                  f"{row['speedup']:.2f}x", flush=True)  # fmt: skip
    return res


def plot(res: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res.get("rows", res)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, *_ in SHAPES:
        ms = [m for m in ROWS if f"{name} M={m}" in rows]
        ax.plot(ms, [rows[f"{name} M={m}"]["speedup"] for m in ms], "o-", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="rows M", ylabel="one split's time / split K's", title="W8A8, 128-512 rows")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/w8a8-split-h200")
    p.add_argument("--replot", default="", help="only redraw the PNG beside this w8a8_split.json")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), os.path.join(os.path.dirname(a.replot), "w8a8_split.png"))
        return
    import torch
    from w4a8_h200 import ceilings

    from dsserve.bench.provenance import run_meta

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    ceil = ceilings(torch)
    res = {"meta": run_meta(ceilings=ceil), "ceilings": ceil, "rows": measure(torch)}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "w8a8_split.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, "w8a8_split.png"))
    speedups = [r["speedup"] for r in res["rows"].values()]
    print(json.dumps({"speedup_min": min(speedups), "speedup_max": max(speedups)}))


if __name__ == "__main__":
    main()
