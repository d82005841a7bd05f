"""dsserve.kernels.engram_rows against EngramHasher.rows_of_lookbacks and its copy engram_rows_ref (exact).

CPU: the Triton interpreter on the tiny and v41-flash hashers' constants, random ids with dead (-1) and before-start
(-2) marks in every column, T 1..33; constants with multipliers near 2^62 so hashes wrap negative (floor vs C mod).
GPU: the same on CUDA, a CUDA-graph replay with refilled lookbacks and a poisoned output, and a prefill-sized T."""

import pytest
import torch

from dsserve.kernels.engram_rows import engram_rows, engram_rows_ref
from dsserve.layers.engram_hash import DEAD, EngramHasher
from dsserve.models.presets import preset

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _hashers(names=("tiny", "v41-flash"), pad_id=None):
    out = []
    for name in names:
        cfg = preset(name)
        out += [EngramHasher(cfg, layer, pad_id) for layer in cfg.engram_layer_ids]
    return out


def _src(h: EngramHasher, t: int, seed: int, device="cpu", high=None) -> torch.Tensor:
    """[t, max_ngram] ids in [0, high) with -1 / -2 sprinkled over every column (column 0 included)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, high or h.compressed_vocab_size, (t, h.max_ngram), generator=g)
    marks = torch.rand(t, h.max_ngram, generator=g)
    src[marks < 0.12] = DEAD
    src[(marks >= 0.12) & (marks < 0.2)] = -2
    return src.to(device)


def _check(h: EngramHasher, src: torch.Tensor) -> torch.Tensor:
    mult, primes, offs = h.constants(src.device)
    out = engram_rows(src, mult, primes, offs, h.pad_id)
    want = h.rows_of_lookbacks(src)
    assert out.shape == want.shape == (src.shape[0], h.columns) and out.dtype == torch.int64
    assert torch.equal(out, want)
    assert torch.equal(engram_rows_ref(src, mult, primes, offs, h.pad_id), want)
    return out


@pytest.mark.parametrize("h", _hashers(), ids=lambda h: f"{h.n_heads}h-layer{h.layer_id}")
def test_matches_hasher(h):
    for t in (1, 2, 7, 16, 17, 33):
        out = _check(h, _src(h, t, seed=100 * h.layer_id + t))
        assert (out >= 0).all() and (out < h.num_rows).all()
    # a row blocked from column 0 on hashes pad ids only: every such row is the same
    src = _src(h, 5, 1)
    src[:, 0] = DEAD
    out = _check(h, src)
    assert (out == out[:1]).all()


def test_decode_lookbacks_and_strides():
    """src built as forward_decode does (lookbacks of histories of every length, a cat), and a strided view."""
    h = _hashers(("tiny",))[0]
    g = torch.Generator().manual_seed(3)
    hist = [torch.randint(-1, h.compressed_vocab_size, (n,), generator=g) for n in (0, 1, 2, 3, 5, 0, 4)]
    back = h.lookbacks(torch.zeros(len(hist), dtype=torch.long), hist)[:, 1:]
    ids = torch.randint(-1, h.compressed_vocab_size, (len(hist),), generator=g)
    _check(h, torch.cat([ids[:, None], back], 1))
    wide = _src(h, 9, 4).repeat(1, 2)[::2, 1 : 1 + h.max_ngram]  # strides (2 * 2 * max_ngram, 1)
    assert not wide.is_contiguous()
    _check(h, wide)
    # pad id 1 (an int argument Triton specialises as a constant) and one that is not a small int
    for pad in (1, 2**40 + 7):
        hp = EngramHasher(preset("tiny"), h.layer_id, pad_id=pad)
        _check(hp, _src(hp, 6, 5))
    assert engram_rows(_src(h, 1, 0)[:0], *h.constants("cpu"), h.pad_id).shape == (0, h.columns)


def test_wrapped_negative_hashes_floor_mod():
    """Multipliers near 2^62 and ids up to 2^20: products wrap and XORs go negative; torch floors, C truncates."""
    g = torch.Generator().manual_seed(7)
    for h in _hashers():
        mult = torch.randint(2**61, 2**62, (h.max_ngram,), generator=g) * 2 + 1
        h._dev["cpu"] = (mult, *h.constants("cpu")[1:])  # the hasher now hashes with these
        src = _src(h, 33, h.layer_id, high=2**20)
        out = _check(h, src)
        assert (out >= torch.tensor(h.offsets)).all()
        # the test can fail: C-style remainders would differ somewhere
        v = torch.where(torch.cumsum((src < 0).long(), 1) > 0, h.pad_id, src) * mult
        r = v[:, 0] ^ v[:, 1]
        assert (r < 0).any()
        p = h.constants("cpu")[1][0]
        assert not torch.equal(torch.fmod(r[:, None], p), r[:, None] % p)


def test_bad_input_is_named():
    h = _hashers(("tiny",))[0]
    mult, primes, offs = h.constants("cpu")
    src = _src(h, 3, 0)
    with pytest.raises(ValueError, match="src"):
        engram_rows(src.int(), mult, primes, offs, 2)
    with pytest.raises(ValueError, match="src"):
        engram_rows(src[:, :2], mult, primes, offs, 2)
    with pytest.raises(ValueError, match="primes"):
        engram_rows_ref(src, mult, primes[:1], offs, 2)
    with pytest.raises(ValueError, match="mult"):
        engram_rows(src, mult[:1], primes, offs, 2)
    with pytest.raises(ValueError, match="pad_id"):
        engram_rows(src, mult, primes, offs, 2.0)


# ------------------------------------------------------------------ GPU
@needs_cuda
@pytest.mark.parametrize("t", [1, 32, 8192])
def test_cuda_matches_hasher(t):
    for h in _hashers():
        _check(h, _src(h, t, t + h.layer_id, "cuda"))
        mult = torch.randint(2**61, 2**62, (h.max_ngram,)).cuda() * 2 + 1
        h._dev["cuda"] = (mult, *h.constants("cuda")[1:])  # wrapped, negative hashes
        _check(h, _src(h, t, t, "cuda", high=2**20))


@needs_cuda
def test_cuda_graph_replays_refilled_src():
    h = _hashers(("v41-flash",))[0]
    mult, primes, offs = h.constants("cuda")
    src = _src(h, 32, 0, "cuda")
    engram_rows(src, mult, primes, offs, h.pad_id)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = engram_rows(src, mult, primes, offs, h.pad_id)
    for seed in (1, 2):
        src.copy_(_src(h, 32, seed, "cuda"))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, h.rows_of_lookbacks(src))
