"""Fixed-shape steps: a forward over buffers of one (row bucket, context bucket) shape, captured as a CUDA graph on
first use and replayed with the buffers refilled; without capture (the CPU, the tests) the same forward runs eagerly.

``StepGraphs`` is what every fixed-shape runner shares: the fallback count (a step that does not fit runs the eager
path, counted by reason), the shapes built largest first (later captures reuse the larger ones' freed scratch), the
masked capture, graph replay or the eager forward, one output buffer per kind and one report. A runner gives:
- ``_unfit(*step)``: why a step cannot run in fixed shapes, or None;
- ``new_step(key, step)``: a ``CapturedStep`` with new buffers of shape ``key`` (``step`` shows their sizes);
- ``fill(s, step)``: refills ``s``'s buffers from ``step`` (no host reads on the device); returns the step's rows;
- ``forward(s)``: the model's forward over ``s``'s buffers, with no host reads or writes (what a graph captures);
- optionally ``ahead_keys(key)`` and ``ahead_step(key, step)``: with ``ahead_rows`` (the warm-up's) the other shapes
  a step also builds at its context bucket (default: the larger row buckets), and from which rows.

The runners: ``DecodeGraphs`` (engine.decode_graphs: decode steps), ``DecoderRowGraphs`` (engine.decoder_row_graphs:
bounded replay's decoder rows after the narrowing), ``EncoderGraphs`` (engine.encoder_graphs: their encoder rows
before it), ``VerifyGraphs`` (engine.verify_graphs: speculative verify steps, a decode with draft rows).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..kv.paged import PagedKVCache
from ..models.model import DeepseekForCausalLM
from .graph_capture import GraphCapture, Outputs, SharedOutputs

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # decode steps' row buckets


def batch_bucket(b: int, max_batch: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The captured size for b rows: the smallest bucket >= b (max_batch itself is the last bucket)."""
    return min([x for x in buckets if b <= x < max_batch] + [max_batch])


def bucket_sizes(max_batch: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> list[int]:
    """Every bucket ``batch_bucket`` can return for up to ``max_batch`` rows."""
    return sorted({x for x in buckets if x < max_batch} | {max_batch})


@dataclass
class CapturedStep:
    """One fixed shape: its batch buffers (``capacity`` rows; ``mask_writes``, ``forget_derived``), the other input
    buffers its fill writes, and on a GPU its graph and the graph's output buffers (rows first)."""

    batch: Any  # DecodeBatch, DecoderRowBatch (kv.replay_batch.ReplayBatch) or EncoderBatch (encoder, verify)
    inputs: Any = None
    graph: torch.cuda.CUDAGraph | None = None
    outputs: Outputs | None = None


class StepGraphs:
    label = "fixed-shape step: {0} rows, context {1}"  # the capture log's name of a shape

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv: PagedKVCache,
        max_rows: int,
        capture: GraphCapture | None,
        min_context: int,
        row_buckets: tuple[int, ...],
    ):
        """``max_rows``: the largest row bucket; ``capture``: how graphs are captured (shared with the engine's
        other graphs); None runs the fixed-shape forwards eagerly (the CPU, the tests)."""
        if min_context % (2 * kv.layout.block_size):
            raise ValueError(
                f"min_context {min_context} must be a multiple of twice the block size "
                f"{kv.layout.block_size} (so that every context bucket is a whole number of blocks)"
            )
        self.model, self.kv, self.max_rows, self.capture = model, kv, max_rows, capture
        self.min_context, self.row_buckets = min_context, row_buckets
        self._steps: dict[tuple[int, int], CapturedStep] = {}
        self._outputs = SharedOutputs(max_rows)  # every graph's outputs, in its first rows
        self.reset_counts()
        self.last_key = None  # the (row bucket, context bucket) of the latest run
        self.ahead_rows = False  # a step also builds other row buckets of its context bucket (the warm-up)

    def reset_counts(self) -> None:
        self.runs, self.replays, self.padded_rows, self.fallbacks = 0, 0, 0, Counter()

    # ------------------------------------------------------------------------- hooks
    def _unfit(self, *step) -> str | None:
        raise NotImplementedError

    def new_step(self, key: tuple[int, int], step) -> CapturedStep:
        raise NotImplementedError

    def fill(self, s: CapturedStep, step) -> int:
        raise NotImplementedError

    def forward(self, s: CapturedStep) -> Outputs:
        raise NotImplementedError

    def ahead_keys(self, key: tuple[int, int]) -> list[tuple[int, int]]:
        return [(r, key[1]) for r in bucket_sizes(self.max_rows, self.row_buckets) if r > key[0]]

    def ahead_step(self, key: tuple[int, int], step):
        return step

    # ------------------------------------------------------------------------- the skeleton
    def fits(self, *step) -> bool:
        """Whether the step can run in fixed shapes; when not, its reason is counted in ``fallbacks``."""
        why = self._unfit(*step)
        if why is not None:
            self.fallbacks[why] += 1
        return why is None

    def launch(self, key: tuple[int, int], step) -> tuple[Outputs, int]:
        """Runs ``step`` in shape ``key`` (built first if new): (the forward's outputs, the step's rows). The outputs
        are the graph's buffers, which its next replay overwrites: callers copy the first rows out."""
        wanted = [key] + (self.ahead_keys(key) if self.ahead_rows else [])
        for k in sorted(wanted, reverse=True):  # largest first: the smaller captures reuse its freed scratch
            if k not in self._steps:
                self._steps[k] = self._build(k, self.ahead_step(k, step))
        s = self._steps[key]
        rows = self.fill(s, step)
        self.runs, self.last_key = self.runs + 1, key
        self.padded_rows += s.batch.capacity - rows
        if s.graph is None:
            return self.forward(s), rows
        s.graph.replay()
        self.replays += 1
        return s.outputs, rows

    def _build(self, key: tuple[int, int], step) -> CapturedStep:
        s = self.new_step(key, step)
        if self.capture is None:
            return s
        # Warm up on this step's inputs with every write masked (the runs must not move the cache: the compressors'
        # carry is read then overwritten); the step refills the buffers before the first replay.
        self.fill(s, step)
        s.batch.mask_writes()
        s.graph, s.outputs = self.capture(
            lambda: self.forward(s), self.label.format(*key), s.batch.forget_derived, self._outputs
        )
        return s

    def report(self) -> dict:
        return {
            "graphs": sorted(k for k, s in self._steps.items() if s.graph is not None),
            "fixed_shape_steps": sorted(self._steps),
            "runs": self.runs,
            "replays": self.replays,
            "padded_rows": self.padded_rows,
            "fallbacks": dict(self.fallbacks),
        }
