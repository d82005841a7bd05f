"""The lightning indexer: scores every visible global entry for each query row and keeps the top-k.

score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) over visible j (j < (p_t + 1) // ratio). V4.1's decoder
adds a hierarchical pool: the candidate source keeps the best ``candidate_topk_blocks`` blocks of
``candidate_block_size`` entries (the block holding the newest entry is always kept), and later index
sources score only inside that pool.
"""

from __future__ import annotations

import torch
from torch import nn

from . import quant
from .norm import RMSNorm
from .numerics import acc
from .rope import Rope

NEG_INF = float("-inf")


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many entries of a ratio-r source a query at each position may read: floor((p + 1) / r)."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k per row with ties to the lower index, returned in ascending index order; -inf picks invalid."""
    k = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    idx = torch.sort(order, dim=-1).values
    valid = torch.gather(scores, -1, idx) > NEG_INF
    return idx, valid


def candidate_pool(scores: torch.Tensor, n_visible: torch.Tensor, block: int, top_blocks: int) -> torch.Tensor:
    """[T, N] bool mask of the entries inside the best blocks; the newest visible block is pinned."""
    t, n = scores.shape
    nb = -(-n // block)
    padded = torch.full((t, nb * block), NEG_INF, dtype=scores.dtype, device=scores.device)
    padded[:, :n] = scores
    bscore = padded.view(t, nb, block).amax(-1)
    newest = torch.div(n_visible - 1, block, rounding_mode="floor")
    # masked, not indexed by the rows that see an entry: no read-back (a training step runs as a CUDA graph)
    pin = (n_visible > 0)[:, None] & (torch.arange(nb, device=scores.device)[None, :] == newest[:, None])
    bscore = bscore.masked_fill(pin, float("inf"))
    bidx, bvalid = stable_topk(bscore, top_blocks)
    keep = torch.zeros(t, nb, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, bidx, bvalid)
    return keep.repeat_interleave(block, dim=1)[:, :n]


class Indexer(nn.Module):
    def __init__(
        self,
        dim: int,
        q_lora_rank: int,
        head_dim: int,
        n_heads: int,
        index_dim: int,
        rope_dim: int,
        eps: float,
        owns_keys: bool,
        owns_query: bool,
        rotate: bool = False,
    ):
        super().__init__()
        self.n_heads, self.index_dim, self.eps = n_heads, index_dim, eps
        if owns_query:
            self.wq_b = nn.Linear(q_lora_rank, n_heads * index_dim, bias=False)
            self.weights_proj = nn.Linear(dim, n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(head_dim, index_dim, bias=False)
            self.k_norm = RMSNorm(index_dim, eps)
        self.rope_dim = rope_dim
        self.rotate = rotate  # V4: Hadamard-rotate q (and k) before FP4; V4.1 has no rotation

    def index_keys(self, latent: torch.Tensor, entry_pos: torch.Tensor, rope: Rope, qat: bool) -> torch.Tensor:
        """V4.1: index keys from the compressor's pre-RoPE latent, rotated at the entry's position."""
        k = rope(self.k_norm(self.wk(latent)), entry_pos, inplace=True)
        return quant.fake_quant_fp4_pow2(k, 32) if qat else k

    def query(
        self,
        x: torch.Tensor,
        q_lat: torch.Tensor,
        positions: torch.Tensor,
        rope: Rope,
        qat: bool,
        ops=None,
        cos_sin=None,
    ):
        """(q [T, heads, dim] rotated and fake-quantised, per-head weights [T, heads] with both scales folded in).
        ops (kernels.ops.KernelOps) with cos_sin (fp32 tables at positions): the RoPE and fake-quant kernels."""
        t = x.shape[0]
        q = self.wq_b(q_lat).view(t, self.n_heads, self.index_dim)
        q = rope(q, positions, inplace=True) if ops is None else ops.rope_inplace(q, *cos_sin)
        if qat:
            q = quant.hadamard_rotate(q) if self.rotate else q
            q = quant.fake_quant_fp4_pow2(q, 32) if ops is None else ops.fake_quant_fp4_pow2(q, 32)
        return q, acc(self.weights_proj(x)) * (self.index_dim**-0.5 * self.n_heads**-0.5)

    def scores(
        self,
        x: torch.Tensor,
        q_lat: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        ratio: int,
        rope: Rope,
        qat: bool,
    ) -> torch.Tensor:
        return self.scores_of(*self.query(x, q_lat, positions, rope, qat), positions, keys, ratio)

    @staticmethod
    def scores_of(
        q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, ratio: int
    ) -> torch.Tensor:
        """[..., T, entries]: ``query``'s (q, w) against one sequence's keys, -inf past each row's visible entries.
        Leading dims (q [..., T, H, D], keys [..., N, D]) batch sequences whose rows sit at the same ``positions``."""
        logits = torch.relu(torch.einsum("...thd,...nd->...thn", acc(q), acc(keys)))
        s = torch.einsum("...thn,...th->...tn", logits, w)
        visible = torch.arange(keys.shape[-2], device=keys.device)[None, :] < visible_entries(positions, ratio)[:, None]
        return s.masked_fill(~visible, NEG_INF)
