"""JSON-schema-constrained sampling (xgrammar): engine output always matches the schema; a schema that cannot be
compiled is a 400 naming the problem; response_format on the chat route."""

import json

import pytest
from fastapi.testclient import TestClient

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.engine.structured_output import GrammarError
from dsserve.server.app import build_app
from dsserve.server.async_engine import AsyncEngine

pytest.importorskip("xgrammar")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
    "required": ["city", "n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def core():
    return EngineCore(EngineArgs(model="tiny", max_num_seqs=4, block_size=16))


def run(core, params_list):
    for k, p in enumerate(params_list):
        core.add_request(f"r{k}", "The weather today:", p)
    done = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"r{k}"] for k in range(len(params_list))]


def test_outputs_match_the_schema(core):
    """The untrained tiny model would write anything; constrained, greedy and sampled rows (batched with an
    unconstrained one) all end in JSON of the schema, then EOS."""
    schema = json.dumps(SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=60, json_schema=schema)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=60, json_schema=schema) for s in range(2)]
    params += [SamplingParams(temperature=1.0, seed=9, max_tokens=8)]
    outs = run(core, params)
    for o in outs[:3]:
        assert o.finish_reason == "stop", o
        value = json.loads(o.text)
        assert set(value) == {"city", "n", "ok"} and value["city"] in ("Paris", "Rome", "Oslo")
        assert value["n"] in (1, 2, 3) and isinstance(value["ok"], bool)
    assert outs[3].finish_reason == "length"  # the unconstrained row is untouched


def test_bad_schema_is_named(core):
    with pytest.raises(GrammarError, match="cannot be compiled"):
        core.validate("x", SamplingParams(json_schema='{"type": "nope"}'))
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema={"type": "object"})


def test_chat_response_format(core):
    c = TestClient(build_app(AsyncEngine(core), "tiny"))
    ask = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 60, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    r = c.post("/v1/chat/completions", json={**ask, "response_format": fmt})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"city", "n", "ok"}
    r = c.post("/v1/chat/completions", json={**ask, "response_format": {"type": "json_object"}, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}
    r = c.post("/v1/chat/completions", json={**ask, "response_format": bad})
    assert r.status_code == 400 and "cannot be compiled" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"
    r = c.post("/v1/chat/completions", json={**ask, "response_format": fmt, "thinking": {"type": "enabled"}})
    assert r.status_code == 400 and "thinking" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={**ask, "response_format": {"type": "yaml"}})
    assert r.status_code == 400 and "'yaml'" in r.json()["error"]["message"]


@pytest.mark.parametrize("dialect", ["v4", "v4.1"])
def test_required_tool_call_follows_the_tool_schema(core, dialect):
    """tool_choice required with the grammar: the untrained model writes a well-formed DSML block whose arguments
    follow the tool's parameter schema; the output parser reads it back."""
    from dsserve.parsers import parse_output
    from dsserve.server import tool_calls as tc

    tool = {"type": "function", "function": {"name": "stock", "parameters": SCHEMA}}
    plan = tc.plan_tools([tool], "required", False, thinking=False, dialect=dialect, grammar=True)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=400, structural_tag=plan.structural_tag) for t in (0, 1)]
    for o in run(core, params):
        assert o.finish_reason == "stop", o
        out = parse_output(o.text, dialect=dialect, tools=["stock"])
        assert out.finish_reason == "tool_calls" and out.content == "" and len(out.tool_calls) == 1
        args = out.tool_calls[0].arguments
        assert set(args) == {"city", "n", "ok"} and args["city"] in ("Paris", "Rome", "Oslo") and args["n"] in (1, 2, 3)
