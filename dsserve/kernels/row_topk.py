"""Stable top-k of rows of up to MAX_N scores in one Triton program per row (the indexer's decode hot path).

* row_topk(scores [T, N] fp32/bf16/fp16, any strides, N <= MAX_N, k >= 0)
  -> (idx int64 [T, min(k, N)] ascending, valid bool [T, min(k, N)]), bit for bit topk / stable_topk
  (dsserve.kernels.topk): the k largest scores, ties to the LOWER index, -inf picked last (lowest indices first)
  and marked invalid (valid = score > -inf). NaN, whatever its sign or payload, ranks above +inf and is marked
  invalid, as torch.sort orders it in stable_topk: a row of garbage still gets exactly min(k, N) in-range indices
  (the GPU's NaN, 0x7FFFFFFF, was once the largest key and left every slot unwritten). The reference is topk
  (== stable_topk); callers send longer rows and fp64 scores to it.

Algorithm (one program holds its whole row in registers, padded to a power of two BLOCK >= N):
1. key = the order-preserving int32 key of topk's docstring (sign 0: the bits, sign 1: low 31 bits flipped), with
   -0.0 folded onto +0.0 by its bit pattern (no `+ 0.0`, which a compiler may drop), every NaN onto INT32_MAX (by
   its bits too: a compiler may fold x != x); padding lanes get INT32_MIN, below every real key (-inf is
   0x807FFFFF), so they are never counted above a real threshold nor selected.
2. If at most k scores are finite the cut is -inf itself: no search. Otherwise a bitwise radix select finds the
   k-th largest key t from the top bit down, one tl.sum of a comparison per bit, on v = key ^ INT32_MIN (unsigned
   order, so the search is plain bit setting). It stops as soon as some candidate threshold has exactly k keys at
   or above it: those k are the answer whatever the lower bits are. That happens at the highest bit where the
   k-th and (k+1)-th largest keys differ (about 20 of the 32 passes for continuous scores); only a tie at the
   cut runs all 32. Loop trip counts are constexpr; later passes are skipped by a uniform branch.
3. Selection: key > t, plus the first r = k - #(key > t) keys == t in index order. One inclusive scan of
   (gt << 16) + eq gives both running counts (BLOCK <= 2^15 keeps them apart); a selected element's output slot is
   #gt-so-far + min(#eq-so-far, r) - 1, so the k indices are written compacted and ascending, each exactly once.
Counts are int32 and all lanes of a pass are summed at once, so the result does not depend on num_warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_N = 16384
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)  # every NaN's key
_POS_INF_BITS = tl.constexpr(0x7F800000)
_KEY_NEG_INF = tl.constexpr(-2139095041)  # key of -inf: bits 0xFF800000 ^ 0x7FFFFFFF = 0x807FFFFF


# entry and pick counts, and the scores' row stride (an entry count too): new ones each step; masks, small outputs
@triton.jit(do_not_specialize=["stride_t", "n", "k"])
def _row_topk_kernel(
    s_ptr,
    stride_t,
    stride_n,
    idx_ptr,
    valid_ptr,
    n,
    k,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr = 1,
    KP: tl.constexpr = 16,
):
    # CHUNKS > 1 (chunk_topk): program p takes chunk p % CHUNKS of row p // CHUNKS (BLOCK scores from
    # (p % CHUNKS) * BLOCK); its k output slots hold that chunk's top min(k, chunk length), global indices, then -1.
    out_row = tl.program_id(0).to(tl.int64)
    row, c0 = out_row // CHUNKS, (out_row % CHUNKS) * BLOCK
    offs = tl.arange(0, BLOCK)
    inb = offs < n - c0
    if CHUNKS > 1:
        k_all = k
        k = tl.minimum(k_all, tl.minimum(n - c0, BLOCK)).to(tl.int32)
        tail = tl.arange(0, KP)
        tl.store(idx_ptr + out_row * k_all + tail, tl.full([KP], -1, tl.int64), mask=(tail >= k) & (tail < k_all))
        tl.store(valid_ptr + out_row * k_all + tail, tl.zeros([KP], tl.int8), mask=(tail >= k) & (tail < k_all))
    else:
        k_all = k
    x = tl.load(s_ptr + row * stride_t + (c0 + offs).to(tl.int64) * stride_n, mask=inb, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _INT32_MIN, 0, bits)  # -0.0 ties +0.0, as the float compare says
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where((bits & 0x7FFFFFFF) > _POS_INF_BITS, _INT32_MAX, key)
    key = tl.where(inb, key, _INT32_MIN)

    n_fin = tl.sum((key > _KEY_NEG_INF).to(tl.int32), axis=0)
    busy = n_fin > k
    # (t, n_gt) = (cut key, #keys > cut); with <= k finite scores the cut is -inf
    t = tl.where(busy, 0, _KEY_NEG_INF)
    # a search in which every candidate passes ends at t = INT32_MAX (>= k NaNs), above which no key lies
    n_gt = tl.where(busy, 0, n_fin)
    v = n_fin * 0  # v-domain threshold: the bits of the k-th largest v found so far
    one = n_fin * 0 + 1
    for i in range(32):
        if busy:
            cand_v = v | (one << (31 - i))
            cand = cand_v ^ _INT32_MIN
            c = tl.sum((key >= cand).to(tl.int32), axis=0)
            up = c >= k
            v = tl.where(up, cand_v, v)
            # The lowest failing candidate of a full search is t + 1, so its count is #(key > t).
            n_gt = tl.where(up, n_gt, c)
            t = v ^ _INT32_MIN
            exact = c == k  # exactly k keys >= cand: take them all (cut just below cand, no ties)
            t = tl.where(exact, cand - 1, t)
            n_gt = tl.where(exact, k, n_gt)
            busy = c != k
    r = k - n_gt

    gt = key > t
    eq = key == t
    run = tl.cumsum(gt.to(tl.int32) * 65536 + eq.to(tl.int32), axis=0)
    run_gt = run >> 16
    run_eq = run & 0xFFFF
    sel = gt | (eq & (run_eq <= r))
    pos = run_gt + tl.minimum(run_eq, r) - 1
    tl.store(idx_ptr + out_row * k_all + pos, (c0 + offs).to(tl.int64), mask=sel)
    tl.store(valid_ptr + out_row * k_all + pos, ((key > _KEY_NEG_INF) & (key < _INT32_MAX)).to(tl.int8), mask=sel)


def default_num_warps(block: int) -> int:
    """16 warps at BLOCK = 16384 (32 keys per thread). A pass is one compare-and-count per key plus a block-wide sum
    (two barriers), so its issue cost per SM is the same for any warp count; what differs is registers. Compiled
    offline for sm_90: 16 warps -> 128 registers and a spill-free search loop (a few spills around the final scan);
    8 warps -> 255 registers and twice those spills; 32 -> 64 registers. One row per program: decode has T <= 64
    rows, under the H200's 132 SMs, so a row per SM is the latency floor."""
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def row_topk(
    scores: torch.Tensor, k: int, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk(scores, k) for N <= MAX_N in one launch (see module doc). `out` = (idx, valid) buffers to fill in
    full (int64 / bool, contiguous [T, min(k, N)]); `num_warps` overrides the default (benchmarks)."""
    if scores.dim() != 2 or scores.dtype not in _DTYPES:
        raise ValueError(
            f"row_topk: scores must be a [T, N] float32/bfloat16/float16 tensor, got "
            f"{scores.dtype} {tuple(scores.shape)} (use topk for float64)"
        )
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"row_topk: k must be a non-negative int, got {k!r}")
    t, n = scores.shape
    if n > MAX_N:
        raise ValueError(f"row_topk: at most MAX_N = {MAX_N} scores per row, got {n} (use topk for longer rows)")
    k = min(k, n)
    if out is None:
        idx = torch.empty(t, k, dtype=torch.int64, device=scores.device)
        valid = torch.empty(t, k, dtype=torch.bool, device=scores.device)
    else:
        idx, valid = out
        for buf, dt in ((idx, torch.int64), (valid, torch.bool)):
            if tuple(buf.shape) != (t, k) or buf.dtype != dt or not buf.is_contiguous() or buf.device != scores.device:
                raise ValueError(
                    f"row_topk: out buffers must be contiguous {dt} [{t}, {k}] on {scores.device}, "
                    f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
                )
    if t == 0 or k == 0:
        return idx, valid
    block = max(16, triton.next_power_of_2(n))
    nw = default_num_warps(block) if num_warps is None else num_warps
    _row_topk_kernel[(t,)](
        scores, scores.stride(0), scores.stride(1), idx, valid.view(torch.int8), n, k, BLOCK=block, num_warps=nw
    )
    return idx, valid


def chunk_topk(scores: torch.Tensor, k: int, chunk: int = MAX_N) -> tuple[torch.Tensor, torch.Tensor]:
    """topk(scores, k) for rows longer than one program holds, in two row_topk passes: each chunk of ``chunk``
    scores keeps its own top k (the global top k is among them: fewer than k scores beat any of its members, in
    its chunk too), then the top k of those candidates, which are in ascending index order, so ties still go to
    the lower index and -inf picks to the lowest indices. Needs ceil(N / chunk) * k <= MAX_N (N <= 512K at
    k = 512). H200, 8192 rows: meant to replace an int64-key torch.topk of 24 / 47 ms at N = 69632 / 139264."""
    t, n = scores.shape
    k = min(k, n)
    nc = triton.cdiv(n, chunk)
    if chunk & (chunk - 1) or not k <= chunk <= MAX_N or nc * k > MAX_N:
        raise ValueError(
            f"chunk_topk: chunk {chunk} must be a power of two in [k = {k}, {MAX_N}] and "
            f"ceil(N / chunk) * k = {nc * k} at most {MAX_N}"
        )
    idx1 = torch.empty(t * nc, k, dtype=torch.int64, device=scores.device)
    valid1 = torch.empty(t * nc, k, dtype=torch.bool, device=scores.device)
    if t and k:
        _row_topk_kernel[(t * nc,)](
            scores,
            scores.stride(0),
            scores.stride(1),
            idx1,
            valid1.view(torch.int8),
            n,
            k,
            BLOCK=chunk,
            CHUNKS=nc,
            KP=triton.next_power_of_2(k),
            num_warps=default_num_warps(chunk),
        )
    cand = idx1.view(t, nc * k)  # ascending: chunks in order, each chunk's picks ascending, -1 slots last
    cs = torch.where(cand >= 0, scores.gather(1, cand.clamp(min=0)).float(), float("-inf"))
    # -1 slots (k <= chunk: only the last chunk, when shorter than k) score -inf like a real -inf candidate but sit
    # behind every real one: with >= k real candidates they are never picked
    pick, valid = row_topk(cs, k)
    return cand.gather(1, pick), valid
