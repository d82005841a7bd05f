"""The OpenAI-compatible HTTP front: FastAPI routes over the ``AsyncEngine``.

Every request is validated in full (body schema, sampling parameters, prompt length and cache capacity)
before anything enters the engine, so a bad request is a 4xx that costs the others nothing. A streaming
client that goes away aborts its requests at once, which frees their cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.core import RequestError
from ..engine.sampling_params import SamplingParamsError
from ..models.tokenizer import TooManyTokens
from . import anthropic
from . import openai_format as fmt
from . import tool_calls as tc
from .async_engine import AsyncEngine, EngineOverloaded, EngineShutdown, KVLoadFailed
from .chat import ChatFormatError, chat_prompt_ids
from .guard import Guard
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        self.status, self.message, self.type, self.param = status, message, type_, param


def build_app(
    engine: AsyncEngine,
    served_model_name: str | list[str],
    api_key: str | list[str] | None = None,
    max_body_bytes: int = 8 << 20,
    default_max_tokens: int | None = 256,
    aliases: tuple = (),
    cors: dict | None = None,
    default_sampling: dict | None = None,
) -> FastAPI:
    """``served_model_name``: the ids a request may name (the first is the one reported and listed first);
    ``aliases``: other names a request may give (the MODEL argument a served name stands for), not listed;
    ``api_key``: the keys any of which is accepted; ``cors``: Starlette CORSMiddleware's arguments
    (allow_origins, allow_methods, allow_headers, allow_credentials), as vLLM's --allowed-origins etc., None: no
    CORS headers; ``default_sampling``: SamplingParams fields a request that sets none of them gets (the
    checkpoint's generation_config.json)."""
    app = FastAPI(title="dsserve", docs_url=None, redoc_url=None)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    served_model_name, default_sampling = names[0], default_sampling or {}
    core = engine.core
    dialect_default = tc.model_dialect(core.tokenizer)  # the chat/DSML dialect (V4 or V4.1) of the served model

    def err(status: int, message: str, type_: str, param: str | None = None, headers=None) -> JSONResponse:
        return JSONResponse(fmt.error_body(message, type_, status, param), status_code=status, headers=headers)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api(_, e: ApiError):
        if engine.metrics is not None:
            engine.metrics.observe_error(
                "bad_request" if e.status < 500 else "unavailable" if e.status == 503 else "internal"
            )
        return err(e.status, e.message, e.type, e.param, headers={"Retry-After": "1"} if e.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return err(
            400,
            f"invalid request: {where}: {first.get('msg', 'malformed body')}"
            + (f" ({len(e.errors())} problems)" if len(e.errors()) > 1 else ""),
            "invalid_request_error",
            where or None,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return err(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _fault(_, e: Exception):
        if engine.metrics is not None:
            engine.metrics.observe_error("internal")
        return err(500, f"internal error: {type(e).__name__}: {e}", "internal_error")

    # ------------------------------------------------------------------ info routes
    @app.get("/health")
    async def health():
        if not engine.alive():
            why = getattr(engine, "death", None)
            return err(
                503, f"the engine stopped: {why}" if why else "the engine loop is not running", "service_unavailable"
            )
        return {"status": "ok", "in_flight": engine.num_in_flight()}

    @app.get("/metrics")
    async def metrics():
        if engine.metrics is None:
            return PlainTextResponse("", status_code=404)
        body, ctype = engine.metrics.render()
        return Response(body, media_type=ctype)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's: every cached prefix forgotten (a benchmark point starts cold). Only an idle engine does it."""
        if not await engine.reset_prefix_cache():
            return err(
                409,
                f"the prefix cache can be reset only while no request runs ({engine.num_in_flight()} "
                "in flight); retry once they finish",
                "conflict_error",
            )
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "dsserve",
                    "max_model_len": core.max_model_len,
                }
                for name in names  # every served name is a model card, as vLLM's
            ],
        }

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            try:
                ids = await asyncio.to_thread(chat_prompt_ids, core.tokenizer, messages)
            except (ChatFormatError, ValueError) as e:
                raise ApiError(400, str(e), param="messages") from None
        else:
            ids = await asyncio.to_thread(core.tokenizer.encode, body.prompt or "", body.add_special_tokens)
        out = {"tokens": ids, "count": len(ids), "max_model_len": core.max_model_len}
        return await asyncio.to_thread(JSONResponse, out)  # a long list renders off the event loop too

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < core.cfg.vocab_size]
        if bad:
            raise ApiError(400, f"token ids must lie in [0, {core.cfg.vocab_size}); got {bad[:5]}", param="tokens")
        return {"prompt": await asyncio.to_thread(core.tokenizer.decode, body.tokens)}

    # ------------------------------------------------------------------ generation routes
    def check_model(name: str | None) -> None:
        if name is not None and name not in names and name not in aliases:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {' or '.join(map(repr, names))}",
                "not_found_error",
                "model",
            )

    def plan_sync(prompts: list, body, logprobs: int | None, constraint: dict | None = None):
        """[(prompt ids, params)] per choice, prompt-major. A prompt that leaves no room for the asked completion
        is a 400 in vLLM's words; without an asked length, the default is cut to the room left (as vLLM does).
        Text prompts are counted before their ids are built (TooManyTokens). ``constraint``: {"json_schema" |
        "structural_tag": text}, compiled by the engine's validate (a 400 if it cannot be)."""
        field, asked = body.output_limit()
        params = body.sampling_params(default_max_tokens, logprobs)
        unset = {k: v for k, v in default_sampling.items() if k not in body.model_fields_set}
        params = dataclasses.replace(params, **unset) if unset else params
        if constraint:
            params = dataclasses.replace(params, **constraint)
        params.check_vocab(core.cfg.vocab_size)
        out = []
        for p in prompts:
            if isinstance(p, str):
                try:
                    ids = core.tokenizer.encode(p, add_bos=True, max_tokens=core.max_model_len - 1)
                except TooManyTokens as e:
                    raise ApiError(
                        400, fmt.context_length_message(core.max_model_len, e.n, asked or 0), param=field
                    ) from None
            else:
                ids = list(p)
            room = core.max_model_len - len(ids)
            if ids and (room < 1 or (asked or 0) > room):
                raise ApiError(400, fmt.context_length_message(core.max_model_len, len(ids), asked or 0), param=field)
            own = params
            if asked is None and params.max_tokens is not None and params.max_tokens > room:
                own = dataclasses.replace(params, max_tokens=room)
            ids = core.validate(ids, own)
            out += [(ids, own)] * body.n
        return out

    async def plan(prompts: list, body, logprobs: int | None, constraint: dict | None = None):
        """Validate everything up front, in a worker thread: tokenising a long prompt must not stall the event
        loop, and with it /health and every stream."""
        try:
            return await asyncio.to_thread(plan_sync, prompts, body, logprobs, constraint)
        except (SamplingParamsError, RequestError, ChatFormatError, ValueError) as e:
            raise ApiError(400, str(e), param=getattr(e, "field", None)) from None

    def routing(request: Request, body) -> tuple[str | None, int | None]:
        """(session id, pinned DP rank) of a request: ``X-Session-ID`` else the body's ``user`` keeps a
        conversation on one DP rank (``user``: with DP only); ``X-data-parallel-rank`` (vLLM's header) pins one."""
        dp = core.args.data_parallel_size
        session = request.headers.get("x-session-id") or (getattr(body, "user", None) if dp > 1 else None)
        pin = request.headers.get("x-data-parallel-rank")
        if pin is None:
            return session, None
        if not pin.strip().isdigit() or int(pin) >= dp:
            raise ApiError(400, f"X-data-parallel-rank {pin!r}: ranks are 0..{dp - 1}", param="X-data-parallel-rank")
        return session, int(pin) if dp > 1 else None

    async def run(choices, body, session_id: str | None, rank: int | None = None):
        kt = getattr(body, "kv_transfer_params", None)  # a P/D hand-off (OpenAI routes; /v1/messages has none)
        if kt and len(choices) > 1:
            raise ApiError(
                400, "kv_transfer_params take one prompt and n=1 (a hand-off is one request's KV)", param="n"
            )
        rid = fmt.new_id("req")
        sinks = []
        if engine.metrics is not None:  # per prompt: its n requests (vLLM's parent request)
            for k in range(0, len(choices), body.n):
                ids = [f"{rid}-{i}" for i in range(k, k + body.n)]
                engine.metrics.observe_request(ids, body.n, choices[k][1].max_tokens)
        try:
            for i, (ids, params) in enumerate(choices):
                if params.seed is not None and body.n > 1:  # n samples, not n copies of one
                    params = dataclasses.replace(params, seed=params.seed + i % body.n)
                sink = engine.submit(
                    f"{rid}-{i}", ids, params, body.priority, body.cache_salt, session_id, rank=rank, kv_transfer=kt
                )
                sinks.append((f"{rid}-{i}", sink))
        except EngineOverloaded as e:
            for sid, _ in sinks:
                engine.abort(sid)
            if engine.metrics is not None:
                engine.metrics.forget_requests([f"{rid}-{i}" for i in range(len(sinks), len(choices))])
            raise ApiError(503, str(e), "service_unavailable") from None
        if (kt or {}).get("transfer_id"):
            sinks = await loaded(sinks)
        return sinks

    async def loaded(sinks):
        """A decode instance's hand-off: wait for each choice's first output (its KV pulled and replayed) before any
        response starts, so a failed load is an error status with its reason, not a broken stream."""
        out = []
        for sid, sink in sinks:
            first = await sink.get()
            if isinstance(first, Exception):
                for other, _ in sinks:
                    engine.abort(other)
                raise_for(first)
            out.append((sid, _Peeked(first, sink)))
        return out

    def raise_for(item: Exception):
        if isinstance(item, EngineShutdown):
            raise ApiError(503, str(item), "service_unavailable")
        if isinstance(item, KVLoadFailed):
            if engine.metrics is not None:
                engine.metrics.observe_error("kv_transfer")
                engine.metrics.kv_transfer.failed()
            raise ApiError(
                item.status, str(item), "kv_transfer_error" if item.status >= 500 else "invalid_request_error"
            )
        if isinstance(item, RequestError):
            raise ApiError(400, str(item))
        raise ApiError(500, str(item), "internal_error")

    async def merged(sinks) -> AsyncIterator[tuple[int, object]]:
        """(choice index, output) from every choice as they come; ends when all have ended."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, sink):
            while True:
                item = await sink.get()
                await queue.put((i, item))
                if item is None or isinstance(item, Exception):
                    return

        tasks = [asyncio.create_task(pump(i, s)) for i, (_, s) in enumerate(sinks)]
        live = len(sinks)
        try:
            while live:
                i, item = await queue.get()
                if item is None or isinstance(item, Exception):
                    live -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(sinks, request: Request, watch=None) -> list:
        """Final outputs of every choice; a client that hangs up first gets its requests aborted. ``watch(i,
        output)``, called on every output, returns True to end choice i now (its request is aborted)."""

        async def gather():
            last: dict[int, object] = {}
            async for i, item in merged(sinks):
                if isinstance(item, Exception):
                    raise_for(item)
                if item is not None:
                    last[i] = item
                    if watch is not None and watch(i, item) and not item.finished:
                        engine.abort(sinks[i][0])
            return [last[i] for i in range(len(sinks))]

        task = asyncio.create_task(gather())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                for sid, _ in sinks:
                    engine.abort(sid)
                raise ApiError(499, "the client closed the connection", "client_closed_request")
        return task.result()

    def stream(
        sinks, chat: bool, model: str, body, top_n: int | None, prompt_lens, echo=None, shapers=None
    ) -> StreamingResponse:
        """SSE chunks as tokens come. ``stream_options``: include_usage adds a last chunk with the usage; with
        continuous_usage_stats too, every chunk carries its choice's usage so far (vLLM's). ``echo``: per choice,
        text sent before any token. ``shapers``: per chat choice, its output parser (reasoning, content and tool-call
        deltas); a choice whose content channel hit a stop string is aborted at once."""
        rid = fmt.new_id("chatcmpl" if chat else "cmpl")
        opts, n = body.stream_options, body.n
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        sent_tokens = [0] * len(sinks)

        def sse(i, c: dict) -> str:
            if continuous:
                c["usage"] = fmt.running_usage(prompt_lens[i], sent_tokens[i])
            return _sse(c)

        def chunk(i, delta, finish, lp=None, role=False):
            return sse(i, fmt.stream_chunk(rid, model, chat, i, delta, finish, lp, role=role))

        async def events():
            sent_text = [0] * len(sinks)
            finals: dict[int, object] = {}
            cut = None  # the shutdown that cut the choices, said once after their "abort" chunks
            done = False
            try:
                if chat:
                    for i in range(len(sinks)):
                        yield chunk(i, None, None, role=True)
                for i, text in enumerate(echo or ()):
                    yield chunk(i, text, None)
                async for i, out in merged(sinks):
                    if isinstance(out, EngineShutdown):
                        cut = out
                        continue
                    if isinstance(out, Exception):
                        yield _sse(fmt.error_body(str(out), "internal_error", 500))
                        continue
                    if out is None:
                        continue
                    c = out.outputs[0]
                    delta = c.text[sent_text[i] :]
                    lp = None
                    if top_n is not None and c.logprobs is not None:
                        lp = (
                            fmt.chat_logprobs(c, sent_tokens[i], top_n)
                            if chat
                            else fmt.completion_logprobs(c, sent_tokens[i], sent_text[i], top_n)
                        )
                    sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                    if shapers is not None:  # chat: reasoning, content and tool-call deltas from the parser
                        for piece in tc.stream_chunks(shapers[i], rid, model, i, delta, c.finish_reason, lp):
                            yield sse(i, piece)
                        if shapers[i].stopped and not out.finished:
                            engine.abort(sinks[i][0])
                    elif delta or c.finish_reason or lp:
                        yield chunk(i, delta, c.finish_reason, lp)
                    if out.finished:
                        finals[i] = out
                if include_usage and len(finals) == len(sinks):
                    yield _sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": int(time.time()),
                            "model": model,
                            "choices": [],
                            "usage": fmt.usage([finals[i] for i in range(len(sinks))], n),
                        }
                    )
                if cut is not None:
                    yield _sse(fmt.error_body(str(cut), "service_unavailable", 503))
                yield "data: [DONE]\n\n"
                done = True
            finally:
                if not done:  # the client went away: free its cache now
                    for sid, _ in sinks:
                        engine.abort(sid)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        p = body.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise ApiError(400, "the prompt is empty", param="prompt")
        choices = await plan(prompts, body, body.logprobs)
        # echo: the prompt as given (token ids decoded) before each choice's text
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else core.tokenizer.decode(p) for p in prompts for _ in range(body.n)]
        sinks = await run(choices, body, *routing(request, body))
        model = served_model_name
        if body.stream:
            lens = [len(ids) for ids, _ in choices]
            return kv_header(stream(sinks, False, model, body, body.logprobs, lens, echo), sinks)
        outs = await collect(sinks, request)
        out = with_kv_transfer(fmt.completion_body(fmt.new_id("cmpl"), model, outs, body.logprobs, body.n), outs)
        if echo:
            for c, text in zip(out["choices"], echo):
                c["text"] = text + c["text"]
        return out

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        kwargs = dict(body.chat_template_kwargs or {})
        try:  # ---- tools, tool_choice and thinking (server/tool_calls.py)
            thinking, effort = tc.thinking_mode(kwargs, body.thinking, body.reasoning_effort)
            dialect = kwargs.get("dialect", dialect_default)
            tools = tc.plan_tools(
                body.tools,
                body.tool_choice,
                body.parallel_tool_calls,
                thinking=thinking,
                dialect=dialect,
                grammar=tc.grammar_available(),
            )
            schema = tc.json_schema_of(body.response_format, tools)
        except tc.ToolChoiceError as e:
            raise ApiError(400, str(e), param=e.field) from None
        try:
            ids = await asyncio.to_thread(
                chat_prompt_ids,
                core.tokenizer,
                [m.model_dump(exclude_none=True) for m in body.messages],
                max_tokens=core.max_model_len - 1,
                thinking=thinking,
                tools=tools.prompt_tools,
                reasoning_effort=effort,
                version=tools.encoder_version,
            )
            ids += core.tokenizer.encode(tools.prefill, add_bos=False) if tools.prefill else []
        except TooManyTokens as e:  # counted before the ids were built
            raise ApiError(
                400,
                fmt.context_length_message(core.max_model_len, e.n, body.output_limit()[1] or 0),
                param="messages",
            ) from None
        except (ChatFormatError, ValueError) as e:
            raise ApiError(400, str(e), param="messages") from None
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        constraint = {"json_schema": schema} if schema else {"structural_tag": tools.structural_tag}
        choices = await plan([ids], body, top_n, constraint if any(constraint.values()) else None)
        if tools.ban_dsml:  # no tools to call: DSML markup cannot be sampled
            bans = tc.dsml_bans(core.tokenizer)
            choices = [(i, dataclasses.replace(p, banned_token_ids=[*p.banned_token_ids, *bans])) for i, p in choices]
        stops, include = (), False
        if tc.content_stops(tools, choices[0][1]):  # stop strings end the content channel only (spec 6.9)
            stops, include = tuple(choices[0][1].stop), choices[0][1].include_stop_str_in_output
            choices = [(i, dataclasses.replace(p, stop=[])) for i, p in choices]
        sinks = await run(choices, body, *routing(request, body))
        shapers = [tc.ChoiceShaper(tools, stops, include) for _ in sinks]
        model = served_model_name
        if body.stream:
            return kv_header(stream(sinks, True, model, body, top_n, [len(ids)] * body.n, shapers=shapers), sinks)
        sent = [0] * len(sinks)

        def watch(i, out):
            text = out.outputs[0].text
            shapers[i].feed(text[sent[i] :])
            sent[i] = len(text)
            return shapers[i].stopped

        outs = await collect(sinks, request, watch)
        body_ = fmt.chat_body(fmt.new_id("chatcmpl"), model, outs, top_n, body.n)
        return with_kv_transfer(tc.shape_chat_body(body_, outs, tools, shapers), outs)

    def kv_header(resp: StreamingResponse, sinks) -> StreamingResponse:
        """A decode instance's streamed hand-off: what its load moved and took, as the ``x-dsserve-kv-transfer``
        header (JSON), known before the stream starts (``loaded``)."""
        first = sinks[0][1].first[0] if sinks and isinstance(sinks[0][1], _Peeked) and sinks[0][1].first else None
        st = getattr(first, "kv_transfer_stats", None)
        if st:
            resp.headers["x-dsserve-kv-transfer"] = json.dumps(st)
        return resp

    def with_kv_transfer(body_: dict, outs) -> dict:
        """P/D: a prefill instance's hand-off (``kv_transfer_params``, vLLM's field) and what a decode instance's
        load moved (``kv_transfer``: bytes, transfer and replay seconds) in the response body."""
        params = [o.kv_transfer_params for o in outs if o.kv_transfer_params is not None]
        stats = [o.kv_transfer_stats for o in outs if o.kv_transfer_stats is not None]
        if params:
            body_["kv_transfer_params"] = params[0]
        if stats:
            body_["kv_transfer"] = stats[0]
        return body_

    # ---- P/D: a decode instance pulls a hand-off's blocks from here (disagg/transport.py). Outside /v1 (no API
    # key): the transfer id, 128 random bits the router got from this instance, is the capability.
    @app.get("/kv_transfer/{transfer_id}")
    async def kv_transfer_pull(transfer_id: str, first: int = 0, count: int = 0):
        conn = core.kv_connector
        if conn is None:
            raise ApiError(404, "this instance has no KV connector (prefix caching is off)", "not_found_error")
        try:
            chunks = conn.export_chunks(transfer_id, first, count)
        except KeyError as e:
            raise ApiError(404, str(e.args[0]), "not_found_error") from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return StreamingResponse(chunks, media_type="application/octet-stream")

    @app.delete("/kv_transfer/{transfer_id}")
    async def kv_transfer_drop(transfer_id: str):
        conn = core.kv_connector
        return {"dropped": bool(conn is not None and conn.drop(transfer_id))}

    @app.get("/kv_transfer")
    async def kv_transfer_state():
        """What this instance holds for hand-offs: staged exports (P) and loads under way (D), and the cache's
        used blocks (a test checks that a failed hand-off leaves none behind)."""
        conn = core.kv_connector
        return {
            "role": core.args.kv_role,
            "exports": 0 if conn is None else conn.num_exports(),
            "loading": 0 if conn is None else conn.num_loading,
            "blocks_used": core.kv.blocks.num_used,
            "blocks_referenced": sum(1 for r in core.kv.blocks.ref if r > 0),
            "in_flight": engine.num_in_flight(),
        }

    # ---- the Anthropic Messages API over the same helpers (server/anthropic.py)
    anthropic.add_routes(
        app, engine, served_model_name, dialect_default, default_max_tokens, plan, run, collect, merged, check_model
    )

    @app.get("/version")
    async def version():
        return {"version": __version__}

    # Outermost last: CORS answers a browser's preflight before the API key check, and the HTTP metrics see
    # every response, the middleware's own rejections (401, 413) included.
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)
    if engine.metrics is not None:
        engine.metrics.install_http(app)
        engine.metrics.observe_step(core)  # every gauge has its value from the start, before any request
    return app


class _Peeked:
    """A sink whose first item was already taken (``loaded``): gives it back first."""

    def __init__(self, first, sink: asyncio.Queue):
        self.first, self.sink = [first], sink

    async def get(self):
        return self.first.pop() if self.first else await self.sink.get()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
