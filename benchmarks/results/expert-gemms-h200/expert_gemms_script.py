"""The routed experts' grouped GEMMs on one EP rank of the release proxy (48 MXFP4 experts, top-6) from decode
batches to a prefix hit's replayed rows: the tile kernels as they are (the weights as the MMA's right operand)
against the same kernels with the operands swapped (`config["swap"]`: out^T = W x^T, the decoded weights as the
left operand, the few rows on the right), each with the PTX decode and tl.dot_scaled, plus a coordinate search of
the swapped tiles. CUDA-graph device time against the read bandwidth and the bf16 matmul measured in the same run.

    python benchmarks/expert_gemms_h200.py --out benchmarks/results/expert-gemms-h200

T = 384 is a prefix hit's encoder step (256 new rows + the 128-row replay window: 48 pairs an expert), T = 128 its
decoder step (16 pairs an expert). Needs a GPU. Weights rotate over 2 copies larger than L2, routings over 4 random
draws; every variant is checked against the torch reference before it is timed. Prints a line per T, then one JSON
line; writes expert_gemms.json and expert_gemms.png under --out.
"""

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
sys.path[:0] = [os.path.dirname(HERE), HERE]

from decode_gemms_h200 import DEADLINE, INTER, N_EXP, TOPK, D, ceilings, rel, search  # noqa: E402

from dsserve.bench.device_timing import graph_ms  # noqa: E402
from dsserve.kernels import grouped_moe as G  # noqa: E402

VARIANTS = {  # name: config (the default is whatever routed_experts picks for the call)
    "default": {},
    "scaled": {"decode": "scaled"},
    "asm": {"decode": "asm"},
    "swap_asm": {"decode": "asm", "swap": True},
    "swap_scaled": {"decode": "scaled", "swap": True},
}


def run_tokens(t: int, exs, per_expert: int, res: dict, g, budget_s: float) -> None:
    sets, copies = 4, len(exs)
    xs = [torch.randn(t, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(sets)]
    ids = [torch.rand(t, N_EXP, device="cuda", generator=g).argsort(1)[:, :TOPK] for _ in range(sets)]
    ws = [torch.rand(t, TOPK, device="cuda", generator=g) for _ in range(sets)]
    used = sum(i.unique().numel() for i in ids) / sets
    refs = [G.routed_experts_ref(xs[i], ids[i], ws[i], exs[0], 10.0) for i in range(sets)]

    def evaluate(cfg):
        for i in range(sets):
            err = rel(G.routed_experts(xs[i], ids[i], ws[i], exs[0], 10.0, config=dict(cfg)), refs[i])
            if not err < 1e-2:
                raise RuntimeError(f"rel err {err:.3g} against the reference")
        return graph_ms(
            lambda i: G.routed_experts(
                xs[i % sets], ids[i % sets], ws[i % sets], exs[i % copies], 10.0, config=dict(cfg)
            ),
            sets * copies,
        )

    row = {"experts_touched": used, "weight_bytes": used * per_expert, "pairs_per_expert": t * TOPK / N_EXP}
    for name, cfg in VARIANTS.items():
        try:
            row[f"{name}_ms"] = evaluate(cfg)
        except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, the others still run
            row[f"{name}_ms"], row[f"{name}_error"] = None, repr(e)[:300]

    def safe(cfg):  # a start that fails to compile or to match is recorded as a miss, not fatal
        try:
            return evaluate(cfg)
        except Exception as e:  # noqa: BLE001
            res["log"].append({"part": f"T={t}", "config": cfg, "error": repr(e)[:300]})
            return float("inf")

    for name, start, axes in (
        (
            "asm_tuned",
            {"decode": "asm"},
            {"BM": [16, 32, 64], "BN": [64, 128], "BK": [128, 256], "num_warps": [4, 8], "num_stages": [2, 3, 4]},
        ),
        (
            "swap_tuned",
            {"decode": "asm", "swap": True, "BN": 128, "BK": 128, "num_warps": 4},
            {
                "BM": [16, 32, 64],
                "BN": [64, 128, 256],
                "BK": [64, 128, 256],
                "num_warps": [4, 8],
                "num_stages": [2, 3, 4],
            },
        ),
    ):
        DEADLINE[0] = time.time() + budget_s / 2
        tuned, tuned_ms = search(safe, start, axes, res["log"], f"T={t} {name}")
        row.update({f"{name}_ms": tuned_ms if tuned_ms < float("inf") else None, f"{name}_config": tuned})
    for key in [k for k in row if k.endswith("_ms") and row[k]]:
        row[key.replace("_ms", "_GBps")] = row["weight_bytes"] / row[key] / 1e6
        row[key.replace("_ms", "_TFLOPs")] = 6 * t * TOPK * D * INTER / row[key] / 1e9
    best_old = min(row[f"{n}_ms"] for n in ("default", "scaled", "asm", "asm_tuned") if row[f"{n}_ms"])
    best_new = min(row[f"{n}_ms"] for n in ("swap_asm", "swap_scaled", "swap_tuned") if row[f"{n}_ms"])
    row["swap_speedup_over_best_unswapped"] = best_old / best_new
    res["rows"][f"T={t}"] = row
    print(
        f"T={t} ({row['pairs_per_expert']:.1f} pairs/expert): "
        + ", ".join(
            f"{n} {row[f'{n}_ms'] * 1e3:.0f} us" for n in list(VARIANTS) + ["asm_tuned", "swap_tuned"] if row[f"{n}_ms"]
        )
        + f"; swap {row['swap_speedup_over_best_unswapped']:.2f}x",
        flush=True,
    )


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    names = list(rows)
    fig, ax = plt.subplots(figsize=(8, 4))
    keys = ["default", "scaled", "asm_tuned", "swap_asm", "swap_tuned"]
    w = 0.8 / len(keys)
    for j, key in enumerate(keys):
        ax.bar(
            [i + (j - len(keys) / 2 + 0.5) * w for i in range(len(names))],
            [rows[n].get(f"{key}_GBps") or 0 for n in names],
            w,
            label=key,
        )
    ax.axhline(res["ceilings"]["read_GBps"], ls=":", c="k", label="read bandwidth")
    ax.set_xticks(range(len(names)), [f"{n}\n{rows[n]['pairs_per_expert']:.0f}/expert" for n in names])
    ax.set_ylabel("weight GB/s (bytes of the experts touched / time)")
    ax.set_title("routed experts (48 MXFP4, top-6): unswapped vs swapped operands")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/expert-gemms-h200")
    p.add_argument("--tokens", default="1,8,32,128,384,1024")
    p.add_argument("--budget-s", type=float, default=300, help="seconds for all the searches")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {
        "meta": {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "rows": {},
        "log": [],
    }
    res["ceilings"] = ceilings()
    print(f"ceilings: {json.dumps(res['ceilings'])}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    exs = [
        G.ExpertWeights.from_dense(
            *(
                torch.randn(N_EXP, o, i, device="cuda", generator=g) * i**-0.5
                for o, i in ((INTER, D), (INTER, D), (D, INTER))
            ),
            "mxfp4",
        )
        for _ in range(2)
    ]
    per_expert = sum(w[0].numel() + s[0].numel() for w, s in exs[0]._pairs())
    path = os.path.join(a.out, "expert_gemms.json")
    tokens = [int(v) for v in a.tokens.split(",")]
    for t in tokens:
        run_tokens(t, exs, per_expert, res, g, a.budget_s / len(tokens))  # each T's searches get a share
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, "expert_gemms.png"))
    print(
        json.dumps(
            {
                n: {k: v for k, v in r.items() if k.endswith("_ms") or k.startswith("swap_speedup")}
                for n, r in res["rows"].items()
            }
        )
    )


if __name__ == "__main__":
    main()
