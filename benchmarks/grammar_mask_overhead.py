"""Step-time overhead of grammar masks, and what overlapping them with the forward does: ``EngineCore.step`` with
every row constrained (xgrammar, ``json_schema`` or a DeepSeek tool-call ``structural_tag``) against the same batch
unconstrained, at batch 1 and 32, on the built-in model (``tiny-trained``, float32) with asynchronous scheduling on
(the paged backend's fixed-shape decode steps: eager on the CPU, CUDA graphs on a GPU).

Each case adds ``batch`` requests with one prompt, steps until all have prefilled, then times ``--steps`` decode
steps while every row is still running (the schema's ``minLength`` keeps constrained rows from ending early). Each
constrained case runs twice in the same engine: ``held`` (``EngineCore.grammar_ahead = False``: a constrained step
waits for the host's read of the previous tokens, the engine before the overlap) and ``overlap`` (the step is
launched ahead from the device's tokens; after the read, the grammars accept those tokens, the masks are filled
while the forward runs, and the sampler applies them). Per case: median and mean step ms, the ratio to the
unconstrained batch, the share of timed steps launched ahead, the host's grammar time per step
(``GrammarMask.fill`` + ``JsonGrammar.accept``, all rows) and the model's (``DecodeGraphs.run``, which every decode
step takes: the forward's compute on the CPU, only its launch on a GPU).

On the CPU the "device" is the same cores: a forward launched ahead has finished when the launch returns, so the
overlap cannot hide the grammar's time there; what the CPU shows is that constrained steps now run ahead and that
sampling them after the read costs nothing. On a GPU the fill runs while the device computes the forward, so up to
the grammar's host time per step (and the read's) leaves the step. On the CPU every time is this process's CPU
time with one torch thread (``time.process_time``): the cores are shared, so wall-clock steps there move many-fold
with the load of other processes; on a GPU it is wall-clock.

    python benchmarks/grammar_mask_overhead.py --out benchmarks/results/grammar-mask-overhead-cpu
    python benchmarks/grammar_mask_overhead.py --device cuda --out $OUT/grammar-mask-overhead-gpu   # ~1 min
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
MODES = ("held", "overlap")  # EngineCore.grammar_ahead False / True
PROMPT = "How many apples are in the north warehouse?"


def constraint(kind: str) -> dict:
    if kind == "none":
        return {}
    if kind == "json_schema":
        return {"json_schema": json.dumps(SCHEMA)}
    import xgrammar as xgr

    tag = xgr.get_model_structural_tag("deepseek_v4", tools=[STOCK], tool_choice="required", reasoning="disabled")
    return {"structural_tag": tag.model_dump_json()}


SPENT = {"grammar": 0.0, "model": 0.0}  # seconds in the wrapped calls below, since the last reset
CLOCK = [time.perf_counter]  # the CPU: this process's CPU time (one torch thread), which the shared cores do not move


def count_time() -> None:
    from dsserve.engine.decode_graphs import DecodeGraphs
    from dsserve.engine.structured_output import GrammarMask, JsonGrammar

    def wrap(owner, name, what, static=False):
        inner = getattr(owner, name)

        def timed(*a, **kw):
            t0 = CLOCK[0]()
            try:
                return inner(*a, **kw)
            finally:
                SPENT[what] += CLOCK[0]() - t0

        setattr(owner, name, staticmethod(timed) if static else timed)

    wrap(GrammarMask, "fill", "grammar", static=True)  # a classmethod: bound already, kept bound
    wrap(JsonGrammar, "accept", "grammar")
    wrap(DecodeGraphs, "run", "model")


def time_case(core, batch: int, kind: str, steps: int, tag: str) -> dict:
    from dsserve.engine.sampling_params import SamplingParams

    ids = core.tokenizer.encode(PROMPT, add_bos=True)
    for k in range(batch):
        params = SamplingParams(temperature=0.8, seed=k, max_tokens=steps + 2, ignore_eos=kind == "none")
        if kind != "none":
            params = SamplingParams(temperature=0.8, seed=k, max_tokens=steps + 2, **constraint(kind))
        core.add_request(f"{tag}-{k}", list(ids), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    times, ahead0 = [], core.stats.ahead_steps
    SPENT.update(grammar=0.0, model=0.0)
    while len(times) < steps and len(core.scheduler.running) == batch:
        t0 = CLOCK[0]()
        core.step()
        times.append(CLOCK[0]() - t0)
    n = max(len(times), 1)
    grammar_ms, model_ms, ahead = 1e3 * SPENT["grammar"] / n, 1e3 * SPENT["model"] / n, core.stats.ahead_steps - ahead0
    while core.has_unfinished_requests():
        core.step()
    med, mean = 1e3 * statistics.median(times), 1e3 * statistics.mean(times)
    return {
        "steps": len(times),
        "median_ms": med,
        "mean_ms": mean,
        "ahead_share": ahead / n,
        "grammar_ms_per_step": grammar_ms,
        "model_ms_per_step": model_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from dsserve.bench.provenance import run_meta
    from dsserve.engine.llm import LLM

    torch.manual_seed(0)
    if a.device == "cpu":
        torch.set_num_threads(1)
        CLOCK[0] = time.process_time
    count_time()
    core = LLM(
        model="tiny-trained",
        max_num_seqs=32,
        dtype="float32",
        device=a.device,
        attention_backend="paged",
        async_scheduling=True,
        reference_ops="all" if a.device == "cpu" else "",  # the CPU has no Triton: the paged path's torch ops
    ).engine
    assert core.async_scheduling, "the overlap is measured with async scheduling on"
    rows = []
    for batch in map(int, a.batches.split(",")):
        base = None
        for kind, mode in (("none", "-"), *((k, m) for k in ("json_schema", "structural_tag") for m in MODES)):
            core.grammar_ahead = mode == "overlap"
            if mode != "overlap":  # compiles the grammar, warms the shapes
                time_case(core, batch, kind, 3, f"warm-{batch}-{kind}")
            r = time_case(core, batch, kind, a.steps, f"{batch}-{kind}-{mode}")
            base = r["median_ms"] if kind == "none" else base
            rows.append({"batch": batch, "constraint": kind, "mode": mode, **r, "ratio": r["median_ms"] / base})
    print(
        f"{'batch':>5} {'constraint':<15}{'mode':<8}{'steps':>6}{'median ms':>10}{'mean ms':>9}{'ratio':>7}"
        f"{'ahead':>7}{'grammar ms':>11}{'model ms':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['constraint']:<15}{r['mode']:<8}{r['steps']:>6}{r['median_ms']:>10.2f}"
            f"{r['mean_ms']:>9.2f}{r['ratio']:>7.2f}{r['ahead_share']:>7.2f}{r['grammar_ms_per_step']:>11.2f}"
            f"{r['model_ms_per_step']:>9.2f}"
        )
    clock = "process CPU time, 1 torch thread" if a.device == "cpu" else "wall"
    meta = run_meta(
        model="tiny-trained float32, max_num_seqs 32, paged", async_scheduling=core.async_scheduling, clock=clock
    )
    result = {**meta, "rows": rows}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    key = "b{batch}_{constraint}_{mode}".format
    last = {key(**r) + "_ratio": round(r["ratio"], 3) for r in rows}
    last.update({key(**r) + "_grammar_ms": round(r["grammar_ms_per_step"], 3) for r in rows})
    print(json.dumps(last))


if __name__ == "__main__":
    main()
