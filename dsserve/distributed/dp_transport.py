"""Data-parallel ranks on other nodes: a socket in place of the pipe between the DP front end and a rank.

Node 0 runs the front end (``dp_client.DPClient``: the API server or the offline ``LLM``) and its own DP ranks; node
n > 0 runs ``serve_headless``: its ranks only (``EngineArgs.dp_ranks_of_node``), no front end. Each of node n's ranks
connects to node 0's front end (``--master-addr``, ``--data-parallel-rpc-port``; default ``--master-port`` + 1) with
``multiprocessing.connection`` (HMAC challenge on a shared authkey, then pickled ``dp_protocol`` messages: the same
messages as on a local rank's pipe), says who it is (``RankHello``), and is accepted (``Welcome``) or refused
(``Refused``: a world that does not match node 0's). With expert parallelism the ranks of every node then join one
torch.distributed world at ``--master-addr:--master-port`` (env rendezvous; world rank = DP rank).

On the front end a remote rank is a ``RemoteRank``: the process handle ``DPClient`` watches, whose end is its
connection's end (the node's process killed, its ranks gone, or the network: TCP keepalive notices a silent peer
within ~30 s), so a lost node fails the whole group as a lost local rank does (fail-stop, ``EngineDeadError``).
The connection carries pickles: keep the port on a trusted network and set ``DSSERVE_DP_AUTHKEY`` (every node the
same) so only your nodes can connect.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait

log = logging.getLogger("dsserve")
AUTHKEY_ENV = "DSSERVE_DP_AUTHKEY"
# What must match between the nodes (EngineArgs fields): a rank built otherwise would compute other outputs or join
# another world.
WORLD_FIELDS = (
    "model",
    "data_parallel_size",
    "nnodes",
    "enable_expert_parallel",
    "enable_eplb",
    "num_redundant_experts",
    "dtype",
    "block_size",
    "master_port",
    "seed",
)
CONNECT_TIMEOUT_S = 600.0  # a node may start long before node 0 (or after it): as long as the ready timeout


def rank_threads_default(local_ranks: int) -> int:
    """A rank's torch threads: ``OMP_NUM_THREADS`` when set, else this host's CPUs shared out among its ranks."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else max(1, (os.cpu_count() or 1) // local_ranks)


def authkey() -> bytes:
    return os.environ.get(AUTHKEY_ENV, "dsserve-dp").encode()


def rpc_address(args) -> tuple[str, int]:
    return args.master_addr or "127.0.0.1", args.data_parallel_rpc_port or args.master_port + 1


def world_of(args) -> dict:
    return {f: getattr(args, f) for f in WORLD_FIELDS}


# ----------------------------------------------------------------------------- handshake messages
@dataclass(frozen=True)
class RankHello:
    """A remote rank's first message: its global DP rank, node, pid and the world it was started for."""

    rank: int
    node_rank: int
    pid: int
    world: dict  # world_of(its args)


@dataclass(frozen=True)
class Welcome:
    pass


@dataclass(frozen=True)
class Refused:
    reason: str


class WorldMismatch(RuntimeError):
    """A node was started for another deployment than node 0's."""


# ----------------------------------------------------------------------------- the front end's side
class RemoteRank:
    """The handle of a rank on another node, shaped as the ``multiprocessing.Process`` handles ``DPClient`` watches:
    it is alive while its connection is open; ``terminate`` closes our side (the rank sees EOF and exits)."""

    def __init__(self, rank: int, node_rank: int, pid: int, conn: Connection):
        self.rank, self.node_rank, self.pid, self.conn = rank, node_rank, pid, conn
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))  # for peeking and shutdown only
        self.exitcode = f"unknown: its connection from node {node_rank} closed"
        self.name = f"dsserve-dp{rank}@node{node_rank}"

    @property
    def sentinel(self) -> socket.socket:
        return self._sock  # readable on a message and on the end alike (a descriptor of its own: wait() wants one)

    def is_alive(self) -> bool:
        """False once the peer closed (EOF or reset); a pending message counts as alive (read it first)."""
        if self._sock.fileno() < 0:
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def terminate(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    kill = terminate

    def join(self, timeout: float | None = None) -> None:
        """Wait for the peer's end, dropping what it still sends (only called once the front end stops it)."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while time.monotonic() < deadline:
            try:
                if self.conn.poll(min(0.05, max(0.0, deadline - time.monotonic()))):
                    self.conn.recv()
            except (EOFError, OSError):
                return


def _keepalive(conn: Connection) -> None:
    """Notice a silent peer (a node powered off, a cable pulled) in ~30 s instead of never; send each message at once
    (no Nagle delay: a step's outputs are one small write)."""
    s = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, v in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
            if hasattr(socket, opt):
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)
    finally:
        s.close()  # a dup: the connection's own descriptor stays open


class RankListener:
    """Node 0's front end: listens for the other nodes' ranks (started before the local ranks, so none is lost)."""

    def __init__(self, args):
        self.args = args
        self.expected = [r for r in range(args.data_parallel_size) if r not in args.dp_ranks_of_node()]
        try:
            self.listener = Listener(rpc_address(args), authkey=authkey())
        except OSError as e:
            host, port = rpc_address(args)
            raise WorldMismatch(f"the DP front end cannot listen on {host}:{port} (--data-parallel-rpc-port): {e}")
        self._arrived: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="dsserve-dp-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except Exception as e:  # a foreign or unauthenticated client: not one of ours, keep listening
                if self._closed:
                    return
                log.warning("DP front end: refused a connection (%s: %s)", type(e).__name__, e)
                continue
            self._arrived.put(conn)

    def accept_ranks(self, timeout_s: float) -> list[RemoteRank]:
        """The remote ranks, in rank order, once every one has said hello with node 0's world; they are welcomed
        together, so that all of them start joining the torch world at once (its rendezvous has a timeout). Raises
        ``WorldMismatch`` on a node started otherwise (it is told why too) or when they do not all arrive within
        ``timeout_s``."""
        mine = world_of(self.args)
        got: dict[int, tuple[RankHello, Connection]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < len(self.expected):
                if time.monotonic() > deadline:
                    missing = sorted(set(self.expected) - set(got))
                    host, port = rpc_address(self.args)
                    raise WorldMismatch(
                        f"DP ranks {missing} (on the other nodes) did not connect to {host}:{port} within "
                        f"{timeout_s:g} s: start `dsserve serve ... --nnodes {self.args.nnodes} --node-rank N "
                        f"--master-addr {host} --master-port {self.args.master_port}` there"
                    )
                try:
                    conn = self._arrived.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    hello = conn.recv() if conn.poll(10.0) else None
                except (EOFError, OSError):
                    hello = None
                if not isinstance(hello, RankHello):
                    conn.close()
                    continue
                diff = {k: (v, hello.world.get(k)) for k, v in mine.items() if hello.world.get(k) != v}
                if diff:
                    text = ", ".join(f"{k}={theirs!r} there, {ours!r} on node 0" for k, (ours, theirs) in diff.items())
                    reason = f"node {hello.node_rank} was started for another deployment than node 0: {text}"
                    conn.send(Refused(reason))
                    conn.close()
                    raise WorldMismatch(reason)
                if hello.rank not in self.expected or hello.rank in got:
                    conn.send(Refused(f"DP rank {hello.rank} is not expected from another node (or came twice)"))
                    conn.close()
                    continue
                got[hello.rank] = (hello, conn)
            for _, conn in got.values():
                conn.send(Welcome())
                _keepalive(conn)
        except BaseException:
            for _, conn in got.values():
                try:
                    conn.send(Refused("node 0 stopped while the nodes were joining"))
                except OSError:
                    pass
                conn.close()
            raise
        finally:
            self.close()  # the world is complete (or failed): later connections are refused by the OS
        out = []
        for r in self.expected:
            hello, conn = got[r]
            out.append(RemoteRank(r, hello.node_rank, hello.pid, conn))
            log.info("DP rank %d of node %d (pid %d) connected", r, hello.node_rank, hello.pid)
        return out

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass
        while not self._arrived.empty():  # connected but never answered: they see EOF, not a wait for ever
            self._arrived.get().close()


def accept_remote_ranks(args, timeout_s: float) -> list[RemoteRank]:
    """Node 0's front end: the other nodes' ranks (``args.dp_ranks_of_node()`` are this node's), connected and
    welcomed, in rank order."""
    if args.node_rank != 0:
        raise WorldMismatch(
            f"node_rank={args.node_rank}: node 0 runs the front end; the other nodes run their ranks headless "
            "(`dsserve serve ... --headless`, or dp_transport.serve_headless)"
        )
    return RankListener(args).accept_ranks(timeout_s)


# ----------------------------------------------------------------------------- node n > 0
def connect(args, rank: int, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
    """Rank ``rank``'s connection to node 0's front end, accepted (retries until it listens). Raises
    ``WorldMismatch`` with node 0's reason when refused."""
    addr = rpc_address(args)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = Client(addr, authkey=authkey())
            break
        except (ConnectionRefusedError, ConnectionResetError, FileNotFoundError, socket.timeout) as e:
            if time.monotonic() > deadline:
                raise WorldMismatch(
                    f"node 0's DP front end at {addr[0]}:{addr[1]} did not answer in {timeout_s:g} s: {e}"
                )
            time.sleep(0.5)
    conn.send(RankHello(rank, args.node_rank, os.getpid(), world_of(args)))
    answer = conn.recv()
    if isinstance(answer, Refused):
        conn.close()
        raise WorldMismatch(answer.reason)
    _keepalive(conn)
    return conn


def watch_front_end(conn: Connection) -> None:
    """In a remote rank: exit as soon as node 0's end of ``conn`` closes, whatever the rank is doing (joining the
    world, building, inside a collective): the remote twin of a local rank's ``PR_SET_PDEATHSIG``. It peeks only, so
    the rank's own reads are untouched."""
    import select

    sock = socket.socket(fileno=os.dup(conn.fileno()))

    def run():
        while True:
            select.select([sock], [], [])
            try:
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    os._exit(0)
            except OSError:
                os._exit(0)
            time.sleep(0.2)  # a message the rank has not read yet: look again later

    threading.Thread(target=run, name="dsserve-front-end-watch", daemon=True).start()


def remote_rank_main(rank: int, args, uniform_routing: bool, group_timeout_s: float, threads: int):
    """A spawned rank of node n > 0 (``launch.RankProcesses`` set its rendezvous): connect to node 0, then serve as a
    local rank does (``dp_rank.rank_main``) over the socket."""
    from .dp_rank import rank_main

    try:
        conn = connect(args, rank)
    except WorldMismatch as e:
        print(f"dsserve: DP rank {rank}: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except Exception as e:
        print(f"dsserve: DP rank {rank} could not reach node 0: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    watch_front_end(conn)
    rank_main(rank, args.data_parallel_size, args, conn, uniform_routing, group_timeout_s, threads)


def serve_headless(args, uniform_routing: bool = False, group_timeout_s: float = 60.0) -> int:
    """Node ``args.node_rank`` > 0: run its DP ranks for node 0's front end until it goes away. Returns the exit
    status: 0 when the front end closed (every rank saw EOF), else non-zero (a rank failed: the others are stopped)."""
    from .launch import RankProcesses, Rendezvous

    if args.node_rank == 0:
        raise WorldMismatch("node 0 runs the front end: --headless is for the other nodes (--node-rank > 0)")
    ranks = list(args.dp_ranks_of_node())
    threads = rank_threads_default(len(ranks))
    rdv = Rendezvous(args.master_addr or "127.0.0.1", args.master_port, args.nnodes, args.node_rank)
    procs = RankProcesses.spawn(
        remote_rank_main,
        ranks,
        args.data_parallel_size,
        rdv,
        (args, uniform_routing, group_timeout_s, threads),
        local_rank=lambda r: r - ranks[0],
    )
    log.info(
        "node %d: DP ranks %s (pids %s) for the front end at %s:%d",
        args.node_rank,
        ranks,
        procs.pids,
        *rpc_address(args),
    )
    stop = threading.Event()
    # SIGINT too: under torchrun it comes from the agent, to the whole process group (server.serve.run_server)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        left = dict(procs.procs)
        while left and not stop.is_set():
            wait([p.sentinel for p in left.values()], 0.5)
            for r, p in list(left.items()):
                if p.is_alive():
                    continue
                p.join(1.0)
                del left[r]
                if p.exitcode != 0:
                    log.error(
                        "node %d: DP rank %d exited with status %s: this node stops", args.node_rank, r, p.exitcode
                    )
                    codes = procs.reap(timeout=2.0)  # its peers, told why (a refusal) or not
                    return 2 if 2 in codes.values() else 1  # 2: node 0 refused this node's world
        return 0 if not stop.is_set() else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        procs.reap(timeout=2.0)
