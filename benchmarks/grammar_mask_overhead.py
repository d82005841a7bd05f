"""Step-time overhead of grammar masks on the CPU: ``EngineCore.step`` with every row constrained (xgrammar,
``json_schema`` or a DeepSeek tool-call ``structural_tag``) against the same batch unconstrained, at batch 1 and
32, on the built-in model (``tiny-trained``, float32).

Each case adds ``batch`` requests with one prompt, steps until all have prefilled, then times ``--steps`` decode
steps while every row is still running (the schema's ``minLength`` keeps constrained rows from ending early), and
the time inside the grammar's ``mask`` and ``accept`` (all rows, per step).
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


GRAMMAR_S = [0.0]  # seconds spent in JsonGrammar.mask / accept (the wrappers below add to it)


def count_grammar_time() -> None:
    from dsserve.engine.structured_output import JsonGrammar

    for name in ("mask", "accept"):
        inner = getattr(JsonGrammar, name)

        def timed(self, *a, _inner=inner):
            t0 = time.perf_counter()
            try:
                return _inner(self, *a)
            finally:
                GRAMMAR_S[0] += time.perf_counter() - t0

        setattr(JsonGrammar, name, timed)


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
    times, GRAMMAR_S[0] = [], 0.0
    while len(times) < steps and len(core.scheduler.running) == batch:
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    grammar_ms = 1e3 * GRAMMAR_S[0] / max(len(times), 1)
    while core.has_unfinished_requests():
        core.step()
    med, mean = 1e3 * statistics.median(times), 1e3 * statistics.mean(times)
    return {"steps": len(times), "median_ms": med, "mean_ms": mean, "grammar_ms_per_step": grammar_ms}


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
    count_grammar_time()
    core = LLM(model="tiny-trained", max_num_seqs=32, dtype="float32").engine
    rows = []
    for batch in map(int, a.batches.split(",")):
        base = None
        for kind in ("none", "json_schema", "structural_tag"):
            time_case(core, batch, kind, 4, f"warm-{batch}-{kind}")  # compiles the grammar, warms the shapes
            r = time_case(core, batch, kind, a.steps, f"{batch}-{kind}")
            base = r["median_ms"] if kind == "none" else base
            rows.append({"batch": batch, "constraint": kind, **r, "ratio": r["median_ms"] / base})
    print(f"{'batch':>5} {'constraint':<16}{'steps':>6}{'median ms':>11}{'mean ms':>9}{'ratio':>7}{'mask ms':>9}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['constraint']:<16}{r['steps']:>6}{r['median_ms']:>11.2f}{r['mean_ms']:>9.2f}"
            f"{r['ratio']:>7.2f}{r['grammar_ms_per_step']:>9.2f}"
        )
    meta = run_meta(model="tiny-trained float32, max_num_seqs 32", async_scheduling=core.async_scheduling)
    result = {**meta, "rows": rows}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    last = {f"b{r['batch']}_{r['constraint']}_ratio": round(r["ratio"], 3) for r in rows}
    last.update({f"b{r['batch']}_{r['constraint']}_mask_ms": round(r["grammar_ms_per_step"], 3) for r in rows})
    print(json.dumps(last))


if __name__ == "__main__":
    main()
