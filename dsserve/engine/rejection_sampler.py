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
    """The core walk. ``target`` [sum(k_b + 1), V]: each request's k_b + 1 target rows in order; ``drafts[b]``:
    request b's k_b draft ids; ``draft_probs`` [sum(k_b), V]: the draft's distributions (None: one-hot at the drafts,
    as DSpark's greedy drafter); ``random[b]`` False: request b's rows are one-hot (greedy) and draw nothing (None:
    every request draws). Returns (tokens per request, drafts accepted per request)."""
    counts = [len(d) for d in drafts]
    if target.shape[0] != sum(counts) + len(counts):
        raise ValueError(f"target has {target.shape[0]} rows; the drafts need {sum(counts) + len(counts)}")
    if draft_probs is None and random is not None and not any(random):
        return _accept_greedy(target, drafts)
    device, vocab = target.device, target.shape[1]
    target = target.float()
    # per target row: the draft it judges (the bonus row judges none: -1) and the draft distribution there
    judged = torch.tensor([t for d in drafts for t in [*d, -1]], dtype=torch.long).to(device)
    has = judged >= 0
    q = torch.zeros_like(target)
    if draft_probs is not None:
        q[_rows(has)] = draft_probs.float().to(device)
    else:
        q[has] = q[has].scatter_(1, judged[has].unsqueeze(1), 1.0)
    p_d = target.gather(1, judged.clamp_min(0).unsqueeze(1)).squeeze(1)
    q_d = q.gather(1, judged.clamp_min(0).unsqueeze(1)).squeeze(1)
    # the residual for draft rows, the target itself for bonus rows
    dist = torch.where(has.unsqueeze(1), (target - q).clamp_min(0.0), target)
    uniform = torch.zeros(target.shape[0], device=device)
    expo = torch.ones_like(target)
    starts = [0, *itertools.accumulate(k + 1 for k in counts)][:-1]
    shared_rows = []  # the unseeded random requests' rows take one draw of each kind from ``shared``
    for b, k in enumerate(counts):
        if random is not None and not random[b]:
            continue
        if generators[b] is None:
            shared_rows.extend(range(starts[b], starts[b] + k + 1))
            continue
        g, at = generators[b], starts[b]
        uniform[at : at + k] = _draw(lambda t, g=g: t.uniform_(generator=g), k, None, g, device)
        expo[at : at + k + 1] = _draw(lambda t, g=g: t.exponential_(generator=g), k + 1, vocab, g, device)
    if shared_rows:
        idx = torch.tensor(shared_rows, dtype=torch.long).to(device)
        uniform[idx] = torch.empty(len(shared_rows), device=device).uniform_(generator=shared)
        expo[idx] = torch.empty(len(shared_rows), vocab, device=device).exponential_(generator=shared)
    ok = (uniform * q_d < p_d) & has  # u < p/q without dividing (a draft row's q_d > 0: the draft drew it)
    raced = (dist / expo.clamp_min_(torch.finfo(expo.dtype).tiny)).argmax(dim=-1)
    ok_h, raced_h = ok.tolist(), raced.tolist()  # the host reads the step's verdict here
    tokens, accepted, row = [], [], 0
    for d in drafts:
        j = 0
        while j < len(d) and ok_h[row + j]:
            j += 1
        tokens.append(list(d[:j]) + [raced_h[row + j]])
        accepted.append(j)
        row += len(d) + 1
    return tokens, accepted


def _accept_greedy(target: torch.Tensor, drafts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """``accept`` when every row is one-hot (greedy) and so are the drafts: what the walk gives (a draft is accepted
    where it is its row's argmax; the first row that rejects, or the bonus row, emits its argmax) with one argmax
    over the rows instead of the draws and races, which would all be decided by the one-hot rows anyway."""
    best = target.argmax(dim=-1).tolist()  # the host reads the step's verdict here
    tokens, accepted, row = [], [], 0
    for d in drafts:
        j = 0
        while j < len(d) and d[j] == best[row + j]:
            j += 1
        tokens.append(list(d[:j]) + [best[row + j]])
        accepted.append(j)
        row += len(d) + 1
    return tokens, accepted


def _rows(mask: torch.Tensor) -> torch.Tensor:
    return mask.nonzero().squeeze(1)


def _draw(fill, n: int, width: int | None, g: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``n`` rows (of ``width``, or scalars) filled by ``fill`` from generator ``g``, drawn where ``g`` lives."""
    shape = (n,) if width is None else (n, width)
    where = g.device if g is not None else device
    return fill(torch.empty(shape, device=where)).to(device)


class RejectionSampler:
    """``RejectionSampler(sampler)(logits, requests, drafts) -> Verdict``: the target's processing is the engine
    sampler's own (``Sampler.target_probs``), so a verify row's distribution is the one a plain step would draw from."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, requests: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]):
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
        tokens, accepted = accept(target, drafts, gens, self.sampler.generator, random=random)
        lps = None
        if raw_logprobs is not None:
            emitted = [t for toks, d in zip(tokens, drafts) for t in (toks + [toks[-1]] * (len(d) + 1 - len(toks)))]
            sampled = torch.tensor(emitted, dtype=torch.long, device=raw_logprobs.device)
            lps = logprob_tensors(raw_logprobs, sampled, [row.params.logprobs for row in rows])
        return Verdict(tokens, accepted, lps)
