"""Batched token sampling with vLLM v1's semantics.

Per step, for logits [B, V] (cast to fp32; the caller's tensor is not modified):

1. logprobs, when any row asks: ``log_softmax`` of the *raw* logits, before penalties and temperature
   (vLLM v1's default ``logprobs_mode="raw_logprobs"``).
2. logit_bias: each row's bias is added to its logits (after the raw logprobs, before everything below).
3. min_tokens: while a row has fewer than ``min_tokens`` outputs, its stop_token_ids and EOS get -inf; so do
   banned tokens, and those a row's grammar does not allow next (``grammar_mask``, filled on the host).
4. penalties: repetition (tokens seen in prompt or output: positive logits divided, the rest multiplied),
   then frequency (minus penalty * count in output) and presence (minus penalty if in output).
5. greedy rows (temperature < 1e-5) take the argmax here; ties go to the lowest id.
6. random rows: temperature, then min-p, then top-k, then top-p (vLLM v1's order), then one draw.

Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary all survive, as in vLLM).
Top-p keeps a token when the mass of tokens strictly more probable than it is < p (the smallest
"nucleus"; ties at the boundary all survive). Min-p keeps probs >= min_p * max prob.

Drawing is the exponential race argmax(p / q), q ~ Exp(1). A seeded row draws its q from its own generator
and nothing else touches that generator, so its tokens do not depend on the rest of the batch. Unseeded rows
share the sampler's generator (or torch's default one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .sampling_params import SAMPLING_EPS, SamplingParams
from .structured_output import GrammarMask

NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One row of the batch: its params, the token history penalties need, and its generator (seeded rows).
    Any object with these four attributes works (the engine's ``Request`` has them)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None


@dataclass
class RowLogprobs:
    """Raw logprobs for one row: the sampled token's logprob and rank, and the row's top-n (rank 1..n)."""

    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # (sampled logprob [B], its rank [B], top-n ids [B, n] | None, top-n logprobs [B, n] | None) on the logits'
    # device, or None when no row asked; read on the host only by ``logprobs`` (the engine copies them back with
    # the tokens, so asking for logprobs adds no wait for the device)
    logprob_tensors: tuple | None = None
    want: tuple = ()  # per row: the top-n it asked for, or None

    @property
    def logprobs(self) -> list[RowLogprobs | None]:
        """Per row; None where the row did not ask."""
        return row_logprobs(self.logprob_tensors, self.want)


def row_logprobs(tensors: tuple | None, want) -> list[RowLogprobs | None]:
    """``SamplerOutput.logprob_tensors`` (or host copies of them) as per-row lists."""
    out: list[RowLogprobs | None] = [None] * len(want)
    if tensors is None:
        return out
    chosen, ranks, top_ids, top_lp = tensors
    chosen, ranks = chosen.tolist(), ranks.tolist()
    for i, n in enumerate(want):
        if n is None:
            continue
        n = min(n, 0 if top_ids is None else top_ids.shape[1])
        out[i] = RowLogprobs(
            chosen[i], ranks[i], top_ids[i, :n].tolist() if n else [], top_lp[i, :n].tolist() if n else []
        )
    return out


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for a seeded request (keep it for the request's lifetime). It must live on
    the logits' device; a seed gives the same tokens on one device type whatever the batch."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# ---------------------------------------------------------------- logits processors (in place, [B, V])
def _history_tensor(rows: list[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """Rows of ids padded with ``vocab`` (an id that no token has)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), vocab, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return out.to(device)


def _bin_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float counts of each id per row (the pad id ``vocab`` falls in a dropped extra column)."""
    counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=ids.device))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[Sequence[int]],
    output_ids: list[Sequence[int]],
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalty vectors are [B]. Repetition applies to tokens in prompt or output; frequency/presence to output."""
    vocab = logits.shape[1]
    out_counts = _bin_counts(_history_tensor(output_ids, vocab, logits.device), vocab)
    out_mask = (out_counts > 0).to(logits.dtype)
    if bool((repetition != 1.0).any()):
        seen = (out_counts > 0) | (_bin_counts(_history_tensor(prompt_ids, vocab, logits.device), vocab) > 0)
        rep = torch.where(seen, repetition.unsqueeze(1), 1.0)
        logits *= torch.where(logits > 0, rep.reciprocal(), rep)
    logits -= frequency.unsqueeze(1) * out_counts
    logits -= presence.unsqueeze(1) * out_mask
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor, k_max: int | None = None) -> torch.Tensor:
    """k is [B]; k <= 0 (or >= V) leaves the row alone. ``k_max``: the largest k in play, if the caller knows
    it without reading k (on a GPU a read waits for the device)."""
    on = (k > 0) & (k < logits.shape[1])
    if k_max is None:
        if not bool(on.any()):
            return logits
        k_max = int(torch.where(on, k, 1).max())
    if k_max < 1:
        return logits
    k = torch.where(on, k, 1).long()
    kth = logits.topk(k_max, dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # the k-th largest logit
    return logits.masked_fill_(on.unsqueeze(1) & (logits < kth), NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    # Only tokens still in play can be in the nucleus: on the CPU sort just those. On a GPU counting them would make
    # the host wait for the device (asynchronous scheduling), so sort the whole row: the masked tokens' zeros sort
    # last and change nothing (mass before them is the whole mass; if rounding leaves it < p, both ways keep every
    # token in play).
    width = logits.shape[1] if logits.is_cuda else int(torch.isfinite(logits).sum(dim=-1).max())
    sorted_p = probs.topk(width, dim=-1).values
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly ahead in sorted order
    last_kept = (mass_before < p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_min(1) - 1
    threshold = sorted_p.gather(1, last_kept)  # smallest kept probability
    threshold = torch.where(p.unsqueeze(1) >= 1.0, 0.0, threshold)  # p = 1: no rounding losses in the tail
    return logits.masked_fill_(probs < threshold, NEG_INF)


def random_sample(
    probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator | None = None
) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1): row i draws q from generators[i], or from ``shared`` when None."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):  # the same draws as below, with no index upload
        q.exponential_(generator=shared)
    elif unseeded:
        q[_index(unseeded, q.device)] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
            generator=shared
        )
    for i, g in enumerate(generators):
        if g is None:
            continue
        if g.device.type == probs.device.type:
            q[i].exponential_(generator=g)
        else:  # a request's generator lives on the host: draw there, so its tokens match the CPU engine's
            pin = g.device.type == "cpu" and q.is_cuda  # pinned and not waited for: a pageable copy waits
            drawn = torch.empty(probs.shape[1], dtype=probs.dtype, device=g.device, pin_memory=pin)
            q[i].copy_(drawn.exponential_(generator=g), non_blocking=pin)
    # q can be exactly 0 (probability ~2^-24 per draw): keep 0/q finite so masked tokens stay at 0.
    return (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row numbers as an index on ``device``, uploaded without waiting (indexing with a list would upload it
    with a copy that waits for the device's queue)."""
    idx = torch.tensor(rows, dtype=torch.long)
    return idx.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else idx


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float] | None], upload) -> torch.Tensor:
    """``logits[i, t] += biases[i][t]`` for every row with a bias (ids outside the vocabulary are an error)."""
    rows, cols, vals = [], [], []
    for i, b in enumerate(biases):
        for t, v in (b or {}).items():
            rows.append(i)
            cols.append(t)
            vals.append(v)
    if not rows:
        return logits
    if max(cols) >= logits.shape[1]:
        raise ValueError(f"logit_bias names token {max(cols)}, outside the vocabulary of {logits.shape[1]}")
    index = (upload(rows, torch.long), upload(cols, torch.long))
    return logits.index_put_(index, upload(vals, logits.dtype), accumulate=True)


# ---------------------------------------------------------------- the sampler
class Sampler:
    """``Sampler(eos_token_id)(logits, rows) -> SamplerOutput``. Stateless apart from the shared generator."""

    def __init__(self, eos_token_id: int | None = None, generator: torch.Generator | None = None):
        self.eos_token_id = eos_token_id
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar_mask=None) -> SamplerOutput:
        return self.forward(logits, rows, grammar_mask)

    @torch.no_grad()
    def forward(self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar_mask=None) -> SamplerOutput:
        """``grammar_mask``: the rows' ``structured_output.GrammarMask``, filled by the caller (the engine fills it
        while the step's forward runs); None fills it here from rows that carry a ``grammar``."""
        logits, probs, rnd, raw_logprobs, want = self._processed(logits, rows, grammar_mask)
        sampled = logits.argmax(dim=-1)  # greedy rows keep this
        if rnd:
            drawn = random_sample(probs, [rows[i].generator for i in rnd], self.generator)
            if len(rnd) == len(rows):
                sampled = drawn
            else:
                sampled[_index(rnd, logits.device)] = drawn
        tensors = None if raw_logprobs is None else logprob_tensors(raw_logprobs, sampled, want)
        return SamplerOutput(sampled, tensors, tuple(want))

    @torch.no_grad()
    def target_probs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar_mask=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The distribution ``forward`` draws each row's token from, [B, V] fp32: one-hot at the argmax for greedy
        rows, the processed (bias, bans, penalties, temperature, min-p, top-k, top-p) softmax for random rows; and
        the raw logprobs when a row asks for logprobs (else None). The rejection sampler's target."""
        logits, probs, rnd, raw_logprobs, _ = self._processed(logits, rows, grammar_mask)
        target = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if rnd:
            if len(rnd) == len(rows):
                target = probs
            else:
                target[_index(rnd, logits.device)] = probs
        return target, raw_logprobs

    def _processed(self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar_mask=None):
        """Steps 1-4 and 6 up to the draw: (processed logits [B, V], the random rows' probabilities [R, V] or None,
        the random rows' indices, raw logprobs or None, per row the top-n logprobs asked for)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [B, V] with B = {len(rows)} rows, got {tuple(logits.shape)}")
        logits = logits.to(torch.float32, copy=True)
        params = [r.params for r in rows]
        device = logits.device

        def vec(values, dtype=torch.float32):  # pinned, not waited for: a pageable upload waits for the device
            host = torch.tensor(values, dtype=dtype)
            return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host

        want = [p.logprobs for p in params]
        raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in want) else None

        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, [p.logit_bias for p in params], vec)

        # min_tokens: stop tokens and EOS are not allowed yet
        for i, (r, p) in enumerate(zip(rows, params)):
            if len(r.output_token_ids) < p.min_tokens:
                ids = [t for t in p.all_stop_token_ids(self.eos_token_id) if t < logits.shape[1]]
                if ids:
                    logits[i, ids] = NEG_INF

        # banned tokens (a chat without tools bans the DSML markup: most rows): one indexed write for the batch
        bans = [(i, t) for i, p in enumerate(params) for t in p.banned_token_ids or () if t < logits.shape[1]]
        if bans:
            logits[vec([i for i, _ in bans], torch.long), vec([t for _, t in bans], torch.long)] = NEG_INF
        if grammar_mask is None and any(getattr(r, "grammar", None) is not None for r in rows):
            grammar_mask = GrammarMask.fill(rows, logits.shape[1])
        if grammar_mask is not None:  # tokens the grammar does not allow next: never sampled
            grammar_mask.apply(logits)

        if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
            apply_penalties(
                logits,
                [r.prompt_token_ids for r in rows],
                [r.output_token_ids for r in rows],
                vec([p.repetition_penalty for p in params]),
                vec([p.frequency_penalty for p in params]),
                vec([p.presence_penalty for p in params]),
            )

        rnd = [i for i, p in enumerate(params) if p.temperature >= SAMPLING_EPS]
        probs = None
        if rnd:
            every = len(rnd) == len(params)
            sub = (logits if every else logits[_index(rnd, device)]) / vec(
                [params[i].temperature for i in rnd]
            ).unsqueeze(1)
            if any(params[i].min_p > 0 for i in rnd):
                apply_min_p(sub, vec([params[i].min_p for i in rnd]))
            ks = [params[i].top_k if 0 < params[i].top_k < logits.shape[1] else 0 for i in rnd]
            if any(ks):
                apply_top_k(sub, vec(ks, torch.long), max(ks))
            if any(params[i].top_p < 1.0 for i in rnd):
                apply_top_p(sub, vec([params[i].top_p for i in rnd]))
            probs = sub.softmax(dim=-1)
        return logits, probs, rnd, raw_logprobs, want


def logprob_tensors(raw_logprobs: torch.Tensor, sampled: torch.Tensor, want) -> tuple:
    """``SamplerOutput.logprob_tensors`` for the ``sampled`` ids [B] of rows with these raw logprobs."""
    n_max = min(max(n for n in want if n is not None), raw_logprobs.shape[1])
    top_lp, top_ids = raw_logprobs.topk(n_max, dim=-1) if n_max else (None, None)
    chosen = raw_logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (raw_logprobs >= chosen).sum(dim=-1)  # vLLM: count of logprobs >= the chosen one
    return chosen.squeeze(1), ranks, top_ids, top_lp
