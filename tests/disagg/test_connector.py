"""The KV connector in one process: a prefill engine hands a prompt's blocks to a decode engine (the socket replaced
by a direct read of the prefill side's staged hand-off), against the oracles of both modes (fp64, tiny)."""

import random

import pytest
import torch

import dsserve.disagg.connector as connector_mod
from dsserve import LLM, SamplingParams
from dsserve.disagg.accounting import handoff_bytes
from dsserve.disagg.transport import KVTransferError
from dsserve.kv.sequence_cache import SequenceCache

BS, NEW, W = 16, 6, 32


def make_llm(replay, **kw):
    return LLM(
        model="tiny",
        dtype="float64",
        device="cpu",
        block_size=BS,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        swa_bounded_replay=replay,
        replay_window=W,
        enable_prefix_caching=True,
        **kw,
    )


def rand_tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 8190) for _ in range(n)]


def run(engine, rid, prompt, kv_transfer=None, new=NEW):
    engine.add_request(
        rid, prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), kv_transfer=kv_transfer
    )
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                last = o
        engine.scheduler.check()
    return last


@pytest.fixture
def direct_pull(monkeypatch):
    """fetch_blocks served by the prefill engine's connector in this process; returns the list of pulls made."""
    pulls, prefills = [], {}

    def fetch(url, tid, first, count, expect, timeout):
        pulls.append((tid, first, count))
        data = b"".join(prefills[url].kv_connector.export_chunks(tid, first, count))
        if len(data) != expect:
            raise KVTransferError(f"{len(data)} != {expect}")
        return data

    monkeypatch.setattr(connector_mod, "fetch_blocks", fetch)
    monkeypatch.setattr(connector_mod, "release_remote", lambda url, tid: prefills[url].kv_connector.drop(tid))
    return pulls, prefills


def handoff(p_engine, d_engine, prompt, prefills, rid="r"):
    out_p = run(p_engine, rid + "-p", prompt, {"do_remote_decode": True})
    assert len(out_p.outputs[0].token_ids) == 1  # P stops after its first token
    params = dict(out_p.kv_transfer_params, remote_url="p://0")
    prefills["p://0"] = p_engine
    return out_p, run(d_engine, rid + "-d", prompt, params)


@torch.no_grad()
def reference_after_hit(model, tokens, hit, window):
    """The replay approximation (as tests/engine/test_prefix_cache.py): global KV of [0, hit) from a cold run, the
    encoder replaying from hit - window, the decoder on the last `window` rows; then greedy decode."""
    cold = SequenceCache(model.cfg.sliding_window)
    model(torch.tensor(tokens[:hit]), cold)
    s = max(0, hit - window)
    c = SequenceCache(model.cfg.sliding_window)
    for src in {r.kv_source for r in model.cfg.roles if r.owns_compressor}:
        c.push_global(src, *cold.global_kv(src))
    c.published_until, c.num_tokens = hit, s
    c.engram_history = model.engram_token_map[torch.tensor(tokens[max(0, s - 3) : s])]
    floor = max(0, len(tokens) - window)
    out = model(torch.tensor(tokens[s:]), c, decoder_start=floor)
    gen = [int(model.logits(out.hidden[-1:])[0].argmax())]
    for _ in range(NEW - 1):
        out = model(torch.tensor(gen[-1:]), c, decoder_start=floor)
        gen.append(int(model.logits(out.hidden)[0].argmax()))
    return gen


@pytest.mark.parametrize("prompt_len", [90, 64 + 1, 47])
def test_exact_mode_handoff_equals_one_engine(direct_pull, prompt_len):
    pulls, prefills = direct_pull
    p, d = make_llm(False).engine, make_llm(False).engine
    prompt = rand_tokens(prompt_len, prompt_len)
    out_p, out_d = handoff(p, d, prompt, prefills)
    ref = run(make_llm(False).engine, "ref", prompt)
    assert out_d.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out_d.outputs[0].token_ids[0] == out_p.outputs[0].token_ids[0]
    n = (prompt_len - 1) // BS
    assert out_d.num_cached_tokens == n * BS and pulls == [(out_p.kv_transfer_params["transfer_id"], 0, n)]
    st = out_d.kv_transfer_stats
    lay = d.kv.layout
    assert st["bytes"] == n * lay.bytes_per_block and st["global_bytes"] == n * lay.global_bytes_per_block
    assert st["bytes"] > st["global_bytes"]  # exact mode moves the window rows too
    for e in (p, d):
        assert e.kv.blocks.num_used == 0 and e.kv_connector.num_loading == 0
    assert p.kv_connector.num_exports() == 0  # pulled: dropped


@pytest.mark.parametrize("prompt_len", [90, 150])
def test_replay_mode_handoff_equals_the_replay_reference(direct_pull, prompt_len):
    pulls, prefills = direct_pull
    p, d = make_llm(True).engine, make_llm(True).engine
    prompt = rand_tokens(prompt_len, 100 + prompt_len)
    out_p, out_d = handoff(p, d, prompt, prefills)
    hit = (prompt_len - 1) // BS * BS
    assert out_d.num_cached_tokens == hit
    assert out_d.outputs[0].token_ids == reference_after_hit(d.model, prompt, hit, W)
    st = out_d.kv_transfer_stats
    assert st["bytes"] == st["global_bytes"] == hit // BS * d.kv.layout.global_bytes_per_block
    assert st["with_window_ring_bytes"] > st["bytes"] and "replay_s" in st and "transfer_s" in st
    assert st["with_window_rows_bytes"] > st["with_window_ring_bytes"]
    assert d.stats.replayed_rows > 0


def test_blocks_already_cached_on_the_decode_side_are_not_pulled(direct_pull):
    pulls, prefills = direct_pull
    p, d = make_llm(True).engine, make_llm(True).engine
    shared = rand_tokens(64, 7)
    run(d, "warm", shared + rand_tokens(20, 8))  # D already holds the first 4 blocks
    a = shared + rand_tokens(40, 9)
    out_p, out_d = handoff(p, d, a, prefills)
    n = (len(a) - 1) // BS
    assert pulls[-1][1:] == (4, n - 4)
    assert out_d.kv_transfer_stats["blocks_local"] == 4 and out_d.num_cached_tokens == n * BS
    assert out_d.outputs[0].token_ids == reference_after_hit(d.model, a, n * BS, W)


def test_a_failed_pull_fails_the_request_and_holds_nothing(monkeypatch):
    d = make_llm(True).engine
    p = make_llm(True).engine
    prompt = rand_tokens(100, 11)
    out_p = run(p, "p", prompt, {"do_remote_decode": True})

    def dead(*a):
        raise KVTransferError("KV transfer x from the prefill instance p://0 failed: ReadError", 502)

    monkeypatch.setattr(connector_mod, "fetch_blocks", dead)
    run(d, "warm", prompt[:40] + [5])  # a local hit the load holds, then must let go
    out = run(d, "d", prompt, dict(out_p.kv_transfer_params, remote_url="p://0"))
    assert out.finished and out.error == (502, "KV transfer x from the prefill instance p://0 failed: ReadError")
    assert d.kv.blocks.num_used == 0 and not d.scheduler.has_unfinished()
    assert run(d, "next", prompt).outputs[0].token_ids  # and it keeps serving


def test_a_handoff_of_another_layout_is_refused(direct_pull):
    p, d = make_llm(False).engine, make_llm(True).engine
    out_p = run(p, "p", rand_tokens(50, 12), {"do_remote_decode": True})
    with pytest.raises(ValueError, match="cache layout"):
        d.add_request(
            "d",
            rand_tokens(50, 12),
            SamplingParams(max_tokens=2),
            kv_transfer=dict(out_p.kv_transfer_params, remote_url="p://0"),
        )
    assert d.kv.blocks.num_used == 0


def test_release_layout_accounting():
    from dsserve.kv.layout import KVLayout
    from dsserve.models.presets import preset

    cfg = preset("v41-flash")
    lay = KVLayout.build(cfg, None, "auto", torch.bfloat16)
    for n in (8192, 32768, 131072):
        hb = handoff_bytes(lay, n, cfg.head_dim, cfg.index_head_dim)
        assert hb.moved == hb.global_bytes
        assert 880 <= hb.global_bytes / (hb.blocks * lay.block_size) <= 900  # ~890 B/token (spec)
        assert hb.with_window_rows / hb.moved >= 20  # 40 layers x 528 B of window rows a token
        assert hb.window_ring_bytes == 40 * 128 * 528  # 2.58 MiB: outweighs the global KV below ~3K tokens
