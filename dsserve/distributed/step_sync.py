"""DP lockstep: before every forward the engine cores of a DP group gather one summary each, so that every rank
takes the same decision from the same numbers (the spec's section 1; no rank decides alone to enter a collective).

With expert parallelism every MoE layer is a collective over the DP ranks: each must run a forward at each step
while any rank has work, a real one or ``expert_parallel.idle_forward``. The gathered summaries also give the
decode-graph bucket (the largest rank's) and the all-to-all sizes to expect. With DSpark drafts the drafter's MoE is
a collective too: the ranks run as many draft passes after the forward as the most any rank announced.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from .all_gather import all_gather_dim


@dataclass(frozen=True)
class StepSummary:
    """One rank's step, as the others need it."""

    num_tokens: int  # rows its plan runs (0: an idle step)
    num_reqs: int  # sequences in its plan
    unfinished: int  # requests it still holds (running or waiting)
    is_prefill: int  # 1 if its plan has a prefill chunk
    requests_seen: int = 0  # requests the DP front end had announced to it when it drained its inbox (dp_rank)
    draft_passes: int = 0  # DSpark draft passes it may run after the forward (an upper bound: dp_rank.Lockstep)


class StepSync:
    """One all-gather a step over ``group`` (a gloo group: host numbers; None: one rank)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def gather(self, mine: StepSummary) -> list[StepSummary]:
        """Every rank's summary, in rank order (the same list on every rank)."""
        row = torch.tensor([astuple(mine)], dtype=torch.long)
        return [StepSummary(*r) for r in all_gather_dim(row, 0, self.group).tolist()]

    @staticmethod
    def wave_done(summaries: list[StepSummary]) -> bool:
        """No rank holds a request, and every rank has seen the same announced requests (none is on its way to a
        rank that would then step alone): every rank stops stepping at once."""
        return all(s.unfinished == 0 for s in summaries) and len({s.requests_seen for s in summaries}) == 1
