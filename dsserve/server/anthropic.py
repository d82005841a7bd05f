"""The Anthropic Messages API (``POST /v1/messages``) over the same engine, chat encoding and output parser.

A request's ``system``, ``messages`` (text, ``tool_use``, ``tool_result`` and ``thinking`` blocks), ``tools``
(``input_schema``), ``tool_choice`` (auto / any / tool / none, ``disable_parallel_tool_use``) and ``thinking``
become the OpenAI-shaped chat the DeepSeek encoder renders (``tool_choice`` any = required, tool = named). The
reply's blocks come from the output parser: ``thinking`` (when thinking is on), ``text``, ``tool_use`` (``input``
the parsed arguments); ``stop_reason`` is ``tool_use``, ``max_tokens``, ``stop_sequence`` or ``end_turn``.
With thinking or tools, ``stop_sequences`` end the text only (spec 6.9): the output parser's shaper matches them,
never inside thinking or a tool call, and the request is aborted once one ends the text.
Streaming sends Anthropic's events: ``message_start``, per block ``content_block_start`` / ``_delta``
(``thinking_delta``, ``text_delta``, ``input_json_delta``) / ``_stop``, then ``message_delta`` and
``message_stop``. Errors have Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``. Auth:
``x-api-key`` (the server's API key guard accepts it as well as a bearer token).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.sampling_params import SamplingParams
from . import tool_calls as tc
from .chat import ChatFormatError, chat_prompt_ids

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    499: "invalid_request_error",
    503: "overloaded_error",
}


class MessagesError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Body):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    top_k: int | None = None
    # accepted and ignored: the Messages API's fields with no meaning here
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: Any = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    output_config: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None
    # what the engine helpers read from a request body
    n: int = 1
    priority: int = 0
    cache_salt: str | None = None

    def output_limit(self) -> tuple[str, int | None]:
        """The field that limits the reply's length and its value (the OpenAI requests' contract)."""
        return "max_tokens", self.max_tokens

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = dict(max_tokens=self.max_tokens, stop=list(self.stop_sequences or []))
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return SamplingParams(**kw)


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for k, b in enumerate(content or []):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise MessagesError(400, f"{where}[{k}]: only text blocks are accepted here, not {b.get('type')!r}")
        parts.append(b["text"])
    return "\n\n".join(parts)


def to_chat(req: MessagesRequest) -> tuple[list[dict], list[dict] | None]:
    """(OpenAI-shaped messages, OpenAI tools) for the chat encoder."""
    msgs: list[dict] = []
    if req.system:
        msgs.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "user":
            texts = []
            for k, b in enumerate(blocks):
                kind = b.get("type") if isinstance(b, dict) else None
                if kind == "text" and isinstance(b.get("text"), str):
                    texts.append(b["text"])
                elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
                    result = _text_of(b.get("content", ""), f"{where}[{k}].content")
                    msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
                else:
                    raise MessagesError(
                        400, f"{where}[{k}]: unsupported block type {kind!r}; user turns take text and tool_result"
                    )
            if texts:
                msgs.append({"role": "user", "content": "\n\n".join(texts)})
            continue
        text, reasoning, calls = [], [], []
        for k, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "thinking" and isinstance(b.get("thinking"), str):
                reasoning.append(b["thinking"])
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
                args = json.dumps(b.get("input", {}), ensure_ascii=False)
                calls.append(
                    {"id": str(b.get("id", "")), "type": "function", "function": {"name": b["name"], "arguments": args}}
                )
            else:
                raise MessagesError(
                    400,
                    f"{where}[{k}]: unsupported block type {kind!r}; assistant turns take text, thinking and "
                    "tool_use (with a name and an object input)",
                )
        msg = {"role": "assistant", "content": "".join(text), "reasoning_content": "".join(reasoning)}
        msgs.append(dict(msg, tool_calls=calls) if calls else msg)
    tools = None
    if req.tools is not None:
        tools = []
        for k, t in enumerate(req.tools):
            if not isinstance(t.get("name"), str):
                raise MessagesError(400, f"tools[{k}]: needs a name (and an input_schema)")
            fn = {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {"type": "object"}),
            }
            tools.append({"type": "function", "function": fn})
    return msgs, tools


def _choice(req: MessagesRequest):
    c = req.tool_choice
    if c is None:
        return None, True
    if c.type == "tool":
        if not c.name:
            raise MessagesError(400, "tool_choice of type 'tool' needs the tool's name")
        return {"type": "function", "function": {"name": c.name}}, not c.disable_parallel_tool_use
    return {"auto": "auto", "any": "required", "none": "none"}[c.type], not c.disable_parallel_tool_use


def _error(status: int, message: str) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def _stop_reason(shaper: tc.ChoiceShaper, out) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a kept tool call wins, then a cut, then the stop sequence that ended the text
    (the shaper's, else the engine's when the stops went to the engine)."""
    if shaper.finish_reason == "tool_calls":
        return "tool_use", None
    if shaper.finish_reason in ("length", "abort"):
        return "max_tokens", None
    if shaper.stopped:
        return "stop_sequence", shaper.stop_reason
    stop = out.outputs[0].stop_reason
    return ("stop_sequence", stop) if isinstance(stop, str) else ("end_turn", None)


def _usage(out, output_tokens: int | None = None) -> dict:
    return {
        "input_tokens": len(out.prompt_token_ids),
        "output_tokens": len(out.outputs[0].token_ids) if output_tokens is None else output_tokens,
        "cache_read_input_tokens": out.num_cached_tokens,
    }


def add_routes(
    app, engine, served_model_name: str, dialect: str, default_max_tokens: int, plan, run, collect, merged, check_model
):
    """``POST /v1/messages`` on ``app``; ``plan`` / ``run`` / ``collect`` / ``merged`` / ``check_model`` are the
    OpenAI routes' helpers (validate and submit, gather, merge choices, the served names and aliases)."""
    core = engine.core

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            try:
                req = MessagesRequest.model_validate(await request.json())
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first.get("loc", ()))
                raise MessagesError(400, f"invalid request: {where}: {first.get('msg')}") from None
            except ValueError:
                raise MessagesError(400, "the body is not JSON") from None
            check_model(req.model)  # an ApiError 404, answered in Anthropic's shape below
            thinking = req.thinking is not None and req.thinking.type != "disabled"
            msgs, tools = to_chat(req)
            choice, parallel = _choice(req)
            try:
                tplan = tc.plan_tools(
                    tools, choice, parallel, thinking=thinking, dialect=dialect, grammar=tc.grammar_available()
                )
                ids = chat_prompt_ids(
                    core.tokenizer, msgs, thinking=thinking, tools=tplan.prompt_tools, version=tplan.encoder_version
                )
            except (tc.ToolChoiceError, ChatFormatError) as e:
                raise MessagesError(400, str(e)) from None
            ids += core.tokenizer.encode(tplan.prefill, add_bos=False) if tplan.prefill else []
            grammar = {"structural_tag": tplan.structural_tag} if tplan.structural_tag else None
            choices = await plan([ids], req, None, grammar)
            if tplan.ban_dsml:
                bans = tc.dsml_bans(core.tokenizer)
                choices = [(i, _with_bans(p, bans)) for i, p in choices]
            stops: tuple[str, ...] = ()
            if tc.content_stops(tplan, choices[0][1]):  # stop sequences end the text only (spec 6.9)
                stops = tuple(choices[0][1].stop)
                choices = [(i, dataclasses.replace(p, stop=[])) for i, p in choices]
            sinks = await run(choices, req, request.headers.get("x-session-id"))
            shaper = tc.ChoiceShaper(tplan, stops)
            mid = "msg_" + uuid.uuid4().hex[:24]
            if req.stream:
                return StreamingResponse(_events(sinks, mid, shaper), media_type="text/event-stream")
            sent = 0

            def watch(i, out):
                nonlocal sent
                text = out.outputs[0].text
                shaper.feed(text[sent:])
                sent = len(text)
                return shaper.stopped

            out = (await collect(sinks, request, watch))[0]
        except MessagesError as e:
            return _error(e.status, e.message)
        except Exception as e:  # the OpenAI helpers' ApiError (400 / 503 / 499), in Anthropic's shape
            if hasattr(e, "status") and hasattr(e, "message"):
                return _error(e.status, e.message)
            raise
        shaper.close(out.outputs[0].finish_reason)
        msg = shaper.message()
        blocks = []
        if thinking:
            blocks.append({"type": "thinking", "thinking": msg.get("reasoning_content") or "", "signature": ""})
        if msg["content"]:
            blocks.append({"type": "text", "text": msg["content"]})
        parsed = shaper.parser.finish()  # its calls' arguments as objects (a cut call: its complete parameters)
        for c, call in zip(msg.get("tool_calls", []), parsed.tool_calls):
            blocks.append({"type": "tool_use", "id": _tool_id(c["id"]), "name": call.name, "input": call.arguments})
        stop, seq = _stop_reason(shaper, out)
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": served_model_name,
            "content": blocks,
            "stop_reason": stop,
            "stop_sequence": seq,
            "usage": _usage(out),
        }

    async def _events(sinks, mid: str, shaper: tc.ChoiceShaper):
        sent, done, started = 0, False, False
        state = {"open": None, "index": -1}  # the open block: "thinking", "text" or ("tool", call index)

        def block(kind, start: dict):
            out = []
            if state["open"] is not None:
                out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": state["index"]}))
            state["open"], state["index"] = kind, state["index"] + 1
            out.append(
                _sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": state["index"], "content_block": start},
                )
            )
            return out

        def delta(d: dict):
            return _sse("content_block_delta", {"type": "content_block_delta", "index": state["index"], "delta": d})

        def events_of(deltas: list[dict]):
            """The shaper's OpenAI deltas (stop sequences already applied to the text) as Anthropic events."""
            out = []
            for d in deltas:
                if "reasoning_content" in d:
                    if state["open"] != "thinking":
                        out += block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    out.append(delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
                elif "content" in d:
                    if state["open"] != "text":
                        out += block("text", {"type": "text", "text": ""})
                    out.append(delta({"type": "text_delta", "text": d["content"]}))
                else:
                    call = d["tool_calls"][0]
                    if "id" in call:
                        start = {"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"]}
                        out += block(("tool", call["index"]), dict(start, input={}))
                    elif call["function"]["arguments"]:
                        out.append(delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
            return out

        try:
            async for _, out in merged(sinks):
                if isinstance(out, Exception):
                    yield _sse("error", {"type": "error", "error": {"type": "api_error", "message": str(out)}})
                    done = True
                    return
                if out is None:
                    continue
                c = out.outputs[0]
                if not started:
                    started = True
                    msg = {
                        "id": mid,
                        "type": "message",
                        "role": "assistant",
                        "model": served_model_name,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": _usage(out, 0),
                    }
                    yield _sse("message_start", {"type": "message_start", "message": msg})
                text, sent = c.text[sent:], len(c.text)
                deltas = shaper.feed(text)
                if c.finish_reason is not None:
                    deltas += shaper.close(c.finish_reason)
                for ev in events_of(deltas):
                    yield ev
                if shaper.finish_reason is not None:  # the end, or a stop sequence ended the text
                    if shaper.stopped and not out.finished:
                        for sid, _ in sinks:
                            engine.abort(sid)
                    if state["open"] is not None:
                        yield _sse("content_block_stop", {"type": "content_block_stop", "index": state["index"]})
                    stop, seq = _stop_reason(shaper, out)
                    yield _sse(
                        "message_delta",
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": stop, "stop_sequence": seq},
                            "usage": {"output_tokens": len(c.token_ids)},
                        },
                    )
                    yield _sse("message_stop", {"type": "message_stop"})
                    done = True
                    return
            done = True
        finally:
            if not done:  # the client went away: free its cache now
                for sid, _ in sinks:
                    engine.abort(sid)


def _with_bans(params: SamplingParams, bans: list[int]) -> SamplingParams:
    return dataclasses.replace(params, banned_token_ids=[*params.banned_token_ids, *bans])


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
