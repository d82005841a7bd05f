"""Held-out log-likelihood of the tasks' completions, teacher-forced: a learning signal that moves long before greedy
accuracy does (a retrieval code at chance costs 2 ln 90 = 9.0 nats whether or not the model is close).

``near`` retrieval asks about the last fact instead of the first: inside the sliding window, so it separates "no keyed
lookup has formed" from "the lookup does not reach through the global KV".
"""

from __future__ import annotations

import torch

from ..layers.context import SeqRows, StepBatch
from .tasks import Problem, problem, prompt_ids

VARIANTS = ("arithmetic", "retrieval", "retrieval-near", "chat")


def near(p: Problem) -> Problem:
    """``p`` (retrieval) asking about its last fact, the one closest to the question."""
    key, value = p.context.splitlines()[-1].removeprefix("The code for ").removesuffix(".").split(" is ")
    return Problem(
        "retrieval", p.context + f"Question: What is the code for {key}?\n", f"Answer: {value}\n", value, p.context
    )


@torch.no_grad()
def completion_nats(model, tokenizer, problems: list[Problem], dense: bool = False) -> float:
    """Mean over ``problems`` of -log p(completion | prompt), summed over the completion's tokens (one forward of all
    of them together). ``dense``: every visible global entry attended (training's dense warm-up), not the indexers'
    top-k (what is served)."""
    seqs, tokens, spans = [], [], []
    for p in problems:
        a, b = prompt_ids(tokenizer, p.prompt), tokenizer.encode(p.completion, add_bos=False)
        seqs.append(SeqRows(slice(len(tokens), len(tokens) + len(a) + len(b)), model.new_cache()))
        spans.append((len(tokens) + len(a), b))
        tokens += a + b
    hidden = model.forward_batch(StepBatch(torch.tensor(tokens), seqs, dense_entries=dense)).hidden
    rows = torch.tensor([at - 1 + i for at, b in spans for i in range(len(b))], device=hidden.device)
    targets = torch.tensor([t for _, b in spans for t in b], device=hidden.device)
    logp = torch.log_softmax(model.logits(hidden[rows]).float(), -1).gather(1, targets[:, None])
    return -float(logp.sum()) / len(problems)


def heldout_nats(model, tokenizer, n: int, min_back: int, dense: bool = False) -> dict[str, float]:
    """``completion_nats`` of the first ``n`` held-out problems of each variant (``dense``: see there)."""
    count = lambda s: len(tokenizer.encode(s, add_bos=False))
    out = {}
    for name in VARIANTS:
        task = name.removesuffix("-near")
        ps = [problem(task, "eval", i, count, min_back) for i in range(n)]
        out[name] = completion_nats(model, tokenizer, [near(p) for p in ps] if name.endswith("-near") else ps, dense)
    return out
