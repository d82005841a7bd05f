"""``dsserve eval``: accuracy on held-out synthetic problems (``train.tasks``, the eval split), with its standard
error, through the engine or a live server (issue 10).

Modes: bounded replay off / on (the engine only: a server runs as it was started), and cold / after a prefix hit
(the problem's ``context``, its earlier turns, is sent first and cached, then the whole prompt arrives). Greedy
decoding; a problem counts as solved when the completion's first ``Answer: X`` line gives its answer. Prints a
table, then one JSON line; ``--out`` writes eval.json, rewritten after every batch (``"complete": false`` until the
end), so a run stopped early keeps what it scored. A long evaluation can run as several processes (one per mode and
task: ``--replay``, ``--cache``, ``--tasks``), whose eval.json files ``--merge`` joins into one.
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
from .provenance import run_meta

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
        outs = llm.generate(
            [ids for ids, _ in requests],
            [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for _, k in requests],
            use_tqdm=False,
        )
        return [o.outputs[0].text for o in outs]

    return complete


def score(correct: int, n: int, skipped: int = 0, first: int = 0) -> dict:
    """Held-out problems ``first`` to ``end`` (``n`` scored, ``skipped`` not), so that split runs can be joined."""
    return {
        "n": n,
        "correct": correct,
        "accuracy": correct / n if n else float("nan"),
        "se": standard_error(correct, n),
        "skipped": skipped,
        "first": first,
        "end": first + n + skipped,
    }


def run_mode(
    complete,
    tokenizer,
    tasks: list[str],
    n: int,
    hit: bool,
    min_back: int,
    batch: int = 64,
    out: dict | None = None,
    on_batch=None,
    first: int = 0,
) -> dict:
    """Per task: {"n", "correct", "accuracy", "se", "skipped", "first", "end"} over held-out problems ``first`` to
    ``first + n``; ``complete([(ids, max_tokens), ...]) -> texts``, called with ``batch`` problems at a time (after a
    hit: their contexts first, all cached, then their prompts). ``out`` is filled as batches finish (the scores so
    far), and ``on_batch()`` called after each."""
    count = lambda s: len(tokenizer.encode(s, add_bos=False))
    out = {} if out is None else out
    for task in tasks:
        correct, scored, skipped = 0, 0, 0
        for at in range(0, n, batch):  # drawn a batch at a time: the first scores are saved without waiting for all
            ids = range(first + at, first + min(n, at + batch))
            chunk = [(i, problem(task, "eval", i, count, min_back)) for i in ids]
            if hit:  # nothing earlier to cache: not a hit problem
                skipped += sum(not p.context for _, p in chunk)
                chunk = [(i, p) for i, p in chunk if p.context]
            if chunk:
                if hit:
                    complete([(prompt_ids(tokenizer, p.context), 1) for _, p in chunk])
                texts = complete([(prompt_ids(tokenizer, p.prompt), MAX_TOKENS[task]) for _, p in chunk])
                correct += sum(final_answer(t) == p.answer for t, (_, p) in zip(texts, chunk))
                scored += len(chunk)
            out[task] = score(correct, scored, skipped, first)
            if on_batch is not None:
                on_batch()
    return out


def run_eval(ns) -> int:
    from ..engine.args import EngineArgs
    from ..models.loader import resolve_config
    from ..models.tokenizer import Tokenizer

    if ns.n < 1 or ns.batch < 1 or ns.first < 0:
        raise SystemExit(
            f"dsserve eval: -n and --batch must be >= 1 and --first >= 0, got {ns.n}, {ns.batch} and {ns.first}"
        )
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
    if ns.merge:
        return _report(merge([_load(path) for path in ns.merge]), tasks_of(ns.merge), ns.out)
    args = EngineArgs.from_cli(ns)
    cfg = resolve_config(args.model)
    tokenizer = Tokenizer.load(args.model)
    min_back = ns.min_back or retrieval_distance(cfg)  # past any window-only path's reach
    results, t0 = [], time.perf_counter()
    summary = {
        "meta": run_meta(),
        "model": args.model,
        "n": ns.n,
        "first": ns.first,
        "min_back": min_back,
        "results": results,
        "complete": False,
    }

    def save():
        summary.update(replay_difference_se=_differences(results, tasks), seconds=time.perf_counter() - t0)
        if ns.out:
            _write(ns.out, summary)

    if ns.url:
        for cache in caches:
            results.append({"replay": "server", "cache": cache, "tasks": {}})
            run_mode(
                server_completer(ns.url, ns.batch),
                tokenizer,
                tasks,
                ns.n,
                cache == "hit",
                min_back,
                ns.batch,
                results[-1]["tasks"],
                save,
                ns.first,
            )
    else:
        from ..engine.llm import LLM

        for replay in replays:
            for cache in caches:
                llm = LLM(
                    **asdict(replace(args, swa_bounded_replay=replay == "on", enable_prefix_caching=cache == "hit"))
                )
                results.append({"replay": replay, "cache": cache, "tasks": {}})
                res = run_mode(
                    engine_completer(llm),
                    tokenizer,
                    tasks,
                    ns.n,
                    cache == "hit",
                    min_back,
                    ns.batch,
                    results[-1]["tasks"],
                    save,
                    ns.first,
                )
                if cache == "hit":
                    res["prefix_hit_tokens"] = llm.engine.stats.as_dict()["prefix_hit_tokens"]
    summary["complete"] = True
    save()
    return _report(summary, tasks, None)


def _write(out_dir: str, summary: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "eval.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "eval.json"))  # a reader never sees half a file


def _report(summary: dict, tasks: list[str], out_dir: str | None) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"dsserve eval: {summary['model']}, {summary['n']} held-out problems a task")
    for col in ("replay", "cache", "task", "accuracy", "se", "n"):
        table.add_column(col)
    for r in summary["results"]:
        for task in tasks:
            if task in r["tasks"]:
                t = r["tasks"][task]
                table.add_row(r["replay"], r["cache"], task, f"{t['accuracy']:.3f}", f"{t['se']:.3f}", str(t["n"]))
    Console().print(table)
    if out_dir:
        _write(out_dir, summary)
    print(json.dumps(summary))
    return 0


def _load(path: str) -> dict:
    path = os.path.join(path, "eval.json") if os.path.isdir(path) else path
    with open(path) as f:
        return json.load(f)


def tasks_of(paths: list[str]) -> list[str]:
    found = {t for path in paths for r in _load(path)["results"] for t in r["tasks"] if t in TASKS}
    return [t for t in TASKS if t in found]


def _join(a: dict, b: dict, where: str) -> dict:
    """One task's scores over two runs' disjoint ranges of held-out problems."""
    (lo, hi) = sorted([a, b], key=lambda t: t.get("first", 0))
    if hi.get("first", 0) < lo.get("end", lo["n"] + lo["skipped"]):
        raise SystemExit(
            f"dsserve eval --merge: {where}: two runs scored the same held-out problems "
            f"({lo.get('first', 0)}-{lo.get('end')} and {hi.get('first', 0)}-{hi.get('end')})"
        )
    out = score(a["correct"] + b["correct"], a["n"] + b["n"], a["skipped"] + b["skipped"], lo.get("first", 0))
    out["end"] = hi.get("end", out["end"])
    return out


def merge(summaries: list[dict]) -> dict:
    """One summary from the eval.json files of runs split by mode, task or range of problems (``--first``): their
    results joined per (replay, cache) and task, the differences recomputed. The runs must agree on model and
    distance, and no problem may be scored twice."""
    if not summaries:
        raise SystemExit("dsserve eval --merge: give the eval.json files (or their directories) to join")
    keys = {(s["model"], s["min_back"]) for s in summaries}
    if len(keys) > 1:
        raise SystemExit(f"dsserve eval --merge: the runs differ in (model, min_back): {sorted(keys)}")
    modes: dict = {}
    for s in summaries:
        for r in s["results"]:
            into = modes.setdefault((r["replay"], r["cache"]), {})
            for task, t in r["tasks"].items():
                if task == "prefix_hit_tokens":  # each run's own engine: the hits add up
                    into[task] = into.get(task, 0) + t
                elif task in into:
                    into[task] = _join(into[task], t, f"{task} in replay {r['replay']}, cache {r['cache']}")
                else:
                    into[task] = t
    results = [{"replay": rp, "cache": c, "tasks": t} for (rp, c), t in sorted(modes.items())]
    tasks = [t for t in TASKS if any(t in r["tasks"] for r in results)]
    return {
        "model": summaries[0]["model"],
        "n": max(t["n"] for r in results for k, t in r["tasks"].items() if k in TASKS),
        "min_back": summaries[0]["min_back"],
        "results": results,
        "complete": all(s.get("complete", True) for s in summaries),
        "replay_difference_se": _differences(results, tasks),
        "seconds": max(s["seconds"] for s in summaries),
        "merged": len(summaries),
    }


def _differences(results: list[dict], tasks: list[str]) -> dict:
    """Per cache mode and task: (accuracy replay on - off) in standard errors of the difference."""
    out = {}
    for cache in ("cold", "hit"):
        by = {r["replay"]: r["tasks"] for r in results if r["cache"] == cache}
        if "on" in by and "off" in by:
            for task in tasks:
                if task not in by["on"] or task not in by["off"]:
                    continue
                a, b = by["on"][task], by["off"][task]
                se = math.sqrt(a["se"] ** 2 + b["se"] ** 2)
                out[f"{cache}/{task}"] = (a["accuracy"] - b["accuracy"]) / se if se > 0 else 0.0
    return out


def add_eval_args(p: argparse.ArgumentParser) -> None:
    from ..engine.args import EngineArgs

    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {list(TASKS)}")
    p.add_argument("-n", type=int, default=100, help="held-out problems per task (default 100)")
    p.add_argument(
        "--first",
        type=int,
        default=0,
        help="the first held-out problem's index (runs over disjoint ranges can be --merge'd)",
    )
    p.add_argument("--replay", default="off,on", help="bounded replay modes, comma list of off/on (engine only)")
    p.add_argument("--cache", default="cold,hit", help="cold and/or hit: the question after its earlier turns cached")
    p.add_argument(
        "--min-back",
        type=int,
        default=0,
        help="retrieval: tokens between the asked fact and the question (default (layers + 1) x window)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=64,
        help="problems in flight together (engine: one generate call; server: concurrent requests)",
    )
    p.add_argument("--url", default=None, help="evaluate a live server at this base URL instead of an engine")
    p.add_argument("--out", default=None, help="write eval.json here (rewritten after every batch)")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="EVAL_JSON",
        help="join the eval.json files (or directories) of runs split by mode and task; runs nothing",
    )
    EngineArgs.add_cli_args(p)
