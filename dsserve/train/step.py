"""One training step in fixed shapes: this rank's sequences padded to one length, forward, loss and backward; on a GPU
captured once as a CUDA graph and replayed.

The tiny model's eager step on an H200 is bound by launching its ops (~15 K of them, ~50-100 us each on the host,
the GPU mostly idle: benchmarks/results/train-tiny-h200-pilot): a graph launches them all at once. The same body runs
eagerly on the CPU (and for the first steps on a GPU, which compile the Triton kernels), so the CPU tests check
what the graph replays. A capture needs fixed shapes and no host reads inside: every sequence is padded to
``length`` (the pads: end-of-sequence tokens at loss weight 0), the step's changing numbers (tokens, targets, weights,
1 / the whole step's weight) live in device buffers refilled before each replay, and the forward runs with
``static=True`` (nothing read back or uploaded). Being of one length and fresh, the sequences attend as one batch,
each row reading its window in blocks rather than an [L, L] masked square (``CSA2Attention._attend_one_shape``): the
ops of a step hardly grow with its sequences (the tiny shape on the CPU, 89-row sequences, forward and backward:
30.8 K ops for 2 sequences, 31.8 K for 8, 36.0 K for 32, dense or sparse alike; through the per-sequence loop 31.6 K
and 44.8 K dense, 33.3 K and 51.5 K sparse, for 2 and 8), nor its bytes with L x L. After capture the parameters'
``.grad`` are the graph's outputs: each replay overwrites them (they are never set to None again), and whatever reads
them (the ranks' sum, clipping, the optimizer) runs outside the graph.
"""

from __future__ import annotations

import math

import torch

from ..layers.context import SeqRows, StepBatch

WARM_STEPS = 2  # eager steps before a capture: Triton compiles and the allocator settles


def problem_align(cfg) -> int:
    """Packed problems start at multiples of this (``train.batch_of`` pads before them), so that no global entry (a
    ratio-r source pools r rows) and no candidate block (``candidate_block_size`` entries of the candidate source)
    holds rows of two problems: each problem then has the entries and blocks it would have alone."""
    align = 1
    for layer, r in enumerate(cfg.compress_ratios[: cfg.num_hidden_layers]):
        if r:
            align = math.lcm(align, r * (cfg.candidate_block_size if layer == cfg.candidate_source_layer_id else 1))
    return align


class TrainStep:
    """Step shape [seqs x length] for ``model``; ``total_seqs``: the sequences of the whole step on all ranks (the
    indexer KLs are averaged over all of them). ``graph``: capture on a GPU after ``WARM_STEPS`` eager steps.
    ``isolate_bos``: the BOS id each packed problem starts with: every row then reads only its own problem (from its
    BOS on; the problems must start at multiples of ``problem_align``), as if each were a sequence of its own. None:
    a sequence's problems see each other."""

    def __init__(
        self,
        model,
        seqs: int,
        length: int,
        total_seqs: int,
        kl_weight: float,
        dense: bool,
        graph: bool,
        pad_id: int,
        isolate_bos: int | None = None,
    ):
        self.model, self.seqs, self.length, self.total_seqs = model, seqs, length, total_seqs
        self.kl_weight, self.dense, self.pad_id, self.bos_id = kl_weight, dense, pad_id, isolate_bos
        dev = model.embed.weight.device
        self.params = [p for p in model.parameters() if p.requires_grad]
        n = seqs * length
        self.tokens = torch.full((n,), pad_id, dtype=torch.int64, device=dev)
        self.targets = torch.zeros(n, dtype=torch.int64, device=dev)
        self.weights = torch.zeros(n, dtype=torch.float32, device=dev)  # loss weight of row t's next-token guess
        self.completion = torch.zeros(n, dtype=torch.bool, device=dev)
        self.inv_total = torch.ones((), dtype=torch.float32, device=dev)  # 1 / the whole step's weight, all ranks
        self.first = None if isolate_bos is None else torch.zeros(n, dtype=torch.int64, device=dev)
        self.align = problem_align(model.cfg)
        self.use_graph = graph and dev.type == "cuda"
        self.graph, self.out, self.warm = None, None, 0

    def load(self, batch: list[tuple[list[int], list[bool]]], weights: list[list[float]], weight_total: float) -> None:
        """This rank's sequences (token ids, which are completion) and their row weights (``train.token_weights``)
        into the buffers, each padded to ``length``."""
        if len(batch) != self.seqs or any(len(ids) > self.length for ids, _ in batch):
            raise ValueError(
                f"a step of this shape takes {self.seqs} sequences of at most {self.length} tokens, got "
                f"{len(batch)} of up to {max((len(ids) for ids, _ in batch), default=0)}"
            )
        n, L = self.seqs * self.length, self.length
        tokens, targets = [self.pad_id] * n, [0] * n
        w, done, first = [0.0] * n, [False] * n, [0] * n
        for i, ((ids, completion), wi) in enumerate(zip(batch, weights)):
            at = i * L
            tokens[at : at + len(ids)] = ids
            targets[at : at + len(ids) - 1] = ids[1:]
            w[at : at + len(ids) - 1] = wi
            done[at : at + len(ids) - 1] = [bool(c) for c in completion[1:]]  # None: alignment padding
            if self.bos_id is not None:
                start = 0
                for t in (t for t, tok in enumerate(ids) if tok == self.bos_id):
                    if t % self.align:
                        raise ValueError(
                            f"sequence {i}: a problem starts at {t}; isolated problems start at "
                            f"multiples of {self.align} (train.batch_of pads them there)"
                        )
                    first[at + start : at + t] = [start] * (t - start)
                    start = t
                first[at + start : at + L] = [start] * (L - start)
        self.tokens.copy_(torch.tensor(tokens))
        self.targets.copy_(torch.tensor(targets))
        self.weights.copy_(torch.tensor(w))
        self.completion.copy_(torch.tensor(done))
        if self.first is not None:
            self.first.copy_(torch.tensor(first))
        self.inv_total.fill_(1.0 / weight_total)

    def _body(self) -> dict:
        m, L = self.model, self.length
        seqs = [SeqRows(slice(i * L, (i + 1) * L), m.new_cache()) for i in range(self.seqs)]
        kl = []
        step = StepBatch(
            self.tokens, seqs, index_kl=kl, dense_entries=self.dense, static=True, segment_first=self.first
        )
        hidden = m.forward_batch(step).hidden
        ce = torch.nn.functional.cross_entropy(m.logits(hidden).float(), self.targets, reduction="none")
        kl_sum = torch.stack(kl).sum() if kl else ce.new_zeros(())
        # every sequence has the same shape, so the same number of KL terms: the whole step's count is known here
        kl_count = len(kl) // self.seqs * self.total_seqs
        loss = (ce * self.weights).sum() * self.inv_total + self.kl_weight * kl_sum / max(kl_count, 1)
        loss.backward()
        return {"ce": ce.detach(), "kl_sum": kl_sum.detach(), "kl_count": len(kl)}

    def run(self) -> dict:
        """Forward and backward of the loaded step: afterwards each parameter's ``.grad`` is this step's gradient
        (not accumulated). Returns device tensors: per-row cross entropy, the KL sum, and the KL term count."""
        if not self.use_graph:
            for p in self.params:
                p.grad = None
            return self._body()
        if self.graph is None and self.warm < WARM_STEPS:  # eager, on a side stream as a capture wants
            self.warm += 1
            for p in self.params:
                p.grad = None
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._body()
            torch.cuda.current_stream().wait_stream(side)
            return out
        if self.graph is None:
            for p in self.params:  # the captured backward then makes each .grad in the graph's memory
                p.grad = None
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph):
                    self.out = self._body()
            except RuntimeError as e:  # something in the step cannot be captured: say so, go on eagerly
                print(
                    f"dsserve.train: the step could not be captured as a CUDA graph ({str(e).splitlines()[0]}); "
                    f"running it eagerly",
                    flush=True,
                )
                self.use_graph, self.graph = False, None
                return self.run()
        self.graph.replay()
        return self.out

    def release(self) -> None:
        """Drop the graph and the gradients it owns (before capturing another shape or mode)."""
        for p in self.params:
            p.grad = None
        self.graph = self.out = None
