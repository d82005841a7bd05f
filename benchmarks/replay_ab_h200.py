"""One request at a time with bounded replay off, on, off again, on the release proxy: TTFT and decode steps.

    PYTHONPATH=.:scratch_gpu/pylib python benchmarks/replay_ab_h200.py --out benchmarks/results/replay-ab-h200

Separates the engine's own per-step cost in each mode from what a live sweep adds (first-use compiles and graph
captures, other requests' prefill chunks). Per engine: a 6000-token prompt and 40 tokens ("warm": compiles, graph
captures), then twice a prefix hit (that prompt + 1500 fresh tokens) and 64 tokens. Per phase: TTFT, the median and
largest gap between steps while decoding, decode steps run as graphs, and the steps' host and device-wait seconds
(EngineStats). The first engine of the process pays Triton's compilation, so replay off runs first and again last.
Prints one line per engine, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from model_h200 import build_core  # noqa: E402

from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.args import EngineArgs  # noqa: E402
from dsserve.engine.core import EngineCore  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.models.loader import LoadedModel  # noqa: E402


def phase(core: EngineCore, rid: str, ids: list[int], n: int) -> dict:
    core.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    s0, t0, ts = core.stats.as_dict(), time.perf_counter(), []
    while core.has_unfinished_requests():
        core.step()
        ts.append(time.perf_counter())
    s1 = core.stats.as_dict()
    gaps = sorted(b - a for a, b in zip(ts[:-1], ts[1:]))
    return {
        "steps": len(ts),
        "ttft_ms": (ts[0] - t0) * 1e3,
        "itl_p50_ms": gaps[len(gaps) // 2] * 1e3,
        "itl_max_ms": gaps[-1] * 1e3,
        **{
            k: s1[k] - s0[k]
            for k in ("graph_steps", "replay_graph_steps", "graph_captures", "step_host_seconds", "step_wait_seconds")
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/replay-ab-h200")
    a = p.parse_args()
    core0, _ = build_core("proxy-h200-release", (1, 1024), release=True, smoke=False, engram_tables="host-fp8")
    loaded = LoadedModel(core0.model, core0.cfg, core0.tokenizer, "dummy")
    del core0
    gen = torch.Generator().manual_seed(0)
    fresh = lambda n: torch.randint(3, loaded.cfg.vocab_size - 2, (n,), generator=gen).tolist()  # noqa: E731
    prompt = fresh(6000)
    runs = []
    for replay in (False, True, False):
        core = EngineCore(
            EngineArgs(
                model="tiny",
                dtype="bfloat16",
                quantization="fp8",
                max_num_seqs=32,
                max_num_batched_tokens=8192,
                max_model_len=40000,
                enable_prefix_caching=True,
                kv_cache_memory=8 << 30,
                swa_bounded_replay=replay,
            ),
            loaded=loaded,
        )
        res = {
            "replay": replay,
            "warm": phase(core, "warm", prompt, 40),
            "hit": phase(core, "hit", prompt + fresh(1500), 64),
            "hit2": phase(core, "hit2", prompt + fresh(1500), 64),
            "decode_graphs": core.runner.decode_graphs.report(),
            "decoder_row_graphs": None
            if core.runner.decoder_row_graphs is None
            else core.runner.decoder_row_graphs.report(),
        }
        print(
            f"replay {replay}: "
            + "  ".join(
                f"{k} ttft {res[k]['ttft_ms']:.0f} ms itl p50 {res[k]['itl_p50_ms']:.1f} ms"
                for k in ("warm", "hit", "hit2")
            ),
            flush=True,
        )
        runs.append(res)
        core.kv = core.runner = None
        del core
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    meta = run_meta()
    with open(os.path.join(a.out, "ab.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1, default=str)
    print(json.dumps({"runs": [{k: r[k] for k in ("replay", "hit2")} for r in runs]}, default=str))


if __name__ == "__main__":
    main()
