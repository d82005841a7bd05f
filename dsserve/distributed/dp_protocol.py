"""The typed messages between the DP front end (``dp_client.DPClient``) and its engine cores (``dp_rank``), one pipe
per rank, pickled by ``multiprocessing.connection``.

Every request the front end routes is announced to every rank with one sequence number (``AddRequest`` to its rank,
``Announce`` to the others): with expert parallelism a rank that has gone idle wakes on either and steps in
lockstep with its peers, and the wave ends only when every rank has seen the same announcements
(``step_sync.StepSummary.requests_seen``), so no request can reach a rank whose peers have stopped stepping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.sampling_params import SamplingParams


# ----------------------------------------------------------------------------- front end -> rank
@dataclass(frozen=True)
class AddRequest:
    seq: int  # the announcement number (1, 2, ...: every routed request, whatever its rank)
    request_id: str
    prompt: list[int]  # token ids, from the front end's validation
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    session_id: str | None = None
    text: str | None = None  # the prompt as given, when it was text (outputs carry it back)


@dataclass(frozen=True)
class Announce:
    """A request went to another rank: with expert parallelism this rank must step with it."""

    seq: int


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


# ----------------------------------------------------------------------------- rank -> front end
@dataclass(frozen=True)
class RankReady:
    """What the front end needs to validate and route requests without a model of its own."""

    rank: int
    tokenizer: object  # models.tokenizer.Tokenizer
    cfg: object  # models.config.ModelConfig
    args: object  # engine.args.EngineArgs, as the rank resolved them
    max_model_len: int
    default_sampling: dict
    block_size: int
    num_blocks: int
    model_path: str = ""  # where the model's files are (EngineCore.model_path)


@dataclass(frozen=True)
class RankLoad:
    """A rank's load and counts after a step (what the front end routes by and exports with a ``rank`` label)."""

    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_total: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0  # forwards in lockstep (real or idle); with EP the same count on every rank
    idle_steps: int = 0  # of those, idle ones (expert_parallel.idle_forward)
    step_seconds: float = 0.0  # in EngineCore.step's scheduled steps (EngineStats: host work + device wait)
    sync_seconds: float = 0.0  # in the lockstep gathers
    idle_seconds: float = 0.0  # in idle forwards
    tp_message_seconds: float = 0.0  # building, pickling and sending the TP workers' step messages (TPExecutor)
    # the rank's EngineStats counters (EngineStats.counters: monotone within the rank), which the front end's
    # /metrics sums over the ranks (prefix cache, replay, graphs, speculative decoding)
    counters: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RankOutputs:
    rank: int
    outputs: list  # engine.outputs.RequestOutput
    load: RankLoad
    failed: list = field(default_factory=list)  # (request_id, message): requests the rank could not take
    # EP: (lockstep step index, rows this rank's experts ran in each MoE layer at that step) for the forwards
    # since the last message
    expert_rows: list = field(default_factory=list)
    eplb: object = None  # eplb.EplbReport (--enable-eplb) when it changed since this rank's last message, else None


@dataclass(frozen=True)
class ResetDone:
    rank: int
    ok: bool


@dataclass(frozen=True)
class RankFailed:
    """The rank's engine raised: its traceback, sent before it exits non-zero."""

    rank: int
    traceback: str
