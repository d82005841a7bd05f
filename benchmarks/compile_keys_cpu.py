"""Does the warm-up reach every kernel that traffic then needs? The launch census on the CPU (no GPU needed).

    python benchmarks/compile_keys_cpu.py --out benchmarks/results/compile-keys-cpu

Builds the tiny model's engine (bf16, paged, prefix caching; bounded replay off and on), runs engine.warmup through
kernels.launch_census (every Triton launch's compile key recorded under the interpreter, the results from the torch
references), then seeded multi-turn traffic: sessions whose turns add 3-600 tokens to 200-1,500-token histories, so
that every turn is a prefix hit at a new context. Prints, per mode, the warm-up's distinct keys and the keys the
traffic met that the warm-up had not, each with the fields that differ from its nearest warm-up key: on a GPU each
would be a compile stalling a live step. Last line: the JSON written to compile_keys.json under --out.
"""

import argparse
import json
import os
import random
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.args import EngineArgs  # noqa: E402
from dsserve.engine.core import EngineCore  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.engine.warmup import warm_up  # noqa: E402
from dsserve.kernels.launch_census import CensusOps, LaunchCensus  # noqa: E402


def nearest_diff(key: tuple, seen) -> list:
    best = max(seen, key=lambda o: sum(a == b for a, b in zip(o, key)), default=None)
    return [] if best is None else [[str(a), str(b)] for a, b in zip(best, key) if a != b]


def run_mode(replay: bool, a) -> dict:
    t0 = time.time()
    core = EngineCore(
        EngineArgs(
            model="tiny",
            load_format="dummy",
            dtype="bfloat16",
            device="cpu",
            attention_backend="paged",
            enable_prefix_caching=True,
            swa_bounded_replay=replay,
            max_model_len=a.max_model_len,
            kv_cache_memory=32 << 20,
            max_num_seqs=4,
            max_num_batched_tokens=a.chunk,
            async_scheduling=True,
        )
    )
    census = LaunchCensus()
    core.model.kernel_ops = CensusOps(census=census)
    report = warm_up(core)
    warm = census.snapshot()
    rng, g = random.Random(a.seed), torch.Generator().manual_seed(a.seed)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    sessions = [torch.randint(0, 8000, (rng.randint(200, 1500),), generator=g).tolist() for _ in range(a.sessions)]
    sent = 0
    for turn in range(a.turns):
        for i, hist in enumerate(sessions):
            hist += torch.randint(0, 8000, (rng.choice([3, 20, 85, 200, 600]),), generator=g).tolist()
            if len(hist) + 3 <= a.max_model_len:
                core.add_request(f"s{i}-t{turn}", list(hist), params)
                sent += 1
        while core.has_unfinished_requests():
            core.step()
    new = {
        name: [nearest_diff(k, warm.get(name, ())) for k in keys - warm.get(name, frozenset())]
        for name, keys in census.keys.items()
        if keys - warm.get(name, frozenset())
    }
    return {
        "replay": replay,
        "warmup_requests": report.requests,
        "warmup_keys": sum(len(v) for v in warm.values()),
        "warmup_keys_by_kernel": {k: len(v) for k, v in sorted(warm.items())},
        "traffic_requests": sent,
        "traffic_prefix_hit_tokens": core.stats.prefix_hit_tokens,
        "launches": census.launches,
        "new_keys": sum(len(v) for v in new.values()),
        "new_keys_by_kernel": new,
        "census_errors": census.errors,
        "seconds": time.time() - t0,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/compile-keys-cpu")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {
        "meta": run_meta(census="Triton interpreter, no device"),
        "modes": [run_mode(r, a) for r in (False, True)],
    }
    print(f"{'replay':>6} | {'warm-up keys':>12} | {'traffic requests':>16} | {'new keys':>8} | by kernel")
    for m in res["modes"]:
        by = ", ".join(f"{k} {len(v)}" for k, v in m["new_keys_by_kernel"].items()) or "-"
        print(
            f"{'on' if m['replay'] else 'off':>6} | {m['warmup_keys']:>12} | {m['traffic_requests']:>16} | "
            f"{m['new_keys']:>8} | {by}"
        )
        for name, diffs in m["new_keys_by_kernel"].items():
            for d in diffs:
                print(f"         {name}: " + "; ".join(f"{x} -> {y}" for x, y in d))
    with open(os.path.join(a.out, "compile_keys.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(
        json.dumps(
            {
                "modes": [
                    {k: m[k] for k in ("replay", "warmup_keys", "traffic_requests", "new_keys")} for m in res["modes"]
                ]
            }
        )
    )


if __name__ == "__main__":
    main()
