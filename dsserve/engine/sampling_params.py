"""Per-request sampling parameters, with vLLM's names, defaults and validation.

Mirrors ``vllm.SamplingParams`` for the fields dsserve supports, so user code carries over:

- ``temperature`` below ``SAMPLING_EPS`` (1e-5) means greedy; greedy resets top_p/top_k/min_p to "off" and
  requires ``n == 1``. A positive temperature below ``MIN_TEMPERATURE`` (0.01) is raised to it, as vLLM does
  (tiny temperatures overflow fp32 logits).
- ``top_k`` 0 or -1 disables top-k (vLLM quietly accepts -1; it is normalised to 0 here).
- ``stop`` may be a string or a list; ``stop_token_ids`` is de-duplicated keeping order; ``seed == -1`` means
  no seed; ``logprobs=True`` means 1; ``max_tokens=None`` means "until the context is full" (the default is
  vLLM's 16; the server's omitted max_tokens is the rest of the context).
- ``logit_bias`` maps token ids to a bias in [-100, 100] added to the raw logits before penalties, temperature
  and top-k/top-p (OpenAI's and vLLM's field; +100 all but forces a token, -100 all but bans it). Ids must lie
  in the vocabulary, which the engine checks (``check_vocab``) since the params do not know it.
- ``prompt_logprobs=n``: each prompt token's logprob (and the top n) under the model, from the prefill's logits
  (such a request reads no prefix cache and is not narrowed by bounded replay); ``detokenize=False``: ids only.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Any

SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
logger = logging.getLogger(__name__)


class SamplingParamsError(ValueError):
    """An invalid sampling parameter. The message names the field, the bad value and what is allowed."""

    def __init__(self, name: str, value: Any, allowed: str):
        self.field, self.value, self.allowed = name, value, allowed
        super().__init__(f"invalid sampling parameter {name}={value!r}: {allowed}")


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-n (the prefill's logits)
    detokenize: bool = True  # False: token ids only, text empty
    banned_token_ids: list[int] | None = field(default_factory=list)  # never sampled (e.g. DSML without tools)
    json_schema: str | None = None  # output constrained to JSON matching this schema (engine/structured_output.py)
    structural_tag: str | None = None  # or to an xgrammar structural tag (JSON text): DSML tool calls

    def __post_init__(self) -> None:
        # ---- normalisation (vLLM's conventions)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise SamplingParamsError("stop", self.stop, "must be a string or a list of strings")
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise SamplingParamsError(
                "stop_token_ids", self.stop_token_ids, "must be a list of non-negative integer token ids"
            )
        self.stop_token_ids = list(dict.fromkeys(ids))
        banned = self.banned_token_ids or []
        if not isinstance(banned, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in banned):
            raise SamplingParamsError("banned_token_ids", banned, "must be a list of non-negative integer token ids")
        self.banned_token_ids = list(banned)
        if self.seed == -1:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", self.logit_bias, "must be a dict of token id -> bias")
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s and may give inf/nan logits; using %s",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE
        if self.temperature < SAMPLING_EPS:  # greedy
            if self.n > 1:
                raise SamplingParamsError("n", self.n, "must be 1 when temperature is 0 (greedy sampling)")
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise SamplingParamsError(name, getattr(self, name), allowed)

        need(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        need(
            _is_num(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            "must be a finite number >= 0 (0 means greedy)",
        )
        need(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(_is_int(self.top_k) and self.top_k >= -1, "top_k", "must be an integer >= 1, or 0 or -1 to disable")
        need(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(
            _is_num(self.repetition_penalty) and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be a finite number > 0",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(_is_num(v) and -2 <= v <= 2, name, "must be in [-2, 2]")
        need(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            "seed",
            "must be an integer in [-2**63, 2**64) or None",
        )
        for tid, bias in (self.logit_bias or {}).items():
            need(_is_int(tid) and tid >= 0, "logit_bias", f"keys must be token ids (integers >= 0), got {tid!r}")
            need(
                _is_num(bias) and math.isfinite(bias) and -100 <= bias <= 100,
                "logit_bias",
                f"bias for token {tid} must be a number in [-100, 100], got {bias!r}",
            )
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1 (or None for no limit)",
        )
        need(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens={self.max_tokens}",
        )
        need(
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            "logprobs",
            "must be None or an integer >= 0 (the number of top tokens to return)",
        )
        need(
            self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            "prompt_logprobs",
            "must be None or an integer >= 0 (the number of top tokens to return per prompt token)",
        )
        need(self.json_schema is None or isinstance(self.json_schema, str), "json_schema", "must be a JSON text")
        need(
            self.structural_tag is None or isinstance(self.structural_tag, str) and self.json_schema is None,
            "structural_tag",
            "must be a JSON text, and json_schema unset",
        )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            need(isinstance(getattr(self, name), bool), name, "must be a bool")
        need(self.detokenize or not self.stop, "stop", "stop strings need detokenize=True (the text is matched)")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a plain dict (e.g. a request body); unknown keys are rejected."""
        if not isinstance(d, dict):
            raise SamplingParamsError("<params>", d, "must be a dict of sampling parameters")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in known:
                raise SamplingParamsError(str(key), d[key], f"unknown field; known fields are {known}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids this request names (``logit_bias``) must lie in [0, vocab_size)."""
        bad = sorted(t for t in self.logit_bias or {} if t >= vocab_size)
        if bad:
            raise SamplingParamsError(
                "logit_bias", self.logit_bias, f"token ids must lie in [0, {vocab_size}); got {bad[:5]}"
            )

    # ---------------------------------------------------------------- derived values
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint: ("json_schema" | "structural_tag", its JSON), or None."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        return ("structural_tag", self.structural_tag) if self.structural_tag is not None else None

    @property
    def stop_buffer_length(self) -> int:
        """Characters a stream holds back so that a stop string that is later cut off is never sent."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def all_stop_token_ids(self, eos_token_id: int | None) -> set[int]:
        """The ids ``min_tokens`` masks: stop_token_ids plus EOS. As in vLLM, EOS is masked even when
        ``ignore_eos`` is set (ignore_eos only stops EOS from ending the request)."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None:
            ids.add(eos_token_id)
        return ids
