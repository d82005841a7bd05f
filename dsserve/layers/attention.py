"""CSA2 attention (spec 2.3): a per-layer sliding window plus sparse reads of a shared compressed KV.

Every mode keeps its own query and its own window KV (one latent, K = V). What differs is what the layer
computes for the long range: a Full layer compresses its input into the global KV and runs its indexer;
a Reindex layer runs only its indexer query against the source's keys; a Reuse layer takes the latest
top-k as published. V4 layers own their compressor; its ratio-128 (HCA) layers read every visible entry.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.config import LayerRole, ModelConfig
from . import quant
from .compressor import Compressor
from .context import ForwardContext
from .indexer import NEG_INF, Indexer, candidate_pool, stable_topk, visible_entries
from .norm import RMSNorm, rms_norm
from .numerics import acc
from .rope import Rope, RopeSpec

# A chunk of more rows than this many windows reads its window in blocks (``banded_attention_with_sink``), not as the
# masked square of ``sparse_attention_with_sink``. Measured on the CPU (1 thread, W = 32, 4 heads of 64, 16 selected
# entries): the square is cheaper up to ~120 rows (the blocks' ops cost ~0.15 ms more), 2.5x dearer at 256, 14x at
# 1024. Decode and verify steps (1-7 rows) always take the square.
BANDED_FROM_WINDOWS = 4


def rope_for(cfg: ModelConfig, role: LayerRole) -> Rope:
    if role.yarn:
        return Rope(
            RopeSpec(
                cfg.qk_rope_head_dim,
                cfg.compress_rope_theta,
                cfg.yarn_factor,
                cfg.yarn_original_max_position,
                cfg.yarn_beta_fast,
                cfg.yarn_beta_slow,
            )
        )
    return Rope(RopeSpec(cfg.qk_rope_head_dim, cfg.rope_theta))


def sparse_attention_with_sink(q, win_k, win_mask, sel_k, sel_mask, sink, scale):
    """Softmax over [window keys ; selected entries] with a per-head sink in the denominator only.

    q [T, H, D]; win_k [Nw, D] with win_mask [T, Nw]; sel_k [T, K, D] with sel_mask [T, K]; sink [H].
    Values are the keys (K = V). Returns o [T, H, D] in fp32.
    """
    q, win_k = acc(q), acc(win_k)
    lw = torch.einsum("thd,nd->thn", q, win_k) * scale
    parts = [lw.masked_fill(~win_mask[:, None, :], NEG_INF)]
    if sel_k is not None:
        sel_k = acc(sel_k)
        ls = torch.einsum("thd,tkd->thk", q, sel_k) * scale
        parts.append(ls.masked_fill(~sel_mask[:, None, :], NEG_INF))
    t, h = q.shape[:2]
    parts.append(sink.to(q.dtype)[None, :, None].expand(t, h, 1))
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    nw = win_k.shape[0]
    o = torch.einsum("thn,nd->thd", p[..., :nw], win_k)
    if sel_k is not None:
        o = o + torch.einsum("thk,tkd->thd", p[..., nw:-1], sel_k)
    return o


def window_mask(key_pos: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
    """[T, N]: which of the window keys at ``key_pos`` [N] the rows at ``pos`` [T] read: at or before the row, within
    ``window`` of it; a paged ring's empty rows carry position -1."""
    k, p = key_pos[None, :], pos[:, None]
    return (k <= p) & (k > p - window) & (k >= 0)


def banded_attention_with_sink(
    q, keys, window, entries, entry_mask, sink, scale, first=None, history=None, history_mask=None
):
    """``sparse_attention_with_sink`` for S sequences of L rows each at consecutive positions: row t reads its
    window's keys (its sequence's rows t - W + 1 .. t; keys [S, L, D]) and its entries: every sequence's own
    [S, N, D] under entry_mask [L, N] or [S, L, N] (the dense mode), or each row's own [S, L, K, D] under [S, L, K]
    (a top-k), or none. ``history`` [S, M, D] under ``history_mask`` [S, L, M]: keys every row may read beside its
    band, under a mask of its own (a chunk's cached window rows, in any order; the dense mode's entries).
    q [S, L, H, D]; ``first`` [S, L] (packed problems): no key before row t's ``first`` is read. Returns o in fp32.
    The window is read in blocks of W rows, each against the 2W keys that block can see, not as an [L, L] masked
    square: the same sums, ~L / 2W times fewer bytes, in products of a useful size."""
    q, keys = acc(q), acc(keys)
    s, n, h, d = q.shape
    blocks = -(-n // window)
    padded = blocks * window
    # block c's queries are rows cW .. cW + W - 1, its keys rows cW - W .. cW + W - 1 (zeros before row 0)
    kp = torch.cat((keys.new_zeros(s, window, d), keys, keys.new_zeros(s, padded - n, d)), 1)
    kb = kp.unfold(1, 2 * window, window).transpose(-1, -2)  # [S, C, 2W, D]
    qb = torch.cat((q, q.new_zeros(s, padded - n, h, d)), 1).view(s, blocks, window, h, d)
    w, k = torch.arange(window, device=q.device), torch.arange(2 * window, device=q.device)
    c = torch.arange(blocks, device=q.device)
    key_pos = c[:, None] * window - window + k[None, :]  # [C, 2W]
    sees = ((k[None, :] > w[:, None]) & (k[None, :] <= w[:, None] + window))[None] & (key_pos[:, None, :] >= 0)
    sees = sees[None]  # [1, C, W, 2W]
    if first is not None:  # [S, C, W, 2W]
        fb = torch.cat((first, first.new_zeros(s, padded - n)), 1).view(s, blocks, window)
        sees = sees & (key_pos[None, :, None, :] >= fb[..., None])
    lw = torch.einsum("scwhd,sckd->scwhk", qb, kb) * scale
    parts = [lw.masked_fill(~sees[:, :, :, None, :], NEG_INF).view(s, padded, h, 2 * window)[:, :n]]
    reads = []  # (keys, mask [S or 1, L, n], one set per row)
    if history is not None:
        reads.append((acc(history), history_mask, False))
    if entries is not None:
        rowwise = entries.dim() == 4
        reads.append((acc(entries), entry_mask if rowwise or entry_mask.dim() == 3 else entry_mask[None], rowwise))
    for ek, em, rowwise in reads:
        le = torch.einsum("slhd,slkd->slhk" if rowwise else "slhd,snd->slhn", q, ek) * scale
        parts.append(le.masked_fill(~em[:, :, None, :], NEG_INF))
    parts.append(sink.to(q.dtype)[:, None].expand(s, n, h, 1))
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    pw = torch.cat((p[..., : 2 * window], p.new_zeros(s, padded - n, h, 2 * window)), 1)
    o = torch.einsum("scwhk,sckd->scwhd", pw.view(s, blocks, window, h, 2 * window), kb).reshape(s, padded, h, d)[:, :n]
    at = 2 * window
    for ek, _, rowwise in reads:
        pe, at = p[..., at : at + ek.shape[-2]], at + ek.shape[-2]
        o = o + torch.einsum("slhk,slkd->slhd" if rowwise else "slhn,snd->slhd", pe, ek)
    return o


def chunk_attention_with_sink(q, kv, pos, old_k, old_p, entries, seen, sel_k, sel_mask, sink, scale, window):
    """One sequence's rows of a step (q [T, H, D], their window keys kv [T, D] at consecutive positions ``pos``)
    against its window: the cached rows ``old_k`` [n, D] at ``old_p`` (any order; a paged ring's empty rows at -1;
    or None), then its own rows; plus the dense mode's ``entries`` [N, D] under ``seen`` [T, N] and each row's
    selected ``sel_k`` [T, K, D] under ``sel_mask`` [T, K] (each may be None). A few rows (decode, verify) read the
    masked square (``sparse_attention_with_sink``); a chunk of more than ``BANDED_FROM_WINDOWS`` windows reads its own
    rows in blocks (``banded_attention_with_sink``), the cached rows and entries beside them under their own masks:
    the same sums, T x (2W + n + N) a head where the square costs T x (T + n + N)."""
    if q.shape[0] > BANDED_FROM_WINDOWS * window:
        hist = [(old_k.to(kv.dtype), window_mask(old_p, pos, window))] if old_k is not None else []
        if entries is not None:
            hist.append((entries, seen))
        history = history_mask = None
        if hist:
            history = torch.cat([k for k, _ in hist])[None]
            history_mask = torch.cat([m for _, m in hist], 1)[None]
        sel = (None, None) if sel_k is None else (sel_k[None], sel_mask[None])
        return banded_attention_with_sink(
            q[None], kv[None], window, *sel, sink, scale, history=history, history_mask=history_mask
        )[0]
    win_k = kv if old_k is None else torch.cat((old_k.to(kv.dtype), kv))
    win_mask = window_mask(pos if old_p is None else torch.cat((old_p, pos)), pos, window)
    if entries is not None:
        win_k, win_mask = torch.cat((win_k, entries)), torch.cat((win_mask, seen), 1)
    return sparse_attention_with_sink(q, win_k, win_mask, sel_k, sel_mask, sink, scale)


class CSA2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, role: LayerRole):
        super().__init__()
        self.cfg, self.role = cfg, role
        d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * hd, bias=False)
        self.wkv = nn.Linear(d, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, d, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        self.rope = rope_for(cfg, role)
        v4 = not cfg.is_v41
        self.compressor = (
            Compressor(d, hd, role.ratio, cfg.rms_norm_eps, overlap=v4 and role.ratio == 4, ape=v4)
            if role.owns_compressor
            else None
        )
        self.indexer = None
        if role.owns_indexer:
            self.indexer = Indexer(
                d,
                cfg.q_lora_rank,
                hd,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.qk_rope_head_dim,
                cfg.rms_norm_eps,
                owns_keys=role.owns_compressor and cfg.is_v41,
                owns_query=True,
                rotate=not cfg.is_v41,
            )
            if v4:  # V4's indexer compresses its own keys from the hidden states
                self.indexer.compressor = Compressor(
                    d, cfg.index_head_dim, role.ratio, cfg.rms_norm_eps, overlap=True, ape=True
                )

    # ------------------------------------------------------------------ global KV (KV sources)
    def compress(self, x: torch.Tensor, ctx: ForwardContext) -> None:
        """Pool this layer's input into new global entries and publish them to each sequence's cache."""
        ctx.log(self.role.index, "compressor")
        if ctx.paged is not None and self.cfg.is_v41:  # V4's compressors (overlap, APE) pool per sequence
            from .compress_paged import compress_paged

            return compress_paged(self, x, ctx)
        if getattr(ctx.paged, "is_decode", False):  # V4 in a fixed-shape decode step
            from .compress_v4_decode import compress_decode_v4

            return compress_decode_v4(self, x, ctx)
        r = self.role.ratio
        work = []  # (cache, first row in x, end row, position of the first row) of each sequence with rows to pool
        for seq in ctx.seqs:
            if seq.rows.stop == seq.rows.start:
                continue
            first = seq.first if seq.first is not None else int(ctx.positions[seq.rows.start])
            # Entries below ``published_until`` came from the prefix cache: read-only. At an odd boundary
            # the last cached raw row is pooled again to rebuild the carried half-group; an overlapping
            # compressor (V4's ratio 4) also pools the group before it again (layout.resume_rows).
            pub = seq.cache.published_until
            start = max(first, pub - pub % r - (r if self.compressor.overlap and pub >= r else 0))
            if start < first + seq.rows.stop - seq.rows.start:
                work.append((seq.cache, seq.rows.start + start - first, seq.rows.stop, start))
        if work:
            self._compress_seqs(x, work, ctx.qat, ctx.ops)

    def _compress_seqs(self, x: torch.Tensor, work: list, qat: bool, ops=None) -> None:
        """Pools each sequence's rows with its carried state, then normalises, rotates, fake-quantises and publishes
        the new entries of all of them at once (row-wise ops: per sequence they only cost launches). ops: V4's RoPE
        and fake quants as kernels."""
        layer, r = self.role.index, self.role.ratio
        icomp = None if self.cfg.is_v41 or self.indexer is None else self.indexer.compressor
        uz = self.compressor.project(x) if r > 1 else None  # every row's projections in one product
        iuz = None if icomp is None else icomp.project(x)
        latents, iks, positions, counts = [], [], [], []
        for cache, a, b, start in work:
            emitted = cache.num_entries(layer)
            latent, pend = self.compressor(
                x[a:b],
                start,
                cache.pending(layer),
                emitted,
                None if uz is None else (uz[0][a:b], uz[1][a:b]),
                norm=False,
            )
            if r > 1:
                cache.set_pending(layer, pend)
            if icomp is not None:  # V4: the indexer's own compressor, with a pending slot of its own
                ik, ipend = icomp(
                    x[a:b], start, cache.pending(-1 - layer), emitted, (iuz[0][a:b], iuz[1][a:b]), norm=False
                )
                cache.set_pending(-1 - layer, ipend)
                iks.append(ik)
            latents.append(latent)
            # made on the device: no upload, so a training step can run as a CUDA graph
            positions.append(torch.arange(emitted * r, (emitted + latent.shape[0]) * r, r, device=x.device))
            counts.append(latent.shape[0])
        latent = self.compressor.norm(torch.cat(latents))  # row-wise: once for every sequence's new entries
        entry_pos = torch.cat(positions)
        v4_ops = None if self.cfg.is_v41 else ops  # V4.1's compressed entries come through compress_paged's kernels
        tables = None if v4_ops is None else self.rope.kernel_tables(entry_pos, latent.dtype)
        main = self.rope(latent, entry_pos) if v4_ops is None else v4_ops.rope_inplace(latent, *tables)
        if qat:  # V4.1's main KV is FP4 with E4M3 scales per 16; V4's is FP8 like its window
            main = quant.fake_quant_fp4_e4m3scale(main, 16) if self.cfg.is_v41 else self._kv_qat(main, True, v4_ops)
        index_k = None
        if self.cfg.is_v41:
            index_k = self.indexer.index_keys(latent.detach(), entry_pos, self.rope, qat)
        elif icomp is not None:
            ik = icomp.norm(torch.cat(iks))
            index_k = self.rope(ik, entry_pos) if v4_ops is None else v4_ops.rope_inplace(ik, *tables)
            if qat:
                fq = quant.fake_quant_fp4_pow2 if v4_ops is None else v4_ops.fake_quant_fp4_pow2
                index_k = fq(quant.hadamard_rotate(index_k), 32)
        mains = main.split(counts)
        index_ks = [None] * len(counts) if index_k is None else index_k.split(counts)
        for (cache, *_), m, ik in zip(work, mains, index_ks):
            cache.push_global(layer, m, ik)

    # ------------------------------------------------------------------ the layer
    def query(self, x: torch.Tensor, pos: torch.Tensor, ops=None, cos_sin=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_lat [T, q_lora], rotated q [T, H, D]); V4 also normalises each head, without a weight. ops (the
        batched path's kernels.ops.KernelOps) with cos_sin (its fp32 tables at pos): the norm and RoPE kernels."""
        cfg = self.cfg
        if ops is None:
            q_lat = self.q_norm(self.wq_a(x))
        else:
            q_lat = ops.rms_norm(self.wq_a(x), self.q_norm.weight, self.q_norm.eps)
        q = self.wq_b(q_lat).view(x.shape[0], cfg.num_attention_heads, cfg.head_dim)
        if not cfg.is_v41:
            q = rms_norm(q, None, cfg.rms_norm_eps) if ops is None else ops.rms_norm(q, None, cfg.rms_norm_eps)
        if ops is None:
            return q_lat, self.rope(q, pos, inplace=True)
        return q_lat, ops.rope_inplace(q, *cos_sin)

    def window_entry(self, x: torch.Tensor, pos: torch.Tensor, qat: bool, ops=None, cos_sin=None) -> torch.Tensor:
        """The row's own K = V latent for the sliding window, post-RoPE, FP8 fake-quantised under QAT. ops with
        cos_sin (as ``query``): the norm and RoPE kernels."""
        if ops is None:
            return self._kv_qat(self.rope(self.kv_norm(self.wkv(x)), pos, inplace=True), qat)
        kv = ops.rms_norm(self.wkv(x), self.kv_norm.weight, self.kv_norm.eps)
        return self._kv_qat(ops.rope_inplace(kv, *cos_sin), qat, ops)

    def _kv_qat(self, kv: torch.Tensor, qat: bool, ops=None) -> torch.Tensor:
        """V4.1 stores all 512 channels FP8 (per 32); V4 stores the non-RoPE channels FP8 (per 64), RoPE in BF16.
        ops (kernels.ops.KernelOps): the fake quant in one launch."""
        if not qat:
            return kv
        fq = quant.fake_quant_fp8_pow2 if ops is None else ops.fake_quant_fp8_pow2
        if self.cfg.is_v41:
            return fq(kv, 32)
        rd = self.cfg.qk_rope_head_dim
        group = math.gcd(self.cfg.nope_head_dim, 64)  # 64 in the release (448 = 7 x 64); smaller in tiny shapes
        return torch.cat((fq(kv[..., :-rd], group), kv[..., -rd:]), dim=-1)

    def output(self, o: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype, ops=None, cos_sin=None) -> torch.Tensor:
        """De-rotate (V = K carries RoPE; only relative offsets remain), then the grouped low-rank projection:
        wo_a is block-diagonal over the head groups. ops with cos_sin (as ``query``; o a fresh contiguous tensor):
        the RoPE kernel turning by -theta."""
        if ops is None:
            return self.project(self.rope(o, pos, inverse=True).to(dtype))
        return self.project(ops.rope_inplace(o, cos_sin[0], -cos_sin[1]).to(dtype))

    def project(self, o: torch.Tensor) -> torch.Tensor:
        """[T, H, D] de-rotated attention output -> [T, hidden]."""
        t, g = o.shape[0], self.cfg.o_groups
        if not isinstance(self.wo_a, nn.Linear):  # an Fp8Linear (--quantization fp8, groups = o_groups): the grouped
            return self.wo_b(self.wo_a(o.view(t, -1)))  # product; not imported here: layers load no Triton module
        u = torch.einsum("tgi,goi->tgo", o.view(t, g, -1), self.wo_a.weight.view(g, self.cfg.o_lora_rank, -1))
        return self.wo_b(u.flatten(1))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.paged is not None:
            from .attention_paged import forward_paged  # the batched kernel path over the paged pools

            return forward_paged(self, x, ctx)
        cfg, role, pos = self.cfg, self.role, ctx.positions
        # with kernel ops (a cache the paged path cannot read, e.g. V4's fp32 rows on a GPU): the query's norms and
        # RoPE as kernels
        ops = ctx.ops
        cos_sin = None if ops is None else self.rope.kernel_tables(pos, x.dtype)
        q_lat, q = self.query(x, pos, ops, cos_sin)
        kv = self.window_entry(x, pos, ctx.qat, ops, cos_sin)
        o = torch.empty(q.shape, dtype=acc(q).dtype, device=q.device)
        select = role.ratio and (self.indexer is not None or role.index_source is None) and not ctx.dense_entries
        index_q = None
        if self.indexer is not None:
            ctx.log(role.index, "indexer")
            # the index query of every row at once (row-wise: the same as per sequence, fewer launches)
            # detached: the indexer learns from its own loss (_index_kl) and teaches the layer nothing
            index_q = self.indexer.query(x.detach(), q_lat.detach(), pos, self.rope, ctx.qat, ops, cos_sin)
            ctx.topk = [None] * len(ctx.seqs)
            if role.candidate == "source":
                ctx.candidates = [None] * len(ctx.seqs)
        elif role.ratio and role.index_source is not None:
            ctx.log(role.index, "reuse")
        if ctx.static and self._one_shape(ctx.seqs):
            return self.output(self._attend_one_shape(q, kv, index_q, select, ctx), pos, x.dtype, ops, cos_sin)
        if ctx.segment_first is not None:
            raise ValueError(
                "packed problems (segment_first) are isolated only in a static step of fresh sequences of one length"
            )
        for i, seq in enumerate(ctx.seqs):
            r = seq.rows
            if r.stop == r.start:
                continue
            cache, p = seq.cache, pos[r]
            sel = None
            if role.ratio:
                index_k = None if self.indexer is None else cache.global_kv(role.kv_source)[1]
                iq = None if index_q is None else (index_q[0][r], index_q[1][r])
                sel = (
                    self._select(i, iq, p, index_k, cache, ctx)
                    if select
                    else None
                    if ctx.dense_entries
                    else ctx.topk[i]
                )
                if ctx.index_kl is not None and iq is not None and index_k.shape[0]:  # training the indexer
                    ctx.index_kl.append(self._index_kl(q[r], iq, p, index_k, cache.global_kv(role.kv_source)[0]))
            old_k, old_p = cache.window_rows(role.index)
            cache.push_window(role.index, kv[r], p)
            entries = seen = None
            if role.ratio and ctx.dense_entries:  # every visible entry, as keys beside the window's
                entries = cache.global_kv(role.kv_source)[0].to(kv.dtype)
                seen = torch.arange(entries.shape[0], device=p.device) < visible_entries(p, role.ratio)[:, None]
            sel_k = sel_mask = None
            if sel is not None and sel[0].shape[1]:
                sel_k, sel_mask = cache.global_kv(role.kv_source)[0].to(kv.dtype)[sel[0]], sel[1]
            o[r] = chunk_attention_with_sink(
                q[r],
                kv[r],
                p,
                old_k,
                old_p,
                entries,
                seen,
                sel_k,
                sel_mask,
                self.attn_sink,
                cfg.head_dim**-0.5,
                cfg.sliding_window,
            )
        return self.output(o, pos, x.dtype, ops, cos_sin)

    @staticmethod
    def _one_shape(seqs) -> bool:
        """The sequences are fresh (from position 0) and of one length, laid out one after another."""
        n = seqs[0].rows.stop - seqs[0].rows.start
        return n > 0 and all(
            s.first == 0 and s.rows.start == i * n and s.rows.stop == (i + 1) * n for i, s in enumerate(seqs)
        )

    def _attend_one_shape(self, q, kv, index_q, select: bool, ctx: ForwardContext) -> torch.Tensor:
        """The training step's sequences (``_one_shape``) attend as one [S, L, ...] batch, and each row reads its window
        in blocks (``banded_attention_with_sink``) where the loop in ``forward`` builds an [L, L] mask: the same sums,
        in ops that do not grow with S (~2 K a sequence through the loop, forward and backward, the tiny shape) and
        bytes that grow with L x (2W + entries read), not L x L."""
        role, seqs, cfg = self.role, ctx.seqs, self.cfg
        s, n = len(seqs), seqs[0].rows.stop
        p = ctx.positions[:n]  # every sequence's
        first = None if ctx.segment_first is None else ctx.segment_first.view(s, n)
        for seq in seqs:
            seq.cache.push_window(role.index, kv[seq.rows], p)
        q = q.view(s, n, *q.shape[1:])
        entries = entry_mask = None
        if role.ratio:
            main = torch.stack([seq.cache.global_kv(role.kv_source)[0] for seq in seqs]).to(kv.dtype)
            index_k, iq, own = None, None, None
            if first is not None:  # [S, L, N]: the entries of each row's own problem (starts align with entries)
                own = torch.arange(main.shape[1], device=p.device)[None, None, :] * role.ratio >= first[..., None]
            if self.indexer is not None:
                index_k = torch.stack([seq.cache.global_kv(role.kv_source)[1] for seq in seqs])
                iq = tuple(t.view(s, n, *t.shape[1:]) for t in index_q)
                if ctx.index_kl is not None and main.shape[1]:  # training the indexer
                    ctx.index_kl.extend(self._index_kl(q, iq, p, index_k, main, own).unbind(0))
            n_vis = visible_entries(p, role.ratio)
            every = torch.arange(main.shape[1], device=p.device) < n_vis[:, None]
            every = every if own is None else every & own
            if ctx.dense_entries:  # as the loop, even with no entry yet (their source's weights get a zero gradient)
                entries, entry_mask = main, every
            elif select and self.indexer is None:  # V4 HCA: every visible entry is its top-k
                entries, entry_mask = (main, every) if main.shape[1] else (None, None)
            else:
                idx, valid = (
                    self._select_rows(iq, p, index_k, n_vis, ctx, own)
                    if select
                    else (torch.stack([t[0] for t in ctx.topk]), torch.stack([t[1] for t in ctx.topk]))
                )
                if idx.shape[-1]:
                    entries = main[torch.arange(s, device=p.device)[:, None, None], idx]  # [S, L, K, D]
                    entry_mask = valid
        o = banded_attention_with_sink(
            q, kv.view(s, n, -1), cfg.sliding_window, entries, entry_mask, self.attn_sink, cfg.head_dim**-0.5, first
        )
        return o.flatten(0, 1)

    def _select_rows(self, index_q, pos, index_k, n_vis, ctx: ForwardContext, own=None):
        """``_select`` for the one-shape batch: the indexer's top-k of every row of every sequence at once (candidate
        pools and top-k are row-wise); published per sequence, as the loop publishes them. ``own`` [S, L, N]: the
        entries each row may read (its packed problem's); the pinned newest block may then lie in an earlier problem,
        but its entries stay unread (the consumers' scores are masked by ``own`` too)."""
        role, cfg = self.role, self.cfg
        s, n = index_q[0].shape[:2]
        scores = self.indexer.scores_of(*index_q, pos, index_k, role.ratio)
        scores = (scores if own is None else scores.masked_fill(~own, NEG_INF)).flatten(0, 1)  # [S x L, N]
        if role.candidate == "source":
            pool = candidate_pool(scores, n_vis.repeat(s), cfg.candidate_block_size, cfg.candidate_topk_blocks)
            ctx.candidates = list(pool.view(s, n, -1).unbind(0))
        elif role.candidate == "consumer":
            scores = scores.masked_fill(~torch.stack(ctx.candidates).flatten(0, 1), NEG_INF)
        idx, valid = (t.view(s, n, -1) for t in stable_topk(scores, cfg.index_topk))
        ctx.topk = list(zip(idx.unbind(0), valid.unbind(0)))
        return idx, valid

    def _index_kl(self, q, index_q, pos, index_k, main_k, own=None) -> torch.Tensor:
        """KL(P || Q) averaged over the rows that see an entry: P the main attention's distribution over the visible
        entries (softmax per head, averaged over heads; no gradient), Q the indexer's softmax over its scores: the
        dense-attention distillation DeepSeek trained its sparse attention's indexer with. Leading dims of q, index_q,
        index_k and main_k batch sequences of one shape: one KL each. ``own``: the entries each row may read."""
        s = self.indexer.scores_of(*index_q, pos, index_k, self.role.ratio)
        s = s if own is None else s.masked_fill(~own, NEG_INF)
        finite = torch.isfinite(s)
        seen = finite.any(-1)
        # masked, not indexed: no read-back, so a training step can run as a CUDA graph (rows that see no entry get
        # finite stand-ins, then weight 0)
        with torch.no_grad():
            scale = self.cfg.head_dim**-0.5
            logits = torch.einsum("...thd,...nd->...thn", acc(q), acc(main_k).to(acc(q).dtype)) * scale
            logits = logits.masked_fill(~finite[..., None, :], float("-inf")).masked_fill(~seen[..., None, None], 0.0)
            p = torch.softmax(logits, -1).mean(-2)
        log_q = torch.log_softmax(s.masked_fill(~seen[..., None], 0.0), -1)
        kl = (p * (torch.log(p.clamp_min(1e-30)) - log_q.clamp_min(-1e30))).sum(-1)
        return (kl * seen).sum(-1) / seen.sum(-1).clamp_min(1)

    def _select(self, i, index_q, pos, index_k, cache, ctx: ForwardContext):
        """Top-k entries for one sequence's rows: every visible entry (V4 HCA), or the indexer's choice from its
        rows' (index q, weights) ``index_q``."""
        role, cfg = self.role, self.cfg
        if self.indexer is None:  # V4 HCA: dense over the visible entries
            n = cache.num_entries(role.kv_source)
            idx = torch.arange(n, device=pos.device).expand(pos.shape[0], n)
            return idx, idx < visible_entries(pos, role.ratio)[:, None]
        s = self.indexer.scores_of(*index_q, pos, index_k, role.ratio)
        if role.candidate == "source":
            n_vis = visible_entries(pos, role.ratio)
            ctx.candidates[i] = candidate_pool(s, n_vis, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        elif role.candidate == "consumer":
            s = s.masked_fill(~ctx.candidates[i], NEG_INF)
        ctx.topk[i] = stable_topk(s, cfg.index_topk)
        return ctx.topk[i]
