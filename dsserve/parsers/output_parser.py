"""The model's output text -> reasoning, content and tool calls (DSML), incrementally (spec tool_calling.md 5-6).

``OutputParser(dialect, thinking, tools)`` is fed text deltas and returns deltas (``TextDelta`` per channel,
``CallStart`` and ``CallArgs`` per call); ``finish(stop_reason)`` ends the output and returns the whole
``ParsedOutput``. ``parse_output(text, ...)`` is the same machine fed once, so streaming and non-streaming agree
for any split of the text. Contract (the rules of spec section 6, in short):

- Channels: thinking mode starts in reasoning, which ends at ``</think>`` or at a committed tool-call block; else
  content. A ``<think>`` in reasoning, a ``</think>`` after it, an EOS spelling: dropped. Leading newlines of each
  channel and the newline run before ``</think>`` or before committed markup are dropped; so is the whitespace
  run after a block.
- Hold-back: text is emitted as soon as it cannot be the start of a marker valid in the current state; a held
  tail that never becomes a marker is flushed at the end (``2 <`` stays content).
- Blocks: any of the three openers (``<｜DSML｜tool_calls>``, ``<｜DSML｜ calls>``, ``<｜DSML｜function_calls>``;
  the dialect does not restrict input), then an invoke opener; the call is committed once a parameter header or
  the invoke closer follows. Diverging earlier releases the held text verbatim into its channel. Inside a
  committed invoke, text that is not a parameter, the invoke closer, a block closer or a next invoke ends the
  arguments (they close after the last complete parameter) and goes, whitespace-trimmed, to content up to the
  invoke closer. A committed call is never retracted.
- Recovery: an invoke without a block opener, or after an unknown ``<｜DSML｜NAME>`` opener, is held and
  committed only once it is complete and well-formed and names a declared tool; else restored verbatim.
- Arguments: a JSON object in parameter order; ``string="true"`` values are JSON strings of the raw text (streamed
  as they arrive, escaped once), ``string="false"`` values are parsed as JSON when the parameter closes, else kept
  as a JSON string (logged). The concatenated ``CallArgs`` fragments are ``ToolCall.arguments_json``.
- End: ``stop_reason="length"`` discards held, uncommitted markup and keeps a cut call's fragments as streamed
  (not valid JSON; ``arguments`` then holds the complete parameters); any other stop closes an open call and
  releases uncommitted markup as content. ``finish_reason``: ``length``, else ``tool_calls`` if a call was
  committed, else ``stop``.
- With no tools declared (``tools`` empty or None) calls are not parsed: DSML stays text (the server masks the
  DSML token instead). Nothing here raises on any text: an internal fault logs and passes the rest through as
  content.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Iterable, Union

log = logging.getLogger("dsserve.parsers")

DIALECTS = ("v4", "v4.1")
DIALECT_NAMES = {"v4": "v4", "v4.1": "v4.1", "v41": "v4.1", "deepseek_v4": "v4", "deepseek_v41": "v4.1"}
DSML = "｜DSML｜"
THINK, END_THINK, EOS = "<think>", "</think>", "<｜end▁of▁sentence｜>"
BLOCK_OPENERS = {"v4": f"<{DSML}tool_calls>", "v4.1": f"<{DSML} calls>", "v3.2": f"<{DSML}function_calls>"}
INVOKE_OPEN = (f'<{DSML}invoke name="', f'<{DSML} invoke name="')
INVOKE_CLOSE = (f"</{DSML}invoke>", f"</{DSML} invoke>")
PARAM_OPEN = (f'<{DSML}parameter name="', f'<{DSML} parameter name="')
PARAM_CLOSE = (f"</{DSML}parameter>", f"</{DSML} parameter>")
_STRING_ATTR = (' string="true">', ' string="false">')
_OPEN, _CLOSE = f"<{DSML}", f"</{DSML}"
_ELEMENTS = ("invoke", " invoke", "parameter", " parameter")
_NAME = re.compile(r'[^"<>\n]{0,256}')  # a tool or parameter name, up to its closing quote
_TAG = re.compile(r"[A-Za-z0-9_ ]{0,41}")  # an element name in <｜DSML｜NAME> / </｜DSML｜NAME>
_WS = re.compile(r"\s*")
_STRAY_BODY = re.compile(r"[^<>]{0,256}")
_NEED, _FAIL = "need", "fail"
_PLAIN_MARKERS = {EOS: "eos", END_THINK: "end_think", THINK: "think"}
_CHANNEL_MARKERS = {
    **_PLAIN_MARKERS,
    **{o: "block" for o in BLOCK_OPENERS.values()},
    **dict.fromkeys(INVOKE_OPEN, "invoke"),
}


@dataclass(frozen=True)
class TextDelta:
    channel: str  # "reasoning" or "content"
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str  # a fragment of the arguments JSON; a call's fragments concatenate to ToolCall.arguments_json


Delta = Union[TextDelta, CallStart, CallArgs]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    arguments_json: str = field(default="", compare=False)
    complete: bool = field(default=True, compare=False)  # False: cut by max_tokens mid-arguments


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    reasoning_content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    ended_in_reasoning: bool = False  # thinking mode never reached </think> nor a call (spec 5: count these)


@dataclass
class _Call:
    name: str
    fragments: list[str] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    closed: bool = False


@dataclass
class _Candidate:
    """Held markup not yet committed: ``start`` (the newline run before it), ``at`` (its first '<'), ``body`` (where
    the invoke is expected), ``channel`` it came from, ``kind``: "block" (a known opener), "guarded" (an invoke
    after an unknown opener or none: must close and name a declared tool) or "next" (a later invoke in a block)."""

    start: int
    at: int
    body: int
    channel: str
    kind: str


def _tool_names(tools) -> frozenset[str]:
    names = set()
    for t in tools or ():
        if isinstance(t, str):
            names.add(t)
        elif isinstance(t, dict):  # an OpenAI tool object, or its function
            fn = t.get("function", t)
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                names.add(fn["name"])
    return frozenset(names)


def _lit(s: str, i: int, options: Iterable[str], final: bool):
    """(end, option) of the option that starts at s[i], or _NEED (the text so far is a proper prefix of one) or
    _FAIL."""
    need = False
    for o in options:
        if s.startswith(o, i):
            return i + len(o), o
        if len(s) - i < len(o) and o.startswith(s[i:]):
            need = True
    return _NEED if need and not final else _FAIL


def _name(s: str, i: int, final: bool):
    """(end after the closing quote, name)."""
    e = _NAME.match(s, i).end()
    if e == len(s):
        return _NEED if not final and e - i < 256 else _FAIL
    return (e + 1, s[i:e]) if s[e] == '"' and e > i else _FAIL


def _tag(s: str, i: int, prefix: str, final: bool):
    """(end, NAME) of ``prefix + NAME + '>'`` at s[i], NAME not an invoke/parameter element."""
    r = _lit(s, i, (prefix,), final)
    if not isinstance(r, tuple):
        return r
    e = _TAG.match(s, r[0]).end()
    if e == len(s):
        return _NEED if not final and e - r[0] <= 40 else _FAIL
    name = s[r[0] : e]
    return (e + 1, name) if s[e] == ">" and 0 < len(name) <= 40 and name not in _ELEMENTS else _FAIL


def _stray(s: str, k: int, final: bool):
    """(end, "stray") of a DSML tag at s[k] (``<｜DSML｜...>`` or ``</｜DSML｜...>``) to drop as malformed markup; a
    tag that never closes before the next '<' loses only its ``<｜DSML｜`` prefix (at the end: all of it)."""
    r = _lit(s, k, (_OPEN, _CLOSE), final)
    if not isinstance(r, tuple):
        return r
    e = _STRAY_BODY.match(s, r[0]).end()
    if e < len(s) and s[e] == ">":
        return e + 1, "stray"
    if e == len(s) and e - r[0] < 256:
        return _NEED if not final else (e, "stray")
    return r[0], "stray"


def _invoke_head(s: str, i: int, final: bool):
    """(end, name) of ``<｜DSML｜[ ]invoke name="NAME">`` at s[i]."""
    r = _lit(s, i, INVOKE_OPEN, final)
    if not isinstance(r, tuple):
        return r
    r = _name(s, r[0], final)
    if not isinstance(r, tuple):
        return r
    end = _lit(s, r[0], (">",), final)
    return (end[0], r[1]) if isinstance(end, tuple) else end


def _param_head(s: str, i: int, final: bool):
    """(end, key, is_string) of a parameter header at s[i]."""
    r = _lit(s, i, PARAM_OPEN, final)
    if not isinstance(r, tuple):
        return r
    r = _name(s, r[0], final)
    if not isinstance(r, tuple):
        return r
    a = _lit(s, r[0], _STRING_ATTR, final)
    return (a[0], r[1], a[1] == _STRING_ATTR[0]) if isinstance(a, tuple) else a


def _first(*results):
    """The first success among matcher results, else _NEED if any needs more text, else _FAIL."""
    for r in results:
        if isinstance(r, tuple):
            return r
    return _NEED if _NEED in results else _FAIL


def _find_any(s: str, i: int, needles) -> tuple[int, str]:
    best, which = -1, ""
    for n in needles:
        j = s.find(n, i)
        if j >= 0 and (best < 0 or j < best):
            best, which = j, n
    return best, which


def _held_closer(s: str, i: int, closers) -> int:
    """Where the tail of s[i:] that is a proper prefix of a closer starts (len(s) if none)."""
    h = s.rfind("<", i)
    return h if h >= 0 and any(c.startswith(s[h:]) for c in closers) else len(s)


def _full_invoke(s: str, i: int, final: bool):
    """(end, name) of a complete, well-formed invoke at s[i] (the recovery guard)."""
    r = _invoke_head(s, i, final)
    if not isinstance(r, tuple):
        return r
    j, name = r
    while True:
        j = _WS.match(s, j).end()
        h = _first(_param_head(s, j, final), _lit(s, j, INVOKE_CLOSE, final))
        if not isinstance(h, tuple):
            return h
        if len(h) == 2:  # the invoke closer
            return h[0], name
        c, closer = _find_any(s, h[0], PARAM_CLOSE)
        if c < 0:
            return _NEED if not final else _FAIL
        j = c + len(closer)


def _json_value(raw: str, key: str):
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        log.warning('parameter %r has string="false" but is not JSON; kept as a string: %.80r', key, raw)
        return raw


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _dumps(v) -> str:
    return json.dumps(v, ensure_ascii=False)


class OutputParser:
    """One per generated choice. ``feed(text) -> [Delta]``, ``close(stop_reason) -> [Delta]`` (the last deltas),
    ``finish(stop_reason) -> ParsedOutput`` (closes first if needed).

    ``dialect``: "v4" or "v4.1" (also "v41"); input markup of either dialect (and V3.2's opener) is accepted, the
    dialect names what the prompt used. ``tools``: declared tool names (or OpenAI tool objects); empty: calls are
    not parsed. ``start_in_block``: the prompt ended with the block opener (tool_choice required);
    ``forced_tool``: it also ended with that tool's invoke header (a named tool_choice)."""

    def __init__(
        self,
        dialect: str = "v4.1",
        thinking: bool = False,
        tools=None,
        *,
        start_in_block: bool = False,
        forced_tool: str | None = None,
        drop_malformed: bool = False,
    ):
        if dialect not in DIALECT_NAMES:
            raise ValueError(f"dialect must be one of {list(DIALECTS)}, not {dialect!r}")
        self.dialect = DIALECT_NAMES[dialect]
        self.thinking = thinking
        self.tools = _tool_names(tools) | ({forced_tool} if forced_tool else set())
        self.parse_calls = bool(self.tools) or start_in_block
        self.drop_malformed = drop_malformed
        self._stray_at = -1  # a released candidate's tag, dropped as stray markup (drop_malformed)
        self._buf, self._pos = "", 0
        self._mode = "reasoning" if thinking and not (start_in_block or forced_tool) else "content"
        self._cand: _Candidate | None = None
        self._calls: list[_Call] = []
        self._text = {"reasoning": [], "content": []}
        self._events: list[Delta] = []
        self._left_reasoning = not self._mode == "reasoning"
        self._closed: str | None = None
        self._broken = False
        self._key, self._value = "", []  # the open parameter
        if forced_tool:
            self._start_call(forced_tool)
            self._mode = "invoke"
        elif start_in_block:
            self._cand = _Candidate(0, 0, 0, "content", "block")
            self._mode = "candidate"
        self._steps = {
            "reasoning": self._channel,
            "content": self._channel,
            "candidate": self._candidate,
            "invoke": self._invoke,
            "string": self._string,
            "json": self._json,
            "junk": self._junk,
            "block": self._block,
            "after": self._after,
        }

    # ---------------------------------------------------------------- public
    def feed(self, text: str) -> list[Delta]:
        if self._closed is not None:
            raise RuntimeError("feed() after close()/finish()")
        self._buf += text
        self._guarded_run(final=False)
        return self._take()

    def close(self, stop_reason: str | None = "eos") -> list[Delta]:
        """End of output: ``stop_reason`` "length" means cut by max_tokens; anything else means the model stopped."""
        if self._closed is None:
            self._closed = stop_reason or "stop"
            if self._broken:
                self._emit("content", self._buf[self._pos :])
            else:
                try:
                    self._end(stop_reason == "length")
                except Exception:
                    log.exception("output parser fault at the end; the rest goes to content")
                    self._emit("content", self._buf[self._pos :])
            self._pos = len(self._buf)
        return self._take()

    def finish(self, stop_reason: str | None = "eos") -> ParsedOutput:
        self.close(stop_reason)
        calls = []
        for c in self._calls:
            args = "".join(c.fragments)
            calls.append(ToolCall(c.name, dict(c.params), args, c.closed))
        reasoning = "".join(self._text["reasoning"])
        if self._closed == "length":
            finish = "length"
        else:
            finish = "tool_calls" if calls else "stop"
        return ParsedOutput(
            content="".join(self._text["content"]),
            reasoning_content=reasoning if reasoning or self.thinking else None,
            tool_calls=calls,
            finish_reason=finish,
            ended_in_reasoning=self.thinking and not self._left_reasoning,
        )

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    # ---------------------------------------------------------------- plumbing
    def _take(self) -> list[Delta]:
        ev, self._events = self._events, []
        return ev

    def _guarded_run(self, final: bool) -> None:
        if self._broken:
            self._emit("content", self._buf[self._pos :])
            self._pos = len(self._buf)
            return
        try:
            self._run(final)
        except Exception:  # a parser bug must not fail the request: pass the rest through
            log.exception("output parser fault; the rest of this output goes to content verbatim")
            self._broken = True
            self._emit("content", self._buf[self._pos :])
            self._pos = len(self._buf)
        self._compact()

    def _run(self, final: bool) -> None:
        while self._steps[self._mode](final):
            pass

    def _compact(self) -> None:
        keep = self._pos if self._cand is None else min(self._pos, self._cand.start)
        if keep > 4096 or (keep and keep == len(self._buf)):
            self._buf = self._buf[keep:]
            self._pos -= keep
            if self._stray_at >= 0:  # an index into the buffer, like _pos: it moves with it
                self._stray_at -= keep
            if self._cand is not None:
                c = self._cand
                self._cand = _Candidate(c.start - keep, c.at - keep, c.body - keep, c.channel, c.kind)

    def _emit(self, channel: str, text: str) -> None:
        if not self._text[channel]:
            text = text.lstrip("\n")
        if not text:
            return
        self._text[channel].append(text)
        last = self._events[-1] if self._events else None
        if isinstance(last, TextDelta) and last.channel == channel:
            self._events[-1] = TextDelta(channel, last.text + text)
        else:
            self._events.append(TextDelta(channel, text))

    def _args(self, text: str) -> None:
        call = self._calls[-1]
        call.fragments.append(text)
        last = self._events[-1] if self._events else None
        index = len(self._calls) - 1
        if isinstance(last, CallArgs) and last.index == index:
            self._events[-1] = CallArgs(index, last.text + text)
        else:
            self._events.append(CallArgs(index, text))

    def _start_call(self, name: str) -> None:
        self._left_reasoning = True
        self._calls.append(_Call(name))
        self._events.append(CallStart(len(self._calls) - 1, name))

    def _close_call(self) -> None:
        call = self._calls[-1]
        if not call.closed:
            self._args("}" if call.fragments else "{}")
            call.closed = True

    # ---------------------------------------------------------------- states
    def _channel(self, final: bool) -> bool:
        s, i, ch = self._buf, self._pos, self._mode
        if i >= len(s):
            return False
        k = s.find("<", i)
        if self.drop_malformed and (b := s.find("｜", i, k if k >= 0 else len(s))) >= 0:
            return self._bare_dsml(s, i, b, final)
        if k < 0:
            end = len(s) if final else i + len(s[i:].rstrip("\n"))
            if end > i:
                self._emit(ch, s[i:end])
                self._pos = end
            return False
        r0 = i + len(s[i:k].rstrip("\n"))  # the newline run before the '<' is decided with it
        if r0 > i:
            self._emit(ch, s[i:r0])
            self._pos = r0
        m = self._marker(s, k, final)
        if m == _NEED:
            return False
        if m == _FAIL:
            self._emit(ch, s[r0 : k + 1])
            self._pos = k + 1
            return True
        end, kind = m
        run = s[r0:k]
        if kind in ("eos", "stray"):
            self._emit(ch, run)
        elif kind == "end_think":
            if ch == "reasoning":
                self._left_reasoning = True
                self._mode = "content"
            else:
                self._emit(ch, run)
        elif kind == "think":
            at_start = ch == "content" and not self._text["content"] and not self._calls
            if ch == "reasoning" or at_start:
                self._emit(ch, run)
            else:
                self._emit(ch, s[r0:end])
        else:  # a block opener, an unknown opener or a bare invoke: held as a candidate
            body = end if kind != "invoke" else k
            self._cand = _Candidate(r0, k, body, ch, "block" if kind == "block" else "guarded")
            self._mode = "candidate"
            self._pos = r0
            return True
        self._pos = end
        return True

    def _bare_dsml(self, s: str, i: int, b: int, final: bool) -> bool:
        """drop_malformed: the DSML marker spelt outside any tag (no '<' before it) is dropped as well."""
        ch = self._mode
        if b > i:
            self._emit(ch, s[i:b])
            self._pos = b
        r = _lit(s, b, (DSML,), final)
        if r == _NEED:
            return b > i
        self._pos = r[0] if isinstance(r, tuple) else b + 1
        if r == _FAIL:
            self._emit(ch, "｜")
        return True

    def _marker(self, s: str, k: int, final: bool):
        """(end, kind) of the marker at s[k] == '<' valid in a text channel, or _NEED / _FAIL."""
        if k == self._stray_at:  # one tag only: once decided, this index means nothing more
            r = _stray(s, k, final)
            if r != _NEED:
                self._stray_at = -1
            return r
        markers = _CHANNEL_MARKERS if self.parse_calls else _PLAIN_MARKERS
        r = _lit(s, k, markers, final)
        if isinstance(r, tuple):
            return r[0], markers[r[1]]
        if not self.parse_calls:
            x = _stray(s, k, final) if self.drop_malformed else _FAIL
            return x if isinstance(x, tuple) else _NEED if _NEED in (r, x) else _FAIL
        u = _tag(s, k, _OPEN, final)
        if isinstance(u, tuple):
            return u[0], "unknown"
        x = _stray(s, k, final) if self.drop_malformed else _FAIL
        if isinstance(x, tuple):
            return x
        return _NEED if _NEED in (r, u, x) else _FAIL

    def _candidate(self, final: bool) -> bool:
        c, s = self._cand, self._buf
        if c.kind == "guarded":
            j = c.body if c.at == c.body else _WS.match(s, c.body).end()
            r = _full_invoke(s, j, final)
            if isinstance(r, tuple):
                r = _invoke_head(s, j, final) if r[1] in self.tools else _FAIL
        else:
            j = c.body if c.kind == "next" else _WS.match(s, c.body).end()
            r = _invoke_head(s, j, final)
            if isinstance(r, tuple):
                b = _WS.match(s, r[0]).end()
                follow = _first(_param_head(s, b, final), _lit(s, b, INVOKE_CLOSE, final))
                r = r if isinstance(follow, tuple) else follow
        if r == _NEED:
            return False
        self._cand = None
        if r == _FAIL:  # release: the held text up to its '<' goes back to its channel; scanning resumes after it
            self._mode = c.channel
            if c.kind == "block" and c.body == c.at:  # the opener was in the prompt: nothing of it to release
                self._pos = c.at
            elif self.drop_malformed:  # its newline run stays text; its first tag is dropped as stray markup
                self._emit(c.channel, s[c.start : c.at])
                self._pos, self._stray_at = c.at, c.at
            else:
                self._emit(c.channel, s[c.start : c.at + 1])
                self._pos = c.at + 1
            return True
        self._start_call(r[1])
        self._pos, self._mode = r[0], "invoke"
        return True

    def _invoke(self, final: bool) -> bool:
        s = self._buf
        i = self._pos = _WS.match(s, self._pos).end()
        if i >= len(s):
            return False
        p = _param_head(s, i, final)
        if isinstance(p, tuple):
            end, key, is_string = p
            call = self._calls[-1]
            self._args(("{" if not call.fragments else ", ") + _dumps(key) + ": " + ('"' if is_string else ""))
            self._key, self._value = key, []
            self._pos, self._mode = end, "string" if is_string else "json"
            return True
        r = _first(
            _lit(s, i, INVOKE_CLOSE, final),
            _tag(s, i, _CLOSE, final),
            _invoke_head(s, i, final),
            _lit(s, i, (EOS,), final),
        )
        if r == _NEED or (p == _NEED and r == _FAIL):
            return False
        if r == _FAIL:  # deviating text: the arguments end here, the text goes to content
            self._close_call()
            self._mode = "junk"
            return True
        self._close_call()
        if s.startswith(INVOKE_CLOSE, i):
            self._pos, self._mode = r[0], "block"
        elif s.startswith((_CLOSE, EOS), i):
            self._pos, self._mode = r[0], "after"
        else:
            self._cand = _Candidate(i, i, i, "content", "next")
            self._mode = "candidate"
        return True

    def _string(self, final: bool) -> bool:
        s, i = self._buf, self._pos
        c, closer = _find_any(s, i, PARAM_CLOSE)
        if c >= 0:
            self._string_data(s[i:c])
            self._args('"')
            self._calls[-1].params[self._key] = "".join(self._value)
            self._pos, self._mode = c + len(closer), "invoke"
            return True
        h = len(s) if final else _held_closer(s, i, PARAM_CLOSE)
        if h > i:
            self._string_data(s[i:h])
            self._pos = h
        return False

    def _string_data(self, text: str) -> None:
        if text:
            self._value.append(text)
            self._args(_dumps(text)[1:-1])

    def _json(self, final: bool) -> bool:
        s, i = self._buf, self._pos
        c, closer = _find_any(s, i, PARAM_CLOSE)
        if c < 0:
            return False
        self._json_done(s[i:c])
        self._pos, self._mode = c + len(closer), "invoke"
        return True

    def _json_done(self, raw: str) -> None:
        value = _json_value(raw, self._key)
        self._args(_dumps(value))
        self._calls[-1].params[self._key] = value

    def _junk(self, final: bool) -> bool:
        """Raw text inside an invoke after its arguments ended: to content, trimmed, until the invoke closer (or
        a block closer)."""
        s, i = self._buf, self._pos
        j = s.find(_CLOSE, i)
        while j >= 0:
            r = _tag(s, j, _CLOSE, final)
            end = _lit(s, j, INVOKE_CLOSE, final)
            if isinstance(end, tuple) or isinstance(r, tuple):
                self._emit("content", "" if self.drop_malformed else s[i:j].rstrip())
                self._pos, self._mode = (end[0], "block") if isinstance(end, tuple) else (r[0], "after")
                return True
            if _NEED in (r, end):
                break
            j = s.find(_CLOSE, j + 1)
        h = len(s) if final else j if j >= 0 else _held_closer(s, i, (_CLOSE,))
        keep = "" if self.drop_malformed else s[i:h].rstrip()
        if keep:
            self._emit("content", keep)
            self._pos = i + len(keep)
        if final:
            self._pos = len(s)
        return False

    def _block(self, final: bool) -> bool:
        s = self._buf
        i = self._pos = _WS.match(s, self._pos).end()
        if i >= len(s):
            return False
        r = _first(_invoke_head(s, i, final), _tag(s, i, _CLOSE, final), _lit(s, i, (EOS,), final))
        if r == _NEED:
            return False
        if r == _FAIL:  # the block ends without its closer; what follows is content
            self._mode = "content"
        elif s.startswith((_CLOSE, EOS), i):
            self._pos, self._mode = r[0], "after"
        else:
            self._cand = _Candidate(i, i, i, "content", "next")
            self._mode = "candidate"
        return True

    def _after(self, final: bool) -> bool:
        s = self._buf
        self._pos = _WS.match(s, self._pos).end()
        if self._pos < len(s):
            self._mode = "content"
            return True
        return False

    def _end(self, truncated: bool) -> None:
        s = self._buf
        if truncated:  # held markup is discarded; complete text is kept
            mode = self._mode
            if mode in ("reasoning", "content"):
                self._run(final=False)
                if "｜" not in s[self._pos :]:
                    self._run(final=True)
            elif mode == "junk":
                self._run(final=False)
                if self._mode == "junk":
                    if not self.drop_malformed:
                        self._emit("content", s[self._pos : _held_closer(s, self._pos, (_CLOSE,))].rstrip())
            return
        self._run(final=True)
        if self._mode == "string":
            self._string_data(s[self._pos :])
            self._args('"')
            self._calls[-1].params[self._key] = "".join(self._value)
            self._close_call()
        elif self._mode == "json":
            self._json_done(s[self._pos :])
            self._close_call()
        elif self._mode == "invoke":
            self._close_call()


def parse_output(
    text: str,
    dialect: str = "v4.1",
    thinking: bool = False,
    tools=None,
    stop_reason: str | None = "eos",
    **kw,
) -> ParsedOutput:
    """The whole output at once: ``OutputParser(...)`` fed ``text`` in one piece, then ``finish``."""
    p = OutputParser(dialect, thinking, tools, **kw)
    p.feed(text)
    return p.finish(stop_reason)
