"""Parameter and KV-byte accounting from a ModelConfig alone (spec 1.9, 3, 4, 5.1, 5.2). Allocates nothing.

Shapes follow the checkpoint tables of spec 4 (and 2.4 / 4.5 for V4-Flash), restated here as plain arithmetic.
"Active" counts the weights a token multiplies (top-k routed experts only); table lookups (the embedding row,
Engram table rows) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from .config import LayerRole, ModelConfig

# ------------------------------------------------------------------ per-part shape arithmetic


def _attention(c: ModelConfig) -> int:
    hd = c.num_attention_heads * c.head_dim
    return (
        c.q_lora_rank * c.hidden_size
        + c.q_lora_rank  # wq_a, q_norm
        + hd * c.q_lora_rank  # wq_b
        + c.head_dim * c.hidden_size
        + c.head_dim  # wkv, kv_norm
        + c.o_groups * c.o_lora_rank * (hd // c.o_groups)  # wo_a (block-diagonal, stored [G*o_lora, hd/G])
        + c.hidden_size * c.o_groups * c.o_lora_rank  # wo_b
        + c.num_attention_heads
    )  # attn_sink


def _mhc(c: ModelConfig) -> int:
    """Two mixing sites (attn, ffn), each fn [(2+n)n, n*d], base [(2+n)n], scale [3]."""
    m = (2 + c.hc_mult) * c.hc_mult
    return 2 * (m * c.hc_mult * c.hidden_size + m + 3)


def _hc_head(c: ModelConfig) -> int:
    """V4 only: hc_head_fn [n, n*d], base [n], scale [1]."""
    return c.hc_mult * c.hc_mult * c.hidden_size + c.hc_mult + 1


def _expert(c: ModelConfig) -> int:
    return 3 * c.hidden_size * c.moe_intermediate_size


def _router(c: ModelConfig, n_experts: int, hash_routed: bool = False) -> int:
    n = n_experts * c.hidden_size  # gate.weight
    if not hash_routed:
        n += n_experts  # gate.bias (V4 hash layers have none; tid2eid is an int table, not counted)
    if c.is_v41:
        n += n_experts  # gate.bias_vl
    return n


def _compressor_indexer(c: ModelConfig, role: LayerRole) -> int:
    d, D, idim, ih = c.hidden_size, c.head_dim, c.index_head_dim, c.index_n_heads
    n = 0
    if c.is_v41:
        if role.owns_compressor:
            n += D * d * (2 if role.ratio > 1 else 1) + D  # wkv (+ wgate when pooling), norm
            n += idim * D + idim  # indexer.wk, indexer.k_norm (index K from the latent)
        if role.owns_indexer:
            n += ih * idim * c.q_lora_rank + ih * d  # indexer.wq_b, weights_proj
        return n
    if role.ratio:  # V4: own compressor; overlapping (x2 width) at ratio 4, with APE
        coff = 2 if role.ratio == 4 else 1
        n += 2 * coff * D * d + role.ratio * coff * D + D  # wkv, wgate, ape, norm
        if role.owns_indexer:  # CSA: lightning indexer with its own overlapping compressor
            n += ih * idim * c.q_lora_rank + ih * d
            n += 2 * 2 * idim * d + role.ratio * 2 * idim + idim
    return n


def _engram_proj(c: ModelConfig) -> int:
    """wkv [(n+1)*d, columns*head_dim] + q_weight, k_weight [n, d]."""
    return (c.hc_mult + 1) * c.hidden_size * c.engram_columns * c.engram_head_dim + 2 * c.hc_mult * c.hidden_size


def layer_parts(c: ModelConfig, role: LayerRole) -> dict[str, int]:
    """Parameters of one backbone layer by part (routed experts: all of them; see ``routed_active``)."""
    return {
        "attention": _attention(c),
        "mhc": _mhc(c),
        "norms": 2 * c.hidden_size,
        "router": _router(c, c.n_routed_experts, role.hash_routed),
        "compressor_indexer": _compressor_indexer(c, role),
        "shared_experts": c.n_shared_experts * _expert(c),
        "routed_experts": c.n_routed_experts * _expert(c),
        "routed_active": c.num_experts_per_tok * _expert(c),
        "engram_projections": _engram_proj(c) if role.engram else 0,
    }


def _draft(c: ModelConfig) -> int:
    """V4.1 DSpark stages + heads, or V4 MTP slots."""
    d, V = c.hidden_size, c.vocab_size
    total = 0
    for s in range(c.num_nextn_predict_layers):
        ratio = c.compress_ratios[c.num_hidden_layers + s] if c.num_draft_layers > s else 0
        role = LayerRole(
            index=c.num_hidden_layers + s,
            side="draft",
            ratio=ratio,
            mode="swa",
            kv_source=None,
            index_source=None,
            owns_compressor=False,
            owns_indexer=False,
            candidate=None,
            engram=False,
            dspark_tap=False,
            hash_routed=False,
            yarn=False,
        )
        n_exp = c.dspark_n_routed_experts if c.is_v41 else c.n_routed_experts
        total += (
            _attention(c)
            + _mhc(c)
            + 2 * d
            + _router(c, n_exp)
            + _compressor_indexer(c, role)
            + (c.n_shared_experts + n_exp) * _expert(c)
        )
        if not c.is_v41:  # V3-style MTP: e_proj, h_proj [d, d]; enorm, hnorm, norm; own hc head
            total += 2 * d * d + 3 * d + _hc_head(c)
    if c.is_v41 and c.num_nextn_predict_layers:
        r = c.dspark_markov_rank
        total += d * len(c.dspark_target_layer_ids) * d + d  # main_proj, main_norm
        total += d  # last stage's norm (head shared with the backbone)
        total += 2 * V * r  # markov_head embed, head
        total += d + r  # confidence_head.proj [1, d + r]
    return total


# ------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class ParamCounts:
    parts: dict  # backbone parts (name -> params)
    engram_tables: int
    draft: int  # DSpark (V4.1) or MTP (V4)
    active_prefill: int  # per prompt token (V4.1: CED, encoder + decoder-KV-source global projections)
    active_decode: int  # per generated token (all layers, top-k experts, head)

    @property
    def backbone(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        return self.backbone + self.engram_tables + self.draft


def engram_table_params(c: ModelConfig) -> int:
    if not c.engram_layer_ids:
        return 0
    from ..layers.engram_hash import engram_rows_per_layer

    return sum(engram_rows_per_layer(c).values()) * c.engram_head_dim


def head_params(c: ModelConfig) -> int:
    """The LM head with its final norm (+ V4's hc head): weights a row multiplies only when its logits are needed."""
    return c.vocab_size * c.hidden_size + c.hidden_size + (0 if c.is_v41 else _hc_head(c))


def param_counts(c: ModelConfig) -> ParamCounts:
    d = c.hidden_size
    parts = dict(
        routed_experts=0,
        shared_experts=0,
        attention=0,
        embed_head=2 * c.vocab_size * d + d,
        mhc=0,
        router_compressor_indexer_norms=0,
        engram_projections=0,
    )
    if not c.is_v41:
        parts["mhc"] += _hc_head(c)
    decode = prefill = 0
    for role in c.roles:
        p = layer_parts(c, role)
        for k in ("routed_experts", "shared_experts", "attention", "mhc", "engram_projections"):
            parts[k] += p[k]
        parts["router_compressor_indexer_norms"] += p["router"] + p["compressor_indexer"] + p["norms"]
        act = sum(v for k, v in p.items() if k != "routed_experts")
        decode += act
        if not c.is_v41 or role.side == "encoder":
            prefill += act
        elif role.owns_compressor:
            # decoder KV source (layer 20) runs its global projections on every prompt row: attn_norm,
            # compressor (wkv [+ wgate], norm) and index-K projection (wk, k_norm); the rest runs on the window.
            pooled = c.head_dim * d * (2 if role.ratio > 1 else 1)
            prefill += d + pooled + c.head_dim + c.index_head_dim * c.head_dim + c.index_head_dim
    head = head_params(c)
    return ParamCounts(
        parts=parts,
        engram_tables=engram_table_params(c),
        draft=_draft(c),
        active_prefill=prefill,
        active_decode=decode + head,
    )


# ------------------------------------------------------------------ KV bytes


@dataclass(frozen=True)
class KVBytes:
    main_per_token: float  # global compressed main KV, all sources, bytes per token
    index_per_token: float  # global index K
    swa_row: int  # one SWA ring row
    swa_per_sequence: int  # all backbone layers' rings, full window
    draft_swa_per_sequence: int  # DSpark / MTP rings
    compressor_state_per_sequence: int  # carried compressor partial groups (fp32)
    bf16_main_per_token: float  # debug layout: BF16 main + BF16 index
    bf16_index_per_token: float
    main_entry: int
    index_entry: int

    @property
    def global_per_token(self) -> float:
        return self.main_per_token + self.index_per_token

    @property
    def bf16_global_per_token(self) -> float:
        return self.bf16_main_per_token + self.bf16_index_per_token


def kv_bytes(c: ModelConfig) -> KVBytes:
    D, idim, W = c.head_dim, c.index_head_dim, c.sliding_window
    index_entry = idim // 2 + ceil(idim / 32)  # FP4 e2m1 + one ue8m0 scale per 32
    main = index = bf_main = bf_index = 0.0
    state = 0
    if c.is_v41:
        main_entry = D // 2 + ceil(D / 16)  # FP4 e2m1 + one E4M3 scale per 16 channels
        swa_row = D + ceil(D / 32)  # FP8 + one power-of-two scale byte per 32
        for s in c.kv_source_layer_ids:
            r = c.compress_ratios[s]
            main += main_entry / r
            index += index_entry / r
            bf_main += 2 * D / r
            bf_index += 2 * idim / r
            state += (r - 1) * 2 * D * 4  # pending tokens' u and z, fp32
    else:
        nope = D - c.qk_rope_head_dim  # [inferred, spec 3.4] FP8 nope + BF16 rope + scale per 64, 8-byte aligned
        main_entry = swa_row = ceil((nope + 2 * c.qk_rope_head_dim + ceil(nope / 64)) / 8) * 8
        for role in c.roles:
            if not role.ratio:
                continue
            coff = 2 if role.ratio == 4 else 1
            main += main_entry / role.ratio
            bf_main += 2 * D / role.ratio
            state += 2 * coff * role.ratio * coff * D * 4  # reference kv_state + score_state buffers
            if role.owns_indexer:
                index += index_entry / role.ratio
                bf_index += 2 * idim / role.ratio
                state += 2 * 2 * role.ratio * 2 * idim * 4
    return KVBytes(
        main_per_token=main,
        index_per_token=index,
        swa_row=swa_row,
        swa_per_sequence=c.num_hidden_layers * W * swa_row,
        draft_swa_per_sequence=c.num_nextn_predict_layers * W * swa_row,
        compressor_state_per_sequence=state,
        bf16_main_per_token=bf_main,
        bf16_index_per_token=bf_index,
        main_entry=main_entry,
        index_entry=index_entry,
    )
