"""Dense projections with FP8 e4m3 weights on b x b ue8m0 block scales (release format; b = 32 V4.1, 128 V4).

* x [M, K] bf16 / fp16 / fp32 (the reference: any float dtype) -> out [M, N] in x's dtype, row-major.
* w_q float8_e4m3fn [N, K]; w_s uint8 e8m0 exponent bytes (float8_e8m0fnu accepted) [ceil(N/b), ceil(K/b)];
  W[n, k] = w_q[n, k] * 2^(w_s[n // b, k // b] - 127), i.e. quant.dequant_fp8_block.

Grouped (groups = G > 1, a block-diagonal weight: attn.wo_a): w_q [G*O, I] holds G stacked [O, I] blocks, x is
[M, G*I], out [M, G*O] with out[:, g*O:(g+1)*O] = x[:, g*I:(g+1)*I] @ W[g*O:(g+1)*O]^T. O must be a multiple of b,
so that no scale block straddles two groups. One launch covers every group: a program's BN output columns lie in
one group (BN divides O), and it reads that group's x columns.

W8A16 (default; numerics of fp8_linear_ref: exact fp32 W cast to x's dtype, matmul): e4m3 tiles are bitcast, scaled
by their pow2 block scale (exact) and fed to x-dtype tensor-core dots, fp32 accumulation. Decode is bound by the
weight bytes (half of bf16's), so small M splits K over programs; up to 16 rows each output tile's last program
sums the fp32 partials in split order (kernels.split_k: deterministic, no extra launches), above that torch does.
From DEQUANT_MIN_ROWS rows on (prefill chunks) the weight is dequantised to x's dtype (kernels.dequant) and cuBLAS
multiplies: the reference's computation exactly, at cuBLAS's rate.
W8A8 (act_quant=True; fp8_linear_w8a8_ref): x -> e4m3 with a pow2 scale per (row, act_group columns), the
release's act_quant (act_quant_rows = quant.fake_quant_fp8_pow2 as bytes + scales); e4m3 x e4m3 -> fp32 dots per
32-wide K group on FP8 tensor cores, both scales on each fp32 partial (group_dot); decode-sized calls swap the
operands (weight rows on the MMA's M side) and split K like W8A16. Prefill-sized calls fake-quantise x in its dtype
and take the dequantise-then-cuBLAS path: the same numbers (exact operands, fp32 sums), at cuBLAS's rate.

torch._scaled_mm does not fit: it takes per-tensor / per-row fp32 scales and, on sm90, blockwise 1x128 activation x
128x128 weight scales (1x32 is MXFP8, sm100 only); nothing describes 32x32 weight blocks, and its fp8 activations
rule out W8A16 numerics. Even for V4's 128x128 blocks, PyTorch 2.11 on the H200 refused the model's shapes
(CUBLAS_STATUS_NOT_SUPPORTED at M=1, "Invalid scaling configuration" for the padded scale layouts), 2026-11-29.
So every block size runs through Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import nn

from ..layers.quant import dequant_fp8_block, fake_quant_fp8_pow2, quant_fp8_block
from .dequant import _e8m0, dequant_fp8
from .split_k import store_split, tile_counters

# W8A8 with config fuse_quant (<= 8 rows): each program quantises the activation groups it reads, one launch fewer a
# projection but 9.1 instead of 4.1 instructions a weight byte in the K loop (offline sm_90 SASS, wq_a decode tile:
# the row maxima cross threads). Off by default (0 rows) until the H200 says which wins (benchmarks/w4a8_h200.py).
FUSE_QUANT_ROWS = 0
IN_KERNEL_SPLIT_ROWS = 16  # split-K partials summed in the kernel up to this many rows (see fp8_linear),
# and up to 64 rows for weights of >= 2048 output columns: at 24-64 rows the decode step's projections took 5-10%
# less in all (131.9 vs 147.1 us at 32 rows), the wide ones up to 22% less, the narrow (wkv, wq_a) up to 30% more
# (H200, 2026-12-02: benchmarks/results/decode-gemms-h200/w8a16_split_rows.json)
IN_KERNEL_SPLIT_ROWS_WIDE, WIDE_N = 64, 2048
# From this many rows the product is compute-bound: the weight dequantised to x's dtype once (kernels.dequant) and
# cuBLAS beat the W8A16 kernel (M = 8192 on the release shapes: 680-730 vs 415-460 TFLOP/s, the dequant 3 bytes
# of traffic a weight; H200, 2026-11-30), with the reference's numerics exactly.
DEQUANT_MIN_ROWS = 1024
# The W8A8 / W4A8 tiles' MMA (config "mma"): "fp8" (the FP8 tensor cores; on Hopper's wgmma, tiles of 32 or more
# rows, sums to about 2^-13 of the products' magnitudes) or "fp16" (exact sums, 1.05-1.25x the time at 32-64 rows and
# 1.3-1.5x at 128-512 on an H100, 2026-12-05: benchmarks/results/fp8-mma-h100).
MMA = "fp8"

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The Triton 3.9 interpreter gets bf16 dots wrong; fp32 dots of the same (exact) products stand in there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_empty = torch.empty  # the W8A8 path's scratch and outputs; tests swap in a NaN fill so that unwritten ones show


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    sxm,
    som,
    sos,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    K_TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    GROUP_N: tl.constexpr = 0,
    TMA: tl.constexpr = False,
):
    KS: tl.constexpr = (K + BLOCK - 1) // BLOCK
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    if GROUP_N:  # block-diagonal weight: this program's columns (BN divides GROUP_N) read their group's x slice
        x_ptr = x_ptr + (tl.program_id(1) * BN // GROUP_N) * K
    acc = tl.zeros((BM, BN), tl.float32)
    for t in range(K_TILES):
        k0 = (tl.program_id(2) * K_TILES + t) * BK
        kk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        # [BK, BN] view of the [N, K] weight: K-major, the operand layout fp8/bf16 MMAs want for B
        if TMA:  # w_ptr: a tensor descriptor of the [N, K] bytes, [BN, BK] tiles (zeros past the edges)
            wq = tl.trans(w_ptr.load([tl.program_id(1) * BN, k0]))
        else:
            wq = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)
        if BK > BLOCK:  # BK // BLOCK scale rows per tile, each repeated over its BLOCK k's
            kb = k0 // BLOCK + tl.arange(0, BK // BLOCK)
            e = tl.load(
                s_ptr + (rn[None, :] // BLOCK) * KS + kb[:, None],
                mask=(rn[None, :] < N) & (kb[:, None] < KS),
                other=127,
            )
            sc = tl.reshape(tl.broadcast_to(_e8m0(e)[:, None, :], (BK // BLOCK, BLOCK, BN)), (BK, BN))
        else:  # the tile lies inside one scale block (BK divides BLOCK)
            e = tl.load(s_ptr + (rn // BLOCK) * KS + k0 // BLOCK, mask=(rn < N) & (rn * 0 + k0 < K), other=127)
            sc = _e8m0(e)[None, :]
        w = wq.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc  # exactly the reference's fp32 W
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if SPLIT == 1:  # the output, or (sos > 0) this program's split of partials that torch sums afterwards
        tl.store(
            o_ptr + tl.program_id(2) * sos + rm[:, None] * som + rn[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )
    else:  # partial [SPLIT, M, N] fp32, contiguous
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        store_split(acc, rm, rn, M, N, part_ptr, N, M * N, o_ptr, som, cnt_ptr, tile, tl.program_id(2), SPLIT)


@triton.jit
def _quant_group(x):
    """fp32 [R, G] -> (e4m3 [R, G], fp32 scales [R]): the release's act_quant of each row,
    s = 2^ceil(log2(max(amax, 1e-4) / 448)) (from the bits of the correctly rounded quotient, as pow2_ceil does),
    q = e4m3(clamp(x / s, +-448)) with RNE onto the e4m3 grid by hand (ulp 2^(exp-3), 2^-9 for subnormals): the
    Triton interpreter's fp32->e4m3 cast drops a rounding carry into the exponent (7.99 -> 4); on the grid every
    cast is exact."""
    bits = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4), 448.0).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1/s, exact: x * inv == x / s
    v = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    ue = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121) - 3
    y = v * ((254 - ue) << 23).to(tl.float32, bitcast=True)
    v = ((y + 12582912.0) - 12582912.0) * (ue << 23).to(tl.float32, bitcast=True)  # 1.5 * 2^23: rint for |y| < 2^22
    return v.to(tl.float8e4nv), (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, sxm, sqm, ssm, ssg, G: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr = False
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    kk = tl.program_id(1) * G + tl.arange(0, G)
    x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=rm[:, None] < M, other=0.0).to(tl.float32)
    q, s = _quant_group(x)
    if SPLIT:  # channel c of the group at (c % 2) * G/2 + c // 2: even channels first, then odd ones
        kk = tl.program_id(1) * G + (kk % 2) * (G // 2) + (kk % G) // 2
    tl.store(q_ptr + rm[:, None] * sqm + kk[None, :], q.to(tl.uint8, bitcast=True), mask=rm[:, None] < M)
    tl.store(s_ptr + rm * ssm + tl.program_id(1) * ssg, s, mask=rm < M)


@triton.jit
def group_dot(acc, a, sa, w, sw, SWAP: tl.constexpr, F16_MMA: tl.constexpr):
    """One 32-wide K group on tensor cores: acc + (a @ w^T) * (sa x sw), a e4m3 [BM, 32] with fp32 scales
    sa [BM], w e4m3 [BN, 32] with sw [BN]; acc [BM, BN], or its transpose [BN, BM] if SWAP (the weight rows on
    the MMA's M side: wgmma needs M = 64, decode has 1-32 rows). The e4m3 products are exact in fp32, but Hopper's
    FP8 wgmma sums them with about 13 bits below the largest (its error up to 2^-12.7 of the sum of |products| on
    an H100, 2026-12-05), so a row's value would depend on the tile shape its batch picked. F16_MMA upcasts both
    tiles to fp16 (e4m3 is exact there; one cvt instruction for two values) for the FP16 MMA, which sums them in
    fp32 exactly, as FP8 mma.sync does. (The interpreter's e4m3 -> bf16 cast is wrong: fp16, not bf16.)"""
    if F16_MMA:
        a, w = a.to(tl.float16), w.to(tl.float16)
    if SWAP:
        acc += tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
    else:
        acc += tl.dot(a, tl.trans(w)) * (sa[:, None] * sw[None, :])
    return acc


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    q_ptr,
    qs_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    sqm,
    ssm,
    ssg,
    som,
    sos,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    G: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    K_TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP: tl.constexpr,
    GROUP_N: tl.constexpr = 0,
    FUSE_Q: tl.constexpr = False,
    F16_MMA: tl.constexpr = False,
):
    """FUSE_Q: q_ptr holds the float rows x themselves (row stride sqm) and each program quantises the 32-wide
    groups it reads (G = 32): no act_quant launch, at a few instructions a row element (decode: <= 8 rows)."""
    KS: tl.constexpr = (K + BLOCK - 1) // BLOCK
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    if GROUP_N:  # as in _w8a16_kernel; G divides K, so the group's activation scales start at column g*K/G
        grp = tl.program_id(1) * BN // GROUP_N
        q_ptr = q_ptr + grp * K
        qs_ptr = qs_ptr + grp * (K // G) * ssg
    if SWAP:
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
    # this split's K tiles that start inside K (the last split may have fewer); EVEN: every one is whole, so the
    # loads need no K masks
    EVEN: tl.constexpr = K % BK == 0
    for t in range(tl.minimum(K_TILES, (K + BK - 1) // BK - tl.program_id(2) * K_TILES)):
        for j in tl.static_range(BK // 32):  # 32 = the finest scale granularity (act group or weight block)
            k0 = (tl.program_id(2) * K_TILES + t) * BK + j * 32
            kk = k0 + tl.arange(0, 32)
            am, bm_, sam, sbm = rm[:, None] < M, rn[:, None] < N, rm < M, rn < N
            if not EVEN:
                am, bm_ = am & (kk[None, :] < K), bm_ & (kk[None, :] < K)
                sam, sbm = sam & (rm * 0 + k0 < K), sbm & (rn * 0 + k0 < K)
            if FUSE_Q:
                a, sa = _quant_group(
                    tl.load(q_ptr + rm[:, None] * sqm + kk[None, :], mask=am, other=0.0).to(tl.float32)
                )
            else:
                a = tl.load(q_ptr + rm[:, None] * sqm + kk[None, :], mask=am, other=0).to(tl.float8e4nv, bitcast=True)
                sa = tl.load(qs_ptr + rm * ssm + (k0 // G) * ssg, mask=sam, other=0.0)
            b = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=bm_, other=0)
            sb = _e8m0(tl.load(s_ptr + (rn // BLOCK) * KS + k0 // BLOCK, mask=sbm, other=127))
            acc = group_dot(acc, a, sa, b.to(tl.float8e4nv, bitcast=True), sb, SWAP, F16_MMA)
    if SWAP:
        acc = tl.trans(acc)
    if SPLIT == 1:  # the output, or (sos > 0) this program's split of partials that torch sums afterwards
        tl.store(
            o_ptr + tl.program_id(2) * sos + rm[:, None] * som + rn[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )
    else:
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        store_split(acc, rm, rn, M, N, part_ptr, N, M * N, o_ptr, som, cnt_ptr, tile, tl.program_id(2), SPLIT)


def _check(x, w_q, w_s, block, act_quant, act_group, kernel, groups=1):
    """Validate the operands; returns (x, w_q as float8_e4m3fn, w_s as uint8)."""
    if block not in (32, 64, 128):  # powers of two (tile reshapes), >= the 32-wide fp8 K step
        raise ValueError(f"block {block} not supported (allowed: 32, 64, 128)")
    if w_q.dim() != 2 or w_q.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"w_q must be float8_e4m3fn [N, K], got {w_q.dtype} {tuple(w_q.shape)}")
    n, k = w_q.shape
    if tuple(w_s.shape) != (-(-n // block), -(-k // block)) or w_s.element_size() != 1:
        raise ValueError(f"w_s must be uint8/e8m0 [{-(-n // block)}, {-(-k // block)}], got {w_s.dtype} {w_s.shape}")
    if not isinstance(groups, int) or groups < 1 or n % groups:
        raise ValueError(f"groups must be a positive int dividing N={n}, got {groups!r}")
    if groups > 1 and (n // groups) % block:
        raise ValueError(
            f"groups={groups}: the rows per group O={n // groups} must be a multiple of block={block} "
            "(no scale block may straddle two groups)"
        )
    if x.dim() != 2 or x.shape[1] != groups * k or not x.is_floating_point():
        raise ValueError(f"x must be a float [M, {groups * k}] tensor (groups x K), got {x.dtype} {tuple(x.shape)}")
    if kernel and x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported by the kernel (allowed: {KERNEL_DTYPES})")
    if act_quant and (act_group not in (32, 128) or k % act_group):
        raise ValueError(f"act_quant needs act_group in (32, 128) dividing K={k}, got {act_group}")
    return x, w_q.view(torch.float8_e4m3fn), w_s.view(torch.uint8)


def fp8_linear_ref(
    x, w_q, w_s, block: int, *, act_quant: bool = False, act_group: int = 32, groups: int = 1
) -> torch.Tensor:
    """x @ W^T: W dequantised (fp32, dequant_fp8_block), cast to x's dtype, plain matmul; groups > 1: the
    block-diagonal product (module docstring), one batched matmul over the groups. act_quant: see w8a8_ref."""
    x, w_q, w_s = _check(x, w_q, w_s, block, act_quant, act_group, kernel=False, groups=groups)
    if act_quant:  # act_group divides K, so no activation group straddles two weight groups
        x = fake_quant_fp8_pow2(x, act_group)
    return _product(x, dequant_fp8_block(w_q, w_s, block).to(x.dtype), groups)


def _product(x, w, groups):
    """x @ w^T for a plain or a block-diagonal (groups > 1) weight w [N, K] of x's dtype."""
    if groups == 1:
        return x @ w.t()
    (m, _), (n, k) = x.shape, w.shape
    return (
        torch.bmm(x.view(m, groups, k).transpose(0, 1), w.view(groups, n // groups, k).transpose(1, 2))
        .transpose(0, 1)
        .reshape(m, n)
    )


def fp8_linear_w8a8_ref(x, w_q, w_s, block: int, *, act_group: int = 32, groups: int = 1) -> torch.Tensor:
    """W8A8 numerics: x fake-quantised to e4m3 per (row, act_group columns) with pow2 scales, then fp8_linear_ref."""
    return fp8_linear_ref(x, w_q, w_s, block, act_quant=True, act_group=act_group, groups=groups)


def _bn(cfg, default, group_n):
    """The N tile: `default`, or for a grouped weight the largest power of two <= default dividing O."""
    if not group_n:
        return cfg.get("BN", default)
    bn = cfg.get("BN", min(default, group_n & -group_n))
    if group_n % bn:
        raise ValueError(f"config BN={bn} must divide the rows per group O={group_n}")
    return bn


def fp8_linear(
    x,
    w_q,
    w_s,
    block: int,
    *,
    act_quant: bool = False,
    act_group: int = 32,
    groups: int = 1,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton x @ W^T, same semantics as fp8_linear_ref. config overrides the tiles (BM, BN, BK, SPLIT_K,
    num_warps, num_stages), tma (W8A16 weight tiles by TMA, when K % 16 == 0) and dequant (True / False: force or
    forbid the dequantise-then-cuBLAS path, default from DEQUANT_MIN_ROWS rows on); tests and benchmarks only."""
    x, w_q, w_s = _check(x, w_q, w_s, block, act_quant, act_group, kernel=True, groups=groups)
    x = x.contiguous()
    (m, _), (n, k), cfg = x.shape, w_q.shape, dict(config or {})
    group_n = n // groups if groups > 1 else 0  # GROUP_N: 0 = one plain [N, K] weight
    if m == 0:  # an empty grid is not launchable
        return x.new_empty(0, n)
    if act_quant:
        return _w8a8(x, w_q, w_s, block, act_group, groups, group_n, cfg)
    if cfg.get("dequant", m >= DEQUANT_MIN_ROWS):  # compute-bound: bf16 weights once, then cuBLAS
        return _product(x, dequant_fp8(w_q, w_s, block, x.dtype), groups)
    small = m <= 64  # decode: weight-bandwidth bound, small BM, split K; else 128x128 tiles
    bm = cfg.get("BM", max(16, triton.next_power_of_2(m)) if small else 128)
    bn, bk = _bn(cfg, 64 if small else 128, group_n), cfg.get("BK", 128 if small else 64)
    tiles, k_tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, bk)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    split = min(k_tiles, cfg.get("SPLIT_K", max(1, 2 * sms // tiles)))
    per = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per)  # no empty programs
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)

    # tma (off until measured on the GPU): weight tiles by TMA from a host descriptor; rows must be 16-byte multiples
    tma = cfg.get("tma", False) and k % 16 == 0
    w = w_q.view(torch.uint8)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w = TensorDescriptor(w, [n, k], [k, 1], [bn, bk])

    def launch(o, part, cnt, sos, in_kernel_split):
        _w8a16_kernel[grid](
            x,
            w,
            w_s,
            o,
            part,
            cnt,
            m,
            n,
            x.stride(0),
            n,
            sos,
            K=k,
            BLOCK=block,
            BM=bm,
            BN=bn,
            BK=bk,
            K_TILES=per,
            SPLIT=in_kernel_split,
            DOT_F32=_INTERPRET or x.dtype == torch.float32,
            GROUP_N=group_n,
            TMA=tma,
            num_warps=cfg.get("num_warps", 4 if small else 8),
            num_stages=cfg.get("num_stages", 4 if small else 3),
        )

    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else None
    if split > 1 and m > (IN_KERNEL_SPLIT_ROWS_WIDE if n >= WIDE_N else IN_KERNEL_SPLIT_ROWS):
        # one program summing a many-row tile's partials is a serial tail (B = 128 decode steps 68 -> 86 ms on the
        # H200, 2026-11-30): each program stores its split (SPLIT=1, stride sos) and torch's sum spreads the rest
        launch(part, part, part, m * n, 1)
        return part.sum(0).to(x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if split == 1:
        launch(out, out, out, 0, 1)
    else:  # few rows: each tile's last program sums the fp32 partials (split_k), no extra launches
        launch(out, part, tile_counters(x.device, grid[0] * grid[1]), 0, split)
    return out


def _w8a8(x, w_q, w_s, block, act_group, groups, group_n, cfg):
    """fp8_linear(act_quant=True). From DEQUANT_MIN_ROWS rows (compute-bound): x fake-quantised in its dtype
    (rowwise) and the weight dequantised (both exact), then cuBLAS: the reference's computation exactly, where
    the FP8 kernel would rescale its fp32 accumulator every 32 K (an FP-pipe bound). Below: act_quant_rows, then
    _w8a8_kernel; up to 64 rows swapped (weights on the MMA's M side); split K as W8A16 (split_k)."""
    (m, _), (n, k) = x.shape, w_q.shape
    if cfg.get("dequant", m >= DEQUANT_MIN_ROWS):
        from .rowwise import fake_quant_fp8_pow2 as fq

        return _product(fq(x, act_group), dequant_fp8(w_q, w_s, block, x.dtype), groups)
    fuse = cfg.get("fuse_quant", m <= FUSE_QUANT_ROWS) and act_group == 32 and m <= 8
    q, qs = (x, x) if fuse else act_quant_rows(x, act_group)
    small = m <= 64
    swap = cfg.get("SWAP", m < 64)
    bm = cfg.get("BM", min(128, max(8 if swap else 16, triton.next_power_of_2(m))))  # rows: the MMA's N if swapped
    bn, bk = _bn(cfg, 64 if small else 128, group_n), cfg.get("BK", 128)
    mma = cfg.get("mma", MMA)
    if mma not in ("fp8", "fp16"):
        raise ValueError(f"config mma={mma!r}: the tiles' MMA is 'fp8' or 'fp16' (exact sums, see group_dot)")
    if bk < 32 or bk & (bk - 1) or bm < (8 if swap else 16) or bm & (bm - 1):
        raise ValueError(f"config BK={bk} / BM={bm} must be powers of two, BK >= 32, BM >= 8 swapped else 16")
    tiles, k_tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, bk)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    # split K to fill the SMs, as W8A16; past 64 rows only where it at least triples the programs: 2 splits of about
    # a wave of tiles measured 0.79x (wo_a, 256 rows), 3+ splits 1.2-5.5x at 128-512 rows (H200, 2026-12-05:
    # benchmarks/results/w8a8-split-h200)
    want = max(1, 2 * sms // tiles)
    split = min(k_tiles, cfg.get("SPLIT_K", want if small or want >= 3 else 1))
    per = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per)  # no empty programs
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)

    def launch(o, part, cnt, sos, in_kernel_split):
        _w8a8_kernel[grid](
            q,
            qs,
            w_q.view(torch.uint8),
            w_s,
            o,
            part,
            cnt,
            m,
            n,
            q.stride(0),
            qs.stride(0),
            qs.stride(1),
            n,
            sos,
            K=k,
            BLOCK=block,
            G=act_group,
            BM=bm,
            BN=bn,
            BK=bk,
            K_TILES=per,
            SPLIT=in_kernel_split,
            SWAP=swap,
            GROUP_N=group_n,
            FUSE_Q=fuse,
            F16_MMA=mma == "fp16",
            num_warps=cfg.get("num_warps", 4 if bm * bn <= 64 * 64 else 8),
            num_stages=cfg.get("num_stages", 4 if small else 3),
        )

    part = _empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else None
    if split > 1 and m > (IN_KERNEL_SPLIT_ROWS_WIDE if n >= WIDE_N else IN_KERNEL_SPLIT_ROWS):
        launch(part, part, part, m * n, 1)
        return part.sum(0).to(x.dtype)
    out = _empty((m, n), dtype=x.dtype, device=x.device)
    if split == 1:
        launch(out, out, out, 0, 1)
    else:
        launch(out, part, tile_counters(x.device, grid[0] * grid[1]), 0, split)
    return out


def act_quant_rows(x, group: int = 32, m_major: bool = False, split: bool = False):
    """The release's act_quant: x [M, K] -> (e4m3 bytes uint8 [M, K], fp32 pow2 scales [M, K/group]; M-major
    storage if m_major); bytes x scales = quant.fake_quant_fp8_pow2(x, group) exactly. split: each group's
    channels stored even ones first, then odd ones (the K order of grouped_moe_a8's MXFP4 weights)."""
    (m, k), dev = x.shape, x.device
    q = _empty((m, k), dtype=torch.uint8, device=dev)
    qs = _empty((k // group, m), dtype=torch.float32, device=dev)
    qs = qs.t() if m_major else qs.view(m, k // group)
    _act_quant_kernel[(triton.cdiv(m, 16), k // group)](
        x, q, qs, m, x.stride(0), q.stride(0), qs.stride(0), qs.stride(1), G=group, BM=16, SPLIT=split
    )
    return q, qs


class Fp8Linear(nn.Module):
    """Bias-free linear layer on the release's FP8 block weights. `use_kernel` (set by the engine) picks Triton
    over the reference; rows >= `act_quant_min_m` (None: never) take the W8A8 numerics, in both.
    groups > 1: the block-diagonal weight of the module docstring; `in_features` stays the weight's columns I
    (one group's input width: the module maps [..., groups * I] -> [..., out_features], out_features = G*O)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, block: int, groups: int = 1):
        super().__init__()
        _check(
            weight.new_empty(0, groups * weight.shape[1], dtype=torch.float32),
            weight,
            weight_scale,
            block,
            False,
            32,
            False,
            groups,
        )
        self.register_buffer("weight", weight.view(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", weight_scale.view(torch.uint8))  # uint8: every PyTorch has it
        self.block, self.groups, self.out_features, self.in_features = block, groups, *weight.shape
        self.use_kernel, self.act_quant_min_m = False, None

    @classmethod
    def from_quantized(
        cls, weight: torch.Tensor, weight_scale: torch.Tensor, block: int, groups: int = 1
    ) -> "Fp8Linear":
        return cls(weight, weight_scale, block, groups)

    @classmethod
    def from_linear(cls, lin: nn.Linear, block: int, groups: int = 1) -> "Fp8Linear":
        """lin.weight [G*O, I] (a block-diagonal one when groups > 1, as attn.wo_a stores it)."""
        if lin.bias is not None:
            raise ValueError("Fp8Linear has no bias; got an nn.Linear with one")
        return cls(*quant_fp8_block(lin.weight.detach(), block), block, groups)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [N, K], exactly what the checkpoint loader puts into an nn.Linear."""
        return dequant_fp8_block(self.weight, self.weight_scale, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.groups * self.in_features)
        aq = self.act_quant_min_m is not None and x2.shape[0] >= self.act_quant_min_m
        fn = fp8_linear if self.use_kernel else fp8_linear_ref
        y = fn(x2, self.weight, self.weight_scale, self.block, act_quant=aq, groups=self.groups)
        return y.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        # model.double() / .to(dtype) would convert fp8 buffers (they count as floating point); moving uint8
        # views instead keeps the bytes and still follows device moves.
        for name in ("weight", "weight_scale"):
            t = self._buffers[name]
            self._buffers[name] = fn(t.view(torch.uint8)).view(t.dtype)
        return self

    def extra_repr(self) -> str:
        g = f", groups={self.groups}" if self.groups > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}{g}"


BENCH_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192)}  # name: (N, K)


def bench(device="cuda", block: int = 32, copies: int = 4) -> dict:
    """Median device times (ms, CUDA graphs) of W8A16, W8A8 and a bf16 torch.matmul on the model's projection
    shapes, rotating over `copies` weight copies so that decode reads weights from HBM, not L2; with the weight
    bandwidth achieved (GB/s: fp8 bytes for ours, bf16 bytes for matmul) and TFLOP/s. Keys "name M=m"."""
    from ..bench.device_timing import graph_ms

    res = {}
    for name, (n, k) in BENCH_SHAPES.items():
        ws = [quant_fp8_block(torch.randn(n, k, device=device) * 0.02, block) for _ in range(copies)]
        wb = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        for m in (1, 16, 64, 4096):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            runs = {
                "w8a16": (lambda i: fp8_linear(x, *ws[i % copies], block), n * k),
                "w8a8": (lambda i: fp8_linear(x, *ws[i % copies], block, act_quant=True), n * k),
                "bf16": (lambda i: x @ wb[i % copies].t(), 2 * n * k),
            }
            row = res[f"{name} M={m}"] = {}
            for kind, (fn, wbytes) in runs.items():
                ms = graph_ms(fn, copies)
                row[kind] = {"ms": ms, "weight_GBps": wbytes / ms / 1e6, "TFLOPs": 2 * m * n * k / ms / 1e9}
    return res
