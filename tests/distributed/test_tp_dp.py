"""TP2 x DP2 on four gloo ranks: two replicas, each tensor-parallel over its two ranks, with the routed experts
spread over the replicas (expert parallel within each TP index) and the attention data-parallel. Each replica runs
its own sequences; its logits equal the single-process reference forward's within 1e-9 (fp64), an idle replica
included."""

import torch
from tiny import sequences, tiny_model

from dsserve.distributed.expert_parallel import idle_forward, shard_expert_parallel
from dsserve.distributed.groups import new_groups
from dsserve.distributed.tensor_parallel import shard_tensor_parallel

WORLD = 4
REPLICA_LENGTHS = ((7, 36), (21, 4))


@torch.no_grad()
def _tp2_dp2(rank: int, name: str, idle_replica) -> dict:
    g = new_groups(2, 2)
    model = shard_expert_parallel(tiny_model(name), g.dp_rank, 2, g.ep)  # first: it replaces the MoE modules
    model = shard_tensor_parallel(model, g.tp_rank, 2, g.tp)
    logits = []
    for s in sequences(20 + g.dp_rank, REPLICA_LENGTHS[g.dp_rank]):
        if g.dp_rank == idle_replica:
            idle_forward(model)
        else:
            logits.append(model.reference_logits(s))
    return {
        "tp": g.tp_rank,
        "dp": g.dp_rank,
        "logits": logits,
        "experts": tuple(model.layers[0].ffn.experts["w1"].shape),
    }


def _check(out, name, idle_replica):
    ref = tiny_model(name)
    cfg = ref.cfg
    assert [(o["dp"], o["tp"]) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with torch.no_grad():
        for o in out:
            assert o["experts"] == (cfg.n_routed_experts // 2, cfg.moe_intermediate_size // 2, cfg.hidden_size)
            if o["dp"] == idle_replica:
                assert o["logits"] == []
                continue
            seqs = sequences(20 + o["dp"], REPLICA_LENGTHS[o["dp"]])
            assert len(o["logits"]) == len(seqs)
            for s, got in zip(seqs, o["logits"]):
                err = (got - ref.reference_logits(s)).abs().max().item()
                assert err < 1e-9, (name, o["dp"], o["tp"], s.shape[0], err)


def test_tp2_dp2_matches_the_reference_forward(workers):
    _check(workers.run(_tp2_dp2, "tiny", None), "tiny", None)  # tiny-v4 is covered by TP2 and DEP2 alone


def test_tp2_dp2_with_an_idle_replica(workers):
    _check(workers.run(_tp2_dp2, "tiny", 1), "tiny", 1)
