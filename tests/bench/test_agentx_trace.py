"""Seeded AgentX-like workload generator: determinism, acceptance bands, exact prefix relations and tokens."""

import hashlib
import json
from dataclasses import asdict

import pytest

from dsserve.bench.agentx_trace import (
    ACCEPTANCE,
    BLOCK,
    PRESETS,
    Trace,
    check_acceptance,
    generate,
    request_token_ids,
    seed_for,
)

VOCAB = 129_280
RESERVED = frozenset(range(3)) | frozenset(range(128_798, VOCAB))


@pytest.fixture(scope="module")
def small():
    return generate("small", 42)


def test_seed_derivation_follows_spec():
    want = int.from_bytes(hashlib.sha256(b"42:trace/7:3").digest()[:8], "big")
    assert seed_for(42, "trace/7", 3) == want


def test_same_seed_same_bytes_different_seed_differs(small):
    a = small.to_json().encode()
    assert generate("small", 42).to_json().encode() == a
    assert generate("small", 43).to_json().encode() != a
    assert Trace.from_json(a.decode()).to_json().encode() == a  # lossless round trip
    assert hashlib.sha256(a).hexdigest() == small.sha256()


def test_sessions_independent_of_corpus_size(small):
    few = generate("small", 42, num_sessions=5)
    assert [asdict(s) for s in few.sessions] == [asdict(s) for s in small.sessions[:5]]


def test_small_stats_inside_acceptance_bands(small):
    st = small.stats()
    print("\nsmall@42 stats:", json.dumps({k: round(v, 4) for k, v in st.items()}, indent=1))
    print("bands:", ACCEPTANCE["small"])
    assert st["sessions"] == PRESETS["small"].traces == 64
    assert check_acceptance(st, "small") == []
    assert check_acceptance({**st, "theoretical_hit": 0.5}, "small") != []


def test_large_and_default_presets_are_shaped(capsys):
    for name in ("large", "default"):
        tr = generate(name, 42, num_sessions=4)
        st = tr.stats()
        assert st["max_in_plus_out"] <= PRESETS[name].max_ctx
        assert st["theoretical_hit"] > 0.9 and st["isl_mean"] > 20_000


def _seen_set_hits(session):
    """Theoretical hit by definition (§1.2/§1.4): longest leading run of ids already seen, infinite cache."""
    seen, hits = set(), []
    for r in session.requests:
        ids = r.hash_ids
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits.append(n)
        seen.update(ids)
    return hits


def test_prefix_relations_and_token_counts_exact(small):
    p = PRESETS["small"]
    for s in small.sessions:
        reqs = s.requests
        assert [r.idx for r in reqs] == list(range(len(reqs)))
        assert [r.hit_blocks for r in reqs] == _seen_set_hits(s)
        assert sum(r.kind == "helper" for r in reqs) == p.n_helpers
        for r in reqs:
            assert len(r.hash_ids) == r.blocks == -(-r.isl // BLOCK)
            assert 1 <= r.osl and r.isl + r.osl <= p.max_ctx and r.isl <= p.compact_at
            assert r.cached_tokens == r.hit_blocks * BLOCK <= r.isl
            for a in r.after:  # gating requests start earlier and the recorded gap is honoured
                assert reqs[a].t + reqs[a].api_time + r.think_time <= r.t + 1e-6
            if r.parent is None:
                assert r.hit_blocks == 0 and r.turn == 0
                continue
            par = reqs[r.parent]
            assert par.agent_id == r.agent_id and par.turn == r.turn - 1 and r.parent in r.after
            assert r.hash_ids[: r.hit_blocks] == par.hash_ids[: r.hit_blocks]
            if r.compacted:  # only the system+tools prefix survives an auto-compaction
                assert r.hit_blocks == r.sys_blocks == min(par.sys_blocks, r.isl // BLOCK)
            else:  # turn k = turn k-1's full blocks + its append (assistant output + tool result)
                assert r.isl - par.isl >= 16 and r.hit_blocks == par.isl // BLOCK
                assert 0 <= r.append_tool <= r.isl - par.isl


def test_request_token_ids_realise_the_trace(small):
    for s in small.sessions[:6]:
        toks, by_block = {}, {}
        for r in s.requests:
            ids = request_token_ids(small, r, VOCAB, RESERVED)
            assert len(ids) == r.isl and not RESERVED.intersection(ids) and max(ids) < VOCAB
            toks[r.idx] = ids
            for j, b in enumerate(r.hash_ids):  # equal hash id -> identical block content
                blk = ids[j * BLOCK : (j + 1) * BLOCK]
                ref = by_block.setdefault(b, blk)
                assert ref[: len(blk)] == blk[: len(ref)]
            if r.parent is not None:
                par, n = toks[r.parent], r.cached_tokens
                assert ids[:n] == par[:n]  # the child starts with exactly the parent's shared prefix
                if n < len(par):
                    assert ids[n : n + BLOCK] != par[n : n + BLOCK]  # ... and no further
    r = small.sessions[0].requests[-1]
    assert request_token_ids(small, r, VOCAB, RESERVED) == request_token_ids(small, r, VOCAB, RESERVED)
    a, b = (request_token_ids(small, r, VOCAB, RESERVED, salt=x) for x in ("play-a", "play-b"))
    n = r.sys_blocks * BLOCK
    assert len(a) == r.isl and a[:n] == b[:n] and a[n : n + BLOCK] != b[n : n + BLOCK]


def test_subagents_and_joins(small):
    spawned = 0
    for s in small.sessions:
        reqs = s.requests
        for sa in s.subagents:
            spawned += 1
            mine = [r for r in reqs if r.agent_id == sa["agent_id"]]
            assert mine[0].after == [sa["spawned_by"]] and reqs[sa["spawned_by"]].kind == "root"
            joiners = [r for r in reqs if mine[-1].idx in r.after and r.kind == "root"]
            assert len(joiners) == (1 if sa["gating"] else 0)
            assert not set(mine[0].hash_ids) & {b for r in reqs if r.kind == "root" for b in r.hash_ids}
    assert spawned > 0
