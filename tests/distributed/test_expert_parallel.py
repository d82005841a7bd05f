"""Expert parallelism with data-parallel attention (DEP2) on two gloo ranks: each rank runs its own sequences, the
routed experts are spread over both, and each rank's logits equal the single-process reference forward's on its
sequences within 1e-9 (fp64). A rank with no rows joins every collective (no hang) and changes nothing."""

import pytest
import torch
from tiny import sequences, tiny_model

from dsserve.distributed.expert_parallel import ExpertParallelMoE, idle_draft, idle_forward, shard_expert_parallel
from dsserve.distributed.expert_placement import ExpertPlacement
from dsserve.distributed.groups import ParallelConfigError, new_groups

# Each rank's own sequences, as many forwards on each rank (every forward is a collective over both).
RANK_LENGTHS = ((6, 40, 3), (19, 9, 33))
LISTS = ((5, 0, 3, 6), (1, 2, 4, 7))  # a given placement, local order not sorted


def _reference_ops():
    from dsserve.kernels.ops import OPS, KernelOps

    return KernelOps(frozenset(OPS))  # every kernelised op on its torch reference


def _packed(model, fmt):
    from dsserve.models.quantize import quantize_experts

    if fmt is not None:
        quantize_experts(model, fmt, keep_dense=False)  # only the packed bytes: the reference dequantises them
    return model


@torch.no_grad()
def _dep2(rank: int, name: str, lists, idle_rank, ops=False, fmt=None) -> dict:
    groups = new_groups(1, 2)
    placement = None if lists is None else ExpertPlacement(8, lists)
    model = _packed(tiny_model(name), fmt if rank == 0 else None)  # rank 0 packs before sharding, rank 1 after
    model = _packed(shard_expert_parallel(model, groups.dp_rank, 2, groups.ep, placement), fmt if rank else None)
    model.kernel_ops = _reference_ops() if ops else None
    logits = []
    for s in sequences(10 + rank, RANK_LENGTHS[rank]):
        if rank == idle_rank:
            idle_forward(model)
        else:
            logits.append(model.reference_logits(s))
    d = model.layers[0].ffn.dispatcher
    return {"logits": logits, "sent": d.rows_sent, "received": d.rows_received}


def _check(out, name, idle_rank=None, ops=False, fmt=None):
    ref = _packed(tiny_model(name), fmt)
    ref.kernel_ops = _reference_ops() if ops else None
    with torch.no_grad():
        for rank, o in enumerate(out):
            if rank == idle_rank:
                assert o["logits"] == [] and o["sent"] == 0
                continue
            seqs = sequences(10 + rank, RANK_LENGTHS[rank])
            assert len(o["logits"]) == len(seqs)
            for s, got in zip(seqs, o["logits"]):
                err = (got - ref.reference_logits(s)).abs().max().item()
                assert err < 1e-9, (name, rank, s.shape[0], err)


@pytest.mark.parametrize("name", ["tiny", "tiny-v4"])
def test_dep2_matches_the_reference_forward(workers, name):
    out = workers.run(_dep2, name, None, None)
    _check(out, name)
    k = 2  # top-k
    for rank, o in enumerate(out):  # rows really crossed: each rank ran rows it did not route
        assert o["sent"] == k * sum(RANK_LENGTHS[rank]) and o["received"] > 0
    assert out[0]["received"] + out[1]["received"] == out[0]["sent"] + out[1]["sent"]


def test_dep2_with_a_given_placement(workers):
    _check(workers.run(_dep2, "tiny", LISTS, None), "tiny")


def test_dep2_with_kernel_ops(workers):
    """The router and the grouped experts through kernels.ops (their torch references here), on both sides."""
    _check(workers.run(_dep2, "tiny", None, None, True), "tiny", ops=True)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_dep2_with_packed_experts(workers, fmt):
    """The release's expert formats, packed before sharding on one rank and after it on the other, dense copies
    dropped: the reference path and the kernel ops (references) dequantise this rank's experts."""
    _check(workers.run(_dep2, "tiny", None, None, False, fmt), "tiny", fmt=fmt)
    _check(workers.run(_dep2, "tiny", None, None, True, fmt), "tiny", ops=True, fmt=fmt)


def test_an_idle_rank_joins_every_collective(workers):
    _check(workers.run(_dep2, "tiny", None, 1), "tiny", idle_rank=1)
    _check(workers.run(_dep2, "tiny-v4", None, 0), "tiny-v4", idle_rank=0)


@pytest.mark.parametrize("name,layer", [("tiny", 5), ("tiny-v4", 0)])  # tiny-v4's layer 0 routes by token (hash)
def test_one_rank_is_the_reference_moe_exactly(name, layer):
    moe = tiny_model(name).layers[layer].ffn
    ep = ExpertParallelMoE(moe, ExpertPlacement.contiguous(8, 1), 0, None)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, moe.gate.weight.shape[1], generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 8000, (11,), generator=g)
    with torch.no_grad():
        assert torch.equal(ep(x, tokens), moe(x, tokens))
        assert ep(x[:0], tokens[:0]).shape == (0, x.shape[1])
        ops = _reference_ops()
        assert (ep(x, tokens, None, ops) - moe(x, tokens, None, ops)).abs().max() < 1e-12


def test_placements_are_checked():
    assert ExpertPlacement.contiguous(8, 2).owned == ((0, 1, 2, 3), (4, 5, 6, 7))
    p = ExpertPlacement(8, LISTS)
    assert p.owner().tolist() == [0, 1, 1, 0, 1, 0, 0, 1] and p.local_index().tolist() == [1, 0, 1, 2, 2, 0, 3, 3]
    with pytest.raises(ParallelConfigError, match="exactly once"):
        ExpertPlacement(8, ((0, 1, 2), (3, 4, 5, 6, 6)))
    with pytest.raises(ParallelConfigError, match="must divide the 8"):
        ExpertPlacement.contiguous(8, 3)
    with pytest.raises(ParallelConfigError, match="ep_rank=2"):
        shard_expert_parallel(tiny_model("tiny"), 2, 2, None)
    with pytest.raises(ParallelConfigError, match="already expert-parallel"):
        shard_expert_parallel(shard_expert_parallel(tiny_model("tiny"), 0, 2, None), 0, 2, None)


@torch.no_grad()
def _replay_stop(rank: int, ep: bool) -> list:
    """Rank 0: a 60-row prompt in two chunks under bounded replay (decoder from row 28: the first chunk's rows all
    stop before the decoder, the forward leaves the layer loop early), then 2 decode steps. Rank 1: 4 full
    forwards of its own sequences. ``ep`` False: the unsharded model in this process (the oracle of the calls)."""
    model = tiny_model("tiny")
    if ep:
        g = new_groups(1, 2)
        model = shard_expert_parallel(model, g.dp_rank, 2, g.ep)
    if rank == 1:
        return [model.reference_logits(s) for s in sequences(30, (5, 12, 8, 30))]
    prompt, cache, out = sequences(31, (60,))[0], model.new_cache(), []
    for rows in (prompt[:20], prompt[20:]):
        out.append(model.logits(model(rows, cache, decoder_start=28).hidden))
    assert out[0].shape[0] == 0  # the first chunk ran no decoder row
    for _ in range(2):
        out.append(model.logits(model(out[-1][-1:].argmax(-1), cache, decoder_start=28).hidden))
    return out


def test_a_forward_that_stops_before_the_decoder_still_joins(workers):
    """Without the join the early-stopping rank skips layer 6..11's MoE collectives and both ranks time out."""
    out = workers.run(_replay_stop, True)
    for rank in range(2):
        want = _replay_stop(rank, False)
        assert len(out[rank]) == len(want)
        for got, w in zip(out[rank], want):
            assert got.shape == w.shape
            assert got.numel() == 0 or (got - w).abs().max().item() < 1e-9


def _draft(model, seq):
    out = model(seq)
    y = int(model.logits(out.hidden[-1:]).argmax())
    state = model.mtp.new_state()
    model.mtp.ingest(out.taps, out.positions, state)
    return model.mtp.propose(y, seq.shape[0] - 1, state, model.embed, model.head)


@torch.no_grad()
def _dep2_draft(rank: int) -> dict:
    groups = new_groups(1, 2)
    model = shard_expert_parallel(tiny_model("tiny"), groups.dp_rank, 2, groups.ep)
    held = model.mtp[0].ffn.experts["w1"].shape[0]
    if rank == 1:  # a target forward of its own, then nothing to draft: it joins rank 0's draft pass
        model(sequences(31, (9,))[0])
        idle_draft(model)
        return {"held": held, "draft": None}
    return {"held": held, "draft": _draft(model, sequences(30, (24,))[0])}


def test_a_draft_pass_is_expert_parallel_and_an_idle_rank_joins_it(workers):
    """The DSpark drafter's MoE is spread over the EP ranks like a layer's (its own 4 experts, 2 a rank); a rank
    with nothing to draft joins the draft pass with idle_draft (without it rank 0 would time out)."""
    out = workers.run(_dep2_draft)
    assert [o["held"] for o in out] == [2, 2]
    ref = tiny_model("tiny")
    with torch.no_grad():
        want = _draft(ref, sequences(30, (24,))[0])
    got = out[0]["draft"]
    assert torch.equal(got[0], want[0])
    assert max((a - b).abs().max().item() for a, b in zip(got[1:], want[1:])) < 1e-9
