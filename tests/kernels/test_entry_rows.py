"""dsserve.kernels.entry_rows against its torch reference (the interpreter on the CPU; the GPU when present)."""

import pytest
import torch

from dsserve.kernels.entry_rows import entry_rows, entry_rows_ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "t,k,mb,epb,dtype", [(5, 8, 4, 32, torch.int64), (19, 12, 7, 2, torch.int32), (1, 64, 1, 64, torch.int64)]
)
def test_matches_ref(device, t, k, mb, epb, dtype):
    g = torch.Generator().manual_seed(t * k)
    tables = torch.randint(0, 1000, (3, mb), generator=g, dtype=torch.int32)
    tables[1, max(1, mb // 2) :] = -1  # a short sequence: absent blocks
    row_seq = torch.randint(0, 3, (t,), generator=g, dtype=torch.int32)
    entries = torch.randint(-2, (mb + 1) * epb, (t, k), generator=g).to(dtype)  # negatives and past the table
    valid = torch.rand(t, k, generator=g) < 0.8
    args = [a.to(device) for a in (entries, valid, tables, row_seq)] + [epb]
    out, ref = entry_rows(*args), entry_rows_ref(*args)
    assert out.dtype == torch.int32 and torch.equal(out, ref)
    assert (out[~valid.to(device)] == -1).all() and (out >= 0).any()


def test_bad_input_is_named():
    e, v = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    tab, seq = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="valid"):
        entry_rows(e, v.int(), tab, seq, 4)
    with pytest.raises(ValueError, match="epb"):
        entry_rows(e, v, tab, seq, 0)
    with pytest.raises(ValueError, match="row_seq"):
        entry_rows(e, v, tab, seq[:1], 4)
    assert entry_rows(e[:0], v[:0], tab, seq[:0], 4).shape == (0, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_new_table_widths_and_row_counts_compile_nothing():
    """A step's table width follows its longest context and its row count its tokens: neither may compile a new
    kernel (they did as constexprs: 70 compiles stalled two minutes of a live server). Entry counts of one power
    of two share one kernel too."""
    from dsserve.engine import jit_compiles

    if not jit_compiles.watch():
        pytest.skip("this Triton has no compile hooks")
    g = torch.Generator().manual_seed(3)

    def call(t, k, mb):
        tables = torch.randint(0, 1000, (2, mb), generator=g, dtype=torch.int32).cuda()
        row_seq = torch.randint(0, 2, (t,), generator=g, dtype=torch.int32).cuda()
        entries = torch.randint(0, mb * 4, (t, k), generator=g).cuda()
        valid = (torch.rand(t, k, generator=g) < 0.9).cuda()
        assert torch.equal(
            entry_rows(entries, valid, tables, row_seq, 4), entry_rows_ref(entries, valid, tables, row_seq, 4)
        )

    call(5, 300, 9)
    before = jit_compiles.COMPILES.count, jit_compiles.COMPILES.loads  # a warm disk cache would load, not compile
    for t, k, mb in [(1, 301, 9), (16, 305, 64), (37, 300, 129), (512, 299, 1000)]:
        call(t, k, mb)
    assert (jit_compiles.COMPILES.count, jit_compiles.COMPILES.loads) == before
