"""Router -> prefill -> decode on loopback in replay mode (the default): the replay approximation's tokens, a
prefill instance killed mid-transfer, a dead prefill instance retried, AgentX small, a decode instance restarted.

One set of processes for the module: two prefill instances (one sends its blocks slowly, to be killed mid-transfer),
one decode instance and the router."""

import json
import threading
import time

import httpx
import pytest
from cluster import launch, router, stop, up
from test_connector import BS, NEW, W, rand_tokens, reference_after_hit

from dsserve import LLM
from dsserve.cli import main
from dsserve.disagg.connector import SEND_DELAY_ENV
from dsserve.disagg.router import Instance, rendezvous


@pytest.fixture(scope="module")
def cluster():
    slow = launch("prefill", env={SEND_DELAY_ENV: "0.25"})
    fast = launch("prefill")
    dec = launch("decode")
    procs = [slow[0], fast[0], dec[0]]
    try:
        up(slow, fast, dec)
        r = router([slow[1], fast[1]], [dec[1]], ["--unavailable-wait", "3"])
        procs.append(r[0])
        yield {"slow": slow, "fast": fast, "decode": dec, "router": r[1], "procs": procs}
    finally:
        stop(*procs)


@pytest.fixture(scope="module")
def model():
    return LLM(model="tiny", dtype="float64", device="cpu", block_size=BS, enable_prefix_caching=True).engine


def key_for(c, which: str) -> str:
    """A session id the router sends to the prefill instance ``which`` while both are up."""
    pool = [Instance(c["slow"][1], "prefill"), Instance(c["fast"][1], "prefill")]
    return next(k for k in (f"s{i}" for i in range(100)) if rendezvous(k, pool).url == c[which][1])


def complete(c, prompt, key, **kw):
    body = dict(prompt=prompt, max_tokens=NEW, temperature=0, ignore_eos=True, **kw)
    return httpx.post(c["router"] + "/v1/completions", json=body, headers={"X-Session-Id": key}, timeout=120)


def state(base):
    return httpx.get(base + "/kv_transfer", timeout=5).json()


def test_replay_mode_equals_the_replay_reference(cluster, model):
    key = key_for(cluster, "fast")
    for n, seed in ((90, 1), (150, 2)):
        prompt = rand_tokens(n, seed)
        r = complete(cluster, prompt, key)
        assert r.status_code == 200, r.text
        body = r.json()
        ref = reference_after_hit(model.model, prompt, (n - 1) // BS * BS, W)
        assert body["choices"][0]["text"] == model.tokenizer.decode(ref)
        st = body["kv_transfer"]
        assert st["bytes"] == st["global_bytes"] == (n - 1) // BS * model.kv.layout.global_bytes_per_block
        streamed = complete(cluster, prompt, key, stream=True)
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        text = "".join(
            c["text"]
            for line in streamed.text.splitlines()
            if line.startswith("data: {")
            for c in json.loads(line[6:])["choices"]
        )
        assert text == body["choices"][0]["text"]
    m = httpx.get(cluster["router"] + "/metrics").text
    assert 'dsserve_router:kv_transfer_bytes_total{kind="moved"}' in m and "dsserve_router:kv_replay_seconds_count" in m
    dm = httpx.get(cluster["decode"][1] + "/metrics").text
    assert "dsserve:kv_transfer_loads_total{kind" not in dm and 'outcome="ok"' in dm


def test_chat_streams_through_the_router(cluster):
    body = dict(messages=[{"role": "user", "content": "hello " * 30}], max_tokens=4, temperature=0, stream=True)
    r = httpx.post(cluster["router"] + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and "data: [DONE]" in r.text and "chat.completion.chunk" in r.text


def test_killing_the_prefill_instance_mid_transfer_fails_the_request_and_leaks_nothing(cluster):
    key = key_for(cluster, "slow")
    prompt = rand_tokens(16 * 13, 3)  # 12 blocks at 0.25 s each: a 3 s pull
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", complete(cluster, prompt, key)))
    t.start()
    deadline = time.monotonic() + 120
    while state(cluster["decode"][1])["loading"] == 0:
        assert time.monotonic() < deadline and t.is_alive(), "the pull never started"
        time.sleep(0.05)
    cluster["slow"][0].kill()
    t.join(60)
    assert not t.is_alive()
    r = result["r"]
    assert r.status_code == 502
    msg = r.json()["error"]["message"]
    assert "prefill instance" in msg and cluster["slow"][1] in msg
    deadline = time.monotonic() + 10
    while (s := state(cluster["decode"][1]))["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s["loading"] == 0 and s["blocks_referenced"] == 0 and s["in_flight"] == 0
    # the same session again: the dead prefill instance is skipped (retried on the other one)
    again = complete(cluster, prompt, key)
    assert again.status_code == 200, again.text
    assert state(cluster["fast"][1])["blocks_referenced"] == 0 and state(cluster["fast"][1])["exports"] == 0


def test_agentx_small_through_the_router(cluster, tmp_path, capsys):
    rc = main(
        [
            "bench",
            "agentx",
            "--base-url",
            cluster["router"],
            "--preset",
            "small",
            "--seed",
            "1",
            "--concurrency",
            "2",
            "--duration",
            "5",
            "--fast",
            "--num-sessions",
            "3",
            "--scale",
            "0.02",
            "--output-dir",
            str(tmp_path),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text[-2000:]
    (pt,) = json.loads(text.strip().splitlines()[-1])["points"]
    assert pt["all_requests"] > 0 and pt["errors"] == 0
    # what the hand-offs moved against the window-carrying alternatives, as the router counts them
    m = {
        line.split('kind="')[1].split('"')[0]: float(line.split()[-1])
        for line in httpx.get(cluster["router"] + "/metrics").text.splitlines()
        if line.startswith("dsserve_router:kv_transfer_bytes_total{")
    }
    assert 0 < m["moved"] < m["with_window_ring"] < m["with_window_rows"]


def test_a_decode_instance_restart_is_survived(cluster):
    proc, base = cluster["decode"]
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    r = complete(cluster, rand_tokens(40, 5), "restart")
    assert r.status_code == 503 and "no decode instance" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 60  # no hang: --unavailable-wait 3 plus the prefill step
    port = int(base.rsplit(":", 1)[1])
    again = launch("decode", port=port)
    cluster["procs"].append(again[0])
    up(again)
    r = complete(cluster, rand_tokens(40, 5), "restart")
    assert r.status_code == 200, r.text
