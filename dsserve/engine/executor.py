"""The executor: how a scheduled step reaches the model, on one process or on a tensor-parallel group.

``EngineCore`` calls ``executor.execute(plan)`` once per step and gets back the requests that sample and their
logits [B, V]. ``LocalExecutor`` is the runner itself. ``TPExecutor`` (TP rank 0, in the engine's process) turns
the plan into a ``StepMessage``, sends it to the T - 1 worker processes (``distributed.tp_worker``) and runs its own
runner: every rank then runs the same forward on the same rows and joins the same collectives; rank 0 alone
samples. Workers hold a mirror of each request (its tokens, its ``SequenceKV`` over their own paged cache, at the
block ids rank 0's scheduler chose), moved on only by messages, in order.

The message carries only what a worker cannot know: new requests' prompt ids, per scheduled chunk its start, rows,
the output tokens sampled since its last chunk and the blocks added to its table, a sequence's host state when it
was (re)admitted (window slot, blocks, prefix-hit position), and the ids whose sequence was released or that
finished. It goes down one pipe per worker (pickled once): a worker blocks on its pipe while the engine idles, and
the pipe's end of file is its parent's death.

With DSpark drafts (``execute(plan, speculative=True)``) a verify chunk carries its drafts, and the step's message
is followed by two more. Each worker, having run the same verify forward, ingests its rows into its drafter's rings
as rank 0 does (engine.drafter). ``DraftPass``, sent once rank 0 has its verdict on the device: the requests that
draft next; then per request the target's token and the committed position its block starts after come from rank 0
in one broadcast on the TP group (on the device under NCCL, so rank 0 does not wait for its verdict to send them);
the workers join the DSpark stages' batched pass (their MoE and the vocabulary-parallel embedding and head close with
collectives). ``Settle``, once rank 0 has read the verdict: per sampling request the tokens it accepted (untrimmed,
as the drafter saw them), for the workers' ``settle`` (rejected rows out of the rings, the cache rolled back) and
their mirrors. Rank 0's own drafts ride in the next step's chunks: a worker's are dropped. No rank waits on another
but in the collectives it already joins (and the one broadcast): two extra one-way messages a step, no round trip.

A worker that dies, a collective that fails or times out, or any fault inside a TP step fails the executor for good
(the ranks can no longer be trusted to be in step): ``EngineDeadError``, the workers reaped.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .request import Request
from .runner import ModelRunner
from .scheduler import StepPlan

log = logging.getLogger("dsserve")
# A collective that waits longer than this fails the step (a hung or lost rank); a dead peer fails it at once.
TIMEOUT_ENV = "DSSERVE_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def dist_timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


class EngineDeadError(RuntimeError):
    """The engine's parallel workers (TP workers, DP ranks) are gone or out of step; it cannot run another step (HTTP
    503). A DP rank that dies stops every rank: nothing in flight will finish."""


class LocalExecutor:
    """The model on this process: the runner, unchanged."""

    failure: str | None = None  # never set: a local step's fault is that step's alone

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, plan: StepPlan, speculative: bool = False) -> tuple[list[Request], torch.Tensor]:
        return self.runner.execute(plan)

    def draft_pass(self, proposers: list[Request], last_tokens, positions, propose: Callable):
        """The next drafts: ``propose(proposers, last_tokens, positions)`` (``Drafter.propose``;
        ``TPExecutor.draft_pass``)."""
        return propose(proposers, last_tokens, positions)

    def settle(self, plan: StepPlan, accepted: dict[str, list[int]]) -> None:
        """After the host read a speculative step's verdict (``TPExecutor.settle``: the workers' rollback)."""

    def idle_forward(self) -> None:
        """A forward with no rows: joins the expert-parallel MoE layers' collectives (a DP rank whose peers forward
        while it has nothing to run: distributed.dp_rank.Lockstep)."""
        from ..distributed.expert_parallel import idle_forward

        idle_forward(self.runner.model)

    def idle_draft(self) -> None:
        """A draft pass with no rows: joins the DSpark stages' expert-parallel MoE collectives (a DEP rank with
        nothing to draft while its peers draft: distributed.dp_rank.Lockstep)."""
        from ..distributed.expert_parallel import idle_draft

        idle_draft(self.runner.model)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------------- the message
@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: int | None  # its prefill rows' logits are gathered on every rank (the head's all-gather)


@dataclass(frozen=True)
class SeqState:
    """A sequence's host state as the scheduler admitted it (a fresh one, or a prefix hit's: ``attach_prefix``)."""

    slot: int
    block_table: tuple[int, ...]
    num_tokens: int
    published_until: int
    entries: tuple[tuple[int, int], ...]  # (KV source, global entries)
    engram_history: tuple[int, ...]
    decoder_start: int | None

    @classmethod
    def of(cls, r: Request) -> "SeqState":
        kv = r.kv
        if kv._pending or kv.carried:  # nothing ran on it yet: a worker's fresh mirror is exact
            raise RuntimeError(f"request {r.request_id}: its sequence ran before its first TP step")
        return cls(
            kv.slot,
            tuple(kv.block_table),
            kv.num_tokens,
            kv.published_until,
            tuple(sorted(kv._entries.items())),
            tuple(kv.engram_history.tolist()),
            r.decoder_start,
        )

    def build(self, cache):
        """The mirror ``SequenceKV`` over ``cache`` (a worker's own pool: its block ids are rank 0's)."""
        from ..kv.paged import SequenceKV

        for pos in cache.window_pos.values():  # the ring's previous tenant is gone (PagedKVCache.new_sequence)
            pos[self.slot] = -1
        seq = SequenceKV(cache, self.slot)
        seq.block_table = list(self.block_table)
        seq.num_tokens, seq.published_until = self.num_tokens, self.published_until
        seq._entries = dict(self.entries)
        if self.engram_history:
            seq.engram_history = torch.tensor(self.engram_history, dtype=torch.long)
        return seq


@dataclass(frozen=True)
class Chunk:
    request_id: str
    start: int  # the request's num_computed_tokens
    rows: int
    output_tokens: tuple[int, ...]  # sampled since the worker last saw this request
    new_blocks: tuple[int, ...]  # appended to its block table since then
    seq: SeqState | None  # set when the request got a new sequence
    draft_token_ids: tuple[int, ...] = ()  # the chunk's last rows: the drafts it verifies


@dataclass(frozen=True)
class StepMessage:
    """One step for the TP workers, or ``stop`` (then nothing else)."""

    chunks: tuple[Chunk, ...] = ()
    new: tuple[NewRequest, ...] = ()
    released: tuple[str, ...] = ()  # preempted: their sequence is gone, their tokens stay
    forgotten: tuple[str, ...] = ()  # finished or aborted
    ahead_rows: bool = False  # the fixed-shape runners also build their other buckets (the warm-up: engine.warmup)
    idle: bool = False  # a forward with no rows (the DP lockstep's: every rank joins its peers' MoE collectives)
    idle_draft: bool = False  # a draft pass with no rows (the DEP lockstep's, like ``idle``)
    speculative: bool = False  # a DSpark step: rows saved for rollback; a ``DraftPass``, a ``Settle`` follow
    audit: bool = False  # no step: each worker gathers its requests' cache states to rank 0 (TPExecutor.audit)
    stop: bool = False


@dataclass(frozen=True)
class DraftPass:
    """After a speculative step's forward (the message that follows its ``StepMessage``): who drafts next, in rank
    0's order (the batched pass's rows). Their tokens and positions follow in a broadcast on the TP group."""

    proposers: tuple[str, ...]


@dataclass(frozen=True)
class Settle:
    """After a speculative step's ``DraftPass``, once rank 0 has read the verdict: request id -> the tokens the step
    accepted for it."""

    accepted: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass
class _Sent:
    request: Request
    kv: object | None = None
    outputs: int = 0
    blocks: int = 0


def step_message(plan: StepPlan, sent: dict[str, _Sent]) -> StepMessage:
    """The message for ``plan``, given what the workers were already sent (``sent``, updated in place)."""
    forgotten, released = [], []
    for rid, s in list(sent.items()):
        if s.request.status.finished:
            del sent[rid]
            forgotten.append(rid)
        elif s.kv is not None and s.request.kv is not s.kv:
            s.kv = None
            released.append(rid)
    new, chunks = [], []
    for c in plan.chunks:
        r = c.request
        s = sent.get(r.request_id)
        if s is None or s.request is not r:
            if s is not None:  # an id used again after its request ended between two steps
                forgotten.append(r.request_id)
            s = sent[r.request_id] = _Sent(r)
            new.append(NewRequest(r.request_id, tuple(r.prompt_token_ids), r.params.prompt_logprobs))
        seq = None
        if r.kv is not s.kv:
            seq, s.kv = SeqState.of(r), r.kv
            s.blocks = len(r.kv.block_table)
        table, outs = r.kv.block_table, r.output_token_ids
        chunks.append(
            Chunk(
                r.request_id,
                r.num_computed_tokens,
                c.num_tokens,
                tuple(outs[s.outputs :]),
                tuple(table[s.blocks :]),
                seq,
                tuple(c.draft_token_ids),
            )
        )
        s.outputs, s.blocks = len(outs), len(table)
    return StepMessage(tuple(chunks), tuple(new), tuple(released), tuple(forgotten))


# ----------------------------------------------------------------------------------------------------- rank 0
@dataclass
class MessageStats:
    messages: int = 0
    bytes: int = 0
    max_bytes: int = 0
    seconds: float = 0.0  # building, pickling and sending
    by_size: list = field(default_factory=list)


class TPExecutor:
    """TP rank 0: sends each step to the workers, runs its own runner; fails for good on a lost worker."""

    def __init__(self, runner: ModelRunner, tp_rank):
        """``tp_rank``: rank 0's ``distributed.tp_worker.TPRank``: the control pipes to ranks 1..T-1 and their
        processes (watched here)."""
        self.runner, self.tp, self.conns, self.procs = runner, tp_rank, tp_rank.conns, tp_rank.procs
        self.failure: str | None = None
        self.stats = MessageStats()
        self._sent: dict[str, _Sent] = {}
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.procs.watch(self._worker_died)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` once, from whichever thread notices the failure first (the watchdog's included)."""
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def execute(self, plan: StepPlan, speculative: bool = False) -> tuple[list[Request], torch.Tensor]:
        """``speculative``: a DSpark step (``EngineCore._step_speculative``), whose ``draft_pass`` must follow."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        t0 = time.perf_counter()
        msg = step_message(plan, self._sent)
        if any(g is not None and g.ahead_rows for g in self._graphs()):  # every rank captures the same graphs
            msg = replace(msg, ahead_rows=True)
        if speculative:
            msg = replace(msg, speculative=True)
        self._post(msg, t0)
        try:
            return self.runner.execute(plan)
        except Exception as e:
            raise self._fail_step(f"TP rank 0's step failed: {type(e).__name__}: {e}") from e

    def draft_pass(self, proposers: list[Request], last_tokens, positions, propose: Callable):
        """After a speculative step's forward: the workers are told who proposes (a ``DraftPass``), take the
        proposal's inputs from rank 0 in one broadcast on the TP group (``TPRank.share_draft_inputs``: no host wait
        under NCCL) and join the pass rank 0 runs, ``propose(proposers, last_tokens, positions)``
        (``Drafter.propose``)."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        t0 = time.perf_counter()
        self._post(DraftPass(tuple(r.request_id for r in proposers)), t0)
        try:
            if proposers:
                self.tp.share_draft_inputs(last_tokens, positions, len(proposers), last_tokens.device)
            return propose(proposers, last_tokens, positions)
        except Exception as e:
            raise self._fail_step(f"TP rank 0's draft pass failed: {type(e).__name__}: {e}") from e

    def settle(self, plan: StepPlan, accepted: dict[str, list[int]]) -> None:
        """After rank 0 read a speculative step's verdict: the workers are sent ``accepted`` (request id -> the tokens
        the step accepted) for their drafter's ``settle`` and their mirrors. What they were sent follows those
        mirrors: the accepted tokens appended, block tables cut by the rollback."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        t0 = time.perf_counter()
        for c in plan.chunks:
            r, s = c.request, self._sent.get(c.request.request_id)
            if s is None or s.request is not r:
                continue
            s.outputs += len(accepted.get(r.request_id, ()))
            if r.kv is not None and r.kv is s.kv:
                s.blocks = len(r.kv.block_table)
        self._post(Settle(tuple((k, tuple(v)) for k, v in accepted.items())), t0)

    def audit(self) -> list[dict]:
        """Between steps, a diagnostic: each worker's ``tp_worker.sequence_state`` of every request it mirrors
        (request id -> state), ranks 1..T-1 in order (a gather on the TP group)."""
        import torch.distributed as dist

        if self.failure is not None:
            raise EngineDeadError(self.failure)
        self._send(pickle.dumps(StepMessage(audit=True), protocol=pickle.HIGHEST_PROTOCOL))
        group, out = self.tp.groups.tp, [None] * self.tp.size
        dist.gather_object({}, out, dst=dist.get_global_rank(group, 0), group=group)
        return out[1:]

    def _post(self, msg, t0: float) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._send(data)
        s = self.stats
        s.messages, s.bytes, s.max_bytes = s.messages + 1, s.bytes + len(data), max(s.max_bytes, len(data))
        s.seconds += time.perf_counter() - t0

    def idle_forward(self) -> None:
        """A forward with no rows on every TP rank of this engine (``LocalExecutor.idle_forward``)."""
        from ..distributed.expert_parallel import idle_forward

        self._idle(StepMessage(idle=True), idle_forward, "idle forward")

    def idle_draft(self) -> None:
        """A draft pass with no rows on every TP rank of this engine (``LocalExecutor.idle_draft``)."""
        from ..distributed.expert_parallel import idle_draft

        self._idle(StepMessage(idle_draft=True), idle_draft, "idle draft pass")

    def _idle(self, msg: StepMessage, run: Callable, what: str) -> None:
        """Tells the workers to run an empty pass (``msg``), then runs rank 0's share (``run(model)``)."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        self._send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        try:
            run(self.runner.model)
        except Exception as e:
            raise self._fail_step(f"TP rank 0's {what} failed: {type(e).__name__}: {e}") from e

    def _send(self, data: bytes) -> None:
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            raise self._fail_step(f"a TP worker's control pipe broke ({e})") from None

    def _graphs(self) -> tuple:
        r = self.runner
        return r.decode_graphs, r.decoder_row_graphs, r.encoder_graphs, r.verify_graphs

    def _fail_step(self, why: str) -> EngineDeadError:
        """A TP step failed: a worker's death (the watchdog's words, when it sees one within a second: a killed
        peer's sockets close just before its exit is visible) or ``why``."""
        deadline = time.monotonic() + 1.0
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        self._set_failure(self.failure or why)
        self.close()
        return EngineDeadError(self.failure)

    def _worker_died(self, rank: int, pid: int, code: int | None) -> None:
        self._set_failure(f"TP worker rank {rank} (pid {pid}) exited with status {code}; the engine has stopped")

    def _set_failure(self, why: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = why
        log.error("%s", why)
        for cb in self._callbacks:
            cb(why)

    def close(self) -> None:
        """Stop the workers (a stop message, then their pipes closed) and reap them; idempotent."""
        if self._closed:
            return
        self._closed, clean = True, self.failure is None
        if clean:
            self.failure = "the engine was closed"
            stop = pickle.dumps(StepMessage(stop=True))
            for conn in self.conns:
                try:
                    conn.send_bytes(stop)
                except OSError:
                    pass
        for conn in self.conns:
            conn.close()
        self.procs.reap(timeout=10.0 if clean else 1.0)  # a failed rank may be stuck: no use waiting long
        self.tp.leave()
