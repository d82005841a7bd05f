"""Tensor parallelism (dsserve.distributed.tensor_parallel) on two gloo ranks: TP2 of the tiny V4.1 and V4 models
gives the single-process reference forward's logits within 1e-9 (fp64) and the same greedy tokens."""

import pytest
import torch
from tiny import greedy, sequences, tiny_model

from dsserve.distributed.groups import ParallelConfigError, new_groups
from dsserve.distributed.parallel_linear import vocab_shards
from dsserve.distributed.tensor_parallel import shard_tensor_parallel, tp_slice
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset

# 40 rows: past the 32-row window and with compressed entries on every compressed layer
LENGTHS = (5, 17, 40)
STEPS = 3


def _reference_ops():
    from dsserve.kernels.ops import OPS, KernelOps

    return KernelOps(frozenset(OPS))  # every kernelised op on its torch reference


@torch.no_grad()
def _tp2(rank: int, name: str, ops=False) -> dict:
    groups = new_groups(2, 1)
    model = shard_tensor_parallel(tiny_model(name), groups.tp_rank, 2, groups.tp)
    model.kernel_ops = _reference_ops() if ops else None
    seqs = sequences(1, LENGTHS)
    return {
        "logits": [model.reference_logits(s) for s in seqs],
        "greedy": [greedy(model, s, STEPS) for s in seqs[:2]],
        "heads": model.layers[0].attn.attn_sink.shape[0],
        "experts": tuple(model.layers[0].ffn.experts["w1"].shape),
    }


@pytest.mark.parametrize("name", ["tiny", "tiny-v4"])
def test_tp2_matches_the_reference_forward(workers, name):
    out = workers.run(_tp2, name)
    ref = tiny_model(name)
    cfg = ref.cfg
    for o in out:  # each rank really holds its share
        assert o["heads"] == cfg.num_attention_heads // 2
        assert o["experts"] == (cfg.n_routed_experts, cfg.moe_intermediate_size // 2, cfg.hidden_size)
    with torch.no_grad():
        for i, s in enumerate(sequences(1, LENGTHS)):
            want = ref.reference_logits(s)
            for o in out:
                err = (o["logits"][i] - want).abs().max().item()
                assert err < 1e-9, (name, i, err)
            assert torch.equal(out[0]["logits"][i], out[1]["logits"][i])  # every rank sees the same logits
        for i, s in enumerate(sequences(1, LENGTHS)[:2]):
            assert out[0]["greedy"][i] == out[1]["greedy"][i] == greedy(ref, s, STEPS)


def test_tp2_with_kernel_ops(workers):
    """The MoE (router, grouped experts), mHC and the query's norms and RoPE through kernels.ops (their torch
    references here): the MoE's all-reduce closes the kernel path's output too."""
    out = workers.run(_tp2, "tiny", True)
    ref = tiny_model("tiny")
    ref.kernel_ops = _reference_ops()
    with torch.no_grad():
        for i, s in enumerate(sequences(1, LENGTHS)):
            want = ref.reference_logits(s)
            assert max((o["logits"][i] - want).abs().max().item() for o in out) < 1e-9


def test_quantising_after_sharding_keeps_the_all_reduce():
    from dsserve.distributed.parallel_linear import RowParallelLinear
    from dsserve.models.quantize import quantize_dense_fp8

    model = shard_tensor_parallel(tiny_model("tiny"), 0, 2, None)
    assert quantize_dense_fp8(model, 32) > 0
    assert all(isinstance(b.attn.wo_b, RowParallelLinear) for b in model.layers)
    with pytest.raises(ParallelConfigError, match="quantised or already sharded"):
        shard_tensor_parallel(model, 0, 2, None)


def test_sharding_checks_the_split():
    model = tiny_model("tiny")
    with pytest.raises(ParallelConfigError, match="num_attention_heads=4"):
        shard_tensor_parallel(model, 0, 3, None)
    with pytest.raises(ParallelConfigError, match="tp_rank=2"):
        shard_tensor_parallel(model, 2, 2, None)
    assert shard_tensor_parallel(model, 0, 1, None) is model


def test_vocab_shards_cover_the_vocabulary():
    assert vocab_shards(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert vocab_shards(8192, 2) == [(0, 4096), (4096, 8192)]


@pytest.mark.parametrize("name", ["tiny", "tiny-v4"])
def test_each_rank_holds_the_tp_slice_of_every_tensor(name):
    """The rule a shard-aware loader reads by (tp_slice) is the one the pass cuts by; names are kept."""
    full = tiny_model(name).state_dict()
    for rank in range(2):
        sharded = shard_tensor_parallel(tiny_model(name), rank, 2, None).state_dict()  # None: shapes only
        assert sharded.keys() == full.keys()
        cut = 0
        for key, t in sharded.items():
            s = tp_slice(key, preset(name), rank, 2)
            want = full[key] if s is None else full[key].narrow(s[0], s[1], s[2] - s[1])
            assert torch.equal(t, want), key
            cut += s is not None
        stages = sum(k.startswith("mtp.") and k.endswith(".ffn.experts.w1") for k in full)  # DSpark (V4.1)
        # embed, head; 10 a layer (4 attention, 6 MoE); 6 a DSpark stage (its MoE)
        assert cut == 2 + 10 * preset(name).num_hidden_layers + 6 * stages


def test_a_meta_model_shards_to_its_shard_shapes():
    with torch.device("meta"):
        model = DeepseekForCausalLM(preset("tiny"))
    sd = shard_tensor_parallel(model, 1, 2, None).state_dict()
    assert all(t.is_meta for t in sd.values())
    assert sd["head.weight"].shape == (4096, 256) and sd["layers.3.ffn.experts.w2"].shape == (8, 256, 64)
