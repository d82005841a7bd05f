"""banded_attention_with_sink (the training step's one-shape attention) equals sparse_attention_with_sink (the loop's)
sequence by sequence: a window read in blocks against the [L, L] masked square, with a sequence's entries, each row's
own entries, or none; lengths shorter than the window, a multiple of it, and neither."""

import pytest
import torch

from dsserve.layers.attention import banded_attention_with_sink, sparse_attention_with_sink


@pytest.mark.parametrize("n,window", [(1, 4), (3, 4), (8, 4), (13, 4), (29, 8)])
@pytest.mark.parametrize("entries", ["none", "sequence", "rows"])
def test_banded_equals_the_masked_square(n, window, entries):
    g = torch.Generator().manual_seed(n * 10 + window)
    s, h, d, m = 3, 2, 8, 5
    q, keys = (
        torch.randn(s, n, h, d, generator=g, dtype=torch.float64),
        torch.randn(s, n, d, generator=g, dtype=torch.float64),
    )
    sink, pos = torch.randn(h, generator=g, dtype=torch.float64), torch.arange(n)
    square = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    ent = mask = None
    if entries == "sequence":
        ent, mask = torch.randn(s, m, d, generator=g, dtype=torch.float64), torch.rand(n, m, generator=g) < 0.6
    elif entries == "rows":
        ent, mask = torch.randn(s, n, m, d, generator=g, dtype=torch.float64), torch.rand(s, n, m, generator=g) < 0.6
    got = banded_attention_with_sink(q, keys, window, ent, mask, sink, 0.3)
    for i in range(s):
        win_k, win_mask, sel_k, sel_mask = keys[i], square, None, None
        if entries == "sequence":
            win_k, win_mask = torch.cat((keys[i], ent[i])), torch.cat((square, mask), 1)
        elif entries == "rows":
            sel_k, sel_mask = ent[i], mask[i]
        want = sparse_attention_with_sink(q[i], win_k, win_mask, sel_k, sel_mask, sink, 0.3)
        assert torch.allclose(got[i], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,window", [(13, 4), (29, 8)])
@pytest.mark.parametrize("entries", ["none", "sequence"])
def test_packed_problems_read_only_themselves(n, window, entries):
    """With ``first`` (each row's packed problem's first row) the window and a sequence's entries stop there: the
    masked square with the problem's lower bound added."""
    g = torch.Generator().manual_seed(n + window)
    s, h, d, m = 2, 2, 8, 6
    q, keys = (
        torch.randn(s, n, h, d, generator=g, dtype=torch.float64),
        torch.randn(s, n, d, generator=g, dtype=torch.float64),
    )
    sink, pos = torch.randn(h, generator=g, dtype=torch.float64), torch.arange(n)
    starts = [(0, 5, 6, 11), (0, 2, 9)]
    first = torch.stack([torch.tensor([max(b for b in st if b <= t) for t in range(n)]) for st in starts])
    ent = mask = None
    if entries == "sequence":  # entry j belongs to row 2j's problem, mask per sequence and row
        ent = torch.randn(s, m, d, generator=g, dtype=torch.float64)
        mask = (torch.rand(s, n, m, generator=g) < 0.7) & (2 * torch.arange(m)[None, None, :] >= first[..., None])
    got = banded_attention_with_sink(q, keys, window, ent, mask, sink, 0.3, first)
    for i in range(s):
        square = (
            (pos[None, :] <= pos[:, None])
            & (pos[None, :] > pos[:, None] - window)
            & (pos[None, :] >= first[i][:, None])
        )
        win_k, win_mask = keys[i], square
        if entries == "sequence":
            win_k, win_mask = torch.cat((keys[i], ent[i])), torch.cat((square, mask[i]), 1)
        want = sparse_attention_with_sink(q[i], win_k, win_mask, None, None, sink, 0.3)
        assert torch.allclose(got[i], want, rtol=1e-12, atol=1e-12)
    unbounded = banded_attention_with_sink(q, keys, window, ent, mask, sink, 0.3)
    assert not torch.allclose(got, unbounded)  # the bound matters on these shapes
