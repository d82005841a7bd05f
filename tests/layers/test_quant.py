"""Release quantisation formats and the QAT fake-quant numerics (spec 1.7, 2.12, 4.2), checked bit-exactly
against independent plain-Python decoders."""

import math

import numpy as np
import pytest
import torch

from dsserve.layers.quant import (
    dequant_engram,
    dequant_fp8_block,
    dequant_mxfp4,
    e2m1_decode,
    e8m0_to_float,
    fake_quant_fp4_e4m3scale,
    fake_quant_fp4_pow2,
    fake_quant_fp8_pow2,
    float_to_e8m0,
    pack_mxfp4,
    pow2_ceil,
    quant_engram,
    quant_fp8_block,
    round_to_e2m1,
)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------- independent reference decoders
def ref_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def ref_e2m1(nibble: int) -> float:
    return (-1.0 if nibble & 8 else 1.0) * E2M1[nibble & 7]


def random_e4m3_bytes(gen, shape):
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b & 0x7E, b)  # no NaN encodings
    return b.to(torch.uint8)


def random_e8m0(gen, shape, lo=100, hi=150):
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def as_f32(values, shape):
    return torch.tensor(np.array(values, dtype=np.float64).astype(np.float32)).reshape(shape)


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---------------------------------------------------------------- e8m0
def test_e8m0_decode_all_codes():
    e = torch.arange(0, 255, dtype=torch.int32).to(torch.uint8)
    expect = as_f32([math.ldexp(1.0, int(i) - 127) for i in range(255)], (255,))
    assert bits_equal(e8m0_to_float(e), expect)
    assert bits_equal(e8m0_to_float(e.view(torch.float8_e8m0fnu)), expect)
    assert torch.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()


def test_e2m1_decode_all_codes():  # computed on the codes' device (no host table: CUDA graph capture refuses it)
    codes = torch.arange(16, dtype=torch.uint8)
    expect = as_f32(E2M1 + [-v for v in E2M1], (16,))  # code 8 is -0.0
    assert bits_equal(e2m1_decode(codes), expect)


def test_e8m0_encode_roundtrip_and_pow2_ceil():
    e = torch.arange(0, 255, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(float_to_e8m0(e8m0_to_float(e)).view(torch.uint8), e)
    y = torch.tensor([1.0, 1.5, 3.0, 4.0, 0.3, 2.0**-130, 0.0, 448.0, 449.0])
    expect = torch.tensor([1.0, 2.0, 4.0, 4.0, 0.5, 2.0**-127, 2.0**-127, 512.0, 512.0])
    assert torch.equal(pow2_ceil(y), expect)


# ---------------------------------------------------------------- bit-exact dequantisation
@pytest.mark.parametrize("n,k,block", [(70, 45, 32), (64, 96, 32), (130, 260, 128)])
def test_dequant_fp8_block_matches_formula(n, k, block):
    gen = torch.Generator().manual_seed(n * k)
    w = random_e4m3_bytes(gen, (n, k))
    s = random_e8m0(gen, (-(-n // block), -(-k // block)))
    expect = [
        ref_e4m3(int(w[i, j])) * 2.0 ** (int(s[i // block, j // block]) - 127) for i in range(n) for j in range(k)
    ]
    out = dequant_fp8_block(w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), block)
    assert bits_equal(out, as_f32(expect, (n, k)))


@pytest.mark.parametrize("shape", [(8, 64), (3, 5, 96)])
def test_dequant_mxfp4_matches_formula(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    *lead, k = shape
    packed = torch.randint(-128, 128, (*lead, k // 2), generator=gen, dtype=torch.int32).to(torch.int8)
    scale = random_e8m0(gen, (*lead, k // 32))
    p2, s2 = packed.reshape(-1, k // 2), scale.reshape(-1, k // 32)
    expect = []
    for r in range(p2.shape[0]):
        for j in range(k):
            byte = int(p2[r, j // 2]) & 0xFF
            nib = byte & 0xF if j % 2 == 0 else byte >> 4
            expect.append(ref_e2m1(nib) * 2.0 ** (int(s2[r, j // 32]) - 127))
    out = dequant_mxfp4(packed, scale.view(torch.float8_e8m0fnu))
    assert bits_equal(out, as_f32(expect, shape))


def test_dequant_engram_matches_formula():
    gen = torch.Generator().manual_seed(7)
    rows, dim = 11, 64
    w, s = random_e4m3_bytes(gen, (rows, dim)), random_e8m0(gen, (rows, dim // 32))
    expect = [ref_e4m3(int(w[r, c])) * 2.0 ** (int(s[r, c // 32]) - 127) for r in range(rows) for c in range(dim)]
    out = dequant_engram(w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu))
    assert bits_equal(out, as_f32(expect, (rows, dim)))


# ---------------------------------------------------------------- quant -> dequant round trips
def test_fp8_block_roundtrip_exact_on_grid_and_scale_choice():
    gen = torch.Generator().manual_seed(1)
    for n, k, b in [(70, 45, 32), (200, 130, 128)]:
        w = dequant_fp8_block(
            random_e4m3_bytes(gen, (n, k)).view(torch.float8_e4m3fn), random_e8m0(gen, (-(-n // b), -(-k // b))), b
        )
        q, s = quant_fp8_block(w, b)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
        assert bits_equal(dequant_fp8_block(q, s, b), w)
    # the scale is the smallest power of two with amax / s <= 448
    w = torch.randn(64, 64, generator=gen) * 100
    q, s = quant_fp8_block(w, 32)
    amax = w.view(2, 32, 2, 32).abs().amax(dim=(1, 3))
    sf = e8m0_to_float(s)
    assert (amax / sf <= 448).all() and (amax / (sf / 2) > 448).all()
    assert (dequant_fp8_block(q, s, 32) - w).abs().max() <= sf.max() * 16  # half an e4m3 step at 448


def test_mxfp4_roundtrip_exact_on_grid():
    gen = torch.Generator().manual_seed(2)
    packed = torch.randint(-128, 128, (16, 128), generator=gen, dtype=torch.int32).to(torch.int8)
    w = dequant_mxfp4(packed, random_e8m0(gen, (16, 8)))
    p2, s2 = pack_mxfp4(w)
    assert p2.dtype == torch.int8 and s2.dtype == torch.float8_e8m0fnu and p2.shape == (16, 128)
    assert bits_equal(dequant_mxfp4(p2, s2), w)
    # groups whose amax is 6 * 2^e keep their exact bytes and scales
    codes = torch.randint(0, 16, (4, 64), generator=gen)
    codes[:, ::32] = 7  # +6 in every group
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale = random_e8m0(gen, (4, 2))
    p3, s3 = pack_mxfp4(dequant_mxfp4(packed, scale))
    assert torch.equal(p3, packed) and torch.equal(s3.view(torch.uint8), scale)


def test_mxfp4_nibble_order():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, -0.5, 1.0  # codes 7, 9, 2
    p, s = pack_mxfp4(w)
    assert int(s.view(torch.uint8)[0, 0]) == 127
    assert [int(x) & 0xFF for x in p[0, :2]] == [0x97, 0x02]


def test_engram_roundtrip_exact_on_grid():
    gen = torch.Generator().manual_seed(3)
    w = dequant_engram(random_e4m3_bytes(gen, (9, 64)).view(torch.float8_e4m3fn), random_e8m0(gen, (9, 2)))
    q, s = quant_engram(w)
    assert q.shape == (9, 64) and s.shape == (9, 2)
    assert bits_equal(dequant_engram(q, s), w)


# ---------------------------------------------------------------- e2m1 rounding
def test_round_to_e2m1_against_bruteforce():
    grid = [(v, c) for c, v in enumerate(E2M1)]
    xs = [i / 16 for i in range(-120, 121)] + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0]
    expect = []
    for x in xs:
        a = min(abs(x), 6.0)
        best = min(grid, key=lambda vc: (abs(vc[0] - a), vc[1] % 2))  # nearest, tie -> even code
        expect.append(math.copysign(best[0], x))
    assert torch.equal(round_to_e2m1(torch.tensor(xs)), torch.tensor(expect))


def test_round_to_e2m1_ties():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    assert torch.equal(round_to_e2m1(x), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]))
    assert torch.equal(round_to_e2m1(-x), -torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]))


# ---------------------------------------------------------------- fake quant
def _varied(gen, shape):
    """Random data whose groups span several decades but stay in normal e4m3-scale range."""
    mag = 10.0 ** torch.empty(*shape[:-1], 1).uniform_(-1, 2, generator=gen)
    return torch.randn(shape, generator=gen) * mag


@pytest.mark.parametrize(
    "fn,group", [(fake_quant_fp8_pow2, 32), (fake_quant_fp4_e4m3scale, 16), (fake_quant_fp4_pow2, 32)]
)
def test_fake_quant_idempotent_and_dtype(fn, group):
    gen = torch.Generator().manual_seed(4)
    x = _varied(gen, (6, 8, 4 * group))
    y = fn(x, group)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(fn(y, group), y)
    for dt in (torch.bfloat16, torch.float16):
        assert fn(x.to(dt), group).dtype == dt
    assert torch.equal(
        fn(x.to(torch.bfloat16), group).float(), fn(x.to(torch.bfloat16).float(), group).to(torch.bfloat16).float()
    )


def test_fake_quant_exact_on_representable_values():
    gen = torch.Generator().manual_seed(5)
    # FP8: e4m3 values times a power of two per 32
    q = random_e4m3_bytes(gen, (4, 64)).view(torch.float8_e4m3fn).float()
    x = q * e8m0_to_float(random_e8m0(gen, (4, 2), 110, 140)).repeat_interleave(32, -1)
    assert torch.equal(fake_quant_fp8_pow2(x), x)
    # FP4 pow2: grid values times a power of two per 32
    g = torch.tensor(E2M1)[torch.randint(0, 8, (4, 64), generator=gen)] * (
        torch.randint(0, 2, (4, 64), generator=gen) * 2 - 1
    )
    x = g * e8m0_to_float(random_e8m0(gen, (4, 2), 110, 140)).repeat_interleave(32, -1)
    assert torch.equal(fake_quant_fp4_pow2(x), x)
    assert torch.equal(dequant_mxfp4(*pack_mxfp4(x)), x)
    # FP4 with e4m3 scales: grid values times an e4m3 scale per 16, each group holding a +-6
    g = g.reshape(8, 32).clone()
    g[:, ::16] = 6.0
    s = torch.tensor([0.0390625, 0.75, 1.0, 1.125, 3.5, 13.0, 96.0, 0.3125])  # all exact e4m3 values
    x = g * s[:, None]
    assert torch.equal(fake_quant_fp4_e4m3scale(x), x)


def test_fake_quant_tie_cases():
    # FP8 with scale 1 (amax 448): e4m3 RNE between 1 and 1.125 (step 1/8), and 256..288 (step 32)
    x = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 272.0, 304.0] + [0.0] * 26)
    y = fake_quant_fp8_pow2(x)
    assert y[:6].tolist() == [448.0, 1.0, 1.25, -1.0, 256.0, 320.0]
    # FP4 pow2 with scale 1 (amax 6)
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.75] + [0.0] * 22)
    assert fake_quant_fp4_pow2(x)[:10].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, -1.0]
    # FP4 with e4m3 scale 1 (amax 6), group 16
    x = torch.tensor([6.0, 0.25, 0.75, 2.5, 3.5, 5.0] + [0.0] * 10)
    assert fake_quant_fp4_e4m3scale(x).tolist()[:6] == [6.0, 0.0, 1.0, 2.0, 4.0, 4.0]
    # e4m3 rounding of the scale itself: amax 6 * 1.0625 -> s = e4m3(1.0625) = 1.0 (tie to even), so 6.375 -> 6
    x = torch.tensor([6.375, 1.0] + [0.0] * 14)
    assert fake_quant_fp4_e4m3scale(x).tolist()[:2] == [6.0, 1.0]


def test_fake_quant_amax_floors():
    # FP8: amax floor 1e-4 -> s = 2^ceil(log2(1e-4/448)) = 2^-22, then e4m3 on x / s
    x = torch.tensor([1e-6, -3e-7] + [0.0] * 30)
    s = 2.0**-22
    expect = torch.tensor([1e-6 / s, -3e-7 / s]).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(fake_quant_fp8_pow2(x)[:2], expect)
    assert torch.equal(fake_quant_fp8_pow2(torch.zeros(2, 32)), torch.zeros(2, 32))
    # FP4 / e4m3 scale: amax floor 6*2^-9 -> s = 2^-9
    u = 2.0**-9
    x = torch.tensor([1.0, 0.5, 0.25, 0.75, -1.5] + [0.0] * 11) * u
    assert torch.equal(fake_quant_fp4_e4m3scale(x)[:5], torch.tensor([1.0, 0.5, 0.0, 1.0, -1.5]) * u)
    assert torch.equal(fake_quant_fp4_e4m3scale(torch.zeros(16)), torch.zeros(16))
    # FP4 pow2: amax floor 6*2^-126 -> s = 2^-126
    u = 2.0**-126
    x = torch.tensor([1.0, 0.5, 0.25, 3.0] + [0.0] * 28) * u
    assert torch.equal(fake_quant_fp4_pow2(x)[:4], torch.tensor([1.0, 0.5, 0.0, 3.0]) * u)
    assert torch.equal(fake_quant_fp4_pow2(torch.zeros(32)), torch.zeros(32))


def test_fake_quant_pow2_scale_choice():
    # amax exactly 448 * 4 keeps scale 4, so 2^-7 = 4 * (smallest e4m3 subnormal) survives;
    # amax slightly above needs scale 8, where 2^-7 / 8 = 2^-10 ties to 0
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = 448.0 * 4, 448.0 * 4 * 1.01
    x[:, 1] = 2.0**-7
    y = fake_quant_fp8_pow2(x)
    assert y[:, 0].tolist() == [1792.0, 1792.0] and y[:, 1].tolist() == [2.0**-7, 0.0]
    # FP4 pow2: amax 6 * 2 keeps scale 2 (0.5 * 2 = 1 survives); amax 6 * 2 * 1.01 -> scale 4 (1 / 4 ties to 0)
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = 12.0, 12.12
    x[:, 1] = 1.0
    y = fake_quant_fp4_pow2(x)
    assert y[:, 0].tolist() == [12.0, 8.0 * 1.5] and y[:, 1].tolist() == [1.0, 0.0]
