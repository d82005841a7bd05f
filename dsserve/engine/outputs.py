"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``.

``CompletionOutput.logprobs`` is a list (one entry per generated token) of ``{token_id: Logprob}`` holding the
sampled token and the top-n tokens; ``cumulative_logprob`` sums the sampled tokens' logprobs. Both are None
when the request did not ask for logprobs, as in vLLM v1. Logprobs are the raw model distribution's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class Logprob:
    """One token's logprob, its rank in the vocabulary (1 = most likely) and its text (``decode([id])``)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list[dict[int, Logprob]]


def make_logprob_dict(
    sampled_token_id: int,
    sampled_logprob: float,
    sampled_rank: int,
    top_token_ids: Sequence[int],
    top_logprobs: Sequence[float],
    tokenizer=None,
) -> dict[int, Logprob]:
    """The per-position dict: the sampled token first, then the top-n with ranks 1..n. When the sampled
    token is among the top-n its entry takes the top-n rank, as in vLLM's output processor."""
    ids = [int(sampled_token_id), *map(int, top_token_ids)]
    lps = [float(sampled_logprob), *map(float, top_logprobs)]
    ranks = [int(sampled_rank), *range(1, len(top_token_ids) + 1)]
    out: dict[int, Logprob] = {}
    for tid, lp, rank in zip(ids, lps, ranks):
        text = tokenizer.decode([tid]) if tokenizer is not None else None
        out[tid] = Logprob(lp, rank, text)
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})"
        )


@dataclass
class RequestMetrics:
    """Timestamps (seconds, one clock: the engine uses ``time.monotonic``) of a request's life."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_generation_tokens: int = 0

    @property
    def time_in_queue(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def mean_time_per_output_token(self) -> Optional[float]:
        """Mean inter-token time after the first token (TPOT); None with fewer than two tokens."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    tpot = mean_time_per_output_token

    @property
    def e2e_latency(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def record_token(self, now: float, count: int = 1) -> None:
        """Note ``count`` new output tokens at time ``now``."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.num_generation_tokens += count


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[list] = None  # not computed by dsserve; kept for vLLM-shaped user code
    num_cached_tokens: int = 0
    # P/D disaggregation (dsserve/disagg): a prefill instance's hand-off for the decode instance; what a decode
    # instance's load moved and took (bytes, transfer_s, replay_s); a failed load's (HTTP status, reason)
    kv_transfer_params: Optional[dict] = None
    kv_transfer_stats: Optional[dict] = None
    error: Optional[tuple] = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics})"
        )
