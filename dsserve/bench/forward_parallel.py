"""``dsserve bench forward -tp T`` / ``-dp D [--enable-expert-parallel]``: the exact batch on every rank, in lockstep.

The bench spawns the world's T x D ranks (``launch.RankProcesses``; rank = dp_rank * T + tp_rank, the groups of
``groups.new_groups``). Each builds its engine core as a serving rank does: a TP rank the TP pass over its group, a
DP rank ``dp_rank.build_rank_core`` (with expert parallelism: its routed experts over the EP group). Every rank gets
the same batch (B requests at context C, N new rows: ``forward.bench_forward``'s, from the same seed) and runs the
step itself (no control messages: the ranks of a serving TP group run the step rank 0 sends them). Each repeat starts
after a barrier on a gloo group of the whole world and ends when the rank's device is done. A deployment's step takes
as long as its slowest rank: ``seconds`` is the median over repeats of the max over ranks; tokens/s counts every
replica's rows (D x B x N) over it. On GPUs the same code runs NCCL, rank r on ``cuda:r``.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection, wait

import torch

from ..engine.args import EngineArgs
from ..engine.executor import EngineDeadError
from .forward import ForwardResult, bench_forward

# Joining the world waits for every rank's interpreter to start and import torch (seconds; minutes on a busy host).
START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class BatchSpec:
    batch: int
    contexts: tuple[int, ...]
    new_tokens: int
    repeats: int


@dataclass
class ParallelForwardResult:
    batch: int
    context: int
    new_tokens: int
    tensor_parallel_size: int
    data_parallel_size: int
    expert_parallel: bool
    seconds: float  # median over the repeats of the slowest rank's time
    rank_seconds: list  # per global rank: its median over the repeats
    mean_seconds: float  # mean over the ranks of rank_seconds
    tokens_per_s: float  # every replica's rows (D x B x N) / seconds
    ranks: list  # per global rank: its ForwardResult (stages, every repeat's time)

    @classmethod
    def of(cls, args: EngineArgs, per_rank: list[ForwardResult]) -> "ParallelForwardResult":
        first = per_rank[0]
        repeats = len(first.times)
        slowest = sorted(max(r.times[i] for r in per_rank) for i in range(repeats))
        seconds = slowest[len(slowest) // 2]
        dp = args.data_parallel_size
        return cls(
            first.batch,
            first.context,
            first.new_tokens,
            args.tensor_parallel_size,
            dp,
            args.enable_expert_parallel and dp > 1,
            seconds,
            [r.seconds for r in per_rank],
            sum(r.seconds for r in per_rank) / len(per_rank),
            dp * first.batch * first.new_tokens / seconds,
            [asdict(r) for r in per_rank],
        )


class _NoWorkers:
    """The worker processes of a TP rank 0 that spawned none (the bench spawned every rank): nothing to watch."""

    def watch(self, on_death) -> None:
        pass

    def reap(self, timeout: float = 0.0) -> dict:
        return {}


def _rank_core(args: EngineArgs, groups):
    """This rank's engine core, built as a serving rank builds it; its executor runs the step here only."""
    from ..distributed.dp_rank import build_rank_core, rank_args
    from ..distributed.tp_worker import TPRank
    from ..engine.core import EngineCore
    from ..engine.executor import LocalExecutor

    if args.data_parallel_size > 1 and args.tensor_parallel_size == 1:
        ep = groups.ep if args.enable_expert_parallel else None
        return build_rank_core(args, groups.dp_rank, args.data_parallel_size, ep)
    # TP (inside DP ranks too): every rank a TP rank of its replica; with EP, TPRank.shard cuts experts, then TP
    ep = args.enable_expert_parallel and args.data_parallel_size > 1
    me = TPRank(groups, [], procs=_NoWorkers(), expert_parallel=ep)
    core = EngineCore(replace(rank_args(args, ep), warmup=False), tp_rank=me)
    core.executor = LocalExecutor(core.runner)  # rank 0 sends no step: every rank runs the batch itself
    return core


def bench_rank(rank: int, args: EngineArgs, spec: BatchSpec, conn: Connection) -> None:
    """A spawned rank (its environment holds the rendezvous): join the world, build, time, send its results."""
    from ..distributed.groups import init_world, new_groups
    from ..distributed.launch import report_and_exit
    from ..engine.executor import dist_timeout_s

    try:
        import torch.distributed as dist

        tp, dp = args.tensor_parallel_size, args.data_parallel_size
        world = tp * dp
        cpu = args.device == "cpu" or not torch.cuda.is_available()
        if cpu:  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        init_world("gloo" if cpu else "auto", timeout_s=max(START_TIMEOUT_S, dist_timeout_s()))
        groups = new_groups(tp, dp, timeout_s=dist_timeout_s())
        ctrl = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=dist_timeout_s()))
        if not cpu:
            args = replace(args, device=f"cuda:{torch.cuda.current_device()}")
        core = _rank_core(args, groups)
        with torch.no_grad():
            results = [
                bench_forward(core, spec.batch, c, spec.new_tokens, spec.repeats, lambda: dist.barrier(group=ctrl))
                for c in spec.contexts
            ]
        dist.barrier(group=ctrl)  # no rank leaves while a peer may still be inside a collective
        conn.send((rank, core.cfg.name, results))
    except BaseException:
        report_and_exit(f"bench forward: rank {rank} failed")
    os._exit(0)  # no teardown of a world whose peers may already be gone


def bench_parallel(args: EngineArgs, spec: BatchSpec) -> tuple[str, list[ParallelForwardResult]]:
    """Spawn the world's ranks on this host, time ``spec`` on each; returns (model name, one result per context).
    A rank that fails ends the run with ``EngineDeadError`` (its traceback is on stderr), the others killed."""
    from ..distributed.launch import RankProcesses, Rendezvous

    if args.nnodes > 1:
        raise EngineDeadError("bench forward runs on one node: --nnodes must be 1")
    world = args.tensor_parallel_size * args.data_parallel_size
    gpus = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 0
    if gpus and world > gpus:  # one rank a GPU: with fewer, some ranks would pick NCCL and others gloo
        raise EngineDeadError(f"bench forward: {world} ranks need {world} GPUs, this host has {gpus} (or --device cpu)")
    rdv = Rendezvous(args.master_addr or "127.0.0.1", args.master_port or 0).resolved()
    ctx = torch.multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = RankProcesses.spawn(bench_rank, list(range(world)), world, rdv, [(args, spec, w) for _, w in pipes])
    conns = {}
    for rank, (r, w) in enumerate(pipes):
        w.close()
        conns[rank] = r
    got: dict[int, list[ForwardResult]] = {}
    name = ""
    deadline = time.monotonic() + START_TIMEOUT_S + 60 * len(spec.contexts) * (spec.repeats + 1)
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError(f"bench forward: ranks {sorted(set(conns) - set(got))} sent nothing in time")
            waiting = [r for r in conns if r not in got]
            wait([conns[r] for r in waiting] + [procs.procs[r].sentinel for r in waiting], left)
            for r in waiting:
                try:
                    if conns[r].poll():
                        rank, name, results = conns[r].recv()
                        got[rank] = results
                        continue
                except EOFError:  # it exited without sending
                    pass
                p = procs.procs[r]
                if not p.is_alive():
                    p.join(1.0)
                    raise EngineDeadError(f"bench forward: rank {r} (pid {p.pid}) exited with status {p.exitcode}")
    finally:
        procs.reap(timeout=10.0 if len(got) == world else 1.0)
        for c in conns.values():
            c.close()
    per_context = zip(*(got[r] for r in range(world)))
    return name, [ParallelForwardResult.of(args, list(rs)) for rs in per_context]


def run_bench_forward_parallel(ns, args: EngineArgs) -> int:
    from rich.console import Console
    from rich.table import Table

    spec = BatchSpec(ns.batch, tuple(ns.context), ns.new_tokens, ns.repeats)
    try:
        name, results = bench_parallel(args, spec)
    except EngineDeadError as e:
        print(f"error: {e}")
        return 1
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    world = tp * dp
    dp_name = "DEP" if args.enable_expert_parallel else "DP"
    shape = " x ".join(([f"TP {tp}"] if tp > 1 else []) + ([f"{dp_name} {dp}"] if dp > 1 else []))
    t = Table(
        title=f"bench forward: {name}, {shape}, batch {ns.batch} per {'replica' if dp > 1 else 'rank'}, new tokens "
        f"{ns.new_tokens}, {args.dtype}, {'CUDA' if torch.cuda.is_available() and args.device != 'cpu' else 'CPU'}"
    )
    # per-rank columns: each rank's median ms/step; max: the slowest rank per repeat (the deployment's step)
    for col in ("context", *(f"rank {r}" for r in range(world)), "max ms", "mean ms", "tok/s (all ranks)"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(
            str(r.context),
            *(f"{s * 1e3:.1f}" for s in r.rank_seconds),
            f"{r.seconds * 1e3:.1f}",
            f"{r.mean_seconds * 1e3:.1f}",
            f"{r.tokens_per_s:,.0f}",
        )
    Console(width=max(Console().width, 150)).print(t)
    print(json.dumps({"bench": "forward", "model": name, "results": [asdict(r) for r in results]}))
    return 0
