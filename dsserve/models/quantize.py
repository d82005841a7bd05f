"""``--quantization fp8``: the attention's dense projections in the release's weight format.

The release stores these weights FP8 e4m3 with one ue8m0 (power-of-two) scale per 32x32 block (V4: 128x128),
and the loader dequantises them. Re-quantising a dequantised release weight is lossless (its blocks are
already on the pow2-scaled e4m3 grid), so the bytes equal the checkpoint's; random dummy weights are rounded
once, and the reference forward then runs the same rounded weights (the oracle uses the same modules).
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp8_linear import Fp8Linear
from ..kernels.grouped_moe import ExpertWeights

QUANTIZATIONS = (None, "fp8")
EXPERT_FORMATS = ("fp8", "mxfp4")  # the routed experts: FP8 32x32 blocks, or MXFP4 as the release ships them
# Projections read through nn.Linear.__call__; wo_a (a grouped einsum) and the compressor (fp32 pooling over
# .weight) keep their dtype.
ATTENTION_PROJECTIONS = ("wq_a", "wq_b", "wkv", "wo_b")
INDEXER_PROJECTIONS = ("wq_b",)


def quantize_dense_fp8(model: nn.Module, block: int) -> int:
    """Replace the attention projections of every layer by Fp8Linear in place; returns how many."""
    n = 0
    for layer in model.layers:
        attn = layer.attn
        for owner, names in ((attn, ATTENTION_PROJECTIONS), (attn.indexer, INDEXER_PROJECTIONS)):
            for name in names if owner is not None else ():
                lin = getattr(owner, name, None)
                if isinstance(lin, nn.Linear):
                    setattr(owner, name, Fp8Linear.from_linear(lin, block).to(lin.weight.device))
                    n += 1
    return n


def use_fp8_kernels(model: nn.Module, on: bool) -> None:
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.use_kernel = on


def quantize_experts(model: nn.Module, fmt: str, keep_dense: bool = True) -> int:
    """Pack every MoE's routed experts in `fmt` (kernels.grouped_moe.ExpertWeights) for the grouped-MoE ops;
    returns how many layers. keep_dense: also round the dense parameters to the packed values, so the oracle
    runs the same weights (tests, tiny models); False drops them (a proxy at real widths: the reference path
    then dequantises expert by expert). Layers already packed in `fmt` are left as they are."""
    for layer in model.layers:
        pack_experts(layer.ffn, fmt, keep_dense)
    return len(model.layers)


def pack_experts(moe: nn.Module, fmt: str, keep_dense: bool = True) -> None:
    """quantize_experts for one MoE (a builder packs each layer as it fills it: models.dummy_build)."""
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"expert format {fmt!r}: expected one of {EXPERT_FORMATS}")
    if moe.packed is not None:
        if moe.packed.fmt != fmt:
            raise ValueError(f"routed experts already packed as {moe.packed.fmt}, cannot repack as {fmt}")
        return
    ex = moe.experts
    with torch.no_grad():
        moe.packed = ExpertWeights.from_dense(ex["w1"].float(), ex["w3"].float(), ex["w2"].float(), fmt)
        if keep_dense:
            for i, name in enumerate(("w1", "w3", "w2")):
                ex[name].copy_(torch.stack([moe.packed.dequant(e)[i] for e in range(ex[name].shape[0])]))
        else:
            for name in ("w1", "w3", "w2"):
                del ex[name]
