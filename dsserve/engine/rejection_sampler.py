"""The rejection sampler: a verify step's target rows and a request's drafts to the tokens it accepts, with the output
distribution exactly the target's (Leviathan et al. 2023; vLLM's rejection sampler is the reference design).

A request that drafted d_1..d_k has k + 1 target rows: row i is the target's distribution for the token after
d_1..d_i (row 0: after the request's last accepted token). Walking i = 0, 1, ...: draft d_{i+1} is accepted with
probability min(1, p_i(d) / q_i(d)); the first rejected one is replaced by a token drawn from the residual
max(0, p_i - q_i) (renormalised) and the walk stops; when every draft is accepted a bonus token is drawn from p_k.
Every emitted token is then distributed exactly as the target would have drawn it. DSpark drafts greedily, so q_i is
one-hot at d_{i+1} (``draft_probs`` None): acceptance is p_i(d), the residual p_i without d. Greedy rows have a
one-hot p_i (``Sampler.target_probs``), so they accept the longest prefix equal to the target's argmax, plus the
target's own next token, and draw nothing.

Draws: a seeded request takes all of its draws (k uniforms, then k + 1 exponential rows of the vocabulary's width
for the residual and bonus races) from its own generator, whatever it accepts, so its tokens repeat for a seed and do
not depend on the rest of the batch; unseeded rows share the engine's generator.

The walk runs on the device (``judge``: every row's acceptance and candidate token at once, then per request its
first row that does not accept, by a segment minimum), so the engine proposes the next drafts from the verdict before
the host reads it (``RejectionSampler.decide``, engine.drafter); ``accept`` and a call read it at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from .sampler import Sampler, SamplingRow, logprob_tensors
from .sampling_params import SAMPLING_EPS


@dataclass
class Verdict:
    """Per request, in order: the tokens it accepted (its accepted drafts, then the target's own token) and how many
    of its drafts were accepted; ``logprobs``: ``SamplerOutput.logprob_tensors`` over every target row with each
    row's emitted token (rows after a request's last emitted token carry nothing meaningful), or None."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: tuple | None = None


@dataclass
class DeviceVerdict:
    """A verdict still on the device (``RejectionSampler.decide``): per request the drafts it accepted
    (``num_accepted`` [B]) and the target's own token after them (``last_token`` [B]), the logprob tensors
    (``Verdict.logprobs``, or None). The drafter proposes from it before the host reads it (engine.drafter);
    ``to_host`` makes the ``Verdict`` once the host has the tensors."""

    drafts: list[list[int]]
    num_accepted: torch.Tensor
    last_token: torch.Tensor
    logprobs: tuple | None = None

    def tensors(self) -> list[torch.Tensor]:
        """What the host reads: the counts, the last tokens, then the logprob tensors present."""
        return [self.num_accepted, self.last_token, *(t for t in self.logprobs or () if t is not None)]

    def to_host(self, host: list[torch.Tensor]) -> Verdict:
        """The ``Verdict`` from host copies of ``tensors()``, in their order."""
        n_acc, last = host[0].tolist(), host[1].tolist()
        lps = None
        if self.logprobs is not None:
            rest = iter(host[2:])
            lps = tuple(None if t is None else next(rest) for t in self.logprobs)
        tokens = [list(d[:n]) + [y] for d, n, y in zip(self.drafts, n_acc, last)]
        return Verdict(tokens, n_acc, lps)


@dataclass
class _DraftRow:
    """A target row seen by the sampler: the request's params and history with the row's drafts appended."""

    params: object
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    grammar: object | None = None


def accept(
    target: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None = None,
    draft_probs: torch.Tensor | None = None,
    random: Sequence[bool] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """``judge``, read on the host: (tokens per request, drafts accepted per request)."""
    n_acc, last, _ = judge(target, drafts, generators, shared, draft_probs, random)
    verdict = DeviceVerdict([list(d) for d in drafts], n_acc, last).to_host([n_acc.cpu(), last.cpu()])
    return verdict.token_ids, verdict.num_accepted


def judge(
    target: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None = None,
    draft_probs: torch.Tensor | None = None,
    random: Sequence[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The core walk, on the device: nothing is read back. ``target`` [sum(k_b + 1), V]: each request's k_b + 1
    target rows in order; ``drafts[b]``: request b's k_b draft ids; ``draft_probs`` [sum(k_b), V]: the draft's
    distributions (None: one-hot at the drafts, as DSpark's greedy drafter); ``random[b]`` False: request b's rows
    are one-hot (greedy) and draw nothing (None: every request draws). Returns (drafts accepted [B], the token after
    them [B], the token each target row emits [sum(k_b + 1)]: its draft up to the first rejected row, from there the
    request's last token)."""
    counts = [len(d) for d in drafts]
    if target.shape[0] != sum(counts) + len(counts):
        raise ValueError(f"target has {target.shape[0]} rows; the drafts need {sum(counts) + len(counts)}")
    device, vocab, rows = target.device, target.shape[1], target.shape[0]
    starts = [0, *itertools.accumulate(k + 1 for k in counts)][:-1]
    # per target row: the draft it judges (the bonus row judges none: -1), its request, its place in the request's
    # rows; then each request's first row. One upload.
    judged_h = [t for d in drafts for t in [*d, -1]]
    seg_h = [b for b, k in enumerate(counts) for _ in range(k + 1)]
    at_h = [j for k in counts for j in range(k + 1)]
    up = torch.tensor(judged_h + seg_h + at_h + starts, dtype=torch.long).to(device, non_blocking=True)
    judged, seg, at, first = up[:rows], up[rows : 2 * rows], up[2 * rows : 3 * rows], up[3 * rows :]
    has = judged >= 0
    if draft_probs is None and random is not None and not any(random):
        # every row one-hot (greedy), and so are the drafts: what the walk gives (a draft is accepted where it is its
        # row's argmax; the first row that rejects, or the bonus row, emits its argmax) with one argmax over the rows
        # instead of the draws and races, which would all be decided by the one-hot rows anyway
        emit = target.argmax(dim=-1)
        ok = (judged == emit) & has
        return _verdict(ok, emit, judged, seg, at, first)
    target = target.float()
    q = torch.zeros_like(target)  # (no boolean-mask indexing: it would read the mask's count back)
    if draft_probs is not None:
        draft_rows = torch.tensor([i for i, t in enumerate(judged_h) if t >= 0], dtype=torch.long)
        q[draft_rows.to(device, non_blocking=True)] = draft_probs.float().to(device)
    else:
        q.scatter_(1, judged.clamp_min(0).unsqueeze(1), has.unsqueeze(1).to(q.dtype))
    p_d = target.gather(1, judged.clamp_min(0).unsqueeze(1)).squeeze(1)
    q_d = q.gather(1, judged.clamp_min(0).unsqueeze(1)).squeeze(1)
    # the residual for draft rows, the target itself for bonus rows
    dist = torch.where(has.unsqueeze(1), (target - q).clamp_min(0.0), target)
    uniform = torch.zeros(rows, device=device)
    expo = torch.ones_like(target)
    shared_rows = []  # the unseeded random requests' rows take one draw of each kind from ``shared``
    for b, k in enumerate(counts):
        if random is not None and not random[b]:
            continue
        if generators[b] is None:
            shared_rows.extend(range(starts[b], starts[b] + k + 1))
            continue
        g, at_b = generators[b], starts[b]
        uniform[at_b : at_b + k] = _draw(lambda t, g=g: t.uniform_(generator=g), k, None, g, device)
        expo[at_b : at_b + k + 1] = _draw(lambda t, g=g: t.exponential_(generator=g), k + 1, vocab, g, device)
    if shared_rows:
        idx = torch.tensor(shared_rows, dtype=torch.long).to(device, non_blocking=True)
        uniform[idx] = torch.empty(len(shared_rows), device=device).uniform_(generator=shared)
        expo[idx] = torch.empty(len(shared_rows), vocab, device=device).exponential_(generator=shared)
    ok = (uniform * q_d < p_d) & has  # u < p/q without dividing (a draft row's q_d > 0: the draft drew it)
    raced = (dist / expo.clamp_min_(torch.finfo(expo.dtype).tiny)).argmax(dim=-1)
    return _verdict(ok, raced, judged, seg, at, first)


def _verdict(
    ok: torch.Tensor, emit: torch.Tensor, judged: torch.Tensor, seg: torch.Tensor, at: torch.Tensor, first: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``judge``'s outputs from each row's acceptance ``ok`` (False on bonus rows) and the token it would emit if
    the walk stopped there (``emit``): a request accepts its drafts up to its first row that does not (the bonus row
    at the latest), and emits that row's token after them."""
    stop = torch.where(ok, torch.iinfo(at.dtype).max, at)
    n_acc = torch.full_like(first, torch.iinfo(at.dtype).max).scatter_reduce(0, seg, stop, "amin")
    last = emit[first + n_acc]
    return n_acc, last, torch.where(at < n_acc[seg], judged, last[seg])


def _draw(fill, n: int, width: int | None, g: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``n`` rows (of ``width``, or scalars) filled by ``fill`` from generator ``g``, drawn where ``g`` lives."""
    shape = (n,) if width is None else (n, width)
    where = g.device if g is not None else device
    return fill(torch.empty(shape, device=where)).to(device)


class RejectionSampler:
    """``RejectionSampler(sampler).decide(logits, requests, drafts) -> DeviceVerdict`` (the engine's: nothing read
    back), or called: the ``Verdict`` on the host. The target's processing is the engine sampler's own
    (``Sampler.target_probs``), so a verify row's distribution is the one a plain step would draw from."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, requests: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]):
        """``decide``, read on the host."""
        v = self.decide(logits, requests, drafts)
        return v.to_host([t.cpu() for t in v.tensors()])

    @torch.no_grad()
    def decide(
        self, logits: torch.Tensor, requests: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]
    ) -> DeviceVerdict:
        """``logits`` [sum(k_b + 1), V]: request b's target rows (its k_b = len(drafts[b]) draft rows' and the last
        one); a request with a grammar must not draft (its mask follows accepted tokens only)."""
        rows = []
        for r, d in zip(requests, drafts):
            if d and getattr(r, "grammar", None) is not None:
                raise ValueError(f"request {getattr(r, 'request_id', '?')} has a grammar and cannot verify drafts")
            for i in range(len(d) + 1):
                hist = list(r.output_token_ids) + list(d[:i]) if i else r.output_token_ids
                rows.append(_DraftRow(r.params, r.prompt_token_ids, hist, r.generator, getattr(r, "grammar", None)))
        target, raw_logprobs = self.sampler.target_probs(logits, rows)
        random = [r.params.temperature >= SAMPLING_EPS for r in requests]
        gens = [r.generator for r in requests]
        n_acc, last, emitted = judge(target, drafts, gens, self.sampler.generator, random=random)
        lps = None
        if raw_logprobs is not None:
            lps = logprob_tensors(raw_logprobs, emitted, [row.params.logprobs for row in rows])
        return DeviceVerdict([list(d) for d in drafts], n_acc, last, lps)
