"""Error paths of the HTTP front, in process (FastAPI's TestClient) over a real tiny engine."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.server.app import build_app
from dsserve.server.async_engine import AsyncEngine, EngineOverloaded
from dsserve.server.metrics import EngineMetrics


@pytest.fixture(scope="module")
def core():
    return EngineCore(EngineArgs(model="tiny", max_num_seqs=2, block_size=16))


def make(core, **kw):
    engine = AsyncEngine(core, max_waiting=kw.pop("max_waiting", 8), metrics=EngineMetrics())
    return engine, TestClient(build_app(engine, "tiny", **kw))


def check_error(r, status, needle):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]


def test_api_key(core):
    _, c = make(core, api_key="sekret")
    check_error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}), 401, "API key")
    ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert c.get("/health").status_code == 200  # health and metrics stay open for probes


def test_oversized_body_unknown_route_and_model(core):
    _, c = make(core, max_body_bytes=1000)
    check_error(c.post("/v1/completions", json={"prompt": "x" * 2000}), 413, "exceeds the limit of 1000")
    check_error(c.get("/v1/nothing"), 404, "Not Found")
    check_error(
        c.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]}),
        404,
        "does not exist",
    )
    check_error(c.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400, "role")


def test_full_queue_is_503_with_retry_after(core, monkeypatch):
    engine, c = make(core)

    def full(*a, **k):
        raise EngineOverloaded("the waiting queue is full")

    monkeypatch.setattr(engine, "submit", full)
    r = c.post("/v1/completions", json={"prompt": "hi"})
    check_error(r, 503, "queue is full")
    assert r.headers["retry-after"] == "1"


def test_a_faulty_step_fails_its_requests_and_the_engine_keeps_serving(core, monkeypatch):
    engine, c = make(core)
    real, calls = core.runner.execute, {"n": 0}

    def flaky(plan):  # fails once, after the request was scheduled
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(plan)

    monkeypatch.setattr(core.runner, "execute", flaky)
    check_error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 500, "injected fault")
    assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert c.get("/health").json()["status"] == "ok"
    assert core.kv.blocks.num_used == 0


def test_graceful_drain_finishes_then_aborts(core):
    engine, c = make(core)
    assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    engine.shutdown(timeout=1.0)
    assert not engine.alive()
    with pytest.raises(EngineOverloaded, match="shutting down"):
        import asyncio

        asyncio.run(_submit(engine))


async def _submit(engine):
    from dsserve import SamplingParams

    engine.submit("late", [1, 2], SamplingParams())


def test_reset_prefix_cache_route(core):
    engine, c = make(core, api_key="sekret")
    auth = {"Authorization": "Bearer sekret"}
    check_error(c.post("/reset_prefix_cache"), 401, "API key")  # an admin route: behind the key
    body = {"prompt": list(range(5, 45)), "max_tokens": 1}  # two full blocks of 16
    c.post("/v1/completions", json=body, headers=auth).raise_for_status()
    assert (
        c.post("/v1/completions", json=body, headers=auth).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    )
    r = c.post("/reset_prefix_cache", headers=auth)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert (
        c.post("/v1/completions", json=body, headers=auth).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        == 0
    )
    # with a request in flight the engine refuses, and keeps serving it
    sink_loop = asyncio.new_event_loop()

    async def busy_then_reset():
        params = SamplingParams(max_tokens=32, ignore_eos=True)  # steps enough to still run when the reset arrives
        sink = engine.submit("long", core.validate("x", params), params)
        refused = not await engine.reset_prefix_cache()
        outs = []
        while (o := await sink.get()) is not None:
            outs.append(o)
        return refused, outs[-1]

    refused, last = sink_loop.run_until_complete(busy_then_reset())
    sink_loop.close()
    assert refused and last.finished and len(last.outputs[0].token_ids) == 32
    engine.reset_prefix_cache = lambda: asyncio.sleep(0, result=False)  # the engine's refusal, as the route says it
    check_error(c.post("/reset_prefix_cache", headers=auth), 409, "only while no request runs")


def test_a_prompt_over_max_model_len_is_refused_by_count(core):
    """Plain and chat prompts are counted before their ids are built; the message names the limit."""
    _, c = make(core)
    long = "hello world " * core.max_model_len
    check_error(
        c.post("/v1/completions", json={"prompt": long}), 400, f"maximum context length is {core.max_model_len}"
    )
    chat = {"messages": [{"role": "user", "content": long}]}
    r = c.post("/v1/chat/completions", json=chat)
    check_error(r, 400, f"maximum context length is {core.max_model_len}")  # the same words on both routes
    assert r.json()["error"]["param"] == "messages"
