"""The DP front end: ``DPClient`` spawns one engine core per data-parallel rank (``dp_rank``, through
``launch.RankProcesses``: the TP workers' spawner, death pipes and reaper), routes each request to one
(``dp_router``), streams their outputs back, routes aborts by request id and keeps each rank's last load. With
``tensor_parallel_size`` T > 1 each rank's core drives its own T - 1 TP workers (dp_size x T processes in all).

It answers ``EngineCore``'s calls (``add_request``, ``abort_request``, ``step``, ``has_unfinished_requests``,
``reset_prefix_cache``, ``validate``, and the ``tokenizer`` / ``cfg`` / ``args`` / ``max_model_len`` /
``default_sampling`` / ``model_path`` a front end reads), so the offline ``LLM`` and the server's ``AsyncEngine``
drive it as they drive one engine. ``step`` waits (at most ``poll_s``) for the ranks' next messages and returns the
outputs they carried; requests are validated here, with the ranks' tokenizer and limits, before any rank sees them.

With ``--nnodes N`` this front end (node 0) spawns its node's ranks and the other nodes' ranks connect to it over
sockets (``dp_transport``; their handles are ``RemoteRank``s, watched as the local processes are).

Failure is fail-stop for the whole group: a rank that exits or reports an exception (a collective that timed out
included; a TP worker's death fails its rank) makes ``step`` stop every rank (their death pipes closed, SIGKILL after
``kill_after_s``; their TP workers follow through their own) and raise ``EngineDeadError``; the front end fails its
in-flight requests with it (the server: 503, then exit non-zero).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from types import SimpleNamespace

from ..engine.args import EngineArgs
from ..engine.core import EngineCore, RequestError
from ..engine.executor import EngineDeadError
from ..engine.sampling_params import SamplingParams
from ..engine.structured_output import Grammars
from ..layers.engram_store import EngramStore, spawning
from .dp_protocol import (
    Abort,
    AddRequest,
    Announce,
    RankFailed,
    RankLoad,
    RankOutputs,
    RankReady,
    ResetDone,
    ResetPrefixCache,
    Shutdown,
)
from .dp_rank import rank_main
from .dp_router import DPRouter
from .dp_transport import rank_threads_default
from .launch import RankProcesses, Rendezvous


def _lost_remote(p) -> bool:
    """A rank on another node (dp_transport.RemoteRank) whose connection closed."""
    return hasattr(p, "node_rank") and not p.is_alive()


@dataclass
class EPBalance:
    """Rows the routed experts of each EP rank ran, per MoE layer, gathered from the ranks' reports by lockstep step
    (every rank reports every step it joined). The balance of a layer is mean over ranks / max over ranks (1: even;
    1/D: one rank runs everything), per step and over the steps since the window began."""

    dp_size: int
    pending: dict = field(default_factory=dict)  # step -> {rank: rows per layer}
    window: list | None = None  # per layer, per rank: rows summed over the complete steps
    steps: int = 0  # complete steps in the window
    step_ratios: list = field(default_factory=list)  # per complete step: sum_l mean / sum_l max
    last: list | None = None  # per layer: (mean, max) of the last complete step

    def add(self, rank: int, step: int, rows: tuple[int, ...]) -> None:
        got = self.pending.setdefault(step, {})
        got[rank] = rows
        if len(got) < self.dp_size:
            return
        del self.pending[step]
        per_layer = list(zip(*(got[r] for r in range(self.dp_size))))  # [layer][rank]
        if self.window is None:
            self.window = [[0] * self.dp_size for _ in per_layer]
        for acc, now in zip(self.window, per_layer):
            for r, n in enumerate(now):
                acc[r] += n
        self.last = [(sum(v) / len(v), max(v)) for v in per_layer]
        total_max = sum(m for _, m in self.last)
        if total_max:
            self.step_ratios.append(sum(m for m, _ in self.last) / total_max)
        self.steps += 1

    def layer_balance(self) -> list[float]:
        """Per MoE layer over the window: mean rows per rank / max rows per rank (1.0 where no row ran)."""
        if self.window is None:
            return []
        return [(sum(v) / len(v)) / max(v) if max(v) else 1.0 for v in self.window]

    def summary(self) -> dict:
        ratios = sorted(self.step_ratios)
        rows = [sum(v) for v in self.window] if self.window else []
        return {
            "steps": self.steps,
            "rows_per_rank_per_step": (sum(rows) / len(rows) / self.dp_size / self.steps) if self.steps else 0.0,
            "layer_balance": self.layer_balance(),
            "window_balance": min(self.layer_balance(), default=1.0),
            "step_balance_p50": ratios[len(ratios) // 2] if ratios else 1.0,
            "step_balance_p10": ratios[len(ratios) // 10] if ratios else 1.0,
        }


class DPClient:
    def __init__(
        self,
        args: EngineArgs,
        policy: str = "balance",
        slack: int = 8,
        uniform_routing: bool = False,
        group_timeout_s: float = 60.0,
        ready_timeout_s: float = 600.0,
        poll_s: float = 0.005,
        kill_after_s: float = 2.0,
        rank_threads: int | None = None,
    ):
        """Spawn ``args.data_parallel_size`` ranks and wait until each has built its engine. ``policy``, ``slack``:
        the router's (``dp_router.DPRouter``). ``uniform_routing``: EP ranks route uniformly (a balance reference:
        changes the outputs). ``group_timeout_s``: a collective waiting longer fails its rank (and so the group).
        ``rank_threads``: each rank's torch threads (None: the CPUs shared out)."""
        self.args = args
        self.dp_size = args.data_parallel_size
        self.expert_parallel = args.enable_expert_parallel and self.dp_size > 1
        self.poll_s, self.kill_after_s = poll_s, kill_after_s
        self.dead: str | None = None
        remote = []  # the other nodes' ranks (dp_transport.RemoteRank), connected before this node's start
        if args.nnodes > 1:
            from .dp_transport import WorldMismatch, accept_remote_ranks

            try:
                remote = accept_remote_ranks(args, ready_timeout_s)
            except WorldMismatch as e:
                raise EngineDeadError(str(e)) from None
        tp = args.tensor_parallel_size  # 1 on several nodes (args: TP stays within one)
        world = self.dp_size * tp
        local = args.dp_ranks_of_node()  # one node: every rank
        threads = rank_threads or rank_threads_default(len(local) * tp)
        # the world of every rank (TP workers too): one node, the flags' address and port, else a free loopback port;
        # several, node 0's address and --master-port
        rdv = Rendezvous(args.master_addr or "127.0.0.1", args.master_port or 0, args.nnodes, args.node_rank)
        rdv = rdv.resolved()
        pipes = [mp.get_context("spawn").Pipe() for _ in local]
        per_rank = [(self.dp_size, args, theirs, uniform_routing, group_timeout_s, threads) for _, theirs in pipes]
        self.engram_store = EngramStore.for_children()  # the ranks' one copy of the host Engram tables
        # not daemonic: a rank with TP workers spawns them (its death pipe, not the daemon flag, ends it with us)
        with spawning(self.engram_store):
            self.ranks = RankProcesses.spawn(
                rank_main,
                [d * tp for d in local],
                world,
                rdv,
                per_rank,
                local_rank=lambda r: r - local.start * tp,
                daemon=False,
            )
        self.conns = [ours for ours, _ in pipes]
        for _, theirs in pipes:
            theirs.close()
        self.procs = [self.ranks.procs[d * tp] for d in local]
        self.conns += [rr.conn for rr in remote]  # ranks in order: this node's first, then the others'
        self.procs += remote
        atexit.register(self.close)
        ready = self._wait_ready(ready_timeout_s)
        if self.engram_store is not None:  # every rank maps its tables: their names can go
            self.engram_store.seal()
        first = ready[0]
        self.tokenizer, self.cfg, self.max_model_len = first.tokenizer, first.cfg, first.max_model_len
        self.default_sampling = first.default_sampling
        self.rank_args, self.model_path = first.args, first.model_path
        # validate()'s view of the cache: the smallest rank's (a request must fit wherever it is routed)
        layout = SimpleNamespace(block_size=first.block_size)
        self.kv = SimpleNamespace(layout=layout, blocks=SimpleNamespace(num_blocks=min(r.num_blocks for r in ready)))
        self.grammars = Grammars(self.tokenizer, self.cfg.vocab_size)
        self.router = DPRouter(self.dp_size, first.block_size, policy, slack)
        self.rank_loads = [RankLoad() for _ in range(self.dp_size)]
        self.ep_balance = EPBalance(self.dp_size)
        self.eplb: dict[int, object] = {}  # rank -> its last eplb.EplbReport (--enable-eplb)
        self._owner: dict[str, int] = {}  # request id -> rank, while in flight
        self._failures: list[tuple[str, str]] = []
        self._resets: dict[int, bool] = {}
        self._seq = 0
        self.messages = 0  # rank messages read (the per-step transport cost is one each)

    validate = EngineCore.validate  # reads only tokenizer, cfg, max_model_len, grammars and kv's two sizes
    _too_long = EngineCore._too_long

    # ------------------------------------------------------------------------- start and stop
    def _wait_ready(self, timeout_s: float) -> list[RankReady]:
        ready: dict[int, RankReady] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.dp_size:
            left = deadline - time.monotonic()
            waiting = [r for r in range(self.dp_size) if r not in ready]
            if left <= 0:
                self._stop_all()
                raise EngineDeadError(f"DP ranks {waiting} were not ready within {timeout_s:g} s")
            wait([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting], left)
            for r in waiting:
                msg = None
                try:
                    if self.conns[r].poll():
                        msg = self.conns[r].recv()
                except EOFError:
                    pass
                if isinstance(msg, RankReady):
                    ready[r] = msg
                elif msg is not None or not self.procs[r].is_alive():
                    self._stop_all()
                    why = msg.traceback if isinstance(msg, RankFailed) else f"exit status {self.procs[r].exitcode}"
                    raise EngineDeadError(f"DP rank {r} failed while starting: {why}")
        return [ready[r] for r in range(self.dp_size)]

    def _stop_all(self) -> None:
        """Close the ranks' death pipes (each exits at once, its TP workers after it), SIGKILL what is left after
        ``kill_after_s``; end the other nodes' ranks (their sockets shut: each sees the end and exits); then drop the
        Engram store's names (none is left to fill a table)."""
        self.ranks.reap(self.kill_after_s)
        for p in self.procs:
            if hasattr(p, "node_rank"):  # dp_transport.RemoteRank
                p.terminate()
        if self.engram_store is not None:
            self.engram_store.seal()

    def close(self) -> None:
        """Ask every rank to stop, then make sure: nothing is left running. Idempotent."""
        for c in self.conns:
            try:
                c.send(Shutdown())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + self.kill_after_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))  # a clean exit first: a rank stops its TP workers
        self._stop_all()
        for c in self.conns:
            c.close()
        self.conns = []
        atexit.unregister(self.close)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _fail(self, why: str) -> None:
        # a lost node makes its peers' collectives fail too: name the root cause first, whichever is seen first
        lost = [f"DP rank {r} of node {p.node_rank}" for r, p in enumerate(self.procs) if _lost_remote(p)]
        if lost:
            why = (
                f"{', '.join(lost)} lost (its connection closed: the node's process ended or the network failed)\n{why}"
            )
        self.dead = why
        self._stop_all()
        self._owner.clear()
        raise EngineDeadError(why)

    # ------------------------------------------------------------------------- EngineCore's calls
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params=None,
        priority: int = 0,
        cache_salt: str | None = None,
        session_id: str | None = None,
        rank: int | None = None,
    ) -> int:
        """Validate, route and send a request; returns its rank. ``rank``: pinned there."""
        if self.dead:
            raise EngineDeadError(self.dead)
        params = params if params is not None else SamplingParams()
        if request_id in self._owner:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        ids = self.validate(prompt, params)
        try:
            chosen = self.router.choose(ids, session_id, cache_salt, rank)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self._seq += 1
        text = prompt if isinstance(prompt, str) else None
        msg = AddRequest(self._seq, request_id, ids, params, priority, cache_salt, session_id, text)
        for r, c in enumerate(self.conns):
            if r == chosen:
                c.send(msg)
            elif self.expert_parallel:
                c.send(Announce(self._seq))
        self._owner[request_id] = chosen
        return chosen

    def abort_request(self, request_id: str):
        """Routed to the request's rank; its aborted output is not waited for (None, as for an unknown id)."""
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self.router.finished(rank)
            if not self.dead:
                self.conns[rank].send(Abort(request_id))
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self) -> list:
        """The outputs the ranks sent within ``poll_s`` (none: an empty list). Raises ``EngineDeadError`` when a
        rank died or failed."""
        if self.dead:
            raise EngineDeadError(self.dead)
        out = []
        for obj in wait(self.conns + [p.sentinel for p in self.procs], self.poll_s):
            if obj in self.conns:
                out += self._read(obj)
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                out += self._read(self.conns[r])  # what it sent before it went (its RankFailed)
                self._fail(f"DP rank {r} (pid {p.pid}) exited with status {p.exitcode}")
        return out

    def _read(self, conn) -> list:
        out = []
        while True:
            try:
                if not conn.poll():
                    return out
                msg = conn.recv()
            except (EOFError, OSError):
                return out
            self.messages += 1
            if isinstance(msg, RankOutputs):
                self.rank_loads[msg.rank] = msg.load
                for step, rows in msg.expert_rows:
                    self.ep_balance.add(msg.rank, step, rows)
                if msg.eplb is not None:
                    self.eplb[msg.rank] = msg.eplb
                for rid, why in msg.failed:
                    if self._owner.pop(rid, None) is not None:
                        self.router.finished(msg.rank)
                        self._failures.append((rid, why))
                for o in msg.outputs:
                    if o.request_id not in self._owner:
                        continue  # aborted here already
                    out.append(o)
                    if o.finished:
                        del self._owner[o.request_id]
                        self.router.finished(msg.rank)
            elif isinstance(msg, RankFailed):
                self._fail(f"DP rank {msg.rank} failed:\n{msg.traceback}")
            elif isinstance(msg, ResetDone):
                self._resets[msg.rank] = msg.ok

    def pop_failures(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests a rank refused since the last call."""
        out, self._failures = self._failures, []
        return out

    def reset_prefix_cache(self) -> bool:
        """Every rank's prefix cache emptied; False while requests run."""
        if self._owner or self.dead:
            return False
        self._resets: dict[int, bool] = {}
        for c in self.conns:
            c.send(ResetPrefixCache())
        deadline = time.monotonic() + 60
        while len(self._resets) < self.dp_size and time.monotonic() < deadline:
            self.step()
        return len(self._resets) == self.dp_size and all(self._resets.values())

    # ------------------------------------------------------------------------- load
    def prefix_hit_rate(self, rank: int | None = None) -> float:
        loads = self.rank_loads if rank is None else [self.rank_loads[rank]]
        q = sum(x.prefix_query_tokens for x in loads)
        return sum(x.prefix_hit_tokens for x in loads) / q if q else 0.0
