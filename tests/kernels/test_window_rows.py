"""dsserve.kernels.window_rows against its torch reference (bitwise: integer ops only).

CPU: the Triton interpreter on tiny batches. GPU: decode batches of the release window."""

import pytest
import torch

from dsserve.kernels.window_rows import window_rows, window_rows_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(t, w, seed, device="cpu"):
    """A ring of 6 slots x w rows (+ the spare element); row i's window q = p-w+1..p in slot s: the ring rows
    hold q (a match), an older position (q - w: overwritten) or nothing (-1); rows -1 where q < 0."""
    g = torch.Generator().manual_seed(seed)
    slots = 6
    p = torch.randint(0, 3 * w, (t,), generator=g)
    s = torch.randint(0, slots, (t,), generator=g)
    q = p[:, None] - (w - 1) + torch.arange(w)[None, :]
    tag_at = s[:, None] * w + q.clamp_min(0) % w
    rows = torch.where(q >= 0, tag_at, -1).to(torch.int32)
    tags = torch.full((slots * w + 1,), -1, dtype=torch.long)
    pick = torch.randint(0, 3, tag_at.shape, generator=g)
    tags[tag_at.view(-1)] = torch.where(pick == 0, q, torch.where(pick == 1, q - w, -1)).view(-1)
    return [x.to(device) for x in (tags, tag_at, q, rows)]


def _check_all(t, w, seed, device):
    args = _inputs(t, w, seed, device)
    torch.full((t * w,), 12345, dtype=torch.int32, device=device)  # freed: on CUDA the output's block is poisoned
    out, ref = window_rows(*args), window_rows_ref(*args)
    assert out.shape == (t, w) and out.dtype == torch.int32 and torch.equal(out, ref)
    return out


@pytest.mark.parametrize("t,w", [(1, 8), (9, 8), (4, 32), (1, 128), (9, 128)])
def test_matches_ref_interpreted(t, w):
    out = _check_all(t, w, seed=t * w, device="cpu")
    if t > 1:  # both outcomes occur
        assert (out >= 0).any() and (out == -1).any()


def test_bad_input_is_named():
    tags = torch.zeros(9, dtype=torch.long)
    at, q = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    rows = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="tags"):
        window_rows(tags.int(), at, q, rows)
    with pytest.raises(ValueError, match="tags"):
        window_rows(tags.view(3, 3), at, q, rows)
    with pytest.raises(ValueError, match="tag_at"):
        window_rows(tags, at.int(), q, rows)
    with pytest.raises(ValueError, match="q"):
        window_rows(tags, at, q[:, :2], rows)
    with pytest.raises(ValueError, match="rows"):
        window_rows(tags, at, q, rows.long())
    assert window_rows(tags, at[:0], q[:0], rows[:0]).shape == (0, 4)


@needs_cuda
@pytest.mark.parametrize("t", [1, 32, 128])
def test_release_window(t):
    out = _check_all(t, 128, seed=t, device="cuda")
    assert (out >= 0).any()
