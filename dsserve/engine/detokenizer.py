"""Incremental detokenization and stop checking, following vLLM v1's output processor.

``IncrementalDetokenizer`` turns one new token at a time into a text delta with the prefix/read-offset
technique: it decodes a short window ``ids[prefix:]`` and the already-emitted part ``ids[prefix:read]`` and
emits the difference, holding everything back while the window's text ends in U+FFFD (a UTF-8 character
whose remaining bytes are still to come in later byte-level tokens). The window starts on a few prompt
tokens so that decoders which look at context (leading spaces) see it.

``StopChecker`` is the per-sequence driver: feed it each sampled token; it decodes, applies the stop rules
and returns the text that is safe to stream. The rules, as in vLLM v1:

- Token rules (``check_token_stop``), only once ``min_tokens`` outputs exist: EOS (unless ignore_eos) ->
  "stop" with stop_reason None; a stop_token_id -> "stop" with stop_reason = the id; then max_tokens (or
  the context limit) -> "length". A stop token is not detokenized unless include_stop_str_in_output.
- Stop strings (``check_stop_strings``), only once more than ``min_tokens`` outputs exist, searching just the
  new characters plus ``len(stop) - 1`` before them, so a stop string split across tokens is found. The
  text is cut before the stop string (or after it, with include_stop_str_in_output); the finish reason is
  "stop" with stop_reason = the string, even when the same token also reached max_tokens.
- Streaming holds back ``max(len(stop)) - 1`` characters until the end (when the stop string is to be
  excluded), so no prefix of a stop string is ever sent and later retracted.
"""

from __future__ import annotations

from typing import Sequence

from .sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens the first decode window starts with (vLLM's initial offset)
MAX_PROMPT_CONTEXT = 24  # widened up to this while the context itself decodes to U+FFFD


class IncrementalDetokenizer:
    """``add_token(id) -> delta``. Works with any tokenizer offering ``decode(ids, skip_special_tokens)``."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prompt_ids = list(prompt_ids)
        n = min(PROMPT_CONTEXT, len(prompt_ids))
        # Start the window on a character boundary: widen it while its text starts with a broken character.
        while n < min(MAX_PROMPT_CONTEXT, len(prompt_ids)) and self._decode(prompt_ids[-n:]).startswith(
            REPLACEMENT_CHAR
        ):
            n += 1
        self._ids: list[int] = prompt_ids[len(prompt_ids) - n :]
        self.prefix_offset, self.read_offset = 0, len(self._ids)
        self._n_context = len(self._ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._n_context :]

    def add_token(self, token_id: int) -> str:
        """Append one token; return the newly completed text (often "" while a character is incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or the last character still misses bytes
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self.text += delta
        return delta


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """(matched stop string, index to cut the text at, or -1 for no cut) or None.

    Only the last ``new_char_count`` characters can complete a stop string, so the search starts
    ``len(stop) - 1`` characters before them; the first stop string (in ``stop`` order) that matches wins.
    """
    if not new_char_count or not stop:
        return None
    for s in stop:
        start = max(0, len(output_text) - new_char_count - len(s) + 1)
        idx = output_text.find(s, start)
        if idx == -1:
            continue
        if include_in_output:
            idx += len(s)
            if idx >= len(output_text):
                return s, -1
        return s, idx
    return None


def check_token_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    eos_token_id: int | None,
    num_prompt_tokens: int = 0,
    max_model_len: int | None = None,
) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) after the last output token, or None to continue."""
    n = len(output_token_ids)
    if n == 0 or n < params.min_tokens:
        return None
    last = output_token_ids[-1]
    if not params.ignore_eos and eos_token_id is not None and last == eos_token_id:
        return "stop", None
    if last in params.stop_token_ids:
        return "stop", last
    if (params.max_tokens is not None and n >= params.max_tokens) or (
        max_model_len is not None and num_prompt_tokens + n >= max_model_len
    ):
        return "length", None
    return None


class StopChecker:
    """Per-sequence detokenization and stopping. ``append(token_id)`` returns the text to stream now."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        eos_token_id: int | None = None,
        max_model_len: int | None = None,
    ):
        self.params = params
        self.eos_token_id = tokenizer.eos_id if eos_token_id is None else eos_token_id
        self.num_prompt_tokens = len(prompt_ids)
        self.max_model_len = max_model_len
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._buffer = params.stop_buffer_length
        self._sent = 0  # characters of ``text`` already streamed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> str:
        if self.finished:
            raise RuntimeError("append() after the sequence finished")
        p = self.params
        token_id = int(token_id)
        self.token_ids.append(token_id)
        verdict = check_token_stop(p, self.token_ids, self.eos_token_id, self.num_prompt_tokens, self.max_model_len)
        stopped_by_token = verdict is not None and verdict[0] == "stop"
        before = len(self.text)
        if (not stopped_by_token or p.include_stop_str_in_output) and p.detokenize:
            self.text += self.detok.add_token(token_id)
        # Stop strings count from the (min_tokens + 1)-th token on; a token stop takes precedence.
        if p.stop and not stopped_by_token and len(self.token_ids) > p.min_tokens:
            hit = check_stop_strings(self.text, len(self.text) - before, p.stop, p.include_stop_str_in_output)
            if hit is not None:
                stop_str, cut = hit
                if cut != -1:
                    self.text = self.text[:cut]
                verdict = ("stop", stop_str)
        if verdict is not None:
            self.finish_reason, self.stop_reason = verdict
        return self._next_delta()

    def _next_delta(self) -> str:
        end = len(self.text) if self.finished else len(self.text) - self._buffer
        if end <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent : end], end
        return delta

    def streamed_text(self) -> str:
        """Everything streamed so far (``text`` minus the held-back tail while unfinished)."""
        return self.text[: self._sent]
