"""Greedy decoding of one sequence over the per-sequence cache: the simplest generator, and the oracle's
driver for decode tests. The batched engine (scheduler, paged caches, sampler) replaces it for serving."""

from __future__ import annotations

import torch

from ..models.model import DeepseekForCausalLM


@torch.no_grad()
def greedy_generate(
    model: DeepseekForCausalLM,
    prompt: list[int],
    max_new_tokens: int,
    eos_id: int | None = None,
    bounded_replay: bool = True,
) -> list[int]:
    """Returns the generated ids. With bounded replay the prefill runs the decoder only on the last window."""
    cfg = model.cfg
    cache = model.new_cache()
    start = max(0, len(prompt) - cfg.sliding_window) if (bounded_replay and cfg.is_v41) else None
    dev = model.embed.weight.device
    out = model(torch.tensor(prompt, device=dev), cache, decoder_start=start)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model.logits(out.hidden[-1:]).argmax(-1))
        generated.append(nxt)
        if nxt == eos_id:
            break
        out = model(torch.tensor([nxt], device=dev), cache, decoder_start=start)
    return generated
