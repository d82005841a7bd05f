"""The live server on loopback, through the official openai client and raw HTTP."""

import asyncio
import json
import os
import sys

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from dsserve.engine.warmup import attention_split_rows, moe_run_rows, prefill_rows, router_split_rows
from dsserve.models.presets import preset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import SERVER_ARGS, live_server  # noqa: E402


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def metric(base, name, **labels):
    text = httpx.get(base + "/metrics").text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_models_health_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server + "/health").json()["status"] == "ok"
    toks = httpx.post(server + "/tokenize", json={"prompt": "Hello"}).json()
    assert toks["count"] == len(toks["tokens"]) and toks["tokens"][0] == 0
    assert httpx.post(server + "/detokenize", json={"tokens": toks["tokens"][1:]}).json()["prompt"] == "Hello"


def test_completions_plain_stream_n_stop_logprobs(server, client):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0, logprobs=2)
    c = r.choices[0]
    n_prompt = httpx.post(server + "/tokenize", json={"prompt": "Hello world"}).json()["count"]
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == n_prompt and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 8 and all(len(t) >= 1 for t in c.logprobs.top_logprobs)
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model="tiny", prompt="Hello world", max_tokens=8, temperature=0, stream=True
        )
    )
    assert streamed == c.text
    stop = c.text[2:5]
    s = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == c.text[: c.text.index(stop)]
    n = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, n=3, temperature=1.0, seed=3)
    assert sorted(ch.index for ch in n.choices) == [0, 1, 2] and n.usage.completion_tokens == 12


def test_chat_plain_stream_usage_and_cached_second_turn(client):
    msgs = [{"role": "system", "content": "You are terse. " * 12}, {"role": "user", "content": "Say hi. " * 10}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    assert len(r.choices[0].logprobs.content) == 6
    # another salt: a prefix hit under bounded replay is (by design) not bit-identical to the cold run
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": "stream"},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    turn2 = msgs + [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "Again."},
    ]
    r2 = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=4, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached <= r.usage.prompt_tokens


def test_streaming_greedy_equals_llm_generate(client):
    from dsserve import LLM, SamplingParams

    opts = dict(zip([a[2:].replace("-", "_") for a in SERVER_ARGS[::2]], SERVER_ARGS[1::2]))
    llm = LLM(model="tiny", dtype=opts["dtype"], block_size=int(opts["block_size"]))
    prompt = "The quick brown fox jumps over the lazy dog " * 4
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    got = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    )
    assert got == want


def test_concurrent_streams_then_disconnects_leave_the_cache_empty(server):
    async def one(i, cut):
        async with httpx.AsyncClient(timeout=120) as c:
            # seeded: unseeded sampling made this test flaky (a 200-token stream can draw EOS within 3 tokens)
            body = {
                "prompt": f"client {i} " * (5 + i % 7),
                "max_tokens": 24 if not cut else 200,
                "temperature": 0.7,
                "stream": True,
                "seed": 1000 + i,
            }
            async with c.stream("POST", server + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        n += 1
                        if cut and n >= 3:
                            return "cut"
                    if line == "data: [DONE]":
                        return "done"
        return "eof"

    async def many(cut):
        return await asyncio.gather(*(one(i, cut) for i in range(16)))

    assert asyncio.run(many(False)) == ["done"] * 16
    aborted_before = metric(server, "dsserve:request_success_total", finished_reason="abort")
    assert asyncio.run(many(True)) == ["cut"] * 16
    for _ in range(100):
        if metric(server, "dsserve:num_requests_running") == 0 and metric(server, "dsserve:num_requests_waiting") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(server, "dsserve:num_requests_running") == 0
    assert metric(server, "dsserve:kv_cache_usage_perc", kind="global") == 0
    assert metric(server, "dsserve:request_success_total", finished_reason="abort") >= aborted_before + 16
    assert httpx.get(server + "/health").json() == {"status": "ok", "in_flight": 0}


def test_metrics_parse_and_move(server, client):
    before = metric(server, "dsserve:generation_tokens_total")
    client.completions.create(model="tiny", prompt="count me", max_tokens=5, temperature=0)
    assert metric(server, "dsserve:generation_tokens_total") == before + 5
    assert metric(server, "dsserve:time_to_first_token_seconds_count") >= 1


def test_warmup_runs_before_the_port_opens_and_counts_nothing(tmp_path):
    """`serve --warmup` runs its synthetic requests before /health answers; the counters start at zero after it.
    `--kernel-manifest` is written after the warm-up (empty here: the interpreter compiles nothing)."""
    log = []
    manifest = tmp_path / "kernels.jsonl"
    args = SERVER_ARGS + [
        "--warmup",
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "1100",
        "--kernel-manifest",
        str(manifest),
        "--precompile-workers",
        "0",
    ]
    with live_server(args=args, log=log) as base:
        assert metric(base, "dsserve:prompt_tokens_total") == 0 and metric(base, "dsserve:prefill_rows_total") == 0
        httpx.post(base + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=60).raise_for_status()
        assert metric(base, "dsserve:generation_tokens_total") == 2
    # the context ladder: the cold prompt and a hit on it (max_model_len 1100: one bucket); the batch buckets:
    # 2 x (1 + 2); the row ladder: its base prompt and one request a row count (chunks of 256 rows, no row graphs on
    # the CPU; the split-K rows of the default model, the tiny shape trained; the router's on one SM, the CPU's;
    # the MoE's expert run's)
    tiny = preset("tiny")
    rows = prefill_rows(256, 0, attention_split_rows(tiny) + router_split_rows(tiny, 1, 256) + moe_run_rows(tiny))
    assert f"warm-up: {2 + 2 * (1 + 2) + 1 + len(rows)} requests" in log[0]
    assert manifest.exists() and manifest.read_text() == ""


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"prompt": "x", "temprature": 1}, 400, "temprature"),
        ({"prompt": [1, 99999]}, 400, "8192"),
        ({"prompt": [5] * 5000, "max_tokens": 1}, 400, "max_model_len"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ],
)
def test_bad_requests_are_openai_errors(server, body, status, needle):
    r = httpx.post(server + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and "type" in err


json_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=8,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "prompt": json_value,
        "messages": json_value,
        "max_tokens": json_value,
        "temperature": json_value,
        "top_p": json_value,
        "top_k": json_value,
        "n": json_value,
        "stop": json_value,
        "stream": json_value,
        "logprobs": json_value,
        "seed": json_value,
        "min_p": json_value,
        "extra": json_value,
    },
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=fields, chat=st.booleans())
def test_fuzzed_bodies_never_5xx(server, body, chat):
    if "max_tokens" not in body:
        body["max_tokens"] = 2
    r = httpx.post(server + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["code"] == r.status_code
    assert httpx.get(server + "/health").status_code == 200


def _mangle(raw: bytes, how: str, at: int) -> bytes:
    """The JSON bytes ``raw`` re-encoded or damaged at the ``at``-th position (or quote)."""
    quotes = [i for i, b in enumerate(raw) if b == ord('"')]
    q = quotes[at % len(quotes)] + 1 if quotes else 0  # just inside a string (or a key)
    k = at % (len(raw) + 1)
    return {
        "utf-8": lambda: raw,
        "utf-16": lambda: json.dumps(json.loads(raw), ensure_ascii=False).encode("utf-16"),
        "invalid utf-8": lambda: raw[:k] + b"\xff" + raw[k:],
        "raw surrogate": lambda: raw[:q] + "\ud800".encode("utf-8", "surrogatepass") + raw[q:],
        "lone surrogate escape": lambda: raw[:q] + b"\\udc00" + raw[q:],
        "surrogate pair escape": lambda: raw[:q] + b"\\ud83d\\ude00" + raw[q:],
        "nul byte": lambda: raw[:k] + b"\x00" + raw[k:],
        "nul escape": lambda: raw[:q] + b"\\u0000" + raw[q:],
    }[how]()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    body=fields,
    chat=st.booleans(),
    how=st.sampled_from(
        [
            "utf-8",
            "utf-16",
            "invalid utf-8",
            "raw surrogate",
            "lone surrogate escape",
            "surrogate pair escape",
            "nul byte",
            "nul escape",
        ]
    ),
    at=st.integers(0, 10**6),
    pieces=st.integers(1, 4),
)
def test_fuzzed_bytes_and_framing_never_5xx(server, body, chat, how, at, pieces):
    """The fuzzed bodies again, as raw bytes re-encoded or damaged, sent whole (Content-Length) or in chunks
    (chunked transfer encoding): never a 5xx, an OpenAI error body for every 4xx, and the kept-alive connection
    serves the next request."""
    body.setdefault("max_tokens", 2)
    raw = _mangle(json.dumps(body).encode(), how, at)
    cuts = sorted({(at * (i + 1)) % (len(raw) + 1) for i in range(pieces - 1)})
    parts = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
    content = raw if pieces == 1 else iter(parts)
    with httpx.Client(base_url=server, timeout=60) as c:
        r = c.post(
            "/v1/chat/completions" if chat else "/v1/completions",
            content=content,
            headers={"content-type": "application/json"},
        )
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["code"] == r.status_code
        port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
        after = c.get("/health")
        assert after.status_code == 200
        assert after.extensions["network_stream"].get_extra_info("client_addr")[1] == port


def test_a_non_streaming_client_that_hangs_up_is_aborted(server):
    before = metric(server, "dsserve:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server + "/v1/completions",
            json={"prompt": "slow " * 20, "max_tokens": 3000, "ignore_eos": True},
            timeout=1.0,
        )
    for _ in range(100):
        if metric(server, "dsserve:request_success_total", finished_reason="abort") > before:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(server, "dsserve:request_success_total", finished_reason="abort") == before + 1
    assert metric(server, "dsserve:num_requests_running") == 0
