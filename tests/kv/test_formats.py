"""Packed KV row formats (spec 3.1): byte counts, byte layout, and unpack(pack(x)) == fake_quant(x) bit for bit."""

import pytest
import torch

from dsserve.kv.formats import (
    BF16_ROWS,
    INDEX_FP4,
    MAIN_FP4,
    SWA_FP8,
    format_for,
    pack_bf16,
    pack_index_fp4,
    pack_main_fp4,
    pack_swa_fp8,
    unpack_bf16,
    unpack_index_fp4,
    unpack_main_fp4,
    unpack_swa_fp8,
)
from dsserve.layers.quant import fake_quant_fp4_e4m3scale, fake_quant_fp4_pow2, fake_quant_fp8_pow2

PACKED = [SWA_FP8, MAIN_FP4, INDEX_FP4]
TINY = [SWA_FP8.with_channels(64), MAIN_FP4.with_channels(64), INDEX_FP4.with_channels(32)]
BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor):
    """Bit-for-bit equality: signed zeros and infinities included."""
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = a.view(BITS[a.dtype]) != b.view(BITS[b.dtype])
    assert not diff.any(), f"{int(diff.sum())} differing values, e.g. {a[diff][:4].tolist()} vs {b[diff][:4].tolist()}"


def roundtrip(fmt, x, prequantized=False):
    b = fmt.pack(x, prequantized)
    assert b.dtype == torch.uint8 and b.shape == (*x.shape[:-1], fmt.row_bytes)
    return fmt.unpack(b, x.dtype)


def random_rows(shape, dtype, seed, mag=None):
    """Normal rows with a per-row magnitude log-uniform in [1e-6, 1e4] (or fixed `mag`), plus heavy outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    m = mag if mag is not None else 10.0 ** (torch.rand((*shape[:-1], 1), generator=g, dtype=torch.float64) * 10 - 6)
    x = x * m * torch.where(torch.rand(shape, generator=g) < 0.01, 50.0, 1.0).double()
    return x.to(dtype)


# ---------------------------------------------------------------- sizes
def test_row_bytes_real_and_tiny_dims():
    real = [format_for("swa", "auto", 512), format_for("main", "auto", 512), format_for("index", "auto", 128)]
    assert [f.row_bytes for f in real] == [528, 288, 68]
    assert real == PACKED and sum(f.row_bytes for f in real[1:]) == 356  # 890 B/token = 534 + 356 (spec 3.2)
    assert [(f.data_bytes, f.scale_bytes) for f in real] == [(512, 16), (256, 32), (64, 4)]
    assert [format_for(k, "auto", c).row_bytes for k, c in (("swa", 64), ("main", 64), ("index", 32))] == [66, 36, 17]
    assert [format_for(k, "bf16", c).row_bytes for k, c in (("swa", 512), ("main", 512), ("index", 128))] == [
        1024,
        1024,
        256,
    ]
    assert format_for("main", "bf16", 64) == BF16_ROWS.with_channels(64)
    with pytest.raises(ValueError):
        format_for("compressor", "auto", 512)
    with pytest.raises(ValueError):
        format_for("swa", "fp8", 512)
    with pytest.raises(ValueError):
        format_for("main", "auto", 24)  # not a multiple of the 16-channel group
    with pytest.raises(ValueError):
        SWA_FP8.pack(torch.zeros(3, 64))
    with pytest.raises(ValueError):
        SWA_FP8.unpack(torch.zeros(3, 527, dtype=torch.uint8))


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("fmt", PACKED + TINY, ids=lambda f: f"{f.name}{f.channels}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_roundtrip_equals_fake_quant_random(fmt, dtype):
    x = random_rows((7, 300, fmt.channels), dtype, seed=fmt.channels)
    assert_bits_equal(roundtrip(fmt, x), fmt.reference(x))


@pytest.mark.parametrize("fmt", PACKED + TINY, ids=lambda f: f"{f.name}{f.channels}")
@pytest.mark.parametrize("mag", [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 1.0, 1e2, 1e4])
def test_roundtrip_equals_fake_quant_per_magnitude(fmt, mag):
    for dtype in (torch.float32, torch.float64):
        x = random_rows((256, fmt.channels), dtype, seed=int(mag * 1e6) % 9973, mag=mag)
        assert_bits_equal(roundtrip(fmt, x), fmt.reference(x))


def test_reference_is_the_fake_quant():
    x = random_rows((4, 512), torch.float64, seed=1)
    assert_bits_equal(SWA_FP8.reference(x), fake_quant_fp8_pow2(x, 32))
    assert_bits_equal(MAIN_FP4.reference(x), fake_quant_fp4_e4m3scale(x, 16))
    assert_bits_equal(INDEX_FP4.reference(x[:, :128]), fake_quant_fp4_pow2(x[:, :128], 32))


@pytest.mark.parametrize("fmt", PACKED, ids=lambda f: f.name)
def test_zeros_and_negative_zeros(fmt):
    c = fmt.channels
    rows = torch.stack(
        [
            torch.zeros(c),
            -torch.zeros(c),
            torch.where(torch.arange(c) % 2 == 0, 0.0, -0.0),
            torch.where(torch.arange(c) % 3 == 0, -1e-45, 1e-45),
        ]
    )  # round to -0 / +0
    for dtype in (torch.float32, torch.float64):
        x = rows.to(dtype)
        y = roundtrip(fmt, x)
        assert_bits_equal(y, fmt.reference(x))
        assert (y == 0).all() and torch.equal(torch.signbit(y), torch.signbit(x))


@pytest.mark.parametrize(
    "fmt,floor,scale_byte",
    [(SWA_FP8, 1e-4, 127 - 22), (MAIN_FP4, 6 * 2.0**-9, 0x01), (INDEX_FP4, 6 * 2.0**-126, 1)],
    ids=lambda v: str(v),
)
def test_rows_at_and_below_the_amax_floor(fmt, floor, scale_byte):
    """Rows whose amax is at, just above or below the floor (down to fp32 subnormals) all use the floor scale."""
    g = torch.Generator().manual_seed(3)
    c = fmt.channels
    base = torch.rand(6, c, generator=g, dtype=torch.float64) * 2 - 1
    amax = torch.tensor([floor, floor * 0.999, floor * 0.5, floor * 1e-3, 1e-40, 2.0**-149], dtype=torch.float64)
    x = base / base.abs().amax(-1, keepdim=True) * amax[:, None]
    for dtype in (torch.float32, torch.float64):
        xd = x.to(dtype)
        b = fmt.pack(xd)
        assert (b[..., fmt.data_bytes :] == scale_byte).all()
        assert_bits_equal(fmt.unpack(b, dtype), fmt.reference(xd))


def test_main_subnormal_e4m3_scales():
    """Group amax = 6*k*2^-9 (k = 1..7) gives the subnormal e4m3 scale byte k; off-grid amaxes round to nearby ones."""
    k = torch.arange(1, 8, dtype=torch.float64)
    x = torch.linspace(-1, 1, 16, dtype=torch.float64).expand(7, 16) * (6 * k * 2.0**-9)[:, None]
    b = pack_main_fp4(x)
    assert b[:, 8].tolist() == list(range(1, 8))
    assert_bits_equal(unpack_main_fp4(b, torch.float64), fake_quant_fp4_e4m3scale(x, 16))
    y = x * torch.linspace(0.6, 1.4, 7, dtype=torch.float64)[:, None]
    assert_bits_equal(unpack_main_fp4(pack_main_fp4(y), torch.float64), fake_quant_fp4_e4m3scale(y, 16))


@pytest.mark.parametrize("fmt", PACKED, ids=lambda f: f.name)
def test_extreme_magnitudes(fmt):
    """Saturation and fp32-overflow behaviour follow the fake-quant (documented in formats.py)."""
    c = fmt.channels
    x32 = (torch.linspace(-1, 1, c) * 3e38).expand(2, c).clone()
    x32[1, ::7] = 1e-3
    assert_bits_equal(roundtrip(fmt, x32), fmt.reference(x32))
    x64 = torch.linspace(-1, 1, c, dtype=torch.float64).expand(3, c).clone()
    x64[0, 5], x64[1, 5] = 1e300, -1e250  # finite in fp64, inf inside the fp32 fake-quant
    x64[2] *= 1e40
    y = roundtrip(fmt, x64)
    assert_bits_equal(y, fmt.reference(x64))
    if fmt is MAIN_FP4:  # scale saturates at e4m3 448 (byte 0x7E), values at +-6 * 448
        assert y[0, 5] == 2688 and y[1, 5] == -2688 and (fmt.pack(x64)[..., 256:][:, 0] == 0x7E).all()
    else:  # scale 2^127 (byte 254); the fp32 product overflows to inf exactly as in the fake-quant
        assert torch.isinf(y[0, 5]) and y[1, 5] == -float("inf")
        assert fmt.pack(x64)[0, fmt.data_bytes] == 254


# ---------------------------------------------------------------- already fake-quantised rows
@pytest.mark.parametrize("fmt", PACKED + TINY, ids=lambda f: f"{f.name}{f.channels}")
def test_prequantized_rows_are_stored_losslessly(fmt):
    """The model caches fake_quant(x); packing that must decode to it again (with prequantized=True)."""
    for mag in (None, 1e-3, 1e-2, 3e-2, 6e-2):
        for dtype in (torch.float32, torch.float64):
            y = fmt.reference(random_rows((512, fmt.channels), dtype, seed=11, mag=mag))
            assert_bits_equal(roundtrip(fmt, y, prequantized=True), y)
            if fmt.name != "main_fp4":  # the pow2 fake-quants are idempotent: the flag changes nothing
                assert torch.equal(fmt.pack(y), fmt.pack(y, prequantized=True))
            elif mag == 1e-2:  # subnormal e4m3 scales: without the flag some rows would change
                assert (fmt.unpack(fmt.pack(y), dtype) != y).any()


def test_main_fake_quant_is_not_idempotent_with_subnormal_scales():
    """The documented edge case: amax 9*2^-9 -> s = 2*2^-9 (ties to even) -> max 4s = 8*2^-9; fake-quantising
    that again picks s = 2^-9 and clamps 8 to 6. The default pack follows the fake-quant of its input;
    prequantized=True keeps s = 2*2^-9 (byte 0x02) and the row exactly."""
    x = torch.zeros(16, dtype=torch.float64)
    x[0], x[1] = 9 * 2.0**-9, -(2.0**-9)
    y = fake_quant_fp4_e4m3scale(x, 16)
    assert y[0] == 8 * 2.0**-9 and fake_quant_fp4_e4m3scale(y, 16)[0] == 6 * 2.0**-9
    assert_bits_equal(unpack_main_fp4(pack_main_fp4(y), torch.float64), fake_quant_fp4_e4m3scale(y, 16))
    b = pack_main_fp4(y, prequantized=True)
    assert b[8] == 0x02 and b[0] == 0x6 | 0x9 << 4  # 4 (code 6) in the low nibble, -0.5 (code 9) in the high one
    assert_bits_equal(unpack_main_fp4(b, torch.float64), y)


# ---------------------------------------------------------------- byte layout
def test_swa_layout_hand_packed():
    x = torch.zeros(64)
    x[0], x[1], x[2], x[31] = 1.0, -2.0, 448.0, 0.5  # group 0: amax 448 -> s = 1 (e = 127)
    x[32], x[33] = 12.0, -0.0  # group 1: amax 12 -> s = 2^ceil(log2(12/448)) = 2^-5
    b = pack_swa_fp8(x)
    expect = torch.zeros(66, dtype=torch.uint8)
    expect[[0, 1, 2, 31]] = torch.tensor([0x38, 0xC0, 0x7E, 0x30], dtype=torch.uint8)
    expect[32], expect[33] = 0x7C, 0x80  # 12 / 2^-5 = 384 = 1.5 * 2^8; -0.0
    expect[64], expect[65] = 127, 127 - 5
    assert torch.equal(b, expect)
    assert_bits_equal(unpack_swa_fp8(expect), fake_quant_fp8_pow2(x, 32))


def test_main_layout_hand_packed():
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3], x[15] = 0.5, -1.0, 6.0, -0.0, 3.0  # group 0: amax 6 -> s = e4m3(1.0) = 0x38
    x[16], x[17] = 0.75, -0.375  # group 1: amax .75 -> s = .125 (0x20)
    b = pack_main_fp4(x)
    expect = torch.zeros(18, dtype=torch.uint8)
    expect[0] = 0x1 | 0xA << 4  # 0.5 low, -1 high (sign 8 | index 2)
    expect[1] = 0x7 | 0x8 << 4  # 6 low, -0.0 high
    expect[7] = 0x0 | 0x5 << 4  # x[14] = 0 low, x[15] = 3 high
    expect[8] = 0x7 | 0xD << 4  # 0.75 / .125 = 6 low; -0.375 / .125 = -3 high
    expect[16], expect[17] = 0x38, 0x20
    assert torch.equal(b, expect)
    assert_bits_equal(unpack_main_fp4(expect), fake_quant_fp4_e4m3scale(x, 16))


def test_index_layout_hand_packed():
    x = torch.zeros(32)
    x[0], x[1], x[30], x[31] = -6.0, 1.5, 2.0, -4.0  # amax 6 -> s = 1 (e = 127)
    b = pack_index_fp4(x)
    expect = torch.zeros(17, dtype=torch.uint8)
    expect[0], expect[15], expect[16] = 0xF | 0x3 << 4, 0x4 | 0xE << 4, 127
    assert torch.equal(b, expect)
    assert_bits_equal(unpack_index_fp4(expect), fake_quant_fp4_pow2(x, 32))
    assert pack_index_fp4(x * 2.0**-40)[16] == 127 - 40  # pure rescale: same nibbles, scale byte moves


def test_leading_dims_and_strided_rows():
    x = random_rows((2, 3, 5, 128), torch.float32, seed=5)
    b = pack_index_fp4(x)
    assert b.shape == (2, 3, 5, 68)
    assert torch.equal(b[1, 2], pack_index_fp4(x[1, 2])) and torch.equal(pack_index_fp4(x[:0]), b[:0])
    pool = torch.cat((b, b), -1)[..., 68:]  # non-contiguous rows, as from a slice of a larger buffer
    assert_bits_equal(INDEX_FP4.unpack(pool), fake_quant_fp4_pow2(x, 32))


# ---------------------------------------------------------------- bf16 debug rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bf16_rows_are_a_cast(dtype):
    x = random_rows((4, 9, 64), dtype, seed=2)
    x[0, 0, :3] = torch.tensor([-0.0, 0.0, 3e38], dtype=torch.float64).to(dtype)
    fmt = format_for("swa", "bf16", 64)
    b = fmt.pack(x)
    assert b.shape == (4, 9, 128) and torch.equal(b, pack_bf16(x))
    assert_bits_equal(fmt.unpack(b, dtype), x.to(torch.bfloat16).to(dtype))
    assert_bits_equal(unpack_bf16(b, dtype), fmt.reference(x))
    one = pack_bf16(torch.tensor([1.0, -2.0]))
    assert one.tolist() == [0x80, 0x3F, 0x00, 0xC0]  # little-endian bf16 0x3F80, 0xC000
