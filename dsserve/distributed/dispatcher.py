"""The expert-parallel dispatch and combine over all-to-all with counts (the spec's ``AllToAll`` backend).

``prepare`` sends each (token, k) pair's row and routing weight to the rank holding its expert: pairs sorted by
(rank, local expert), a counts exchange ([EP, local experts] a rank), then one all-to-all of the rows, each row
carrying its activation bytes and its weight's bytes (exact in any dtype: no cast of the fp32 weight to bf16).
The receiver knows each row's local expert from the counts alone. ``finalize`` returns one output row per pair,
unsummed, with one all-to-all the other way, and the source sums each token's k rows in ascending expert id from
zero in the accumulation dtype: the order of ``MoE.forward``'s reference loop, so the only difference from one
process is the expert products' batch shapes. Per MoE layer: three collectives (counts, rows, rows back), the same
on every rank whatever it holds; an idle rank sends and receives zero-row blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layers.numerics import acc
from .all_to_all import all_to_all_counts, all_to_all_rows
from .expert_placement import ExpertPlacement


@dataclass(frozen=True)
class Dispatch:
    """What ``finalize`` needs of a ``prepare``: the pairs' sort order, the row counts each way, the expert ids."""

    order: torch.Tensor  # [T * k]: pair index of each sent row
    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank
    ids: torch.Tensor  # [T, k] the router's expert ids


def pack_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[n, d] activations and [n] weights as [n, d * x.itemsize + w.itemsize] bytes."""
    return torch.cat((x.contiguous().view(torch.uint8), w.contiguous()[:, None].view(torch.uint8)), 1)


def unpack_rows(b: torch.Tensor, d: int, x_dtype: torch.dtype, w_dtype: torch.dtype):
    """``pack_rows``' inverse: ([n, d] activations, [n] weights)."""
    cut = d * torch.empty(0, dtype=x_dtype).element_size()
    return b[:, :cut].contiguous().view(x_dtype), b[:, cut:].contiguous().view(w_dtype)[:, 0]


class AllToAllDispatcher:
    def __init__(self, placement: ExpertPlacement, group: dist.ProcessGroup | None):
        """``group`` None: no communication (one rank, or a model sharded for its shapes only: a loader's meta
        model; its first ``prepare`` then fails unless the placement has one rank)."""
        self.placement, self.group = placement, group
        self._owner, self._local = placement.owner(), placement.local_index()
        self.rows_sent = self.rows_received = 0  # pairs this rank sent / experts' rows it ran, over its lifetime

    def prepare(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, slots: torch.Tensor | None = None):
        """x [T, d]; ids, w [T, k] (the router's). Returns (rows [n, d], their local expert [n], their weights [n],
        a Dispatch): the rows this rank's experts run, grouped by source rank, then by local expert. ``slots``
        [T, k]: the placement's expert each pair runs on (EPLB's physical slots; None: ``ids``); the combine still
        sums in ascending ``ids`` order."""
        t, k = ids.shape
        ep, m = self.placement.ep_size, self.placement.max_local
        world = 1 if self.group is None else dist.get_world_size(self.group)
        if world != ep:
            raise ValueError(f"the EP group has {world} ranks, the expert placement {ep}")
        flat = (ids if slots is None else slots).reshape(-1)
        key = self._owner.to(flat.device)[flat] * m + self._local.to(flat.device)[flat]
        order = torch.sort(key, stable=True).indices
        counts = torch.bincount(key, minlength=ep * m).view(ep, m)
        recv = all_to_all_counts(counts, self.group)
        sent, received = counts.sum(1).tolist(), recv.sum(1).tolist()
        token = order // k
        got = all_to_all_rows(pack_rows(x[token], w.reshape(-1)[order]), sent, received, self.group)
        rows, weights = unpack_rows(got, x.shape[1], x.dtype, w.dtype)
        local = torch.arange(m, device=x.device).repeat(ep).repeat_interleave(recv.reshape(-1).to(x.device))
        self.rows_sent += t * k
        self.rows_received += rows.shape[0]
        return rows, local, weights, Dispatch(order, sent, received, ids)

    def finalize(self, out: torch.Tensor, h: Dispatch) -> torch.Tensor:
        """out [n, d]: the experts' output of ``prepare``'s rows, weighted. Returns [T, d] in the accumulation
        dtype: each token's rows summed in ascending expert id (MoE.forward's order)."""
        back = all_to_all_rows(out, h.received, h.sent, self.group)
        t, k = h.ids.shape
        pairs = torch.empty_like(back)
        pairs[h.order] = back
        pairs = pairs.view(t, k, out.shape[1])
        by_expert = torch.sort(h.ids, dim=1, stable=True).indices
        y = torch.zeros(t, out.shape[1], dtype=acc(out).dtype, device=out.device)
        for j in range(k):
            y += acc(pairs[torch.arange(t, device=out.device), by_expert[:, j]])
        return y
