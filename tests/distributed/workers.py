"""Rank processes for the distributed tests: spawned once per test module, reused by its tests.

``Workers(n)`` spawns n processes that join one gloo world through the env rendezvous (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free loopback port), as torchrun would start them. ``run(fn, *args)`` calls
``fn(rank, *args)`` on every rank (``fn`` a module-level function, pickled by name) and returns the results in rank
order. Every wait has a deadline: a rank that raises, dies or hangs in a collective fails the test with its
traceback instead of hanging the suite; the workers are then torn down (a rank left inside a collective cannot be
trusted) and later calls fail at once.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

# A collective waiting longer than this raises in the rank (gloo's timeout); the parent's deadline is longer, so the
# rank's own error (with its traceback) is what the test reports.
GROUP_TIMEOUT_S = 45.0
RUN_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, inbox, outbox) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import torch

        torch.set_num_threads(1)  # two cores shared by every rank and the parent
        from dsserve.distributed.groups import init_world

        init_world("gloo", timeout_s=GROUP_TIMEOUT_S)
        outbox.put((rank, True, "ready"))
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))
        return
    while (task := inbox.get()) is not None:
        fn, args = task
        try:
            outbox.put((rank, True, fn(rank, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    # The parent has every result (it asks the ranks to stop only then): leave without the group's teardown, which
    # waits on the peers and took seconds per module.
    os._exit(0)


class Workers:
    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world, self.broken = world, None
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, port, self.inboxes[r], self.outbox), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self._collect("startup", RUN_TIMEOUT_S)

    def run(self, fn, *args, timeout_s: float = RUN_TIMEOUT_S) -> list:
        """fn(rank, *args) on every rank; the results in rank order."""
        if self.broken:
            raise RuntimeError(f"the workers were torn down by an earlier failure: {self.broken}")
        for q in self.inboxes:
            q.put((fn, args))
        return self._collect(fn.__name__, timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list:
        results, deadline = {}, time.monotonic() + timeout_s
        while len(results) < self.world:
            try:
                rank, ok, value = self.outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in results]
                late = time.monotonic() > deadline
                if dead or late:
                    why = f"ranks {dead} died" if dead else f"no answer within {timeout_s:.0f} s (a hang)"
                    self._fail(f"{what}: {why}")
                continue
            if not ok:
                self._fail(f"{what} failed on rank {rank}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(self.world)]

    def _fail(self, why: str):
        self.broken = why.splitlines()[0]
        self.close()
        raise RuntimeError(why)

    def close(self) -> None:
        for q, p in zip(self.inboxes, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():  # stuck in a collective: end it by its pid
                p.kill()
                p.join(timeout=5)
