"""Expert parallelism with data-parallel attention (DEP) as a pass over the single-process model.

``shard_expert_parallel`` replaces every layer's MoE by an ``ExpertParallelMoE`` holding only this rank's routed
experts (an ``ExpertPlacement``: contiguous ranges or given lists). Everything else stays whole on every rank:
attention runs on the rank's own rows (its own sequences and caches: DP attention), as do the router and the
shared expert; only the routed experts' rows cross ranks, by ``dispatcher.AllToAllDispatcher`` (three collectives
a MoE layer). Every EP rank must run the same number of forwards: a rank with no rows runs ``idle_forward``, which
joins each MoE layer's collectives with zero rows (vLLM's and SGLang's dummy batch, without the dummy token).

The reference path only (``ops`` None): the kernel path (``ops.route``, ``ops.routed_experts`` on the received
rows as top-1 picks) is the next step (docs/parallel.md). The DSpark drafter's MoE is left whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..layers.moe import clamped_swiglu
from ..layers.numerics import acc
from .dispatcher import AllToAllDispatcher
from .expert_placement import ExpertPlacement
from .groups import ParallelConfigError


class ExpertParallelMoE(nn.Module):
    """A ``layers.moe.MoE`` whose routed experts are spread over an EP group: same call, same parameter names
    (``gate``, ``shared_experts``, ``experts`` holding this rank's experts in the placement's local order)."""

    def __init__(self, moe: nn.Module, placement: ExpertPlacement, ep_rank: int, group: dist.ProcessGroup | None):
        super().__init__()
        if moe.experts["w1"].shape[0] != placement.n_experts:
            raise ParallelConfigError(
                f"the placement is for {placement.n_experts} experts, the MoE has {moe.experts['w1'].shape[0]}"
            )
        if getattr(moe, "packed", None) is not None:
            raise ParallelConfigError("expert parallelism takes the plain float experts; pack them after sharding")
        self.limit, self.gate, self.shared_experts = moe.limit, moe.gate, moe.shared_experts
        mine = list(placement.owned[ep_rank])
        self.experts = nn.ParameterDict(
            {n: nn.Parameter(p.detach()[mine].clone(), requires_grad=p.requires_grad) for n, p in moe.experts.items()}
        )
        self.ep_rank, self.dispatcher = ep_rank, AllToAllDispatcher(placement, group)

    def forward(
        self, x: torch.Tensor, tokens: torch.Tensor, is_image: torch.Tensor | None = None, ops=None
    ) -> torch.Tensor:
        if ops is not None:
            raise ParallelConfigError("the expert-parallel MoE runs the reference path only (kernel ops: not yet)")
        ids, w = self.gate(x, tokens, is_image)
        rows, local, weights, handle = self.dispatcher.prepare(x, ids, w)
        routed = self.dispatcher.finalize(self.run_local(rows, local, weights), handle)
        return (routed + acc(self.shared_experts(x))).to(x.dtype)

    def run_local(self, rows: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert, weighted before the down projection (MoE.forward's
        arithmetic); one output row per input row, in x's dtype."""
        w1, w2, w3 = self.experts["w1"], self.experts["w2"], self.experts["w3"]
        out = torch.empty(rows.shape[0], w2.shape[1], dtype=rows.dtype, device=rows.device)
        for j in torch.unique(local).tolist():
            sel = torch.nonzero(local == j, as_tuple=True)[0]
            xe = rows[sel]
            he = clamped_swiglu(xe @ w1[j].t(), xe @ w3[j].t(), self.limit)
            out[sel] = (acc(he) * weights[sel, None]).to(rows.dtype) @ w2[j].t()
        return out


def shard_expert_parallel(
    model: nn.Module,
    ep_rank: int,
    ep_size: int,
    group: dist.ProcessGroup | None,
    placement: ExpertPlacement | None = None,
) -> nn.Module:
    """Replace every layer's MoE of ``model`` by an ``ExpertParallelMoE`` for EP rank ``ep_rank`` of ``ep_size``
    (``placement`` default: contiguous ranges) in place; returns the model."""
    if not 0 <= ep_rank < ep_size:
        raise ParallelConfigError(f"ep_rank={ep_rank} must lie in [0, ep_size={ep_size})")
    placement = placement or ExpertPlacement.contiguous(model.cfg.n_routed_experts, ep_size)
    if placement.ep_size != ep_size:
        raise ParallelConfigError(f"the placement spans {placement.ep_size} ranks, ep_size is {ep_size}")
    for block in model.layers:
        block.ffn = ExpertParallelMoE(block.ffn, placement, ep_rank, group)
    return model


def idle_forward(model: nn.Module) -> None:
    """A forward with no rows on an expert-parallel model: joins every MoE layer's collectives with zero rows, so
    the ranks with rows are not left waiting. Nothing is read from or written to any cache."""
    w = model.embed.weight
    x = w.new_zeros(0, model.cfg.hidden_size)
    tokens = torch.zeros(0, dtype=torch.long, device=w.device)
    for block in model.layers:
        block.ffn(x, tokens)
