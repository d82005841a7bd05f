"""The per-forward context that layers read: which rows belong to which sequence, at which positions,
against which cache.

A forward runs a flat batch of rows from several sequences (prefill chunks and decodes alike). Row-wise
work (projections, mHC, MoE) runs on all rows at once; sequence-wise work (window and global KV reads,
the compressor, the indexer, Engram hashing) runs per ``SeqRows``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqRows:
    rows: slice  # this sequence's rows in the flat batch (consecutive positions)
    cache: object  # SequenceCache or a paged view with the same methods
    decoder_start: int | None = None  # bounded replay: the decoder runs only on positions >= this
    first: int | None = None  # position of its first row, known on the host (reading it back would sync)


@dataclass(frozen=True)
class StepBatch:
    """What one eager batched forward runs (``DeepseekForCausalLM.forward_batch``): rows of several sequences and
    the step's options. Each sequence's rows continue its cache at ``cache.num_tokens``."""

    tokens: torch.Tensor  # [T] ids: on the host (checked, then uploaded), or on the model's device when ``static``
    seqs: list[SeqRows]  # which rows are whose, in order, covering the batch exactly
    qat: bool | None = None  # None: the model's config
    is_image: torch.Tensor | None = None  # [T] bool: rows inside an image span
    trace: list | None = None  # an optional (layer, op) log for tests
    replay_form: str = "report"  # bounded replay's narrowing: "report" (at layer 20) or "vllm" (after it)
    decoder_rows: object | None = None  # engine.decoder_row_graphs.DecoderRowGraphs: the narrowed rows' graphs
    encoder_rows: object | None = None  # engine.encoder_graphs.EncoderGraphs: a replayed step's encoder graphs
    index_kl: list | None = None  # training: the indexers' KL terms are appended here (ForwardContext.index_kl)
    dense_entries: bool = False  # training's dense warm-up (ForwardContext.dense_entries)
    static: bool = False  # training's fixed-shape step: no host reads or uploads (ForwardContext.static)
    segment_first: torch.Tensor | None = None  # static only: packed problems' first positions (ForwardContext)


@dataclass(frozen=True)
class KeptRows:
    """Bounded replay's narrowing, decided on the host: per sequence the number of its last rows that continue
    (a suffix), and their indices in the flat batch (uploaded without a wait)."""

    counts: tuple[int, ...]
    index: torch.Tensor  # [sum(counts)] int64 on the rows' device

    @classmethod
    def suffixes(cls, seqs: list[SeqRows], counts, device) -> "KeptRows":
        idx = [torch.arange(s.rows.stop - c, s.rows.stop) for s, c in zip(seqs, counts)]
        idx = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
        return cls(tuple(counts), idx.to(device, non_blocking=True))


@dataclass
class ForwardContext:
    tokens: torch.Tensor  # [N] token ids of the rows in flight
    positions: torch.Tensor  # [N] absolute positions
    seqs: list[SeqRows]
    qat: bool = True
    is_image: torch.Tensor | None = None  # [N] bool: rows inside an image span
    trace: list | None = None  # optional (layer, op) log for tests
    # Training: each indexer's KL divergence from the main attention's distribution over the entries it scores is
    # appended here (layers.attention: the loss that teaches the indexer what to select)
    index_kl: list | None = None
    # Training's dense warm-up (DeepSeek's, before sparse training): a compressed layer attends every visible global
    # entry instead of the indexer's top-k, so the main attention learns which entries matter while the indexers
    # learn by their KL to it; sparse selection then starts from an indexer that picks them.
    dense_entries: bool = False
    static: bool = False  # a fixed-shape training step (models.model.forward_batch): no host reads, no uploads
    # Training's packed problems (train.step): [N] the position of the first row of each row's problem. No row reads
    # an earlier problem of its sequence (window keys, global entries, Engram lookbacks): a lookup learnt in training
    # must find the fact in its own problem, as at serving time, not the same key in the problem before.
    segment_first: torch.Tensor | None = None
    engram_ids: torch.Tensor | None = None  # [N] compressed ids (-1 = dead) for Engram layers
    engram_history: list[torch.Tensor] = field(default_factory=list)  # per sequence: the ids before its rows
    # Host-table Engram layers: layer -> prefetch handle (layers.engram_table.EngramRows) started before layer 0.
    # A handle narrows itself to the sequences' current rows (EngramRows.for_seqs), so narrow passes it on.
    engram_rows: dict = field(default_factory=dict)
    # Published within a forward by the latest index source / candidate source, per sequence.
    topk: list = field(default_factory=list)  # (entry ids [T, K], valid [T, K]) per sequence
    candidates: list = field(default_factory=list)  # [T, n_entries] bool per sequence
    # The batched path over a paged cache (None: the per-sequence reference path) and its op choices.
    paged: object | None = None  # kv.paged_batch.PagedBatch
    ops: object | None = None  # kernels.ops.KernelOps
    probe: object | None = None  # engine.step_check.ScoreProbe: counts non-finite index scores (a diagnostic)

    def log(self, layer: int, op: str) -> None:
        if self.trace is not None:
            self.trace.append((layer, op))

    def narrow(self, keep: KeptRows) -> "ForwardContext":
        """The same forward restricted to the kept rows (bounded replay's decoder window): each sequence keeps
        a suffix of its rows; dropped rows become Engram lookback. Nothing here reads the device back."""
        seqs, hist, topk, cands, start, idx = [], [], [], [], 0, keep.index
        for i, (s, n) in enumerate(zip(self.seqs, keep.counts)):
            dropped = s.rows.stop - s.rows.start - n
            seqs.append(
                SeqRows(
                    slice(start, start + n), s.cache, s.decoder_start, None if s.first is None else s.first + dropped
                )
            )
            start += n
            # a selection already published (narrowing after the index source) follows its rows
            t = self.topk[i] if i < len(self.topk) else None
            topk.append(None if t is None else (t[0][dropped:], t[1][dropped:]))
            c = self.candidates[i] if i < len(self.candidates) else None
            cands.append(None if c is None else c[dropped:])
            if self.engram_ids is not None:
                gone = self.engram_ids[s.rows][:dropped]
                # a fresh sequence's history is an empty CPU tensor
                hist.append(torch.cat((self.engram_history[i].to(gone.device, non_blocking=True), gone)))
        return ForwardContext(
            tokens=self.tokens[idx],
            positions=self.positions[idx],
            seqs=seqs,
            qat=self.qat,
            is_image=None if self.is_image is None else self.is_image[idx],
            trace=self.trace,
            engram_ids=None if self.engram_ids is None else self.engram_ids[idx],
            engram_history=hist,
            engram_rows=self.engram_rows,
            topk=topk,
            candidates=cands,
            paged=None if self.paged is None else self.paged.narrow(idx, seqs),
            ops=self.ops,
            probe=self.probe,
        )
