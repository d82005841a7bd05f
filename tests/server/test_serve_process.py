"""`dsserve serve` as a process: what its log says, its API key (from the environment, vLLM's scope), a port in
use, and SIGTERM past --shutdown-timeout with streams running."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dsserve.server.serve import add_serve_args, api_key_from, served_name

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import ROOT, SERVER_ARGS, spawn  # noqa: E402

KEY = "sekret-from-the-environment"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHUTDOWN_TIMEOUT = 2


@pytest.fixture(scope="module")
def keyed():
    """A server with its key in $DSSERVE_API_KEY and --shutdown-timeout 2; its log lines up to "ready"."""
    proc, base = spawn(
        args=[*SERVER_ARGS, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)], env={"DSSERVE_API_KEY": KEY}, drain=False
    )
    log = []
    while not log or "ready:" not in log[-1]:
        log.append(proc.stdout.readline())
        if not log[-1]:
            proc.kill()
            raise RuntimeError("no ready line:\n" + "".join(log))
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()


def test_the_log_says_what_is_served_where_and_when_it_is_ready(keyed):
    proc, base, log = keyed
    text = "".join(log)
    assert f"dsserve serve: model tiny, served as 'tiny', will listen on {base}" in text
    ready = [line for line in log if "ready:" in line]
    assert len(ready) == 1 and f"ready: {base} serves 'tiny' (start-up took " in ready[0]
    assert float(ready[0].split("start-up took ")[1].split(" s)")[0]) > 0


def test_the_api_key_guards_v1_as_vllm_does(keyed):
    proc, base, _ = keyed
    assert KEY not in " ".join(proc.args)  # from the environment: not on the command line, not in ps
    with httpx.Client(base_url=base, timeout=60) as c:
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
            ("POST", "/reset_prefix_cache", None),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
        models = c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})  # the scheme in any case
        assert models.status_code == 200
        assert [(m["id"], m.get("root")) for m in models.json()["data"]] == [("tiny", None)]
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=AUTH).status_code == 200
        # open, as in vLLM: probes, metrics and the tokenizer routes
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        toks = c.post("/tokenize", json={"prompt": "hi"})
        assert toks.status_code == 200
        assert c.post("/detokenize", json={"tokens": toks.json()["tokens"]}).status_code == 200
        assert c.options("/v1/models").status_code != 401  # a CORS preflight carries no key


def test_api_key_sources_and_served_name(tmp_path):
    ns = argparse.Namespace(api_key=None)
    assert api_key_from(ns, {}) is None
    assert api_key_from(ns, {"VLLM_API_KEY": "v"}) == "v"
    assert api_key_from(ns, {"VLLM_API_KEY": "v", "DSSERVE_API_KEY": "d"}) == "d"
    assert api_key_from(argparse.Namespace(api_key="flag"), {"DSSERVE_API_KEY": "d"}) == "flag"  # the flag wins
    ckpt = tmp_path / "DeepSeek-V4.1-Flash"
    ckpt.mkdir()
    assert served_name(str(ckpt) + "/", None) == "DeepSeek-V4.1-Flash"  # no local path in /v1/models
    assert served_name(str(ckpt), "ds") == "ds" and served_name("tiny", None) == "tiny"
    p = argparse.ArgumentParser()
    add_serve_args(p)
    helptext = " ".join(p.format_help().split())
    assert "every path under /v1" in helptext and "DSSERVE_API_KEY" in helptext and "VLLM_API_KEY" in helptext


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "dsserve", "serve", "tiny", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
    assert r.returncode != 0
    assert r.stderr.splitlines() == [
        f"dsserve: error: port {port} on 127.0.0.1 is in use (another server?); stop it or pick another --port"
    ]
    assert r.stdout == ""  # nothing was loaded: no model, no KV cache line


def _stream(base: str, i: int, lines: list, started: threading.Event) -> None:
    body = {"prompt": f"stream {i} " * 3, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) >= 3:
                        started.set()
    except httpx.HTTPError as e:
        lines.append(f"client error: {e!r}")
    started.set()


def test_sigterm_past_the_shutdown_timeout_ends_every_request_cleanly(keyed):
    """Four long streams and one plain request run when SIGTERM comes; at --shutdown-timeout (2 s) each stream
    gets a chunk with finish_reason "abort", an error event and [DONE], the plain request a 503, and the process
    exits 0 within the timeout + 2 s (the issue's bound: the cut is at 2 s, the rest is closing connections and
    the interpreter's exit, about 1.5 s here), with no traceback."""
    proc, base, log = keyed
    streams = [([], threading.Event()) for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(base, i, *s)) for i, s in enumerate(streams)]
    plain = {}

    def post():
        body = {"prompt": "plain", "max_tokens": 4000, "ignore_eos": True}
        plain["r"] = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=60)

    threads.append(threading.Thread(target=post))
    for t in threads:
        t.start()
    for _, started in streams:
        assert started.wait(120)
    time.sleep(0.3)  # the plain request is in the engine too
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    took = time.monotonic() - t0
    for t in threads:
        t.join(60)
    out = "".join(log) + proc.stdout.read()
    assert code == 0, out
    assert SHUTDOWN_TIMEOUT - 0.5 < took < SHUTDOWN_TIMEOUT + 2, took
    assert "Traceback" not in out and "Exception" not in out, out
    for lines, _ in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-3].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shut down before the request finished" in error["message"]
    r = plain["r"]
    assert r.status_code == 503 and "shut down before the request finished" in r.json()["error"]["message"]
