"""Step-time overhead of grammar masks on the CPU: ``EngineCore.step`` with every row constrained (xgrammar,
``json_schema`` or a DeepSeek tool-call ``structural_tag``) against the same batch unconstrained, at batch 1 and
32, on the built-in model (``tiny-trained``, float32).

Each case adds ``batch`` requests with one prompt, steps until all have prefilled, then times ``--steps`` decode
steps while every row is still running (the schema's ``minLength`` keeps constrained rows from ending early).
A constrained row also never runs a step ahead of the host's read of its token (``EngineCore._may_run_ahead``), so
the overhead holds the mask (fill bitmask + apply), the matcher's accept, and the lost overlap. Ratios are within
one run; the CPU is shared, so absolute times move between runs.

    python benchmarks/grammar_mask_overhead.py --out benchmarks/results/grammar-mask-overhead-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 200}},
    "required": ["note"],
}
STOCK = {
    "type": "function",
    "function": {
        "name": "stock",
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "string"}, "warehouse": {"type": "string"}},
            "required": ["item", "warehouse"],
        },
    },
}
PROMPT = "How many apples are in the north warehouse?"


def constraint(kind: str) -> dict:
    if kind == "none":
        return {}
    if kind == "json_schema":
        return {"json_schema": json.dumps(SCHEMA)}
    import xgrammar as xgr

    tag = xgr.get_model_structural_tag("deepseek_v4", tools=[STOCK], tool_choice="required", reasoning="disabled")
    return {"structural_tag": tag.model_dump_json()}


def time_case(core, batch: int, kind: str, steps: int, tag: str) -> dict:
    from dsserve.engine.sampling_params import SamplingParams

    ids = core.tokenizer.encode(PROMPT, add_bos=True)
    for k in range(batch):
        params = SamplingParams(temperature=0.8, seed=k, max_tokens=steps + 8, ignore_eos=kind == "none")
        if kind != "none":
            params = SamplingParams(temperature=0.8, seed=k, max_tokens=steps + 8, **constraint(kind))
        core.add_request(f"{tag}-{k}", list(ids), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    times = []
    while len(times) < steps and len(core.scheduler.running) == batch:
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    while core.has_unfinished_requests():
        core.step()
    return {"steps": len(times), "median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.mean(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from dsserve.bench.provenance import run_meta
    from dsserve.engine.llm import LLM

    torch.manual_seed(0)
    core = LLM(model="tiny-trained", max_num_seqs=32, dtype="float32").engine
    rows = []
    for batch in map(int, a.batches.split(",")):
        base = None
        for kind in ("none", "json_schema", "structural_tag"):
            time_case(core, batch, kind, 4, f"warm-{batch}-{kind}")  # compiles the grammar, warms the shapes
            r = time_case(core, batch, kind, a.steps, f"{batch}-{kind}")
            base = r["median_ms"] if kind == "none" else base
            rows.append({"batch": batch, "constraint": kind, **r, "ratio": r["median_ms"] / base})
    print(f"{'batch':>5} {'constraint':<16}{'steps':>6}{'median ms':>11}{'mean ms':>9}{'ratio':>7}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['constraint']:<16}{r['steps']:>6}{r['median_ms']:>11.2f}{r['mean_ms']:>9.2f}"
            f"{r['ratio']:>7.2f}"
        )
    meta = run_meta(model="tiny-trained float32, max_num_seqs 32", async_scheduling=core.async_scheduling)
    result = {**meta, "rows": rows}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({f"b{r['batch']}_{r['constraint']}_ratio": round(r["ratio"], 3) for r in rows}))


if __name__ == "__main__":
    main()
