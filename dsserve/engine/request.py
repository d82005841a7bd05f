"""A request's life in the engine: its tokens, how many have their KV computed, and where its KV lives."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .outputs import RequestMetrics
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # a decode instance pulls its prompt's KV (disagg.connector)
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    priority: int = 0  # lower runs first under the priority policy, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    kv: object | None = None  # SequenceKV while running
    decoder_start: int | None = None  # bounded replay floor for this run (set when scheduled)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    metrics: RequestMetrics | None = None
    cache_salt: str | None = None  # isolates this tenant's prefix-cache entries
    session_id: str | None = None  # an agent session whose blocks may outlive this request
    block_hashes: list = field(default_factory=list)  # hash chain of this request's full token blocks
    num_cached_tokens: int = 0  # prompt tokens whose global KV came from the prefix cache
    counted_admission: int = -1  # the admission (preemption count) the engine's stats have counted
    # prompt_logprobs: per prompt position (0 has none), (token, logprob, rank, top ids, top logprobs) on the host
    prompt_logprobs: list | None = None
    grammar: object | None = None  # a JsonGrammar when params.json_schema is set (engine/structured_output.py)
    # P/D disaggregation (dsserve/disagg): the request's kv_transfer_params (P: {"do_remote_decode": true}; D: where
    # to pull its prompt's KV from), the blocks D holds for it until admission, and what its hand-off moved
    kv_transfer: dict | None = None
    kv_held: list = field(default_factory=list)
    kv_transfer_stats: dict | None = None
    # speculative decoding (engine/drafter.py): the drafts the next step verifies, and the DSpark rings
    draft_token_ids: list[int] = field(default_factory=list)
    draft_state: object | None = None

    def __post_init__(self):
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list (a 128K prompt is ~0.5 ms to copy, per
        request and step)."""
        p, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if stop <= n:
            return p[start:stop]
        out = self.output_token_ids[max(0, start - n) : stop - n]
        return p[start:] + out if start < n else out

    @property
    def num_pending_tokens(self) -> int:
        """Tokens known but not yet through the model (a prompt's rest, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens
