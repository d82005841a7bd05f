"""The fixed-shape training step (train.step): padded sequences give the unpadded sequences' loss and gradients, the
step reads nothing back to the host (so a GPU can capture it), and on a GPU the captured graph replays the eager
step."""

import copy
import traceback
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from dsserve.train.step import TrainStep
from dsserve.train.train import token_weights


def _model(name="tiny", dtype=torch.float64, device="cpu", **changes):
    cfg = replace(preset(name), **changes)
    m = DeepseekForCausalLM(cfg)
    dummy_weights(m, cfg, seed=0)
    for b in m.layers:
        b.ffn.every_expert = True  # the routed loop reads the routing back (torch.unique); training on a GPU does not
    return m.to(dtype).to(device).train()


def _batch(lengths, seed, vocab=8000):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        done = (torch.rand(n, generator=g) < 0.4).tolist()
        out.append((ids, done))
    return out


def _problems(lengths, seed, bos=0, vocab=8000):
    """Problems of ``lengths`` tokens, each from a BOS; the BOS itself is no target (None: what padding is)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = [bos] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()
        out.append((ids, [None] + (torch.rand(n - 1, generator=g) < 0.4).tolist()))
    return out


def _packed(groups):
    return [([t for ids, _ in g for t in ids], [c for _, done in g for c in done]) for g in groups]


def _reference(m, batch, prompt_weight, kl_weight, total_seqs, dense=False):
    """The step's loss written out per sequence, unpadded (each through the attention's loop, not the step's one
    batched attention of equal sequences): weighted next-token CE over the whole step's weight plus kl_weight x the
    mean indexer KL."""
    weights = token_weights(batch, prompt_weight)
    total = sum(map(sum, weights))
    loss, kls = 0.0, []
    for (ids, _), w in zip(batch, weights):
        kl = []
        hidden = m.forward(torch.tensor(ids), index_kl=kl, dense_entries=dense).hidden
        ce = torch.nn.functional.cross_entropy(m.logits(hidden[:-1]).float(), torch.tensor(ids[1:]), reduction="none")
        loss = loss + (ce * torch.tensor(w)).sum() / total
        kls += kl
    per_seq = len(kls) // len(batch)
    return loss + kl_weight * torch.stack(kls).sum() / (per_seq * total_seqs)


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "name,lengths,length,kl_weight,dense",
    [
        ("tiny", (70, 70), 70, 0.1, False),
        ("tiny", (45, 70, 12), 72, 0.0, False),
        ("tiny", (70, 70, 70), 70, 0.1, True),
        ("tiny", (45, 70), 71, 0.0, True),
        ("tiny-v4", (70, 70), 70, 0.1, False),
        ("tiny-v4", (70, 70), 70, 0.1, True),
    ],
)
def test_padded_step_equals_the_unpadded_sequences(name, lengths, length, kl_weight, dense):
    """Padding adds rows after each sequence (weight 0; causal, so earlier rows are untouched). The pad rows join the
    indexer KL, so with KL on the check uses sequences that need no padding. The step's sequences attend as one batch
    (CSA2Attention._attend_one_shape: window-only layers, and every layer in the dense mode); the reference runs
    each alone through the loop; top-k selection and candidate pools too, for all the step's rows at once."""
    m = _model(name)
    batch = _batch(lengths, seed=len(lengths))
    _reference(m, batch, 0.5, kl_weight, len(batch), dense).backward()
    want = _grads(m)
    step = TrainStep(m, len(batch), length, len(batch), kl_weight, dense=dense, graph=False, pad_id=1)
    step.load(batch, token_weights(batch, 0.5), sum(map(sum, token_weights(batch, 0.5))))
    out = step.run()
    got = _grads(m)
    assert want.keys() == got.keys() and len(got) > 50
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7 * float(g.abs().max()) + 1e-12), name
    assert out["kl_count"] > 0 and torch.isfinite(out["ce"]).all()


def test_a_step_too_long_is_named():
    m = _model(dtype=torch.float32)
    step = TrainStep(m, 1, 16, 1, 0.1, dense=False, graph=False, pad_id=1)
    with pytest.raises(ValueError, match="1 sequences of at most 16 tokens, got 1 of up to 20"):
        step.load(_batch((20,), 0), [[1.0] * 19], 19.0)


class _HostReads(TorchFunctionMode):
    """Records where tensors are read back to the host or made on it (what a CUDA graph capture refuses)."""

    READS = frozenset(
        {
            "item",
            "tolist",
            "__bool__",
            "__int__",
            "__float__",
            "__index__",
            "nonzero",
            "unique",
            "cpu",
            "numpy",
            "masked_select",
            "tensor",
            "as_tensor",
        }
    )
    # called without a device: made on the host, then uploaded
    FACTORIES = frozenset({"arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "linspace", "eye"})

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        bad = name in self.READS or (name in self.FACTORIES and "device" not in (kwargs or {}))
        if name in ("__getitem__", "__setitem__", "index_put_") and len(args) > 1:  # boolean-mask indexing
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            bad = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if bad:
            where = [f for f in traceback.extract_stack()[:-1] if "/dsserve/" in f.filename]
            self.seen.append((name, f"{where[-1].filename}:{where[-1].lineno}" if where else "?"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,isolate", [("tiny", None), ("tiny-v4", None), ("tiny", 0)])
@pytest.mark.parametrize("dense", [False, True])
def test_the_step_reads_nothing_back(name, isolate, dense):
    m = _model(name, torch.float32)
    batch = _batch((40, 64), seed=5) if isolate is None else _packed([_problems((12, 28), 5), _problems((64,), 6)])
    step = TrainStep(m, 2, 64, 2, 0.1, dense=dense, graph=False, pad_id=1, isolate_bos=isolate)
    step.load(batch, token_weights(batch, 0.5), 100.0)
    step.run()  # the first step makes per-device constants once (on a GPU: the eager warm-up steps)
    with _HostReads() as reads:
        step.run()
    assert reads.seen == []
    with _HostReads() as reads:  # the detector sees the reads the old paths made
        m.forward(torch.tensor(batch[0][0]), index_kl=[])
    assert reads.seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("isolate", [None, 0])
def test_the_captured_step_replays_the_eager_step(isolate):
    eager = _model(dtype=torch.float32, device="cuda")
    graphed = copy.deepcopy(eager)
    steps = {
        m: TrainStep(m, 2, 96, 2, 0.1, dense=False, graph=g, pad_id=1, isolate_bos=isolate)
        for m, g in ((eager, False), (graphed, True))
    }
    for seed in range(5):  # warm-up steps, the capture, then replays of fresh batches (other problem starts)
        batch = (
            _batch((96, 50), seed)
            if isolate is None
            else _packed([_problems((4 * (seed + 3), 96 - 4 * (seed + 3)), seed), _problems((48,), seed)])
        )
        w = token_weights(batch, 0.5)
        for step in steps.values():
            step.load(batch, w, sum(map(sum, w)))
            step.run()
        assert steps[graphed].graph is not None or seed < 2
        want, got = _grads(eager), _grads(graphed)
        assert want.keys() == got.keys()
        for n, g in want.items():
            assert torch.allclose(got[n], g, rtol=1e-4, atol=1e-6 * float(g.abs().max()) + 1e-10), (seed, n)


@pytest.mark.parametrize("dense", [False, True])
def test_isolated_packed_problems_train_as_sequences_of_their_own(dense):
    """``isolate_bos``: a step of sequences that pack several problems each (starting at multiples of
    problem_align) gives the loss and gradients of every problem run alone through the reference forward's loop:
    the CE summed over the step's weight, and each indexer's KL averaged over the rows of a packed sequence that see
    an entry (a problem of n rows has n - (r - 1) of them at ratio r: each row sees its own problem's entries only).
    Without isolation the same step gives other gradients (a problem's rows read the one before). QAT off: its fake
    quantisation of the rotated window keys rounds by absolute position, so a problem placed later in a pack rounds
    slightly differently (the attention itself depends only on distances)."""
    m = _model("tiny", qat=False)
    cfg, kl_weight = m.cfg, 0.1
    groups = [_problems((24, 40, 16), seed=1), _problems((36, 44), seed=2)]
    batch = _packed(groups)
    weights = token_weights(batch, 0.5)
    total = sum(map(sum, weights))
    ratios = [cfg.compress_ratios[i] for i in cfg.index_source_layer_ids]
    ce, kl_terms = 0.0, []
    for group in groups:
        per_layer = [[0.0, 0] for _ in ratios]
        for ids, done in group:
            kl = []
            hidden = m.forward(torch.tensor(ids), index_kl=kl, dense_entries=dense).hidden
            loss = torch.nn.functional.cross_entropy(
                m.logits(hidden[:-1]).float(), torch.tensor(ids[1:]), reduction="none"
            )
            w = torch.tensor(token_weights([(ids, done)], 0.5)[0])
            ce = ce + (loss * w).sum() / total
            assert len(kl) == len(ratios)
            for acc, k, r in zip(per_layer, kl, ratios):
                rows = len(ids) - (r - 1)
                acc[0], acc[1] = acc[0] + k * rows, acc[1] + rows
        kl_terms += [s / c for s, c in per_layer]
    (ce + kl_weight * torch.stack(kl_terms).sum() / len(kl_terms)).backward()
    want = _grads(m)
    for isolate, equal in ((0, True), (None, False)):
        step = TrainStep(m, 2, 80, 2, kl_weight, dense=dense, graph=False, pad_id=1, isolate_bos=isolate)
        step.load(batch, weights, total)
        step.run()
        got = _grads(m)
        assert want.keys() == got.keys() and len(got) > 50
        same = [torch.allclose(got[k], g, rtol=1e-5, atol=1e-7 * float(g.abs().max()) + 1e-12) for k, g in want.items()]
        assert all(same) if equal else not all(same)


def test_an_isolated_problem_off_the_alignment_is_named():
    m = _model(dtype=torch.float32)
    batch = _packed([_problems((6, 10), seed=0)])  # the second problem starts at 6: tiny aligns to 4
    step = TrainStep(m, 1, 16, 1, 0.1, dense=False, graph=False, pad_id=1, isolate_bos=0)
    with pytest.raises(ValueError, match="sequence 0: a problem starts at 6; isolated problems start at multiples"):
        step.load(batch, token_weights(batch, 0.5), 10.0)


def test_problem_bounds_outside_a_static_one_shape_step_are_refused():
    """segment_first only where the one-shape attention honours it: a static step of V4.1 (not the reference
    forward's loop, whose reads would ignore it; not V4's overlapping compression)."""
    from dsserve.layers.context import SeqRows, StepBatch
    from dsserve.models.model import ModelInputError

    m = _model(dtype=torch.float32)
    tokens, first = torch.arange(3, 11), torch.tensor([0, 0, 0, 0, 4, 4, 4, 4])
    with pytest.raises(ModelInputError, match="static step's packed problems"):
        m.forward_batch(StepBatch(tokens, [SeqRows(slice(0, 8), m.new_cache())], segment_first=first))
    with pytest.raises(ValueError, match="fresh sequences of one length"):  # static, but two lengths: the loop
        m.forward_batch(
            StepBatch(
                tokens,
                [SeqRows(slice(0, 3), m.new_cache()), SeqRows(slice(3, 8), m.new_cache())],
                static=True,
                segment_first=first,
            )
        )
    v4 = _model("tiny-v4", torch.float32)
    with pytest.raises(ModelInputError, match="V4.1"):
        v4.forward_batch(StepBatch(tokens, [SeqRows(slice(0, 8), v4.new_cache())], static=True, segment_first=first))
