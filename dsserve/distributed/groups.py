"""The process groups of a parallel deployment, from torch.distributed's env rendezvous.

World = dp_size x tp_size ranks and rank = dp_rank * tp_size + tp_rank (docs/parallel.md): a replica's TP ranks
are neighbours. The TP group of a rank holds its replica's ranks; the EP group the ranks of its TP index across the
replicas (tp_size 1: every rank, the DEP layout), so that an expert-parallel MoE inside a TP replica exchanges rows
only with the ranks that hold the same slice of every expert. Every rank must build the groups, in the same order
(``dist.new_group`` is a collective over the world).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")
# A collective that waits longer than this fails instead of hanging (gloo raises; NCCL aborts the communicator).
DEFAULT_TIMEOUT_S = 60.0


class ParallelConfigError(ValueError):
    """Parallel sizes or ranks that do not fit the world or the model."""


def choose_backend(backend: str = "auto") -> str:
    """``auto``: NCCL when this process has a GPU of its own (LOCAL_RANK below the device count), else gloo."""
    if backend not in BACKENDS:
        raise ParallelConfigError(f"backend {backend!r}: one of {list(BACKENDS)}")
    if backend != "auto":
        return backend
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    return "nccl" if torch.cuda.is_available() and local < torch.cuda.device_count() else "gloo"


def init_world(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the world torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the GPU) and
    return (rank, world). Already initialised: returns the existing world's. A missing variable is a clear error,
    not a wait on the default port."""
    backend = choose_backend(backend)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ParallelConfigError(f"the env rendezvous needs {missing} set (torchrun sets them)")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the dp_size x tp_size world and its groups (None: a group of one, no communication)."""

    rank: int
    tp_size: int
    dp_size: int
    tp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None

    @property
    def world(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        """Also this rank's index in its EP group."""
        return self.rank // self.tp_size

    @staticmethod
    def ranks(tp_size: int, dp_size: int) -> tuple[list[list[int]], list[list[int]]]:
        """(the TP groups' ranks, the EP groups' ranks) of the world, in the order they are built."""
        tp = [[d * tp_size + t for t in range(tp_size)] for d in range(dp_size)]
        ep = [[d * tp_size + t for d in range(dp_size)] for t in range(tp_size)]
        return tp, ep


def new_groups(
    tp_size: int, dp_size: int, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ParallelGroups:
    """Build the TP and EP groups of an initialised world of tp_size x dp_size ranks (a collective: every rank
    calls it). ``backend``: the groups' (default: the world's); a gloo twin of an NCCL world carries host-side
    control, as vLLM keeps one per group. ``timeout_s``: each group's own (a new group does not take the world's:
    torch gives it 30 minutes)."""
    if tp_size < 1 or dp_size < 1:
        raise ParallelConfigError(f"tp_size={tp_size} and dp_size={dp_size} must be at least 1")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp_size * dp_size != world:
        raise ParallelConfigError(f"tp_size={tp_size} x dp_size={dp_size} must equal the world size {world}")
    if world == 1:
        return ParallelGroups(0, 1, 1, None, None)
    rank = dist.get_rank()
    tp_ranks, ep_ranks = ParallelGroups.ranks(tp_size, dp_size)
    tp = ep = None
    timeout = datetime.timedelta(seconds=timeout_s)
    for ranks in tp_ranks:
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        tp = g if rank in ranks else tp
    for ranks in ep_ranks:
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        ep = g if rank in ranks else ep
    return ParallelGroups(rank, tp_size, dp_size, tp if tp_size > 1 else None, ep if dp_size > 1 else None)
