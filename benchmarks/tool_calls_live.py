"""Sampled tool-calling requests against a live ``dsserve serve tiny-trained`` (the issue's 200 at temperature 0.8):
counts finish reasons, parsed calls, DSML leaks into content or any streamed delta, and invalid argument JSON.
``--api messages`` sends them through the Anthropic route (``POST /v1/messages``, the ``anthropic`` client) instead:
stop reasons, DSML in any text block or streamed delta, tool_use inputs that are not JSON objects or name no allowed
tool (the Messages API takes no seed: its samples are not reproducible one by one).

    python benchmarks/tool_calls_live.py --requests 200 --out benchmarks/results/tool-calls-live-cpu
    python benchmarks/tool_calls_live.py --api messages --requests 200 \
        --out benchmarks/results/tool-calls-live-messages-cpu
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time

from dsserve.train.tasks import STOCK_TOOL

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from live_server import SERVER_ARGS, live_server  # noqa: E402

D = "｜DSML｜"
STOCK = STOCK_TOOL  # the tool the built-in model was trained to call
ITEMS = ("apples", "marbles", "coins", "books", "shells")
PLACES = ("north", "south", "east", "west", "harbor", "valley")


async def chat_reply(client, kw: dict, stream: bool) -> tuple[list[str], list[dict], str | None]:
    """One chat completion through the openai client: (its texts: content and reasoning, or each streamed delta's;
    its calls as {"name", "arguments"}, streamed deltas joined by index; its finish_reason)."""
    if not stream:
        r = await client.chat.completions.create(**kw)
        finish, msg = r.choices[0].finish_reason, r.choices[0].message
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
        return [msg.content or "", getattr(msg, "reasoning_content", None) or ""], calls, finish
    texts, calls, finish = [], {}, None
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d, finish = ch.delta, ch.finish_reason or finish
            texts += [d.content or "", getattr(d, "reasoning_content", None) or ""]
            for t in d.tool_calls or []:
                c = calls.setdefault(t.index, {"name": "", "arguments": ""})
                c["name"] += (t.function.name or "") if t.function else ""
                c["arguments"] += (t.function.arguments or "") if t.function else ""
    return texts, [calls[i] for i in sorted(calls)], finish


async def run(base: str, n: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    stats = {
        k: 0
        for k in (
            "requests",
            "streamed",
            "tool_calls",
            "stop",
            "length",
            "calls",
            "dsml_leaks",
            "bad_json",
            "wrong_name",
        )
    }

    async def one(k: int):
        ask = f"How many {ITEMS[k % 5]} are in the {PLACES[k % 6]} warehouse?"
        kw = dict(
            model="tiny-trained",
            messages=[{"role": "user", "content": ask}],
            tools=[STOCK],
            temperature=0.8,
            max_tokens=max_tokens,
            seed=k,
        )
        stream = k % 2 == 1
        texts, calls, finish = await chat_reply(client, kw, stream)
        stats["requests"] += 1
        stats["streamed"] += stream
        stats[finish] += 1
        stats["calls"] += len(calls)
        leak = any(D in t for t in texts) or any(D in c["arguments"] for c in calls)
        stats["dsml_leaks"] += leak
        if leak:
            examples.append({"finish": finish, "text": "".join(texts), "calls": calls})
        stats["wrong_name"] += sum(c["name"] != "stock" for c in calls)
        if finish == "tool_calls":
            for c in calls:
                try:
                    json.loads(c["arguments"])
                except ValueError:
                    stats["bad_json"] += 1

    examples = []
    try:
        await asyncio.gather(*(one(k) for k in range(n)))
    finally:
        await client.close()
    return dict(stats, leak_examples=examples[:10])


async def run_messages(base: str, n: int, max_tokens: int) -> dict:
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0, timeout=600)
    tool = {"name": STOCK["function"]["name"], "description": STOCK["function"]["description"]}
    tool["input_schema"] = STOCK["function"]["parameters"]
    keys = ("requests", "streamed", "tool_use", "end_turn", "max_tokens", "stop_sequence", "tool_use_blocks")
    stats = {k: 0 for k in (*keys, "dsml_leaks", "bad_json", "non_object_input", "wrong_name")}
    examples = []

    async def one(k: int):
        ask = f"How many {ITEMS[k % 5]} are in the {PLACES[k % 6]} warehouse?"
        kw = dict(
            model="tiny-trained", max_tokens=max_tokens, tools=[tool], messages=[{"role": "user", "content": ask}]
        )
        kw["extra_body"] = {"temperature": 0.8}  # the SDK takes no sampling fields as arguments
        stream = k % 2 == 1
        texts, partial = [], {}  # streamed: every text / thinking delta, and each tool_use block's input JSON
        if stream:
            async with client.messages.stream(**kw) as s:
                async for ev in s:
                    if ev.type != "content_block_delta":
                        continue
                    d = ev.delta
                    if d.type == "input_json_delta":
                        partial[ev.index] = partial.get(ev.index, "") + d.partial_json
                    else:
                        texts.append(getattr(d, "text", None) or getattr(d, "thinking", None) or "")
                r = await s.get_final_message()
        else:
            r = await client.messages.create(**kw)
        uses = [b for b in r.content if b.type == "tool_use"]
        texts += [b.text for b in r.content if b.type == "text"]
        stats["requests"] += 1
        stats["streamed"] += stream
        stats[r.stop_reason] += 1
        stats["tool_use_blocks"] += len(uses)
        leak = any(D in t for t in texts) or any(D in j for j in partial.values())
        leak = leak or any(D in json.dumps(b.input, ensure_ascii=False) for b in uses)
        stats["dsml_leaks"] += leak
        if leak:
            examples.append({"stop_reason": r.stop_reason, "text": "".join(texts), "partial": partial})
        stats["wrong_name"] += sum(b.name != "stock" for b in uses)
        stats["non_object_input"] += sum(not isinstance(b.input, dict) for b in uses)
        if r.stop_reason == "tool_use":
            for j in partial.values():
                try:
                    stats["bad_json"] += not isinstance(json.loads(j), dict)
                except ValueError:
                    stats["bad_json"] += 1

    try:
        await asyncio.gather(*(one(k) for k in range(n)))
    finally:
        await client.close()
    return dict(stats, leak_examples=examples[:10])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--api", choices=("chat", "messages"), default="chat", help="/v1/chat/completions or /v1/messages")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    args = [x if x != "float64" else "float32" for x in SERVER_ARGS]
    args[args.index("--max-num-seqs") + 1] = "32"
    t0 = time.time()
    with live_server("tiny-trained", args) as base:
        t1 = time.time()
        stats = asyncio.run((run_messages if a.api == "messages" else run)(base, a.requests, a.max_tokens))
        t2 = time.time()
    result = {
        "command": f"python benchmarks/tool_calls_live.py --api {a.api} --requests {a.requests} --max-tokens "
        f"{a.max_tokens}",
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.machine()}), shared 2 cores, server float32 max-num-seqs 32",
        "server_start_s": round(t1 - t0, 1),
        "requests_s": round(t2 - t1, 1),
        **stats,
    }
    print(json.dumps(result, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
