"""Decode steps in fixed shapes, one per (batch bucket, context bucket), captured as CUDA graphs and replayed.

A decode step of B sequences runs as ``DecodeBatch`` buffers of ``batch_bucket(B)`` rows whose index sources
score ``context_bucket(max position + 1)`` positions' worth of entries (-inf past each row's own); the model's
``forward_decode`` over those buffers has no host reads or writes, so on a GPU it is captured once per bucket pair
(on first use) and replayed with the buffers refilled. Without capture (the CPU) the same fixed-shape step runs
eagerly: the tests check that path against the reference forward, and the GPU tests check replay against it.

With ``ahead_batches`` set (the engine's warm-up: engine.warmup) a step also builds, from its own rows, the steps of
every larger batch bucket at its context bucket: the capture masks every write and a replay refills all the buffers,
so a graph does not depend on the rows it was captured from, and the warm-up's one-sequence context ladder then
captures the whole (batch, context) grid instead of leaving most pairs to stall a live step on first use.

Steps that are not plain decodes (prefill chunks, bounded-replay narrowing, a batch past the largest bucket) and
sequences whose compressor state a fixed-shape step cannot continue fall back to the eager ``forward_batch``;
``fallbacks`` counts why.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..kv.decode_batch import DecodeBatch
from ..kv.paged import PagedKVCache
from ..kv.paged_batch import PagedBatch
from ..models.model import DeepseekForCausalLM
from .graph_capture import GraphCapture, SharedOutputs
from .scheduler import StepPlan

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_bucket(b: int, max_batch: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The captured batch size for b rows: the smallest bucket >= b (max_batch itself is the last bucket)."""
    return min([x for x in buckets if b <= x < max_batch] + [max_batch])


def bucket_sizes(max_batch: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> list[int]:
    """Every bucket ``batch_bucket`` can return for up to ``max_batch`` rows."""
    return sorted({x for x in buckets if x < max_batch} | {max_batch})


def context_bucket(n: int, min_context: int) -> int:
    """The position bound for a step whose longest row needs n positions: min_context m, then steps of m up to
    8m, then a quarter of the power-of-two multiple of m below (8m, 10m, 12m, 14m, 16m, 20m, ...): the index sources
    score at most 1.25x the entries they need past 8m."""
    b = min_context
    while b < n:
        step = min_context
        while step * 8 <= b:
            step *= 2
        b += step
    return b


class DecodeGraphs:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv: PagedKVCache,
        max_batch: int,
        capture: GraphCapture | None,
        min_context: int = 1024,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
    ):
        """``capture``: how graphs are captured (shared with the engine's other graphs); None runs the fixed-shape
        steps eagerly (the CPU, the tests)."""
        if min_context % (2 * kv.layout.block_size):
            raise ValueError(
                f"min_context {min_context} must be a multiple of twice the block size "
                f"{kv.layout.block_size} (so that every context bucket is a whole number of blocks)"
            )
        self.model, self.kv, self.max_batch, self.capture = model, kv, max_batch, capture
        self.min_context, self.batch_buckets = min_context, batch_buckets
        # A decode step gathers its Engram rows inside the step: a GPU reads host tables in place only when pinned
        # (registration can fail, e.g. past the locked-memory limit); otherwise every step takes the eager path.
        self._unpinned_tables = kv.device.type == "cuda" and any(
            b.engram is not None
            and b.engram.table is not None
            and not (b.engram.table.memory is not None and b.engram.table.memory.pinned)
            for b in model.layers
        )
        self._steps: dict[tuple[int, int], tuple[DecodeBatch, torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._logits = SharedOutputs(max_batch)  # every graph's logits, in its first rows
        self.reset_counts()
        self.last_key = None  # the (batch bucket, context bucket) of the latest run
        self.ahead_batches = False  # a step also builds its context bucket's larger batch buckets (the warm-up)

    def reset_counts(self) -> None:
        self.replays, self.padded_rows, self.fallbacks = 0, 0, Counter()

    def key(self, plan: StepPlan, ahead: bool = False) -> tuple[int, int] | None:
        """(batch bucket, context bucket) of a plan that can run as a fixed-shape decode step, or None.
        ``ahead``: the rows' input tokens are still on the device (the previous step's samples, its progress not yet
        applied: each row's input goes at the request's ``num_tokens``)."""
        why = self._unfit(plan, ahead)
        if why is not None:
            self.fallbacks[why] += 1
            return None
        seqs = [c.request.kv for c in plan.chunks]
        return (
            batch_bucket(len(seqs), self.max_batch, self.batch_buckets),
            context_bucket(max(kv.num_tokens for kv in seqs) + 1, self.min_context),
        )

    def _unfit(self, plan: StepPlan, ahead: bool = False) -> str | None:
        if self.model.kernel_ops is None or not PagedBatch.layout_supported(self.kv.layout, self.model.kernel_ops):
            return "not the paged batched path"
        if self._unpinned_tables:
            return "Engram tables in unpinned host memory"
        if not plan.chunks or len(plan.chunks) > self.max_batch:
            return "batch size outside the buckets"
        for c in plan.chunks:
            r = c.request
            start = r.num_tokens if ahead else r.num_computed_tokens  # the row's position
            if c.num_tokens != 1 or not (ahead or c.samples):
                return "not a decode step"
            if r.decoder_start is not None and start < r.decoder_start:
                return "bounded replay narrows the step"
            if r.kv.cache is not self.kv:
                return "another cache"
        return DecodeBatch.fits([c.request.kv for c in plan.chunks], carried=self.model.cfg.is_v41)

    @torch.no_grad()
    def run(self, plan: StepPlan, key: tuple[int, int], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The step's logits [B, V] (copied out of the graph's output buffer, which the next replay overwrites).
        ``tokens``: the rows' input ids as a device tensor when the host does not have them yet (asynchronous
        scheduling: the previous step's samples; the Engram histories then wait for
        ``model.push_decode_history``); None: each request's last token."""
        seqs = [c.request.kv for c in plan.chunks]
        host = None
        if tokens is None:
            host = [c.request.token_ids(c.request.num_computed_tokens, c.request.num_tokens)[0] for c in plan.chunks]
        wanted = [key]
        if self.ahead_batches:
            wanted += [(b, key[1]) for b in bucket_sizes(self.max_batch, self.batch_buckets) if b > key[0]]
        for k in sorted(wanted, reverse=True):  # largest first: the smaller captures reuse its freed scratch
            if k not in self._steps:
                self._steps[k] = self._build(k, seqs, host if tokens is None else tokens)
        batch, graph, logits = self._steps[key]
        self.last_key = key
        self.model.fill_decode(batch, seqs, host if tokens is None else tokens)
        self.padded_rows += batch.capacity - len(seqs)
        if graph is None:
            logits = self.model.forward_decode(batch)
        else:
            graph.replay()
            self.replays += 1
        self.model.commit_decode(seqs, host)
        return logits[: len(seqs)].clone()

    def _build(self, key, seqs, tokens):
        cfg = self.model.cfg
        batch = DecodeBatch(self.kv, *key, lookbacks=cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0)
        if self.capture is None:
            return batch, None, None
        # Warm up on this step's inputs with every write masked (the runs must not move the cache: the compressor's
        # carry is read then overwritten); the step refills the buffers before the first replay.
        self.model.fill_decode(batch, seqs, tokens)
        batch.mask_writes()
        graph, logits = self.capture(
            lambda: self.model.forward_decode(batch),
            f"decode step: batch {key[0]}, context {key[1]}",
            batch.forget_derived,
            self._logits,
        )
        return batch, graph, logits

    def report(self) -> dict:
        return {
            "graphs": sorted(k for k, v in self._steps.items() if v[1] is not None),
            "fixed_shape_steps": sorted(self._steps),
            "replays": self.replays,
            "padded_rows": self.padded_rows,
            "fallbacks": dict(self.fallbacks),
        }
