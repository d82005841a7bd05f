"""A data-parallel rank: one ``EngineCore`` in its own process, with its own scheduler, paged KV and prefix cache,
serving the requests the DP front end (``dp_client.DPClient``) routes to it over one pipe.

With expert parallelism (DEP: DP attention, the routed experts spread over the DP ranks by
``expert_parallel.shard_expert_parallel``) every MoE layer is a collective over the ranks, so the engine cores step
in lockstep: before each forward ``Lockstep`` all-gathers one ``StepSummary`` a rank on a gloo group; a rank with
an empty plan runs ``idle_forward`` while a peer has rows; when no rank holds a request and every rank has seen the
same announced requests, the wave ends on every rank at once and each blocks on its pipe (no collective spins while
all are idle). With DSpark drafts the drafter's MoE is expert parallel too: after the forward every rank runs as many
draft passes as the most any rank announced in its summary, ``idle_draft`` for those it has nothing to draft in.
Without expert parallelism the ranks share nothing and step on their own.

With ``tensor_parallel_size`` T > 1 a rank's core is TP rank 0 of its replica and drives T - 1 TP workers of its own
(``tp_worker.start_tensor_parallel``, the ``-tp`` engine's path): the world is dp_size x T ranks, DP rank d's core is
global rank d * T, and an idle forward goes to its workers too (``TPExecutor.idle_forward``).

A rank is spawned by ``launch.RankProcesses`` and dies with its front end (the death pipe, and EOF on its pipe); an
exception in its engine, or a TP worker's death, is sent as ``RankFailed`` and the process exits non-zero (fail-stop:
with EP its peers would wait in the next collective).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import replace

import torch

from ..engine.args import EngineArgs
from ..engine.core import EngineCore, RequestError
from ..engine.scheduler import StepPlan
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
from .eplb import Eplb
from .expert_parallel import ExpertParallelMoE, shard_expert_parallel
from .step_sync import StepSummary, StepSync


class Lockstep:
    """``EngineCore.lockstep`` of a DEP rank: one gather of the ranks' step summaries before every forward
    (``StepSync``), and an idle forward where this rank's plan is empty and a peer's is not. ``awake``: the wave is
    on (set by the rank loop when a request is announced; cleared here when the wave ends on every rank).

    With DSpark drafts (``EngineCore._step_speculative``) a rank announces one draft pass when its plan samples for
    a request without a grammar (the drafter proposes, batched over its requests, only for those), none otherwise;
    ``draft_passes`` is the most any rank announced. A rank with an empty plan joins them right after its idle
    forward; one with rows joins, after its own proposal (``after_propose``), those it did not run."""

    def __init__(self, core: EngineCore, sync: StepSync, uniform_routing: bool = False, eplb=None):
        self.core, self.sync = core, sync
        self.eplb = eplb  # distributed.eplb.Eplb (--enable-eplb): its step boundary is every joined forward's start
        self.seen = 0  # requests announced to this rank and drained from its pipe
        self.awake = False
        self.steps = self.idle_steps = 0  # forwards joined (real or idle), and of those idle ones
        self.sync_seconds = self.idle_seconds = 0.0  # in the summaries' gather, and in idle forwards
        self.moes = [b.ffn for b in core.model.layers if isinstance(b.ffn, ExpertParallelMoE)]
        mtp = core.model.mtp if core.drafter is not None else None
        self.draft_moe = mtp[0].ffn if mtp is not None and isinstance(mtp[0].ffn, ExpertParallelMoE) else None
        self.draft_passes = 0  # agreed for the current step: every rank runs this many after its forward
        self._draft_calls = 0  # the drafter's first MoE's calls at the step's start: the passes this rank ran
        self.draft_steps = self.idle_drafts = 0  # steps with draft passes, and the passes this rank joined idle
        self._rows = [m.dispatcher.rows_received for m in self.moes]
        if uniform_routing and eplb is not None:  # before the replica map and the load recorder: EPLB's own hook
            eplb.uniform_routing(seed=100_000 * eplb.rank)
        elif uniform_routing:
            for m in self.moes:
                _route_uniformly(m)

    def before_forward(self, plan: StepPlan) -> None:
        sched = self.core.scheduler
        prefill = any(c.num_tokens > 1 or not c.samples for c in plan.chunks)
        drafts = int(self.draft_moe is not None and any(c.samples and c.request.grammar is None for c in plan.chunks))
        mine = StepSummary(
            plan.num_tokens, len(plan.chunks), int(sched.has_unfinished()), int(prefill), self.seen, drafts
        )
        t0 = time.perf_counter()
        peers = self.sync.gather(mine)
        self.sync_seconds += time.perf_counter() - t0
        self.draft_passes = 0
        if StepSync.wave_done(peers):
            self.awake = False
            return
        if not any(p.num_tokens for p in peers):  # nobody forwards this step (e.g. every queue blocked on KV)
            return
        self.draft_passes = max(p.draft_passes for p in peers)
        if self.draft_moe is not None:
            self._draft_calls = self.draft_moe.calls
        self.steps += 1
        if self.eplb is not None:  # every rank at the same boundary: load window, policy, one transfer chunk
            self.eplb.step()
        if not plan.chunks:
            t0 = time.perf_counter()
            self.core.executor.idle_forward()  # under TP: on every TP rank of this replica
            self.after_propose()  # an idle rank drafts nothing: it joins its peers' draft passes now
            self.idle_seconds += time.perf_counter() - t0
            self.idle_steps += 1

    def after_propose(self) -> None:
        """Join, with zero rows, the step's agreed draft passes this rank did not run itself (the drafter's MoE
        counts its calls). A rank that ran more than it announced would leave its peers out of a collective: it
        fails instead."""
        if self.draft_moe is None:
            return
        ran = self.draft_moe.calls - self._draft_calls
        if ran > self.draft_passes:
            raise RuntimeError(
                f"this rank ran {ran} DSpark draft passes in a step, the ranks agreed on {self.draft_passes}: "
                "Lockstep.before_forward must announce every pass the drafter may run"
            )
        for _ in range(self.draft_passes - ran):
            self.core.executor.idle_draft()  # under TP: on every TP rank of this replica
        self.draft_steps += self.draft_passes > 0
        self.idle_drafts += self.draft_passes - ran
        self.draft_passes = 0

    def expert_rows(self) -> tuple[int, ...]:
        """Rows this rank's experts ran in each MoE layer since the last call."""
        now = [m.dispatcher.rows_received for m in self.moes]
        out, self._rows = tuple(a - b for a, b in zip(now, self._rows)), now
        return out


def _route_uniformly(moe: ExpertParallelMoE) -> None:
    """Replace the router's picks by top-k distinct experts drawn uniformly (the EP balance figure's reference:
    the same rows a step, perfectly spread in expectation). Changes the model's output: a measurement run only."""
    prepare = moe.dispatcher.prepare
    n = moe.dispatcher.placement.n_experts
    gen = torch.Generator().manual_seed(moe.ep_rank)

    def uniform(x, ids, w):
        t, k = ids.shape
        picks = torch.rand(t, n, generator=gen).argsort(1)[:, :k].to(ids.device)
        return prepare(x, picks, w)

    moe.dispatcher.prepare = uniform


def rank_args(args: EngineArgs, expert_parallel: bool) -> EngineArgs:
    """One rank's engine arguments: a single-device engine; under EP every forward must be one the ranks agreed on,
    so no fixed-shape runner (their dispatch would read counts inside a graph), no asynchronous step ahead and no
    warm-up forwards of its own."""
    nodes = dict(nnodes=1, node_rank=0, data_parallel_size_local=None, data_parallel_start_rank=0)
    one = replace(args, data_parallel_size=1, enable_expert_parallel=False, enable_eplb=False, **nodes)
    if expert_parallel:
        one = replace(one, async_scheduling=False, enforce_eager=True, warmup=False)
    return one


def build_rank_core(
    args: EngineArgs,
    dp_rank: int,
    dp_size: int,
    ep_group=None,
    ctrl_group=None,
    uniform_routing: bool = False,
    tp_rank=None,
) -> EngineCore:
    """The engine core of DP rank ``dp_rank``; with ``ep_group`` (an initialised world's EP group) its MoE layers
    expert-parallel over it and its steps in lockstep over ``ctrl_group`` (a gloo group; default ``ep_group``).
    ``tp_rank``: this core's ``tp_worker.TPRank`` (TP rank 0 of its replica, its workers started by
    ``start_tensor_parallel``); its groups then say whether it is expert parallel, and its TP pass does the EP cut.

    An expert-parallel rank of a checkpoint reads only its share of the files (``load_release`` with its
    ``ParallelLayout``: its routed experts, and with EPLB those of its slots under the initial placement,
    redundant ones included); a preset (no files) is built whole and cut by the pass (``shard_expert_parallel``,
    ``Eplb.shard``)."""
    if tp_rank is not None:
        ep = tp_rank.expert_parallel
        core = EngineCore(rank_args(args, ep), tp_rank=tp_rank)
        if ep:
            core.lockstep = Lockstep(core, StepSync(tp_rank.ctrl))
        return core
    from .layout import ParallelLayout

    ep = ep_group is not None
    balancer = []
    eplb_cfg = args.eplb_config() if args.enable_eplb else None
    layout = ParallelLayout(ep_rank=dp_rank, ep_size=dp_size) if eplb_cfg is None else eplb_cfg.layout(dp_rank, dp_size)

    def model_pass(m):
        read = any(isinstance(b.ffn, ExpertParallelMoE) for b in m.layers)  # the loader built this rank's share
        if eplb_cfg is None:
            return m if read else shard_expert_parallel(m, dp_rank, dp_size, ep_group)
        if read:
            eplb = Eplb(m, dp_rank, dp_size, ep_group, eplb_cfg)  # load recorders on the slots as read
        else:
            m, eplb = Eplb.shard(m, dp_rank, dp_size, ep_group, eplb_cfg)  # redundant slots, load recorders
        balancer.append(eplb)
        return m

    load = {"layout": layout, "ep_group": ep_group} if ep else None
    core = EngineCore(rank_args(args, ep), model_pass=model_pass if ep else None, load_kwargs=load)
    if ep:
        eplb = balancer[0] if balancer else None
        core.lockstep = Lockstep(core, StepSync(ctrl_group or ep_group), uniform_routing, eplb)
    return core


class RankLoop:
    """Serve the pipe: drain messages, step while there is work (with EP: while the wave is on), send outputs."""

    def __init__(self, rank: int, core: EngineCore, conn):
        self.rank, self.core, self.conn = rank, core, conn
        self.lockstep: Lockstep | None = core.lockstep
        self.eplb_version = -1  # of the last EplbReport sent
        self._sending = threading.Lock()  # the executor's watchdog reports a TP worker's death from its thread
        core.executor.on_failure(self.fail)

    def fail(self, why: str) -> None:
        """The engine cannot step again (a TP worker died): tell the front end, exit non-zero at once (the workers
        follow through their death pipes)."""
        if self._sending.acquire(timeout=2.0):
            try:
                self.conn.send(RankFailed(self.rank, why))
            except Exception:
                pass
        os._exit(1)

    def active(self) -> bool:
        return self.lockstep.awake if self.lockstep is not None else self.core.has_unfinished_requests()

    def run(self) -> None:
        failed: list = []
        while True:
            if not self.active() and not self.handle(self.conn.recv(), failed):  # blocks; EOFError: front end gone
                return
            while self.conn.poll():
                if not self.handle(self.conn.recv(), failed):
                    return
            if not self.active():
                if failed:
                    self.send([], failed)
                    failed = []
                continue
            steps = self.lockstep.steps if self.lockstep is not None else 0
            outs = self.core.step()
            rows = []
            if self.lockstep is not None and self.lockstep.steps > steps:
                rows.append((self.lockstep.steps, self.lockstep.expert_rows()))
            self.send(outs, failed, rows)
            failed = []

    def handle(self, msg, failed: list) -> bool:
        """Apply one message; False: stop."""
        if isinstance(msg, (AddRequest, Announce)) and self.lockstep is not None:
            self.lockstep.seen, self.lockstep.awake = msg.seq, True
        if isinstance(msg, AddRequest):
            try:
                req = self.core.add_request(
                    msg.request_id, msg.prompt, msg.params, msg.priority, msg.cache_salt, msg.session_id
                )
                req.prompt = msg.text
            except RequestError as e:  # validated by the front end: a race or a limit only this rank knows
                failed.append((msg.request_id, str(e)))
        elif isinstance(msg, Abort):
            self.core.abort_request(msg.request_id)
        elif isinstance(msg, ResetPrefixCache):
            done = ResetDone(self.rank, self.core.reset_prefix_cache())
            with self._sending:
                self.conn.send(done)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def send(self, outs: list, failed: list, expert_rows: list = ()) -> None:
        msg = RankOutputs(self.rank, outs, self.load(), failed, list(expert_rows), self.eplb_report())
        with self._sending:
            self.conn.send(msg)

    def eplb_report(self):
        """The EPLB figures (``eplb.EplbReport``) when they changed since the last message; None otherwise."""
        eplb = self.lockstep.eplb if self.lockstep is not None else None
        if eplb is None or eplb.version == self.eplb_version:
            return None
        self.eplb_version = eplb.version
        return eplb.report()

    def load(self) -> RankLoad:
        core, ls = self.core, self.lockstep
        sched, blocks, stats = core.scheduler, core.kv.blocks, core.stats
        return RankLoad(
            len(sched.running),
            len(sched.waiting),
            blocks.num_used,
            blocks.num_blocks,
            stats.prefix_query_tokens,
            stats.prefix_hit_tokens,
            ls.steps if ls is not None else stats.steps,
            ls.idle_steps if ls is not None else 0,
            stats.step_host_seconds + stats.step_wait_seconds,
            ls.sync_seconds if ls is not None else 0.0,
            ls.idle_seconds if ls is not None else 0.0,
            tp.seconds if (tp := getattr(core.executor, "stats", None)) is not None else 0.0,
            stats.counters(),
        )


def _told_to_stop(conn, wait_s: float = 0.1) -> bool:
    """Whether the front end has asked this rank to stop (a ``Shutdown`` waits on its pipe) or is gone."""
    deadline = time.monotonic() + wait_s
    try:
        while conn.poll(max(0.0, deadline - time.monotonic())):
            if isinstance(conn.recv(), Shutdown):
                return True
    except (EOFError, OSError):
        return True
    return False


def rank_main(
    rank: int,
    dp_size: int,
    args: EngineArgs,
    conn,
    uniform_routing: bool = False,
    group_timeout_s: float = 60.0,
    threads: int = 1,
) -> None:
    """The process target ``dp_client.DPClient`` spawns (``launch.RankProcesses``) for global rank ``rank``: DP rank
    ``rank // T`` of ``dp_size`` (T = ``tensor_parallel_size``); its environment holds the world's rendezvous (on
    another node: ``dp_transport.remote_rank_main``, ``conn`` a socket to node 0's front end)."""
    tp = args.tensor_parallel_size
    dp_rank = rank // tp
    try:
        torch.set_num_threads(threads)
        if torch.cuda.is_available():  # a GPU a rank ("auto" and "cuda" then mean this one)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        ep = args.enable_expert_parallel and dp_size > 1
        if tp > 1:  # TP rank 0 of its replica: its workers join the dp_size x T world at the same rendezvous
            from .launch import Rendezvous
            from .tp_worker import start_tensor_parallel

            env = os.environ
            rdv = Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
            me = start_tensor_parallel(rank_args(args, ep), dp_rank, dp_size, ep, rdv, group_timeout_s)
            core = build_rank_core(args, dp_rank, dp_size, tp_rank=me)
        else:
            ep_group = ctrl_group = None
            if ep:
                from .groups import init_world, new_groups

                init_world(timeout_s=group_timeout_s)
                g = new_groups(1, dp_size, timeout_s=group_timeout_s)
                ep_group = ctrl_group = g.ep
                if torch.distributed.get_backend(g.ep) != "gloo":  # host-side control on a gloo twin (vLLM's CPU group)
                    ctrl_group = new_groups(1, dp_size, backend="gloo", timeout_s=group_timeout_s).ep
            core = build_rank_core(args, dp_rank, dp_size, ep_group, ctrl_group, uniform_routing)
        if not ep:  # an independent replica warms up as a lone engine does (EP ranks: no forward alone)
            from ..engine import warmup

            if warmup.wanted(core.args.warmup, core.device):
                warmup.warm_up(core)
        loop = RankLoop(dp_rank, core, conn)
        conn.send(
            RankReady(
                dp_rank,
                core.tokenizer,
                core.cfg,
                core.args,
                core.max_model_len,
                dict(core.default_sampling),
                core.kv.layout.block_size,
                core.kv.blocks.num_blocks,
                core.model_path,
            )
        )
        loop.run()
    except EOFError:  # the front end closed the pipe: nothing left to serve
        os._exit(0)
    except BaseException:
        if _told_to_stop(conn):  # a peer that obeyed the same Shutdown first broke this rank's collective
            os._exit(0)
        try:
            conn.send(RankFailed(dp_rank, traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)
    # The front end asked to stop: leave without the process group's teardown (it waits on the peers); TP workers
    # exit through their death pipes.
    os._exit(0)
