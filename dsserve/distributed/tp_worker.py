"""The tensor-parallel process model of one engine: TP rank 0 is the engine's own process, ranks 1..T-1 are workers.

``start_tensor_parallel(args)`` (rank 0, from ``EngineCore``) spawns the workers (``launch.RankProcesses``), joins the
world as rank 0 and builds the TP group. Each worker (``run_worker``) joins the same world, builds the same
``EngineCore`` on its ``TPRank`` (the same model with the TP pass, or its share of a checkpoint through
``load_release``'s ``ParallelLayout``; the same ``ModelRunner``, its own paged KV of the same shape), then loops:
receive a ``StepMessage`` on its pipe, apply it to its mirror of the requests, run the step, until ``stop`` or its
parent's end. Its logits are dropped: rank 0 samples.

Under data parallel (``dp_size`` > 1: a DP rank's engine core, ``distributed.dp_rank``) the world is dp_size x T
ranks, rank = dp_rank * T + tp_rank (``groups.ParallelGroups``): each DP rank's core starts its own T - 1 workers at
the same rendezvous, and every rank builds the TP groups and the EP groups across the replicas; with expert
parallelism every rank's MoE layers are spread over its EP group before the TP pass cuts what they keep.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import torch

from .groups import ParallelGroups, init_world, new_groups
from .launch import RankProcesses, Rendezvous, report_and_exit

log = logging.getLogger("dsserve")
# Joining the world waits for every rank's start (a spawned interpreter importing torch: seconds, minutes on a busy
# host); the collectives then run on the TP group with the executor's shorter timeout.
RENDEZVOUS_TIMEOUT_S = 600.0


@dataclass
class TPRank:
    """This process's place in its engine's TP group."""

    groups: ParallelGroups
    conns: list[Connection]  # rank 0: the control pipes to ranks 1..T-1; a worker: none
    procs: RankProcesses | None = None  # rank 0: the workers
    threads_before: int = 0  # rank 0: this process's torch threads before it took its share of the CPU
    env_before: dict | None = None  # rank 0: the rendezvous variables before it set its own
    expert_parallel: bool = False  # the routed experts spread over the EP group (dp_size > 1)
    ctrl: object | None = None  # the EP group's gloo twin (the DP lockstep's control group); None: dp_size 1

    def leave(self) -> None:
        """Rank 0, after its workers are reaped: leave the world (a later engine in this process may start
        another) and take back the CPU threads."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before:
            torch.set_num_threads(self.threads_before)
        for k, v in (self.env_before or {}).items():  # a later world must not meet at this one's port
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    @property
    def rank(self) -> int:
        return self.groups.tp_rank

    @property
    def size(self) -> int:
        return self.groups.tp_size

    def layout(self):
        from .layout import ParallelLayout

        g = self.groups
        if self.expert_parallel:
            return ParallelLayout(tp_rank=g.tp_rank, tp_size=g.tp_size, ep_rank=g.dp_rank, ep_size=g.dp_size)
        return ParallelLayout(tp_rank=g.tp_rank, tp_size=g.tp_size)

    def load_kwargs(self) -> dict:
        """``load_model``'s share of a checkpoint for this rank: its layout and the groups the passes close over."""
        return {
            "layout": self.layout(),
            "tp_group": self.groups.tp,
            "ep_group": self.groups.ep if self.expert_parallel else None,
        }

    def shard(self, model):
        """This rank's share of a built model: expert parallel over the EP group first (it replaces the MoE modules),
        then the TP pass (it cuts what they kept)."""
        from .tensor_parallel import shard_tensor_parallel

        g = self.groups
        if self.expert_parallel:
            from .expert_parallel import shard_expert_parallel

            model = shard_expert_parallel(model, g.dp_rank, g.dp_size, g.ep)
        return shard_tensor_parallel(model, g.tp_rank, g.tp_size, g.tp)

    def share_draft_inputs(
        self, last_tokens: torch.Tensor | None, positions: torch.Tensor | None, n: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A speculative step's proposal inputs (``Drafter.inputs``: n tokens and n positions) from TP rank 0 to every
        rank of its group, in one broadcast (rank 0 passes them, a worker None): under NCCL the tensors stay on the
        device, so rank 0 does not wait for its verdict to send them."""
        import torch.distributed as dist

        group = self.groups.tp
        nccl = dist.get_backend(group) == "nccl"
        if last_tokens is None:
            buf = torch.empty(2, n, dtype=torch.long, device=device if nccl else "cpu")
        else:
            buf = torch.stack((last_tokens, positions)).long()
            buf = buf if nccl else buf.cpu()
        dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
        buf = buf.to(device, non_blocking=True)
        return buf[0], buf[1]

    def smallest(self, n: int) -> int:
        """The least ``n`` over the TP ranks (a collective): every rank sizes its cache alike."""
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.long)
        if dist.get_backend(self.groups.tp) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, dist.ReduceOp.MIN, group=self.groups.tp)
        return int(t.item())


def _world_backend(args) -> str:
    return "gloo" if args.device == "cpu" or not torch.cuda.is_available() else "auto"


def _threads(args, world: int) -> int:
    """On the CPU the ranks share the host's cores: each takes its share (oversubscribed ranks slow every
    collective's slowest member). Returns the threads before (0: unchanged)."""
    before = torch.get_num_threads()
    if args.device == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        return before
    return 0


def _join(args, dp_size: int, timeout_s: float) -> tuple[ParallelGroups, object]:
    """Join the world (this process's environment holds the rendezvous) and build its groups, every rank alike (the
    groups' construction is a collective over the world). Returns the groups and the EP group's gloo twin for host
    control (the EP group itself on gloo; None with one DP rank)."""
    import torch.distributed as dist

    tp = args.tensor_parallel_size
    init_world(_world_backend(args), timeout_s=max(RENDEZVOUS_TIMEOUT_S, timeout_s))
    groups = new_groups(tp, dp_size, timeout_s=timeout_s)
    ctrl = groups.ep
    if dp_size > 1 and dist.get_backend() != "gloo":  # host-side control on a gloo twin (vLLM's CPU group)
        ctrl = new_groups(tp, dp_size, backend="gloo", timeout_s=timeout_s).ep
    return groups, ctrl


def start_tensor_parallel(
    args,
    dp_rank: int = 0,
    dp_size: int = 1,
    expert_parallel: bool = False,
    rendezvous: Rendezvous | None = None,
    timeout_s: float | None = None,
) -> TPRank:
    """Rank 0's side of one engine: spawn TP ranks 1..T-1 of this node, join the world, build the groups. Under data
    parallel (``dp_size`` > 1) this engine is DP rank ``dp_rank``'s core, global rank ``dp_rank * T``, and every DP
    rank meets at the same ``rendezvous``; ``expert_parallel``: the routed experts spread over the DP ranks (each TP
    index's EP group). ``timeout_s``: the groups' (default ``DSSERVE_DIST_TIMEOUT_S``)."""
    from ..engine.executor import dist_timeout_s

    tp = args.tensor_parallel_size
    timeout_s = timeout_s or dist_timeout_s()
    rdv = Rendezvous.from_env(args.master_addr, args.master_port, args.nnodes, args.node_rank)
    if rdv.nnodes > 1:
        raise NotImplementedError(
            "tensor parallel across nodes: the step messages travel on pipes of one host; run TP within a node "
            "(--nnodes is for data-parallel replicas)"
        )
    if rendezvous is None and dp_size > 1:
        raise ValueError("a DP rank's TP group needs the rendezvous every DP rank meets at")
    # one node: the flags' address and port, else a free loopback port (never an earlier world's, left in the env)
    rdv = (rendezvous or Rendezvous(args.master_addr or "127.0.0.1", args.master_port or 0)).resolved()
    world, first = tp * dp_size, dp_rank * tp
    ctx = torch.multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, tp)]
    ranks = list(range(first + 1, first + tp))
    procs = RankProcesses.spawn(
        run_worker, ranks, world, rdv, [(args, r, dp_size, expert_parallel, timeout_s) for r, _ in pipes]
    )
    conns = []
    for r, w in pipes:
        r.close()
        conns.append(w)
    procs.watch(_worker_died_while_starting)  # until the executor takes the watch over
    try:
        env = rdv.env(first, world, first)
        env_before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        before = _threads(args, world)
        groups, ctrl = _join(args, dp_size, timeout_s)
    except BaseException:
        procs.reap(0)
        raise
    log.info("tensor parallel: %d ranks (DP rank %d of %d), workers %s", tp, dp_rank, dp_size, procs.pids)
    return TPRank(groups, conns, procs, before, env_before, expert_parallel and dp_size > 1, ctrl)


def _worker_died_while_starting(rank: int, pid: int, code: int | None) -> None:
    """A TP worker gone before the engine runs: rank 0 is blocked in the rendezvous or a start-up collective (the
    KV sizing), which would only give up at their timeouts (minutes). Fail-stop now: the reason on stderr, exit 1
    (the other workers follow through their death pipes; under DP the front end sees this rank die)."""
    print(
        f"TP worker rank {rank} (pid {pid}) exited with status {code} while the engine was starting: stopping",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def run_worker(
    rank: int, args, conn: Connection, dp_size: int = 1, expert_parallel: bool = False, timeout_s: float | None = None
) -> None:
    """A TP worker (a spawned process; its environment holds the rendezvous): the engine's model and cache on this
    rank, stepped by rank 0's messages. Any error ends the process with status 1 and its traceback on stderr."""
    try:
        from ..engine.core import EngineCore
        from ..engine.executor import dist_timeout_s

        _threads(args, args.tensor_parallel_size * dp_size)
        groups, ctrl = _join(args, dp_size, timeout_s or dist_timeout_s())
        if args.device != "cpu" and torch.cuda.is_available():
            args = replace(args, device=f"cuda:{torch.cuda.current_device()}")
        me = TPRank(groups, [], expert_parallel=expert_parallel and dp_size > 1, ctrl=ctrl)
        core = EngineCore(replace(args, warmup=False), tp_rank=me)
        serve_steps(core, conn)
    except BaseException:
        report_and_exit(f"TP worker rank {rank} failed")
    os._exit(0)  # no teardown of a world whose rank 0 may be gone


@torch.no_grad()
def serve_steps(core, conn: Connection) -> None:
    from ..engine import warmup
    from ..engine.executor import DraftPass, Settle, StepMessage

    mirror = Mirror(core.kv)
    while True:
        msg: StepMessage | None = _receive(conn)
        if msg is None or msg.stop:
            return
        if msg.idle:  # a DP peer forwards while this replica has no rows: join its MoE layers' collectives
            from .expert_parallel import idle_forward

            idle_forward(core.model)
            continue
        if msg.idle_draft:  # a DEP peer drafts while this replica has nothing to: join its draft MoE's collectives
            from .expert_parallel import idle_draft

            idle_draft(core.model)
            continue
        if msg.audit:
            audit(core, mirror)
            continue
        r = core.runner
        graphs = [g for g in (r.decoder_row_graphs, r.encoder_graphs, r.verify_graphs) if g is not None]
        warmup.ahead(r.decode_graphs, graphs, msg.ahead_rows)
        plan = mirror.apply(msg)
        if not msg.speculative:
            r.execute(plan)
            continue
        core.drafter.before(plan)
        r.execute(plan)
        core.drafter.ingest(plan, r.last_forward)  # the same rows into the rings as rank 0's
        draft = _receive_due(conn, DraftPass)  # once rank 0 has its verdict on the device
        if draft is None:
            return
        if draft.proposers:  # joins the pass; its drafts are dropped
            n, dev = len(draft.proposers), core.model.embed.weight.device
            ys, ps = core.tp.share_draft_inputs(None, None, n, dev)
            core.drafter.propose([mirror.requests[rid] for rid in draft.proposers], ys, ps)
        settle = _receive_due(conn, Settle)  # once rank 0 has read the verdict
        if settle is None:
            return
        accepted = {rid: list(t) for rid, t in settle.accepted}
        core.drafter.settle(plan, accepted)  # the same rollback as rank 0's
        mirror.accept(accepted)


def _receive_due(conn: Connection, kind: type):
    """The message of ``kind`` a speculative step sends next, or None when rank 0 is gone or stops."""
    msg = _receive(conn)
    if msg is None or getattr(msg, "stop", False):
        return None
    if not isinstance(msg, kind):
        raise RuntimeError(f"a speculative step's {kind.__name__} was due, rank 0 sent {type(msg).__name__}")
    return msg


def _receive(conn: Connection):
    """The next message, or None when rank 0 is gone."""
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        return None


class Mirror:
    """A worker's copy of rank 0's requests: tokens, progress, sequences over this rank's cache."""

    def __init__(self, cache):
        self.cache = cache
        self.requests = {}
        # rank 0's scheduler owns the block ids: this rank's pool counts none, so the blocks a rollback cuts from a
        # table (SequenceKV.rollback) go back to rank 0's pool only
        cache.blocks.free = _owned_by_rank_0

    def apply(self, msg):
        from ..engine.request import Request
        from ..engine.sampling_params import SamplingParams
        from ..engine.scheduler import ScheduledChunk, StepPlan

        for rid in msg.forgotten:
            self.requests.pop(rid, None)
        for rid in msg.released:
            r = self.requests[rid]
            r.kv, r.decoder_start, r.draft_state = None, None, None
        for n in msg.new:
            params = SamplingParams(max_tokens=1, prompt_logprobs=n.prompt_logprobs)
            self.requests[n.request_id] = Request(n.request_id, list(n.prompt_token_ids), params)
        chunks = []
        for c in msg.chunks:
            r = self.requests[c.request_id]
            r.output_token_ids.extend(c.output_tokens)
            if c.seq is not None:
                r.kv, r.decoder_start, r.draft_state = c.seq.build(self.cache), c.seq.decoder_start, None
            r.kv.block_table.extend(c.new_blocks)
            if r.kv.num_tokens != c.start:
                raise RuntimeError(
                    f"request {c.request_id}: this rank's sequence is at {r.kv.num_tokens} tokens, rank 0 runs it "
                    f"from {c.start} (the mirror is out of step)"
                )
            r.num_computed_tokens = c.start
            chunks.append(ScheduledChunk(r, c.rows, list(c.draft_token_ids)))
        return StepPlan(chunks, [])

    def accept(self, accepted: dict[str, list[int]]) -> None:
        """A speculative step's verdict, as rank 0's ``Scheduler.update`` applies it: the tokens appended (the
        drafter's rollback already set each sequence's rows)."""
        for rid, tokens in accepted.items():
            self.requests[rid].output_token_ids.extend(tokens)


def _owned_by_rank_0(ids, hold_until=None) -> None:
    pass


def sequence_state(r) -> dict:
    """What request ``r``'s caches hold on this rank, every kind (tokens, blocks, global entries and their pool rows,
    the window ring's rows and tags, compressor carries and pending rows, the Engram lookback, the DSpark rings): the
    TP ranks' audit compares them (``TPExecutor.audit``, a test's check). Tensors on the host."""
    kv, out = r.kv, {"tokens": list(r.all_token_ids)}
    if kv is None:
        return out
    c, lay, cpu = kv.cache, kv.cache.layout, _host
    out.update(num_tokens=kv.num_tokens, published=kv.published_until, blocks=list(kv.block_table))
    out["engram"] = cpu(kv.engram_history)
    for src in lay.sources:
        n = kv.num_entries(src)
        out[f"entries {src}"] = n
        if n:
            rows = kv.entry_rows(src, 0, n).cpu()
            out[f"main {src}"] = c.main[src].view(-1, c.main[src].shape[-1]).cpu()[rows]
            if src in c.index:
                out[f"index {src}"] = c.index[src].view(-1, c.index[src].shape[-1]).cpu()[rows]
        carried = kv.carried.get(src, 0)
        if carried and src in c._carry:
            out[f"carry {src}"] = tuple(cpu(t[kv.slot, :carried]) for t in c._carry[src])
    for key, state in kv._pending.items():  # the reference path's rows (u, z, first), or a fixed-shape ring's span
        rows = isinstance(state, tuple)
        out[f"pending {key}"] = tuple(map(cpu, state)) if rows else (state.first, state.ring, state.ratio)
    if not lay.window_in_blocks:
        for i in c.window:
            out[f"window {i}"] = (cpu(c.window[i][kv.slot]), cpu(c.window_pos[i][kv.slot]))
    ds = r.draft_state
    if ds is not None:
        out["draft"] = (ds.last_position, [cpu(k) for k in ds.keys], [cpu(p) for p in ds.positions])
    return out


def _host(t):
    return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t


def audit(core, mirror: Mirror) -> None:
    """A worker's side of ``TPExecutor.audit``: its mirror's ``sequence_state``s to rank 0 (a gather on the TP
    group)."""
    import torch.distributed as dist

    states = {rid: sequence_state(r) for rid, r in mirror.requests.items()}
    dist.gather_object(states, None, dst=dist.get_global_rank(core.tp.groups.tp, 0), group=core.tp.groups.tp)
