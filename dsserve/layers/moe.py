"""MoE (spec 2.5): sqrtsoftplus router whose bias only selects, renormalised top-k weights x1.5, clamped
SwiGLU experts and one shared expert. V4's first layers route by a frozen token -> experts table."""

from __future__ import annotations

import contextlib
import contextvars
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import ModelConfig
from .numerics import acc
from .quant import fake_quant_fp8_pow2
from .side_stream import fork, side_stream


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit): the gate is clamped from above only."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)
        # optional [2 * inter, dim] module computing w1 and w3 in one product (models.quantize.fuse_gate_up:
        # w1 and w3 then hold views of its rows)
        self.w13: nn.Module | None = None

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        """``ops`` (kernels.ops.KernelOps): the clamped SwiGLU of the fused w1/w3 product in one kernel."""
        if self.w13 is not None:
            h = self.w13(x)
            if ops is not None:
                return self.w2(ops.swiglu(h.reshape(-1, h.shape[-1]), self.limit).view(*h.shape[:-1], -1))
            gate, up = h.chunk(2, dim=-1)
            return self.w2(clamped_swiglu(gate, up, self.limit))
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class Gate(nn.Module):
    def __init__(
        self,
        dim: int,
        n_experts: int,
        topk: int,
        hash_routed: bool,
        vision_bias: bool,
        vocab: int,
        temp: float,
        scale: float,
    ):
        super().__init__()
        self.topk, self.temp, self.scale, self.hash_routed = topk, temp, scale, hash_routed
        self.weight = nn.Parameter(torch.zeros(n_experts, dim))
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(vocab, topk, dtype=torch.int32))
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts))
            self.bias_vl = nn.Parameter(torch.zeros(n_experts)) if vision_bias else None

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, is_image: torch.Tensor | None):
        """Returns (expert ids [T, k], weights [T, k]) with weights summing to ``scale`` per row."""
        xf = acc(x)
        scores = torch.sqrt(F.softplus((xf @ self.weight.to(xf.dtype).t()) / self.temp))
        if self.hash_routed:
            ids = self.tid2eid[tokens].long()
        else:
            biased = scores + self.bias.to(scores.dtype)
            if is_image is not None and self.bias_vl is not None:
                biased = torch.where(is_image[:, None], scores + self.bias_vl.to(scores.dtype), biased)
            ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : self.topk]
        w = torch.gather(scores, 1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale


_DEFER_EXPERTS = contextvars.ContextVar("defer_experts", default=False)


@contextlib.contextmanager
def deferred_experts():
    """MoEs built inside hold their routed experts on the meta device (no memory): a builder then fills and
    packs them one layer at a time (models.dummy_build), so the dense experts of all layers never coexist."""
    token = _DEFER_EXPERTS.set(True)
    try:
        yield
    finally:
        _DEFER_EXPERTS.reset(token)


# A decode step's shared expert runs on a side stream beside the router and the routed experts (each alone leaves
# SMs idle at a few rows); larger batches keep one stream. 0 turns it off.
SHARED_EXPERT_STREAM_MAX_ROWS = 64


def _side_stream(x: torch.Tensor):
    """The side stream for the shared expert of ``x``'s rows, or None (CPU, or too many rows to gain)."""
    return side_stream(x, SHARED_EXPERT_STREAM_MAX_ROWS)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, n_experts: int, topk: int, hash_routed: bool = False):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate = Gate(
            d, n_experts, topk, hash_routed, cfg.is_v41, cfg.vocab_size, cfg.gate_temp, cfg.routed_scaling_factor
        )
        # Routed experts stacked per layer ([E, out, in]); the checkpoint stores them one by one.
        where = {"device": "meta"} if _DEFER_EXPERTS.get() else {}
        self.experts = nn.ParameterDict(
            {
                "w1": nn.Parameter(torch.zeros(n_experts, inter, d, **where)),
                "w2": nn.Parameter(torch.zeros(n_experts, d, inter, **where)),
                "w3": nn.Parameter(torch.zeros(n_experts, inter, d, **where)),
            }
        )
        self.shared_experts = Expert(d, inter * cfg.n_shared_experts, cfg.swiglu_limit)
        # Routed experts in a release storage format (kernels.grouped_moe.ExpertWeights), set by
        # models.quantize.quantize_experts; None: the dense parameters above, as plain float weights.
        self.packed = None
        self._plain = None  # expert_weights()'s view of the dense parameters
        # Training on a GPU: every expert on every row, weighted 0 where not chosen. The same sums (the routing
        # weights multiply before the down projection), in ~10 launches and no host sync, where the loop below
        # takes ~6 a present expert plus a read-back; E / top-k times the FLOPs, nothing for a tiny model.
        self.every_expert = False
        # The release's act_quant (spec 2.12) on the packed experts' inputs x and h, reference and kernels alike:
        # models.quantize.use_act_quant; dense (unpacked) experts are not FP4/FP8-weight linears and keep x as is.
        self.act_quant = False

    def expert_weights(self):
        """The routed experts as the grouped-MoE ops take them."""
        if self.packed is not None:
            return self.packed
        ex, view = self.experts, self._plain
        if view is None or view.w1 is not ex["w1"] or view.w3 is not ex["w3"] or view.w2 is not ex["w2"]:
            from ..kernels.grouped_moe import ExpertWeights  # import here: the kernels import this module

            # built once (per parameter set), not per step: the checks in ExpertWeights cost host time per layer
            view = self._plain = ExpertWeights("bf16", ex["w1"], ex["w3"], ex["w2"])
        return view

    def _apply(self, fn, recurse=True):
        # .to(device) / .double() must follow the packed experts too: quantised bytes (uint8) move unchanged,
        # plain float experts change dtype like parameters.
        super()._apply(fn, recurse)
        p = self.packed
        if p is not None:
            tensors = (p.w1, p.w3, p.w2, p.s1, p.s3, p.s2)
            self.packed = type(p)(p.fmt, *(None if t is None else fn(t) for t in tensors))
        return self

    def _act_quant(self) -> bool:
        return self.act_quant and self.packed is not None

    def _shared(self, x: torch.Tensor, ops):
        """The shared expert's output, and the event it is ready at when it runs on a side stream (else None)."""
        side = _side_stream(x)
        if side is None:
            return self.shared_experts(x, ops), None
        return fork(side, self.shared_experts, x, ops)

    def forward(
        self, x: torch.Tensor, tokens: torch.Tensor, is_image: torch.Tensor | None = None, ops=None
    ) -> torch.Tensor:
        """``ops`` (kernels.ops.KernelOps): the fused router and the grouped routed experts, Triton or their
        references; None: the loop below, the oracle (which the references reproduce)."""
        if ops is not None:
            shared, ready = self._shared(x, ops)
            g = self.gate
            if g.hash_routed:
                ids, w = g(x, tokens, is_image)
            else:
                ids, w = ops.route(x, g.weight, g.bias, g.topk, g.temp, g.scale, g.bias_vl, is_image)
            # the routed sum lands on the shared expert's output in place: fp32, rounded once, as below
            kw = {"act_quant": True} if self._act_quant() else {}
            return ops.routed_experts(
                x, ids, w, self.expert_weights(), self.limit, accumulate_into=shared, accumulate_after=ready, **kw
            )
        ids, w = self.gate(x, tokens, is_image)
        if self.packed is not None and "w1" not in self.experts:  # packed only: dequantise expert by expert
            from ..kernels.grouped_moe import routed_experts_ref

            routed = routed_experts_ref(x, ids, w, self.packed, self.limit, act_quant=self._act_quant())
            return (acc(routed) + acc(self.shared_experts(x))).to(x.dtype)
        w1, w2, w3 = self.experts["w1"], self.experts["w2"], self.experts["w3"]
        aq = fake_quant_fp8_pow2 if self._act_quant() else (lambda t: t)
        xq = aq(x)
        if self.every_expert:
            h = clamped_swiglu(torch.einsum("td,eid->eti", xq, w1), torch.einsum("td,eid->eti", xq, w3), self.limit)
            # added, not set: a hash-routed row may name an expert twice, which the loop counts twice
            chosen = torch.zeros(x.shape[0], w1.shape[0], dtype=w.dtype, device=x.device).scatter_add(1, ids, w)
            ye = torch.bmm(aq((acc(h) * chosen.t()[:, :, None]).to(x.dtype)), w2.transpose(1, 2))  # [E, T, d]
            return (acc(ye).sum(0) + acc(self.shared_experts(x))).to(x.dtype)
        # The (row, slot) pairs sorted by expert (stable: by row within one), so each present expert's rows are one
        # contiguous run: only the three products go expert by expert, every row-wise op runs once on all pairs.
        # The same products on the same rows in the same order as one loop over experts would run them.
        if x.shape[0] == 0:
            return x.clone()
        k = ids.shape[1]
        pairs = ids.flatten()
        order = torch.argsort(pairs, stable=True)
        ends = list(itertools.accumulate(torch.bincount(pairs, minlength=w1.shape[0]).tolist()))
        present = [(e, a, b) for e, (a, b) in enumerate(zip([0, *ends], ends)) if b > a]
        rows = order // k
        xs = xq[rows]
        gate = torch.cat([xs[a:b] @ w1[e].t() for e, a, b in present])
        up = torch.cat([xs[a:b] @ w3[e].t() for e, a, b in present])
        # The routing weight multiplies the activation before the down projection, as the release does.
        h = aq((acc(clamped_swiglu(gate, up, self.limit)) * w.flatten()[order, None]).to(x.dtype))
        ys = torch.cat([h[a:b] @ w2[e].t() for e, a, b in present])
        out = torch.zeros(x.shape, dtype=acc(x).dtype, device=x.device).index_add_(0, rows, acc(ys))
        return (out + acc(self.shared_experts(x))).to(x.dtype)
