"""A long prefill chunk's kernels on one GPU, each fast path against the path it would replace (issue 8).

    python benchmarks/prefill_kernels_h200.py --out benchmarks/results/prefill-kernels-h200
    python benchmarks/prefill_kernels_h200.py --smoke --out /tmp/pk   # CPU, tiny shapes, the Triton interpreter

Shapes of an 8192-row chunk of V4.1-Flash on 128K of context (H 64 x D 512, window 128, top-512; index 32 x 128
over 139K entries at ratio 1; candidates 2048 x 8; mHC 4 x 5120). Cases:
- attention: the general kernel on FP8 / FP4 pools vs the many-row kernel on them and on bf16 key tables
  (kernels/sparse_attention_prefill; the tables' unpack included);
- index: the source scoring, the general kernel on FP4 vs on a bf16 table vs the long-chunk kernel
  (kernels/indexer_prefill) at a few tiles; the consumers' candidate scoring on FP4 vs on the bf16 table;
- top-k of rows of 69K / 139K scores: torch.topk on int64 keys vs chunk_topk (both bit for bit stable_topk);
- mHC site partials: tf32x3 vs bf16x3.
Each case checks its output against the path it replaces, then times it (triton.testing.do_bench, median), and
is printed with its TFLOP/s and the share of the bf16 matmul rate measured in this run (copy bandwidth too).
Prints a table, then one JSON line; writes prefill_kernels.json and .png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

import dsserve.kernels.indexer as ix  # noqa: E402
import dsserve.kernels.indexer_prefill as ixp  # noqa: E402
import dsserve.kernels.mhc as mhc  # noqa: E402
import dsserve.kernels.sparse_attention as sa  # noqa: E402
import dsserve.kernels.sparse_attention_prefill as sap  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.kernels.kv_unpack import unpack_rows  # noqa: E402
from dsserve.kernels.row_topk import chunk_topk  # noqa: E402
from dsserve.kernels.topk import candidate_blocks, topk_int64_keys  # noqa: E402
from dsserve.kv.formats import INDEX_FP4, MAIN_FP4, SWA_FP8  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
if SMOKE:  # tiny shapes; the kernels' tiles shrunk to fit them
    T, H, D, R, W, K, CTX, HI, DI, NB, CBS, HC, HD = 40, 4, 64, 16, 16, 16, 64, 4, 32, 4, 4, 4, 64
    ixp.ROWS, ixp.BLOCK_N, ixp.SUPER, sap.BLOCK_N = 4, 16, 2, 16
    TOPK_CHUNK = 32
else:
    T, H, D, R, W, K, CTX, HI, DI, NB, CBS, HC, HD = 8192, 64, 512, 64, 128, 512, 131072, 32, 128, 2048, 8, 4, 5120
    TOPK_CHUNK = None


def ceilings() -> dict:
    if SMOKE:
        return {"copy_GBps": 1.0, "bf16_TFLOPs": 1.0}
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    copy = 2 * n / triton.testing.do_bench(lambda: b.copy_(a), rep=200, return_mode="median") / 1e6  # noqa: F821
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    bf16 = 2 * 8192**3 / triton.testing.do_bench(lambda: x @ x, rep=200, return_mode="median") / 1e9
    return {"copy_GBps": copy, "bf16_TFLOPs": bf16}


def ms_of(fn) -> float:
    if SMOKE:  # the interpreter: one timed call (the numbers mean nothing; the smoke test checks the plumbing)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, rep=200, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")
    return float((a[fin].double() - b[fin].double()).norm() / b[fin].double().norm().clamp_min(1e-30))


def row(section: str, case: str, ms: float, flops: float, err: float, ceil: dict) -> dict:
    tf = flops / ms / 1e9
    return {
        "section": section,
        "case": case,
        "ms": ms,
        "TFLOPs": tf,
        "of_bf16_rate": tf / ceil["bf16_TFLOPs"],
        "rel_err": err,
    }


def attention(ceil: dict, g) -> list[dict]:
    """One chunk after CTX tokens: no old window rows past the chunk's first W rows, K valid picks a row."""
    t = torch.arange(T, device=DEV)
    n_main = CTX // 4
    old = torch.where(torch.arange(W, device=DEV)[None, :] > t[:, None], torch.arange(W, device=DEV)[None, :], -1).to(
        torch.int32
    )
    sel = torch.stack([torch.randperm(n_main, generator=g)[:K] for _ in range(T)]).to(DEV, torch.int32)
    q = torch.randn(T, H, D, generator=g).to(DEV, torch.bfloat16)
    ang = torch.rand(T, R // 2, generator=g).to(DEV)
    fresh = torch.randn(T, D, generator=g).to(DEV, torch.bfloat16)
    first = torch.zeros(T, dtype=torch.int32, device=DEV)
    sink = torch.randn(H, generator=g).to(DEV)
    wpool = SWA_FP8.with_channels(D).pack(torch.randn(W, D, generator=g)).to(DEV)
    mpool = MAIN_FP4.with_channels(D).pack(torch.randn(n_main, D, generator=g)).to(DEV)
    keys = float(((old >= 0).sum(1) + (t + 1).clamp(max=W) + K).sum())
    flops = 4 * H * D * keys
    packed = (wpool, "fp8", old, fresh, first, mpool, "fp4", sel, sink, D**-0.5)

    def general():
        sap.PREFILL_MIN_ROWS = 1 << 62
        return sa.sparse_attention(q, ang.cos(), ang.sin(), *packed)

    def prefill_packed():
        sap.PREFILL_MIN_ROWS = 1
        return sa.sparse_attention(q, ang.cos(), ang.sin(), *packed)

    def prefill_tables():
        sap.PREFILL_MIN_ROWS = 1
        wt = unpack_rows(wpool, "fp8", torch.arange(W, dtype=torch.int32, device=DEV)).view(torch.uint8)
        mt = unpack_rows(mpool, "fp4", torch.arange(n_main, dtype=torch.int32, device=DEV)).view(torch.uint8)
        return sa.sparse_attention(
            q, ang.cos(), ang.sin(), wt, "bf16", old, fresh, first, mt, "bf16", sel, sink, D**-0.5
        )

    base = general().float()
    out = [row("attention", "general kernel, FP8 / FP4 pools", ms_of(general), flops, 0.0, ceil)]
    for name, fn in (
        ("many-row kernel, FP8 / FP4 pools", prefill_packed),
        ("many-row kernel, bf16 tables (unpack included)", prefill_tables),
    ):
        err = rel(fn().float(), base)
        out.append(row("attention", name, ms_of(fn), flops, err, ceil))
    sap.PREFILL_MIN_ROWS = 128
    return out


def index(ceil: dict, g) -> list[dict]:
    n_max = CTX + T
    pool = INDEX_FP4.with_channels(DI).pack(torch.randn(n_max, DI, generator=g)).to(DEV)
    q = torch.randn(T, HI, DI, generator=g).to(DEV, torch.bfloat16)
    w = (torch.rand(T, HI, generator=g) * 0.01).to(DEV)
    epb = 64 if n_max % 64 == 0 else 1
    bt = torch.arange(n_max // epb, dtype=torch.int32, device=DEV)[None]
    seq = torch.zeros(T, dtype=torch.int32, device=DEV)
    nv = (CTX + 1 + torch.arange(T, device=DEV)).to(torch.int32)
    flops = float(nv.sum()) * HI * DI * 2
    one = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    rows = torch.arange(n_max, dtype=torch.int32, device=DEV)

    def general():
        return ix.index_scores(q, w, pool, "fp4", bt, seq, epb, nv, n_max)

    def tabled():
        tab = unpack_rows(pool, "index_fp4", rows).view(torch.uint8)
        return ix.index_scores(q, w, tab, "bf16", one, seq, n_max, nv, n_max)

    ixp.PREFILL_ROWS = 1 << 62
    base = general()
    out = [
        row("index", "sources: general kernel, FP4", ms_of(general), flops, 0.0, ceil),
        row("index", "sources: general kernel, bf16 table", ms_of(tabled), flops, rel(tabled(), base), ceil),
    ]
    tiles = ((ixp.ROWS, ixp.BLOCK_N, ixp.SUPER),) if SMOKE else ((8, 32, 128), (4, 64, 64), (8, 64, 64), (16, 32, 128))
    ixp.PREFILL_ROWS = 1
    for rows_, bn, sup in tiles:
        ixp.ROWS, ixp.BLOCK_N, ixp.SUPER = rows_, bn, sup
        out.append(
            row(
                "index",
                f"sources: long-chunk kernel {rows_} rows x {bn} x {sup}, bf16 table",
                ms_of(tabled),
                flops,
                rel(tabled(), base),
                ceil,
            )
        )
    ixp.PREFILL_ROWS = 1 << 62
    cand = candidate_blocks(base, nv, CBS, NB)
    cflops = float(T) * NB * CBS * HI * DI * 2
    cbase = ix.index_scores_candidates(q, w, pool, "fp4", bt, seq, epb, cand, CBS, nv)

    def cand_tabled():
        tab = unpack_rows(pool, "index_fp4", rows).view(torch.uint8)
        return ix.index_scores_candidates(q, w, tab, "bf16", one, seq, n_max, cand, CBS, nv)

    out += [
        row(
            "index",
            "consumers: candidates, FP4",
            ms_of(lambda: ix.index_scores_candidates(q, w, pool, "fp4", bt, seq, epb, cand, CBS, nv)),
            cflops,
            0.0,
            ceil,
        ),
        row("index", "consumers: candidates, bf16 table", ms_of(cand_tabled), cflops, rel(cand_tabled(), cbase), ceil),
    ]
    return out


def top_k(ceil: dict, g) -> list[dict]:
    out = []
    for n in ((CTX + T) // 2, CTX + T):
        s = torch.randn(T, n, generator=g).to(DEV)
        s = s.masked_fill(
            torch.arange(n, device=DEV)[None, :] > (n - T + torch.arange(T, device=DEV))[:, None], float("-inf")
        )
        k = K
        want = topk_int64_keys(s, k)
        chunk = (lambda: chunk_topk(s, k, TOPK_CHUNK)) if TOPK_CHUNK else (lambda: chunk_topk(s, k))
        got = chunk()
        same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for name, fn, err in (
            (f"N = {n}: torch.topk on int64 keys", lambda: topk_int64_keys(s, k), 0.0),
            (f"N = {n}: chunk_topk", chunk, 0.0 if same else float("inf")),
        ):
            ms = ms_of(fn)
            out.append({"section": "topk", "case": name, "ms": ms, "GBps": s.numel() * 4 / ms / 1e6, "rel_err": err})
    return out


def mhc_site(ceil: dict, g) -> list[dict]:
    args = mhc.example_inputs(T, HC, HD, torch.bfloat16, DEV, seed=0)
    ref = mhc.mhc_site_ref(*args)
    out = []
    for name, rows_ in (("tf32x3", 1 << 62), ("bf16x3", 1)):
        mhc.BF16X3_MIN_ROWS = rows_
        got = mhc.mhc_site(*args)
        err = max(rel(a.float(), b.float()) for a, b in zip(got[1:], ref[1:]))
        ms = ms_of(lambda: mhc.mhc_site(*args))
        out.append(
            {
                "section": "mhc",
                "case": f"site, {name} partials",
                "ms": ms,
                "GBps": T * HC * HD * 2 / ms / 1e6,
                "rel_err": err,
            }
        )
    mhc.BF16X3_MIN_ROWS = 1 << 62
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1))
    labels = [f"{r['section']}: {r['case']}" for r in rows]
    ax.barh(range(len(rows)), [r["ms"] for r in rows])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/prefill-kernels-h200")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the Triton interpreter")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    ceil = ceilings()
    res = {
        "meta": run_meta(),
        "ceilings": ceil,
        "rows": [],
    }
    for section in (attention, index, top_k, mhc_site):
        res["rows"] += section(ceil, g)
        json.dump(res, open(os.path.join(a.out, "prefill_kernels.json"), "w"), indent=1)
    plot(res["rows"], os.path.join(a.out, "prefill_kernels.png"))
    print(f"ceilings: {ceil}")
    print(f"{'section':10s} {'case':62s} {'ms':>10s} {'TFLOP/s':>9s} {'rel err':>9s}")
    for r in res["rows"]:
        print(
            f"{r['section']:10s} {r['case']:62s} {r['ms']:10.3f} {r.get('TFLOPs', float('nan')):9.1f} "
            f"{r['rel_err']:9.2e}"
        )
    print(json.dumps({"ceilings": ceil, "rows": [{k: r[k] for k in ("section", "case", "ms")} for r in res["rows"]]}))


if __name__ == "__main__":
    main()
