"""The decode step's weight-bound GEMMs on one EP rank's shapes of the release proxy (issue 8): the routed experts
(MXFP4, grouped_moe's tile kernels against decode_moe's) and the dense FP8 projections (W8A16 as x W^T against
W x^T, the weight as the MMA's left operand), each tuned by a coordinate search over its config, measured as
CUDA-graph device time against the copy bandwidth measured in the same run.

    python benchmarks/decode_gemms_h200.py --out benchmarks/results/decode-gemms-h200

Needs a GPU. Weights rotate over copies larger than L2 (so they stream from HBM, as in a decode step), routings
over 4 random draws. Every variant is checked against its torch reference before it is timed. Prints a table per
part, then one JSON line; writes decode_gemms.json (and a PNG) under --out, after each part.
"""
import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from dsserve.bench.device_timing import graph_ms  # noqa: E402
from dsserve.kernels import fp8_linear as F  # noqa: E402
from dsserve.kernels import grouped_moe as G  # noqa: E402
from dsserve.layers.quant import quant_fp8_block  # noqa: E402

D, INTER, N_EXP, TOPK = 5120, 2304, 48, 6
# the proxy's FP8 projections of one layer: name -> (N, K, groups); wo_a is block-diagonal over 8 head groups
DENSE = {"wq_a": (1280, 5120, 1), "wq_b": (32768, 1280, 1), "wkv": (512, 5120, 1), "wo_a": (8192, 4096, 8),
         "wo_b": (5120, 8192, 1), "shared_w13": (4608, 5120, 1), "shared_w2": (5120, 2304, 1),
         "indexer_wq_b": (4096, 1280, 1)}
L2_BYTES = 60 << 20


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ceilings() -> dict:
    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    copy = 2 * n / graph_ms(lambda _: b.copy_(a), calls=5) / 1e6
    x = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")
    read = n / graph_ms(lambda _: x.sum(dtype=torch.float32), calls=5) / 1e6  # one read pass of 1 GB
    return {"copy_GBps": copy, "read_GBps": read}


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
    exs = [G.ExpertWeights.from_dense(*(torch.randn(N_EXP, o, i, device="cuda", generator=g) * i ** -0.5
                                        for o, i in ((INTER, D), (INTER, D), (D, INTER))), "mxfp4")
           for _ in range(copies)]
    per_expert = sum(w[0].numel() + s[0].numel() for w, s in exs[0]._pairs())
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

        tiles_ms = evaluate({"path": "tiles"})
        start = {"path": "decode", "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4}
        axes = {"scaled": [False], "BN": [128, 32], "BK": [256], "num_warps": [8], "num_stages": [2, 4],
                "programs_per_sm": [2, 8, 16]}
        best, best_ms = search(evaluate, start, axes, out["log"], f"moe T={t}")
        wbytes = used * per_expert
        out["rows"][f"T={t}"] = {"experts_touched": used, "weight_bytes": wbytes, "tiles_ms": tiles_ms,
                                 "tiles_GBps": wbytes / tiles_ms / 1e6, "decode_ms": best_ms,
                                 "decode_GBps": wbytes / best_ms / 1e6, "decode_config": best,
                                 "speedup": tiles_ms / best_ms,
                                 "decode_over_floor": best_ms / (wbytes / ceil["copy_GBps"] / 1e6)}
        print(f"moe T={t}: tiles {tiles_ms * 1e3:.1f} us ({wbytes / tiles_ms / 1e6:.0f} GB/s), decode "
              f"{best_ms * 1e3:.1f} us ({wbytes / best_ms / 1e6:.0f} GB/s) {best}", flush=True)


def dense_part(res: dict, ceil: dict, rows=(1, 32)) -> None:
    out = res["dense"] = {"rows": {}, "log": [], "best": {}}
    weights = {}
    for name, (n, k, groups) in DENSE.items():
        copies = max(2, math.ceil(L2_BYTES * 2 / (n * k)))
        weights[name] = [quant_fp8_block(torch.randn(n, k, device="cuda") * 0.02, 32) for _ in range(copies)]
    for m in rows:
        xs = {name: torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
              for name, (n, k, groups) in DENSE.items()}

        def total(cfg):
            ms = 0.0
            for name, (n, k, groups) in DENSE.items():
                ws = weights[name]
                ref = F.fp8_linear_ref(xs[name], *ws[0], 32, groups=groups)
                err = rel(F.fp8_linear(xs[name], *ws[0], 32, groups=groups, config=cfg), ref)
                if not err < 1e-2:
                    raise RuntimeError(f"{name}: rel err {err:.3g} against the reference")
                ms += graph_ms(lambda i: F.fp8_linear(xs[name], *ws[i % len(ws)], 32, groups=groups, config=cfg),
                               len(ws))
            return ms

        base = total({"swap": False})
        start = {"swap": True}
        axes = {"BN": [128, 32], "BK": [256], "num_warps": [8], "num_stages": [5], "SPLIT_K_x": [2, 0.5]}

        def evaluate(cfg):
            c = dict(cfg)
            mult = c.pop("SPLIT_K_x", None)
            if mult is not None:  # scale the default split (2 programs per SM over the tiles)
                c["split_scale"] = mult
            return total(c)

        best, best_ms = search(evaluate, start, axes, out["log"], f"dense M={m}")
        per = {}
        for name, (n, k, groups) in DENSE.items():  # the winner and the baseline per projection
            ws = weights[name]
            c = {k2: v for k2, v in best.items() if k2 != "SPLIT_K_x"}
            if "SPLIT_K_x" in best:
                c["split_scale"] = best["SPLIT_K_x"]
            a = graph_ms(lambda i: F.fp8_linear(xs[name], *ws[i % len(ws)], 32, groups=groups,
                                                config={"swap": False}), len(ws))
            b = graph_ms(lambda i: F.fp8_linear(xs[name], *ws[i % len(ws)], 32, groups=groups, config=c), len(ws))
            wb = n * k * (1 + 1 / 1024)
            per[name] = {"base_ms": a, "best_ms": b, "base_GBps": wb / a / 1e6, "best_GBps": wb / b / 1e6}
        wbytes = sum(n * k for n, k, _ in DENSE.values())
        out["rows"][f"M={m}"] = {"weight_bytes": wbytes, "base_ms": base, "best_ms": best_ms, "best_config": best,
                                 "base_GBps": wbytes / base / 1e6, "best_GBps": wbytes / best_ms / 1e6,
                                 "speedup": base / best_ms, "per_projection": per}
        print(f"dense M={m}: x W^T {base * 1e3:.1f} us ({wbytes / base / 1e6:.0f} GB/s), best "
              f"{best_ms * 1e3:.1f} us ({wbytes / best_ms / 1e6:.0f} GB/s) {best}", flush=True)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axs = plt.subplots(1, 2, figsize=(11, 4))
    for ax, part, (a, b), (la, lb) in ((axs[0], "moe", ("tiles_GBps", "decode_GBps"), ("tile kernels", "decode_moe")),
                                       (axs[1], "dense", ("base_GBps", "best_GBps"), ("x W^T", "best (tuned)"))):
        rows = res.get(part, {}).get("rows", {})
        if not rows:
            continue
        names = list(rows)
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], [rows[n][a] for n in names], 0.4, label=la)
        ax.bar([i + 0.2 for i in xs], [rows[n][b] for n in names], 0.4, label=lb)
        ax.axhline(res["ceilings"]["copy_GBps"], ls=":", c="k", label="copy bandwidth")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("weight GB/s")
        ax.set_title(f"{part}: weight bytes / device time")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/decode-gemms-h200")
    p.add_argument("--parts", default="moe,dense")
    p.add_argument("--budget-s", type=float, default=480, help="stop trying new configs after this many seconds")
    a = p.parse_args()
    DEADLINE[0] = time.time() + a.budget_s
    os.makedirs(a.out, exist_ok=True)
    res = {"meta": {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}
    res["ceilings"] = ceilings()
    print(f"ceilings: copy {res['ceilings']['copy_GBps']:.0f} GB/s, read {res['ceilings']['read_GBps']:.0f} GB/s",
          flush=True)

    def save():
        with open(os.path.join(a.out, "decode_gemms.json"), "w") as f:
            json.dump(res, f, indent=1)
    for part in a.parts.split(","):
        t0 = time.time()
        {"moe": moe_part, "dense": dense_part}[part](res, res["ceilings"])
        res["meta"][f"{part}_s"] = time.time() - t0
        save()
    plot(res, os.path.join(a.out, "decode_gemms.png"))
    print(json.dumps({k: {r: {kk: v for kk, v in row.items() if kk != "per_projection"}
                          for r, row in res[k]["rows"].items()} for k in ("moe", "dense") if k in res}))


if __name__ == "__main__":
    main()
