"""The drafter's proposal in fixed shapes, one per batch bucket, captured as CUDA graphs and replayed.

A proposal (engine.drafter, ``DSpark.propose_batch``) runs every request's block [y, noise x 4] through the three
DSpark stages, the shared head and the Markov head: some 2000 small ops a pass, so eagerly it is bound by their
launches. Here a proposal of B blocks runs ``DSpark.propose_fixed`` on static buffers of the bucket b >= B (b a
decode batch bucket up to ``max_seqs``): the last tokens [b], the committed positions [b], every stage's ring keys
padded to the ring's capacity S (the window and the spare rows of ``DSparkCache``) [b, S, stages, head_dim] and
their positions [b, S] (-1 in a padding slot: no window reaches it). The pass reads nothing back and writes nothing
but its outputs, so on a GPU it is captured once per bucket (on first use) and replayed with the buffers refilled;
without capture (the CPU, TP and expert parallel, the tests) the same pass runs eagerly.

The tokens and positions come as device tensors (the engine's: taken from the rejection sampler's verdict, which the
host has not read yet) or host lists (one upload). Per proposal the host uploads where each ring's rows go and copies
the rings in: every request's ring rows concatenated, then scattered into the buffers by one ``index_copy_`` (keys
and positions, after the positions are reset to padding): a few launches whatever B, no wait for the device. A
bucket's rows past B are dummies (the noise token after position 0, an empty ring) whose drafts are dropped. A
proposal of more blocks than the largest bucket runs the same pass eagerly on buffers of its own size (counted in
``fallbacks``).

On a GPU the stages' mHC sites and MoE go through the engine's kernel ops (the torch MoE reads the experts' row
counts back to the host, which a graph cannot); the fallback runs with the same ops, so a request's drafts do not
depend on how many requests draft beside it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..layers.rope import forget_tables
from ..models.dspark import DSparkCache, RingWindows
from ..models.model import DeepseekForCausalLM
from .graph_capture import GraphCapture, SharedOutputs
from .step_graphs import BATCH_BUCKETS, batch_bucket, bucket_sizes

PADDING = -1  # a ring slot's position when it holds no row: before every window


@dataclass
class ProposalBuffers:
    """The static inputs of every bucket (a bucket of b blocks reads the first b rows)."""

    last_tokens: torch.Tensor  # [max_seqs] long
    rings: RingWindows  # keys [max_seqs, S, stages, head_dim], positions [max_seqs, S], committed [max_seqs]

    def first(self, b: int) -> tuple[torch.Tensor, RingWindows]:
        r = self.rings
        return self.last_tokens[:b], RingWindows(r.keys[:b], r.positions[:b], r.committed[:b])


class ProposeGraphs:
    label = "draft proposal: {0} blocks"

    def __init__(
        self,
        model: DeepseekForCausalLM,
        max_seqs: int,
        capture: GraphCapture | None,
        ops=None,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
    ):
        """``max_seqs``: the largest bucket (more blocks fall back to ``propose_batch``); ``capture``: how graphs are
        captured (the engine's, shared with its other graphs), None runs the fixed shapes eagerly; ``ops``
        (kernels.ops.KernelOps): the stages' mHC and MoE ops, None the torch forward (a GPU capture needs them)."""
        if model.mtp is None:
            raise ValueError(f"{model.cfg.name} has no DSpark stages")
        if max_seqs < 1:
            raise ValueError(f"max_seqs {max_seqs}: a proposal bucket holds at least one block")
        self.model, self.mtp, self.max_seqs, self.capture, self.ops = model, model.mtp, max_seqs, capture, ops
        self.buckets = tuple(bucket_sizes(max_seqs, batch_buckets))
        self._buffers: ProposalBuffers | None = None  # made on first use, on the model's device
        self._graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # bucket -> its graph (None: run eagerly)
        self._outputs = SharedOutputs(max_seqs)  # every graph's (drafts, confidences), in its first rows
        self._graph_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset_counts()

    def reset_counts(self) -> None:
        self.runs, self.replays, self.padded_rows, self.fallbacks = 0, 0, 0, Counter()

    @torch.no_grad()
    def propose(
        self,
        last_tokens: torch.Tensor | list[int],
        positions: torch.Tensor | list[int],
        states: list[DSparkCache],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``DSpark.propose_batch(last_tokens, positions, states, ...)`` in the bucket's fixed shapes: (drafts
        [B, block], confidence logits [B, block]), copies the next replay does not touch. ``last_tokens`` and
        ``positions`` [B]: device tensors (nothing is checked or read back), or host lists (checked against what
        each state holds)."""
        if not isinstance(positions, torch.Tensor):
            for p, state in zip(positions, states):
                if state.last_position != p:
                    raise ValueError(f"propose at p={p} but the draft state was ingested up to {state.last_position}")
        n = len(states)
        if n > self.max_seqs:
            self.fallbacks["batch size outside the buckets"] += 1
            buf = self._new_buffers(n)
            self._fill(buf, n, last_tokens, positions, states)
            return self._forward(buf, n)
        b = batch_bucket(n, self.max_seqs, self.buckets)
        self._buffers = self._buffers or self._new_buffers(self.max_seqs)
        self._fill(self._buffers, b, last_tokens, positions, states)
        if b not in self._graphs:
            self._graphs[b] = self._capture(b)
        self.runs += 1
        self.padded_rows += b - n
        graph = self._graphs[b]
        if graph is None:
            drafts, conf = self._forward(self._buffers, b)
        else:
            graph.replay()
            self.replays += 1
            drafts, conf = self._graph_outputs[b]
        return drafts[:n].clone(), conf[:n].clone()

    def _forward(self, buf: ProposalBuffers, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        last, rings = buf.first(b)
        return self.mtp.propose_fixed(last, rings, self.model.embed, self.model.head, ops=self.ops)

    def _capture(self, b: int) -> torch.cuda.CUDAGraph | None:
        if self.capture is None:
            return None
        # the warm-up runs read the buffers this proposal just filled and write nothing but their outputs
        graph, self._graph_outputs[b] = self.capture(
            lambda: self._forward(self._buffers, b), self.label.format(b), forget_tables, self._outputs
        )
        return graph

    def _fill(
        self,
        buf: ProposalBuffers,
        b: int,
        last_tokens: torch.Tensor | list[int],
        positions: torch.Tensor | list[int],
        states: list[DSparkCache],
    ) -> None:
        """The first b rows of ``buf``: each request's token, position and ring; rows past the requests are
        dummies. One upload, no wait for the device."""
        n, slots = len(states), buf.rings.keys.shape[1]
        rings = [(i, st.ring) for i, st in enumerate(states) if st.ring is not None]
        if any(k.shape[0] > slots for _, (k, _) in rings):
            raise ValueError(f"a ring holds more rows than the proposal's {slots} slots (window + block)")
        dest = [i * slots + j for i, (k, _) in rings for j in range(k.shape[0])]
        given = isinstance(positions, torch.Tensor)
        host = dest if given else list(last_tokens) + list(positions) + dest
        up = torch.tensor(host, dtype=torch.long).to(buf.last_tokens.device, non_blocking=True)
        if not given:
            last_tokens, positions, up = up[:n], up[n : 2 * n], up[2 * n :]
        last, r = buf.first(b)
        last[:n].copy_(last_tokens)
        last[n:].fill_(self.mtp.cfg.dspark_noise_token_id)
        r.committed[:n].copy_(positions)
        r.committed[n:].zero_()
        r.positions.fill_(PADDING)
        if dest:
            keys = torch.cat([k for _, (k, _) in rings]).to(r.keys.dtype)
            r.keys.view(b * slots, *r.keys.shape[2:]).index_copy_(0, up, keys)
            r.positions.view(b * slots).index_copy_(0, up, torch.cat([p for _, (_, p) in rings]))

    def _new_buffers(self, rows: int) -> ProposalBuffers:
        cfg, emb = self.mtp.cfg, self.model.embed.weight
        s, dev, slots = len(self.mtp), emb.device, cfg.sliding_window + cfg.dspark_block_size
        # zeros, not empty: a slot no ring filled yet is masked, and 0 x a finite key adds nothing (garbage could
        # be NaN)
        return ProposalBuffers(
            torch.zeros(rows, dtype=torch.long, device=dev),
            RingWindows(
                torch.zeros(rows, slots, s, cfg.head_dim, dtype=emb.dtype, device=dev),
                torch.full((rows, slots), PADDING, dtype=torch.long, device=dev),
                torch.zeros(rows, dtype=torch.long, device=dev),
            ),
        )

    def report(self) -> dict:
        return {
            "graphs": sorted(b for b, g in self._graphs.items() if g is not None),
            "fixed_shape_steps": sorted(self._graphs),
            "runs": self.runs,
            "replays": self.replays,
            "padded_rows": self.padded_rows,
            "fallbacks": dict(self.fallbacks),
        }
