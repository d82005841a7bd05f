"""Engram (spec 2.7): hashed n-gram memory added to every mHC copy before the layer's attention mixing.

Rows come from the token ids alone (``EngramHasher``); the gathered [columns x head_dim] row concatenation is
projected to one key per copy and one shared value, and a per-copy gate from the dot product of two RMS
norms decides how much value each copy receives. Dead tokens (image spans) get gate 0.

Host tables: ``move_table_to_host`` moves the table [rows, head_dim] into an ``EngramTable`` in host memory
("float", "bf16" or "fp8" layout) and leaves ``embed`` an empty placeholder, so ``.to(cuda)`` never copies the
table. Load the checkpoint (or dummy weights) into ``embed.weight`` BEFORE the move: the loader fills that name.
The model then hashes and prefetches each step's rows before layer 0 (``prefetch``); ``forward`` consumes them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.config import ModelConfig
from .engram_hash import EngramHasher, engram_rows_per_layer
from .engram_table import EngramRows, EngramTable
from .numerics import acc


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        d, n = cfg.hidden_size, cfg.hc_mult
        self.hasher = EngramHasher(cfg, layer_id)
        rows = engram_rows_per_layer(cfg)[layer_id]
        self.embed = nn.Embedding(rows, cfg.engram_head_dim)
        self.wkv = nn.Linear(cfg.engram_columns * cfg.engram_head_dim, (n + 1) * d, bias=False)
        self.q_weight = nn.Parameter(torch.ones(n, d))
        self.k_weight = nn.Parameter(torch.ones(n, d))
        self.table: EngramTable | None = None  # set by move_table_to_host

    def move_table_to_host(
        self, fmt: str = "bf16", huge_pages: bool = False, store=None, key: str | None = None
    ) -> EngramTable:
        """Move ``embed.weight`` into a host ``EngramTable`` and replace ``embed`` with an empty placeholder
        (same name, 0 rows). Weights must already be loaded; the checkpoint loader cannot fill it afterwards.
        ``store``, ``key`` (this module's name): the node's shared copy (``layers.engram_store``)."""
        if self.table is not None:
            raise ValueError("this Engram table is already in host memory")
        w = self.embed.weight
        self.table = EngramTable.from_weight(w.detach(), fmt, huge_pages, store, key)
        self.embed = nn.Embedding(0, w.shape[1], device=w.device, dtype=w.dtype)
        return self.table

    def row_ids(
        self,
        compressed_ids: torch.Tensor,
        seq_rows: list[slice],
        histories: list[torch.Tensor],
        check: bool = True,
        reach: torch.Tensor | None = None,
    ):
        """LongTensor [T, columns] of table rows, hashed per sequence on the ids' device (``check``: host ids are
        checked to be in range; ``reach``: see ``EngramHasher.rows_of_seqs``)."""
        return self.hasher.rows_of_seqs(compressed_ids, seq_rows, histories, check, reach)

    def prefetch(
        self,
        compressed_ids: torch.Tensor,
        seq_rows: list[slice],
        histories: list[torch.Tensor],
        device,
        dtype: torch.dtype,
    ) -> EngramRows:
        """Hash on the host and start copying this step's rows (host tables only); pass the handle to
        ``forward`` as ``rows``."""
        if self.table is None:
            raise ValueError("prefetch needs a host table (move_table_to_host)")
        ids = self.row_ids(compressed_ids.cpu(), seq_rows, [h.cpu() for h in histories])
        return self.table.prefetch(ids, device, dtype, [r.stop - r.start for r in seq_rows])

    def forward(
        self,
        x: torch.Tensor,
        compressed_ids: torch.Tensor,
        seq_rows: list[slice],
        histories: list[torch.Tensor],
        rows: torch.Tensor | EngramRows | None = None,
        ops=None,
        check: bool = True,
        reach: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: the mHC stream [T, n, d]; compressed_ids [T] (-1 = dead); per sequence its rows and the ids
        before them (hashing looks back across chunk boundaries, never across sequences). ``rows``: this
        step's gathered table rows [T, columns, head_dim] (or their prefetch handle, narrowed to ``seq_rows``), or
        their row ids [T, columns] (int64, hashed beforehand: a fixed-shape decode step); None: hash and gather now.
        ``ops`` (kernels.ops.KernelOps): the gated mix after the projection in one kernel; None: the torch lines.
        ``reach`` [T] (training's packed problems): how far back each row's n-grams may look (rows hashed here)."""
        t, n, d = x.shape
        eps = self.cfg.rms_norm_eps
        if isinstance(rows, EngramRows):
            rows = rows.for_seqs(seq_rows)
        if reach is not None and rows is not None:
            raise ValueError("reach applies to rows hashed here; these rows were hashed beforehand")
        if rows is None or rows.dtype == torch.int64:
            ids = self.row_ids(compressed_ids, seq_rows, histories, check, reach) if rows is None else rows
            rows = self.embed.weight[ids] if self.table is None else self.table.device_gather(ids, x.dtype)
        if rows.shape[0] != t:
            raise ValueError(f"rows cover {rows.shape[0]} tokens, the stream has {t}")
        e = rows.flatten(1).to(x.dtype)
        kv = self.wkv(e)
        if ops is not None:
            return ops.engram_mix(x, kv, self.q_weight, self.k_weight, compressed_ids, eps)
        key, value = acc(kv[:, : n * d].view(t, n, d)), acc(kv[:, n * d :])
        xf = acc(x)
        dot = (xf * self.q_weight.to(xf.dtype) * self.k_weight.to(xf.dtype) * key).sum(-1)
        dot = dot * torch.rsqrt(xf.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) / d**0.5
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
        gate = gate.masked_fill(EngramHasher.is_dead(compressed_ids)[:, None], 0.0)
        return (xf + gate[:, :, None] * value[:, None, :]).to(x.dtype)
