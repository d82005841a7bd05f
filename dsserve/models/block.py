"""One backbone layer: (Engram), attention and MoE sublayers joined by two mHC mixing sites.

V4.1 runs the single-pass schedule: each site's projection yields the ``pre`` that the *next* sublayer
collapses with, so one read of the stream serves both (spec 2.2). V4 computes and uses ``pre`` at the same
site (two passes).
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.attention import CSA2Attention
from ..layers.context import ForwardContext, KeptRows
from ..layers.engram import Engram
from ..layers.mhc import collapse, expand, hc_mix, sinkhorn
from ..layers.moe import MoE
from ..layers.norm import RMSNorm
from ..layers.side_stream import fork, join, side_stream
from .config import LayerRole, ModelConfig

# Up to this many rows (a decode step) an mHC site's mixes (projection, Sinkhorn) run on a side stream beside the
# sublayer they feed: the sublayer needs only the collapse (kernels.mhc_collapse), the mixes are first read by the
# expand after it (the seeds saw ~4% lower latency at low concurrency). Release proxy on the H200, 8K decode graphs:
# B = 1, 8, 16 steps 3.5-6% shorter with it, B = 32 4.5% longer (benchmarks/results/side-stream-mhc-h200). 0: the
# fused single pass on one stream.
MHC_SIDE_STREAM_MAX_ROWS = 16


class Block(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        role: LayerRole,
        n_experts: int | None = None,
        topk: int | None = None,
        attn_cls=CSA2Attention,
    ):
        super().__init__()
        self.cfg, self.role = cfg, role
        # the mixes' Sinkhorn; training on a GPU swaps in kernels.sinkhorn.sinkhorn_trainable (the same function,
        # one launch each way where autograd replays a few hundred)
        self.sinkhorn = sinkhorn
        d, n = cfg.hidden_size, cfg.hc_mult
        mix = (2 + n) * n
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, n * d)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = attn_cls(cfg, role)
        self.ffn = MoE(cfg, n_experts or cfg.n_routed_experts, topk or cfg.num_experts_per_tok, role.hash_routed)
        self.engram = Engram(cfg, role.index) if role.engram else None
        # training's warm-in (train.warm_in): a 0-d tensor r blending mHC towards a plain residual and scaling the
        # MoE's output by r; None (serving, the oracle) leaves the block exact
        self.warm_in: torch.Tensor | None = None

    def mix(self, site: str, x: torch.Tensor):
        c = self.cfg
        pre, post, comb = hc_mix(
            x,
            getattr(self, f"hc_{site}_fn"),
            getattr(self, f"hc_{site}_base"),
            getattr(self, f"hc_{site}_scale"),
            c.rms_norm_eps,
            c.hc_eps,
            c.hc_sinkhorn_iters,
            self.sinkhorn,
        )
        if self.warm_in is None:
            return pre, post, comb
        r, n = self.warm_in, pre.shape[1]  # convex blends: comb stays doubly stochastic
        eye = torch.eye(n, dtype=comb.dtype, device=comb.device)
        return (1 - r) / n + r * pre, (1 - r) + r * post, (1 - r) * eye + r * comb

    def site(self, name: str, x: torch.Tensor, pre: torch.Tensor, norm: RMSNorm, ops):
        """V4.1's single pass at a mixing site: (norm(collapse(x, pre)), the site's pre, post, comb, ready).
        ready: None, or (a few rows on a GPU) the event at which the mixes, computed on the side stream while the
        sublayer runs on h, are done; ``side_stream.join`` it before reading pre, post or comb."""
        if ops is None or self.warm_in is not None:
            p, post, comb = self.mix(name, x)
            return norm(collapse(x, pre)), p, post, comb, None
        c = self.cfg
        args = (
            x,
            getattr(self, f"hc_{name}_fn"),
            getattr(self, f"hc_{name}_base"),
            getattr(self, f"hc_{name}_scale"),
            pre,
            norm.weight,
            norm.eps,
            c.rms_norm_eps,
            c.hc_eps,
            c.hc_sinkhorn_iters,
        )
        side = side_stream(x, MHC_SIDE_STREAM_MAX_ROWS)
        if side is None:
            return (*ops.mhc_site(*args), None)
        (_, p, post, comb), ready = fork(side, ops.mhc_site, *args)  # its h is recomputed here, on the main stream
        return ops.mhc_collapse_norm(x, pre, norm.weight, norm.eps), p, post, comb, ready

    def v4_site(self, name: str, x: torch.Tensor, norm: RMSNorm, ops):
        """V4's two passes at a mixing site: the mixes, then the collapse with the site's own pre. Returns
        (norm(collapse(x, pre)), post, comb). With ops: the fused site's mixes (its own h, collapsed with a zero
        pre_in, is dropped) and the collapse kernel: 4 launches where the torch mixes take ~120 (Sinkhorn's 20
        iterations)."""
        if ops is None or self.warm_in is not None:
            pre, post, comb = self.mix(name, x)
            return norm(collapse(x, pre)), post, comb
        c = self.cfg
        _, pre, post, comb = ops.mhc_site(
            x,
            getattr(self, f"hc_{name}_fn"),
            getattr(self, f"hc_{name}_base"),
            getattr(self, f"hc_{name}_scale"),
            x.new_zeros(x.shape[0], c.hc_mult),
            norm.weight,
            norm.eps,
            c.rms_norm_eps,
            c.hc_eps,
            c.hc_sinkhorn_iters,
        )
        return ops.mhc_collapse_norm(x, pre, norm.weight, norm.eps), post, comb

    @staticmethod
    def expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, ops) -> torch.Tensor:
        return expand(y, x, post, comb) if ops is None else ops.mhc_expand(y, x, post, comb)

    def forward(self, x: torch.Tensor, pre: torch.Tensor | None, ctx: ForwardContext, keep: KeptRows | None = None):
        """x: stream [T, n, d]; pre: the collapse weights handed over by the previous layer (V4.1).

        ``keep`` (bounded replay): after this layer has published its global KV from every row, continue
        with only these rows. Returns (stream, pre_out, ctx) for the rows kept.
        """
        x, h, a_pre, a_post, a_comb, ctx, ready = self._head(x, pre, ctx, keep)
        if x.shape[0] == 0:  # every row is before the replay window: only the global KV was needed
            return x, h.new_zeros(0, self.cfg.hc_mult), ctx
        return self.tail(x, h, a_pre, a_post, a_comb, ctx, ready)

    def head(self, x: torch.Tensor, pre: torch.Tensor | None, ctx: ForwardContext, keep: KeptRows | None = None):
        """Up to the attention: Engram, the attention site's mix, the compressor on every row, then bounded
        replay's narrowing. Returns (stream, attention input h, the site's pre, post, comb, ctx) of the kept rows;
        ``tail`` continues (split so that a CUDA graph of the decoder can start after the narrowing)."""
        *out, ready = self._head(x, pre, ctx, keep)
        join(ready, x.device)
        return tuple(out)

    def _head(self, x: torch.Tensor, pre: torch.Tensor | None, ctx: ForwardContext, keep: KeptRows | None):
        if self.engram is not None:
            ctx.log(self.role.index, "engram")
            reach = None if ctx.segment_first is None else ctx.positions - ctx.segment_first
            x = self.engram(
                x,
                ctx.engram_ids,
                [s.rows for s in ctx.seqs],
                ctx.engram_history,
                rows=ctx.engram_rows.get(self.role.index),
                ops=ctx.ops,
                check=not ctx.static,
                reach=reach,
            )
        ops, ready = ctx.ops, None  # ops: kernels.ops.KernelOps, or None: the torch forward (the oracle)
        if self.cfg.is_v41:
            h, a_pre, a_post, a_comb, ready = self.site("attn", x, pre, self.attn_norm, ops)
        else:
            a_pre, (h, a_post, a_comb) = None, self.v4_site("attn", x, self.attn_norm, ops)
        if self.attn.compressor is not None:
            self.attn.compress(h, ctx)
        if keep is not None:
            join(ready, x.device)  # the narrowing reads the mixes
            ready, idx = None, keep.index
            x, h, a_post, a_comb, ctx = x[idx], h[idx], a_post[idx], a_comb[idx], ctx.narrow(keep)
            a_pre = None if a_pre is None else a_pre[idx]
        return x, h, a_pre, a_post, a_comb, ctx, ready

    def tail(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        a_pre,
        a_post: torch.Tensor,
        a_comb: torch.Tensor,
        ctx: ForwardContext,
        ready=None,
    ):
        """The attention and the MoE with their expansions (see ``head``; ``ready``: see ``site``). Returns
        (stream, pre_out, ctx)."""
        ops = ctx.ops
        y = self.attn(h, ctx)
        join(ready, x.device)
        x = self.expand(y, x, a_post, a_comb, ops)
        ready = None
        if self.cfg.is_v41:
            h, f_pre, f_post, f_comb, ready = self.site("ffn", x, a_pre, self.ffn_norm, ops)
        else:
            f_pre, (h, f_post, f_comb) = None, self.v4_site("ffn", x, self.ffn_norm, ops)
        y = self.ffn(h, ctx.tokens, ctx.is_image, ops)
        if self.warm_in is not None:
            y = y * self.warm_in
        join(ready, x.device)
        return self.expand(y, x, f_post, f_comb, ops), f_pre, ctx
