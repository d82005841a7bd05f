"""OpenAI request bodies (plus vLLM's extra sampling fields), validated by pydantic before anything runs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling_params import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 400 naming it, not silently ignored


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    user: str | None = None
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

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = dict(
            n=1,
            max_tokens=self.max_tokens or default_max_tokens,
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
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return SamplingParams(**kw)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


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
    # ---- tool calling and reasoning (server/tool_calls.py)
    parallel_tool_calls: bool = True
    reasoning_effort: str | int | None = None  # low / medium / high / max ... or 1..100 (V4.1)
    thinking: dict[str, Any] | None = None  # DeepSeek's {"type": "enabled" | "disabled"}
    response_format: dict[str, Any] | None = None  # text / json_object / json_schema (needs the grammar extra)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
