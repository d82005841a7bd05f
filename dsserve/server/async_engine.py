"""The engine loop on its own thread, so HTTP stays responsive while a step runs.

Requests and aborts cross into the loop through a queue; each request's outputs come back to the event
loop through its own ``asyncio.Queue``. A fault in one step aborts that step's requests with an error
and the loop keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..engine.core import EngineCore
from ..engine.sampling_params import SamplingParams

log = logging.getLogger("dsserve.server")


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the client should retry later (HTTP 503)."""


class EngineFault(RuntimeError):
    """A step failed for this request; the engine itself keeps running (HTTP 500)."""


class KVLoadFailed(RuntimeError):
    """A decode instance could not load the request's prompt KV from its prefill instance (P/D disaggregation);
    ``status``: the HTTP status to answer with (502, 504)."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


class EngineShutdown(RuntimeError):
    """The server shut down before the request finished: its sink gets this after its "abort" output (HTTP 503)."""


@dataclass
class _Submit:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    session_id: str | None
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    kv_transfer: dict | None = None


class AsyncEngine:
    def __init__(self, core: EngineCore, max_waiting: int = 1024, metrics=None):
        self.core, self.max_waiting, self.metrics = core, max_waiting, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Submit] = {}
        self._stop = threading.Event()
        self._intake_open = True
        self._drain_timeout: float | None = None
        self._thread = threading.Thread(target=self._loop, name="dsserve-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- event-loop side
    def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        session_id: str | None = None,
        kv_transfer: dict | None = None,
    ) -> asyncio.Queue:
        """Queue a request; its outputs (then None at the end, or an exception) arrive on the returned queue.
        The request is validated synchronously by the caller through ``validate`` first."""
        if not self._intake_open:
            raise EngineOverloaded("the server is shutting down")
        if self.num_in_flight() >= self.max_waiting + self.core.args.max_num_seqs:
            raise EngineOverloaded(
                f"{self.num_in_flight()} requests in flight; the waiting queue is full "
                f"({self.max_waiting}); retry later"
            )
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(
            _Submit(
                request_id,
                prompt,
                params,
                priority,
                cache_salt,
                session_id,
                sink,
                asyncio.get_running_loop(),
                kv_transfer,
            )
        )
        return sink

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache on the engine thread, between steps; False while requests run (or the loop
        is shutting down)."""
        if not self._intake_open or not self.alive():
            return False
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(("reset_prefix_cache", done, loop))
        try:
            return await asyncio.wait_for(done, 60)  # the loop answers between steps
        except asyncio.TimeoutError:
            return False

    def alive(self) -> bool:
        return self._thread.is_alive()

    def num_in_flight(self) -> int:
        return len(self._sinks) + self._inbox.qsize()

    def close_intake(self) -> None:
        self._intake_open = False

    def begin_drain(self, timeout: float) -> None:
        """Stop intake; in-flight requests get ``timeout`` seconds to finish, then each is aborted and its sink
        gets its "abort" output and an ``EngineShutdown``; then the engine thread ends. Returns at once; a later
        call keeps the first deadline."""
        self.close_intake()
        if self._drain_timeout is None:
            self._drain_timeout = timeout
            self._inbox.put(("drain", timeout))

    def shutdown(self, timeout: float) -> None:
        """``begin_drain``, then wait for the engine thread."""
        self.begin_drain(timeout)
        self._thread.join(self._drain_timeout + 5)

    # ---------------------------------------------------------------- engine thread
    def _deliver(self, sub: _Submit, item) -> None:
        sub.loop.call_soon_threadsafe(sub.sink.put_nowait, item)

    def _loop(self) -> None:
        deadline = None  # set by a drain: finish in-flight work until then, then abort the rest
        while True:
            idle = not self.core.has_unfinished_requests() and deadline is None
            try:
                item = self._inbox.get() if idle else self._inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if isinstance(item, tuple) and item[0] == "drain":
                    deadline = time.monotonic() + item[1]
                else:
                    self._handle(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            busy = self.core.has_unfinished_requests()
            if self.metrics is not None and not busy:  # aborts may have emptied the engine: no step will say so
                self.metrics.observe_step(self.core)
            if deadline is not None and (not busy or time.monotonic() > deadline):
                cut = EngineShutdown(
                    f"the server shut down before the request finished (the {self._drain_timeout:g} s "
                    "--shutdown-timeout after SIGTERM ran out); retry on another server"
                )
                for rid in list(self._sinks):
                    self._abort(rid, cut)
                return
            if busy:
                self._step()

    def _handle(self, item) -> None:
        if isinstance(item, _Submit):
            try:
                self.core.add_request(
                    item.request_id,
                    item.prompt,
                    item.params,
                    item.priority,
                    item.cache_salt,
                    item.session_id,
                    item.kv_transfer,
                )
                self._sinks[item.request_id] = item
            except Exception as e:  # validated before, so this is a race or a fault: report, keep serving
                self._deliver(item, e)
        elif item[0] == "abort":
            self._abort(item[1])
        elif item[0] == "reset_prefix_cache":
            _, done, loop = item
            loop.call_soon_threadsafe(done.set_result, self.core.reset_prefix_cache())

    def _abort(self, rid: str, end: Exception | None = None) -> None:
        """Abort a request; its sink gets its last output, then ``end`` (None: a plain end)."""
        sub = self._sinks.pop(rid, None)
        out = self.core.abort_request(rid)
        if out is not None and self.metrics is not None:
            self.metrics.observe_output(out)
        if sub is not None:
            if out is not None:
                self._deliver(sub, out)
            self._deliver(sub, end)

    def _step(self) -> None:
        try:
            outs = self.core.step()
        except Exception as e:  # a real fault: fail the requests of this step, keep the engine alive
            log.exception("engine step failed")
            running = [r.request_id for r in self.core.scheduler.running]
            for rid in running:
                sub = self._sinks.pop(rid, None)
                self.core.abort_request(rid)
                if sub is not None:
                    self._deliver(sub, EngineFault(f"internal error while running the request: {e}"))
            if self.metrics is not None:
                self.metrics.observe_error("internal")
            return
        if self.metrics is not None:
            self.metrics.observe_step(self.core)
            for out in outs:
                self.metrics.observe_output(out)
            self.metrics.end_step()  # before delivering: a client that reads /metrics after its reply sees it
        for out in outs:
            sub = self._sinks.get(out.request_id)
            if sub is None:
                continue
            if out.error is not None:  # its remote KV could not be loaded: it holds nothing any more
                self._sinks.pop(out.request_id, None)
                self._deliver(sub, KVLoadFailed(out.error[1], out.error[0]))
                continue
            self._deliver(sub, out)
            if out.finished:
                self._sinks.pop(out.request_id, None)
                self._deliver(sub, None)
