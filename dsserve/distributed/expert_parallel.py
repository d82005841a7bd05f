"""Expert parallelism with data-parallel attention (DEP) as a pass over the single-process model.

``shard_expert_parallel`` replaces every layer's MoE by an ``ExpertParallelMoE`` holding only this rank's routed
experts (an ``ExpertPlacement``: contiguous ranges or given lists). Everything else stays whole on every rank:
attention runs on the rank's own rows (its own sequences and caches: DP attention), as do the router and the
shared expert; only the routed experts' rows cross ranks, by ``dispatcher.AllToAllDispatcher`` (three collectives
a MoE layer). Every EP rank must run the same number of forwards: a rank with no rows runs ``idle_forward``, which
joins each MoE layer's collectives with zero rows (vLLM's and SGLang's dummy batch, without the dummy token). A
forward that stops early (bounded replay: no row of the step reaches the decoder, so ``forward_batch`` leaves the
layer loop and the narrowing layer's MoE is skipped) joins the MoE layers it skipped the same way, after it: the pass
wraps the model's ``forward_batch``. Fixed-shape runners (CUDA graphs) are not supported under EP: the dispatch
reads its counts on the host.

With kernel ops the router is ``ops.route`` and the local experts run as ``ops.routed_experts`` on the received rows,
each a top-1 pick (the same products); packed experts (FP8, MXFP4) are sliced by expert like the dense ones. The
DSpark drafter's MoE is spread the same way over its own experts (the spec's P_d, contiguous by the same rule), so a
draft pass is a collective too: every EP rank runs as many as its peers, ``idle_draft`` where it has nothing to draft.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..layers.moe import clamped_swiglu
from ..layers.numerics import acc
from .dispatcher import AllToAllDispatcher
from .eplb_replicas import ReplicaMap
from .expert_placement import ExpertPlacement
from .groups import ParallelConfigError
from .handshake import agree


class ExpertParallelMoE(nn.Module):
    """A ``layers.moe.MoE`` whose routed experts are spread over an EP group: same call, same parameter names
    (``gate``, ``shared_experts``, ``experts`` holding this rank's experts in the placement's local order)."""

    def __init__(
        self,
        moe: nn.Module,
        placement: ExpertPlacement,
        ep_rank: int,
        group: dist.ProcessGroup | None,
        phy2log: tuple[int, ...] | None = None,
    ):
        """``phy2log`` (EPLB): the placement is over physical slots, slot s holding logical expert phy2log[s]
        (redundant replicas: an expert in several slots); None: slot = logical expert."""
        super().__init__()
        packed = getattr(moe, "packed", None)
        n = moe.experts["w1"].shape[0] if "w1" in moe.experts else packed.w1.shape[0]
        slots = n if phy2log is None else len(phy2log)
        if slots != placement.n_experts:
            raise ParallelConfigError(f"the placement is for {placement.n_experts} experts, the MoE has {slots}")
        if phy2log is not None and sorted(set(phy2log)) != list(range(n)):
            raise ParallelConfigError(f"phy2log must hold each of the MoE's {n} experts at least once; got {phy2log}")
        self.limit, self.gate, self.shared_experts = moe.limit, moe.gate, moe.shared_experts
        mine = list(placement.owned[ep_rank])
        if phy2log is not None:
            mine = [phy2log[s] for s in mine]
        self.experts = nn.ParameterDict(
            {k: nn.Parameter(p.detach()[mine].clone(), requires_grad=p.requires_grad) for k, p in moe.experts.items()}
        )
        # packed experts (kernels.grouped_moe.ExpertWeights, models.quantize.pack_experts: before or after this
        # pass): this rank's, every tensor being [E, ...]
        self.packed = None
        if packed is not None:
            parts = (packed.w1, packed.w3, packed.w2, packed.s1, packed.s3, packed.s2)
            self.packed = type(packed)(packed.fmt, *(None if t is None else t[mine].clone() for t in parts))
        self.ep_rank, self.dispatcher = ep_rank, AllToAllDispatcher(placement, group)
        self._plain = None  # expert_weights()'s view
        # EPLB (distributed.eplb): the layer's ReplicaMap (logical -> physical slot per pair; swapped whole between
        # steps), its load recorder (eplb_load.LayerLoad) and the --uniform-routing reference router; None: off
        self.replicas = None if phy2log is None else ReplicaMap(phy2log, n)
        self.load = None
        self.uniform = None
        self.calls = 0  # forwards run: the model's wrapper finds the layers a forward skipped

    def forward(
        self, x: torch.Tensor, tokens: torch.Tensor, is_image: torch.Tensor | None = None, ops=None
    ) -> torch.Tensor:
        """``ops`` (kernels.ops.KernelOps): the fused router, and the grouped routed experts on the received rows,
        each row a top-1 pick of its local expert; None: the torch loop, as ``MoE.forward``'s oracle."""
        self.calls += 1
        g = self.gate
        if ops is None or g.hash_routed:
            ids, w = g(x, tokens, is_image)
        else:
            ids, w = ops.route(x, g.weight, g.bias, g.topk, g.temp, g.scale, g.bias_vl, is_image)
        if self.uniform is not None:
            ids = self.uniform(ids)
        slots = None if self.replicas is None else self.replicas.route(ids, self.ep_rank)
        if self.load is not None:
            self.load(ids, ids if slots is None else slots)
        rows, local, weights, handle = self.dispatcher.prepare(x, ids, w, slots)
        if ops is None:
            out = self.run_local(rows, local, weights)
        else:
            out = ops.routed_experts(rows, local[:, None], weights[:, None], self.expert_weights(), self.limit)
        routed = self.dispatcher.finalize(out, handle)
        return (routed + acc(self.shared_experts(x, ops))).to(x.dtype)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(device) / .double() follow the packed experts, as in MoE._apply
        p = self.packed
        if p is not None:
            tensors = (p.w1, p.w3, p.w2, p.s1, p.s3, p.s2)
            self.packed = type(p)(p.fmt, *(None if t is None else fn(t) for t in tensors))
        return self

    def expert_weights(self):
        """This rank's experts as the grouped-MoE ops take them: the packed ones, else a view of the parameters
        (built once a set)."""
        if self.packed is not None:
            return self.packed
        ex, view = self.experts, self._plain
        if view is None or view.w1 is not ex["w1"] or view.w3 is not ex["w3"] or view.w2 is not ex["w2"]:
            from ..kernels.grouped_moe import ExpertWeights  # import here: the kernels import the layers

            view = self._plain = ExpertWeights("bf16", ex["w1"], ex["w3"], ex["w2"])
        return view

    def run_local(self, rows: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert, weighted before the down projection (MoE.forward's
        arithmetic); one output row per input row, in x's dtype. Packed experts without their dense copies are
        dequantised expert by expert (kernels.grouped_moe.routed_experts_ref), as MoE.forward does."""
        if "w1" not in self.experts:
            from ..kernels.grouped_moe import routed_experts_ref

            return routed_experts_ref(rows, local[:, None], weights[:, None], self.packed, self.limit).to(rows.dtype)
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
    phy2log: tuple[int, ...] | None = None,
    draft_phy2log: tuple[int, ...] | None = None,
) -> nn.Module:
    """Replace every layer's MoE of ``model`` by an ``ExpertParallelMoE`` for EP rank ``ep_rank`` of ``ep_size``
    (``placement`` default: contiguous ranges) in place; returns the model. Ranks that disagree on the config or
    the placement fail here, all of them (handshake.agree). ``phy2log`` / ``draft_phy2log`` (EPLB, with redundant
    slots: distributed.eplb): every layer's / the drafter's physical slots, contiguous over the ranks."""
    if phy2log is not None:
        placement = ExpertPlacement.contiguous(len(phy2log), ep_size)
    if not 0 <= ep_rank < ep_size:
        raise ParallelConfigError(f"ep_rank={ep_rank} must lie in [0, ep_size={ep_size})")
    if any(isinstance(b.ffn, ExpertParallelMoE) for b in model.layers):
        raise ParallelConfigError("the model is already expert-parallel: shard the single-process model once")
    placement = placement or ExpertPlacement.contiguous(model.cfg.n_routed_experts, ep_size)
    if placement.ep_size != ep_size:
        raise ParallelConfigError(f"the placement spans {placement.ep_size} ranks, ep_size is {ep_size}")
    agree("the model config and expert placement", repr((model.cfg, placement, phy2log, draft_phy2log)), group)
    for block in model.layers:
        block.ffn = ExpertParallelMoE(block.ffn, placement, ep_rank, group, phy2log)
    if getattr(model, "mtp", None) is not None:  # the drafter's MoE: its own experts, the contiguous rule
        n = model.cfg.dspark_n_routed_experts if draft_phy2log is None else len(draft_phy2log)
        draft = ExpertPlacement.contiguous(n, ep_size)
        for stage in model.mtp:
            stage.ffn = ExpertParallelMoE(stage.ffn, draft, ep_rank, group, draft_phy2log)
    model.forward_batch = _JoinSkipped(model, model.forward_batch)
    return model


class _JoinSkipped:
    """``forward_batch``, then zero-row calls of the MoE layers it did not run, in layer order: the collectives
    a rank whose rows all stopped before the decoder would otherwise leave its peers waiting in."""

    def __init__(self, model: nn.Module, forward_batch):
        self.model, self.forward_batch = model, forward_batch

    def __call__(self, *args, **kwargs):
        before = [b.ffn.calls for b in self.model.layers]
        out = self.forward_batch(*args, **kwargs)
        ran = [b.ffn.calls > n for b, n in zip(self.model.layers, before)]
        first = ran.index(False) if False in ran else len(ran)
        if any(ran[first:]):  # a runner that skips leading layers (a fixed-shape encoder): no order to join in
            raise ParallelConfigError(f"an expert-parallel forward ran MoE layers {ran}: only a skipped tail joins")
        idle_forward(self.model, first)
        return out


def idle_draft(model: nn.Module) -> None:
    """A draft pass with no rows on an expert-parallel model: joins the collectives of each DSpark stage's MoE with
    zero rows (for a rank with nothing to draft while its peers draft)."""
    w = model.embed.weight
    x = w.new_zeros(0, model.cfg.hidden_size)
    tokens = torch.zeros(0, dtype=torch.long, device=w.device)
    for stage in model.mtp:
        stage.ffn(x, tokens)


def idle_forward(model: nn.Module, first_layer: int = 0) -> None:
    """A forward with no rows on an expert-parallel model: joins the collectives of every MoE layer from
    ``first_layer`` on with zero rows, so the ranks with rows are not left waiting. Nothing is read from or written
    to any cache."""
    w = model.embed.weight
    x = w.new_zeros(0, model.cfg.hidden_size)
    tokens = torch.zeros(0, dtype=torch.long, device=w.device)
    for block in model.layers[first_layer:]:
        block.ffn(x, tokens)
