"""``dsserve router``: one OpenAI-compatible front over prefill and decode instances (P/D disaggregation).

Each request goes first to a prefill instance, as itself with ``max_tokens=1``, no stream and ``kv_transfer_params:
{"do_remote_decode": true}``; the prefill instance runs the prompt, stages its global KV and answers with the hand-off
(``kv_transfer_params``). Then the request goes, as the client sent it, to a decode instance with that hand-off and
the prefill instance's URL; the decode instance pulls the blocks it lacks, replays the last prompt rows and answers,
streamed or not, and its answer is passed through unchanged (vLLM's toy proxy flow, docs/disaggregation.md).

Affinity: a request's session (``X-Session-Id``, else the body's ``user``) picks the instance on each side by
rendezvous hashing over the healthy ones, so a session's turns meet their prefix cache on both sides and only the
instances of a dead one move; a request without a session goes to the instance with the fewest in flight.

Failures: a prefill instance that cannot be reached or dies before answering is marked down and the request retried
on another; a decode instance that cannot be reached likewise. A failed transfer is the decode instance's 5xx with its
reason, passed through. With no healthy instance on a side the request waits up to ``--unavailable-wait`` seconds
for one (a decode instance restarting), then gets a 503 saying which side is missing. A health check every
``--health-interval`` seconds brings instances back.

Imports no torch: the router runs on a base install.
"""

import argparse
import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("dsserve.router")
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host", "content-encoding"}


@dataclass
class Instance:
    url: str
    role: str  # "prefill" | "decode"
    healthy: bool = True
    in_flight: int = 0


def rendezvous(key: str, instances: list[Instance]) -> Instance:
    """Highest-random-weight choice: stable for a key while its instance lives; only a dead instance's keys move."""
    return max(instances, key=lambda i: hashlib.blake2b(f"{key}|{i.url}".encode(), digest_size=8).digest())


class Pool:
    def __init__(self, urls: list[str], role: str):
        self.role = role
        self.instances = [Instance(u.rstrip("/"), role) for u in urls]

    def pick(self, key: str | None, exclude: set[str]) -> Instance | None:
        live = [i for i in self.instances if i.healthy and i.url not in exclude]
        if not live:
            return None
        return rendezvous(key, live) if key else min(live, key=lambda i: i.in_flight)


class RouterError(Exception):
    def __init__(self, status: int, message: str, type_: str = "service_unavailable"):
        self.status, self.message, self.type = status, message, type_


class Router:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout: float = 600.0,
        unavailable_wait: float = 30.0,
        health_interval: float = 1.0,
    ):
        if not prefill or not decode:
            raise ValueError("the router needs at least one --prefill and one --decode URL")
        self.prefill, self.decode = Pool(prefill, "prefill"), Pool(decode, "decode")
        self.timeout, self.unavailable_wait, self.health_interval = timeout, unavailable_wait, health_interval
        self.client = None
        self._build_metrics()

    def _build_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        b = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.m_requests = Counter("dsserve_router:requests", "Requests by outcome.", ["outcome"], registry=reg)
        self.m_queue = Histogram(
            "dsserve_router:queue_seconds",
            "Arrival to the request's dispatch to a prefill instance (waiting for a healthy one included).",
            buckets=b,
            registry=reg,
        )
        self.m_prefill = Histogram(
            "dsserve_router:prefill_seconds",
            "The prefill instance's round trip (its queueing, the prompt, one token, staging the KV).",
            buckets=b,
            registry=reg,
        )
        self.m_decode_first = Histogram(
            "dsserve_router:decode_first_byte_seconds",
            "Dispatch to a decode instance to its answer's first byte (its queueing, the KV pull, the replay).",
            buckets=b,
            registry=reg,
        )
        self.m_transfer = Histogram(
            "dsserve_router:kv_transfer_seconds",
            "KV pull times the decode instances reported.",
            buckets=b,
            registry=reg,
        )
        self.m_replay = Histogram(
            "dsserve_router:kv_replay_seconds", "Replay times the decode instances reported.", buckets=b, registry=reg
        )
        self.m_bytes = Counter(
            "dsserve_router:kv_transfer_bytes",
            "Bytes moved P -> D as the decode instances reported (kind=moved), and what the window-carrying "
            "alternatives would have moved (with_window_rows, with_window_ring).",
            ["kind"],
            registry=reg,
        )
        self.m_healthy = Gauge("dsserve_router:healthy_instances", "Healthy instances by role.", ["role"], registry=reg)
        self.m_retries = Counter("dsserve_router:retries", "Dispatches retried, by role.", ["role"], registry=reg)
        for o in ("ok", "client_error", "failed"):
            self.m_requests.labels(o)
        for k in ("moved", "with_window_rows", "with_window_ring"):
            self.m_bytes.labels(k)
        for r in ("prefill", "decode"):
            self.m_retries.labels(r)

    # ------------------------------------------------------------------ health
    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval)

    async def check_health(self) -> None:
        import httpx

        for pool in (self.prefill, self.decode):
            for inst in pool.instances:
                try:
                    r = await self.client.get(inst.url + "/health", timeout=2.0)
                    up = r.status_code == 200
                except httpx.HTTPError:
                    up = False
                if up != inst.healthy:
                    log.warning("%s instance %s is %s", pool.role, inst.url, "up" if up else "down")
                inst.healthy = up
            self.m_healthy.labels(pool.role).set(sum(i.healthy for i in pool.instances))

    async def _pick(self, pool: Pool, key: str | None, tried: set[str]) -> Instance:
        deadline = time.monotonic() + self.unavailable_wait
        while True:
            inst = pool.pick(key, tried)
            if inst is not None:
                return inst
            if time.monotonic() >= deadline or len(tried) >= len(pool.instances):
                raise RouterError(
                    503,
                    f"no {pool.role} instance is available ({len(pool.instances)} configured, "
                    f"{len(tried)} failed for this request, waited {self.unavailable_wait:g} s for one to come back)",
                )
            await asyncio.sleep(0.2)
            if not tried:
                await self.check_health()

    # ------------------------------------------------------------------ one request
    async def handle(self, path: str, body: dict, headers: dict):
        """The response (JSON or a stream) for one generation request."""
        import httpx
        from fastapi.responses import JSONResponse, StreamingResponse

        t0 = time.perf_counter()
        if not isinstance(body, dict):
            raise RouterError(400, "the body must be a JSON object", "invalid_request_error")
        if body.get("n", 1) != 1:
            raise RouterError(
                400, "n must be 1 through the P/D router (one decode per hand-off)", "invalid_request_error"
            )
        key = headers.get("x-session-id") or body.get("user")
        fwd = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
        drop = ("stream", "stream_options", "max_completion_tokens", "min_tokens")
        pre = {k: v for k, v in body.items() if k not in drop}
        pre.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})

        # ---- prefill: retried on another instance when one cannot be reached or dies before answering
        tried: set[str] = set()
        while True:
            p = await self._pick(self.prefill, key, tried)
            if not tried:
                self.m_queue.observe(time.perf_counter() - t0)
            t1 = time.perf_counter()
            p.in_flight += 1
            try:
                r = await self.client.post(p.url + path, json=pre, headers=fwd, timeout=self.timeout)
            except httpx.TransportError as e:
                log.warning("prefill instance %s failed: %s: %s", p.url, type(e).__name__, e)
                p.healthy = False
                tried.add(p.url)
                self.m_retries.labels("prefill").inc()
                continue
            finally:
                p.in_flight -= 1
            break
        self.m_prefill.observe(time.perf_counter() - t1)
        if r.status_code != 200:
            if r.status_code < 500:
                self.m_requests.labels("client_error").inc()
                return JSONResponse(_json_or(r), status_code=r.status_code)
            raise RouterError(502, f"the prefill instance {p.url} failed: HTTP {r.status_code}: {r.text[:500]}")
        handoff = r.json().get("kv_transfer_params")
        if not isinstance(handoff, dict):
            raise RouterError(
                502,
                f"the prefill instance {p.url} returned no kv_transfer_params (is it a dsserve instance with "
                "prefix caching on?)",
            )
        dec = dict(body, kv_transfer_params=dict(handoff, remote_url=p.url))

        # ---- decode: retried on another instance only when one cannot be reached (it never saw the request)
        tried = set()
        while True:
            d = await self._pick(self.decode, key, tried)
            t2 = time.perf_counter()
            d.in_flight += 1
            try:
                resp = await self.client.send(
                    self.client.build_request("POST", d.url + path, json=dec, headers=fwd, timeout=self.timeout),
                    stream=True,
                )
            except httpx.TransportError as e:
                d.in_flight -= 1
                log.warning("decode instance %s failed: %s: %s", d.url, type(e).__name__, e)
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    d.healthy = False
                    tried.add(d.url)
                    self.m_retries.labels("decode").inc()
                    continue
                raise RouterError(502, f"the decode instance {d.url} failed: {type(e).__name__}: {e}") from None
            break
        self.m_decode_first.observe(time.perf_counter() - t2)
        if resp.status_code != 200 or not body.get("stream"):
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
                d.in_flight -= 1
            try:
                out = json.loads(data)
            except ValueError:
                out = {"error": {"message": data[:500].decode(errors="replace"), "type": "internal_error"}}
            if resp.status_code == 200:
                self._observe_transfer(out.get("kv_transfer"))
                self.m_requests.labels("ok").inc()
            else:
                self.m_requests.labels("client_error" if resp.status_code < 500 else "failed").inc()
            return JSONResponse(out, status_code=resp.status_code)
        hdr = resp.headers.get("x-dsserve-kv-transfer")
        self._observe_transfer(json.loads(hdr) if hdr else None)
        self.m_requests.labels("ok").inc()

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                d.in_flight -= 1

        keep = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(relay(), status_code=200, headers=keep, media_type="text/event-stream")

    def _observe_transfer(self, st: dict | None) -> None:
        if not st:
            return
        self.m_bytes.labels("moved").inc(st.get("bytes", 0))
        self.m_bytes.labels("with_window_rows").inc(st.get("with_window_rows_bytes", 0))
        self.m_bytes.labels("with_window_ring").inc(st.get("with_window_ring_bytes", 0))
        if "transfer_s" in st:
            self.m_transfer.observe(st["transfer_s"])
        if "replay_s" in st:
            self.m_replay.observe(st["replay_s"])

    async def fan_out(self, method: str, path: str) -> tuple[int, dict]:
        """``path`` on every healthy instance (``/reset_prefix_cache``; a dead one has no cache to reset): the worst
        status, and each answer."""
        import httpx

        worst, answers = 200, {}
        for inst in [i for i in self.prefill.instances + self.decode.instances if i.healthy]:
            try:
                r = await self.client.request(method, inst.url + path, timeout=60)
                answers[inst.url] = _json_or(r)
                worst = max(worst, r.status_code)
            except httpx.HTTPError as e:
                answers[inst.url] = {"error": f"{type(e).__name__}: {e}"}
                worst = max(worst, 502)
        return worst, answers


def _json_or(r) -> dict:
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": r.text[:500], "type": "internal_error"}}


def build_app(router: Router):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="dsserve router", docs_url=None, redoc_url=None)

    @app.on_event("startup")
    async def _start():
        router.client = httpx.AsyncClient(timeout=router.timeout, limits=httpx.Limits(max_connections=1024))
        await router.check_health()
        router._health = asyncio.create_task(router.health_loop())

    @app.on_event("shutdown")
    async def _stop():
        router._health.cancel()
        await router.client.aclose()

    @app.exception_handler(RouterError)
    async def _err(_, e: RouterError):
        router.m_requests.labels("failed" if e.status >= 500 else "client_error").inc()
        return JSONResponse(
            {"error": {"message": e.message, "type": e.type, "param": None, "code": e.status}}, status_code=e.status
        )

    async def generate(path: str, request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise RouterError(400, "the body is not valid JSON", "invalid_request_error") from None
        return await router.handle(path, body, dict(request.headers))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        d = await router._pick(router.decode, None, set())
        r = await router.client.get(d.url + "/v1/models")
        return JSONResponse(_json_or(r), status_code=r.status_code)

    @app.post("/reset_prefix_cache")
    async def reset():
        status, answers = await router.fan_out("POST", "/reset_prefix_cache")
        return JSONResponse({"status": "ok" if status == 200 else "failed", "instances": answers}, status_code=status)

    @app.get("/health")
    async def health():
        ok = all(any(i.healthy for i in p.instances) for p in (router.prefill, router.decode))
        state = {i.url: i.healthy for p in (router.prefill, router.decode) for i in p.instances}
        return JSONResponse({"status": "ok" if ok else "degraded", "instances": state}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (--kv-role prefill)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (--kv-role decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one instance may take to answer (default 600)")
    p.add_argument(
        "--unavailable-wait",
        type=float,
        default=30.0,
        help="seconds a request waits for a healthy instance on a side that has none, then 503 (default 30)",
    )
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks (default 1)")
    p.add_argument("--uvicorn-log-level", default="warning")


def run_router(ns: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s", datefmt="%m-%d %H:%M:%S")
    router = Router(ns.prefill, ns.decode, ns.timeout, ns.unavailable_wait, ns.health_interval)
    log.info("dsserve router on http://%s:%d: prefill %s, decode %s", ns.host, ns.port, ns.prefill, ns.decode)
    uvicorn.run(build_app(router), host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level)
    return 0
