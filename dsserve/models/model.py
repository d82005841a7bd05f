"""The DeepSeek-V4.1-Flash / V4-Flash text backbone, and its reference forward.

``forward`` runs one sequence's new rows against its ``SequenceCache``. With a fresh cache and every row at
once it is the reference forward (full recompute, no cache): the oracle every fast path is tested against.
Bounded replay (``decoder_start``) runs the encoder and layer 20's global projection on every row, and the
decoder only on rows at or after ``decoder_start`` (spec 2.9).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..kv.decode_batch import DecodeBatch
from ..kv.encoder_batch import EncoderBatch
from ..kv.paged_batch import PagedBatch
from ..kv.replay_batch import ReplayBatch
from ..kv.sequence_cache import SequenceCache
from ..layers.compress_v4_decode import ring_specs, rings_before_step
from ..layers.context import ForwardContext, KeptRows, SeqRows, StepBatch
from ..layers.mhc import collapse, hc_head_pre
from ..layers.norm import RMSNorm
from ..layers.numerics import acc
from .block import Block
from .config import ModelConfig


class ModelInputError(ValueError):
    """Token ids or options that this model cannot run."""


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T', d] final hidden states of the rows that ran the decoder
    positions: torch.Tensor  # [T'] their positions
    taps: dict[int, torch.Tensor]  # DSpark targets: layer -> mean over copies of the stream entering it [T', d]
    seqs: list[SeqRows]  # which of the returned rows belong to which sequence


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Set by the engine: run attention batched over the paged pools with these ops (None: the
        # per-sequence reference path, which the oracle always uses).
        self.kernel_ops = None
        self.score_probe = None  # set by engine.step_check (DSSERVE_CHECK_STEPS)
        d, n = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(Block(cfg, role) for role in cfg.roles)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        if not cfg.is_v41:
            self.hc_head_fn = nn.Parameter(torch.zeros(n, n * d))
            self.hc_head_base = nn.Parameter(torch.zeros(n))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.mtp = None
        if cfg.is_v41 and cfg.num_draft_layers:
            from .dspark import DSpark

            self.mtp = DSpark(cfg)
        identity = cfg.engram_layer_ids and cfg.engram_compressed_vocab_size == cfg.vocab_size
        # token id -> Engram compressed id; the real tokenizer's map is set by the loader.
        self.register_buffer("engram_token_map", torch.arange(cfg.vocab_size) if identity else None, persistent=False)

    def new_cache(self) -> SequenceCache:
        return SequenceCache(self.cfg.sliding_window, self.cfg.engram_max_ngram_size - 1)

    # ----------------------------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        cache: SequenceCache | None = None,
        decoder_start: int | None = None,
        qat: bool | None = None,
        is_image: torch.Tensor | None = None,
        trace: list | None = None,
        index_kl: list | None = None,
        dense_entries: bool = False,
    ) -> ForwardOutput:
        """One sequence's new rows (a whole prompt, a chunk, or a decoded token) against its cache. ``index_kl``
        (training): a list the indexers append their distillation losses to (``CSA2Attention._index_kl``)."""
        tokens = torch.as_tensor(tokens)
        cache = cache if cache is not None else self.new_cache()
        seq = SeqRows(slice(0, tokens.shape[0] if tokens.dim() else 0), cache, decoder_start)
        return self.forward_batch(
            StepBatch(tokens, [seq], qat, is_image, trace, index_kl=index_kl, dense_entries=dense_entries)
        )

    def forward_batch(self, step: StepBatch) -> ForwardOutput:
        """A flat batch of rows from several sequences (``StepBatch``): ``step.seqs`` says which rows are whose.

        Returns the hidden states of the rows that ran the decoder, with ``seqs`` narrowed to them. Bounded replay
        narrows the rows at the decoder's KV source (``replay_form`` ``report``: layer 20 publishes global KV from
        every row, then its attention and FFN run on the window, as the V4.1 report and TRT-LLM do) or after it
        (``vllm``: layer 20 on every row, 21-39 on the window). Both publish the same global KV. ``decoder_rows``
        may run the narrowed rows from there on in fixed shapes (a CUDA graph); it returns None for a step it does
        not take. The DSpark taps of layers it runs are not returned. ``encoder_rows`` may likewise run a replayed
        step's encoder layers (the split's other piece) and hand their streams to the decoder's KV source layer.
        ``dense_entries`` (training's dense warm-up): every compressed layer attends all its visible global entries.
        ``static`` (training's fixed-shape step, train.step): ``tokens`` are on the model's device and were checked by
        the caller; nothing is read back or uploaded (positions and Engram ids are made on the device), so the step
        can be captured as a CUDA graph. ``segment_first`` (static only; ``ForwardContext.segment_first``): per row the
        position its packed problem starts at, so that no row reads an earlier problem.
        """
        tokens, seqs, is_image, static = step.tokens, step.seqs, step.is_image, step.static
        cfg = self.cfg
        if static:
            if tokens.device != self.embed.weight.device or tokens.dtype != torch.int64 or is_image is not None:
                raise ModelInputError("a static forward takes int64 tokens on the model's device and no image rows")
            if any(b.engram is not None and b.engram.table is not None for b in self.layers):
                raise ModelInputError("a static forward reads Engram tables on the device, not in host memory")
            host_tokens = None
        else:  # checked where they are (the runner hands host tensors: no device read-back), then moved
            host_tokens = self._check_tokens(tokens)
            tokens = host_tokens.to(self.embed.weight.device, non_blocking=True)
        if sum(s.rows.stop - s.rows.start for s in seqs) != tokens.shape[0]:
            raise ModelInputError("the sequences' rows must cover the batch exactly")
        last = max(s.cache.num_tokens + s.rows.stop - s.rows.start - 1 for s in seqs)
        if last >= cfg.max_position_embeddings:
            raise ModelInputError(f"position {last} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        seqs = [replace(s, first=s.cache.num_tokens) for s in seqs]  # host positions, for the compressor
        positions = torch.cat(
            [
                torch.arange(s.first, s.first + s.rows.stop - s.rows.start, device=tokens.device if static else "cpu")
                for s in seqs
            ]
        ).to(tokens.device, non_blocking=True)
        replay = any(s.decoder_start is not None for s in seqs)
        if step.replay_form not in ("report", "vllm"):
            raise ModelInputError(f"replay_form must be 'report' or 'vllm', got {step.replay_form!r}")
        narrow_at = cfg.encoder_layers + (step.replay_form == "vllm")
        if replay and not cfg.is_v41:
            raise ModelInputError("bounded replay (decoder_start) needs the V4.1 encoder/decoder split")
        if step.segment_first is not None and not (static and cfg.is_v41 and not replay):
            # V4's overlapping compression mixes the rows either side of a problem's start into one entry
            raise ModelInputError(
                "segment_first isolates a static step's packed problems, on V4.1 (non-overlapping "
                "compression), without bounded replay"
            )
        ctx = ForwardContext(
            tokens=tokens,
            positions=positions,
            seqs=list(seqs),
            qat=cfg.qat if step.qat is None else step.qat,
            is_image=is_image,
            trace=step.trace,
            index_kl=step.index_kl,
            dense_entries=step.dense_entries,
            static=static,
            segment_first=step.segment_first,
        )
        ctx.ops, ctx.probe = self.kernel_ops, self.score_probe  # row-wise ops (MoE, mHC) run on either path
        if self.kernel_ops is not None and PagedBatch.supports(seqs, self.kernel_ops):
            if step.dense_entries:
                raise ModelInputError("dense_entries is training's, on the reference path, not the paged one")
            ctx.paged = PagedBatch(seqs[0].cache.cache, seqs, positions)
        if cfg.engram_layer_ids:
            if self.engram_token_map is None:
                raise ModelInputError(
                    "this model's Engram needs the tokenizer's compressed-token map; "
                    "load it with the checkpoint's tokenizer"
                )
            if static:
                host_ids = ctx.engram_ids = self.engram_token_map[tokens]  # on the device (no host tables here)
            else:  # hashed from the host's copy of the ids: the host-table prefetch needs them there before layer 0
                host_ids = self._engram_ids(host_tokens, None if is_image is None else is_image.cpu())
                ctx.engram_ids = host_ids.to(tokens.device, non_blocking=True)
            ctx.engram_history = [s.cache.engram_history for s in seqs]
            ctx.engram_rows = self._prefetch_engram(ctx, host_ids)

        x, first_layer = None, 0
        if replay and step.encoder_rows is not None:
            ran = step.encoder_rows.run(ctx, host_ids if cfg.engram_layer_ids else None)
            if ran is not None:
                (x, pre), first_layer = ran, cfg.encoder_layers
        if x is None:
            x, pre = self._embed(tokens)
        taps, hidden = {}, None
        for block in self.layers[first_layer:]:
            i = block.role.index
            if i in cfg.dspark_target_layer_ids:
                taps[i] = acc(x).mean(1).to(x.dtype)
            keep = None
            if replay and i == narrow_at:
                keep = self._replay_rows(seqs, tokens.device)
                taps = taps if keep is None else {k: v[keep.index] for k, v in taps.items()}
            if keep is not None and step.decoder_rows is not None:  # the split: the decoder rows may run as a graph
                x, h, a_pre, a_post, a_comb, ctx = block.head(x, pre, ctx, keep)
                if x.shape[0] and (hidden := step.decoder_rows.run(i, (x, h, a_pre, a_post, a_comb), ctx)) is not None:
                    break
                if x.shape[0]:
                    x, pre, ctx = block.tail(x, h, a_pre, a_post, a_comb, ctx)
            else:
                x, pre, ctx = block(x, pre, ctx, keep)
            if x.shape[0] == 0:  # every row is before its replay window: only the global KV was needed
                break

        for s in seqs:
            n = s.rows.stop - s.rows.start
            s.cache.num_tokens += n
            if cfg.engram_layer_ids:
                s.cache.push_engram_history(host_ids[s.rows])
        if x.shape[0] == 0:
            return ForwardOutput(x.new_zeros(0, cfg.hidden_size), ctx.positions[:0], taps, ctx.seqs)
        if hidden is not None:
            return ForwardOutput(hidden, ctx.positions, taps, ctx.seqs)
        if not cfg.is_v41:
            pre = hc_head_pre(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.rms_norm_eps, cfg.hc_eps)
        return ForwardOutput(collapse(x, pre), ctx.positions, taps, ctx.seqs)

    # ------------------------------ fixed-shape forwards (CUDA graphs): decode steps, bounded replay's decoder rows
    def fill_decode(self, batch: DecodeBatch, seqs: list, tokens: list[int] | torch.Tensor) -> None:
        """A decode step's inputs into ``batch`` (sequence i decodes ``tokens[i]``: host ids, or a device LongTensor
        the host has not read); then ``forward_decode`` runs (or replays) on them. Engram needs only each
        sequence's history from the host: the rows are hashed and gathered on the device, in the step."""
        if not self.cfg.is_v41:  # V4's compressors keep their rows not yet pooled in the cache's rings
            rings_before_step(self.v4_rings(), seqs)
        back = None
        if self.cfg.engram_layer_ids:
            if self.engram_token_map is None:  # the step maps its tokens on the device
                raise ModelInputError(
                    "this model's Engram needs the tokenizer's compressed-token map; "
                    "load it with the checkpoint's tokenizer"
                )
            hasher = next(b.engram.hasher for b in self.layers if b.engram is not None)
            back = hasher.lookbacks(torch.zeros(len(seqs), dtype=torch.long), [kv.engram_history for kv in seqs])[:, 1:]
        batch.fill(seqs, tokens, back)

    def _fixed_shape_context(self, batch) -> ForwardContext:
        """The context of a fixed-shape step over ``batch``'s buffers (a decode, encoder-row or verify batch), its
        per-step device state begun."""
        batch.begin()
        return ForwardContext(
            tokens=batch.tokens,
            positions=batch.positions,
            seqs=batch.seqs,
            qat=self.cfg.qat,
            paged=batch,
            ops=self.kernel_ops,
            probe=self.score_probe,
        )

    def forward_decode(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits [capacity, V] of the decode step in ``batch``: fixed shapes, no host reads or writes, so a CUDA
        graph can capture it. The host's bookkeeping follows in ``commit_decode``."""
        cfg = self.cfg
        ctx = self._fixed_shape_context(batch)
        if cfg.engram_layer_ids:  # hashed here, on the device: the step needs no token on the host
            ctx.engram_ids = self.engram_token_map[batch.tokens]
            src = torch.cat([ctx.engram_ids[:, None], batch.engram_back], 1)
            hashers = [b.engram.hasher for b in self.layers if b.engram is not None]
            ctx.engram_rows = {
                h.layer_id: self.kernel_ops.engram_rows(src, *h.constants(src.device), h.pad_id) for h in hashers
            }
        x, pre = self._embed(batch.tokens)
        for block in self.layers:
            x, pre, ctx = block(x, pre, ctx)
        if not cfg.is_v41:
            pre = hc_head_pre(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.rms_norm_eps, cfg.hc_eps)
        return self.logits(collapse(x, pre))

    def forward_encoder_rows(self, batch: EncoderBatch, engram_rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The streams [capacity, n, d] and collapse weights [capacity, n] that enter the decoder's KV source layer,
        for the encoder rows in ``batch``: the embedding and every encoder layer, compressors included.
        ``engram_rows``: Engram layer -> its rows' gathered table rows [capacity, columns, D] (host tables,
        prefetched) or table row ids [capacity, columns] (tables on the device), in buffers. Fixed shapes, no host
        reads or writes: a CUDA graph can capture it. The host's counts follow in ``EncoderBatch.commit``."""
        ctx = self._fixed_shape_context(batch)
        if self.cfg.engram_layer_ids:
            ctx.engram_ids, ctx.engram_rows = self.engram_token_map[batch.tokens], engram_rows
        x, pre = self._embed(batch.tokens)
        for block in self.layers[: self.cfg.encoder_layers]:
            x, pre, ctx = block(x, pre, ctx)
        return x, pre

    def forward_verify(
        self, batch: EncoderBatch, engram_rows: dict, sample_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [capacity, V] of the rows ``sample_rows`` [capacity] picks, DSpark taps [capacity, taps, d] in
        layer order) of a step's rows in ``batch`` through every layer, compressors and Engram included: a
        speculative verify step (several rows a sequence: its pending rows, then its drafts). ``engram_rows`` as
        ``forward_encoder_rows``'. Fixed shapes, no host reads or writes: a CUDA graph can capture it. The host's
        counts follow in ``commit_rows``."""
        cfg = self.cfg
        ctx = self._fixed_shape_context(batch)
        if cfg.engram_layer_ids:
            ctx.engram_ids, ctx.engram_rows = self.engram_token_map[batch.tokens], engram_rows
        x, pre = self._embed(batch.tokens)
        taps = []
        for block in self.layers:
            if block.role.index in cfg.dspark_target_layer_ids:
                taps.append(acc(x).mean(1).to(x.dtype))  # forward_batch's taps
            x, pre, ctx = block(x, pre, ctx)
        return self.logits(collapse(x, pre)[sample_rows]), torch.stack(taps, 1)

    def commit_rows(self, seqs: list[SeqRows], host_ids: torch.Tensor | None) -> None:
        """The host's side of ``forward_verify`` over ``seqs`` (their host ``first`` positions, rows in order):
        every source's entry and carried-row counts, token counts, Engram histories (``host_ids``: the rows'
        compressed ids on the host; None without Engram)."""
        if not seqs:
            return
        sources = {src: r for src, (r, _) in seqs[0].cache.cache.layout.sources.items()}
        EncoderBatch.commit(seqs, sources)
        for s in seqs:
            s.cache.num_tokens += s.rows.stop - s.rows.start
            if host_ids is not None:
                s.cache.push_engram_history(host_ids[s.rows])

    def forward_decoder_rows(
        self,
        batch: ReplayBatch,
        start: int,
        x: torch.Tensor,
        h: torch.Tensor,
        a_pre: torch.Tensor,
        a_post: torch.Tensor,
        a_comb: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states [capacity, d] of bounded replay's decoder rows in ``batch``: layer ``start``'s
        attention and MoE (``Block.tail``, on its ``head``'s outputs x, h, a_pre, a_post, a_comb, padded to the
        batch's rows), then every later layer. Fixed shapes, no host reads or writes: a CUDA graph can capture
        it."""
        ctx = self._fixed_shape_context(batch)
        x, pre, ctx = self.layers[start].tail(x, h, a_pre, a_post, a_comb, ctx)
        for block in self.layers[start + 1 :]:
            x, pre, ctx = block(x, pre, ctx)
        return collapse(x, pre)

    def commit_decode(self, seqs: list, tokens: list[int] | None) -> None:
        """The host's side of a decode step run by ``forward_decode``: token counts, the compressor's entry and
        carried-row counts, Engram histories. ``tokens`` None (the step's tokens are not on the host yet): the
        histories wait for ``push_decode_history``."""
        if tokens is not None:
            self.push_decode_history(seqs, tokens)
        for kv in seqs:
            p = kv.num_tokens
            for src, (r, _) in kv.cache.layout.sources.items():
                kv._entries[src] = (p + 1) // r
                if r > 1:
                    kv.carried[src] = (p + 1) % r
            kv.num_tokens = p + 1

    def v4_rings(self) -> list:
        """V4's pooling compressors with their rings' shapes (layers.compress_v4_decode.ring_specs), built once."""
        if getattr(self, "_v4_rings", None) is None:
            self._v4_rings = ring_specs(self)
        return self._v4_rings

    def push_decode_history(self, seqs: list, tokens: list[int]) -> None:
        """Engram histories of sequences whose decode step took ``tokens`` (no-op without Engram)."""
        if not self.cfg.engram_layer_ids:
            return
        ids = self._engram_ids(torch.tensor(tokens), None)
        for i, kv in enumerate(seqs):
            kv.push_engram_history(ids[i : i + 1])

    def _embed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mHC streams [T, n, d] (n copies of the embedding) and the first collapse weights."""
        n = self.cfg.hc_mult
        x = self.embed(tokens)[:, None, :].expand(-1, n, -1).contiguous()
        pre = torch.zeros(tokens.shape[0], n, device=tokens.device)
        pre[:, 0] = 1.0  # the copies are identical, so collapsing with copy 0 returns the embedding
        return x, pre

    @staticmethod
    def _replay_rows(seqs: list[SeqRows], device) -> KeptRows | None:
        """The rows at or past each sequence's decoder_start (from host positions), or None when every row is
        (a decode step: nothing to narrow)."""
        counts = [
            n - min(n, max(0, (s.decoder_start or 0) - s.first))
            for s, n in ((s, s.rows.stop - s.rows.start) for s in seqs)
        ]
        if all(c == s.rows.stop - s.rows.start for s, c in zip(seqs, counts)):
            return None
        return KeptRows.suffixes(seqs, counts, device)

    def _prefetch_engram(self, ctx: ForwardContext, host_ids: torch.Tensor) -> dict:
        """Host-table Engram layers: hash this step's rows and start their copies before layer 0 runs."""
        return {
            b.role.index: b.engram.prefetch(
                host_ids, [s.rows for s in ctx.seqs], ctx.engram_history, ctx.tokens.device, self.embed.weight.dtype
            )
            for b in self.layers
            if b.engram is not None and b.engram.table is not None
        }

    def _engram_ids(self, tokens: torch.Tensor, is_image: torch.Tensor | None) -> torch.Tensor:
        """Compressed ids of the tokens, on the host (the map's host copy is made once; tokens handed on the
        device, as the oracle's callers may, are read back)."""
        m = self.engram_token_map
        if getattr(self, "_host_token_map", (None, None))[0] is not m:
            self._host_token_map = (m, m.cpu())
        ids = self._host_token_map[1][tokens.cpu()]
        return ids if is_image is None else ids.masked_fill(is_image, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return acc(self.head(self.norm(hidden)))

    def reference_logits(self, tokens: torch.Tensor, **kw) -> torch.Tensor:
        """The oracle: every row through every layer from an empty cache, logits for every row."""
        return self.logits(self.forward(tokens, **kw).hidden)

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32) or tokens.numel() == 0:
            raise ModelInputError(
                f"tokens must be a non-empty 1-D integer tensor, got shape {tuple(tokens.shape)} dtype {tokens.dtype}"
            )
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ModelInputError(f"token ids must lie in [0, {self.cfg.vocab_size}); got min {lo}, max {hi}")
        return tokens.long()
