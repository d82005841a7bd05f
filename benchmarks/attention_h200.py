"""The attention side on one GPU: ceilings, decode attention, the consumer indexer, FP4 vs FP8 KV, prefill.

    python benchmarks/attention_h200.py --out benchmarks/results/attention-h200

Real V4.1-Flash shapes (H 64 x D 512, R 64, window 128, top-512; index 32 x 128; candidates 2048 x 8) on
synthetic paged pools. Every figure is a median of CUDA-event timings (triton.testing.do_bench) over inputs
rotated among several sets so that repeated runs do not just re-read L2. Decode attention and the consumer
indexer are timed twice: one eager call (the host's launch path included) and the device time per call inside
a CUDA graph of 20 calls (what a graph-captured decode step pays). Each is printed next to its floor:
the bytes it must move at the copy bandwidth measured in this run, and its FLOPs at the matmul rate
measured in this run. Prints a table and, last, one JSON line; writes JSON + PNG under --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton.testing

from dsserve.bench.device_timing import eager_ms, graph_ms
from dsserve.bench.provenance import run_meta
from dsserve.kernels.indexer import index_scores, index_scores_candidates
from dsserve.kernels.sparse_attention import sparse_attention
from dsserve.kernels.topk import topk
from dsserve.kv.formats import INDEX_FP4, MAIN_FP4, SWA_FP8

H, D, R, W, K = 64, 512, 64, 128, 512
HI, DI, NB, CBS = 32, 128, 2048, 8
EPB = 64  # entries per block at ratio 1 with 64-token blocks
ROT = 4  # input sets rotated through
DEV = "cuda"


def ceilings() -> dict:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")  # noqa: F821
    copy_bw = 2 * n / ms / 1e6  # GB/s, bytes read + written
    del a, b
    m = 8192
    x = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: x @ y, warmup=25, rep=200, return_mode="median")
    bf16 = 2 * m**3 / ms / 1e9  # TFLOP/s
    x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=DEV)
    ms = triton.testing.do_bench(
        lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16), warmup=25, rep=200, return_mode="median"
    )
    fp8 = 2 * m**3 / ms / 1e9
    return {"copy_GBps": copy_bw, "bf16_TFLOPs": bf16, "fp8_TFLOPs": fp8}


def floor_ms(nbytes: float, flops: float, ceil: dict, fp8: bool = False) -> tuple[float, float]:
    return nbytes / ceil["copy_GBps"] / 1e6, flops / (ceil["fp8_TFLOPs" if fp8 else "bf16_TFLOPs"]) / 1e9


def rand_rows(n: int, nbytes: int, fmt) -> torch.Tensor:
    """n packed rows of real-looking data (packing random latents), not zeros."""
    chunk = 1 << 16
    out = torch.empty(n, nbytes, dtype=torch.uint8, device=DEV)
    src = fmt.pack(torch.randn(chunk, fmt.channels, device=DEV))
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        out[s:e] = src[: e - s].roll(s % 97, 0)
    return out


# ------------------------------------------------------------------ decode attention
def attention_case(b: int, ctx: int, main_fmt: str, pool_rows: int, main_pool, win_pool):
    """ROT input sets for B decode rows of B sequences at context ctx (each reads K of its ctx entries)."""
    sets = []
    for _ in range(ROT):
        q = torch.randn(b, H, D, device=DEV, dtype=torch.bfloat16)
        ang = torch.rand(b, R // 2, device=DEV) * 6.28
        seq_base = torch.randint(0, max(1, pool_rows - ctx), (b, 1), device=DEV)
        sel = (seq_base + torch.rand(b, ctx, device=DEV).argsort(1)[:, :K]).to(torch.int32)
        slot = torch.randint(0, win_pool.shape[0] // W, (b, 1), device=DEV)
        old = (slot * W + torch.arange(W, device=DEV)).to(torch.int32)
        old[:, -1] = -1  # the newest row is this step's own
        fresh = torch.randn(b, D, device=DEV, dtype=torch.bfloat16)
        first = torch.arange(b, device=DEV, dtype=torch.int32)
        sink = torch.randn(H, device=DEV)
        sets.append((q, ang.cos(), ang.sin(), win_pool, "fp8", old, fresh, first, main_pool, main_fmt, sel, sink))
    return sets


def decode_attention(ceil: dict) -> list[dict]:
    rows = []
    pool_rows = 64 * 1024 * 1024 // 8  # 8M entries: 2.4 GB of FP4 rows, far past L2
    win_pool = rand_rows(64 * 4 * W, SWA_FP8.row_bytes, SWA_FP8)
    pools = {
        "fp4": rand_rows(pool_rows, MAIN_FP4.row_bytes, MAIN_FP4),
        "fp8": rand_rows(pool_rows, SWA_FP8.row_bytes, SWA_FP8),
    }
    for main_fmt, ctxs, bs in (("fp4", (8192, 131072, 524288), (1, 16, 64)), ("fp8", (131072,), (1, 16, 64))):
        for ctx in ctxs:
            for b in bs:
                sets = attention_case(b, min(ctx, pool_rows), main_fmt, pool_rows, pools[main_fmt], win_pool)
                ms = eager_ms(lambda i: sparse_attention(*sets[i], D**-0.5), ROT)
                gms = graph_ms(lambda i: sparse_attention(*sets[i], D**-0.5), ROT)
                row_b = (MAIN_FP4 if main_fmt == "fp4" else SWA_FP8).row_bytes
                nbytes = b * (K * row_b + W * SWA_FP8.row_bytes + 2 * H * D * 2 + K * 4 + W * 4)
                flops = b * 4 * H * D * (K + W)
                fb, ff = floor_ms(nbytes, flops, ceil)
                rows.append(
                    {
                        "op": "decode_attention",
                        "main_fmt": main_fmt,
                        "B": b,
                        "ctx": ctx,
                        "ms": ms,
                        "graph_ms": gms,
                        "bytes": nbytes,
                        "flops": flops,
                        "floor_bytes_ms": fb,
                        "floor_flops_ms": ff,
                        "GBps": nbytes / ms / 1e6,
                        "TFLOPs": flops / ms / 1e9,
                    }
                )
    return rows


# ------------------------------------------------------------------ consumer indexer
def consumer_indexer(ceil: dict) -> list[dict]:
    rows = []
    for b in (1, 16, 64):
        for ctx in (8192, 524288):
            nblk = -(-ctx // EPB)
            pool = rand_rows(b * nblk * EPB, INDEX_FP4.row_bytes, INDEX_FP4)
            table = torch.arange(b * nblk, device=DEV, dtype=torch.int32).view(b, nblk)
            table = table[:, torch.randperm(nblk, device=DEV)].contiguous()  # blocks scattered in the pool
            n_vis = torch.full((b,), ctx, device=DEV, dtype=torch.int32)
            row_seq = torch.arange(b, device=DEV, dtype=torch.int32)  # one decode row per sequence
            sets = []
            for _ in range(ROT):
                q = torch.randn(b, HI, DI, device=DEV, dtype=torch.bfloat16)
                w = torch.randn(b, HI, device=DEV)
                ncb = -(-ctx // CBS)
                cand = torch.full((b, NB), -1, device=DEV, dtype=torch.int32)
                pick = torch.rand(b, ncb, device=DEV).argsort(1)[:, :NB].sort(1).values
                cand[:, : pick.shape[1]] = pick.to(torch.int32)
                sets.append((q, w, cand))

            def cand_path(i):
                q, w, cand = sets[i]
                s = index_scores_candidates(q, w, pool, "fp4", table, row_seq, EPB, cand, CBS, n_vis)  # noqa: F821
                return topk(s, K)

            def dense_path(i):  # score every visible entry, then mask to the candidates
                q, w, cand = sets[i]
                s = index_scores(q, w, pool, "fp4", table, row_seq, EPB, n_vis, ctx)  # noqa: F821
                keep = torch.zeros(b, -(-ctx // CBS), dtype=torch.bool, device=DEV)
                keep.scatter_(1, cand.clamp_min(0).long(), cand >= 0)
                s = s.masked_fill(~keep.repeat_interleave(CBS, 1)[:, :ctx], float("-inf"))
                return topk(s, K)

            n_scored = min(ctx, NB * CBS)
            nbytes = b * n_scored * INDEX_FP4.row_bytes
            flops = b * n_scored * HI * DI * 2
            fb, ff = floor_ms(nbytes, flops, ceil)
            for name, fn, nb_, fl in (
                ("candidates", cand_path, nbytes, flops),
                ("dense_then_mask", dense_path, b * ctx * INDEX_FP4.row_bytes, b * ctx * HI * DI * 2),
            ):
                ms, gms = eager_ms(fn, ROT), graph_ms(fn, ROT)
                fb, ff = floor_ms(nb_, fl, ceil)
                rows.append(
                    {
                        "op": "consumer_indexer",
                        "path": name,
                        "B": b,
                        "ctx": ctx,
                        "ms": ms,
                        "graph_ms": gms,
                        "bytes": nb_,
                        "flops": fl,
                        "floor_bytes_ms": fb,
                        "floor_flops_ms": ff,
                        "GBps": nb_ / ms / 1e6,
                    }
                )
            del pool
    return rows


# ------------------------------------------------------------------ prefill
def prefill(ceil: dict, chunk: int = 4096) -> list[dict]:
    """One Full layer (indexer over all visible entries + top-k + attention) over N new tokens from an empty
    context, in chunks of ``chunk`` rows as the engine runs them; and the attention alone."""
    rows = []
    for n in (8192, 32768, 131072):
        nblk = -(-n // EPB)
        ipool = rand_rows(nblk * EPB, INDEX_FP4.row_bytes, INDEX_FP4)
        mpool = rand_rows(nblk * EPB, MAIN_FP4.row_bytes, MAIN_FP4)
        wpool = rand_rows(W, SWA_FP8.row_bytes, SWA_FP8)
        t_idx = t_att = t_scores = idx_bytes = 0.0
        for c0 in range(0, n, chunk):
            t = min(chunk, n - c0)
            pos = torch.arange(c0, c0 + t, device=DEV)
            table = torch.arange(nblk, device=DEV, dtype=torch.int32)[None]  # the one sequence's blocks
            row_seq = torch.zeros(t, device=DEV, dtype=torch.int32)
            q_i = torch.randn(t, HI, DI, device=DEV, dtype=torch.bfloat16)
            w = torch.randn(t, HI, device=DEV)
            n_vis = (pos + 1).to(torch.int32)
            n_max = c0 + t
            idx_bytes += t * n_max * 4 * 2 + n_max * INDEX_FP4.row_bytes  # scores written + read by top-k; keys
            state = {}

            def index_step(_):
                s = index_scores(q_i, w, ipool, "fp4", table, row_seq, EPB, n_vis, n_max)  # noqa: F821
                state["sel"] = topk(s, K)

            t_idx += eager_ms(index_step)
            t_scores += eager_ms(lambda _: index_scores(q_i, w, ipool, "fp4", table, row_seq, EPB, n_vis, n_max))  # noqa: F821
            idx, valid = state["sel"]
            if idx.shape[1] < K:
                pad = K - idx.shape[1]
                idx = torch.cat((idx, idx.new_zeros(t, pad)), 1)
                valid = torch.cat((valid, valid.new_zeros(t, pad)), 1)
            sel = torch.where(valid, idx, -1).to(torch.int32)
            q = torch.randn(t, H, D, device=DEV, dtype=torch.bfloat16)
            ang = torch.rand(t, R // 2, device=DEV)
            old = torch.full((t, W), -1, device=DEV, dtype=torch.int32)
            fresh = torch.randn(t, D, device=DEV, dtype=torch.bfloat16)
            first = torch.zeros(t, device=DEV, dtype=torch.int32)
            args = (
                q,
                ang.cos(),
                ang.sin(),
                wpool,
                "fp8",
                old,
                fresh,
                first,
                mpool,
                "fp4",
                sel,
                torch.randn(H, device=DEV),
                D**-0.5,
            )
            t_att += eager_ms(lambda _: sparse_attention(*args))
        pairs = n * (n + 1) / 2
        idx_flops = pairs * HI * DI * 2
        att_flops = 4 * H * D * (K + W) * n
        rows.append(
            {
                "op": "prefill",
                "new_tokens": n,
                "chunk": chunk,
                "indexer_ms": t_idx,
                "attention_ms": t_att,
                "indexer_scores_only_ms": t_scores,
                "indexer_flops": idx_flops,
                "attention_flops": att_flops,
                "indexer_floor_flops_ms": idx_flops / ceil["bf16_TFLOPs"] / 1e9,
                "attention_floor_flops_ms": att_flops / ceil["bf16_TFLOPs"] / 1e9,
                "indexer_bytes": idx_bytes,
                "indexer_floor_bytes_ms": idx_bytes / ceil["copy_GBps"] / 1e6,
            }
        )
        del ipool, mpool
    return rows


def dense(ceil: dict) -> list[dict]:
    """The attention projections with FP8 32x32-block weights (W8A16 and W8A8) against a bf16 matmul."""
    from dsserve.kernels.fp8_linear import bench as fp8_bench

    rows = []
    for shape, kinds in fp8_bench(DEV, block=32).items():
        name, m = shape.split(" M=")
        for kind, r in kinds.items():
            rows.append(
                {
                    "op": "dense",
                    "proj": name,
                    "M": int(m),
                    "kind": kind,
                    "ms": r["ms"],
                    "weight_GBps": r["weight_GBps"],
                    "TFLOPs": r["TFLOPs"],
                    "floor_bytes_ms": 0.0,
                    "floor_flops_ms": 0.0,
                }
            )
    return rows


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    dec = [r for r in res["rows"] if r["op"] == "decode_attention" and r["main_fmt"] == "fp4"]
    for b in sorted({r["B"] for r in dec}):
        pts = sorted(
            (r["ctx"], r["graph_ms"] * 1e3, r["ms"] * 1e3, r["floor_bytes_ms"] * 1e3) for r in dec if r["B"] == b
        )
        (line,) = ax[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"B={b}")
        ax[0].plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=line.get_color())
        ax[0].plot([p[0] for p in pts], [p[3] for p in pts], ":", color=line.get_color())
    ax[0].set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="us per layer",
        title="decode sparse attention (solid: graph, dashed: eager, dotted: bytes floor)",
    )
    ax[0].legend()
    ci = [r for r in res["rows"] if r["op"] == "consumer_indexer"]
    labels, vals = [], []
    for r in ci:
        labels.append(f"{r['path'][:5]} B{r['B']} {r['ctx'] // 1024}K")
        vals.append(r["graph_ms"] * 1e3)
    ax[1].barh(labels, vals)
    ax[1].set(xscale="log", xlabel="us per layer (graph)", title="consumer indexer + top-k")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/attention-h200")
    p.add_argument("--skip", default="", help="comma list of sections to skip: decode,indexer,prefill,dense")
    a = p.parse_args()
    skip = set(a.skip.split(","))
    torch.manual_seed(0)
    meta = run_meta()
    ceil = ceilings()
    res = {
        "meta": meta,
        "ceilings": ceil,
        "rows": [],
        "kv_bytes_per_entry": {
            "fp4_main": MAIN_FP4.row_bytes,
            "fp8_main": SWA_FP8.row_bytes,
            "fp4_smaller_by": 1 - MAIN_FP4.row_bytes / SWA_FP8.row_bytes,
        },
    }
    for name, fn in (
        ("decode", decode_attention),
        ("indexer", consumer_indexer),
        ("prefill", prefill),
        ("dense", dense),
    ):
        if name not in skip:
            try:
                res["rows"] += fn(ceil)
            except Exception as e:  # keep the other sections' numbers; the error is part of the result
                res.setdefault("errors", {})[name] = repr(e)
                print(f"section {name} failed: {e!r}")
            torch.cuda.empty_cache()
            os.makedirs(a.out, exist_ok=True)  # after every section, so a cut-short run keeps what it measured
            with open(os.path.join(a.out, "attention.json"), "w") as f:
                json.dump(res, f, indent=1)
    print(
        f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 {ceil['bf16_TFLOPs']:.0f} TFLOP/s, "
        f"fp8 {ceil['fp8_TFLOPs']:.0f} TFLOP/s"
    )
    for r in res["rows"]:
        keys = ("op", "main_fmt", "path", "B", "ctx", "new_tokens", "proj", "M", "kind")
        head = " ".join(f"{k}={r[k]}" for k in keys if k in r)
        if r["op"] == "dense":
            print(
                f"{head:50s} {r['ms'] * 1e3:9.1f} us graph  {r['weight_GBps']:7.0f} GB/s weights  "
                f"{r['TFLOPs']:6.1f} TFLOP/s"
            )
        elif "ms" in r:
            print(
                f"{head:50s} {r['ms'] * 1e3:9.1f} us eager {r['graph_ms'] * 1e3:9.1f} us graph  "
                f"floor bytes {r['floor_bytes_ms'] * 1e3:7.1f} us  "
                f"flops {r['floor_flops_ms'] * 1e3:7.1f} us"
            )
        else:
            print(
                f"{head:50s} indexer {r['indexer_ms']:8.2f} ms (scores alone {r['indexer_scores_only_ms']:.2f}; "
                f"floors: flops {r['indexer_floor_flops_ms']:.2f}, bytes {r['indexer_floor_bytes_ms']:.2f})"
                f"  attention {r['attention_ms']:8.2f} ms (flops floor {r['attention_floor_flops_ms']:.2f})"
            )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "attention.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, "attention.png"))
    print(json.dumps({"ceilings": ceil, "n_rows": len(res["rows"])}))


if __name__ == "__main__":
    main()
