"""The KV compressor: pools the layer's normalised input into one global entry per ``ratio`` tokens.

V4.1: ratio 2 pools each pair with a per-channel softmax gate (no APE, no overlap); ratio 1 passes every
token through ungated. V4: ratio 4 overlaps each window with the previous one (two channel halves, APE
added to the gate logits); ratio 128 pools non-overlapping windows with APE.

Rows that cannot be pooled yet (a dangling half-group; with overlap, also the last full window) are kept
in the cache as raw (u, z) and prepended on the next call, so chunked prefill and decode emit exactly the
entries a one-shot prefill would.
"""

from __future__ import annotations

import torch
from torch import nn

from .norm import RMSNorm
from .numerics import acc, acc_param


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float, overlap: bool = False, ape: bool = False):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        width = head_dim * (2 if overlap else 1)
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False) if ratio > 1 else None
        self.ape = nn.Parameter(torch.zeros(ratio, width)) if ape else None
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, first_pos: int, pending, emitted: int, uz=None, norm: bool = True):
        """x: [T, dim] rows at positions first_pos..first_pos+T-1; ``uz``: their (u, z) from ``project``, when the
        caller projected the rows of several sequences at once; ``norm`` False: the caller normalises the latents
        (of several sequences at once: the norm is row-wise).

        Returns (latents [G, head_dim] for entries emitted..emitted+G-1, new pending state).
        """
        finish = self.norm if norm else (lambda t: t)
        if self.ratio == 1:
            return finish(self.wkv(x)), None
        u, z, first_pos, done, new_pending = self.projected(x, first_pos, pending, uz)
        if done > emitted:
            pooled = self._pool(u, z, first_pos, emitted, done)
        else:
            pooled = u.new_zeros(0, self.head_dim)
        return finish(pooled.to(x.dtype)), new_pending

    def project(self, x: torch.Tensor):
        """(u, z) of rows x: fp32 projections, like the release's reference (x.float() before the projection)."""
        xf = acc(x)  # converted once for both products; the weights' fp32 copies are kept (acc_param)
        return xf @ acc_param(self.wkv.weight).t(), xf @ acc_param(self.wgate.weight).t()

    def projected(self, x: torch.Tensor, first_pos: int, pending, uz=None):
        """(u, z) of the pending rows then x's, the position of their first row, the number of complete
        groups, and the state to carry: the part of forward the fused cache-write kernel does not do."""
        u, z = self.project(x) if uz is None else uz
        if pending is not None:
            u, z, first_pos = torch.cat((pending[0], u)), torch.cat((pending[1], z)), pending[2]
        r, end = self.ratio, first_pos + u.shape[0]
        done = end // r  # groups [0, done) are complete
        keep_from = max(0, (done - 1) * r) if self.overlap else done * r
        keep_from = max(keep_from, first_pos)
        cut = keep_from - first_pos
        new_pending = (u[cut:], z[cut:], keep_from) if cut < u.shape[0] else None
        return u, z, first_pos, done, new_pending

    def _pool(self, u, z, first_pos, g0, g1):
        r, c = self.ratio, self.head_dim
        if self.ape is not None:
            slot = torch.arange(first_pos, first_pos + u.shape[0], device=u.device) % r
            z = z + self.ape.to(z.dtype)[slot]
        if not self.overlap:
            s, n = g0 * r - first_pos, g1 - g0
            uw, zw = u[s : s + n * r].view(n, r, c), z[s : s + n * r].view(n, r, c)
        else:
            # Entry w mixes window w-1's first half (Ca) and window w's second half (Cb); window -1 is empty.
            if g0 == 0:
                u = torch.cat((u.new_zeros(r, 2 * c), u))
                z = torch.cat((z.new_full((r, 2 * c), float("-inf")), z))
                first_pos -= r
            s, n = (g0 - 1) * r - first_pos, g1 - g0 + 1
            wu, wz = u[s : s + n * r].view(n, r, 2 * c), z[s : s + n * r].view(n, r, 2 * c)
            uw = torch.cat((wu[:-1, :, :c], wu[1:, :, c:]), dim=1)
            zw = torch.cat((wz[:-1, :, :c], wz[1:, :, c:]), dim=1)
        return (torch.softmax(zw, dim=1) * uw).sum(1)
