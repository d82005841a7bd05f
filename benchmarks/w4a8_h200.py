"""W4A8 routed experts and W8A8 dense projections on FP8 tensor cores (issue 59, items 1-2), one run on the H200.

In one go, with the ceilings measured in the same run:
1. ceilings: copy and read bandwidth (1 GiB), bf16 and fp8 (torch._scaled_mm) matmul rates at 8192^3;
2. checks, fresh random inputs on CUDA: each new kernel against its torch reference with the same activation
   rounding (rel err, NaN-poisoned outputs, the PTX nibble conversion bit-equal to the Triton byte ops);
3. routed experts on one EP rank of the release proxy (hidden 5120, intermediate 2304, 48 MXFP4 experts, top-6) at
   T = 1 and 8..256 tokens (1-32 tokens an expert) and a prefill T = 8192: weight-only MXFP4 (today's default)
   against W4A8 (prefill: bf16 tiles with the same rounding; its FP8 tiles as a variant), and a few W4A8 tile
   variants; achieved TB/s over the weight bytes of the experts touched (goal
   >= 3.2 TB/s);
4. the dense FP8 projections of the release (wq_a, wq_b, wkv, wo_a grouped over 8, wo_b; shared expert w13, w2)
   at M = 1, 8, 32 and a prefill M = 8192: W8A16 against W8A8 (and at 8192 the W8A8 FP8 kernel and a bf16 cuBLAS
   matmul of the same shape), TB/s and TFLOP/s against the ceilings.
A variant that fails records its error and the run goes on; past --budget-s the remaining timings are skipped
(recorded as such). Weights rotate over copies larger than L2, so they stream from HBM as in a decode step.

    python benchmarks/w4a8_h200.py --out benchmarks/results/w4a8-h200
    python benchmarks/w4a8_h200.py --smoke --out /tmp/w4a8-smoke   # CPU, Triton interpreter, tiny shapes, < 60 s

Prints a table, then one JSON line (the summary); writes w4a8.json under --out.
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

D, INTER, N_EXP, TOPK = 5120, 2304, 48, 6  # one EP rank of the release proxy (proxy-h200-release)
# (name, N, K, groups) of the release's FP8 projections (presets v41-flash / proxy-h200-release)
DENSE = (
    ("wq_a", 1280, 5120, 1),
    ("wq_b", 32768, 1280, 1),
    ("wkv", 512, 5120, 1),
    ("wo_a", 8192, 4096, 8),
    ("wo_b", 5120, 8192, 1),
    ("shared_w13", 4608, 5120, 1),
    ("shared_w2", 5120, 2304, 1),
)
# T; T * 6 / 48 = 1/8 (B = 1), then 1, 4, 8, 16, 32 tokens an expert; 8192 a prefill chunk (1024 an expert: the
# weight-only default dequantises to bf16 there, W4A8 runs 64-row FP8 tiles)
MOE_TOKENS = (1, 8, 32, 64, 128, 256, 8192)
DENSE_M = (1, 8, 32, 8192)
W4A8_VARIANTS = {  # tile variants timed after the defaults (config overrides of routed_experts_a8; the default BN
    # is 128 where the up kernel still has two programs an SM, else 64: offline SASS favours 128, occupancy 64)
    "BN64": {"BN": 64},
    "BN128": {"BN": 128},
    "stages2": {"num_stages": 2},
    "BK128": {"BK": 128},
    "fp8_tiles": {"dequant": False},  # prefill (T = 8192) on W4A8's FP8 tiles, not the default bf16 tiles
}
PREFILL_ONLY = ("fp8_tiles",)
GOAL_TBPS = 3.2


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Run:
    """The result being built, its errors, and the time budget."""

    def __init__(self, budget_s: float):
        self.res = {"errors": [], "skipped": []}
        self.deadline = time.time() + budget_s

    def over(self, what: str) -> bool:
        if time.time() > self.deadline:
            self.res["skipped"].append(what)
            return True
        return False

    def attempt(self, what: str, fn, default=None):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            self.res["errors"].append({"what": what, "error": repr(e)[:400], "trace": traceback.format_exc()[-800:]})
            print(f"  ERROR {what}: {repr(e)[:200]}", flush=True)
            return default


def ceilings(torch) -> dict:
    from triton.testing import do_bench

    from dsserve.bench.device_timing import graph_ms

    def copy_gbps(n=1 << 30):
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return 2 * n / do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median") / 1e6

    out = {"copy_GBps": copy_gbps()}
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    out["read_GBps"] = 2 * x.numel() / graph_ms(lambda _: x.sum(dtype=torch.float32), calls=5) / 1e6
    del x
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    out["bf16_TFLOPs"] = 2 * m**3 / do_bench(lambda: x @ y, warmup=10, rep=100, return_mode="median") / 1e9
    x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda")
    try:
        ms = do_bench(
            lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16), warmup=10, rep=100,
            return_mode="median",
        )  # fmt: skip
        out["fp8_TFLOPs"] = 2 * m**3 / ms / 1e9
    except Exception as e:  # noqa: BLE001 - older torch builds: recorded, the rest stands
        out["fp8_TFLOPs_error"] = repr(e)[:200]
    return out


def timer(torch, smoke: bool):
    """ms of fn(i) over `sets` input sets: CUDA-graph device time, or (smoke) one wall-clock call."""
    if smoke:

        def wall(fn, sets):
            t0 = time.perf_counter()
            fn(0)
            return (time.perf_counter() - t0) * 1e3

        return wall
    from dsserve.bench.device_timing import graph_ms

    return lambda fn, sets: graph_ms(fn, sets, calls=max(20, sets))


def expert_set(torch, G, dev, d, inter, n_exp, copies, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [
        G.ExpertWeights.from_dense(
            *(
                torch.randn(n_exp, o, i, device=dev, generator=g) * i**-0.5
                for o, i in ((inter, d), (inter, d), (d, inter))
            ),
            "mxfp4",
        )
        for _ in range(copies)
    ]


def moe_part(run: Run, torch, dev, smoke: bool):
    """Checks and the default variants' timings; returns a function that times the tile variants."""
    from dsserve.kernels import grouped_moe as G
    from dsserve.kernels import grouped_moe_a8 as A

    d, inter, n_exp, k = (64, 64, 8, 2) if smoke else (D, INTER, N_EXP, TOPK)
    copies = 1 if smoke else 2  # 2 x 0.85 GB: far past L2
    exs = expert_set(torch, G, dev, d, inter, n_exp, copies)
    per_expert = sum(w[0].numel() + s[0].numel() for w, s in exs[0]._pairs())
    g = torch.Generator(device=dev).manual_seed(1)
    ms_of = timer(torch, smoke)
    out = run.res["moe"] = {"shape": {"d": d, "inter": inter, "experts": n_exp, "topk": k}, "rows": {}, "checks": {}}
    out["per_expert_bytes"] = per_expert

    # checks on fresh inputs: W4A8 against routed_experts_ref(act_quant=True) with fp32 rows (the same rounding)
    # BM 8, 8, 8, 32, 64 (unswapped FP8 tiles), then the prefill path (bf16 tiles, x and h fake-quantised)
    for t in (1, 8) if smoke else (1, 8, 64, 256, 2048, 8192):

        def check(t=t):
            x = torch.randn(t, d, device=dev, generator=g).bfloat16()
            ids = torch.rand(t, n_exp, device=dev, generator=g).argsort(1)[:, :k]
            w = torch.rand(t, k, device=dev, generator=g)
            real = A._empty  # NaN-poisoned scratch and outputs: an unwritten row shows
            A._empty = lambda shape, dtype, device: torch.full(
                shape, float("nan") if dtype.is_floating_point else 0xFF, dtype=dtype, device=device
            )
            try:
                got = G.routed_experts(x, ids, w, exs[0], 10.0, act_quant=True)
                # against the reference in x's dtype (the same bf16 roundings of h before its act_quant), and with
                # fp32 rows: a bf16 ulp of h flips some e4m3 roundings, about 1% rel err (information only)
                row = {"rel_err": rel(got, G.routed_experts_ref(x, ids, w, exs[0], 10.0, act_quant=True))}
                row["rel_err_vs_fp32_rows"] = rel(
                    got, G.routed_experts_ref(x.float(), ids, w, exs[0], 10.0, act_quant=True)
                )
                row["finite"] = bool(got.isfinite().all())
                row["rounding_visible"] = rel(
                    G.routed_experts_ref(x.float(), ids, w, exs[0], 10.0, act_quant=True),
                    G.routed_experts_ref(x.float(), ids, w, exs[0], 10.0),
                )
                if not smoke and t == 8:  # (one T: each asm=False tile compiles its own kernels)
                    plain = G.routed_experts(x, ids, w, exs[0], 10.0, act_quant=True, config={"asm": False})
                    row["asm_equals_triton_ops"] = bool(torch.equal(got, plain))
            finally:
                A._empty = real
            row["ok"] = row["rel_err"] < 1e-2 and row["finite"] and row.get("asm_equals_triton_ops", True)
            return row

        out["checks"][f"T={t}"] = run.attempt(f"moe check T={t}", check, {"ok": False})
        print(f"check w4a8 T={t}: {out['checks'][f'T={t}']}", flush=True)

    later = []  # (T, row, timer) for the variants' pass
    for t in (1, 8) if smoke else MOE_TOKENS:
        if run.over(f"moe T={t}"):
            continue
        sets = 1 if smoke else 4
        xs = [torch.randn(t, d, device=dev, generator=g).bfloat16() for _ in range(sets)]
        ids = [torch.rand(t, n_exp, device=dev, generator=g).argsort(1)[:, :k] for _ in range(sets)]
        ws = [torch.rand(t, k, device=dev, generator=g) for _ in range(sets)]
        used = sum(i.unique().numel() for i in ids) / sets
        wbytes = used * per_expert
        row = out["rows"][f"T={t}"] = {"tokens_an_expert": t * k / n_exp, "experts_touched": used, "bytes": wbytes}

        def timed(name, aq, cfg=None, t=t, xs=xs, ids=ids, ws=ws, row=row, wbytes=wbytes):  # bound now: run later too
            def go():
                fn = lambda i: G.routed_experts(  # noqa: E731
                    xs[i % sets], ids[i % sets], ws[i % sets], exs[i % copies], 10.0, act_quant=aq, config=cfg
                )
                ms = ms_of(fn, sets * copies)
                row[name] = {"ms": ms, "TBps": wbytes / ms / 1e9, "config": cfg}
                return ms

            return run.attempt(f"moe T={t} {name}", go)

        timed("weight_only", False)
        timed("w4a8", True)
        _best(row)
        print(f"moe T={t}: " + _fmt_row(row), flush=True)
        later.append((t, row, timed))

    def variants():
        """The W4A8 tile variants, after every default number is in (they compile more kernels)."""
        for t, row, timed in later:
            for name, cfg in W4A8_VARIANTS.items():
                if (name in PREFILL_ONLY) != (t * k >= 512 * n_exp):  # decode tiles below, bf16 tiles above
                    continue
                if not run.over(f"moe T={t} w4a8 {name}"):
                    timed(f"w4a8_{name}", True, cfg)
            _best(row)
            print(f"moe T={t} with variants: " + _fmt_row(row), flush=True)

    return variants


def _best(row: dict) -> None:
    best = min(
        ((n, v) for n, v in row.items() if n.startswith("w4a8") and isinstance(v, dict)),
        key=lambda nv: nv[1]["ms"],
        default=(None, None),
    )
    row["w4a8_best"] = best[0]
    if best[1] and isinstance(row.get("weight_only"), dict):
        row["w4a8_speedup"] = row["weight_only"]["ms"] / best[1]["ms"]


def _fmt_row(row: dict) -> str:
    return ", ".join(
        f"{n} {v['ms'] * 1e3:.1f} us {v['TBps']:.2f} TB/s" for n, v in row.items() if isinstance(v, dict) and "ms" in v
    )


def dense_part(run: Run, torch, dev, smoke: bool, ceil: dict):
    """Checks and W8A16 / W8A8 timings; returns a function that times the W8A8 FP8 kernel at prefill."""
    from dsserve.kernels import fp8_linear as F
    from dsserve.layers.quant import quant_fp8_block

    shapes = (("tiny", 96, 128, 1), ("tiny_grouped", 128, 64, 2)) if smoke else DENSE
    ms_of = timer(torch, smoke)
    g = torch.Generator(device=dev).manual_seed(2)
    out = run.res["dense"] = {"rows": {}, "checks": {}}
    later = []  # (key, row, timer) of the FP8 kernel at prefill, for the variants' pass
    for name, n, k, groups in shapes:
        nbytes = n * k + math.ceil(n / 32) * math.ceil(k / 32)
        copies = 1 if smoke else max(2, min(64, math.ceil((160 << 20) / nbytes)))  # > L2 (50 MB) in all
        ws = [
            tuple(t.view(torch.uint8) for t in quant_fp8_block(torch.randn(n, k, device=dev, generator=g) * 0.02, 32))
            for _ in range(copies)
        ]
        for m in (1, 8) if smoke else DENSE_M:
            x = torch.randn(m, groups * k, device=dev, generator=g).bfloat16()

            def check():
                if dev == "cuda":  # the allocator's next blocks of the output's size hold NaN: unwritten shows
                    torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                got = F.fp8_linear(x, *ws[0], 32, act_quant=True, groups=groups)
                ref = F.fp8_linear_w8a8_ref(x.float(), *ws[0], 32, groups=groups)
                r = {"rel_err": rel(got, ref), "finite": bool(got.isfinite().all())}
                if m >= F.DEQUANT_MIN_ROWS:  # the FP8-kernel path too, where the default dequantises
                    fp8 = F.fp8_linear(x, *ws[0], 32, act_quant=True, groups=groups, config={"dequant": False})
                    r["fp8_kernel_rel_err"] = rel(fp8, ref)
                r["ok"] = r["rel_err"] < 1e-2 and r["finite"] and r.get("fp8_kernel_rel_err", 0) < 1e-2
                return r

            key = f"{name} M={m}"
            if run.over(f"dense {key}"):
                continue
            out["checks"][key] = run.attempt(f"dense check {key}", check, {"ok": False})
            row = out["rows"][key] = {"N": n, "K": k, "groups": groups, "M": m, "weight_bytes": nbytes}
            flops = 2 * m * n * k

            def timed(label, fn, wb=nbytes, row=row, flops=flops, copies=copies, key=key):  # bound: run later too
                def go():
                    ms = ms_of(fn, copies)
                    row[label] = {"ms": ms, "TBps": wb / ms / 1e9, "TFLOPs": flops / ms / 1e9}

                run.attempt(f"dense {key} {label}", go)

            timed("w8a16", lambda i, x=x, ws=ws, g=groups: F.fp8_linear(x, *ws[i % len(ws)], 32, groups=g))
            timed(
                "w8a8", lambda i, x=x, ws=ws, g=groups: F.fp8_linear(x, *ws[i % len(ws)], 32, act_quant=True, groups=g)
            )
            if m <= 8:  # the quantisation inside the product kernel (fp8_linear fuse_quant): one launch fewer
                later.append(
                    (
                        key,
                        row,
                        lambda timed=timed, x=x, ws=ws, groups=groups: timed(
                            "w8a8_fused_quant",
                            lambda i: F.fp8_linear(
                                x, *ws[i % len(ws)], 32, act_quant=True, groups=groups, config={"fuse_quant": True}
                            ),
                        ),
                    )
                )
            if m >= 1024 and not smoke:
                wb16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16)  # the same product on bf16 weights
                timed("bf16_matmul", lambda i, x=x, wb16=wb16, g=groups: F._product(x, wb16, g), 2 * n * k)
                later.append(
                    (
                        key,
                        row,
                        lambda timed=timed, x=x, ws=ws, groups=groups: timed(
                            "w8a8_fp8_kernel",
                            lambda i: F.fp8_linear(
                                x, *ws[i % len(ws)], 32, act_quant=True, groups=groups, config={"dequant": False}
                            ),
                        ),
                    )
                )
            _rates(row, ceil)
            print(f"dense {key}: " + _fmt_row(row), flush=True)

    def variants():
        """W8A8 with the quantisation fused (<= 8 rows), prefill on the W8A8 FP8 kernel (the default there dequantises
        and runs cuBLAS)."""
        for key, row, go in later:
            if not run.over(f"dense {key} variant"):
                go()
                _rates(row, ceil)
                print(f"dense {key} with its variant: " + _fmt_row(row), flush=True)

    return variants


def _rates(row: dict, ceil: dict) -> None:
    for label in ("w8a16", "w8a8", "w8a8_fused_quant", "w8a8_fp8_kernel", "bf16_matmul"):
        v = row.get(label)
        if isinstance(v, dict) and ceil.get("copy_GBps"):
            v["of_copy_bw"] = v["TBps"] * 1e3 / ceil["copy_GBps"]
            if ceil.get("bf16_TFLOPs"):
                v["of_bf16_rate"] = v["TFLOPs"] / ceil["bf16_TFLOPs"]
        if isinstance(v, dict) and isinstance(row.get("bf16_matmul"), dict):
            v["of_bf16_matmul_same_shape"] = row["bf16_matmul"]["ms"] / v["ms"]


def table(res: dict) -> str:
    lines = ["| part | w/o act quant | with act quant (best) | speedup |", "|---|---|---|---|"]
    for key, row in res.get("moe", {}).get("rows", {}).items():
        wo, best = row.get("weight_only"), row.get(row.get("w4a8_best") or "", None)
        lines.append(
            f"| moe {key} ({row['tokens_an_expert']:.2g}/expert) | "
            + (f"{wo['ms'] * 1e3:.1f} us, {wo['TBps']:.2f} TB/s" if wo else "-")
            + " | "
            + (f"{best['ms'] * 1e3:.1f} us, {best['TBps']:.2f} TB/s ({row['w4a8_best']})" if best else "-")
            + f" | {row.get('w4a8_speedup', float('nan')):.2f}x |"
        )
    for key, row in res.get("dense", {}).get("rows", {}).items():
        a, b = row.get("w8a16"), row.get("w8a8")
        cell = lambda v: f"{v['ms'] * 1e3:.1f} us, {v['TBps']:.2f} TB/s, {v['TFLOPs']:.0f} TFLOP/s" if v else "-"  # noqa: E731
        sp = a["ms"] / b["ms"] if a and b else float("nan")
        lines.append(f"| dense {key} | {cell(a)} | {cell(b)} | {sp:.2f}x |")
    return "\n".join(lines)


def summary(res: dict) -> dict:
    s = {"errors": len(res["errors"]), "skipped": len(res["skipped"])}
    checks = [c for part in ("moe", "dense") for c in res.get(part, {}).get("checks", {}).values()]
    s["checks_ok"] = f"{sum(bool(c.get('ok')) for c in checks)}/{len(checks)}"
    for key, row in res.get("moe", {}).get("rows", {}).items():
        best = row.get(row.get("w4a8_best") or "")
        if best:
            wo = row.get("weight_only") or {}
            s[f"moe {key}"] = {"w4a8_TBps": round(best["TBps"], 3), "weight_only_TBps": round(wo.get("TBps", 0), 3)}
    for key, row in res.get("dense", {}).get("rows", {}).items():
        if isinstance(row.get("w8a8"), dict):
            s[f"dense {key}"] = {
                lbl: round(row[lbl]["TBps" if row["M"] < 1024 else "TFLOPs"], 3)
                for lbl in ("w8a16", "w8a8", "w8a8_fused_quant", "w8a8_fp8_kernel", "bf16_matmul")
                if isinstance(row.get(lbl), dict)
            }
    return s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/w4a8-h200")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (checks the script)")
    p.add_argument("--budget-s", type=float, default=170, help="skip the timings left after this many seconds")
    a = p.parse_args()
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    from dsserve.bench.provenance import run_meta

    dev = "cpu" if a.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check of this script")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    run = Run(a.budget_s)
    t0 = time.time()
    smoke_note = {"smoke": "CPU, Triton interpreter: no ceilings; times are the interpreter's wall clock"}
    ceil = smoke_note if a.smoke else run.attempt("ceilings", lambda: ceilings(torch), {})
    run.res["ceilings"] = ceil
    run.res["meta"] = run_meta(ceilings=ceil, smoke=a.smoke, goal_TBps=GOAL_TBPS)
    print(f"ceilings: {json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in ceil.items()})}")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "w4a8.json")

    def save():
        run.res["meta"]["wall_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(run.res, f, indent=1)

    # the default paths first (the goals' numbers), then the variants with what is left of the budget
    moe_variants = run.attempt("moe", lambda: moe_part(run, torch, dev, a.smoke))
    save()
    dense_variants = run.attempt("dense", lambda: dense_part(run, torch, dev, a.smoke, ceil))
    save()
    for what, fn in (("moe variants", moe_variants), ("dense variants", dense_variants)):
        if fn is not None:
            run.attempt(what, fn)
            save()
    print(table(run.res))
    print(json.dumps(summary(run.res)))


if __name__ == "__main__":
    main()
