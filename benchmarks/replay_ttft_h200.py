"""Issue 9's TTFT study: single-request time to first token with and without bounded replay, on the release proxy.

    python benchmarks/replay_ttft_h200.py --out benchmarks/results/replay-ttft-h200
    python benchmarks/replay_ttft_h200.py --smoke --out /tmp/ttft-smoke      # CPU, tiny model, < 2 min

One model (`proxy-h200-release`: dense FP8, routed experts MXFP4, Engram tables host-resident FP8, dummy weights),
three engines around it, each with prefix caching on and 8K-token prefill chunks:
  (a) replay off: the exact mode (the decoder runs on every prompt row; window rows kept with the cached blocks);
  (b) replay on, eager: the decoder runs on each prompt's last `replay_window` rows, as plain kernel launches;
  (c) replay on, graphs split at the encoder/decoder boundary (the engine's default): the encoder rows of a step that
      fits a row bucket (a prefix hit's replayed + new rows, a short prompt) and the decoder rows replay CUDA graphs
      (engine.encoder_graphs, engine.decoder_row_graphs);
  (d) as (c) with the encoder eager (`--no-encoder-graphs`: the decoder rows' graphs only).
Per prompt length L: TTFT of fresh random prompts (cold), then of an earlier prompt plus `--hit-new` fresh tokens
(a prefix hit on the L cached tokens). Every (engine, L, cold/hit) case runs once untimed first (graph capture and
Triton compilation land there; reported as `first_ms`), then `--repeats` timed requests, one at a time,
max_tokens 1. TTFT = wall time from add_request to the step that returns the token (the engine's own wait for
the device included). With ``--profile-hit``, one more hit per L runs under torch.profiler afterwards: its TTFT,
the device time of its kernels grouped by name (on the CPU smoke run: the ops' self time) and the host time not
covered by them, to say what a hit's step spends at each length. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from model_h200 import DEV, build_core  # noqa: E402

from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.args import EngineArgs  # noqa: E402
from dsserve.engine.core import EngineCore  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.models.loader import LoadedModel  # noqa: E402

MODES = {
    "a_replay_off": dict(swa_bounded_replay=False),
    "b_replay_eager": dict(swa_bounded_replay=True, enforce_eager=True),
    "c_replay_graphs": dict(swa_bounded_replay=True, encoder_graphs=True),
    "d_decoder_graphs_only": dict(swa_bounded_replay=True, encoder_graphs=False),
}


def engine(loaded: LoadedModel, mode: dict, kv_bytes: int, max_len: int, smoke: bool) -> EngineCore:
    args = EngineArgs(
        model="tiny",
        dtype="bfloat16" if DEV == "cuda" else "float32",
        # "device": leave the tables where build_core put them (host, FP8) for every engine
        quantization="fp8" if not smoke else None,
        engram_tables="device",
        max_num_seqs=4,
        max_num_batched_tokens=256 if smoke else 8192,
        max_model_len=max_len,
        enable_prefix_caching=True,
        kv_cache_memory=kv_bytes,
        reference_ops="all" if smoke and DEV == "cpu" else "",
        **mode,
    )
    return EngineCore(args, loaded=loaded)


def ttft_ms(core: EngineCore, rid: str, ids: list[int]) -> tuple[float, int]:
    """(ms to the first token, prompt tokens served from the prefix cache)."""
    if DEV == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    core.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while True:
        outs = [o for o in core.step() if o.request_id == rid and o.outputs[0].token_ids]
        if outs:
            return (time.perf_counter() - t) * 1e3, outs[0].num_cached_tokens


def study(core: EngineCore, lengths: list[int], repeats: int, hit_new: int, gen: torch.Generator) -> list[dict]:
    vocab = core.cfg.vocab_size
    fresh = lambda n: torch.randint(3, vocab - 2, (n,), generator=gen).tolist()  # noqa: E731
    rows, n = [], 0
    for L in lengths:
        reps = max(1, repeats if L <= 32768 else repeats // 2)
        prompts = [fresh(L) for _ in range(reps + 1)]
        for kind in ("cold", "hit"):
            times, cached = [], []
            before = core.stats.as_dict()
            for i, p in enumerate(prompts):
                ids = p if kind == "cold" else p + fresh(hit_new)
                ms, c = ttft_ms(core, f"r{n}", ids)
                n += 1
                times.append(ms)
                cached.append(c)
            after = core.stats.as_dict()
            timed = sorted(times[1:])
            rows.append(
                {
                    "L": L,
                    "kind": kind,
                    "first_ms": times[0],
                    "ms": timed[len(timed) // 2],
                    "all_ms": times,
                    "cached_tokens": cached,
                    **{
                        k: after[k] - before[k]
                        for k in (
                            "decoder_rows_skipped",
                            "replayed_rows",
                            "replay_graph_steps",
                            "encoder_graph_steps",
                            "prefill_rows",
                        )
                    },
                }
            )
            r = rows[-1]
            print(
                f"  L={L:>6d} {kind:4s} ttft {r['ms']:9.1f} ms (first {r['first_ms']:9.1f}) cached {cached[-1]:>6d} "
                f"decoder rows skipped {r['decoder_rows_skipped']}",
                flush=True,
            )
    return rows


def profile_hit(core: EngineCore, L: int, hit_new: int, gen: torch.Generator, top: int = 15) -> dict:
    """A cold prompt of L tokens, then a hit on it (+hit_new fresh tokens) under torch.profiler: the hit's TTFT,
    its kernels' total device ms and count, and the `top` kernel names by device ms (CPU: ops by self time)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = core.cfg.vocab_size
    prompt = torch.randint(3, vocab - 2, (L,), generator=gen).tolist()
    ttft_ms(core, f"prof-{L}-cold", prompt)
    hit = prompt + torch.randint(3, vocab - 2, (hit_new,), generator=gen).tolist()
    acts = [ProfilerActivity.CUDA] if DEV == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        ms, cached = ttft_ms(core, f"prof-{L}-hit", hit)
    per: dict[str, list] = {}
    if DEV == "cuda":
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = per.setdefault(e.name[:80], [0.0, 0])
                k[0] += e.time_range.elapsed_us() / 1e3
                k[1] += 1
    else:
        for e in prof.key_averages():
            per[e.key[:80]] = [e.self_cpu_time_total / 1e3, e.count]
    busy = sum(v[0] for v in per.values())
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])
    return {
        "L": L,
        "ttft_ms": ms,
        "cached_tokens": cached,
        "kernels_ms": busy,
        "kernels": sum(v[1] for v in per.values()),
        "not_kernels_ms": ms - busy,
        "top": [{"name": n, "ms": round(v[0], 3), "count": v[1]} for n, v in ranked[:top]],
    }


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    color = {m: f"C{i}" for i, m in enumerate(MODES)}
    for i, kind in enumerate(("cold", "hit")):
        for mode, rows in res["modes"].items():
            pts = [(r["L"], r["ms"]) for r in rows if r["kind"] == kind]
            ax[i].plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color[mode], label=mode)
        ax[i].set(
            xscale="log",
            yscale="log",
            xlabel="prompt tokens",
            ylabel="TTFT ms",
            title=f"{kind} prompt" + (f" (+{res['meta']['hit_new']} new on a cached prefix)" if kind == "hit" else ""),
        )
        ax[i].legend()
    for kind, mark in (("cold", "o-"), ("hit", "s--")):
        for mode in [m for m in MODES if m != "a_replay_off" and m in res["modes"]]:
            pts = [(r["L"], r["vs_a"]) for r in res["ratios"] if r["kind"] == kind and r["mode"] == mode]
            ax[2].plot([p[0] for p in pts], [p[1] for p in pts], mark, color=color[mode], label=f"{mode} {kind}")
    ax[2].axhline(0.7, ls=":", color="k")
    ax[2].axhline(1.0, ls="-", color="k", lw=0.5)
    ax[2].set(xscale="log", xlabel="prompt tokens", ylabel="TTFT / TTFT of (a)", title="against replay off")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/replay-ttft-h200")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--lengths", default="", help="comma list (default 1024,8192,32768,100000)")
    p.add_argument("--repeats", type=int, default=3, help="timed requests per case (halved past 32K)")
    p.add_argument("--hit-new", type=int, default=256, help="fresh tokens after the cached prefix")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--profile-hit", action="store_true", help="then profile one more hit per length and mode")
    a = p.parse_args()
    lengths = (
        [int(x) for x in a.lengths.split(",")]
        if a.lengths
        else ([40, 100, 200] if a.smoke else [1024, 8192, 32768, 100000])
    )
    t0 = time.perf_counter()
    if a.smoke:
        from dsserve.models.loader import load_model

        torch.set_flush_denormal(True)  # the tiny random model's fp32 activations go subnormal: 50x slower CPU ops
        loaded = load_model("tiny", dtype="float32")
    else:
        core, info = build_core("proxy-h200-release", (1, 1024), release=True, smoke=False, engram_tables="host-fp8")
        loaded = LoadedModel(core.model, core.cfg, core.tokenizer, "dummy")
        del core
    res = {
        "meta": run_meta(
            model=loaded.cfg.name,
            hit_new=a.hit_new,
            lengths=lengths,
            build_s=time.perf_counter() - t0,
        ),
        "modes": {},
        "graphs": {},
        "profiles": {},
    }
    os.makedirs(a.out, exist_ok=True)
    max_len = max(lengths) + a.hit_new + 64
    kv_bytes = (1 << 26) if a.smoke else 24 << 30
    for name in a.modes.split(","):
        print(f"{name}:", flush=True)
        core = engine(loaded, MODES[name], kv_bytes, max_len, a.smoke)
        res["modes"][name] = study(core, lengths, a.repeats, a.hit_new, torch.Generator().manual_seed(0))
        if a.profile_hit:
            res["profiles"][name] = [profile_hit(core, L, a.hit_new, torch.Generator().manual_seed(1)) for L in lengths]
            for r in res["profiles"][name]:
                print(
                    f"  profiled hit L={r['L']:>6d}: ttft {r['ttft_ms']:.1f} ms, kernels {r['kernels_ms']:.1f} ms "
                    f"({r['kernels']}), top: " + ", ".join(f"{t['name'][:32]} {t['ms']:.1f}" for t in r["top"][:4]),
                    flush=True,
                )
        rg, eg = core.runner.decoder_row_graphs, core.runner.encoder_graphs
        res["graphs"][name] = {
            "replay": None if rg is None else rg.report(),
            "encoder": None if eg is None else eg.report(),
            "decode": None if core.runner.decode_graphs is None else core.runner.decode_graphs.report(),
        }
        core.kv = core.runner = core.model = None
        del core
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        with open(os.path.join(a.out, "ttft.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    base = {(r["L"], r["kind"]): r["ms"] for r in res["modes"].get("a_replay_off", [])}
    res["ratios"] = [
        {
            "mode": m,
            "L": r["L"],
            "kind": r["kind"],
            "vs_a": r["ms"] / base[(r["L"], r["kind"])],
            "faster_than_a": 1 - r["ms"] / base[(r["L"], r["kind"])],
        }
        for m, rows in res["modes"].items()
        if m != "a_replay_off"
        for r in rows
        if (r["L"], r["kind"]) in base
    ]
    print(f"{'L':>7s} {'kind':5s} " + " ".join(f"{m:>16s}" for m in res["modes"]) + "   c faster than a")
    for L in lengths:
        for kind in ("cold", "hit"):
            ms = {
                m: next(r["ms"] for r in rows if r["L"] == L and r["kind"] == kind) for m, rows in res["modes"].items()
            }
            c = next(
                (
                    r["faster_than_a"]
                    for r in res["ratios"]
                    if r["mode"] == "c_replay_graphs" and r["L"] == L and r["kind"] == kind
                ),
                float("nan"),
            )
            print(f"{L:7d} {kind:5s} " + " ".join(f"{v:14.1f}ms" for v in ms.values()) + f"   {c:6.0%}")
    with open(os.path.join(a.out, "ttft.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    if res["ratios"]:
        plot(res, os.path.join(a.out, "ttft.png"))
    print(
        json.dumps(
            {
                "ratios": [(r["mode"][0], r["L"], r["kind"], round(r["faster_than_a"], 3)) for r in res["ratios"]],
                "graphs": res["graphs"],
            },
            default=str,
        )
    )


if __name__ == "__main__":
    main()
