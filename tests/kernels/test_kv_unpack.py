"""unpack_rows (Triton) vs unpack_rows_ref: packed KV rows to bf16 key tables, absent rows zero."""

import pytest
import torch

from dsserve.kernels.kv_unpack import FORMATS, unpack_rows, unpack_rows_ref


def _case(fmt, d, n, m, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rf = FORMATS[fmt].with_channels(d)
    vals = torch.randn(n, d, generator=g, dtype=torch.float64)
    vals[::3, :16] *= 0.003  # small groups: subnormal e4m3 scales in FP4 rows
    pool = rf.pack(vals)
    pool[-1] = 0xFF  # a junk row (NaN bytes): read only where listed
    rows = torch.randint(0, n - 1, (m,), generator=g)
    rows[::4] = -1
    return pool.to(device), rows.to(device=device, dtype=torch.int32), rf, vals


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "bf16", "index_fp4"])
def test_kernel_equals_reference(fmt):
    pool, rows, rf, _ = _case(fmt, 64, 40, 37, seed=1)  # 37 rows: a partial last program
    out = unpack_rows(pool, fmt, rows)
    ref = unpack_rows_ref(pool, fmt, rows)
    assert out.dtype == torch.bfloat16 and out.shape == (37, 64)
    assert torch.equal(out, ref)
    assert (out[::4] == 0).all()
    # FP8 / FP4 keys are exact in bf16: the table holds the packed values themselves
    assert torch.equal(ref[1:2].double(), rf.unpack(pool[rows[1:2].long()], torch.float64))


def test_empty_and_bad_input():
    pool, rows, _, _ = _case("fp4", 64, 8, 4, seed=2)
    assert unpack_rows(pool, "fp4", rows[:0]).shape == (0, 64)
    with pytest.raises(ValueError, match="fmt"):
        unpack_rows(pool, "fp16", rows)
    with pytest.raises(ValueError, match="pool"):
        unpack_rows(pool[:, :-1], "fp4", rows)
    with pytest.raises(ValueError, match="rows"):
        unpack_rows(pool, "fp4", rows.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt,d", [("fp8", 512), ("fp4", 512), ("index_fp4", 128)])
def test_gpu_real_rows(fmt, d):
    pool, rows, _, _ = _case(fmt, d, 3000, 5000, seed=3, device="cuda")
    assert torch.equal(unpack_rows(pool, fmt, rows), unpack_rows_ref(pool, fmt, rows))
