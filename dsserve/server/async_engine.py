"""The engine loop on its own thread, so HTTP stays responsive while a step runs.

Requests and aborts cross into the loop through a queue; each request's outputs come back to the event
loop through its own ``asyncio.Queue``. A fault in one step aborts that step's requests with an error
and the loop keeps serving the rest. When the engine itself is lost (a tensor-parallel worker or a data-parallel
rank died: ``EngineDeadError``) every request in flight ends with an ``EngineShutdown`` (HTTP 503), ``alive`` turns
False at once and the loop ends; ``died`` is set for the server to exit non-zero. With data parallelism ``core`` is a
``distributed.dp_client.DPClient`` (the same calls over one engine core a rank process).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..engine.core import EngineCore
from ..engine.executor import EngineDeadError
from ..engine.sampling_params import SamplingParams

log = logging.getLogger("dsserve.server")
# After the engine is lost, its loop gets this long to come back from the step it is in (a gloo collective fails at
# once; an NCCL one may wait for its timeout) before the requests are ended without it.
LOST_GRACE_S = 5.0


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
    rank: int | None = None  # a pinned DP rank (DPClient only)
    kv_transfer: dict | None = None  # kv_transfer_params of a P/D hand-off (disagg)


class AsyncEngine:
    def __init__(self, core: EngineCore, max_waiting: int = 1024, metrics=None):
        self.core, self.max_waiting, self.metrics = core, max_waiting, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Submit] = {}
        self._stop = threading.Event()
        self._intake_open = True
        self._drain_timeout: float | None = None
        self.death: str | None = None  # why the engine was lost
        self.died = threading.Event()
        self._ending = threading.Lock()
        executor = getattr(core, "executor", None)  # a DPClient watches its ranks itself (EngineDeadError in step)
        if executor is not None:
            executor.on_failure(self._lost)  # from the executor's watchdog: /health turns at once
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
        rank: int | None = None,
        kv_transfer: dict | None = None,
    ) -> asyncio.Queue:
        """Queue a request; its outputs (then None at the end, or an exception) arrive on the returned queue.
        The request is validated synchronously by the caller through ``validate`` first."""
        if self.death is not None:
            raise EngineOverloaded(f"the engine has stopped: {self.death}")
        if not self._intake_open:
            raise EngineOverloaded("the server is shutting down")
        if self.num_in_flight() >= self.max_waiting + self.core.args.max_num_seqs * self.core.args.data_parallel_size:
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
                rank,
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
        return self._thread.is_alive() and self.death is None

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

    def _lost(self, why: str) -> None:
        """The engine cannot step again (any thread): refuse new work now, wake the loop to end the rest."""
        if self.death is None:
            self.death = why
        self._inbox.put(("lost", why))
        timer = threading.Timer(LOST_GRACE_S, self._end_all)  # the loop may be stuck in the step
        timer.daemon = True
        timer.start()

    def _end_all(self) -> None:
        """Every request in flight (queued ones too) ends with a 503; then ``died`` is set. Once (the loop's end or
        the grace timer, whichever comes first)."""
        with self._ending:
            if self.died.is_set():
                return
            cut = EngineShutdown(f"the engine stopped: {self.death}; retry on another server")
            for rid in list(self._sinks):
                sub = self._sinks.pop(rid, None)
                if sub is not None:
                    self._deliver(sub, cut)
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Submit):
                    self._deliver(item, cut)
                elif item[0] == "reset_prefix_cache":
                    item[2].call_soon_threadsafe(item[1].set_result, False)
            if self.metrics is not None:
                self.metrics.observe_error("internal")
            self.died.set()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            if self.death is not None:
                self._end_all()

    def _serve(self) -> None:
        deadline = None  # set by a drain: finish in-flight work until then, then abort the rest
        # DP ranks report load and die on their own: an idle loop still reads them twice a second
        watch = 0.5 if hasattr(self.core, "rank_loads") else None
        while self.death is None:
            idle = not self.core.has_unfinished_requests() and deadline is None
            try:
                item = self._inbox.get(timeout=watch) if idle else self._inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if isinstance(item, tuple) and item[0] == "lost":
                    return
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
            if busy or watch is not None:
                self._step()

    def _handle(self, item) -> None:
        if isinstance(item, _Submit):
            try:
                pin = {} if item.rank is None else {"rank": item.rank}  # DPClient's
                if item.kv_transfer is not None:  # a P/D hand-off (EngineCore's)
                    pin["kv_transfer"] = item.kv_transfer
                self.core.add_request(
                    item.request_id,
                    item.prompt,
                    item.params,
                    item.priority,
                    item.cache_salt,
                    item.session_id,
                    **pin,
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
        except EngineDeadError as e:  # the engine itself is lost: _loop ends every request
            self._lost(str(e))
            return
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
        for rid, why in getattr(self.core, "pop_failures", list)():  # a DP rank refused them
            sub = self._sinks.pop(rid, None)
            if sub is not None:
                self._deliver(sub, EngineFault(f"the engine refused the request: {why}"))
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
