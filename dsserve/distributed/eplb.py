"""EPLB: expert-parallel load balancing of the target's MoE layers and the DSpark drafter's, rebalanced live.

``Eplb.shard(model, ep_rank, ep_size, group, config)`` spreads the model's experts over P = E + R physical slots
(``shard_expert_parallel`` with a ``phy2log``; the drafter over its own P_d = E_d + R_d) and attaches one
``EplbModel`` per MoE model (target, draft): its layers' ``ReplicaMap``s, its load window (``eplb_load``) and its
figures. ``Eplb.step()`` is called once per engine step on every EP rank, after the step's forwards (the DP lockstep
makes the calls line up, idle steps included). Every ``step_interval`` steps it all-reduces each model's window load
and starts the policy (``eplb_policy.place``, the same on every rank) on a thread, off the critical path; the next
boundary takes its result, checks that the ranks agree on it (``handshake.agree``), and queues the weight moves
(``eplb_transfer.Transfer``); each later boundary runs at most one chunk of them (``steps_waited`` counts the
boundaries that did) until every layer has switched. Target and draft keep their own load, placement and moves;
they share the step counter, the trigger and the transfer queue (one chunk a boundary in all, the models' moves
taking turns).

Balance is ``mean / max`` of the tokens each rank's experts run, per layer, aggregated over layers as
``sum mean / sum max`` (vLLM's). ``report()`` gives them per layer and over all layers (``EplbReport``, what the DP
ranks send their front end for ``/metrics`` and the bench): per step (the mean over the window's steps) and over the
window under the placement that ran, and at each rebalance the window before it (measured, and the old placement's
expectation on its load), the new placement's expectation on the same load, and the first full window after its
layers switched (measured).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import eplb_policy
from .eplb_load import ExpertLoad
from .eplb_transfer import Transfer, expert_bytes, plan_layer
from .groups import ParallelConfigError
from .handshake import agree


@dataclass(frozen=True)
class EplbConfig:
    window_size: int = 1000  # steps of load the policy sees
    step_interval: int = 3000  # steps between rebalances
    num_redundant_experts: int = 0  # the target's extra slots (P = E + R)
    num_redundant_draft_experts: int = 0  # the drafter's
    transfer_chunk: int = 32  # expert moves (over the group) in one chunk: one chunk a step boundary at most
    n_nodes: int = 1  # EP ranks split evenly over nodes; > 1: replicas pack into nodes, then ranks
    min_gain: float = 0.02  # a layer moves only if its expected most-loaded rank drops by more than this fraction
    figures_interval: int = 0  # steps between balance figures (an all-reduce of the window's rank loads); 0: at
    # each rebalance only

    def __post_init__(self):
        for name in ("window_size", "step_interval", "transfer_chunk", "n_nodes"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(f"eplb {name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.min_gain < 1:
            raise ParallelConfigError(f"eplb min_gain must be in [0, 1), got {self.min_gain}")
        for name in ("num_redundant_experts", "num_redundant_draft_experts", "figures_interval"):
            if getattr(self, name) < 0:
                raise ParallelConfigError(f"eplb {name} must be >= 0, got {getattr(self, name)}")

    def layout(self, ep_rank: int, ep_size: int):
        """EP rank ``ep_rank``'s share under the initial placement (``layout.ParallelLayout``: what ``Eplb.shard``
        places, and what the loader reads of a checkpoint for it)."""
        from .layout import ParallelLayout

        return ParallelLayout(
            ep_rank=ep_rank,
            ep_size=ep_size,
            redundant=(self.num_redundant_experts, self.num_redundant_draft_experts),
        )


BALANCE_KINDS = {
    "step": "per step, the mean over the window's steps, under the placement that ran",
    "window": "over the window's steps summed, under the placement that ran",
    "before": "the window that triggered the last rebalance, under the placement it replaced (measured)",
    "before_predicted": "the placement the last rebalance replaced: its expected balance on that window's load",
    "after_predicted": "the last rebalance's new placement: its expected balance on the same load",
    "after": "the first full window after the last rebalance's layers switched (measured)",
}


@dataclass(frozen=True)
class EplbFigures:
    """One MoE model's figures (``model``: target or draft). ``balance``: kind (``BALANCE_KINDS``, those measured
    so far) -> (all layers: sum mean / sum max, per layer: mean / max). Every rank holds the same values (they come
    from all-reduced loads) but ``staging_peak``, its own."""

    model: str
    balance: dict[str, tuple[float, tuple[float, ...]]]
    rebalances: int  # policy results that moved experts
    bytes_moved_last: int  # over the group, by the last of them
    bytes_moved_total: int
    staging_peak: int  # the moved-weight buffer's peak on this rank
    staging_bound: int  # its bound: one layer's slots of a rank


@dataclass(frozen=True)
class EplbReport:
    """What an EP rank reports of its EPLB (``dp_protocol.RankOutputs.eplb``); ``version`` grows when it changes."""

    version: int
    steps: int  # step boundaries so far
    steps_waited: int  # of those, the ones that ran a weight transfer chunk
    models: tuple[EplbFigures, ...]


def layer_balance(rank_load: torch.Tensor) -> torch.Tensor:
    """[..., L, EP] tokens per rank -> [...] balance over layers: sum_l mean_r / sum_l max_r (1 when empty)."""
    rank_load = rank_load.double()
    top = rank_load.amax(-1).sum(-1)
    mean = rank_load.mean(-1).sum(-1)
    return torch.where(top > 0, mean / top.clamp(min=1e-30), torch.ones_like(top))


class EplbModel:
    """One MoE model's EPLB state: its layers (``ExpertParallelMoE``), placement, load window and figures."""

    def __init__(self, name: str, moes: list[nn.Module], n_experts: int, ep_size: int, window: int):
        self.name, self.moes, self.n_experts, self.ep_size = name, moes, n_experts, ep_size
        self.n_slots = moes[0].replicas.n_slots
        device = moes[0].gate.weight.device
        self.load = ExpertLoad(len(moes), n_experts, self.n_slots, ep_size, window, device)
        for i, moe in enumerate(moes):
            moe.load = self.load.layer(i)
        self.balance: dict[str, tuple[float, tuple[float, ...]]] = {}  # EplbFigures.balance
        self.after_from: int | None = None  # load steps from this index on ran the last rebalance's placement
        self.rebalances = 0
        self.switched: list[tuple[int, int]] = []  # (layer, step boundary) of every layer switch so far
        self.last_bytes_moved = self.bytes_moved_total = 0
        self.staging_peak = 0
        self.staging_bound = self.n_slots // ep_size * expert_bytes(moes[0])

    @property
    def phy2log(self) -> list[tuple[int, ...]]:
        return [m.replicas.phy2log for m in self.moes]

    def predicted_layers(self, load, phy2log) -> tuple[float, tuple[float, ...]]:
        """The expected balance (all layers, per layer) of placement ``phy2log`` on load ``[L, E]``."""
        ranks = torch.tensor([eplb_policy.rank_loads(row, p, self.ep_size) for row, p in zip(load, phy2log)])
        return float(layer_balance(ranks)), tuple(layer_balance(ranks[:, None, :]).tolist())

    def measured(self, ranks: torch.Tensor) -> None:
        """Refresh the measured kinds from the window's all-reduced ``[n, L, EP]`` rows (steps with none skipped)."""
        ranks = ranks[ranks.sum((1, 2)) > 0]
        if not ranks.shape[0]:
            return
        total = ranks.sum(0)
        self.balance["step"] = (
            float(layer_balance(ranks).mean()),
            tuple(layer_balance(ranks[:, :, None]).mean(0).tolist()),
        )
        self.balance["window"] = float(layer_balance(total)), tuple(layer_balance(total[:, None]).tolist())
        if self.after_from is not None and self.load.steps - self.load.filled() >= self.after_from:
            self.balance["after"], self.after_from = self.balance["window"], None

    def report(self) -> EplbFigures:
        return EplbFigures(
            self.name,
            dict(self.balance),
            self.rebalances,
            self.last_bytes_moved,
            self.bytes_moved_total,
            self.staging_peak,
            self.staging_bound,
        )


class Eplb:
    def __init__(self, model: nn.Module, ep_rank: int, ep_size: int, group: dist.ProcessGroup | None, cfg: EplbConfig):
        self.cfg, self.rank, self.ep_size, self.group = cfg, ep_rank, ep_size, group
        self.models = [
            EplbModel("target", [b.ffn for b in model.layers], model.cfg.n_routed_experts, ep_size, cfg.window_size)
        ]
        if getattr(model, "mtp", None) is not None:
            self.models.append(
                EplbModel(
                    "draft", [s.ffn for s in model.mtp], model.cfg.dspark_n_routed_experts, ep_size, cfg.window_size
                )
            )
        self.steps = 0
        self.transfers: list[tuple[EplbModel, Transfer]] = []
        self._policy: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eplb-policy")
        self.steps_waited = 0  # boundaries that ran a transfer chunk
        self.max_chunks_per_step = 0
        self.policy_wait_s = 0.0  # time boundaries spent waiting for the policy thread
        self.skipped = 0  # triggers that found a rebalance still in flight
        self.chunks_total = 0  # transfer chunks queued over all rebalances
        self.version = 0  # grows whenever report() would change
        self._force = False

    @classmethod
    def shard(cls, model: nn.Module, ep_rank: int, ep_size: int, group: dist.ProcessGroup | None, cfg: EplbConfig):
        """``shard_expert_parallel`` with the redundant slots of ``cfg``, then EPLB attached. Returns (model, Eplb)."""
        from .expert_parallel import shard_expert_parallel

        c, layout = model.cfg, cfg.layout(ep_rank, ep_size)
        target = layout.phy2log(c.n_routed_experts)
        has_draft = getattr(model, "mtp", None) is not None
        draft = layout.phy2log(c.dspark_n_routed_experts, draft=True) if has_draft else None
        model = shard_expert_parallel(model, ep_rank, ep_size, group, phy2log=target, draft_phy2log=draft)
        return model, cls(model, ep_rank, ep_size, group, cfg)

    def rebalance_next(self) -> None:
        """Trigger a rebalance at the next boundary (every rank must call it at the same step)."""
        self._force = True

    def uniform_routing(self, seed: int = 0) -> None:
        """``--uniform-routing``: every MoE layer routes uniformly at random from now on (outputs change)."""
        for i, m in enumerate(self.models):
            for j, moe in enumerate(m.moes):
                moe.uniform = UniformRouting(m.n_experts, seed + 1000 * i + j)

    def step(self) -> None:
        """One step boundary: end the step's load, take a finished policy, run one transfer chunk, maybe trigger."""
        for m in self.models:
            m.load.end_step()
        self.steps += 1
        if self._policy is not None:
            self._start_transfers()
        chunks = 0
        while self.transfers:
            m, t = self.transfers[0]
            chunks += t.advance(self.steps, chunk_allowed=chunks == 0)
            if not t.done:
                self.transfers.append(self.transfers.pop(0))  # round robin: target and draft move side by side
                break
            m.staging_peak = max(m.staging_peak, t.staging_peak)
            m.switched += t.switched
            m.after_from = self.steps  # the steps ended after this boundary run the new placement everywhere
            self.transfers.pop(0)
        self.steps_waited += chunks > 0
        self.version += chunks > 0
        self.max_chunks_per_step = max(self.max_chunks_per_step, chunks)
        due = self._force or self.steps % self.cfg.step_interval == 0
        if due:
            self._force = False
            if self.transfers or self._policy is not None:
                self.skipped += 1
            else:
                self._trigger()
        elif self.cfg.figures_interval and self.steps % self.cfg.figures_interval == 0:
            self._measure()

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

    def _measure(self) -> list[list[list[float]]]:
        """All-reduce each model's window; refresh its measured figures. Returns each model's [L, E] load."""
        loads = []
        for m in self.models:
            load = self._all_reduce(m.load.window_load().clone())
            m.measured(self._all_reduce(m.load.window_rank_load().clone()))  # [n, L, EP]: rows each rank ran
            loads.append(load.tolist())
        self.version += 1
        return loads

    def _trigger(self) -> None:
        loads = self._measure()
        olds = [m.phy2log for m in self.models]
        for m, load, old in zip(self.models, loads, olds):
            if any(map(any, load)):  # a model that ran no rows (a drafter not drafting) has no expectation
                m.balance["before_predicted"] = m.predicted_layers(load, old)
            if "window" in m.balance:
                m.balance["before"] = m.balance["window"]
        cfg = self.cfg
        redundant = [cfg.num_redundant_experts, cfg.num_redundant_draft_experts]

        def policy():
            return [
                eplb_policy.place(load, self.ep_size, r, cfg.n_nodes, old, cfg.min_gain)
                for load, r, old in zip(loads, redundant, olds)
            ]

        self._policy = self._pool.submit(policy)
        self._loads = loads

    def _start_transfers(self) -> None:
        t0 = time.perf_counter()
        new = self._policy.result()
        self.policy_wait_s += time.perf_counter() - t0
        self._policy = None
        agree("the EPLB placement", repr(new), self.group)
        self.version += 1
        for m, placement, load in zip(self.models, new, self._loads):
            if any(map(any, load)):
                m.balance["after_predicted"] = m.predicted_layers(load, placement)
            m.balance.pop("after", None)
            m.after_from = self.steps  # no move: the next full window; else set again when the last layer switched
            plans = [
                plan_layer(i, old, tuple(p), self.ep_size)
                for i, (old, p) in enumerate(zip(m.phy2log, placement))
                if tuple(p) != old
            ]
            if not plans:
                continue
            t = Transfer(m.moes, plans, self.rank, self.ep_size, self.group, self.cfg.transfer_chunk)
            m.rebalances += 1
            self.chunks_total += t.chunks
            m.last_bytes_moved = t.bytes_moved
            m.bytes_moved_total += t.bytes_moved
            m.after_from = None
            self.transfers.append((m, t))

    def report(self) -> EplbReport:
        """The figures as of the last refresh (no collective: the HTTP or messaging side may call it any time)."""
        return EplbReport(self.version, self.steps, self.steps_waited, tuple(m.report() for m in self.models))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class UniformRouting:
    """``--uniform-routing``: each row's top-k replaced by k distinct experts drawn uniformly (seeded): the balanced
    reference of the balance figures. It changes outputs; a benchmark mode, never a serving one."""

    def __init__(self, n_experts: int, seed: int = 0):
        self.n_experts, self.gen = n_experts, torch.Generator().manual_seed(seed)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        pick = torch.rand(t, self.n_experts, generator=self.gen).argsort(dim=1)[:, :k]
        return pick.to(ids.device)
