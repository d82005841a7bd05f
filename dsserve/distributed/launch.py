"""Rank processes on one host: spawn them, join them through torch.distributed's env rendezvous, watch, reap.

``RankProcesses.spawn(target, ranks, world, rendezvous, args)`` starts one spawned process per global rank in
``ranks``, each with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set before it
calls ``target(rank, *args)``; the target joins the world itself (``groups.init_world``). Every child watches its
parent through a death pipe (a pipe the parent never writes: end of file means the parent is gone) and exits at
once with ``PARENT_GONE``; the parent's watchdog thread reports a child that exits while it is not being stopped, and
``reap`` ends them all by pid. Used for the TP workers of one engine (``tp_worker``) and for the DP ranks of the
front end (``dp_client``), whose ranks may spawn TP workers of their own.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Callable

log = logging.getLogger("dsserve")
PARENT_GONE = 70  # a child's exit status when its parent died (EX_SOFTWARE: it did not fail on its own)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (torch.distributed's env rendezvous) and this node's share of the world: node
    ``node_rank`` of ``nnodes`` holds global ranks ``node_rank * nproc_per_node ...`` (torchrun's order)."""

    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port of this host (one node only)
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self):
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must lie in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("a multi-node run needs --master-port (every node must name the same one)")

    @classmethod
    def from_env(cls, master_addr: str | None, master_port: int | None, nnodes: int, node_rank: int) -> "Rendezvous":
        """The flags, else torchrun's variables (MASTER_ADDR, MASTER_PORT; nodes: WORLD_SIZE / LOCAL_WORLD_SIZE; this
        node: GROUP_RANK), else one node on a free loopback port."""
        env = os.environ
        if nnodes == 1 and "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env:
            nnodes = int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"])
        return cls(
            master_addr or env.get("MASTER_ADDR", "127.0.0.1"),
            master_port or int(env.get("MASTER_PORT", 0)),
            nnodes,
            node_rank or int(env.get("GROUP_RANK", 0)),
        )

    def resolved(self) -> "Rendezvous":
        """With a concrete port (a free one on this host when none was given)."""
        if self.master_port:
            return self
        return Rendezvous(self.master_addr, free_port(self.master_addr), self.nnodes, self.node_rank)

    def env(self, rank: int, world: int, local_rank: int) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def watch_parent(death: Connection) -> None:
    """In a child: exit with ``PARENT_GONE`` as soon as the parent is gone (its end of ``death`` closes)."""

    def wait_for_eof():
        try:
            death.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(PARENT_GONE)

    threading.Thread(target=wait_for_eof, name="dsserve-parent-watch", daemon=True).start()


def _enter(rank: int, env: dict, death: Connection, target: Callable, args: tuple) -> None:
    os.environ.update(env)
    watch_parent(death)
    target(rank, *args)


class RankProcesses:
    """Spawned rank processes of this host, with a watchdog and a reaper."""

    def __init__(self, procs: dict[int, mp.process.BaseProcess], deaths: list[Connection]):
        self.procs, self._deaths = procs, deaths  # global rank -> process; the write ends of the death pipes
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._on_death: Callable[[int, int, int | None], None] | None = None

    @classmethod
    def spawn(
        cls,
        target: Callable,
        ranks: list[int],
        world: int,
        rendezvous: Rendezvous,
        args: list[tuple] | tuple = (),
        local_rank: Callable[[int], int] | None = None,
        daemon: bool = True,
    ) -> "RankProcesses":
        """``target(rank, *args)`` in a spawned process per global rank of ``ranks`` (``args``: one tuple for all, or
        a list of one tuple per rank). ``local_rank(rank)``: its index on this host (the GPU it takes; default the
        rank itself, as on one node). ``target`` must be importable by name. ``daemon``: the children end with this
        interpreter even without ``reap`` (multiprocessing's atexit); False for children that spawn children of
        their own (a daemonic process may not), which then rely on their death pipe and the caller's ``reap``."""
        ctx = mp.get_context("spawn")
        per_rank = args if isinstance(args, list) else [args] * len(ranks)
        procs, deaths = {}, []
        try:
            for rank, a in zip(ranks, per_rank):
                r_end, w_end = ctx.Pipe(duplex=False)
                local = local_rank(rank) if local_rank is not None else rank
                env = rendezvous.env(rank, world, local)
                p = ctx.Process(
                    target=_enter, args=(rank, env, r_end, target, a), name=f"dsserve-rank{rank}", daemon=daemon
                )
                p.start()
                r_end.close()  # the child holds the read end; the parent keeps only the write end
                procs[rank], deaths = p, deaths + [w_end]
        except BaseException:
            cls(procs, deaths).reap(0)
            raise
        return cls(procs, deaths)

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def watch(self, on_death: Callable[[int, int, int | None], None]) -> None:
        """Start the watchdog: ``on_death(rank, pid, exitcode)`` (from its thread) for the first child that exits
        before ``reap``. Called again, it hands the running watchdog a new ``on_death`` (a start-up handler, then the
        running engine's), so no death falls between two watchers."""
        self._on_death = on_death
        if self._watchdog is not None:
            return

        def run():
            by_sentinel = {p.sentinel: r for r, p in self.procs.items()}
            ready = wait(list(by_sentinel))
            if self._stopping.is_set():
                return
            rank = by_sentinel[ready[0]]
            p = self.procs[rank]
            p.join(0.1)
            self._on_death(rank, p.pid, p.exitcode)

        self._watchdog = threading.Thread(target=run, name="dsserve-rank-watchdog", daemon=True)
        self._watchdog.start()

    def reap(self, timeout: float = 10.0) -> dict[int, int | None]:
        """Stop watching, close the death pipes (the children exit with ``PARENT_GONE`` unless they exit first),
        wait up to ``timeout`` seconds, then kill what is left by pid. Returns each rank's exit code."""
        self._stopping.set()
        for d in self._deaths:
            d.close()
        self._deaths = []
        for p in self.procs.values():
            p.join(timeout)
        for p in self.procs.values():
            if p.is_alive():
                log.warning("rank process %s (pid %d) did not exit within %.0f s: killed", p.name, p.pid, timeout)
                p.kill()
                p.join(5)
        return {r: p.exitcode for r, p in self.procs.items()}


def report_and_exit(what: str, code: int = 1) -> None:
    """A child's last words: the traceback of the exception being handled, on stderr, then exit ``code`` at once
    (no teardown of a process group whose peers may be gone)."""
    import traceback

    print(f"{what}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    os._exit(code)
