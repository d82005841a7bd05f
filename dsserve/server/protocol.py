"""OpenAI request bodies (plus vLLM's extra sampling fields), validated by pydantic before anything runs.

Every field of OpenAI's completions and chat-completions request schemas is either implemented or accepted as a
documented no-op (docs/openai_api.md has the table); any other field is a 400 that names it. Checks that need more
than one field, or that pydantic cannot phrase well, raise ``FieldError`` from ``sampling_params``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's range for seed and priority


class FieldError(ValueError):
    """A request field that is well-formed but not allowed: the message says what is allowed instead."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 400 naming it, not silently ignored


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (needs include_usage)


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    user: str | None = None  # no-op: an end-user id for the caller's own abuse tracking
    # vLLM's extra fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0
    # P/D disaggregation (docs/disaggregation.md), vLLM's field: {"do_remote_decode": true} to a prefill instance; to
    # a decode instance, the kv_transfer_params the prefill instance returned plus its "remote_url"
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("seed", "priority")
    @classmethod
    def _int64(cls, v: int | None) -> int | None:
        if v is not None and not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"must be an integer in [{INT64_MIN}, {INT64_MAX}] (int64, as vLLM), got {v}")
        return v

    def check(self) -> None:
        """The cross-field rules (vLLM's): ``FieldError`` on the first broken one."""
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream options can only be defined when `stream=True`")

    def output_limit(self) -> tuple[str, int | None]:
        """The field that limits the completion's length and its value (None: not given)."""
        return "max_tokens", self.max_tokens

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams, with ``n=1``: the front runs ``n`` requests for ``n`` choices. The ``n``
        rules (greedy sampling needs ``n == 1``, as vLLM) are checked here all the same."""
        self.check()
        kw: dict[str, Any] = dict(
            n=1,
            max_tokens=self.output_limit()[1] or default_max_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            logit_bias=_logit_bias(self.logit_bias),
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.n > 1:
            SamplingParams(**dict(kw, n=self.n))  # raises for n > 1 with greedy sampling
        return SamplingParams(**kw)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise FieldError("logit_bias", f"keys must be token ids (integers as strings), got {key!r}") from None
        if not math.isfinite(value):
            raise FieldError("logit_bias", f"bias for token {key} must be a finite number in [-100, 100]")
        out[tid] = value
    return out


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt is prepended to each choice's text
    suffix: str | None = None  # rejected unless null: the model has no fill-in-the-middle format
    best_of: int | None = Field(default=None, ge=1)  # only best_of == n (the same result as n alone)

    def check(self) -> None:
        super().check()
        if self.suffix is not None:
            raise FieldError("suffix", "is not supported (this model has no fill-in-the-middle format); leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError(
                "best_of",
                f"best_of={self.best_of} with n={self.n} is not supported (as in vLLM V1): dsserve does not rank "
                "extra samples; send best_of equal to n, or leave it out",
            )
        if self.echo and self.logprobs is not None:
            raise FieldError("echo", "echo with logprobs needs prompt logprobs, which dsserve does not compute")


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, reasoning_content, ...
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # {"thinking": true} turns DeepSeek thinking mode on
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # ---- tool calling and reasoning (server/tool_calls.py: thinking_mode, plan_tools, json_schema_of)
    parallel_tool_calls: bool = True
    reasoning_effort: str | int | None = None  # "none" (off), minimal ... max, or 1..100 (V4.1)
    thinking: dict[str, Any] | None = None  # DeepSeek's {"type": "enabled" | "disabled"}
    response_format: dict[str, Any] | None = None  # text / json_object / json_schema (needs the grammar extra)
    # accepted no-ops (docs/openai_api.md says why each changes nothing here)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.modalities is not None and "audio" in self.modalities:
            raise FieldError("modalities", 'only ["text"] is supported: this model does not produce audio')
        if self.audio is not None:
            raise FieldError("audio", "audio output is not supported: this model produces text only")
        if self.web_search_options is not None:
            raise FieldError("web_search_options", "web search is not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true")

    def output_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
