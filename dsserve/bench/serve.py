"""``dsserve bench serve``: vLLM's ``vllm bench serve`` against any OpenAI-compatible server.

Requests are sent streaming (``stream_options.include_usage``) at Poisson arrivals of ``--request-rate`` per second
(inf: all at once; ``--burstiness`` shapes the gaps as vLLM's gamma), at most ``--max-concurrency`` in flight.
Per request: TTFT (first content chunk), ITL (gaps between later content chunks), E2EL, and TPOT = (E2EL - TTFT) /
(output tokens - 1); token counts come from the server's usage. Prints a table, then one JSON line whose keys are
vLLM's (``duration``, ``completed``, ``total_input_tokens``, ``request_throughput``, ``mean_ttft_ms``,
``p99_itl_ms``, ...). Datasets: ``random`` (token-id prompts for completions, their text for chat) and ``sharegpt``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
from rich.console import Console
from rich.table import Table

from .eplb_figures import eplb_figures, eplb_lines

METRICS = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)"}
NAMES.update(itl="Inter-token Latency", e2el="End-to-end Latency")
BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""


# ------------------------------------------------------------------ datasets
def load_tokenizer(name: str | None, model: str | None):
    """The tokenizer that sizes prompts: ``--tokenizer``, else the model's when it names a local model, else the
    built-in tiny one (8,192 ids, every one valid in every model of this family)."""
    from ..models.hub import TOKENIZER_FILES, resolve_model
    from ..models.tokenizer import Tokenizer

    for candidate in (name, model):
        if candidate:
            try:
                return Tokenizer.load(resolve_model(candidate, TOKENIZER_FILES))
            except (ValueError, OSError, ImportError):
                if candidate == name:
                    raise
    return Tokenizer.load("tiny")


def random_requests(ns, tokenizer, chat: bool) -> list[BenchRequest]:
    """vLLM's random dataset: lengths uniform in [L(1-r), L(1+r)], ids uniform over the non-special vocabulary
    (a shared random prefix of ``--random-prefix-len`` first)."""
    rng = np.random.default_rng(ns.seed)
    r = ns.random_range_ratio
    if not 0 <= r < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {r}")

    def lengths(n: int):
        return rng.integers(max(1, int(n * (1 - r))), max(1, int(n * (1 + r))) + 1, ns.num_prompts)

    ins, outs = lengths(ns.random_input_len), lengths(ns.random_output_len)
    first = 1 + max(i for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, 0) if i is not None)
    vocab = tokenizer.vocab_size
    prefix = rng.integers(first, vocab, ns.random_prefix_len).tolist()
    out = []
    for n_in, n_out in zip(ins, outs):
        ids = prefix + rng.integers(first, vocab, int(n_in)).tolist()
        prompt = tokenizer.decode(ids, skip_special_tokens=True) if chat else ids
        out.append(BenchRequest(prompt, len(ids), int(n_out)))
    return out


def sharegpt_requests(ns, tokenizer) -> list[BenchRequest]:
    """The first human turn of each ShareGPT conversation; its output length is the reply's token count (or
    ``--sharegpt-output-len``), as vLLM's. Conversations with fewer than two turns are skipped."""
    if not ns.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    with open(ns.dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    rng = np.random.default_rng(ns.seed)
    out = []
    for k in rng.permutation(len(data)):
        conv = data[int(k)].get("conversations") or []
        if len(conv) < 2:
            continue
        prompt, reply = conv[0]["value"], conv[1]["value"]
        n_in = len(tokenizer.encode(prompt, add_bos=False))
        n_out = ns.sharegpt_output_len or len(tokenizer.encode(reply, add_bos=False))
        if n_in < 4 or n_out < 4:  # vLLM drops these too
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
        if len(out) == ns.num_prompts:
            break
    if len(out) < ns.num_prompts:
        raise ValueError(f"{ns.dataset_path}: only {len(out)} usable conversations for --num-prompts {ns.num_prompts}")
    return out


# ------------------------------------------------------------------ one request
async def send(client, url: str, chat: bool, model: str, req: BenchRequest, ns) -> RequestResult:
    body = {"model": model, "max_tokens": req.output_len, "stream": True, "stream_options": {"include_usage": True}}
    body["temperature"] = ns.temperature
    if ns.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    res = RequestResult(prompt_len=req.prompt_len)
    chunks, text = 0, []
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    res.error = str(msg["error"])
                    return res
                if msg.get("usage"):
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                    res.prompt_len = msg["usage"].get("prompt_tokens", req.prompt_len)
                for ch in msg.get("choices") or []:
                    delta = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if not delta:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(delta)
        res.latency = time.perf_counter() - t0
        res.text = "".join(text)
        res.output_tokens = res.output_tokens or chunks  # a server without usage: one token a chunk
        res.success = chunks > 0 or res.output_tokens > 0
        if not res.success:
            res.error = "no content in the stream"
    except Exception as e:  # a failed request is counted, never fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_all(ns, url: str, chat: bool, model: str, reqs: list[BenchRequest], headers: dict):
    import httpx

    rng = np.random.default_rng(ns.seed)
    limit = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    limits = httpx.Limits(max_connections=ns.max_concurrency or len(reqs) or 1)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:

        async def one(req):
            if limit is None:
                return await send(client, url, chat, model, req, ns)
            async with limit:
                return await send(client, url, chat, model, req, ns)

        tasks = []
        t0 = time.perf_counter()
        for k, req in enumerate(reqs):
            if k and np.isfinite(ns.request_rate):  # gamma gaps: Poisson at burstiness 1, as vLLM's
                theta = 1.0 / (ns.request_rate * ns.burstiness)
                await asyncio.sleep(float(rng.gamma(ns.burstiness, theta)))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


# ------------------------------------------------------------------ metrics
def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
    }
    for m in METRICS:
        ms = np.asarray(series[m] or [0.0]) * 1000
        out[f"mean_{m}_ms"] = float(ms.mean())
        out[f"median_{m}_ms"] = float(np.median(ms))
        out[f"std_{m}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"p{p:g}_{m}_ms"] = float(np.percentile(ms, p))
    return out


def _print_table(res: dict, percentiles: list[float], shown: list[str]) -> None:
    t = Table(title="Serving Benchmark Result")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("Successful requests", res["completed"]),
        ("Failed requests", res["failed"]),
        ("Maximum request concurrency", res["max_concurrency"]),
        ("Benchmark duration (s)", res["duration"]),
        ("Total input tokens", res["total_input_tokens"]),
        ("Total generated tokens", res["total_output_tokens"]),
        ("Request throughput (req/s)", res["request_throughput"]),
        ("Output token throughput (tok/s)", res["output_throughput"]),
        ("Total token throughput (tok/s)", res["total_token_throughput"]),
    ]
    for m in shown:
        rows.append((f"[bold]{NAMES[m]}[/bold]", ""))
        rows += [(f"Mean {m.upper()} (ms)", res[f"mean_{m}_ms"]), (f"Median {m.upper()} (ms)", res[f"median_{m}_ms"])]
        rows += [(f"P{p:g} {m.upper()} (ms)", res[f"p{p:g}_{m}_ms"]) for p in percentiles]
    for k, v in rows:
        t.add_row(k, f"{v:,.2f}" if isinstance(v, float) else str(v))
    Console(width=100, stderr=False).print(t)


def _metrics_text(base: str, headers: dict) -> str:
    """The server's /metrics text; empty when it has none."""
    import httpx

    try:
        r = httpx.get(base + "/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return ""
    return r.text if r.status_code == 200 else ""


def run_bench_serve(ns) -> int:
    base = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    chat = ns.backend == "openai-chat"
    url = base + (ns.endpoint or BACKENDS[ns.backend])
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}
    model = ns.model
    if model is None:
        import httpx

        try:
            model = httpx.get(base + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        except Exception as e:
            raise ValueError(f"--model not given and {base}/v1/models did not name one: {e}") from None
    tokenizer = load_tokenizer(ns.tokenizer, model)
    if ns.dataset_name == "random":
        reqs = random_requests(ns, tokenizer, chat)
    else:
        reqs = sharegpt_requests(ns, tokenizer)
    percentiles = [float(p) for p in ns.metric_percentiles.split(",")]
    shown = [m.strip() for m in ns.percentile_metrics.split(",")]
    if bad := [m for m in shown if m not in METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {list(METRICS)}")
    print(
        f"bench serve: {len(reqs)} prompts to {url} (model {model}), request rate {ns.request_rate}, "
        f"max concurrency {ns.max_concurrency}",
        file=sys.stderr,
    )
    metrics_before = _metrics_text(base, headers)
    results, duration = asyncio.run(run_all(ns, url, chat, model, reqs, headers))
    eplb = eplb_figures(metrics_before, _metrics_text(base, headers))
    res = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": ns.backend,
        "model_id": model,
        "num_prompts": len(reqs),
        "request_rate": "inf" if not np.isfinite(ns.request_rate) else ns.request_rate,
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
    }
    res.update(summarize(results, duration, percentiles))
    if eplb is not None:  # a server with --enable-eplb: its balance figures over the run
        res["eplb"] = eplb
    res.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_tokens for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        errors=[r.error for r in results],
    )
    _print_table(res, percentiles, shown)
    for line in eplb_lines(eplb) if eplb else ():
        print(line)
    errors = [e for e in res["errors"] if e]
    if errors:
        print(f"{len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    if ns.save_result:
        concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
        name = ns.result_filename or (
            f"{ns.backend}-{res['request_rate']}qps{concurrency}-{os.path.basename(model)}-{res['date']}.json"
        )
        path = os.path.join(ns.result_dir or ".", name)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(res, generated_texts=[r.text for r in results]), f)
        print(f"saved {path}", file=sys.stderr)
    print(json.dumps(res))
    return 0 if res["completed"] else 1


def add_bench_serve_args(p) -> None:
    p.add_argument("--backend", default="openai", choices=sorted(BACKENDS), help="openai (completions) | openai-chat")
    p.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default: /v1/completions, or /v1/chat/completions for chat")
    p.add_argument("--model", default=None, help="the model id to request (default: the server's first)")
    p.add_argument("--tokenizer", default=None, help="sizes the prompts (default: the model's, else the built-in)")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    p.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    p.add_argument("--random-prefix-len", type=int, default=0, help="a random prefix every prompt shares")
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="sent with every request (default: 0, greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="every request generates its full output length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="shown in the table: ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99 (default: 99)")
    p.add_argument("--save-result", action="store_true", help="write the result JSON to --result-dir")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
