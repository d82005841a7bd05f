"""``dsserve eval``: accuracy on held-out synthetic problems (``train.tasks``, the eval split), with its standard
error, through the engine or a live server (issue 10).

Modes: bounded replay off / on (the engine only: a server runs as it was started), and cold / after a prefix hit
(the problem's ``context``, its earlier turns, is sent first and cached, then the whole prompt arrives). Greedy
decoding; a problem counts as solved when the completion's first ``Answer: X`` line gives its answer. Prints a
table, then one JSON line; ``--out`` writes eval.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import urllib.request
from dataclasses import asdict, replace

from ..train.tasks import TASKS, final_answer, problem, prompt_ids, retrieval_distance

MAX_TOKENS = {"arithmetic": 64, "retrieval": 8, "chat": 24}


def standard_error(correct: int, n: int) -> float:
    p = correct / n if n else 0.0
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def _server_complete(url: str, ids: list[int], max_tokens: int) -> str:
    body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]["text"]


def server_completer(url: str, concurrency: int):
    """``complete(requests)`` sending a batch's requests to the server ``concurrency`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def complete(requests: list[tuple[list[int], int]]) -> list[str]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda r: _server_complete(url, *r), requests))
    return complete


def engine_completer(llm):
    """``complete(requests)`` running a batch's requests through the engine together (continuous batching)."""
    from ..engine.sampling_params import SamplingParams

    def complete(requests: list[tuple[list[int], int]]) -> list[str]:
        outs = llm.generate([ids for ids, _ in requests],
                            [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for _, k in requests],
                            use_tqdm=False)
        return [o.outputs[0].text for o in outs]
    return complete


def run_mode(complete, tokenizer, tasks: list[str], n: int, hit: bool, min_back: int, batch: int = 64) -> dict:
    """Per task: {"n", "correct", "accuracy", "se", "skipped"}; ``complete([(ids, max_tokens), ...]) -> texts``,
    called with ``batch`` problems at a time (after a hit: their contexts first, all cached, then their prompts)."""
    count = (lambda s: len(tokenizer.encode(s, add_bos=False)))
    out = {}
    for task in tasks:
        problems = [problem(task, "eval", i, count, min_back) for i in range(n)]
        skipped = 0
        if hit:  # nothing earlier to cache: not a hit problem
            skipped = sum(not p.context for p in problems)
            problems = [p for p in problems if p.context]
        correct = 0
        for at in range(0, len(problems), batch):
            chunk = problems[at:at + batch]
            if hit:
                complete([(prompt_ids(tokenizer, p.context), 1) for p in chunk])
            texts = complete([(prompt_ids(tokenizer, p.prompt), MAX_TOKENS[task]) for p in chunk])
            correct += sum(final_answer(t) == p.answer for t, p in zip(texts, chunk))
        m = len(problems)
        out[task] = {"n": m, "correct": correct, "accuracy": correct / m if m else float("nan"),
                     "se": standard_error(correct, m), "skipped": skipped}
    return out


def run_eval(ns) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..engine.args import EngineArgs
    from ..models.loader import resolve_config
    from ..models.tokenizer import Tokenizer

    if ns.n < 1 or ns.batch < 1:
        raise SystemExit(f"dsserve eval: -n and --batch must be >= 1, got {ns.n} and {ns.batch}")
    tasks = [t for t in ns.tasks.split(",") if t]
    bad = sorted(set(tasks) - set(TASKS))
    if bad or not tasks:
        raise SystemExit(f"dsserve eval: unknown task(s) {bad}; tasks are {list(TASKS)}")
    caches = [c for c in ns.cache.split(",") if c]
    if sorted(set(caches) - {"cold", "hit"}):
        raise SystemExit(f"dsserve eval: --cache takes cold and/or hit, got {ns.cache!r}")
    replays = [r for r in ns.replay.split(",") if r]
    if not replays or sorted(set(replays) - {"off", "on"}):  # checked before any mode runs
        raise SystemExit(f"dsserve eval: --replay takes off and/or on, got {ns.replay!r}")
    args = EngineArgs.from_cli(ns)
    cfg = resolve_config(args.model)
    tokenizer = Tokenizer.load(args.model)
    min_back = ns.min_back or retrieval_distance(cfg)  # past any window-only path's reach
    results, t0 = [], time.perf_counter()
    if ns.url:
        for cache in caches:
            res = run_mode(server_completer(ns.url, ns.batch), tokenizer, tasks, ns.n, cache == "hit", min_back,
                           ns.batch)
            results.append({"replay": "server", "cache": cache, "tasks": res})
    else:
        from ..engine.llm import LLM
        for replay in replays:
            for cache in caches:
                llm = LLM(**asdict(replace(args, swa_bounded_replay=replay == "on", enable_prefix_caching=cache == "hit")))
                res = run_mode(engine_completer(llm), tokenizer, tasks, ns.n, cache == "hit", min_back, ns.batch)
                if cache == "hit":
                    res["prefix_hit_tokens"] = llm.engine.stats.as_dict()["prefix_hit_tokens"]
                results.append({"replay": replay, "cache": cache, "tasks": res})
    summary = {"model": args.model, "n": ns.n, "min_back": min_back, "results": results,
               "replay_difference_se": _differences(results, tasks), "seconds": time.perf_counter() - t0}
    table = Table(title=f"dsserve eval: {args.model}, {ns.n} held-out problems a task")
    for col in ("replay", "cache", "task", "accuracy", "se", "n"):
        table.add_column(col)
    for r in results:
        for task in tasks:
            t = r["tasks"][task]
            table.add_row(r["replay"], r["cache"], task, f"{t['accuracy']:.3f}", f"{t['se']:.3f}", str(t["n"]))
    Console().print(table)
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        with open(os.path.join(ns.out, "eval.json"), "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


def _differences(results: list[dict], tasks: list[str]) -> dict:
    """Per cache mode and task: (accuracy replay on - off) in standard errors of the difference."""
    out = {}
    for cache in ("cold", "hit"):
        by = {r["replay"]: r["tasks"] for r in results if r["cache"] == cache}
        if "on" in by and "off" in by:
            for task in tasks:
                a, b = by["on"][task], by["off"][task]
                se = math.sqrt(a["se"] ** 2 + b["se"] ** 2)
                out[f"{cache}/{task}"] = (a["accuracy"] - b["accuracy"]) / se if se > 0 else 0.0
    return out


def add_eval_args(p: argparse.ArgumentParser) -> None:
    from ..engine.args import EngineArgs
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {list(TASKS)}")
    p.add_argument("-n", type=int, default=100, help="held-out problems per task (default 100)")
    p.add_argument("--replay", default="off,on", help="bounded replay modes, comma list of off/on (engine only)")
    p.add_argument("--cache", default="cold,hit", help="cold and/or hit: the question after its earlier turns cached")
    p.add_argument("--min-back", type=int, default=0,
                   help="retrieval: tokens between the asked fact and the question (default (layers + 1) x window)")
    p.add_argument("--batch", type=int, default=64,
                   help="problems in flight together (engine: one generate call; server: concurrent requests)")
    p.add_argument("--url", default=None, help="evaluate a live server at this base URL instead of an engine")
    p.add_argument("--out", default=None, help="write eval.json here")
    EngineArgs.add_cli_args(p)
