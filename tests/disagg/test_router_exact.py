"""Exact mode (--no-swa-bounded-replay) through router -> prefill -> decode on loopback: the same greedy tokens (fp64)
as one `both` engine, a transfer that runs past --kv-transfer-timeout fails with a 504 and its reason, and both sides
hold nothing afterwards."""

import time

import httpx
import pytest
from cluster import launch, router, stop, up
from test_connector import BS, NEW, rand_tokens

from dsserve import LLM, SamplingParams
from dsserve.disagg.connector import SEND_DELAY_ENV

EXACT = ["--no-swa-bounded-replay"]


@pytest.fixture(scope="module")
def cluster():
    p = launch("prefill", EXACT)
    slow = launch("prefill", EXACT, env={SEND_DELAY_ENV: "1.0"})
    d = launch("decode", [*EXACT, "--kv-transfer-timeout", "2"])
    procs = [p[0], slow[0], d[0]]
    try:
        up(p, slow, d)
        r = router([p[1]], [d[1]])
        r_slow = router([slow[1]], [d[1]])
        procs += [r[0], r_slow[0]]
        yield {"router": r[1], "router_slow": r_slow[1], "prefill": p[1], "slow": slow[1], "decode": d[1]}
    finally:
        stop(*procs)


def test_exact_mode_equals_one_both_engine(cluster):
    both = LLM(
        model="tiny", dtype="float64", device="cpu", block_size=BS, swa_bounded_replay=False, enable_prefix_caching=True
    )
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for n, seed in ((90, 21), (65, 22), (200, 23)):
        prompt = rand_tokens(n, seed)
        body = dict(prompt=prompt, max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
        r = httpx.post(cluster["router"] + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        ref = both.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
        assert got["choices"][0]["text"] == ref.text
        assert got["choices"][0]["text"] == both.engine.tokenizer.decode(ref.token_ids)
        st = got["kv_transfer"]
        assert st["bytes"] == (n - 1) // BS * both.engine.kv.layout.bytes_per_block > st["global_bytes"]


def test_a_transfer_past_its_timeout_is_a_504_and_leaks_nothing(cluster):
    prompt = rand_tokens(16 * 6, 24)  # 5 blocks at 1 s each against a 2 s timeout
    body = dict(prompt=prompt, max_tokens=NEW, temperature=0, ignore_eos=True)
    t0 = time.monotonic()
    r = httpx.post(cluster["router_slow"] + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 60
    deadline = time.monotonic() + 10
    while True:
        d = httpx.get(cluster["decode"] + "/kv_transfer").json()
        p = httpx.get(cluster["slow"] + "/kv_transfer").json()
        if (d["in_flight"], p["in_flight"]) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert d["loading"] == 0 and d["blocks_referenced"] == 0 and p["blocks_referenced"] == 0
    # the decode side told the prefill side it gave up: the staged copy is gone too
    assert p["exports"] == 0
