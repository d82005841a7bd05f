"""Tensor parallelism as a pass over the single-process model (gpt-fast's ``apply_tp``): ``shard_tensor_parallel``
cuts a built model's weights down to one TP rank's share in place and puts the collective where each split closes.
The model's code and its reference forward stay single-process; every rank runs the same forward on the same rows.

What is split (docs/parallel.md, the spec's section 2; vLLM and SGLang do the same for this family):

| module | split | closes with |
|---|---|---|
| attention ``wq_b``, ``attn_sink`` | by head: H / T heads a rank | - |
| attention ``wo_a`` (block-diagonal over the G output groups) | by group: G / T groups a rank | - |
| attention ``wo_b`` | its input columns, by group | all-reduce (``RowParallelLinear``) |
| shared expert ``w1``/``w3``, ``w2`` | the intermediate: rows, columns | the MoE's all-reduce |
| routed experts ``w1``/``w3``, ``w2`` | each expert's intermediate | the same all-reduce (one per MoE) |
| ``embed`` | vocabulary rows | all-reduce (``VocabParallelEmbedding``) |
| ``head`` | vocabulary rows | all-gather of the logits (``VocabParallelHead``) |

The DSpark drafter's MoE (shared and routed experts) is split the same way, closing with its own all-reduce; the
rest of the drafter is replicated. Replicated: ``wq_a`` and ``q_norm`` (the norm needs the whole latent), ``wkv``
and ``kv_norm`` (one K = V latent a token: every rank keeps the full window rows and global KV, as vLLM does),
compressors, indexers, routers, mHC, norms, Engram, the drafter's attention and heads. The attention module gets a
config with its local head and group counts, so every path that reads ``attn.cfg`` (the reference loop, the paged
kernels) sees its own shapes.

Routed experts are split on the intermediate dimension, not replicated: the routed and shared partial sums then
close with one all-reduce per MoE layer; each rank holds 1/T of every expert (replicating would hold all of them
on every rank and compute each routed row T times); every rank works on every routed row, so the load is even
whatever the router picks; and 2304 / T stays a multiple of the 32-wide MXFP4 block for T <= 8. The MoE's sum runs
as a forward hook on the MoE module, which keeps its class and parameter names (a checkpoint shard loads by name).

The pass takes plain float weights (before ``models.quantize``): quantised modules are refused, as a row-parallel
wo_b swapped for an Fp8Linear afterwards would lose its all-reduce. Apply ``shard_expert_parallel`` first when
both are used (it replaces the MoE modules; this pass then splits the experts they kept).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from .all_reduce import all_reduce_sum
from .groups import ParallelConfigError
from .handshake import agree
from .parallel_linear import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, vocab_shards


def _keep(t: torch.Tensor, dim: int, start: int, end: int) -> nn.Parameter:
    return nn.Parameter(t.detach().narrow(dim, start, end - start).clone(), requires_grad=t.requires_grad)


def _span(n: int, rank: int, size: int) -> tuple[int, int]:
    return n // size * rank, n // size * (rank + 1)


def check_tp_split(cfg, tp_size: int) -> None:
    """Raise ParallelConfigError unless every count ``tp_slice`` splits divides by ``tp_size`` (the vocabulary need
    not: ``vocab_shards``)."""
    need = {
        "num_attention_heads": cfg.num_attention_heads,
        "o_groups": cfg.o_groups,
        "moe_intermediate_size": cfg.moe_intermediate_size,
    }
    bad = [f"{k}={v}" for k, v in need.items() if v % tp_size]
    if bad:
        raise ParallelConfigError(f"tensor parallel size {tp_size} must divide {', '.join(bad)}")


def check_tensor_parallel(model: nn.Module, tp_size: int) -> None:
    """Raise ParallelConfigError unless ``model`` splits ``tp_size`` ways (every count divides, plain weights)."""
    check_tp_split(model.cfg, tp_size)
    for block in model.layers:
        linears = (block.attn.wq_b, block.attn.wo_a, block.attn.wo_b, block.ffn.shared_experts.w1)
        if any(type(m) is not nn.Linear for m in linears) or getattr(block.ffn, "packed", None) is not None:
            raise ParallelConfigError(
                f"layer {block.role.index} is quantised or already sharded: tensor parallelism splits the plain "
                "float model; quantise after sharding"
            )


_LAYER = re.compile(
    r"layers\.\d+\.(attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)|ffn\.(shared_experts\.w[123]\.weight|experts\.w[123]))"
    r"|mtp\.\d+\.(ffn\.(shared_experts\.w[123]\.weight|experts\.w[123]))"  # the drafter: its MoE only
)


def tp_slice(name: str, cfg, tp_rank: int, tp_size: int) -> tuple[int, int, int] | None:
    """Which part of the full tensor ``name`` (a ``DeepseekForCausalLM`` state-dict name) TP rank ``tp_rank`` of
    ``tp_size`` holds: (dim, start, end), or None (replicated). The one rule the pass cuts by, and the one a
    shard-aware loader reads by (docs/parallel.md)."""
    if name in ("embed.weight", "head.weight"):
        return (0, *vocab_shards(cfg.vocab_size, tp_size)[tp_rank])
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    part = m.group(1) or m.group(4)
    if part.startswith("attn."):
        h0, h1 = _span(cfg.num_attention_heads, tp_rank, tp_size)
        g0, g1 = _span(cfg.o_groups, tp_rank, tp_size)
        hd, r = cfg.head_dim, cfg.o_lora_rank
        return {
            "attn.wq_b.weight": (0, h0 * hd, h1 * hd),
            "attn.attn_sink": (0, h0, h1),
            "attn.wo_a.weight": (0, g0 * r, g1 * r),  # the rows of groups g0..g1, whose inputs are its heads
            "attn.wo_b.weight": (1, g0 * r, g1 * r),
        }[part]
    shared = part.startswith("ffn.shared_experts.")
    inter = cfg.moe_intermediate_size * (cfg.n_shared_experts if shared else 1)
    i0, i1 = _span(inter, tp_rank, tp_size)
    down = ".w2" in part
    return ((1 if down else 0) if shared else (2 if down else 1), i0, i1)


def shard_tensor_parallel(model: nn.Module, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None) -> nn.Module:
    """Cut ``model`` (a built ``DeepseekForCausalLM``, on any device, the meta device included) to TP rank
    ``tp_rank`` of ``tp_size`` in place (module docstring; ``tp_slice`` per tensor) and return it. Every rank of
    ``group`` must shard the same model the same way; each then runs the unchanged forward on the same rows and
    gets the same logits; ranks that disagree on the config fail here, all of them (handshake.agree). tp_size 1
    leaves the model as it is. ``group`` None: no communication (a model sharded
    for its shapes only)."""
    if not 0 <= tp_rank < tp_size:
        raise ParallelConfigError(f"tp_rank={tp_rank} must lie in [0, tp_size={tp_size})")
    if group is not None and dist.get_world_size(group) != tp_size:
        raise ParallelConfigError(f"the TP group has {dist.get_world_size(group)} ranks, tp_size is {tp_size}")
    if tp_size == 1:
        return model
    check_tensor_parallel(model, tp_size)
    cfg = model.cfg
    agree("the model config and tp_size", repr((cfg, tp_size)), group)
    with torch.no_grad():
        for name, p in list(model.named_parameters()):
            cut = tp_slice(name, cfg, tp_rank, tp_size)
            if cut is not None:
                owner, leaf = name.rsplit(".", 1)
                setattr(model.get_submodule(owner), leaf, _keep(p, *cut))
        for block in model.layers:
            attn = block.attn
            attn.wq_b.out_features, attn.wo_a.out_features = attn.wq_b.weight.shape[0], attn.wo_a.weight.shape[0]
            attn.wo_b = RowParallelLinear(attn.wo_b.weight, group)
            # the local shapes, for every path that reads them from attn.cfg
            attn.cfg = replace(
                attn.cfg,
                num_attention_heads=attn.cfg.num_attention_heads // tp_size,
                o_groups=attn.cfg.o_groups // tp_size,
            )
        for block in list(model.layers) + list(getattr(model, "mtp", None) or ()):
            shared = block.ffn.shared_experts
            shared.w1.out_features = shared.w3.out_features = shared.w2.in_features = shared.w1.weight.shape[0]
            block.ffn.register_forward_hook(_SumOver(group))  # routed and shared partials: one sum
        shards = vocab_shards(cfg.vocab_size, tp_size)
        start = shards[tp_rank][0]
        model.embed = VocabParallelEmbedding(model.embed.weight, start, cfg.vocab_size, group)
        model.head = VocabParallelHead(model.head.weight, [b - a for a, b in shards], group)
    return model


class _SumOver:
    """A forward hook completing a module's partial output with an all-reduce over the group."""

    def __init__(self, group):
        self.group = group

    def __call__(self, module, args, output):
        return all_reduce_sum(output, self.group)
