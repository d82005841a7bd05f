"""TP2 x DP2 on four gloo ranks: two replicas, each tensor-parallel over its two ranks, with the routed experts
spread over the replicas (expert parallel within each TP index) and the attention data-parallel. Each replica runs
its own sequences; its logits equal the single-process reference forward's within 1e-9 (fp64), an idle replica
included; built from a release checkpoint, each rank reads only its share."""

import pytest
import torch
from tiny import sequences, tiny_model

from dsserve.distributed.expert_parallel import idle_forward, shard_expert_parallel
from dsserve.distributed.groups import new_groups
from dsserve.distributed.layout import ParallelLayout
from dsserve.distributed.tensor_parallel import shard_tensor_parallel, tp_slice
from dsserve.models.checkpoint import save_checkpoint
from dsserve.models.checkpoint_layout import model_name_for, model_shapes, release_layout
from dsserve.models.loader import load_model
from dsserve.models.release_loader import load_release

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


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    src = load_model("tiny", seed=7)
    out = tmp_path_factory.mktemp("tiny-release-tp-dp")
    save_checkpoint(src.model, src.cfg, str(out), max_shard_bytes=8 << 20)
    return src.cfg, str(out)


@torch.no_grad()
def _tp2_dp2_from_files(rank: int, cfg, path: str) -> dict:
    g = new_groups(2, 2)
    layout = ParallelLayout(tp_rank=g.tp_rank, tp_size=2, ep_rank=g.dp_rank, ep_size=2)
    forms = {"quantization": "fp8", "expert_format": "mxfp4", "keep_dense": False}
    model, report = load_release(cfg, path, layout=layout, dtype=torch.float64, tp_group=g.tp, ep_group=g.ep, **forms)
    logits = [model.reference_logits(s) for s in sequences(20 + g.dp_rank, REPLICA_LENGTHS[g.dp_rank])]
    return {"tp": g.tp_rank, "dp": g.dp_rank, "logits": logits, "bytes_read": report.bytes_read}


def test_tp2_dp2_built_from_files(workers, saved):
    """EP over the replicas, then TP within each, FP8 linears and MXFP4 experts as stored: a rank reads the TP
    slices of its 4 of 8 backbone experts, its 2 of 4 drafter experts whole (TP leaves the drafter whole),
    tp_slice of every other tensor."""
    cfg, path = saved
    out = workers.run(_tp2_dp2_from_files, cfg, path)
    ref, _ = load_release(cfg, path, dtype=torch.float64, quantization="fp8", expert_format="mxfp4", keep_dense=False)
    shapes = model_shapes(cfg)
    for o in out:
        want = 0
        for name, spec in release_layout(cfg).items():
            mname, e = model_name_for(spec.owner or name)
            n = cfg.n_routed_experts if mname.startswith("layers.") else cfg.dspark_n_routed_experts
            if e is not None and e // (n // 2) != o["dp"]:
                continue
            cut = tp_slice(mname, cfg, o["tp"], 2)
            want += spec.nbytes if cut is None else spec.nbytes * (cut[2] - cut[1]) // shapes[mname][0][cut[0]]
        assert o["bytes_read"] == want
        with torch.no_grad():
            for s, got in zip(sequences(20 + o["dp"], REPLICA_LENGTHS[o["dp"]]), o["logits"], strict=True):
                err = (got - ref.reference_logits(s)).abs().max().item()
                assert err < 1e-9, (o["dp"], o["tp"], s.shape[0], err)
