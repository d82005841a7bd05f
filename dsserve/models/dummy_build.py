"""Dummy-weight models built straight on their device, routed experts packed layer by layer.

The release proxy's routed experts are 68 B parameters: dense (fp32 at construction) they would need 270 GB,
more than an H200 or the host has, while MXFP4 they are 36 GB. So the model is built with its experts deferred
(on the meta device, layers.moe.deferred_experts), the rest gets its dummy weights, and then each MoE in turn
gets its experts filled (checkpoint.dummy_tensor: the values dummy_weights would give them) and packed: one
layer's dense experts exist at a time. The result equals a plain build + dummy_weights + quantize_experts
with the same keep_dense.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from ..layers.moe import MoE, deferred_experts
from .checkpoint import dummy_tensor, dummy_weights, model_shapes
from .config import ModelConfig
from .model import DeepseekForCausalLM
from .quantize import EXPERT_FORMATS, pack_experts


def build_dummy_model(
    cfg: ModelConfig,
    seed: int = 0,
    expert_format: str | None = None,
    device: str | torch.device = "cpu",
    keep_dense: bool = False,
) -> DeepseekForCausalLM:
    """An eval-mode model on `device` (float32) with dummy_weights(seed). expert_format (fp8 | mxfp4): the
    backbone's routed experts packed in it as they are filled, their dense copies kept (rounded to the packed
    values) only with keep_dense; the draft's experts stay dense, as quantize_experts leaves them. None: a plain
    build on the device."""
    if expert_format is not None and expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert format {expert_format!r}: expected one of {EXPERT_FORMATS} or None")
    device = torch.device(device)
    with torch.device(device), deferred_experts() if expert_format else nullcontext():
        net = DeepseekForCausalLM(cfg).eval()
    dummy_weights(net, cfg, seed)  # skips the deferred (meta) experts
    backbone = {id(layer.ffn) for layer in net.layers}
    shapes = model_shapes(cfg)
    for name, moe in net.named_modules():
        if not isinstance(moe, MoE) or not any(p.is_meta for p in moe.experts.values()):
            continue
        with torch.no_grad():
            for key, p in list(moe.experts.items()):
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                full = f"{name}.experts.{key}"
                if full in shapes:
                    dummy_tensor(full, t, cfg, seed)
                else:  # a tensor dummy_weights does not know keeps its construction value, zeros
                    t.zero_()
                moe.experts[key] = nn.Parameter(t)
        if id(moe) in backbone:
            pack_experts(moe, expert_format, keep_dense)
    return net
