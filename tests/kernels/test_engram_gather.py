"""dsserve.kernels.engram_gather against its torch reference and EngramTable.gather (bitwise).

CPU: the Triton interpreter on tiny tables. GPU: tables in registered host memory read by the kernel, a CUDA-graph
capture replayed with refilled ids, and a device-resident table."""

import pytest
import torch

from dsserve.kernels.engram_gather import engram_gather, engram_gather_ref
from dsserve.layers.engram_table import EngramTable

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weight(rows, dim, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # per-row magnitudes over many binades, so fp8 scales differ between rows and 32-column groups
    w = torch.randn(rows, dim, generator=g) * torch.exp2(
        torch.randint(-12, 6, (rows, dim // 16 or 1), generator=g).float().repeat_interleave(16, 1)[:, :dim]
    )
    return w.to(dtype)


def _ids(rows, shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, shape, generator=g)
    flat = ids.view(-1)
    flat[0], flat[-1] = 0, rows - 1  # the first and last row
    flat[1] = flat[2] = flat[len(flat) // 2]  # repeated ids
    return ids.to(device)


def _check_all(table, ids, dtype):
    out = engram_gather(table.data, ids, table.fmt, table.dim, dtype)
    ref = engram_gather_ref(table.data, ids, table.fmt, table.dim, dtype)
    assert out.shape == (*ids.shape, table.dim) and out.dtype == dtype and out.device == ids.device
    assert torch.equal(out, ref)
    assert torch.equal(out, table.gather(ids, ids.device, dtype))
    assert out.abs().amax() > 0 and out.isfinite().all()
    return out


@pytest.mark.parametrize(
    "fmt,wdtype,dim,dtype,shape",
    [
        ("fp8", torch.float32, 32, torch.float32, (5, 3)),
        ("fp8", torch.float32, 96, torch.bfloat16, (7,)),  # D not a power of two: masked columns
        ("fp8", torch.float32, 256, torch.bfloat16, (2, 3)),  # the release D
        ("fp8", torch.float32, 64, torch.float16, (4, 2)),
        ("bf16", torch.float32, 16, torch.float32, (6, 2)),
        ("bf16", torch.float32, 32, torch.bfloat16, (9,)),
        ("float", torch.float32, 16, torch.bfloat16, (3, 4)),  # fp32 -> bf16 rounding
        ("float", torch.float16, 32, torch.float32, (5,)),
        ("float", torch.float64, 16, torch.float64, (4, 3)),  # the fp64 tiny models
    ],
)
def test_matches_ref_and_table(fmt, wdtype, dim, dtype, shape):
    rows = 37
    table = EngramTable.from_weight(_weight(rows, dim, dim, wdtype), fmt)
    _check_all(table, _ids(rows, shape, rows + dim), dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter warns on the intended overflow
def test_fp8_every_code_and_scale():
    """Every finite e4m3 byte and scale bytes 0 (subnormal 2^-127) .. 254 (products overflow to inf)."""
    dim, rows = 32, 255
    data = torch.zeros(rows, dim + 1, dtype=torch.uint8)
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    data[:, :dim] = codes[(torch.arange(rows)[:, None] * 7 + torch.arange(dim)) % len(codes)]
    data[:, dim] = torch.arange(rows, dtype=torch.uint8)
    ids = torch.arange(rows - 1, -1, -1)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        out = engram_gather(data, ids, "fp8", dim, dtype)
        assert torch.equal(out, engram_gather_ref(data, ids, "fp8", dim, dtype))
    assert out.isinf().any() and (out == 0).any()


def test_bad_input_is_named():
    t = EngramTable.from_weight(_weight(4, 32, 0), "fp8")
    ids = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="fmt"):
        engram_gather(t.data, ids, "fp4", 32, torch.float32)
    with pytest.raises(ValueError, match="data"):
        engram_gather(t.data, ids, "fp8", 64, torch.float32)
    with pytest.raises(ValueError, match="ids"):
        engram_gather(t.data, ids.float(), "fp8", 32, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        engram_gather_ref(t.data, ids, "fp8", 32, torch.int32)
    assert engram_gather(t.data, ids[:0].view(0, 3), "fp8", 32, torch.float32).shape == (0, 3, 32)


# ------------------------------------------------------------------ GPU
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "bf16", "float"])
@pytest.mark.parametrize("shape", [(1, 24), (37, 24), (300,)])
def test_registered_host_table(fmt, shape):
    rows, dim = 5003, 256
    table = EngramTable.from_weight(_weight(rows, dim, 1), fmt)
    assert table.data.device.type == "cpu" and table.memory.pinned  # the kernel reads host memory directly
    ids = _ids(rows, shape, 2, "cuda")
    for dtype in (torch.bfloat16, torch.float32):
        _check_all(table, ids, dtype)


@needs_cuda
def test_cuda_graph_replays_refilled_ids():
    rows, dim, shape = 20011, 256, (32, 24)
    table = EngramTable.from_weight(_weight(rows, dim, 3), "fp8")
    ids = _ids(rows, shape, 4, "cuda")
    engram_gather(table.data, ids, "fp8", dim, torch.bfloat16)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = engram_gather(table.data, ids, "fp8", dim, torch.bfloat16)
    for seed in (5, 6):
        new = _ids(rows, shape, seed, "cuda")
        ids.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, table.gather(new, "cuda", torch.bfloat16))


@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_device_resident_table(fmt):
    rows, dim = 4099, 256
    table = EngramTable.from_weight(_weight(rows, dim, 7), fmt)
    data = table.data.cuda()
    ids = _ids(rows, (128, 24), 8, "cuda")
    out = engram_gather(data, ids, fmt, dim, torch.bfloat16)
    assert torch.equal(out, engram_gather_ref(data, ids, fmt, dim, torch.bfloat16))
    assert torch.equal(out, table.gather(ids, "cuda", torch.bfloat16))
