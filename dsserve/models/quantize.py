"""``--quantization fp8``: the dense projections the release stores in FP8, in its weight format.

The release stores these weights FP8 e4m3 with one ue8m0 (power-of-two) scale per 32x32 block (V4: 128x128),
and the loader dequantises them: per layer attn.wq_a/wq_b/wkv/wo_a/wo_b, attn.indexer.wq_b,
ffn.shared_experts.w1/w2/w3 and engram.wkv (spec 1.7, 4.2). wo_a [G*o_lora_rank, H*D/G] is block-diagonal over the
G = o_groups head groups: an Fp8Linear with groups = G (attention.project calls it on the flat [T, H*D] output).
Re-quantising a dequantised release weight is lossless (its blocks are already on the pow2-scaled e4m3 grid), so
the bytes equal the checkpoint's; random dummy weights are rounded once, and the reference forward then runs the
same rounded weights (the oracle uses the same modules). Not converted here: the DSpark stages (model.mtp) and
mtp.0.main_proj, which the release also stores in FP8.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp8_linear import Fp8Linear
from ..kernels.grouped_moe import ExpertWeights
from ..layers.moe import MoE

QUANTIZATIONS = (None, "fp8")
EXPERT_FORMATS = ("fp8", "mxfp4")  # the routed experts: FP8 32x32 blocks, or MXFP4 as the release ships them
# Projections read through module calls (wo_a: attention.project switches to the grouped Fp8Linear); the
# compressor (fp32 pooling over .weight) keeps its dtype, as the release stores it in bf16.
ATTENTION_PROJECTIONS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
INDEXER_PROJECTIONS = ("wq_b",)
SHARED_EXPERT_PROJECTIONS = ("w1", "w2", "w3")
ENGRAM_PROJECTIONS = ("wkv",)


def quantize_dense_fp8(model: nn.Module, block: int) -> int:
    """Replace the release's FP8 dense projections of every layer (module docstring) by Fp8Linear in place;
    returns how many. wo_a stays as it is when o_lora_rank is not a multiple of `block` (a scale block would
    straddle two groups: tiny-v4's 64 rows per group on 128x128 blocks; every release has 1024)."""
    n = 0
    for layer in model.layers:
        attn = layer.attn
        owners = (
            (attn, ATTENTION_PROJECTIONS),
            (attn.indexer, INDEXER_PROJECTIONS),
            (layer.ffn.shared_experts, SHARED_EXPERT_PROJECTIONS),
            (layer.engram, ENGRAM_PROJECTIONS),
        )
        for owner, names in owners:
            for name in names if owner is not None else ():
                lin = getattr(owner, name, None)
                groups = attn.cfg.o_groups if owner is attn and name == "wo_a" else 1
                if not isinstance(lin, nn.Linear) or (groups > 1 and lin.out_features // groups % block):
                    continue
                setattr(owner, name, Fp8Linear.from_linear(lin, block, groups).to(lin.weight.device))
                n += 1
        fuse_gate_up(layer.ffn.shared_experts)
    return n


def fuse_gate_up(expert: nn.Module) -> bool:
    """Give an FP8 shared expert one [2I, K] product for w1 and w3 (expert.w13; w1 and w3 become views of its rows,
    so the bytes are held once): one decode launch instead of two, on a weight twice as tall. Returns whether it
    fused (both Fp8Linear, same block, I a multiple of it, not fused yet)."""
    w1, w3 = expert.w1, expert.w3
    if getattr(expert, "w13", None) is not None or not (isinstance(w1, Fp8Linear) and isinstance(w3, Fp8Linear)):
        return False
    b, i = w1.block, w1.out_features
    if w3.block != b or w1.groups != 1 or w3.groups != 1 or i % b or w3.out_features != i:
        return False
    w13 = Fp8Linear(
        torch.cat([w1.weight.view(torch.uint8), w3.weight.view(torch.uint8)]),
        torch.cat([w1.weight_scale, w3.weight_scale]),
        b,
    )
    w13.use_kernel, w13.act_quant_min_m = w1.use_kernel, w1.act_quant_min_m
    expert.w1 = Fp8Linear(w13.weight[:i], w13.weight_scale[: i // b], b)
    expert.w3 = Fp8Linear(w13.weight[i:], w13.weight_scale[i // b :], b)
    expert.w13 = w13
    return True


def use_act_quant(model: nn.Module, on: bool) -> int:
    """The release's activation rounding (spec 2.12, its act_quant): the inputs of every FP8-weight projection
    (Fp8Linear) and of the packed routed experts quantised to e4m3 per 32 channels with power-of-two scales, in the
    reference forward and the kernels alike (on a GPU: W8A8 / W4A8 on FP8 tensor cores). Returns how many modules
    it set."""
    n = 0
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.act_quant_min_m, n = (0 if on else None), n + 1
        elif isinstance(m, MoE):
            m.act_quant, n = on, n + 1
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
        moe.packed = ExpertWeights.from_dense(ex["w1"], ex["w3"], ex["w2"], fmt)  # in fp32 expert by expert
        if keep_dense:
            for i, name in enumerate(("w1", "w3", "w2")):
                ex[name].copy_(torch.stack([moe.packed.dequant(e)[i] for e in range(ex[name].shape[0])]))
        else:
            for name in ("w1", "w3", "w2"):
                del ex[name]
