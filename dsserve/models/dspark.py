"""DSpark: the block drafter (spec 1.6, 2.10). Three SWA-only stages over the backbone's last-layer taps.

Two entry points, both per sequence:

* ``ingest`` (committed positions only): project the backbone taps to m_p and push each stage's window
  entry c_p = rope(RMSNorm(W_kv m_p)) into that stage's ring in a ``DSparkCache``.
* ``propose`` (speculative, read-only on the rings): run the block [y, noise...] through the stages with the
  ordinary single-pass ``Block.forward`` schedule, whose attention is swapped for ``DraftAttention`` (ring
  window plus the block's own rows, non-causal inside the block), then the shared head plus the sequential
  Markov head and the confidence head.

``propose_batch`` is ``propose`` for several sequences in one pass; ``propose_fixed`` is the same pass over
device buffers of fixed shape (``RingWindows``: every block's rings padded to their capacity), with no host read or
write, which engine.propose_graphs captures as a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import CSA2Attention, sparse_attention_with_sink
from ..layers.context import ForwardContext, SeqRows
from ..layers.indexer import NEG_INF
from ..layers.mhc import collapse
from ..layers.norm import RMSNorm, rms_norm
from ..layers.numerics import acc
from .block import Block
from .config import LayerRole, ModelConfig


def draft_role(cfg: ModelConfig, stage: int) -> LayerRole:
    return LayerRole(
        index=cfg.num_hidden_layers + stage,
        side="draft",
        ratio=0,
        mode="swa",
        kv_source=None,
        index_source=None,
        owns_compressor=False,
        owns_indexer=False,
        candidate=None,
        engram=False,
        dspark_tap=False,
        hash_routed=False,
        yarn=False,
    )


class DSparkCache:
    """Per-sequence draft state: for each stage, the c rows (post-RoPE, fake-quantised when QAT) of the last ingested
    positions, with those positions: up to ``window`` committed ones plus ``spare`` more. The engine's drafter
    ingests a verify chunk's rows before the host knows which are committed (its proposal reads the rings with the
    verdict still on the device, and the window's position test hides rows past the committed position), then drops
    the rejected ones (``drop_after``); ``spare`` (the block size) keeps the window whole across that. Never touched
    by ``propose``."""

    def __init__(self, window: int, n_stages: int, spare: int = 0):
        self.window, self.capacity = window, window + spare
        self.keys: list[torch.Tensor | None] = [None] * n_stages  # [n <= capacity, head_dim]
        self.positions: list[torch.Tensor | None] = [None] * n_stages  # [n], strictly increasing
        self._ring: torch.Tensor | None = None  # [n, n_stages, head_dim]: keys[s] is its view ring[:, s]
        self._last: int | None = None  # the newest position on the host, when the pusher gave it

    @property
    def ring(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys [n, n_stages, head_dim], positions [n]) of the ingested rows every stage holds, or None (none yet)."""
        return None if self._ring is None else (self._ring, self.positions[0])

    @property
    def last_position(self) -> int:
        """The newest ingested position (-1 when nothing has been ingested). Kept on the host by ``DSpark.ingest``:
        the drafter reads it per request per step, and a read of the device tensor would wait for the device."""
        if self._last is not None:
            return self._last
        p = self.positions[0]
        return -1 if p is None else int(p[-1])

    def push(self, keys: torch.Tensor, positions: torch.Tensor, last: int | None = None) -> None:
        """Every stage's entries of new rows: keys [n, n_stages, head_dim], positions [n] (after the ring's).
        ``last``: ``positions[-1]`` as a host int (None: read from ``positions`` when asked)."""
        self._last = last
        # New tensors every time (no in-place writes), so a snapshot taken by a caller stays valid; the stages' rows
        # and the one positions tensor they share are views of them.
        if self._ring is not None:
            keys, positions = torch.cat((self._ring, keys)), torch.cat((self.positions[0], positions))
        self._set(keys[-self.capacity :], positions[-self.capacity :])

    def drop_after(self, position: int) -> None:
        """Forgets the rows past ``position``: the newest ``last_position - position`` rows, every one of them
        pushed contiguously after it (a verify chunk's rejected rows). Reads nothing from the device."""
        n = self.last_position - position
        if n <= 0:
            return
        if self._ring is None or n > self._ring.shape[0]:
            raise ValueError(f"drop_after({position}): the ring holds rows up to {self.last_position} only")
        self._set(self._ring[:-n], self.positions[0][:-n])
        self._last = position

    def _set(self, ring: torch.Tensor, positions: torch.Tensor) -> None:
        self._ring = ring
        self.keys = [ring[:, s] for s in range(ring.shape[1])]
        self.positions = [positions] * len(self.keys)


@dataclass(frozen=True)
class RingWindows:
    """Every block's rings in fixed shapes (``DSpark.propose_fixed``): keys [B, S, n_stages, head_dim] and their
    positions [B, S] (S slots: a ring's capacity, the window and its spare rows; a padding slot carries -1, which no
    window reaches), and each block's committed position p [B] (the block is at p + 1, p + 2, ...). Device tensors;
    a slot outside [p - W + 1, p] (stale, or an ingested row past p) is hidden by the window's position test."""

    keys: torch.Tensor
    positions: torch.Tensor
    committed: torch.Tensor


class DraftAttention(CSA2Attention):
    """A stage's SWA attention in draft mode. Same parameters (so the same checkpoint names) as the backbone's
    ratio-0 attention; only the key set differs: every query row sees the ring window [p-W+1, p] of committed
    entries plus all block rows (no causal mask inside the block), where p = the position before the block."""

    def __init__(self, cfg: ModelConfig, role: LayerRole):
        super().__init__(cfg, role)
        self.stage = role.index - cfg.num_hidden_layers

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Each sequence of ``ctx.seqs`` is one block (its rows, its ``DSparkCache``, ``first``: the block's first
        position on the host, or read from the positions); or one sequence over every row whose cache is a
        ``RingWindows`` (``DSpark.propose_fixed``: blocks of one size, no host reads)."""
        cfg, pos = self.cfg, ctx.positions
        q, own = self.query_and_entry(x, pos, ctx.qat)
        if len(ctx.seqs) == 1 and isinstance(rings := ctx.seqs[0].cache, RingWindows):
            o = self._attend(q, own, rings.keys[:, :, self.stage], rings.positions, rings.committed[:, None])
            return self.output(o, pos, x.dtype)
        if (o := self._attend_blocks(q, own, ctx.seqs)) is not None:
            return self.output(o, pos, x.dtype)
        outs = []
        for s in ctx.seqs:
            rows, state = s.rows, s.cache
            t = rows.stop - rows.start
            p = (int(pos[rows.start]) if s.first is None else s.first) - 1
            ring_k, ring_p = state.keys[self.stage], state.positions[self.stage]
            if ring_k is None:
                ring_k, ring_p = own[:0], pos[:0]
            # Ring rows are kept by count; the position test makes stale rows (after a gap) invisible anyway.
            ring_ok = (ring_p >= max(0, p - cfg.sliding_window + 1)) & (ring_p <= p)
            keys = torch.cat((ring_k, own[rows]))
            mask = torch.cat((ring_ok, torch.ones(t, dtype=torch.bool, device=x.device)))[None, :].expand(t, -1)
            outs.append(sparse_attention_with_sink(q[rows], keys, mask, None, None, self.attn_sink, cfg.head_dim**-0.5))
        return self.output(torch.cat(outs), pos, x.dtype)

    def query_and_entry(self, x: torch.Tensor, pos: torch.Tensor, qat: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(``query``'s rotated q [T, H, D], ``window_entry``'s own rows [T, D]) with one RoPE pass over both: V4.1's
        query has no per-head norm, so both are rotated as they come out of their projections, each row by its
        position (the same ops on the same values as the two calls)."""
        if not self.cfg.is_v41:
            return self.query(x, pos)[1], self.window_entry(x, pos, qat)
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(x.shape[0], self.cfg.num_attention_heads, self.cfg.head_dim)
        qk = self.rope(torch.cat((q, self.kv_norm(self.wkv(x))[:, None]), dim=1), pos, inplace=True)
        return qk[:, :-1], self._kv_qat(qk[:, -1], qat)

    def _attend_blocks(self, q: torch.Tensor, own: torch.Tensor, seqs: list[SeqRows]) -> torch.Tensor | None:
        """``forward``'s attention for several blocks of one size (``DSpark.propose_batch``'s) in one pass: the
        rings padded to the longest, the padding masked like a stale ring row. Returns o [T, H, D] in fp32, or None
        (one block, blocks of several sizes or out of order, or no host ``first``: the per-block loop)."""
        if len(seqs) < 2 or any(s.first is None for s in seqs):
            return None
        nb, b = len(seqs), seqs[0].rows.stop - seqs[0].rows.start
        if any(s.rows != slice(i * b, (i + 1) * b) for i, s in enumerate(seqs)) or nb * b != q.shape[0]:
            return None
        dev = q.device
        keys = [s.cache.keys[self.stage] for s in seqs]
        keys = [own[:0] if k is None else k for k in keys]
        tags = [
            torch.full((0,), -1, dtype=torch.long, device=dev) if k is None else k
            for k in (s.cache.positions[self.stage] for s in seqs)
        ]
        ring_k = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)  # [B, n, D]
        ring_p = torch.nn.utils.rnn.pad_sequence([t.to(dev) for t in tags], batch_first=True, padding_value=-1)
        p = torch.tensor([s.first - 1 for s in seqs], device=dev)[:, None]
        return self._attend(q, own, ring_k, ring_p, p)

    def _attend(
        self, q: torch.Tensor, own: torch.Tensor, ring_k: torch.Tensor, ring_p: torch.Tensor, p: torch.Tensor
    ) -> torch.Tensor:
        """Attention of B blocks of b rows each (q [B b, H, D], own [B b, D]) over their ring keys ring_k [B, n, D]
        at positions ring_p [B, n] (-1: padding) and their own rows, block i committed up to p [B, 1]: a ring row is
        seen iff p - W + 1 <= its position <= p, every block row by every block row. o [B b, H, D] in fp32."""
        nb, w, dev = ring_k.shape[0], self.cfg.sliding_window, q.device
        b = q.shape[0] // nb
        ring_ok = (ring_p >= (p - w + 1).clamp_min(0)) & (ring_p <= p)  # padding (-1) is before any window
        k = acc(torch.cat((ring_k.to(own.dtype), own.view(nb, b, -1)), 1))  # [B, n + b, D]
        mask = torch.cat((ring_ok, torch.ones(nb, b, dtype=torch.bool, device=dev)), 1)
        qb = acc(q).view(nb, b, *q.shape[1:])  # [B, b, H, D]
        logits = torch.einsum("bthd,bnd->bthn", qb, k) * self.cfg.head_dim**-0.5
        logits = logits.masked_fill(~mask[:, None, None, :], NEG_INF)
        sink = self.attn_sink.to(logits.dtype)[None, None, :, None].expand(nb, b, -1, 1)
        probs = torch.softmax(torch.cat((logits, sink), -1), -1)
        return torch.einsum("bthn,bnd->bthd", probs[..., :-1], k).reshape(q.shape[0], *q.shape[1:])


class DSparkStage(Block):
    def __init__(self, cfg: ModelConfig, stage: int):
        # Same parameter names (mtp.{s}.attn.*) as a plain SWA layer; only the key set differs, so
        # ``Block.forward`` (mHC mixes, collapse, expand, MoE) is reused unchanged.
        super().__init__(
            cfg,
            draft_role(cfg, stage),
            cfg.dspark_n_routed_experts,
            cfg.dspark_num_experts_per_tok,
            attn_cls=DraftAttention,
        )
        d, r, last = cfg.hidden_size, cfg.dspark_markov_rank, cfg.num_draft_layers - 1
        if stage == 0:
            self.main_proj = nn.Linear(len(cfg.dspark_target_layer_ids) * d, d, bias=False)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if stage == last:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(cfg.vocab_size, r)
            self.markov_head.head = nn.Linear(r, cfg.vocab_size, bias=False)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(d + r, 1, bias=False)


class DSpark(nn.ModuleList):
    def __init__(self, cfg: ModelConfig):
        super().__init__(DSparkStage(cfg, s) for s in range(cfg.num_draft_layers))
        self.cfg = cfg

    def new_state(self, spare: int = 0) -> DSparkCache:
        """A sequence's empty rings; ``spare``: rows kept past the window (``DSparkCache``)."""
        return DSparkCache(self.cfg.sliding_window, len(self), spare)

    def ingest(
        self, taps: dict[int, torch.Tensor], positions: torch.Tensor, state: DSparkCache, qat: bool | None = None
    ) -> None:
        """Push the ring entries of committed rows. taps: layer -> [T, d] (``ForwardOutput.taps``, the mean
        over copies of the stream entering each target layer); positions [T], increasing, after the ring's."""
        cfg = self.cfg
        positions = torch.as_tensor(positions).long().cpu()
        if positions.numel() == 0:
            return
        if bool((positions[1:] <= positions[:-1]).any()) or int(positions[0]) <= state.last_position:
            raise ValueError(
                f"DSpark ingestion needs increasing positions after {state.last_position}, "
                f"got {positions.tolist()[:8]}..."
            )
        # Only the last W rows can ever be attended (spec 6.17), so skip the rest of a long prefill.
        keep = slice(-cfg.sliding_window, None)
        if any(taps[layer].shape[0] != positions.shape[0] for layer in cfg.dspark_target_layer_ids):
            raise ValueError("every DSpark tap needs one row per ingested position")
        x = torch.cat([taps[layer][keep] for layer in cfg.dspark_target_layer_ids], dim=-1)
        kept = positions[keep]
        self._push(x, kept, [(state, kept.shape[0], int(positions[-1]))], qat)

    def ingest_spans(
        self, taps: dict[int, torch.Tensor], spans: list[tuple[DSparkCache, slice, int]], qat: bool | None = None
    ) -> None:
        """``ingest`` for several sequences in one pass (the drafter's, after a step). A span (state, rows, first):
        the taps' rows ``rows`` hold the state's positions first, first + 1, ..., after what it holds."""
        w, idx, pos, parts = self.cfg.sliding_window, [], [], []
        for state, rows, first in spans:
            n = rows.stop - rows.start
            if n <= 0:
                continue
            if first <= state.last_position:
                raise ValueError(f"DSpark ingestion needs positions after {state.last_position}, got {first}..")
            skip = max(0, n - w)  # only the last W rows can ever be attended (spec 6.17)
            idx.extend(range(rows.start + skip, rows.stop))
            pos.extend(range(first + skip, first + n))
            parts.append((state, n - skip, first + n - 1))
        if not parts:
            return
        layers = self.cfg.dspark_target_layer_ids
        # one span: its rows are a slice (no gather); the row ids go up without the host waiting for the device
        dev = taps[layers[0]].device
        sel = slice(idx[0], idx[-1] + 1) if len(parts) == 1 else torch.tensor(idx).to(dev, non_blocking=True)
        x = torch.cat([taps[layer][sel] for layer in layers], dim=-1)
        self._push(x, torch.tensor(pos), parts, qat)

    def _push(self, x: torch.Tensor, positions: torch.Tensor, parts: list, qat: bool | None) -> None:
        """x [R, len(targets) x d]: the concatenated taps of the rows at ``positions`` [R] (host), in ``parts``
        (state, rows, last position) order: every stage's window entry of all rows at once, then each state's."""
        qat = self.cfg.qat if qat is None else qat
        m = self[0].main_norm(self[0].main_proj(x))
        positions = positions.to(m.device, non_blocking=True)
        entries = self.ring_entries(m, positions, qat)
        start = 0
        for state, n, last in parts:
            state.push(entries[start : start + n], positions[start : start + n], last)
            start += n

    def ring_entries(self, m: torch.Tensor, positions: torch.Tensor, qat: bool) -> torch.Tensor:
        """Each stage's window entry ``stage.attn.window_entry(m, positions, qat)`` of rows m [R, d], as
        [R, stages, head_dim]: the projections per stage, the norm, RoPE and fake quant (row-wise, the same in every
        stage but for the norm's weight) once for all stages."""
        attns = [stage.attn for stage in self]
        kv = torch.stack([a.wkv(m) for a in attns], dim=1)
        kv = rms_norm(kv, torch.stack([a.kv_norm.weight for a in attns]), attns[0].kv_norm.eps)
        return attns[0]._kv_qat(attns[0].rope(kv, positions, inplace=True), qat)

    @torch.no_grad()
    def propose_batch(
        self,
        last_tokens: list[int],
        positions: list[int],
        states: list[DSparkCache],
        embed: nn.Module,
        head: nn.Module,
        qat: bool | None = None,
        ops=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``propose`` for several sequences in one pass (greedy): sequence b drafts after its committed position
        ``positions[b]`` with ``last_tokens[b]`` the target's token after it. The stages, heads and Markov steps run
        on every block's rows at once; only attention reads each block's own rings. Returns (drafts [B, block],
        confidence logits [B, block]); reads the states, never writes them. ``ops`` (kernels.ops.KernelOps): the
        stages' mHC sites and MoE through them (engine.propose_graphs on a GPU); None: the torch forward."""
        cfg = self.cfg
        for p, state in zip(positions, states):
            if state.last_position != p:
                raise ValueError(f"propose at p={p} but the draft state was ingested up to {state.last_position}")
        b, dev = cfg.dspark_block_size, embed.weight.device
        nb = len(states)
        ids = torch.full((nb, b), cfg.dspark_noise_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(last_tokens, dtype=torch.long)
        ids = ids.flatten().to(dev)
        pos = (torch.tensor(positions, dtype=torch.long)[:, None] + torch.arange(1, b + 1)).flatten().to(dev)
        seqs = [SeqRows(slice(i * b, (i + 1) * b), st, first=p + 1) for i, (st, p) in enumerate(zip(states, positions))]
        return self._draft(ids, pos, seqs, embed, head, qat, ops)

    @torch.no_grad()
    def propose_fixed(
        self,
        last_tokens: torch.Tensor,
        rings: RingWindows,
        embed: nn.Module,
        head: nn.Module,
        qat: bool | None = None,
        ops=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``propose_batch`` over device tensors of fixed shape, with no host read or write (what a CUDA graph
        captures): block i drafts after ``rings.committed[i]`` with ``last_tokens[i]`` [B] the target's token after
        it, its attention over the slots of its rings (``RingWindows``) and its own rows. The same ops on the same
        values as ``propose_batch`` (its rings padded to their capacity, not to the longest). Returns (drafts
        [B, block], confidence logits [B, block])."""
        cfg = self.cfg
        b, nb = cfg.dspark_block_size, last_tokens.shape[0]
        noise = last_tokens.new_full((nb, b - 1), cfg.dspark_noise_token_id)
        ids = torch.cat((last_tokens[:, None], noise), 1).flatten()
        steps = torch.arange(1, b + 1, dtype=torch.long, device=last_tokens.device)
        pos = (rings.committed[:, None] + steps).flatten()
        return self._draft(ids, pos, [SeqRows(slice(0, nb * b), rings)], embed, head, qat, ops)

    def _draft(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        seqs: list[SeqRows],
        embed: nn.Module,
        head: nn.Module,
        qat: bool | None,
        ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batched pass of blocks of ``dspark_block_size`` rows (ids, pos [B block] on the device, the rings in
        ``seqs``): the stages, the shared head, the Markov head's greedy steps and the confidence head."""
        cfg, last = self.cfg, self[-1]
        qat = cfg.qat if qat is None else qat
        b, n, dev = cfg.dspark_block_size, cfg.hc_mult, ids.device
        nb = ids.shape[0] // b
        # The pass runs in inference mode: its ops skip autograd's per-op bookkeeping (a block's ~2000 small ops are
        # bound by their fixed cost: ~8% of the pass at B = 1 on the CPU); ids and positions stay normal tensors, so
        # RoPE keeps its tables (it checks their version). The drafts and confidences come out as inference tensors.
        with torch.inference_mode():
            ctx = ForwardContext(tokens=ids, positions=pos, seqs=seqs, qat=qat, ops=ops)
            x = embed(ids)[:, None, :].expand(-1, n, -1).contiguous()
            pre = torch.zeros(nb * b, n, device=dev)
            pre[:, 0] = 1.0
            for stage in self:
                x, pre, ctx = stage(x, pre, ctx)
            h = collapse(x, pre)
            logits = head(last.norm(h)).float().view(nb, b, -1)
            h = h.view(nb, b, -1)
            drafts, conf, prev = [], [], ids.view(nb, b)[:, 0]
            for i in range(b):
                e = last.markov_head.embed(prev)  # [B, r]
                row = logits[:, i] + last.markov_head.head(e).float()
                conf.append(last.confidence_head.proj(torch.cat((h[:, i], e.to(h.dtype)), dim=-1))[:, 0].float())
                prev = row.argmax(dim=-1)
                drafts.append(prev)
            return torch.stack(drafts, 1), torch.stack(conf, 1)

    def propose(
        self,
        last_token_y: int,
        p: int,
        state: DSparkCache,
        embed: nn.Module,
        head: nn.Module,
        qat: bool | None = None,
        greedy: bool = True,
    ):
        """Draft a block after committed position ``p``; y is the target's token for position p+1.

        Returns (draft ids [B], confidence logits [B], logits [B, V]); draft i proposes the token at
        p+2+i. Reads ``state`` and never writes it: drafts are speculative until verified.
        """
        cfg, last = self.cfg, self[-1]
        qat = cfg.qat if qat is None else qat
        if not greedy:
            raise NotImplementedError("DSpark sampling is not implemented yet; use greedy=True")
        if state.last_position != p:
            raise ValueError(f"propose at p={p} but the draft state was ingested up to {state.last_position}")
        b, n = cfg.dspark_block_size, cfg.hc_mult
        dev = embed.weight.device
        ids = torch.full((b,), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
        ids[0] = last_token_y
        positions = torch.arange(p + 1, p + 1 + b, device=dev)
        # The ring state rides in the sequence's cache slot; DraftAttention only reads it.
        ctx = ForwardContext(tokens=ids, positions=positions, seqs=[SeqRows(slice(0, b), state, first=p + 1)], qat=qat)
        x = embed(ids)[:, None, :].expand(-1, n, -1).contiguous()
        pre = torch.zeros(b, n, device=dev)
        pre[:, 0] = 1.0  # identical copies: collapsing with copy 0 gives the embedding (spec 2.1)
        for stage in self:
            x, pre, ctx = stage(x, pre, ctx)
        h = collapse(x, pre)
        logits = head(last.norm(h)).float()
        # Markov head: each row's correction depends on the previous row's draft, so it runs sequentially.
        rows, drafts, conf, prev = [], [], [], torch.tensor([last_token_y], device=dev)
        for i in range(b):
            e = last.markov_head.embed(prev)  # [1, r]: E_m[prev_i]
            rows.append(logits[i] + last.markov_head.head(e)[0].float())
            conf.append(last.confidence_head.proj(torch.cat((h[i : i + 1], e.to(h.dtype)), dim=-1))[0, 0].float())
            prev = rows[-1].argmax().view(1)  # greedy; torch.argmax returns the lowest index on ties
            drafts.append(prev)
        return torch.cat(drafts), torch.stack(conf), torch.stack(rows)
