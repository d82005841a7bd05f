"""The release checkpoint's tensor inventory (spec 4), derived from a ModelConfig without allocating anything.

Names are the release's own (``layers.{L}.attn.wq_b.weight``, ``mtp.{s}.…``). The in-memory model uses the same
names, dequantised to a float dtype, except that routed experts are stacked per layer as
``layers.{L}.ffn.experts.w1|w2|w3`` [E, n, k] and FP8/MXFP4/Engram scales are folded into their weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from .config import V4, V41, ModelConfig

# safetensors dtype names -> torch dtypes
ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "I32": torch.int32,
}
QUANT_DTYPE = {
    "bf16": "BF16",
    "fp32": "F32",
    "fp8": "F8_E4M3",
    "mxfp4": "I8",
    "engram_fp8": "F8_E4M3",
    "int32": "I32",
    "scale": "F8_E8M0",
}
PLAIN_FLOAT = ("BF16", "F32", "F16")  # an unquantised checkpoint may store any float weight in any of these
MX_BLOCK = 32  # MXFP4 experts and Engram tables: one e8m0 scale per 32 values

# Release tensors that exist but are not part of this engine's model; tolerated (and skipped) by the loader.
IGNORED_PREFIXES = {
    V41: ("vision.", "aligner.", "image_start", "image_end", "image_newline"),
    V4: ("mtp.",),  # V4's MTP block is not modelled yet (see release_layout)
}


@dataclass(frozen=True)
class TensorSpec:
    """One release tensor. quant: "bf16" | "fp32" | "int32" (plain), "fp8" (dense, sibling ``.scale``),
    "mxfp4" (routed expert, I8 [n, k/2] + ``.scale`` [n, k/32]), "engram_fp8" (F8 + ``.scale`` [rows, D/32]),
    or "scale" (the F8_E8M0 scale of ``owner``)."""

    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name
    quant: str
    owner: str | None = None  # for quant == "scale": the weight it scales

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_DTYPES[self.dtype].itemsize

    @property
    def float_shape(self) -> tuple[int, ...]:
        """Shape after dequantisation (MXFP4 packs two values per byte)."""
        return self.shape[:-1] + (self.shape[-1] * 2,) if self.quant == "mxfp4" else self.shape


def dtype_accepted(spec: TensorSpec, dtype: str, cfg: ModelConfig) -> bool:
    """A stored dtype the loader takes for `spec`: the release's exact one, or (unquantised config) any float
    dtype for a float weight (a fine-tune saved in FP32 loads as well as a BF16 conversion)."""
    if dtype == spec.dtype:
        return True
    return not cfg.quantized and spec.dtype in PLAIN_FLOAT and dtype in PLAIN_FLOAT


def scale_name(weight_name: str) -> str:
    """``a.b.weight`` -> ``a.b.scale`` (the sibling e8m0 scale of a quantised weight)."""
    return weight_name.removesuffix(".weight") + ".scale"


class _Builder:
    def __init__(self, cfg: ModelConfig):
        self.cfg, self.specs = cfg, {}

    def add(self, name, quant, *shape):
        shape = tuple(int(s) for s in shape)
        if not self.cfg.quantized and quant in ("fp8", "mxfp4", "engram_fp8"):
            quant = "bf16"  # no quantization_config: the same names, plain weights, no scales
        self.specs[name] = TensorSpec(shape, QUANT_DTYPE[quant], quant)
        if quant == "fp8":
            b = self.cfg.weight_block_size
            self._scale(name, -(-shape[0] // b), -(-shape[1] // b))
        elif quant == "mxfp4":
            self.specs[name] = TensorSpec((shape[0], shape[1] // 2), "I8", quant)
            self._scale(name, shape[0], shape[1] // MX_BLOCK)
        elif quant == "engram_fp8":
            self._scale(name, shape[0], shape[1] // MX_BLOCK)

    def _scale(self, owner, *shape):
        self.specs[scale_name(owner)] = TensorSpec(tuple(shape), "F8_E8M0", "scale", owner)


def _engram_rows(cfg: ModelConfig) -> dict[int, int]:
    from ..layers.engram_hash import engram_rows_per_layer  # lazy: written separately

    rows = engram_rows_per_layer(cfg)
    return dict(rows) if isinstance(rows, dict) else dict(zip(cfg.engram_layer_ids, rows))


def _block(b: _Builder, p: str, n_experts: int, *, bias_vl: bool, hash_routed: bool = False):
    """Names shared by every backbone layer and DSpark stage (attention core, mHC, norms, MoE)."""
    c = b.cfg
    d, hd, heads = c.hidden_size, c.head_dim, c.num_attention_heads
    mix, inter = (2 + c.hc_mult) * c.hc_mult, c.moe_intermediate_size
    b.add(p + "attn_norm.weight", "bf16", d)
    b.add(p + "ffn_norm.weight", "bf16", d)
    for site in ("attn", "ffn"):
        b.add(f"{p}hc_{site}_fn", "fp32", mix, c.hc_mult * d)
        b.add(f"{p}hc_{site}_base", "fp32", mix)
        b.add(f"{p}hc_{site}_scale", "fp32", 3)
    b.add(p + "attn.wq_a.weight", "fp8", c.q_lora_rank, d)
    b.add(p + "attn.q_norm.weight", "bf16", c.q_lora_rank)
    b.add(p + "attn.wq_b.weight", "fp8", heads * hd, c.q_lora_rank)
    b.add(p + "attn.wkv.weight", "fp8", hd, d)
    b.add(p + "attn.kv_norm.weight", "bf16", hd)
    b.add(p + "attn.wo_a.weight", "fp8", c.o_groups * c.o_lora_rank, heads * hd // c.o_groups)
    b.add(p + "attn.wo_b.weight", "fp8", d, c.o_groups * c.o_lora_rank)
    b.add(p + "attn.attn_sink", "fp32", heads)
    b.add(p + "ffn.gate.weight", "bf16", n_experts, d)
    if hash_routed:
        b.add(p + "ffn.gate.tid2eid", "int32", c.vocab_size, c.num_experts_per_tok)
    else:
        b.add(p + "ffn.gate.bias", "fp32", n_experts)
    if bias_vl:
        b.add(p + "ffn.gate.bias_vl", "fp32", n_experts)
    if c.n_shared_experts:
        sh = inter * c.n_shared_experts
        b.add(p + "ffn.shared_experts.w1.weight", "fp8", sh, d)
        b.add(p + "ffn.shared_experts.w2.weight", "fp8", d, sh)
        b.add(p + "ffn.shared_experts.w3.weight", "fp8", sh, d)
    for e in range(n_experts):
        b.add(f"{p}ffn.experts.{e}.w1.weight", "mxfp4", inter, d)
        b.add(f"{p}ffn.experts.{e}.w2.weight", "mxfp4", d, inter)
        b.add(f"{p}ffn.experts.{e}.w3.weight", "mxfp4", inter, d)


def _v4_compressor(b: _Builder, p: str, ratio: int, width: int):
    """V4 compressor at `width` (head_dim, or index_head_dim for the indexer's own one); ratio 4 overlaps (x2)."""
    w = width * (2 if ratio == 4 else 1)
    b.add(p + "wkv.weight", "bf16", w, b.cfg.hidden_size)
    b.add(p + "wgate.weight", "bf16", w, b.cfg.hidden_size)
    b.add(p + "ape", "fp32", ratio, w)
    b.add(p + "norm.weight", "bf16", width)


def release_layout(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of the release checkpoint (spec 4.1-4.3 for V4.1, 4.5 for V4), in file order. An unquantised
    config (``cfg.quantized`` False) has the same names with every FP8/MXFP4 weight plain BF16 and no scales.
    Pure metadata (V4.1-Flash: 95,819 entries); cached per config, each call returns a fresh dict."""
    return dict(_layout(cfg))


@lru_cache(maxsize=8)
def _layout(cfg: ModelConfig) -> dict[str, TensorSpec]:
    b, c = _Builder(cfg), cfg
    d, hd, ihd = c.hidden_size, c.head_dim, c.index_head_dim
    b.add("embed.weight", "bf16", c.vocab_size, d)
    b.add("head.weight", "bf16", c.vocab_size, d)
    b.add("norm.weight", "bf16", d)
    if not c.is_v41:
        b.add("hc_head_fn", "fp32", c.hc_mult, c.hc_mult * d)
        b.add("hc_head_base", "fp32", c.hc_mult)
        b.add("hc_head_scale", "fp32", 1)
    engram_rows = _engram_rows(c) if c.is_v41 and c.engram_layer_ids else {}
    for role in c.roles:
        p = f"layers.{role.index}."
        _block(b, p, c.n_routed_experts, bias_vl=c.is_v41, hash_routed=role.hash_routed)
        if c.is_v41:
            if role.owns_compressor:
                b.add(p + "attn.compressor.wkv.weight", "bf16", hd, d)
                if role.ratio > 1:
                    b.add(p + "attn.compressor.wgate.weight", "bf16", hd, d)
                b.add(p + "attn.compressor.norm.weight", "bf16", hd)
                b.add(p + "attn.indexer.wk.weight", "bf16", ihd, hd)
                b.add(p + "attn.indexer.k_norm.weight", "bf16", ihd)
            if role.owns_indexer:
                b.add(p + "attn.indexer.wq_b.weight", "fp8", c.index_n_heads * ihd, c.q_lora_rank)
                b.add(p + "attn.indexer.weights_proj.weight", "bf16", c.index_n_heads, d)
            if role.engram:
                b.add(p + "engram.embed.weight", "engram_fp8", engram_rows[role.index], c.engram_head_dim)
                b.add(p + "engram.wkv.weight", "fp8", (c.hc_mult + 1) * d, c.engram_columns * c.engram_head_dim)
                b.add(p + "engram.q_weight", "bf16", c.hc_mult, d)
                b.add(p + "engram.k_weight", "bf16", c.hc_mult, d)
        else:
            if role.owns_compressor:
                _v4_compressor(b, p + "attn.compressor.", role.ratio, hd)
            if role.owns_indexer:
                b.add(p + "attn.indexer.wq_b.weight", "fp8", c.index_n_heads * ihd, c.q_lora_rank)
                b.add(p + "attn.indexer.weights_proj.weight", "bf16", c.index_n_heads, d)
                _v4_compressor(b, p + "attn.indexer.compressor.", role.ratio, ihd)
    # V4's MTP block (mtp.0.{e_proj,h_proj,enorm,hnorm,norm,hc_head_*} + a full block) is deliberately left out
    # for now: only the num_hidden_layers backbone layers are described; the loader skips `mtp.` keys for V4.
    if c.is_v41:
        stages = c.num_draft_layers
        for s in range(stages):
            p = f"mtp.{s}."
            _block(b, p, c.dspark_n_routed_experts, bias_vl=True)
            if s == 0:
                b.add(p + "main_proj.weight", "fp8", d, len(c.dspark_target_layer_ids) * d)
                b.add(p + "main_norm.weight", "bf16", d)
            if s == stages - 1:
                r = c.dspark_markov_rank
                b.add(p + "norm.weight", "bf16", d)
                b.add(p + "markov_head.embed.weight", "bf16", c.vocab_size, r)
                b.add(p + "markov_head.head.weight", "bf16", c.vocab_size, r)
                b.add(p + "confidence_head.proj.weight", "bf16", 1, d + r)
    return b.specs


_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")


def model_name_for(release_name: str) -> tuple[str, int | None]:
    """Model state_dict name for a release tensor, plus the expert index for routed experts.

    ``layers.3.ffn.experts.17.w2.weight`` -> (``layers.3.ffn.experts.w2``, 17); every other name maps to itself.
    A ``.scale`` maps to the weight it is folded into (``attn.wq_b.scale`` -> ``attn.wq_b.weight``)."""
    m = _EXPERT.match(release_name)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    if release_name.endswith(".scale"):
        return release_name.removesuffix(".scale") + ".weight", None
    return release_name, None


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected model state_dict entries: name -> (shape, natural dtype). Experts are stacked [E, n, k];
    quantised weights are dequantised (natural dtype bf16), fp32 tensors stay fp32, tid2eid int32."""
    out: dict = {}
    counts: dict[str, int] = {}
    for name, spec in release_layout(cfg).items():
        if spec.quant == "scale":
            continue
        mname, e = model_name_for(name)
        dt = {"fp32": torch.float32, "int32": torch.int32}.get(spec.quant, torch.bfloat16)
        if e is None:
            out[mname] = (spec.float_shape, dt)
        else:
            counts[mname] = max(counts.get(mname, 0), e + 1)
            out[mname] = ((counts[mname],) + spec.float_shape, dt)
    return out
