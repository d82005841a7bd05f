"""Split-K ("flash-decoding") combine for sparse_attention, plus the de-rotating store both of its kernels share.

With NUM_SPLITS = S > 1, the attention kernel's program (t, head block, s) leaves its share of row t's softmax
un-normalised in fp32 workspaces (log2 domain, every split's running max started at the sink, its sum at 0, so the
sink is counted here once and an empty split contributes exactly nothing):
* m_ws   [T, H, S]     running max of scale * log2(e) * q.k (>= sink * log2(e)).
* l_ws   [T, H, S]     sum of 2^(logit - m) over the split's valid keys (0 when it had none).
* acc_ws [T, H, S, D]  sum of 2^(logit - m) * key; channels stored as D/2 even channels then D/2 odd channels.
The combine takes M = max_s m_s, L = 2^(sink log2e - M) + sum_s l_s 2^(m_s - M), o = sum_s acc_s 2^(m_s - M) / L,
de-rotates o's last R channels at the query position (inverse RoPE) and writes o [T, H, D] in out's dtype.
Cost: one extra launch reading S * D * 4 bytes per (row, head), e.g. 24 splits * 2 KiB at D = 512.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _derotate_store(o, cos, sin, t, offs_h, hm, o_e, o_o, H, D: tl.constexpr, R2: tl.constexpr, BLOCK_H: tl.constexpr):
    """Writes o[t, offs_h] = (o_e, o_o) interleaved [BLOCK_H, D] with the inverse RoPE on the last R2 pairs."""
    D2: tl.constexpr = D // 2
    # Pairs j < D2 - R2 load cos = 1, sin = 0, which leaves them as they are.
    jj = tl.arange(0, D2)
    tail = jj >= D2 - R2
    c = tl.load(cos + t * R2 + jj - (D2 - R2), mask=tail, other=1.0)[None, :]
    s = tl.load(sin + t * R2 + jj - (D2 - R2), mask=tail, other=0.0)[None, :]
    res = tl.reshape(tl.join(o_e * c + o_o * s, o_o * c - o_e * s), [BLOCK_H, D])
    ch = tl.arange(0, D)
    tl.store(o + t * H * D + offs_h[:, None] * D + ch[None, :], res.to(o.dtype.element_ty), mask=hm[:, None])


@triton.jit
def _combine_kernel(
    m_ws,
    l_ws,
    acc_ws,
    sink,
    cos,
    sin,
    o,
    H,
    D: tl.constexpr,
    R2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    # One program per (row, head) reads all its splits as one [S_PAD, D/2] tile per half: the loads are
    # independent (a loop over the splits chained them, which dominated decode at B = 1 on the H200).
    D2: tl.constexpr = D // 2
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_h = h + tl.arange(0, 1)
    sp = tl.arange(0, S_PAD)
    sm = sp < NUM_SPLITS
    ms = (t * H + h) * NUM_SPLITS + sp
    m_s = tl.load(m_ws + ms, mask=sm, other=float("-inf"))
    sink2 = tl.load(sink + h) * 1.4426950408889634
    m_max = tl.maximum(tl.max(m_s, 0), sink2)
    w = tl.exp2(m_s - m_max)  # masked splits: 2^-inf = 0
    l_sum = tl.exp2(sink2 - m_max) + tl.sum(w * tl.load(l_ws + ms, mask=sm, other=0.0), 0)  # sink counted once
    jj = tl.arange(0, D2)
    base = acc_ws + ms[:, None] * D + jj[None, :]
    acc_e = tl.sum(w[:, None] * tl.load(base, mask=sm[:, None], other=0.0), 0)
    acc_o = tl.sum(w[:, None] * tl.load(base + D2, mask=sm[:, None], other=0.0), 0)
    _derotate_store(o, cos, sin, t, offs_h, offs_h < H, (acc_e / l_sum)[None, :], (acc_o / l_sum)[None, :], H, D, R2, 1)


def split_workspace(t, h, s, d, device):
    """Uninitialised fp32 (m_ws, l_ws, acc_ws) for T = t rows, H = h heads, S = s splits, D = d channels."""
    m_ws, l_ws = (torch.empty(t, h, s, dtype=torch.float32, device=device) for _ in range(2))
    return m_ws, l_ws, torch.empty(t, h, s, d, dtype=torch.float32, device=device)


def combine_splits(m_ws, l_ws, acc_ws, sink, cos, sin, out, r2):
    """Merges the S partial softmaxes of m_ws/l_ws [T, H, S], acc_ws [T, H, S, D] (fp32, contiguous; layout above)
    with sink [H] fp32, de-rotates with cos/sin [T, R2] fp32 and writes out [T, H, D] (contiguous, any float dtype)."""
    t, h, s, d = acc_ws.shape
    s_pad = triton.next_power_of_2(s)
    _combine_kernel[(t, h)](
        m_ws,
        l_ws,
        acc_ws,
        sink,
        cos,
        sin,
        out,
        h,
        D=d,
        R2=r2,
        NUM_SPLITS=s,
        S_PAD=s_pad,
        num_warps=8 if s_pad * d >= 8192 else 4,
    )
    return out
