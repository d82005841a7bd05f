"""OpenAI/vLLM request fields, in process (FastAPI's TestClient) over a real tiny engine: range checks, echo,
continuous usage, the context-length 400 in vLLM's words, the accepted no-op fields and logit_bias."""

import json

import pytest
from fastapi.testclient import TestClient

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.server.app import build_app
from dsserve.server.async_engine import AsyncEngine
from dsserve.server.metrics import EngineMetrics


@pytest.fixture(scope="module")
def client():
    core = EngineCore(EngineArgs(model="tiny", max_num_seqs=4, block_size=16))
    engine = AsyncEngine(core, max_waiting=8, metrics=EngineMetrics())
    with TestClient(build_app(engine, "tiny")) as c:
        c.core = core
        yield c
    engine.shutdown(1.0)


def error(r, status: int, param: str | None, *needles: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err["message"]


def events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


GREEDY = {"temperature": 0, "max_tokens": 3, "ignore_eos": True}


# ---------------------------------------------------------------- range and cross-field checks
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
def test_seed_outside_int64_is_a_400_naming_the_range(client, seed, stream):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": seed, "stream": stream})
    error(r, 400, "seed", "seed", f"[{-(2**63)}, {2**63 - 1}]", str(seed))
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": seed, "stream": stream})
    error(r, 400, "priority", "priority", f"[{-(2**63)}, {2**63 - 1}]")


def test_int64_edge_seeds_are_served_and_repeat(client):
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt": "hi", "max_tokens": 2, "seed": seed, "n": 2, "ignore_eos": True}
        first, again = (client.post("/v1/completions", json=body) for _ in range(2))
        assert first.status_code == 200, first.text
        assert [c["text"] for c in again.json()["choices"]] == [c["text"] for c in first.json()["choices"]]


def test_n_above_1_with_greedy_sampling_is_a_400_as_in_vllm(client):
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2, "temperature": 0.0}),
    ):
        error(client.post(path, json=body), 400, "n", "n=2", "greedy")
    assert client.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 1}).status_code == 200


def test_suffix_and_best_of(client):
    error(client.post("/v1/completions", json={"prompt": "hi", "suffix": "end"}), 400, "suffix", "not supported")
    error(client.post("/v1/completions", json={"prompt": "hi", "best_of": 3}), 400, "best_of", "best_of=3", "n=1")
    error(client.post("/v1/completions", json={"prompt": "hi", "best_of": 1, "n": 2}), 400, "best_of")
    ok = client.post("/v1/completions", json={"prompt": "hi", "best_of": 2, "n": 2, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    nulls = {"prompt": "hi", "max_tokens": 1, "suffix": None, "best_of": None}
    assert client.post("/v1/completions", json=nulls).status_code == 200


def test_stream_options_need_stream(client):
    body = {"prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}}
    error(client.post("/v1/completions", json=body), 400, "stream_options", "stream=True")


# ---------------------------------------------------------------- echo and continuous usage
def test_echo_prepends_the_prompt(client):
    plain = client.post("/v1/completions", json={"prompt": "Hello there", **GREEDY}).json()["choices"][0]["text"]
    got = client.post("/v1/completions", json={"prompt": "Hello there", "echo": True, **GREEDY}).json()
    assert got["choices"][0]["text"] == "Hello there" + plain
    assert got["usage"]["completion_tokens"] == 3
    ids = client.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_ids = client.post("/v1/completions", json={"prompt": ids, "echo": True, **GREEDY}).json()
    assert by_ids["choices"][0]["text"] == client.core.tokenizer.decode(ids) + plain
    chunks = events(
        client.post("/v1/completions", json={"prompt": "Hello there", "echo": True, "stream": True, **GREEDY})
    )
    assert chunks[0]["choices"][0]["text"] == "Hello there"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello there" + plain
    body = {"prompt": "Hello", "echo": True, "logprobs": 1, "max_tokens": 1}
    error(client.post("/v1/completions", json=body), 400, "echo", "prompt logprobs")


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_usage_in_every_chunk(client, chat):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"stream": True, "stream_options": opts, "n": 2, "seed": 4, "max_tokens": 4, "ignore_eos": True}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "count"}]
    else:
        path, body["prompt"] = "/v1/completions", "count"
    chunks = events(client.post(path, json=body))
    *per_choice, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    prompt = last["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    for c in per_choice:
        (choice,) = c["choices"]
        u = c["usage"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
        assert u["completion_tokens"] >= seen[choice["index"]]  # never goes back
        seen[choice["index"]] = u["completion_tokens"]
    assert seen == {0: 4, 1: 4}
    # without the switch only the last chunk has a usage
    body["stream_options"] = {"include_usage": True}
    assert [("usage" in c) for c in events(client.post(path, json=body))][-2:] == [False, True]


# ---------------------------------------------------------------- the context length
def test_prompt_plus_max_tokens_over_the_context_is_a_400_in_vllm_words(client):
    n = client.core.max_model_len
    msg = error(
        client.post("/v1/completions", json={"prompt": [5] * (n - 10), "max_tokens": 11}),
        400,
        "max_tokens",
        f"maximum context length is {n} tokens",
        "requested 11 output tokens",
        f"at least {n - 10} input tokens",
    )
    assert f"for a total of at least {n + 1} tokens" in msg
    chat = {"messages": [{"role": "user", "content": "x " * (n - 40)}], "max_completion_tokens": 100}
    error(client.post("/v1/chat/completions", json=chat), 400, "max_completion_tokens", "maximum context length")
    error(client.post("/v1/completions", json={"prompt": [5] * n}), 400, "max_tokens", "maximum context length")
    # exactly full is fine; with no max_tokens the default is cut to the room left (vLLM's rule)
    full = client.post("/v1/completions", json={"prompt": [5] * (n - 3), "max_tokens": 3, "ignore_eos": True})
    assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 3
    cut = client.post("/v1/completions", json={"prompt": [5] * (n - 2), "ignore_eos": True}).json()
    assert cut["usage"]["completion_tokens"] == 2 and cut["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- fields clients send
CHAT = {"messages": [{"role": "user", "content": "Say something"}], **GREEDY}


def test_accepted_no_op_fields_change_nothing(client):
    want = client.post("/v1/chat/completions", json=CHAT).json()
    no_ops = {
        "store": True,
        "metadata": {"team": "a"},
        "user": "u-1",
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "prediction": {"type": "content", "content": "Something"},
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "verbosity": "low",
        "modalities": ["text"],
        "reasoning_effort": None,
    }
    got = client.post("/v1/chat/completions", json={**CHAT, **no_ops})
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want["choices"]
    assert got.json()["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]  # cached_tokens may differ
    done = client.post("/v1/completions", json={"prompt": "hi", "user": "u", "best_of": 1, **GREEDY})
    assert done.status_code == 200


def test_reasoning_effort_switches_thinking(client, monkeypatch):
    import dsserve.server.app as app_module

    seen = []

    def spy(tokenizer, messages, **kw):
        seen.append((kw["thinking"], kw["reasoning_effort"]))
        return real(tokenizer, messages, **kw)

    real = app_module.chat_prompt_ids
    monkeypatch.setattr(app_module, "chat_prompt_ids", spy)

    def mode(**kw):
        r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return seen.pop()

    assert mode() == (False, None)
    assert mode(reasoning_effort="none") == (False, None)
    assert mode(reasoning_effort="high") == (True, "high")
    assert mode(reasoning_effort="minimal") == (True, "low") and mode(reasoning_effort="xhigh") == (True, "high")
    assert mode(reasoning_effort="high", chat_template_kwargs={"thinking": False}) == (False, None)  # kwargs win
    assert mode(chat_template_kwargs={"enable_thinking": True}) == (True, None)
    error(client.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "extreme"}), 400, "reasoning_effort")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"functions": [{"name": "f"}]}, "functions"),  # outside the schema dsserve serves: named, as any other
        ({"temprature": 0.5}, "temprature"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true (vLLM's rule)
    ],
)
def test_unsupported_fields_are_named_400s(client, extra, param):
    error(client.post("/v1/chat/completions", json={**CHAT, **extra}), 400, param, param)


def test_logit_bias_validation(client):
    vocab = client.core.cfg.vocab_size
    body = {"prompt": "hi", "max_tokens": 1}
    error(client.post("/v1/completions", json={**body, "logit_bias": {str(vocab): 5}}), 400, "logit_bias", str(vocab))
    error(client.post("/v1/completions", json={**body, "logit_bias": {"7": 100.5}}), 400, "logit_bias", "[-100, 100]")
    error(client.post("/v1/completions", json={**body, "logit_bias": {"seven": 1}}), 400, "logit_bias", "'seven'")
    assert client.post("/v1/completions", json={**body, "logit_bias": {}}).status_code == 200
    # the engine checks it too (LLM users): before the request enters a step, not in the sampler
    from dsserve.engine.sampling_params import SamplingParams, SamplingParamsError

    with pytest.raises(SamplingParamsError, match=f"0, {vocab}"):
        client.core.validate([5, 6], SamplingParams(logit_bias={vocab + 3: 1.0}))


# ---------------------------------------------------------------- the live server
def test_live_logit_bias_forces_and_bans_tokens(server):
    import httpx

    forced = 77
    text = httpx.post(server + "/detokenize", json={"tokens": [forced] * 5}).json()["prompt"]
    for path, body in (
        ("/v1/completions", {"prompt": "Hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
    ):
        common = {"max_tokens": 5, "ignore_eos": True, "temperature": 1.0, "seed": 3, **body}
        r = httpx.post(server + path, json={**common, "logit_bias": {str(forced): 100}}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"] if "text" in choice else choice["message"]["content"]) == text
    greedy = {"prompt": "Hello", "max_tokens": 1, "temperature": 0, "logprobs": 0}
    first = httpx.post(server + "/v1/completions", json=greedy, timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    ids = httpx.post(server + "/tokenize", json={"prompt": first[0], "add_special_tokens": False}).json()["tokens"]
    banned = httpx.post(
        server + "/v1/completions", json={**greedy, "logit_bias": {str(t): -100 for t in ids}}, timeout=60
    ).json()
    assert banned["choices"][0]["logprobs"]["tokens"] != first
