"""Grammar-constrained output is valid on sampled requests: ``tool_choice="required"``, a named function and
``response_format`` json_schema, each streamed and not, at temperature 0.8, against a live
``dsserve serve tiny-trained`` (the ``grammar`` extra, xgrammar, installed).

A request is valid when its finish_reason is ``tool_calls`` (tool modes) or ``stop`` (json_schema) and every call
names an allowed tool (the named one for a named choice) with arguments that parse to JSON valid against that
tool's ``parameters`` schema, or the content parses to JSON valid against the response schema (``jsonschema``).
Anything else (a cut output included) is counted as a failure and kept as an example.

    python benchmarks/tool_choice_validity.py --requests 50 --out benchmarks/results/tool-choice-validity-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from dsserve.train.tasks import STOCK_TOOL

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tool_calls_live import chat_reply  # noqa: E402

STOCK = STOCK_TOOL  # the tool the built-in model was trained to call
MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move crates between warehouses",
        "parameters": {
            "type": "object",
            "properties": {
                "count": {"type": "integer", "minimum": 0, "maximum": 1000},
                "unit": {"type": "string", "enum": ["box", "crate"]},
                "to": {"type": "string"},
            },
            "required": ["count", "unit"],
        },
    },
}
TOOLS = [STOCK, MOVE]
SCHEMA = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 24},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "sure": {"type": "boolean"},
    },
    "required": ["item", "count", "sure"],
    "additionalProperties": False,
}
MODES = {
    "required": dict(tools=TOOLS, tool_choice="required"),
    "named": dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "move"}}),
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "stock", "schema": SCHEMA}}),
}
ITEMS = ("apples", "marbles", "coins", "books", "shells")
PLACES = ("north", "south", "east", "west", "harbor", "valley")
D = "｜DSML｜"


def check(mode: str, finish: str | None, content: str | None, calls: list[dict]) -> str | None:
    """None if the output is valid for ``mode``, else what is wrong."""
    import jsonschema

    if mode == "json_schema":
        if finish != "stop" or calls:
            return f"finish_reason {finish!r}, {len(calls)} calls"
        try:
            jsonschema.validate(json.loads(content or ""), SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"content: {str(e).splitlines()[0]}"
        return None
    if finish != "tool_calls" or not calls:
        return f"finish_reason {finish!r}, {len(calls)} calls"
    if D in (content or ""):
        return "DSML in content"
    allowed = {"move"} if mode == "named" else {t["function"]["name"] for t in TOOLS}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        if c["name"] not in allowed:
            return f"call to {c['name']!r}, allowed {sorted(allowed)}"
        try:
            jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{c['name']} arguments: {str(e).splitlines()[0]}"
    return None


async def run(base: str, n: int, max_tokens: int, concurrency: int) -> dict:
    """``n`` requests per mode and per streaming flag (3 x 2 x n in all), ``concurrency`` at a time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    counts = {f"{m}/{s}": {"requests": 0, "valid": 0} for m in MODES for s in ("plain", "stream")}
    failures = []

    async def one(mode: str, stream: bool, k: int):
        ask = f"How many {ITEMS[k % 5]} are in the {PLACES[k % 6]} warehouse?"
        kw = dict(model="tiny-trained", messages=[{"role": "user", "content": ask}], temperature=0.8, seed=k)
        kw.update(max_tokens=max_tokens, **MODES[mode])
        async with gate:
            texts, calls, finish = await chat_reply(client, kw, stream)
        content = "".join(texts[0::2])  # the content of the reply or of its deltas (reasoning is off here)
        key = f"{mode}/{'stream' if stream else 'plain'}"
        counts[key]["requests"] += 1
        why = check(mode, finish, content, calls)
        if why is None:
            counts[key]["valid"] += 1
        else:
            failures.append({"case": key, "seed": k, "why": why, "content": content, "calls": calls})

    try:
        jobs = [one(m, s, k) for m in MODES for s in (False, True) for k in range(n)]
        await asyncio.gather(*jobs)
    finally:
        await client.close()
    return {"counts": counts, "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50, help="per mode and streaming flag")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tests"))
    from live_server import SERVER_ARGS, live_server

    from dsserve.bench.provenance import run_meta

    args = [x if x != "float64" else "float32" for x in SERVER_ARGS]
    args[args.index("--max-num-seqs") + 1] = "32"
    t0 = time.time()
    with live_server("tiny-trained", args) as base:
        t1 = time.time()
        res = asyncio.run(run(base, a.requests, a.max_tokens, a.concurrency))
        t2 = time.time()
    total = sum(c["requests"] for c in res["counts"].values())
    valid = sum(c["valid"] for c in res["counts"].values())
    result = {
        **run_meta(server="tiny-trained float32, max-num-seqs 32, CPU (2 cores shared)"),
        "temperature": 0.8,
        "max_tokens": a.max_tokens,
        "server_start_s": round(t1 - t0, 1),
        "requests_s": round(t2 - t1, 1),
        "requests": total,
        "valid": valid,
        **res,
    }
    print(f"{'case':<22}{'valid':>8}{'requests':>10}")
    for k, c in res["counts"].items():
        print(f"{k:<22}{c['valid']:>8}{c['requests']:>10}")
    for f in res["failures"][:10]:
        print("FAIL", json.dumps(f, ensure_ascii=False)[:300])
    print(json.dumps({"requests": total, "valid": valid, "requests_s": result["requests_s"]}))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
