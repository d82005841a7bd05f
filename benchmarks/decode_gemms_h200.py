"""The decode step's routed experts on one EP rank of the release proxy (issue 8): 48 MXFP4 experts, top-6, at
T = 1, 8, 32 tokens; grouped_moe's kernels with tl.dot_scaled's upcast against dequant's PTX decode (the default),
a coordinate search around the default tiles, and the same kernels on bf16 experts (no decode), as CUDA-graph
device time against the read bandwidth measured in the same run.

    python benchmarks/decode_gemms_h200.py --out benchmarks/results/decode-gemms-h200

Needs a GPU. Weights rotate over 2 copies larger than L2 (so they stream from HBM, as in a decode step), routings
over 4 random draws. Every variant is checked against the torch reference before it is timed. Prints a line per T,
then one JSON line; writes decode_gemms.json and decode_gemms.png under --out.
"""

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from dsserve.bench.device_timing import graph_ms  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.kernels import grouped_moe as G  # noqa: E402

D, INTER, N_EXP, TOPK = 5120, 2304, 48, 6


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ceilings() -> dict:
    """The benchmarks' copy and matmul ceilings (attention_h200: eager; a captured 1 GB copy runs on a copy engine,
    2.7 TB/s) and a read pass over 1 GB: the ceiling of a weight stream."""
    from attention_h200 import ceilings as gpu_ceilings

    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    read = 2 * x.numel() / graph_ms(lambda _: x.sum(dtype=torch.float32), calls=5) / 1e6
    return {**gpu_ceilings(), "read_GBps": read}


DEADLINE = [float("inf")]  # time.time() past which searches stop trying new values (--budget-s)


def search(evaluate, start: dict, axes: dict, log: list, label: str) -> tuple[dict, float]:
    """Coordinate search: each axis in turn, keep the fastest value (evaluate -> ms or None when invalid)."""
    best, best_ms = dict(start), evaluate(start)
    log.append({"part": label, "config": dict(best), "ms": best_ms})
    for key, values in axes.items():
        for v in values:
            if best.get(key) == v or time.time() > DEADLINE[0]:
                continue
            c = dict(best, **{key: v})
            try:
                ms = evaluate(c)
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is recorded, not fatal
                log.append({"part": label, "config": c, "error": repr(e)[:200]})
                continue
            log.append({"part": label, "config": c, "ms": ms})
            if ms is not None and ms < best_ms:
                best, best_ms = c, ms
        print(f"  {label}: after {key}: {best_ms * 1e3:.1f} us {best}", flush=True)
    return best, best_ms


def moe_part(res: dict, ceil: dict, tokens=(1, 8, 32)) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    copies = 2
    exs = [
        G.ExpertWeights.from_dense(
            *(
                torch.randn(N_EXP, o, i, device="cuda", generator=g) * i**-0.5
                for o, i in ((INTER, D), (INTER, D), (D, INTER))
            ),
            "mxfp4",
        )
        for _ in range(copies)
    ]
    per_expert = sum(w[0].numel() + s[0].numel() for w, s in exs[0]._pairs())
    # the same kernels on bf16 experts (4x the bytes, no decode): what the tile structure streams undecoded
    bf16 = G.ExpertWeights("bf16", *(exs[0].dequantized(n, torch.bfloat16) for n in ("w1", "w3", "w2")))
    bf16_per = 3 * D * INTER * 2
    out = res["moe"] = {"per_expert_bytes": per_expert, "rows": {}, "log": []}
    for t in tokens:
        sets = 4
        xs = [torch.randn(t, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(sets)]
        ids = [torch.rand(t, N_EXP, device="cuda", generator=g).argsort(1)[:, :TOPK] for _ in range(sets)]
        ws = [torch.rand(t, TOPK, device="cuda", generator=g) for _ in range(sets)]
        used = sum(i.unique().numel() for i in ids) / sets
        refs = [G.routed_experts_ref(xs[i], ids[i], ws[i], exs[0], 10.0) for i in range(sets)]

        def run(cfg, i):
            return G.routed_experts(xs[i % sets], ids[i % sets], ws[i % sets], exs[i % copies], 10.0, config=cfg)

        def evaluate(cfg):
            for i in range(sets):
                err = rel(G.routed_experts(xs[i], ids[i], ws[i], exs[0], 10.0, config=cfg), refs[i])
                if not err < 1e-2:
                    raise RuntimeError(f"rel err {err:.3g} against the reference")
            return graph_ms(lambda i: run(cfg, i), sets * copies)

        scaled_ms = evaluate({"decode": "scaled"})  # the kernels' default before the PTX decode
        asm_ms = evaluate({})  # the default now: the PTX decode, its tiles
        tuned, tuned_ms = search(
            evaluate,
            {"decode": "asm"},
            {"BN": [64, 128], "BK": [128, 256], "num_stages": [1, 2, 3]},
            out["log"],
            f"T={t}",
        )
        bf16_ms = graph_ms(lambda i: G.routed_experts(xs[i % sets], ids[i % sets], ws[i % sets], bf16, 10.0), sets)
        wbytes = used * per_expert
        gbps = {name: wbytes / ms / 1e6 for name, ms in (("scaled", scaled_ms), ("asm", asm_ms), ("tuned", tuned_ms))}
        out["rows"][f"T={t}"] = {
            "experts_touched": used,
            "weight_bytes": wbytes,
            "scaled_ms": scaled_ms,
            "asm_ms": asm_ms,
            "tuned_ms": tuned_ms,
            "tuned_config": tuned,
            **{f"{k}_GBps": v for k, v in gbps.items()},
            "asm_speedup": scaled_ms / asm_ms,
            "asm_over_read_floor": asm_ms / (wbytes / ceil["read_GBps"] / 1e6),
            "bf16_experts_ms": bf16_ms,
            "bf16_experts_GBps": used * bf16_per / bf16_ms / 1e6,
        }
        print(
            f"moe T={t}: "
            + ", ".join(f"{k} {v:.0f} GB/s" for k, v in gbps.items())
            + f", bf16 experts {used * bf16_per / bf16_ms / 1e6:.0f} GB/s",
            flush=True,
        )


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = res["moe"]["rows"]
    names = list(rows)
    xs = range(len(names))
    for j, (key, label) in enumerate(
        (
            ("scaled_GBps", "tl.dot_scaled"),
            ("asm_GBps", "PTX decode (default)"),
            ("bf16_experts_GBps", "bf16 experts (no decode)"),
        )
    ):
        ax.bar([i + (j - 1) * 0.27 for i in xs], [rows[n][key] for n in names], 0.27, label=label)
    ax.axhline(res["ceilings"]["read_GBps"], ls=":", c="k", label="read bandwidth")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("weight GB/s")
    ax.set_title("routed experts (48 MXFP4, top-6): weight bytes / device time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/decode-gemms-h200")
    p.add_argument("--budget-s", type=float, default=480, help="stop trying new configs after this many seconds")
    a = p.parse_args()
    DEADLINE[0] = time.time() + a.budget_s
    os.makedirs(a.out, exist_ok=True)
    res = {"meta": run_meta()}
    res["ceilings"] = ceilings()
    print(
        f"ceilings: copy {res['ceilings']['copy_GBps']:.0f} GB/s, read {res['ceilings']['read_GBps']:.0f} GB/s",
        flush=True,
    )

    def save():
        with open(os.path.join(a.out, "decode_gemms.json"), "w") as f:
            json.dump(res, f, indent=1)

    t0 = time.time()
    moe_part(res, res["ceilings"])
    res["meta"]["moe_s"] = time.time() - t0
    save()
    plot(res, os.path.join(a.out, "decode_gemms.png"))
    print(json.dumps(res["moe"]["rows"]))


if __name__ == "__main__":
    main()
