"""Engram tables in host memory (layers.engram_table) and the model running on them: every path is exact."""

import copy

import pytest
import torch

from dsserve.layers.context import ForwardContext, KeptRows, SeqRows
from dsserve.layers.engram import Engram
from dsserve.layers.engram_table import EngramRows, EngramTable, allocate_host
from dsserve.layers.quant import dequant_engram, quant_engram
from dsserve.models.presets import preset

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def table_weight(rows=300, dim=64, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g, dtype=torch.float64) * 0.1
    w[::7, :32] *= 1e-3  # per-32-column scales differ within a row
    return w.to(dtype)


def rand_rows(n_rows, shape, seed=1):
    return torch.randint(0, n_rows, shape, generator=torch.Generator().manual_seed(seed))


def host_copy(model, fmt):
    """A copy of `model` with every Engram table moved to host memory in `fmt`."""
    m = copy.deepcopy(model)
    for b in m.layers:
        if b.engram is not None:
            b.engram.move_table_to_host(fmt)
    return m


def engram_layers(model):
    return [b.engram for b in model.layers if b.engram is not None]


# ------------------------------------------------------------------ the table
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_gather_layouts_are_exact(device):
    w = table_weight()
    rows = rand_rows(w.shape[0], (9, 5)).to(device)
    got = EngramTable.from_weight(w, "float").gather(rows, device, torch.float64)
    assert got.shape == (9, 5, 64) and got.device.type == device and torch.equal(got.cpu(), w[rows.cpu()])
    got = EngramTable.from_weight(w, "bf16").gather(rows, device, torch.float32)
    assert torch.equal(got.cpu(), w.to(torch.bfloat16)[rows.cpu()].float())
    q, s = quant_engram(w)
    deq = dequant_engram(q, s)
    for t in (EngramTable.from_weight(w, "fp8"), EngramTable.from_fp8(q, s)):
        assert t.data.shape == (300, 64 + 2)
        for dt in (torch.float32, torch.bfloat16):
            assert torch.equal(t.gather(rows, device, dt).cpu(), deq[rows.cpu()].to(dt))
    assert not torch.equal(deq, w.float())  # the fp8 comparison is not vacuous


def test_staging_buffer_grows_and_is_reused():
    w = table_weight(dim=32)
    t = EngramTable.from_weight(w, "float")
    a = t.gather(torch.tensor([3, 1, 4]))
    buf = t._staging
    b = t.gather(torch.tensor([5, 9]))
    assert t._staging is buf  # no allocation for a smaller step
    c = t.gather(torch.arange(200))
    assert t._staging.shape[0] >= 200 and t._staging is not buf
    buf = t._staging
    d = t.gather(torch.arange(150, 0, -1))
    assert t._staging is buf
    # results never alias the staging buffer: earlier results survive later gathers
    for out, r in ((a, [3, 1, 4]), (b, [5, 9]), (c, list(range(200))), (d, list(range(150, 0, -1)))):
        assert torch.equal(out, w[r].float())


def test_prefetch_wait_equals_gather_and_narrows_to_suffixes():
    w = table_weight()
    t = EngramTable.from_weight(w, "fp8")
    rows = rand_rows(300, (7, 4))
    h = t.prefetch(rows, "cpu", torch.float64, seq_lens=[3, 4])
    assert isinstance(h, EngramRows) and torch.equal(h.wait(), t.gather(rows, "cpu", torch.float64))
    # bounded replay keeps a suffix of each sequence: 2 of the first 3 rows, all 4 of the second
    got = h.for_seqs([slice(0, 2), slice(2, 6)])
    assert torch.equal(got, t.gather(rows[[1, 2, 3, 4, 5, 6]], "cpu", torch.float64))
    with pytest.raises(ValueError, match="cannot serve"):
        h.for_seqs([slice(0, 4), slice(4, 5)])
    with pytest.raises(ValueError, match="rows must lie"):
        t.gather(torch.tensor([300]))
    with pytest.raises(ValueError, match="fmt must be"):
        EngramTable.from_weight(w, "fp16")


def test_allocate_host_records_huge_pages():
    m = allocate_host(1 << 21, huge_pages=True)
    assert m.tensor.shape == (1 << 21,) and int(m.tensor.sum()) == 0
    assert m.huge_pages or m.huge_pages_reason  # either advised or the reason is recorded
    m.tensor[:4] = 7
    assert allocate_host(4096).huge_pages_reason == "not requested"
    with pytest.raises(ValueError, match="nbytes"):
        allocate_host(0)


# ------------------------------------------------------------------ the layer
def test_prefetched_rows_follow_bounded_replay_narrowing():
    """Rows prefetched for every row, consumed after ctx.narrow: same output as hashing the kept rows."""
    cfg = preset("tiny")
    torch.manual_seed(0)
    dev = Engram(cfg, 1).double()
    torch.nn.init.normal_(dev.embed.weight, std=0.1)
    host = copy.deepcopy(dev)
    host.move_table_to_host("float")
    assert host.embed.weight.shape[0] == 0  # .to(cuda) no longer copies the table
    ids = torch.randint(0, cfg.engram_compressed_vocab_size, (11,))
    ids[4] = -1  # a dead token
    hist = [torch.tensor([5, 6]), torch.empty(0, dtype=torch.long)]
    ctx = ForwardContext(
        tokens=ids,
        positions=torch.arange(11),
        seqs=[SeqRows(slice(0, 5), None), SeqRows(slice(5, 11), None)],
        engram_ids=ids,
        engram_history=hist,
    )
    ctx.engram_rows = {1: host.prefetch(ids, [s.rows for s in ctx.seqs], hist, "cpu", torch.float64)}
    n = ctx.narrow(KeptRows.suffixes(ctx.seqs, (3, 5), "cpu"))  # rows 2-4 and 6-10
    x = torch.randn(8, cfg.hc_mult, cfg.hidden_size, dtype=torch.float64)
    args = (x, n.engram_ids, [s.rows for s in n.seqs], n.engram_history)
    ref = dev(*args)
    assert torch.equal(host(*args, rows=n.engram_rows[1]), ref)
    assert torch.equal(host(*args), ref)  # no handle: gathers from the host table now


# ------------------------------------------------------------------ the model
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_host_tables_give_the_same_logits(tiny_models, dtype):
    base = tiny_models["tiny"] if dtype == torch.float64 else copy.deepcopy(tiny_models["tiny"]).float()
    toks = torch.randint(3, base.cfg.vocab_size, (14,), generator=torch.Generator().manual_seed(5))
    host = host_copy(base, "float")
    for kw in ({}, {"decoder_start": 9}):
        ref = base.reference_logits(toks, **kw)
        assert torch.equal(host.reference_logits(toks, **kw), ref), kw


@torch.no_grad()
def test_fp8_host_tables_equal_the_dequantised_table(tiny_models):
    host = host_copy(tiny_models["tiny"], "fp8")
    base = copy.deepcopy(tiny_models["tiny"])
    for e in engram_layers(base):
        e.embed.weight.copy_(dequant_engram(*quant_engram(e.embed.weight)))
    toks = torch.randint(3, base.cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(6))
    assert torch.equal(host.reference_logits(toks), base.reference_logits(toks))


def test_engine_chunked_prefill_decode_and_replay_hit_are_exact():
    """The same requests on an engine with device tables and on one with engram_tables="host": chunked prefill,
    decode and a prefix hit with bounded replay give the same tokens and logits."""
    import random

    from dsserve import LLM, SamplingParams

    rng = random.Random(7)
    prefix = [rng.randrange(3, 8190) for _ in range(34)]
    prompts = [prefix + [5, 6], prefix + [7, 8, 9]]  # the second hits 32 cached tokens and replays
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run(tables):
        llm = LLM(
            model="tiny",
            dtype="float64",
            device="cpu",
            block_size=16,
            max_num_batched_tokens=20,
            max_num_seqs=4,
            swa_bounded_replay=True,
            replay_window=16,
            enable_prefix_caching=True,
            engram_tables=tables,
        )
        seen, execute = [], llm.engine.runner.execute

        def capture(plan):
            reqs, logits = execute(plan)
            seen.extend(logits)
            return reqs, logits

        llm.engine.runner.execute = capture
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        assert outs[1].num_cached_tokens == 32 and llm.engine.stats.replayed_rows > 0
        hosted = [e.table is not None and e.embed.weight.numel() == 0 for e in engram_layers(llm.engine.model)]
        return [o.outputs[0].token_ids for o in outs], torch.stack(seen), hosted

    ref_tokens, ref_logits, hosted = run("device")
    assert hosted and not any(hosted)
    tokens, logits, hosted = run("host")
    assert all(hosted)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


def test_engram_tables_option_rejects_unknown_places():
    from dsserve.engine.args import EngineArgs, EngineArgsError

    with pytest.raises(EngineArgsError, match="engram_tables must be device, host or host-fp8"):
        EngineArgs(engram_tables="gpu")


# ------------------------------------------------------------------ GPU
@CUDA
def test_prefetch_copies_on_the_side_stream():
    w = table_weight(rows=4096, dim=256, dtype=torch.float32)
    t = EngramTable.from_weight(w, "fp8")
    assert t.memory.pinned and t._staging is None
    rows = rand_rows(4096, (128, 24))
    out = torch.full((128, 24, 256), float("nan"), device="cuda")
    h = t.prefetch(rows, "cuda", torch.float32)
    assert h.stream is t.side_stream(torch.device("cuda")) and h.stream != torch.cuda.current_stream()
    assert t._staging.is_pinned()
    out.copy_(h.wait())
    q, s = quant_engram(w)
    assert torch.equal(out.cpu(), dequant_engram(q, s)[rows])


@CUDA
@torch.no_grad()
def test_host_tables_on_cuda_give_the_same_logits(tiny_models):
    for fmt in ("float", "fp8"):
        base = copy.deepcopy(tiny_models["tiny"]).float()
        if fmt == "fp8":
            for e in engram_layers(base):
                e.embed.weight.copy_(dequant_engram(*quant_engram(e.embed.weight)))
        host = host_copy(base, fmt).cuda()
        base = base.cuda()
        assert all(e.embed.weight.numel() == 0 for e in engram_layers(host))
        toks = torch.randint(3, base.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(8)).cuda()
        for kw in ({}, {"decoder_start": 200}):
            ref, again = base.reference_logits(toks, **kw), base.reference_logits(toks, **kw)
            got = torch.full_like(ref, float("nan"))
            got.copy_(host.reference_logits(toks, **kw))
            assert torch.isfinite(ref).all()
            if torch.equal(ref, again):  # bitwise only where the device model itself is (atomics may not be)
                assert torch.equal(got, ref), (fmt, kw)
            else:
                assert ((got - ref).norm() / ref.norm()).item() < 1e-5, (fmt, kw)


def test_engram_tables_the_table_cannot_take_is_an_engine_args_error(monkeypatch):
    """A layout the table does not fit (here: forced) fails engine start-up with the option named."""
    from dsserve import LLM
    from dsserve.engine.args import EngineArgsError
    from dsserve.layers.engram import Engram

    def refuse(self, fmt="bf16", huge_pages=False, store=None, key=None):
        raise ValueError("fp8 needs D a multiple of 32, got 48")

    monkeypatch.setattr(Engram, "move_table_to_host", refuse)
    with pytest.raises(EngineArgsError, match="engram_tables='host-fp8': fp8 needs D a multiple of 32"):
        LLM(model="tiny", engram_tables="host-fp8")
