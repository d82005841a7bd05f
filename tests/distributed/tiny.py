"""The tiny models and sequences the distributed tests compare: built the same way in every process."""

from __future__ import annotations

import torch

from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset


def tiny_model(name: str) -> DeepseekForCausalLM:
    """``preset(name)`` with seeded dummy weights, in fp64 (QAT on, as the preset has it)."""
    cfg = preset(name)
    model = DeepseekForCausalLM(cfg).eval()
    dummy_weights(model, cfg, seed=0)
    return model.double()


def sequences(seed: int, lengths: tuple[int, ...], vocab: int = 8000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@torch.no_grad()
def greedy(model: DeepseekForCausalLM, prompt: torch.Tensor, steps: int) -> list[int]:
    """``steps`` greedy tokens, each from the reference forward over the whole sequence so far."""
    seq = prompt.clone()
    for _ in range(steps):
        nxt = model.reference_logits(seq)[-1].argmax()
        seq = torch.cat((seq, nxt[None]))
    return seq[prompt.shape[0] :].tolist()
