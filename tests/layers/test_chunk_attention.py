"""chunk_attention_with_sink (the reference loop's attention of one sequence's rows) equals sparse_attention_with_sink
over the masked square of the same keys: a long chunk read in blocks, with its cached window rows (none, a sequence
shorter than the window, a paged ring in ring order with empty rows), each row's selected entries (some masked, or
none) or the dense mode's entries; a short chunk takes the square itself."""

import pytest
import torch

from dsserve.layers import attention
from dsserve.layers.attention import chunk_attention_with_sink, sparse_attention_with_sink

W, H, D, K, N = 8, 2, 8, 5, 12  # banded above BANDED_FROM_WINDOWS * W = 32 rows
SCALE = 0.3


def square(q, kv, pos, old_k, old_p, entries, seen, sel_k, sel_mask, sink):
    """The loop's inputs before banding: every key of the window beside the chunk's, one [T, n + T (+ N)] mask."""
    keys, key_pos = kv, pos
    if old_k is not None:
        keys, key_pos = torch.cat((old_k, kv)), torch.cat((old_p, pos))
    k, p = key_pos[None, :], pos[:, None]
    mask = (k <= p) & (k > p - W) & (k >= 0)
    if entries is not None:
        keys, mask = torch.cat((keys, entries)), torch.cat((mask, seen), 1)
    return sparse_attention_with_sink(q, keys, mask, sel_k, sel_mask, sink, SCALE)


def history(kind, start, g):
    """(rows [n, D], positions [n]) cached before a chunk at ``start``, as a cache would hand them over."""
    if kind == "none":
        return None, None
    if kind == "short":  # a SequenceCache of a sequence shorter than the window: its rows, oldest first
        n = min(start, W - 3)
        return torch.randn(n, D, generator=g, dtype=torch.float64), torch.arange(start - n, start)
    # a paged ring: W slots, row at position p in slot p % W; "ring" has empty slots (-1), "full" none
    live = min(start, W - 3) if kind == "ring" else W
    slot_pos = torch.full((W,), -1)
    for p in range(start - live, start):
        slot_pos[p % W] = p
    return torch.randn(W, D, generator=g, dtype=torch.float64), slot_pos


def inputs(t, start, hist, reads, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(t, D, generator=g, dtype=torch.float64)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    pos = torch.arange(start, start + t)
    old_k, old_p = history(hist, start, g)
    entries = seen = sel_k = sel_mask = None
    if reads == "selected":
        sel_k = torch.randn(t, K, D, generator=g, dtype=torch.float64)
        sel_mask = torch.rand(t, K, generator=g) < 0.6
    elif reads == "dense":  # every entry visible to a row at or past its ratio-2 group
        entries = torch.randn(N, D, generator=g, dtype=torch.float64)
        seen = torch.arange(N)[None, :] < torch.div(pos + 1, 2, rounding_mode="floor")[:, None]
    return q, kv, pos, old_k, old_p, entries, seen, sel_k, sel_mask, sink


@pytest.mark.parametrize("t", [33, 100])  # just above the threshold, well above; neither a multiple of W
@pytest.mark.parametrize("hist", ["none", "short", "ring", "full"])
@pytest.mark.parametrize("reads", ["selected", "none", "dense"])
def test_long_chunk_equals_the_masked_square(t, hist, reads):
    assert t > attention.BANDED_FROM_WINDOWS * W
    start = {"none": 0, "short": 5, "ring": 5, "full": 37}[hist]  # "ring": empty slots a row near 0 would not mask
    args = inputs(t, start, hist, reads, seed=t + len(hist) * 7 + len(reads))
    got = chunk_attention_with_sink(*args[:-1], args[-1], SCALE, W)
    want = square(*args)
    assert got.shape == (t, H, D)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_long_chunk_reads_stale_ring_rows_as_the_square_does():
    """Cached rows need not be the contiguous positions right before the chunk: a ring holding rows at and past the
    chunk's start (a step not rolled back) and a gap is read under each row's own mask, as the square reads it."""
    args = list(inputs(50, 40, "full", "selected", seed=3))
    args[4] = torch.tensor([41, 33, 34, -1, 36, 45, 38, 39])  # 41 and 45: positions inside the chunk; 35, 37 gone
    got = chunk_attention_with_sink(*args[:-1], args[-1], SCALE, W)
    assert torch.allclose(got, square(*args), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t", [1, 7, 32])
def test_short_chunk_takes_the_square(t, monkeypatch):
    """Decode and verify steps and chunks up to the threshold run sparse_attention_with_sink itself."""
    args = inputs(t, 37, "ring", "selected", seed=t)
    calls = []
    monkeypatch.setattr(attention, "banded_attention_with_sink", lambda *a, **k: calls.append(a))
    got = chunk_attention_with_sink(*args[:-1], args[-1], SCALE, W)
    assert not calls
    assert torch.equal(got, square(*args))
