"""The HTTP front over an engine with asynchronous scheduling (CPU: fixed-shape decode steps run ahead): streamed
and plain completions equal the synchronous engine's, and nothing stays in the cache."""

import json

import pytest
from fastapi.testclient import TestClient

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.server.app import build_app
from dsserve.server.async_engine import AsyncEngine


def _client(async_on: bool):
    core = EngineCore(
        EngineArgs(
            model="tiny",
            dtype="float64",
            device="cpu",
            attention_backend="paged",
            reference_ops="all",
            max_num_seqs=4,
            async_scheduling=async_on,
        )
    )
    return core, TestClient(build_app(AsyncEngine(core), "tiny"))


@pytest.fixture(scope="module")
def clients():
    return _client(False), _client(True)


def _stream_text(c, body) -> str:
    text = ""
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_async_server_streams_what_the_sync_server_streams(clients):
    bodies = [
        {"prompt": "The quick brown fox " * 3, "max_tokens": 14, "temperature": 0, "ignore_eos": True},
        {"prompt": "abc " * 9, "max_tokens": 10, "temperature": 0.8, "seed": 5, "ignore_eos": True},
    ]
    got = {}
    for async_on, (core, c) in zip((False, True), clients):
        got[async_on] = [_stream_text(c, b) for b in bodies]
        got[async_on] += [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
        assert core.kv.blocks.num_used == 0
        assert not core.has_unfinished_requests()
    assert got[True] == got[False] and all(got[True])
    assert clients[1][0].stats.ahead_steps > 0 and clients[0][0].stats.ahead_steps == 0
