import itertools
import time

import numpy as np
import pytest
import torch

from dsserve.layers import engram_hash as eh
from dsserve.layers.engram_hash import (
    DEAD,
    EngramHasher,
    engram_offsets,
    engram_primes,
    engram_rows_per_layer,
    hash_multipliers,
)
from dsserve.models.presets import preset


def _slow_prime(n):
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


@pytest.mark.parametrize(
    "name,rows",
    [
        ("v41-flash", {1: 384_006_168, 14: 384_016_682}),
        ("tiny", {1: 49_796, 4: 50_980}),
        ("proxy-h200", {1: 6_294_996, 14: 6_302_196}),
    ],
)
def test_rows_per_layer(name, rows):
    assert engram_rows_per_layer(preset(name)) == rows


def test_prime_rule_smallest_unused_above_start():
    cfg = preset("tiny")
    primes = engram_primes(cfg)
    flat = [p for layer in cfg.engram_layer_ids for p in primes[layer]]
    assert len(flat) == len(set(flat)) == 2 * cfg.engram_columns
    # drawn in order layer -> order -> head, so the concatenation is exactly the consecutive primes > vocab - 1
    expected, c = [], cfg.engram_vocab_size - 1
    while len(expected) < len(flat):
        c += 1
        if _slow_prime(c):
            expected.append(c)
    assert flat == expected
    assert engram_primes(preset("v41-flash"))[1][:3] == [16_000_057, 16_000_079, 16_000_081]


def test_offsets_are_running_sums():
    cfg = preset("v41-flash")
    for layer, primes in engram_primes(cfg).items():
        offs = engram_offsets(cfg)[layer]
        assert offs[0] == 0 and offs[-1] + primes[-1] == engram_rows_per_layer(cfg)[layer]
        assert all(offs[i + 1] - offs[i] == primes[i] for i in range(len(primes) - 1))


def test_primes_fast():
    eh._prime_layout.cache_clear()
    t = time.perf_counter()
    engram_primes(preset("v41-flash"))
    assert time.perf_counter() - t < 0.5


def test_multipliers_match_spec():
    assert hash_multipliers(1, 99092, 4) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert hash_multipliers(14, 99092, 4) == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    bound = (2**63 - 1) // 99092 // 2
    assert all(m % 2 == 1 and m < 2 * bound for m in hash_multipliers(14, 99092, 4))


# ------------------------------------------------------------------ scalar reference


def _wrap(x):
    return ((x + 2**63) % 2**64) - 2**63


def _ref_rows(h, seq, pos):
    """Plain-int rolling hash for position `pos` of `seq` (seq[j] < -1 never occurs; index < 0 = before start)."""
    blocked, r, out = False, 0, []
    for s, m in enumerate(h.multipliers):
        p = pos - s
        src = seq[p] if p >= 0 else None
        blocked = blocked or p < 0 or src == DEAD
        v = h.pad_id if blocked else src
        r = _wrap(r ^ _wrap(v * m))
        if s >= 1:
            for hd in range(h.n_heads):
                c = (s - 1) * h.n_heads + hd
                out.append(r % h.primes[c] + h.offsets[c])
    return out


@pytest.mark.parametrize("name,layer", [("tiny", 1), ("tiny", 4), ("v41-flash", 14)])
def test_vectorised_matches_scalar_reference(name, layer):
    cfg = preset(name)
    h = EngramHasher(cfg, layer)
    g = torch.Generator().manual_seed(layer)
    for hist_len in (0, 1, 2, 3, 5):
        seq = torch.randint(0, cfg.engram_compressed_vocab_size, (hist_len + 40,), generator=g)
        seq[torch.rand(seq.shape, generator=g) < 0.1] = DEAD
        got = h.rows(seq[hist_len:], seq[:hist_len])
        assert got.shape == (40, cfg.engram_columns) and got.dtype == torch.int64
        ref = [_ref_rows(h, seq.tolist(), hist_len + t) for t in range(40)]
        assert got.tolist() == ref
        assert (got >= 0).all() and (got < h.num_rows).all()
        offs, primes = torch.tensor(h.offsets), torch.tensor(h.primes)
        assert ((got >= offs) & (got < offs + primes)).all()


def test_int64_wraparound_matches_reference():
    h = EngramHasher(preset("tiny"), 1)
    seq = torch.tensor([2**62 - 7, 2**61 + 3, 2**62 + 12345, 2**40 + 1, 3, 2**62 - 1], dtype=torch.int64)
    got = h.rows(seq, check=False)
    assert got.tolist() == [_ref_rows(h, seq.tolist(), t) for t in range(len(seq))]
    with pytest.raises(ValueError):
        h.rows(seq)


def test_chunk_split_invariance():
    cfg = preset("v41-flash")
    h = EngramHasher(cfg, 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.engram_compressed_vocab_size, (97,), generator=g)
    ids[[10, 11, 50]] = DEAD
    full = h.rows(ids)
    for cuts in ([1], [2, 3], [5, 11, 12, 13, 60], list(range(1, 97))):
        hist, parts = None, []
        for a, b in zip([0] + cuts, cuts + [97]):
            parts.append(h.rows(ids[a:b], hist))
            hist = h.next_history(hist, ids[a:b])
            assert hist.numel() <= 3
        assert torch.equal(torch.cat(parts), full)


def test_sticky_dead_blocking_equals_sequence_start():
    h = EngramHasher(preset("tiny"), 4)
    b, c, d = 100, 200, 300
    for x in (7, 8000):
        rows = h.rows(torch.tensor([x, DEAD, b, c, d]))
        # position 3 (c): lookbacks c, b, DEAD -> blocked, x ignored although it is a real token
        assert torch.equal(rows[3], h.rows(torch.tensor([b, c]))[1])
        # position 4: c, b then DEAD at lookback 3
        assert torch.equal(rows[4], h.rows(torch.tensor([b, c, d]))[2])
    # DEAD carried in the history blocks exactly the same way
    assert torch.equal(h.rows(torch.tensor([c]), torch.tensor([5, DEAD, b])), h.rows(torch.tensor([b, c]))[1:])
    # a DEAD token itself hashes as all-pad and is flagged for gate 0
    ids = torch.tensor([b, DEAD, c])
    assert h.is_dead(ids).tolist() == [False, True, False]
    pad_row = h.rows(torch.tensor([h.pad_id]))[0]
    assert torch.equal(h.rows(ids)[1], pad_row)


def test_not_an_engram_layer():
    with pytest.raises(ValueError):
        EngramHasher(preset("tiny"), 0)


def test_batch_of_histories_independent_of_context_before_history():
    h = EngramHasher(preset("tiny"), 1)
    ids = torch.tensor(np.arange(10, 20))
    assert torch.equal(h.rows(ids, torch.tensor([1, 2, 3])), h.rows(ids, torch.tensor([9, 9, 1, 2, 3])))
    assert not torch.equal(h.rows(ids, torch.tensor([1, 2, 3]))[:3], h.rows(ids, torch.tensor([2, 3]))[:3])


def test_rows_of_seqs_equals_hashing_each_sequence():
    """The batched form (one pass over every sequence of a step) against rows() per sequence: ragged lengths,
    histories of 0 to more than max_ngram - 1 ids (or None), DEAD ids inside rows and histories."""
    cfg = preset("v41-flash")
    h = EngramHasher(cfg, 14)
    g = torch.Generator().manual_seed(3)
    lens, hist_lens = [1, 5, 1, 17, 2, 1, 9], [None, 0, 1, 2, 3, 6, 3]
    ids = torch.randint(0, cfg.engram_compressed_vocab_size, (sum(lens),), generator=g)
    ids[[3, 4, 20]] = DEAD
    seq_rows, hists, start = [], [], 0
    for n, m in zip(lens, hist_lens):
        seq_rows.append(slice(start, start + n))
        start += n
        hist = None if m is None else torch.randint(0, cfg.engram_compressed_vocab_size, (m,), generator=g)
        if m and m > 2:
            hist[-2] = DEAD
        hists.append(hist)
    want = torch.cat([h.rows(ids[r], hi) for r, hi in zip(seq_rows, hists)])
    assert torch.equal(h.rows_of_seqs(ids, seq_rows, hists), want)
    assert h.rows_of_seqs(ids, [], []).shape == (0, h.columns)
    with pytest.raises(ValueError, match="compressed ids must lie in"):
        h.rows_of_seqs(ids, seq_rows[:2], [torch.tensor([cfg.engram_compressed_vocab_size]), None])


def test_lookbacks_of_full_and_short_histories():
    """A decode step's lookbacks: column s is the id s tokens back (-2 before the start), whether every history is
    full (one stacked copy) or some are short (per row)."""
    cfg = preset("tiny")
    h = EngramHasher(cfg, cfg.engram_layer_ids[0])
    k = h.max_ngram - 1
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 100, (4,), generator=g)
    full = [torch.randint(0, 100, (k + 2,), generator=g) for _ in range(4)]
    short = full[:2] + [full[2][:1], full[3][:0]]
    for hist in (full, short, full[:3]):  # the last: row 3 has no history, so it starts its sequence
        src = h.lookbacks(ids, hist)
        assert src.shape == (4, k + 1)
        for t in range(4):
            ht = hist[t] if t < len(hist) else ids[:0]
            want = [int(ids[t])] + [int(ht[-s]) if s <= min(k, ht.numel()) else -2 for s in range(1, k + 1)]
            assert src[t].tolist() == want


def test_reach_hashes_each_packed_problem_as_a_sequence_of_its_own():
    """Training's packed problems: with ``reach`` (how far back each row may look) one sequence of three problems
    hashes as the three hashed apart; without it, the rows after a problem's start differ."""
    cfg = preset("tiny")
    h = EngramHasher(cfg, cfg.engram_layer_ids[0])
    g = torch.Generator().manual_seed(4)
    starts, n = (0, 5, 6, 14), 20
    ids = torch.randint(0, cfg.engram_compressed_vocab_size, (n,), generator=g)
    bounds = list(starts) + [n]
    want = torch.cat([h.rows(ids[a:b]) for a, b in itertools.pairwise(bounds)])
    reach = torch.tensor([t - max(s for s in starts if s <= t) for t in range(n)])
    assert torch.equal(h.rows_of_seqs(ids, [slice(0, n)], [None], reach=reach), want)
    assert not torch.equal(h.rows_of_seqs(ids, [slice(0, n)], [None]), want)
