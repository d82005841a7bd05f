"""What a step must cost at least, from a ModelConfig alone: the KV bytes a decode row reads and a prefill chunk's
FLOPs. The H200 benchmarks divide these by measured ceilings (copy GB/s, bf16 matmul TFLOP/s) to state floors and
shares; tests recompute them by hand on a tiny config. Allocates nothing.

Counting rules (spec 2.3-2.5):
- a row at position p sees (p + 1) // ratio global entries of a compressed layer (ratio 0: window only);
- its attention reads its window (min(p + 1, sliding_window) rows) and min(visible, index_topk) selected entries;
- an indexer-owning layer scores index keys: a source (or a plain indexer) every visible entry, a candidate-pool
  consumer at most the pool (candidate_topk_blocks x candidate_block_size);
- the LM head runs on the rows whose logits are needed: one a prefill chunk, every decode row.
"""

from __future__ import annotations

from dsserve.models.accounting import head_params, kv_bytes, param_counts
from dsserve.models.config import ModelConfig


def _backbone(cfg: ModelConfig):
    return cfg.roles[: cfg.num_hidden_layers]


def candidate_pool(cfg: ModelConfig) -> int:
    """Entries a consumer indexer scores at most (0: no candidate pool in this config)."""
    return (cfg.candidate_topk_blocks or 0) * (cfg.candidate_block_size or 0)


def visible_entries(ratio: int, position: int) -> int:
    """Global entries of a layer of this compress ratio that the row at `position` sees."""
    return (position + 1) // ratio if ratio else 0


def index_keys_scored(cfg: ModelConfig, position: int) -> int:
    """Index keys the indexers of all backbone layers score for one row at `position`."""
    pool, n = candidate_pool(cfg), 0
    for role in _backbone(cfg):
        if role.owns_indexer:
            vis = visible_entries(role.ratio, position)
            n += min(vis, pool) if role.candidate == "consumer" and pool else vis
    return n


def attention_keys_read(cfg: ModelConfig, position: int) -> tuple[int, int]:
    """(window rows, selected global entries) the attention of all backbone layers reads for one row."""
    window = selected = 0
    for role in _backbone(cfg):
        window += min(position + 1, cfg.sliding_window)
        selected += min(visible_entries(role.ratio, position), cfg.index_topk)
    return window, selected


def kv_row_bytes(cfg: ModelConfig, context: int) -> dict:
    """Per decode row at `context` cached tokens (its position is `context`): the KV bytes its attention and
    indexers read in the release's packed records (FP8 window rows, FP4 main entries, FP4 index keys), and its
    indexer FLOPs."""
    window, selected = attention_keys_read(cfg, context)
    keys = index_keys_scored(cfg, context)
    rec = kv_bytes(cfg)  # the packed records' sizes for this config (release: 528 / 288 / 68 B)
    return {
        "kv_bytes": window * rec.swa_row + selected * rec.main_entry + keys * rec.index_entry,
        "index_keys": keys,
        "indexer_layers": sum(1 for r in _backbone(cfg) if r.owns_indexer),
        "indexer_flops": keys * cfg.index_n_heads * cfg.index_head_dim * 2,
    }


def prefill_flops(cfg: ModelConfig, context: int, new: int, logit_rows: int = 1) -> float:
    """FLOPs of one prefill chunk of `new` rows on `context` cached tokens: 2 x the active weights a row (every row
    through every layer, as the benchmark's chunks run) outside the LM head, the LM head on `logit_rows` rows (the
    engine computes logits for a chunk's last row only), attention's QK and PV over each row's window and selected
    entries, and the indexers' scores."""
    head = head_params(cfg)
    body = param_counts(cfg).active_decode - head
    att = idx = 0
    for p in range(context, context + new):
        w, s = attention_keys_read(cfg, p)
        att += w + s
        idx += index_keys_scored(cfg, p)
    return (
        2.0 * body * new
        + 2.0 * head * logit_rows
        + att * 4 * cfg.num_attention_heads * cfg.head_dim
        + idx * cfg.index_n_heads * cfg.index_head_dim * 2
    )
