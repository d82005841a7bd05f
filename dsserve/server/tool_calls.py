"""OpenAI tools, tool_choice and reasoning over the DSML output parser (spec tool_calling.md 3.4, 3.5, 7).

``plan_tools`` turns a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and thinking mode into a
``ToolPlan``: what the prompt renders, the text appended after the generation prompt, how the parser starts, and
whether the DSML token is banned in sampling. ``auto``: tools rendered, output parsed. ``none`` or no tools: tools
not rendered, calls not parsed, and the DSML token masked so no markup can appear. ``required`` / a named function
(non-thinking only, as DeepSeek's API; named renders only that tool): the prompt ends with the block opener and
the parser starts inside the block. ``parallel_tool_calls=false`` keeps only the first call.

``ChoiceShaper`` (one per choice) feeds the engine's text deltas to an ``OutputParser`` and returns OpenAI deltas
as vLLM streams them: ``reasoning_content`` (and ``reasoning``), ``content``, a call's start (index, id, type,
name, empty arguments), then argument fragments; ``message`` gives the non-streaming message, built from the same
deltas. Malformed DSML (markup the parser cannot commit as a call) is dropped rather than released as text, so no
DSML ever reaches ``content`` or ``reasoning_content``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

from ..parsers import CallArgs, CallStart, OutputParser, TextDelta
from ..parsers.output_parser import BLOCK_OPENERS, DIALECT_NAMES, DSML
from .chat import SYSTEM

EFFORTS = {
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "high",
    "max": "max",
    "ultra": "max",
}


class ToolChoiceError(ValueError):
    """A tools / tool_choice / thinking request that cannot be served; ``field`` names the offending field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ToolPlan:
    prompt_tools: list | None  # the tools the prompt renders
    names: tuple[str, ...]  # declared tool names the parser accepts; empty: calls are not parsed
    prefill: str  # text after the generation prompt (the block opener for required / named)
    ban_dsml: bool  # mask the DSML token in sampling
    parallel: bool
    dialect: str  # "v4" or "v4.1"
    thinking: bool
    structural_tag: str | None = None  # required / named with the grammar extra: xgrammar's DSML grammar (JSON)

    @property
    def encoder_version(self) -> str:
        return "v41" if self.dialect == "v4.1" else "v4"

    def parser(self) -> OutputParser:
        # malformed markup is dropped, not shown (the parser's default keeps it as text, spec 6.2): clients must
        # never see DSML in content or reasoning
        return OutputParser(
            self.dialect, self.thinking, self.names, start_in_block=bool(self.prefill), drop_malformed=True
        )


def model_dialect(tokenizer) -> str:
    """The chat dialect of a checkpoint: V4.1 tokenizers hold ``<｜System｜>`` as one token; V4's (and the tiny
    vocabulary the built-in models were trained with V4 chats on) do not."""
    return "v4.1" if tokenizer.token_to_id(SYSTEM) is not None else "v4"


def thinking_mode(chat_template_kwargs: dict | None, thinking: dict | None, reasoning_effort) -> tuple[bool, object]:
    """(thinking on?, the encoder's effort) from vLLM's ``chat_template_kwargs`` (``thinking`` /
    ``enable_thinking``), DeepSeek's ``thinking: {"type": "enabled"|"disabled"}`` and ``reasoning_effort``
    (minimal/low -> low, medium/high/xhigh -> high, max/ultra -> max, an int 1..100 as is, "none" -> off).
    An explicit switch wins (DeepSeek's ``thinking`` over the kwargs' ``thinking`` / ``enable_thinking``); without
    one, an effort other than "none" turns thinking on (vLLM's rule). The effort is None when thinking is off: the
    encoder writes it only in thinking mode."""
    kw = chat_template_kwargs or {}
    explicit = None
    if "thinking" in kw or "enable_thinking" in kw:
        explicit = bool(kw.get("thinking", kw.get("enable_thinking")))
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise ToolChoiceError(
                f'thinking must be {{"type": "enabled"}} or {{"type": "disabled"}}, not {thinking!r}', "thinking"
            )
        explicit = kind == "enabled"
    effort = kw.get("reasoning_effort", reasoning_effort)
    if effort is None or effort == "none":
        mapped = None
    elif isinstance(effort, str) and effort in EFFORTS:
        mapped = EFFORTS[effort]
    elif type(effort) is int and 1 <= effort <= 100:
        mapped = effort
    else:
        raise ToolChoiceError(
            f"reasoning_effort {effort!r} is not one of {['none', *EFFORTS]} or an integer in [1, 100]",
            "reasoning_effort",
        )
    if effort == "none":
        return False, None
    on = explicit if explicit is not None else mapped is not None
    return on, mapped if on else None


def grammar_available() -> bool:
    """Whether the ``grammar`` extra (xgrammar) is installed: then required / named tool choices are constrained."""
    return importlib.util.find_spec("xgrammar") is not None


def plan_tools(
    tools, tool_choice, parallel_tool_calls, *, thinking: bool, dialect: str, grammar: bool = False
) -> ToolPlan:
    """``grammar``: constrain required / named choices with xgrammar's DeepSeek tool-call grammar (arguments
    follow each tool's parameter schema; thinking mode allowed) instead of prefilling the block opener; under
    ``auto``, when a tool has ``strict: true``, the same grammar constrains any call the model opens (free text
    before it), every tool's arguments then following its schema."""
    if tools is not None and not isinstance(tools, list):
        raise ToolChoiceError("tools must be a list of function tools", "tools")
    names = []
    for k, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolChoiceError(
                f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}", "tools"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError(f"tools[{k}].function.name must be a non-empty string", "tools")
        names.append(fn["name"])
    if not isinstance(dialect, str) or dialect not in DIALECT_NAMES:
        raise ToolChoiceError(f"dialect must be one of {sorted(DIALECT_NAMES)}, not {dialect!r}", "dialect")
    dialect = DIALECT_NAMES[dialect]
    if not isinstance(parallel_tool_calls, bool):
        raise ToolChoiceError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    forced = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolChoiceError(
                "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        forced = fn["name"]
        if forced not in names:
            raise ToolChoiceError(
                f"tool_choice names the function {forced!r}, which is not among the request's tools {names}",
                "tool_choice",
            )
    elif choice not in ("auto", "none", "required"):
        raise ToolChoiceError(
            f"tool_choice {choice!r} is not one of 'auto', 'none', 'required' or a named function", "tool_choice"
        )
    if choice == "required" and not names:
        raise ToolChoiceError("tool_choice 'required' needs at least one tool in tools", "tool_choice")
    if choice == "none" or not names:
        return ToolPlan(None, (), "", True, parallel_tool_calls, dialect, thinking)
    if choice == "auto":  # vLLM's: a strict tool puts calls under the grammar, which the block opener triggers
        tag = None
        if grammar and any(t["function"].get("strict") is True for t in tools):
            tag = _structural_tag(tools, "auto", parallel_tool_calls, thinking=thinking, dialect=dialect)
        return ToolPlan(tools, tuple(names), "", False, parallel_tool_calls, dialect, thinking, tag)
    kept = [t for t in tools if t["function"]["name"] == forced] if forced else tools
    names = tuple(n for n in names if forced in (None, n))
    if grammar:
        return ToolPlan(
            kept,
            names,
            "",
            False,
            parallel_tool_calls,
            dialect,
            thinking,
            _structural_tag(kept, choice, parallel_tool_calls, thinking=thinking, dialect=dialect),
        )
    if thinking:  # DeepSeek's API and deepseek-recipe refuse it too: the opener cannot follow <think>
        raise ToolChoiceError(
            "Thinking mode does not support this tool_choice (required or a named function); turn thinking off "
            "or use tool_choice 'auto'",
            "tool_choice",
        )
    opener = BLOCK_OPENERS["v4.1" if dialect == "v4.1" else "v4"]
    return ToolPlan(kept, names, f"\n\n{opener}\n", False, True, dialect, False)


def _structural_tag(tools, choice, parallel: bool, *, thinking: bool, dialect: str) -> str:
    import xgrammar as xgr

    try:
        tag = xgr.get_model_structural_tag(
            "deepseek_v4_1" if dialect == "v4.1" else "deepseek_v4",
            tools=tools,
            tool_choice=choice,
            reasoning="enabled" if thinking else "disabled",
            parallel_tool_calls=parallel,
            max_whitespace_cnt=2,  # between tags and inside values: a model cannot pad the block forever
        )
    except Exception as e:  # a tool xgrammar cannot take (its parameters not a schema object, ...)
        raise ToolChoiceError(f"tools: cannot build the tool-call grammar: {e}", "tools") from None
    return tag.model_dump_json()


def json_schema_of(response_format, plan: ToolPlan) -> str | None:
    """The JSON schema text that constrains the reply for OpenAI's ``response_format`` (``json_object``: any
    object), or None for ``text`` / absent. Refused with thinking on or tools callable: the grammar constrains
    the whole output, so neither reasoning nor DSML could be written."""
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if response_format is None or kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ToolChoiceError(
                "response_format json_schema needs {'json_schema': {'schema': {...}}}", "response_format"
            )
    else:
        raise ToolChoiceError(
            f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'", "response_format"
        )
    if plan.thinking or plan.names:
        raise ToolChoiceError(
            "response_format json_object / json_schema cannot be combined with thinking mode or callable tools",
            "response_format",
        )
    return json.dumps(schema)


def dsml_bans(tokenizer) -> list[int]:
    """Token ids to mask so that DSML markup cannot be sampled. A DeepSeek vocabulary has ``｜DSML｜`` as one
    token: that one (spec 6.7). A byte-level vocabulary without it (the tiny one): every token that holds the
    spelling or ends with a proper prefix of its bytes, which no sampled text can then contain."""
    return list(_bans(tokenizer.tok if hasattr(tokenizer, "tok") else tokenizer))


@functools.lru_cache(maxsize=8)
def _bans(tok) -> tuple[int, ...]:
    single = tok.token_to_id(DSML)
    if single is not None:
        return (single,)
    marker = DSML.encode()
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    out = []
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        try:
            raw = bytes(byte_of[c] for c in piece)
        except KeyError:  # an added token spelled in plain text
            raw = piece.encode()
        if marker in raw or any(raw.endswith(marker[:k]) for k in range(1, len(marker))):
            out.append(i)
    return tuple(sorted(out))


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's, which ``tokenizers``' ByteLevel uses): byte -> the character that
    spells it in the vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ChoiceShaper:
    """One choice's parser and the OpenAI deltas of its output; ``message`` folds the same deltas."""

    def __init__(self, plan: ToolPlan, stop: Sequence[str] = (), include_stop: bool = False):
        self.plan = plan
        self.parser = plan.parser()
        self.content, self.reasoning = [], []
        self.calls: list[dict] = []
        self.finish_reason: str | None = None
        self.stop, self.include_stop = tuple(stop), include_stop
        self.stop_reason: str | None = None  # the stop string that ended the content channel
        self._held = ""  # content not yet released: it may be the start of a stop string
        self._keep = max((len(s) for s in self.stop), default=1) - 1

    @property
    def stopped(self) -> bool:
        """A stop string ended the content channel: the rest of the output is ignored (the caller aborts it)."""
        return self.stop_reason is not None

    def feed(self, text: str) -> list[dict]:
        if self.stopped or not text:
            return []
        deltas = self._deltas(self.parser.feed(text))
        if self.stopped:  # calls committed before the stop keep their closing fragments; nothing else is read
            deltas += self._deltas(self.parser.close("eos"))
            self.finish_reason = "tool_calls" if self.calls else "stop"
        return deltas

    def close(self, engine_finish: str | None) -> list[dict]:
        """The last deltas; sets ``finish_reason``: the engine's ``length`` / ``abort``, else ``tool_calls`` if a
        call was kept, else the engine's reason. After a stop string: nothing (``finish_reason`` is set)."""
        if self.stopped:
            return []
        cut = engine_finish in ("length", "abort")
        deltas = self._deltas(self.parser.close("length" if cut else "eos")) + self._release()
        self.finish_reason = engine_finish if cut or not self.calls else "tool_calls"
        return deltas

    def _content(self, text: str) -> list[dict]:
        """Content through the stop strings (spec 6.9: they apply to this channel only): the text up to the
        earliest stop (with it if ``include_stop``), else all but the tail that could start one."""
        if not self.stop:
            return self._emit(text)
        buf = self._held + text
        hits = [(i, s) for s in self.stop if (i := buf.find(s)) != -1]
        if hits:
            i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
            self._held, self.stop_reason = "", s
            return self._emit(buf[: i + len(s) if self.include_stop else i])
        cut = len(buf) - self._keep
        self._held = buf[max(cut, 0) :]
        return self._emit(buf[:cut]) if cut > 0 else []

    def _release(self) -> list[dict]:
        """The held content, before any other delta: a stop string cannot span a block or reasoning."""
        held, self._held = self._held, ""
        return self._emit(held)

    def _emit(self, text: str) -> list[dict]:
        if not text:
            return []
        self.content.append(text)
        return [{"content": text}]

    def _deltas(self, events) -> list[dict]:
        out = []
        for e in events:
            if self.stopped:
                if isinstance(e, CallArgs) and e.index < len(self.calls):
                    self.calls[e.index]["function"]["arguments"] += e.text
                    out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
                continue
            if isinstance(e, TextDelta) and e.channel == "content":
                out += self._content(e.text)
                continue
            out += self._release()
            if isinstance(e, TextDelta):
                self.reasoning.append(e.text)
                out.append({"reasoning_content": e.text, "reasoning": e.text})
            elif e.index > 0 and not self.plan.parallel:
                continue
            elif isinstance(e, CallStart):
                call = {"id": call_id(), "type": "function", "function": {"name": e.name, "arguments": ""}}
                self.calls.append(call)
                start = {"index": e.index, "id": call["id"], "type": "function"}
                out.append({"tool_calls": [dict(start, function={"name": e.name, "arguments": ""})]})
            elif isinstance(e, CallArgs):
                self.calls[e.index]["function"]["arguments"] += e.text
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out

    def message(self) -> dict:
        content = "".join(self.content)
        msg = {"role": "assistant", "content": content if content or not self.calls else None}
        reasoning = "".join(self.reasoning)
        if reasoning or self.plan.thinking:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if self.calls:
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self.calls]
        return msg


def shape_chat_body(body: dict, outs: list, plan: ToolPlan, shapers: list[ChoiceShaper] | None = None) -> dict:
    """Rewrite a plain ``chat.completion`` body's messages through the parser (the non-streaming path).
    ``shapers``: per choice, already fed the output as it came (stop strings on the content channel)."""
    for k, (choice, out) in enumerate(zip(body["choices"], outs)):
        c = out.outputs[0]
        if shapers is None:
            shaper = ChoiceShaper(plan)
            shaper.feed(c.text)
        else:
            shaper = shapers[k]
        shaper.close(c.finish_reason)
        choice["message"] = shaper.message()
        choice["finish_reason"] = shaper.finish_reason
        if shaper.stopped:
            choice["stop_reason"] = shaper.stop_reason
    return body


def stream_chunks(
    shaper: ChoiceShaper, rid: str, model: str, index: int, text: str, finish: str | None, logprobs
) -> list[dict]:
    """The ``chat.completion.chunk`` objects for one engine output of a choice: one per delta, then (at the end,
    or where a stop string ended the content channel) an empty delta carrying ``finish_reason``; nothing after."""
    if shaper.finish_reason is not None:
        return []
    deltas = shaper.feed(text)
    if finish is not None:
        deltas += shaper.close(finish)
    end = shaper.finish_reason is not None

    def chunk(delta, fin=None, lp=None):
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": fin}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }

    out = [chunk(d, lp=logprobs if k == 0 else None) for k, d in enumerate(deltas)]
    if end:
        out.append(chunk({}, shaper.finish_reason, None if deltas else logprobs))
    elif logprobs and not deltas:
        out.append(chunk({}, lp=logprobs))
    return out


def content_stops(plan: ToolPlan, params) -> bool:
    """Whether the request's stop strings go to the shaper (the content channel) instead of the engine: when the
    output has other channels (reasoning, parsed tool calls) a stop string must not cut."""
    return bool(params.stop) and (plan.thinking or bool(plan.names))
