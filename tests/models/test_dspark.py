"""DSpark drafter (spec 2.10): context ingestion into per-stage rings, and block proposal.

The draft attention is checked against a dense re-derivation written from spec 2.3/2.10 (explicit loops over
query rows and heads, its own RMSNorm and RoPE), fed with the inputs captured from a real ``propose``.
"""

import math

import pytest
import torch

from dsserve.layers.quant import fake_quant_fp8_pow2
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset

T = 100


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = preset("tiny")
    model = DeepseekForCausalLM(cfg).eval()
    dummy_weights(model, cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for stage in model.mtp:  # dummy sinks are 0; make them matter for the reference check
            stage.attn.attn_sink.copy_(torch.randn(cfg.num_attention_heads, generator=g))
        tokens = torch.randint(0, cfg.vocab_size - 2, (T,), generator=g)
        out = model(tokens)
        y = int(model.logits(out.hidden[-1:]).argmax())
    return cfg, model, out.taps, out.positions, y


def ingested(setup, chunks=(T,), qat=None, n=T):
    cfg, model, taps, pos, _ = setup
    state = model.mtp.new_state()
    start = 0
    with torch.no_grad():
        for c in chunks:
            sl = slice(start, min(start + c, n))
            model.mtp.ingest({k: v[sl] for k, v in taps.items()}, pos[sl], state, qat=qat)
            start += c
    return state


def propose(setup, state, p=T - 1, qat=None):
    cfg, model, _, _, y = setup
    with torch.no_grad():
        return model.mtp.propose(y, p, state, model.embed, model.head, qat=qat)


def snapshot(state):
    return [(k.clone(), p.clone()) for k, p in zip(state.keys, state.positions)]


def test_shapes_finite_deterministic(setup):
    cfg = setup[0]
    b = cfg.dspark_block_size
    ids, conf, logits = propose(setup, ingested(setup))
    assert ids.shape == (b,) and ids.dtype == torch.long and conf.shape == (b,)
    assert logits.shape == (b, cfg.vocab_size)
    assert torch.isfinite(conf).all() and torch.isfinite(logits).all()
    assert torch.equal(ids, logits.argmax(-1))
    ids2, conf2, logits2 = propose(setup, ingested(setup))
    assert torch.equal(ids, ids2) and torch.equal(conf, conf2) and torch.equal(logits, logits2)


def test_ring_holds_last_window(setup):
    cfg = setup[0]
    w = cfg.sliding_window
    state = ingested(setup)
    assert len(state.keys) == cfg.num_draft_layers
    for k, p in zip(state.keys, state.positions):
        assert k.shape == (w, cfg.head_dim) and torch.equal(p, torch.arange(T - w, T))
    state = ingested(setup, chunks=(1,), n=1)
    assert all(k.shape[0] == 1 for k in state.keys)
    # stages own different W_kv, so their rings differ
    assert not torch.allclose(ingested(setup).keys[0], ingested(setup).keys[1])


def test_qat_ring_is_fp8_fake_quant_of_plain_ring(setup):
    plain, qat = ingested(setup, qat=False), ingested(setup, qat=True)
    for a, b in zip(plain.keys, qat.keys):
        assert torch.equal(fake_quant_fp8_pow2(a, 32), b) and not torch.equal(a, b)


@pytest.mark.parametrize("qat", [False, True])
def test_chunked_ingest_matches_one_shot(setup, qat):
    one, chunked = ingested(setup, qat=qat), ingested(setup, chunks=(1, 30, T), qat=qat)
    for (k1, p1), (k2, p2) in zip(snapshot(one), snapshot(chunked)):
        assert torch.equal(p1, p2)
        torch.testing.assert_close(k1, k2, rtol=0, atol=1e-5)
    a, b = propose(setup, one, qat=qat), propose(setup, chunked, qat=qat)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[2], b[2], rtol=1e-5, atol=1e-4)


def test_propose_leaves_state_unchanged_and_checks_inputs(setup):
    state = ingested(setup)
    before, objs = snapshot(state), (list(state.keys), list(state.positions))
    propose(setup, state)
    after = snapshot(state)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))
    assert all(x is y for x, y in zip(objs[0] + objs[1], state.keys + state.positions))
    with pytest.raises(ValueError):
        propose(setup, state, p=T - 2)  # p must be the last ingested (committed) position
    cfg, model, taps, pos, _ = setup
    with pytest.raises(ValueError):
        model.mtp.ingest({k: v[-1:] for k, v in taps.items()}, pos[-1:], state)  # position already ingested


# ------------------------------------------------------------------ dense reference from the spec
def ref_rms(x, g, eps):
    return g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_rope(v, p, rd, theta, sign=1.0):
    """Rotate the last rd channels of v [..., D] as adjacent pairs (2k, 2k+1) by sign * p * theta^(-2k/rd)."""
    v = v.clone()
    for k in range(rd // 2):
        ang = sign * p * theta ** (-2 * k / rd)
        c, s = math.cos(ang), math.sin(ang)
        i, j = v.shape[-1] - rd + 2 * k, v.shape[-1] - rd + 2 * k + 1
        a, b = v[..., i].clone(), v[..., j].clone()
        v[..., i], v[..., j] = a * c - b * s, a * s + b * c
    return v


def ref_draft_attention(cfg, mtp, stage, taps, x, p):
    """Stage attention for block rows x [B, d] at positions p+1..p+B, written from spec 2.3 / 2.10 (qat off)."""
    at, eps, rd, th = stage.attn, cfg.rms_norm_eps, cfg.qk_rope_head_dim, cfg.rope_theta
    H, D, G, W = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.sliding_window
    # ring: c_s for committed s in [max(0, p-W+1), p], from taps -> m_s (spec 2.10 ingestion)
    keys = []
    for s in range(max(0, p - W + 1), p + 1):
        cat = torch.cat([taps[layer][s] for layer in cfg.dspark_target_layer_ids])
        m = ref_rms(mtp[0].main_proj.weight @ cat, mtp[0].main_norm.weight, eps)
        keys.append(ref_rope(ref_rms(at.wkv.weight @ m, at.kv_norm.weight, eps), s, rd, th))
    rows = []
    for i in range(x.shape[0]):  # the block rows' own c: all mutually visible
        keys.append(ref_rope(ref_rms(at.wkv.weight @ x[i], at.kv_norm.weight, eps), p + 1 + i, rd, th))
    K = torch.stack(keys)
    for t in range(x.shape[0]):
        q_lat = ref_rms(at.wq_a.weight @ x[t], at.q_norm.weight, eps)
        q = (at.wq_b.weight @ q_lat).view(H, D)
        heads = []
        for h in range(H):
            qh = ref_rope(q[h], p + 1 + t, rd, th)
            logit = (K @ qh) / math.sqrt(D)
            mx = logit.max()
            e = torch.exp(logit - mx)
            prob = e / (e.sum() + torch.exp(at.attn_sink[h] - mx))
            heads.append(ref_rope(prob @ K, p + 1 + t, rd, th, sign=-1.0))
        per_group = H // G
        wo_a = at.wo_a.weight.view(G, cfg.o_lora_rank, per_group * D)
        u = [wo_a[g] @ torch.cat(heads[g * per_group : (g + 1) * per_group]) for g in range(G)]
        rows.append(at.wo_b.weight @ torch.cat(u))
    return torch.stack(rows)


@pytest.mark.parametrize("n", [T, 10])
def test_draft_attention_matches_dense_reference(setup, n):
    cfg, model, taps, _, y = setup
    state = ingested(setup, chunks=(3, n), n=n, qat=False)
    captured = {}
    hooks = []
    for i, stage in enumerate(model.mtp):
        hooks.append(
            stage.attn.register_forward_hook(
                lambda mod, args, out, i=i: captured.__setitem__(i, (args[0].clone(), out.clone()))
            )
        )
    try:
        propose(setup, state, p=n - 1, qat=False)
    finally:
        for h in hooks:
            h.remove()
    assert sorted(captured) == list(range(cfg.num_draft_layers))
    # stage 0's attention input: identical copies collapsed with onehot(0) = the embedding, then attn_norm
    ids = torch.tensor([y] + [cfg.dspark_noise_token_id] * (cfg.dspark_block_size - 1))
    x0 = ref_rms(model.embed.weight[ids], model.mtp[0].attn_norm.weight, cfg.rms_norm_eps)
    torch.testing.assert_close(captured[0][0], x0, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for i, stage in enumerate(model.mtp):
            x, out = captured[i]
            torch.testing.assert_close(
                out, ref_draft_attention(cfg, model.mtp, stage, taps, x, n - 1), rtol=1e-4, atol=1e-4
            )


def test_markov_head_is_sequential_and_confidence(setup):
    cfg, model, _, _, y = setup
    last = model.mtp[-1]
    got = {}
    hook = last.norm.register_forward_hook(lambda mod, args, out: got.__setitem__("h", args[0].clone()))
    try:
        ids, conf, logits = propose(setup, ingested(setup))
    finally:
        hook.remove()
    with torch.no_grad():
        base = model.head(last.norm(got["h"])).float()
        prev = torch.cat((torch.tensor([y]), ids[:-1]))  # prev_0 = y, prev_i = draft_{i-1}
        e = last.markov_head.embed(prev)
        torch.testing.assert_close(logits, base + last.markov_head.head(e), rtol=1e-5, atol=1e-5)
        kappa = torch.cat((got["h"], e), dim=-1) @ last.confidence_head.proj.weight[0]
        torch.testing.assert_close(conf, kappa, rtol=1e-5, atol=1e-5)
        # Force a different draft_0 by steering E_m[y] towards token z: U_1 must move by W_mh (E_m[z] - E_m[d0]).
        z = int((ids[0] + 1) % cfg.vocab_size)
        z = z if z != y else (z + 1) % cfg.vocab_size
        saved = last.markov_head.embed.weight[y].clone()
        last.markov_head.embed.weight[y] = 1000.0 * last.markov_head.head.weight[z]
        try:
            ids2, _, logits2 = propose(setup, ingested(setup))
        finally:
            last.markov_head.embed.weight[y] = saved
        assert int(ids2[0]) == z
        delta = last.markov_head.head(last.markov_head.embed(torch.tensor([z, int(ids[0])])))
        torch.testing.assert_close(logits2[1] - logits[1], delta[0] - delta[1], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(logits2[1], logits[1])


# ------------------------------------------------------------------ batched ingestion (the drafter's)
def ring_by_definition(model, taps, positions, qat):
    """Each stage's ring after ingesting rows at ``positions`` [n] from ``taps`` (layer -> [n, d]), one stage at a
    time as ``ingest`` did before it batched the stages: m = main_norm(main_proj(taps)), then
    ``stage.attn.window_entry(m)`` per stage, of the last W rows."""
    cfg, w = model.cfg, model.cfg.sliding_window
    x = torch.cat([taps[layer][-w:] for layer in cfg.dspark_target_layer_ids], dim=-1)
    m = model.mtp[0].main_norm(model.mtp[0].main_proj(x))
    return [stage.attn.window_entry(m, positions[-w:], qat) for stage in model.mtp], positions[-w:]


@pytest.mark.parametrize("qat", [False, True])
def test_ingest_spans_matches_one_stage_and_one_sequence_at_a_time(tiny_models, qat):
    """``DSpark.ingest_spans`` (every sequence's rows and every stage in one pass) leaves each ring as ``ingest`` of
    that sequence alone, and as the per-stage definition: spans of 0, 1, a few and more than W rows, some onto rings
    that already hold rows, taken from anywhere in the taps."""
    model = tiny_models["tiny"]
    cfg, w = model.cfg, model.cfg.sliding_window
    gen = torch.Generator().manual_seed(3)
    total = 3 * w + 20
    taps = {
        layer: torch.randn(total, cfg.hidden_size, generator=gen, dtype=torch.float64)
        for layer in cfg.dspark_target_layer_ids
    }
    # (rows already ingested, rows added by the spans) per sequence; each sequence's taps are its own rows of taps
    plan = [(0, 1), (5, 3), (0, w + 7), (w + 2, 2), (3, 0), (0, 4)]
    with torch.no_grad():
        batched, alone, spans, row = [], [], [], 0
        for before, n in plan:
            seq = {k: v[row : row + before + n] for k, v in taps.items()}
            a, b = model.mtp.new_state(), model.mtp.new_state()
            if before:
                for st in (a, b):
                    model.mtp.ingest({k: v[:before] for k, v in seq.items()}, torch.arange(before), st, qat=qat)
            spans.append((a, slice(row + before, row + before + n), before))
            if n:
                model.mtp.ingest({k: v[before:] for k, v in seq.items()}, torch.arange(before, before + n), b, qat=qat)
            batched.append(a)
            alone.append((b, seq, before + n))
            row += before + n
        model.mtp.ingest_spans(taps, spans, qat=qat)
        for a, (b, seq, n) in zip(batched, alone):
            assert a.last_position == b.last_position == n - 1
            if n == 0:
                assert a.keys[0] is None
                continue
            want, want_pos = ring_by_definition(model, seq, torch.arange(n), qat)
            for s in range(cfg.num_draft_layers):
                assert torch.equal(a.positions[s], want_pos) and torch.equal(b.positions[s], want_pos)
                torch.testing.assert_close(a.keys[s], want[s], rtol=0, atol=1e-12)
                torch.testing.assert_close(b.keys[s], want[s], rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="positions after"):
            model.mtp.ingest_spans(taps, [(batched[0], slice(0, 1), 0)])  # position 0 is already in the ring


@pytest.mark.parametrize("qat", [False, True])
def test_draft_query_and_entry_are_query_and_window_entry(setup, qat):
    """``DraftAttention.query_and_entry`` (one RoPE pass over q and the own rows) is ``query`` and ``window_entry``."""
    cfg, model = setup[0], setup[1]
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(40, 47)
    with torch.no_grad():
        for stage in model.mtp:
            q, own = stage.attn.query_and_entry(x, pos, qat)
            assert torch.equal(q, stage.attn.query(x, pos)[1])
            assert torch.equal(own, stage.attn.window_entry(x, pos, qat))


def test_propose_fixed_hides_padding_and_stale_slots_whatever_they_hold(tiny_models):
    """``DSpark.propose_fixed`` over hand-made ``RingWindows``: each block's ring rows scattered among slots of
    padding (-1) and of stale positions (before the window, or past p), those slots holding large random keys, gives
    ``propose``'s drafts and confidences for the ring alone."""
    from dsserve.models.dspark import RingWindows

    model = tiny_models["tiny"]
    cfg, w, s = model.cfg, model.cfg.sliding_window, model.cfg.num_draft_layers
    gen = torch.Generator().manual_seed(7)
    blocks = [(5, w + 8), (w, w + 20), (1, 0)]  # (ring rows, committed position p)
    keys = 1e3 * torch.randn(len(blocks), w, s, cfg.head_dim, generator=gen, dtype=torch.float64)
    tags = torch.full((len(blocks), w), -1, dtype=torch.long)
    states, ys = [], []
    with torch.no_grad():
        for i, (n, p) in enumerate(blocks):
            st = model.mtp.new_state()
            taps = {
                layer: torch.randn(n, cfg.hidden_size, generator=gen, dtype=torch.float64)
                for layer in cfg.dspark_target_layer_ids
            }
            model.mtp.ingest(taps, torch.arange(p - n + 1, p + 1), st)
            k, pos = st.ring
            slots = torch.randperm(w, generator=gen)[:n].sort().values
            keys[i, slots], tags[i, slots] = k, pos
            free = torch.ones(w, dtype=torch.bool)
            free[slots] = False
            stale = torch.tensor([p - w - 3, p + 2, p + 9])  # before the window, past p
            at = free.nonzero()[: len(stale), 0]
            tags[i, at] = stale[: len(at)]
            states.append(st)
            ys.append(int(torch.randint(3, cfg.vocab_size, (1,), generator=gen)))
        committed = torch.tensor([p for _, p in blocks])
        drafts, conf = model.mtp.propose_fixed(
            torch.tensor(ys), RingWindows(keys, tags, committed), model.embed, model.head
        )
        for i, (st, (_, p)) in enumerate(zip(states, blocks)):
            d, c, _ = model.mtp.propose(ys[i], p, st, model.embed, model.head)
            assert drafts[i].tolist() == d.tolist()
            torch.testing.assert_close(conf[i], c, rtol=0, atol=1e-9)
