"""The scheduler: which rows of which requests run in the next step, under a token budget, and the one owner of a
request's progress.

Every step first serves the running requests (decodes, and the next chunk of prefills still in flight),
then admits waiting ones, chunking a long prompt so decode tokens and prefill chunks share one batch.
When the global KV pool runs out, the lowest-priority running request is preempted by recompute: its
cache is freed and it goes back to the front of the queue with its tokens so far, so nothing is lost.
After a step ran, ``update`` moves each request on: its computed tokens by the step's rows, its output by the tokens
the step accepted for it (a list per request: one sampled token today, a verify step's accepted drafts later).

With a KV connector (P/D disaggregation, ``dsserve.disagg.connector``), a request whose prompt KV is on a prefill
instance waits in ``remote`` (``WAITING_FOR_REMOTE_KVS``) until its blocks arrived and joined the prefix cache; it
then queues like any request and is admitted as a prefix hit (bounded replay rebuilds its windows). A failed pull
finishes it with the reason (``take_failed``). On a prefill instance, a request handed off to a decode instance has
its prompt blocks staged by the connector as it finishes (``kv_transfer_params``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv.paged import PagedKVCache
from .request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    policy: str = "fcfs"  # "fcfs" | "priority"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk per step (0 = the budget)
    swa_bounded_replay: bool = False  # V4.1: the decoder sees only the last `replay_window` prompt rows
    replay_window: int = 0
    enable_prefix_caching: bool = False
    session_retention_s: float = 0.0  # keep a finished session request's blocks ahead of LRU this long

    def __post_init__(self):
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy {self.policy!r} is not 'fcfs' or 'priority'")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # rows of this request in the step, starting at request.num_computed_tokens (drafts included)
    draft_token_ids: list[int] = field(default_factory=list)  # the last rows: drafts the step verifies

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token, so the step samples from its last row (and its draft
        rows). Valid until the step's ``Scheduler.update``."""
        return self.request.num_computed_tokens + self.num_tokens - self.num_drafts == self.request.num_tokens


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class StepOutput:
    """What a step gave its requests: request id -> the token ids it accepted, in order. A chunk that samples accepts
    one token, a verify chunk (drafts) one to 1 + its drafts; a prefill chunk short of its prompt's end, none (it may
    be left out). ``rolled_back``: request id -> how many of its chunk's last rows the step took back out of the cache
    (rejected drafts, engine.drafter)."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    rolled_back: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: PagedKVCache, connector=None):
        self.config, self.kv, self.connector = config, kv, connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self.kv_transfer_params: dict[str, dict] = {}  # P: request id -> its hand-off, read once by the engine

    # ------------------------------------------------------------------------- queue
    def add(self, req: Request) -> None:
        """Queue ``req``; with a hand-off to load, start its pull (``KVTransferError`` for one this instance cannot
        take: nothing is queued then)."""
        kt = req.kv_transfer
        if kt and kt.get("transfer_id") and self.connector is not None and req.params.prompt_logprobs is None:
            if self.connector.start_load(req):
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.requests[req.request_id] = req
                self.remote[req.request_id] = req
                return
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.remote.pop(req.request_id, None)
            self.connector.cancel(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.kv_held:  # arrived remote KV not admitted yet
            self.kv.blocks.free(req.kv_held)
            req.kv_held = []
        kt = req.kv_transfer
        if kt and kt.get("do_remote_decode") and self.connector is not None and req.kv is not None:
            if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.kv_transfer_params[req.request_id] = self.connector.request_finished(req)
        self._release(req, finished=True)
        req.status = status
        self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote)

    def take_failed(self) -> list[tuple[Request, int, str]]:
        """Requests whose remote KV could not be loaded since the last call, finished (aborted) and holding nothing,
        with an HTTP status and the reason."""
        if self.connector is None or not self.connector.failed:
            return []
        out, self.connector.failed = self.connector.failed, []
        for req, _, _ in out:
            self.remote.pop(req.request_id, None)
            self.requests.pop(req.request_id, None)
            req.status = RequestStatus.FINISHED_ABORTED
        return out

    def _poll_remote(self) -> None:
        idle = not (self.waiting or self.running)
        for req in self.connector.poll(wait_s=0.005 if idle else 0.0):
            del self.remote[req.request_id]
            req.status = RequestStatus.WAITING
            self.waiting.append(req)

    # ------------------------------------------------------------------------- one step
    def schedule(self) -> StepPlan:
        if self.remote:
            self._poll_remote()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        for req in list(self._by_priority(self.running)):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(req, budget)
            if n == 0:
                continue
            k = self._num_drafts(req, n, budget)
            if self.kv.blocks_needed(req.kv, req.num_computed_tokens + n + k) > self.kv.blocks.num_free:
                k = 0  # drafts never preempt anyone
            while self.kv.blocks_needed(req.kv, req.num_computed_tokens + n) > self.kv.blocks.num_free:
                victim = self._by_priority(self.running)[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            self.kv.grow(req.kv, req.num_computed_tokens + n + k)
            chunks.append(ScheduledChunk(req, n + k, req.draft_token_ids[:k]))
            budget -= n + k
        if not preempted:  # admitting new work right after a preemption would only thrash
            self._admit(chunks, budget)
        now = time.monotonic()
        for c in chunks:
            if c.request.metrics.first_scheduled_time is None:
                c.request.metrics.first_scheduled_time = now
        return StepPlan(chunks, preempted)

    def update(self, plan: StepPlan, output: StepOutput) -> list[Request]:
        """After ``plan`` ran: each of its requests has its chunk's rows in the cache (``num_computed_tokens``
        advances by them) and the tokens ``output`` accepted for it appended. Requests that finished while the step
        ran (an abort) are left alone. Returns the requests given tokens, in plan order. The only place, with
        admission and release, that moves a request's progress."""
        given = []
        for c in plan.chunks:
            r = c.request
            if r.status.finished:
                continue
            r.num_computed_tokens += c.num_tokens - output.rolled_back.get(r.request_id, 0)
            r.draft_token_ids = []
            accepted = output.token_ids.get(r.request_id)
            if accepted:
                r.output_token_ids.extend(accepted)
                given.append(r)
        return given

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        order = self._by_priority(list(self.waiting)) if self.config.policy == "priority" else list(self.waiting)
        for req in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or self.kv.slots.num_free == 0:
                break
            # prompt logprobs need every prompt row's logits: no cache hit, no narrowing (as vLLM skips the cache)
            exact = req.params.prompt_logprobs is not None
            hit, hashes = (
                self.kv.match(req.all_token_ids, req.cache_salt)
                if self.config.enable_prefix_caching and not exact
                else ([], [])
            )
            hit_len = len(hit) * self.kv.layout.block_size
            start = hit_len
            if hit and self.config.swa_bounded_replay:
                start = max(0, hit_len - self.config.replay_window)  # encoder-side bounded replay
            n = self._chunk_size(req.num_tokens - start, budget)
            if n <= 0:
                break
            # Cached blocks that sit free in the LRU queue stop being free once this request holds them.
            reclaimed = sum(1 for b in hit if self.kv.blocks.ref[b] == 0)
            need = -(-(start + n) // self.kv.layout.block_size) - len(hit)
            if need > self.kv.blocks.num_free - reclaimed:
                break  # FCFS: no overtaking by smaller requests
            self.waiting.remove(req)
            req.kv = self.kv.new_sequence()
            req.block_hashes = hashes
            if hit:
                req.num_computed_tokens = self.kv.attach_prefix(
                    req.kv, hit, req.all_token_ids, start if self.config.swa_bounded_replay else None
                )
                req.num_cached_tokens = hit_len
            if req.kv_held:  # the blocks a remote load held until now: the sequence holds its own references
                self.kv.blocks.free(req.kv_held)
                req.kv_held = []
            req.status = RequestStatus.RUNNING
            if self.config.swa_bounded_replay and not exact:
                req.decoder_start = max(0, req.num_tokens - self.config.replay_window)
            self.running.append(req)
            self.kv.grow(req.kv, req.num_computed_tokens + n)
            chunks.append(ScheduledChunk(req, n))
            budget -= n

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """How many of ``req``'s drafts ride on its chunk of ``n`` rows: only a chunk that samples verifies drafts,
        within the budget, the context (max_model_len) and its max_tokens (the bonus token is one more)."""
        if not req.draft_token_ids or n != req.num_pending_tokens:
            return 0
        left = self.config.max_model_len - req.num_tokens
        if req.params.max_tokens is not None:
            left = min(left, req.params.max_tokens - len(req.output_token_ids) - 1)
        return max(0, min(len(req.draft_token_ids), budget - n, left))

    def _chunk(self, req: Request, budget: int) -> int:
        return self._chunk_size(req.num_pending_tokens, budget)

    def _chunk_size(self, n: int, budget: int) -> int:
        if n > budget and not self.config.enable_chunked_prefill:
            return 0
        cap = self.config.long_prefill_token_threshold
        return min(n, budget, cap) if cap > 0 else min(n, budget)

    def _by_priority(self, reqs: list[Request]) -> list[Request]:
        if self.config.policy == "priority":
            return sorted(reqs, key=lambda r: (r.priority, r.arrival_time))
        return sorted(reqs, key=lambda r: r.arrival_time)

    def _preempt(self, req: Request) -> None:
        """Recompute-style: drop the KV, keep the tokens, go back to the front of the queue."""
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request, finished: bool = False) -> None:
        if req.kv is not None:
            hold = None
            if finished and req.session_id is not None and self.config.session_retention_s > 0:
                hold = time.monotonic() + self.config.session_retention_s
            self.kv.release(req.kv, hold)
            req.kv = None
        req.num_computed_tokens = 0
        req.decoder_start = None
        req.draft_token_ids, req.draft_state = [], None

    def register_full_blocks(self, reqs: list[Request]) -> None:
        """After a step: the requests' newly full blocks join the prefix cache (decode blocks too)."""
        if not self.config.enable_prefix_caching:
            return
        from ..kv.prefix_cache import block_hashes

        for r in reqs:
            if r.kv is None:
                continue
            bs = self.kv.layout.block_size
            if r.num_tokens // bs > len(r.block_hashes):  # the token list is built only when a block filled
                parent = r.block_hashes[-1] if r.block_hashes else None
                r.block_hashes += block_hashes(r.all_token_ids, bs, r.cache_salt, len(r.block_hashes), parent)
            self.kv.register_full_blocks(r.kv, r.block_hashes)

    # ------------------------------------------------------------------------- invariants
    def check(self) -> None:
        """The cache holds exactly the running requests' blocks and window slots."""
        held = [b for r in self.waiting for b in r.kv_held]
        held += self.connector.held_blocks() if self.connector is not None else []
        self.kv.check([r.kv for r in self.running], held)
        for r in self.waiting:
            if r.kv is not None or r.num_computed_tokens:
                raise RuntimeError(f"waiting request {r.request_id} still holds KV")
