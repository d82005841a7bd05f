"""Routed experts of the MoE (spec 2.5) as two grouped GEMMs over expert-sorted pairs; bf16, FP8 32x32, MXFP4.

* x [T, d] bf16 / fp16 / fp32 (the reference: any float dtype); ids int64 [T, k] (int32 accepted), experts in [0, E);
  weights [T, k] float, the routing weights of MoE.gate (renormalised, x1.5).
* y [T, d] in x's dtype: sum_j weights[t, j] * W2_e(clamped_swiglu(W1_e x_t, W3_e x_t)) with e = ids[t, j], the
  routed part of MoE.forward (no shared expert) with its roundings: x-dtype matmul outputs and SwiGLU, the routing
  weight multiplied (fp32) into the activation before the down projection, an fp32 sum over the k picks.
* ExpertWeights(fmt, w1, w3, w2, s1, s3, s2): W1, W3 [E, inter, d] and W2 [E, d, inter] ([E, out, in]) as
  - "bf16": plain float weights (bf16 in the model), no scales;
  - "fp8": e4m3 [E, out, in] + e8m0 bytes [E, ceil(out/32), ceil(in/32)] (quant.dequant_fp8_block, block 32);
  - "mxfp4": uint8 [E, out, in/2], two e2m1 per byte, the even element in the low nibble, + e8m0 bytes
    [E, out, in/32] (quant.pack_mxfp4). Hopper has no FP4 MMA: weight-only, upcast in registers to x's dtype
    (bf16 rows: by dequant's PTX decode on CUDA, or tl.dot_scaled; other dtypes: the kernel's own nibble decode).
  Quantised tensors are held as uint8 views (every PyTorch has them); in the kernels W is exactly the reference's
  (pow2 scales: the fp32 products are exact, and so is their cast to bf16). ExpertWeights.max_scale: MXFP4's
  largest e8m0 byte (the PTX decode, dequant.mxfp4_tile_bf16, takes <= 128).

Plan: moe_permute sorts the T*k (token, slot) pairs by expert into BM-row tiles (grid independent of the routing,
no host sync). The up kernel, per (tile, BN columns of inter), gathers x rows, runs the W1 and W3 dots in one K pass,
applies the clamped SwiGLU and the routing weight, and writes h [T*k, inter] (x dtype, sorted order). The down kernel
multiplies h by W2_e^T and stores each row at its pair index t*k + j; y is their fp32 sum over j: deterministic,
no atomics. Tiles past the real count, and so empty experts, exit at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..layers.moe import clamped_swiglu
from ..layers.numerics import acc
from ..layers.quant import MX_BLOCK, dequant_fp8_block, dequant_mxfp4, fake_quant_fp8_pow2, pack_mxfp4, quant_fp8_block
from .dequant import MXFP4_FAST_MAX_SCALE, dequant_fp8, mxfp4_tile_bf16, weight_tile
from .dequant import dequant_mxfp4 as dequant_mxfp4_rows
from .grouped_moe_a8 import quant_e4m3_pow2
from .moe_permute import MAX_KERNEL_PAIRS, expert_tiles, run_constexprs

FMTS = ("bf16", "fp8", "mxfp4")
FP8_BLOCK = 32  # V4.1's weight_block_size; MXFP4 blocks are quant.MX_BLOCK (also 32) along `in`
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The Triton 3.9 interpreter gets bf16 dots wrong; fp32 dots of the same (exact) operands stand in there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_empty = torch.empty  # scratch and output allocation; tests swap in a NaN fill so that unwritten rows show


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts in one storage format (see the module docstring for the layouts)."""

    fmt: str
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    s1: torch.Tensor | None = None
    s3: torch.Tensor | None = None
    s2: torch.Tensor | None = None

    def __post_init__(self):
        if self.fmt not in FMTS:
            raise ValueError(f"fmt {self.fmt!r} not supported (allowed: {FMTS})")
        if self.w1.dim() != 3:
            raise ValueError(f"w1 must be [E, inter, in], got {tuple(self.w1.shape)}")
        pack = 2 if self.fmt == "mxfp4" else 1
        e, inter, d = self.w1.shape[0], self.w1.shape[1], self.w1.shape[2] * pack
        for name, (out, inn) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            w, s = getattr(self, name), getattr(self, "s" + name[1])
            if tuple(w.shape) != (e, out, inn // pack) or inn % pack:
                raise ValueError(f"{name} must be [{e}, {out}, {inn // pack}], got {tuple(w.shape)}")
            object.__setattr__(self, name, w.contiguous())  # the kernels index [E, out, in] densely
            if self.fmt == "bf16":
                if not w.is_floating_point() or s is not None:
                    raise ValueError(f"fmt bf16 takes float {name} and no scale, got {w.dtype}, s={s is not None}")
                continue
            if w.element_size() != 1 or s is None or s.element_size() != 1:
                raise ValueError(f"fmt {self.fmt} takes 1-byte {name} and its 1-byte scale")
            blocks = (-(-out // FP8_BLOCK), -(-inn // FP8_BLOCK)) if self.fmt == "fp8" else (out, inn // MX_BLOCK)
            if tuple(s.shape) != (e, *blocks) or (self.fmt == "mxfp4" and inn % MX_BLOCK):
                raise ValueError(
                    f"s{name[1]} must be [{e}, {blocks[0]}, {blocks[1]}] for {name} [{e}, {out}, "
                    f"{inn}] ({self.fmt}), got {tuple(s.shape)}"
                )
            object.__setattr__(self, name, w.contiguous().view(torch.uint8))
            object.__setattr__(self, "s" + name[1], s.contiguous().view(torch.uint8))
        # the largest e8m0 byte (one host sync, here rather than per call): the PTX decode takes <= 128
        mx = max(int(s.max()) for s in (self.s1, self.s3, self.s2)) if self.fmt == "mxfp4" and self.w1.numel() else 0
        object.__setattr__(self, "max_scale", mx)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, d, inter)."""
        return self.w2.shape[0], self.w2.shape[1], self.w1.shape[1]

    @classmethod
    def from_dense(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, fmt: str) -> "ExpertWeights":
        """Quantise dense [E, out, in] weights as the release stores them (bf16: a plain cast). The quantised
        formats go one expert at a time, each in fp32 (fp64 kept), so the temporaries are one expert's size, not the
        layer's: the release proxy's build (48 experts of 3 x 2304 x 5120 a layer) ran out of an H100's memory with
        fp32 copies of a whole layer."""
        if fmt == "bf16":
            return cls(fmt, w1.bfloat16(), w3.bfloat16(), w2.bfloat16())
        if fmt not in ("fp8", "mxfp4"):
            raise ValueError(f"fmt {fmt!r} not supported (allowed: {FMTS})")

        def one(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            m = m if m.dtype == torch.float64 else m.float()
            if fmt == "mxfp4":
                return pack_mxfp4(m)
            q, sc = quant_fp8_block(m, FP8_BLOCK)
            return q.view(torch.uint8), sc.view(torch.uint8)

        def stack(ts: list[torch.Tensor]) -> torch.Tensor:  # as bytes: every PyTorch stacks uint8
            return torch.stack([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)

        qs = [[one(m) for m in w] for w in (w1, w3, w2)]
        qs = [(stack([q for q, _ in p]), stack([s for _, s in p])) for p in qs]
        return cls(fmt, *(w for w, _ in qs), *(s for _, s in qs))

    def dequant(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's (W1, W3, W2): float32 for the quantised formats, as stored for bf16."""
        if self.fmt == "bf16":
            return self.w1[e], self.w3[e], self.w2[e]
        if self.fmt == "fp8":
            return tuple(dequant_fp8_block(w[e], s[e], FP8_BLOCK) for w, s in self._pairs())
        return tuple(dequant_mxfp4(w[e], s[e]) for w, s in self._pairs())

    def _pairs(self):
        return (self.w1, self.s1), (self.w3, self.s3), (self.w2, self.s2)

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's `name` ("w1", "w3" or "w2") as dtype [E, out, in], decoded in one launch (kernels.dequant;
        exact, as the in-kernel decode)."""
        w, s = getattr(self, name), getattr(self, "s" + name[1])
        if self.fmt == "bf16":
            return w.to(dtype)
        if self.fmt == "mxfp4":
            return dequant_mxfp4_rows(w, s, dtype)
        e, out, inn = w.shape
        if out % FP8_BLOCK:  # an expert's last scale row would straddle the next expert's rows: one at a time
            return torch.stack([dequant_fp8(w[i], s[i], FP8_BLOCK, dtype) for i in range(e)])
        return dequant_fp8(w.view(e * out, inn), s.view(-1, s.shape[-1]), FP8_BLOCK, dtype).view(e, out, inn)


@triton.jit
def _dot_scaled(
    acc, a, w_ptr, s_ptr, e, rn, k0, N: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr = False
):
    """MXFP4 with bf16 rows: acc + a @ W_e[rn, k0:k0 + BK]^T by tl.dot_scaled, which upcasts the packed nibbles
    and their e8m0 scales to bf16 itself (Hopper has no FP4 MMA): the reference's bf16 weight, exactly. TMA:
    w_ptr is a tensor descriptor of the packed weights as [E * N, K / 2] rows (tiles past the array read 0; rows
    past expert e's N belong to the next expert and only reach output columns that are never stored)."""
    KH: tl.constexpr = K // 2
    KS: tl.constexpr = K // 32
    kh = k0 // 2 + tl.arange(0, BK // 2)
    ks = k0 // 32 + tl.arange(0, BK // 32)
    nm = rn[:, None] < N
    e = e.to(tl.int64)
    if TMA:
        b = w_ptr.load([(e * N + tl.min(rn, axis=0)).to(tl.int32), k0 // 2])
    else:
        b = tl.load(w_ptr + e * N * KH + rn[:, None] * KH + kh[None, :], mask=nm & (kh[None, :] < KH), other=0)
    s = tl.load(s_ptr + e * N * KS + rn[:, None] * KS + ks[None, :], mask=nm & (ks[None, :] < KS), other=127)
    return tl.dot_scaled(a, None, "bf16", tl.trans(b), s, "e2m1", acc, fast_math=True)


@triton.jit
def _dot(acc, a, w, DOT_F32: tl.constexpr):  # acc + a [BM, BK] @ w[BN, BK]^T, w cast to a's dtype as the ref does
    if DOT_F32:
        acc += tl.dot(a.to(tl.float32), tl.trans(w.to(a.dtype).to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    return acc


@triton.jit
def _tile(tiles_ptr, n_tiles, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(expert, sorted positions [BM], their mask, output columns [BN]) of this program; GROUP_M row tiles share
    the column sweep, so an expert's weights and its gathered rows stay in L2 across them."""
    n_n: tl.constexpr = (N + BN - 1) // BN
    pid = tl.program_id(0)
    first = (pid // (GROUP_M * n_n)) * GROUP_M
    size = tl.minimum(n_tiles - first, GROUP_M)
    pid_m = first + (pid % (GROUP_M * n_n)) % size
    pid_n = (pid % (GROUP_M * n_n)) // size
    e = tl.load(tiles_ptr + pid_m)
    p = tl.load(tiles_ptr + n_tiles + pid_m) + tl.arange(0, BM)
    return e, p, p < tl.load(tiles_ptr + 2 * n_tiles + pid_m), pid_n * BN + tl.arange(0, BN)


@triton.jit(do_not_specialize=["n_tiles"])
def _up_kernel(
    x_ptr,
    sxm,
    tiles_ptr,
    order_ptr,
    rw_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    h_ptr,
    n_tiles,
    n_experts,
    limit,
    KSLOT: tl.constexpr,
    D: tl.constexpr,
    I: tl.constexpr,
    FMT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr,
    SCALED: tl.constexpr,
    TMA: tl.constexpr = False,
    ASM: tl.constexpr = False,
    AQ_H: tl.constexpr = False,
):
    e, p, pm, rn = _tile(tiles_ptr, n_tiles, I, BM, BN, GROUP_M)
    if e >= n_experts:  # past the last real tile
        return
    pair = tl.load(order_ptr + p, mask=pm, other=0)
    xrow = x_ptr + (pair // KSLOT) * sxm
    acc1 = tl.zeros((BM, BN), tl.float32)
    acc3 = tl.zeros((BM, BN), tl.float32)
    for t in range((D + BK - 1) // BK):
        kk = t * BK + tl.arange(0, BK)
        a = tl.load(xrow[:, None] + kk[None, :], mask=pm[:, None] & (kk[None, :] < D), other=0.0)
        if SCALED:
            acc1 = _dot_scaled(acc1, a, w1_ptr, s1_ptr, e, rn, t * BK, I, D, BK, TMA)
            acc3 = _dot_scaled(acc3, a, w3_ptr, s3_ptr, e, rn, t * BK, I, D, BK, TMA)
        elif ASM:  # MXFP4 decoded by PTX (w*_ptr: int32 words of 8 nibbles)
            acc1 = tl.dot(a, tl.trans(mxfp4_tile_bf16(w1_ptr, s1_ptr, e, rn, t * BK, I, D, BN, BK)), acc1)
            acc3 = tl.dot(a, tl.trans(mxfp4_tile_bf16(w3_ptr, s3_ptr, e, rn, t * BK, I, D, BN, BK)), acc3)
        else:
            acc1 = _dot(acc1, a, weight_tile(w1_ptr, s1_ptr, e, rn, t * BK, I, D, FMT, BN, BK), DOT_F32)
            acc3 = _dot(acc3, a, weight_tile(w3_ptr, s3_ptr, e, rn, t * BK, I, D, FMT, BN, BK), DOT_F32)
    # the reference's roundings: x-dtype matmul outputs, x-dtype silu and product, then the fp32 routing weight
    dt = h_ptr.dtype.element_ty
    g = tl.minimum(acc1.to(dt).to(tl.float32), limit)
    u = tl.minimum(tl.maximum(acc3.to(dt).to(tl.float32), -limit), limit)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    a = (s * u).to(dt).to(tl.float32) * tl.load(rw_ptr + pair, mask=pm, other=0.0)[:, None]
    if AQ_H:  # the down projection's act_quant (W4A8 numerics on bf16 tiles): h in x's dtype, e4m3 x pow2 per 32
        hq, hs = quant_e4m3_pow2(tl.reshape(a.to(dt).to(tl.float32), (BM * (BN // 32), 32)))
        a = tl.reshape(hq.to(tl.float8e4nv, bitcast=True).to(tl.float32) * hs[:, None], (BM, BN))
    tl.store(h_ptr + p.to(tl.int64)[:, None] * I + rn[None, :], a.to(dt), mask=pm[:, None] & (rn[None, :] < I))


@triton.jit(do_not_specialize=["n_tiles"])
def _down_kernel(
    h_ptr,
    tiles_ptr,
    order_ptr,
    w2_ptr,
    s2_ptr,
    y_ptr,
    n_tiles,
    n_experts,
    D: tl.constexpr,
    I: tl.constexpr,
    FMT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr,
    SCALED: tl.constexpr,
    TMA: tl.constexpr = False,
    ASM: tl.constexpr = False,
):
    e, p, pm, rn = _tile(tiles_ptr, n_tiles, D, BM, BN, GROUP_M)
    if e >= n_experts:
        return
    hrow = h_ptr + p.to(tl.int64) * I
    acc = tl.zeros((BM, BN), tl.float32)
    for t in range((I + BK - 1) // BK):
        kk = t * BK + tl.arange(0, BK)
        a = tl.load(hrow[:, None] + kk[None, :], mask=pm[:, None] & (kk[None, :] < I), other=0.0)
        if SCALED:
            acc = _dot_scaled(acc, a, w2_ptr, s2_ptr, e, rn, t * BK, D, I, BK, TMA)
        elif ASM:
            acc = tl.dot(a, tl.trans(mxfp4_tile_bf16(w2_ptr, s2_ptr, e, rn, t * BK, D, I, BN, BK)), acc)
        else:
            acc = _dot(acc, a, weight_tile(w2_ptr, s2_ptr, e, rn, t * BK, D, I, FMT, BN, BK), DOT_F32)
    pair = tl.load(order_ptr + p, mask=pm, other=0)
    tl.store(
        y_ptr + pair[:, None] * D + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=pm[:, None] & (rn[None, :] < D)
    )


def _check(x, ids, weights, experts, kernel):
    if not isinstance(experts, ExpertWeights):
        raise ValueError(f"experts must be an ExpertWeights, got {type(experts).__name__}")
    n_exp, d, _ = experts.shape
    if x.dim() != 2 or x.shape[1] != d or not x.is_floating_point():
        raise ValueError(f"x must be a float [T, {d}] tensor, got {x.dtype} {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be int64/int32 [{x.shape[0]}, k], got {ids.dtype} {tuple(ids.shape)}")
    if tuple(weights.shape) != tuple(ids.shape) or not weights.is_floating_point():
        raise ValueError(f"weights must be float {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    if kernel and (x.dtype not in KERNEL_DTYPES or experts.w1.dtype not in KERNEL_DTYPES + (torch.uint8,)):
        raise ValueError(
            f"x {x.dtype} / weights {experts.w1.dtype} not supported by the kernel "
            f"(allowed: {KERNEL_DTYPES}, quantised weights)"
        )
    if not kernel and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_exp):
        raise ValueError(f"ids must lie in [0, {n_exp}), got [{int(ids.min())}, {int(ids.max())}]")


def routed_experts_ref(
    x,
    ids,
    weights,
    experts: ExpertWeights,
    limit: float,
    *,
    accumulate_into: torch.Tensor | None = None,
    accumulate_after=None,
    act_quant: bool = False,
) -> torch.Tensor:
    """MoE.forward's per-expert loop on the dequantised weights (cast to x's dtype), without the shared expert.
    ``accumulate_into`` ([T, d], x's dtype; the shared expert's output): the routed sum is added to it in place, in
    fp32 with one rounding (as the oracle adds the two), and it is returned. ``accumulate_after``: a CUDA event
    (accumulate_into made on another stream) the current stream waits for before the add. ``act_quant``: the
    release's W4A8 / W8A8 numerics (spec 2.12): x and the down projection's input h fake-quantised to e4m3 per 32
    channels with pow2 scales (quant.fake_quant_fp8_pow2) before their products."""
    _check(x, ids, weights, experts, kernel=False)
    _check_into(x, accumulate_into)
    out = torch.zeros(x.shape, dtype=acc(x).dtype, device=x.device)
    xq = fake_quant_fp8_pow2(x) if act_quant else x
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        w1, w3, w2 = (w.to(x.dtype) for w in experts.dequant(e))
        xe = xq[rows]
        he = clamped_swiglu(xe @ w1.t(), xe @ w3.t(), limit)
        he = (acc(he) * weights[rows, slot, None]).to(x.dtype)
        ye = (fake_quant_fp8_pow2(he) if act_quant else he) @ w2.t()
        out.index_add_(0, rows, acc(ye))
    if accumulate_into is not None:
        _wait(accumulate_after, x)
        return accumulate_into.copy_(out + acc(accumulate_into))
    return out.to(x.dtype)


def _wait(event, x) -> None:
    if event is not None:
        torch.cuda.current_stream(x.device).wait_event(event)


def _check_into(x, into):
    if into is not None and (into.shape != x.shape or into.dtype != x.dtype or into.device != x.device):
        raise ValueError(
            f"accumulate_into must be a {x.dtype} {tuple(x.shape)} tensor on {x.device}, got "
            f"{into.dtype} {tuple(into.shape)} on {into.device}"
        )


SMEM_BUDGET = 160 * 1024  # of the H200's 227 KiB per block: headroom for Triton's own buffers
# Compute-bound calls (prefill chunks): quantised experts dequantised to bf16 (ExpertWeights.dequantized) and run
# on bf16 tiles: 8192 tokens x top-6 of 48 MXFP4 experts took 10.67 ms with the in-register decode, 6.93 ms on bf16
# experts with these tiles (502 TFLOP/s; 9.19 ms with the default bf16 tiles), the dequant of a layer ~1-2 ms
# (H200, 2026-11-30, scratch sweep). The bf16 copy is transient: w1 + w3 for the up kernel, then w2.
DEQUANT_MIN_ROWS_PER_EXPERT = 512
DEQUANT_MAX_BYTES = 3 << 30  # of transient bf16 weights (w1 + w3); more experts than that keep the in-kernel decode
DEQUANT_TILES = {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3}


def _config(n, n_exp, d, inter, cfg, elem: int = 2, scaled: bool = False, asm: bool = False):
    """Tiles for n (row, expert) pairs; elem = the widest operand's bytes (4 for fp32 experts or rows); scaled /
    asm: MXFP4 by tl.dot_scaled / the PTX decode (packed weight tiles, half a byte an element, and larger prefill
    tiles)."""
    packed = scaled or asm
    rows = -(-n // min(n, n_exp))  # rows per used expert under even routing
    bm = cfg.get("BM", min(128 if packed else 64, max(16, triton.next_power_of_2(rows))))
    big = bm >= 64  # prefill: compute-bound tiles; else decode, weight-bandwidth bound
    c = {
        "BM": bm,
        "BN": 128 if big else 64,
        "BK": (128 if packed else 64) if big else 128,
        "GROUP_M": 8,
        "num_warps": 8 if big else 4,
        "num_stages": 3 if big else 4,
    }
    if asm and not big:  # the H200 sweep (benchmarks/results/decode-gemms-h200): 80 / 293 / 447 us at T = 1 / 8 / 32
        c.update(BK=256, num_stages=2)
    c.update(cfg)
    for key, low in (("BM", 16), ("BN", 16), ("BK", 32)):  # tl.dot dims >= 16; BK spans whole 32-wide scale blocks
        if c[key] < low or c[key] & (c[key] - 1):
            raise ValueError(f"config {key}={c[key]} must be a power of two >= {low}")
    # never wider than the dims each kernel runs over (tiny shapes), kept at those minimums
    c["BN_UP"], c["BN_DOWN"] = (max(16, min(c["BN"], triton.next_power_of_2(m))) for m in (inter, d))
    c["BK_UP"], c["BK_DOWN"] = (max(32, min(c["BK"], triton.next_power_of_2(m))) for m in (d, inter))
    c.update({key: cfg[key] for key in ("BN_UP", "BN_DOWN", "BK_UP", "BK_DOWN") if key in cfg})  # per-kernel sweeps
    # each pipeline stage holds a row tile and the up kernel's two weight tiles (w1, w3): fp32 prefill tiles need
    # 80 KiB a stage, so three stages would not fit
    w_elem = 0.5 if packed else elem
    stage = max(
        elem * c["BM"] * c["BK_UP"] + w_elem * 2 * c["BN_UP"] * c["BK_UP"],
        elem * c["BM"] * c["BK_DOWN"] + w_elem * c["BN_DOWN"] * c["BK_DOWN"],
    )
    if "num_stages" not in cfg:
        c["num_stages"] = max(1, min(c["num_stages"], int(SMEM_BUDGET // stage)))
    c["up_stages"] = c["num_stages"]
    if not asm and bm < 64 and "num_stages" not in cfg:
        # decode with many row tiles (T >= 8 on the release proxy): tl.dot_scaled's up kernel unpipelined fits more
        # programs per SM, which beat the pipeline's overlap: 233 vs 256 us (T = 8), 347 vs 392 us (T = 32), but
        # 88 vs 71 us at T = 1 (6 tiles), H200, 2026-11-30 (scratch sweep); the kernels read it with the tile count
        c["up_stages_many_tiles"] = 1
    return c


def _weight_desc(w: torch.Tensor, bn: int, bk: int):
    """A host TMA descriptor of packed MXFP4 weights [E, N, K/2] as [E * N, K/2] rows, [bn, bk/2] byte tiles (the
    rows are 16-byte multiples for every K the kernels take: K % 32 == 0)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, n, kh = w.shape
    return TensorDescriptor(w.view(e * n, kh), [e * n, kh], [kh, 1], [bn, bk // 2])


def expert_run_rows(n_exp: int, k: int, d: int, inter: int) -> list[int]:
    """The fewest tokens of each launch variant of the expert-run kernel (moe_permute.run_constexprs: its sizes and
    _config's BM follow from the token count), with packed MXFP4 tiles and without, and W4A8's (config_a8). A
    warm-up that runs these row counts builds every variant traffic can meet (engine.warmup); past MAX_KERNEL_PAIRS
    pairs torch sorts."""
    from .grouped_moe_a8 import config_a8

    first = {}
    for t in range(1, MAX_KERNEL_PAIRS // k + 1):
        bms = [_config(t * k, n_exp, d, inter, {}, scaled=packed)["BM"] for packed in (False, True)]
        for bm in bms + [config_a8(t * k, n_exp, d, inter)["BM"]]:  # and W4A8's tiles (act_quant)
            first.setdefault(tuple(sorted(run_constexprs(t * k, n_exp, bm).items())), t)
    return sorted(set(first.values()))


def routed_experts(
    x,
    ids,
    weights,
    experts: ExpertWeights,
    limit: float,
    *,
    accumulate_into: torch.Tensor | None = None,
    accumulate_after=None,
    config: dict | None = None,
    act_quant: bool = False,
):
    """Triton grouped GEMMs, same semantics as routed_experts_ref. act_quant: W4A8 / W8A8 on FP8 tensor cores
    (grouped_moe_a8; config keys as its routed_experts_a8). Ids must lie in [0, E) (not checked: that would
    need a host sync); a pick outside leaves its row undefined. config overrides BM, BN, BK, GROUP_M, num_warps,
    num_stages, decode and tma (tests and benchmarks only). decode (MXFP4 with bf16 rows; _mxfp4_decode): "asm"
    (the default on CUDA for decode-sized calls: 1.3-1.4x tl.dot_scaled's speed on the H200, 2026-12-02:
    benchmarks/results/decode-gemms-h200), "scaled" (tl.dot_scaled; the older key scaled=True), "own"
    (scaled=False; 1.7-2.2x slower than scaled, 2026-11-29: benchmarks/results/model-h200). tma ("scaled" only;
    off until measured on the GPU): the packed weight tiles are loaded by TMA from host tensor descriptors. dequant
    (True / False; default: bf16 rows, >= DEQUANT_MIN_ROWS_PER_EXPERT pairs an expert, within DEQUANT_MAX_BYTES):
    run quantised experts as bf16 ones, dequantised first. accumulate_into: see the reference (one launch where a
    separate add would take three)."""
    if act_quant:
        from .grouped_moe_a8 import routed_experts_a8

        return routed_experts_a8(
            x,
            ids,
            weights,
            experts,
            limit,
            accumulate_into=accumulate_into,
            accumulate_after=accumulate_after,
            config=config,
        )
    _check(x, ids, weights, experts, kernel=True)
    _check_into(x, accumulate_into)
    (t, k), (n_exp, d, inter) = ids.shape, experts.shape
    if t * k == 0:
        _wait(accumulate_after, x)
        return accumulate_into if accumulate_into is not None else torch.zeros(t, d, dtype=x.dtype, device=x.device)
    cfg = dict(config or {})
    aq_h = cfg.pop("act_quant_h", False)  # grouped_moe_a8's prefill path: h fake-quantised in the up epilogue
    dense = cfg.pop("dequant", None)
    if dense is None:
        dense = (
            experts.fmt != "bf16"
            and x.dtype == torch.bfloat16
            and t * k >= DEQUANT_MIN_ROWS_PER_EXPERT * n_exp
            and 2 * experts.w1.shape[0] * inter * d * 2 <= DEQUANT_MAX_BYTES
        )
    decode = _mxfp4_decode(x, experts, dense, cfg, t * k)
    scaled, asm = decode == "scaled", decode == "asm"
    if dense:
        cfg = {**DEQUANT_TILES, **cfg}
    tma = scaled and cfg.pop("tma", False)
    c = _config(
        t * k,
        n_exp,
        d,
        inter,
        cfg,
        x.element_size() if dense else max(x.element_size(), experts.w1.element_size()),
        scaled,
        asm,
    )
    if aq_h and c["BN_UP"] % 32:
        raise ValueError(f"act_quant_h quantises h per 32 columns: BN_UP={c['BN_UP']} must be a multiple of 32")
    order, tiles = expert_tiles(ids, n_exp, c["BM"])
    nt, fmt = tiles.shape[1], FMTS.index("bf16" if dense else experts.fmt)
    x = x if x.stride(1) == 1 else x.contiguous()
    rw = weights.float().contiguous()
    h = _empty((t * k, inter), dtype=x.dtype, device=x.device)
    yk = _empty((t * k, d), dtype=x.dtype, device=x.device)
    s1, s3, s2 = (s if s is not None else w for w, s in experts._pairs())  # bf16: unused, any pointer does
    common = dict(
        FMT=fmt,
        BM=c["BM"],
        GROUP_M=c["GROUP_M"],
        DOT_F32=_INTERPRET or x.dtype == torch.float32,
        SCALED=scaled,
        ASM=asm,
        num_warps=c["num_warps"],
    )
    up_stages = c.get("up_stages_many_tiles", c["up_stages"]) if nt >= 16 else c["up_stages"]
    w1, w3, w2 = experts.w1, experts.w3, experts.w2
    if dense:  # w2 is dequantised after the up kernel, into the memory w1 and w3 free (stream order)
        w1, w3 = experts.dequantized("w1", x.dtype), experts.dequantized("w3", x.dtype)
    if asm:  # the PTX decode reads 32-bit words of 8 nibbles
        w1, w3, w2 = (w.view(torch.int32) for w in (w1, w3, w2))
    if tma:  # packed weight tiles by TMA: no per-element address arithmetic (K step 1173 -> 827 SASS, sm_90)
        w1, w3 = (_weight_desc(w, c["BN_UP"], c["BK_UP"]) for w in (w1, w3))
        w2 = _weight_desc(w2, c["BN_DOWN"], c["BK_DOWN"])
    _up_kernel[(nt * triton.cdiv(inter, c["BN_UP"]),)](
        x,
        x.stride(0),
        tiles,
        order,
        rw,
        w1,
        s1,
        w3,
        s3,
        h,
        nt,
        n_exp,
        float(limit),
        KSLOT=k,
        D=d,
        I=inter,
        BN=c["BN_UP"],
        BK=c["BK_UP"],
        num_stages=up_stages,
        TMA=tma,
        AQ_H=aq_h,
        **common,
    )
    if dense:
        del w1, w3
        w2 = experts.dequantized("w2", x.dtype)
    _down_kernel[(nt * triton.cdiv(d, c["BN_DOWN"]),)](
        h,
        tiles,
        order,
        w2,
        s2,
        yk,
        nt,
        n_exp,
        D=d,
        I=inter,
        BN=c["BN_DOWN"],
        BK=c["BK_DOWN"],
        num_stages=c["num_stages"],
        TMA=tma,
        **common,
    )
    routed = yk.view(t, k, d).sum(1, dtype=torch.float32)  # fp32 sum, no fp32 copy of yk
    if accumulate_into is not None:
        _wait(accumulate_after, x)
        return accumulate_into.add_(routed)  # computed in fp32, rounded once into x's dtype
    return routed.to(x.dtype)


MXFP4_DECODES = ("asm", "scaled", "own")
# the PTX decode is the default up to this many pairs an expert (decode-sized tiles, BM < 64), where it was measured
DECODE_ROWS_PER_EXPERT = 32


def _mxfp4_decode(x, experts: ExpertWeights, dense: bool, cfg: dict, n_pairs: int) -> str:
    """How the kernels turn MXFP4 weights into bf16 MMA operands (pops config keys decode / scaled):
    "asm" (default where it runs: CUDA, bf16 rows, every scale byte <= MXFP4_FAST_MAX_SCALE, decode-sized calls
    of <= DECODE_ROWS_PER_EXPERT pairs an expert): dequant's PTX, eight nibbles a 32-bit word; "scaled":
    tl.dot_scaled (the default otherwise); "own": the kernel's fp32 nibble decode (what other formats, fp16 / fp32
    rows and the interpreter take, whatever is asked)."""
    scaled = cfg.pop("scaled", None)  # the older switch: False = "own"
    decode = cfg.pop("decode", None if scaled is None else "scaled" if scaled else "own")
    if decode is not None and decode not in MXFP4_DECODES:
        raise ValueError(f"config decode {decode!r} not supported (allowed: {MXFP4_DECODES})")
    if dense or experts.fmt != "mxfp4" or x.dtype != torch.bfloat16:
        return "own"
    asm_runs = x.is_cuda and not _INTERPRET and experts.max_scale <= MXFP4_FAST_MAX_SCALE
    if decode == "asm" and not asm_runs:
        raise ValueError(
            f"config decode 'asm' needs CUDA (not the interpreter) and scale bytes <= "
            f"{MXFP4_FAST_MAX_SCALE}, got device {x.device}, largest scale byte {experts.max_scale}"
        )
    small = n_pairs <= DECODE_ROWS_PER_EXPERT * experts.shape[0]
    return decode or ("asm" if asm_runs and small else "scaled")


def bench(
    device="cuda",
    d: int = 5120,
    inter: int = 2304,
    n_experts: int = 48,
    k: int = 6,
    sets: int = 4,
    tokens=(1, 8, 32, 128, 4096),
) -> dict:
    """Median device ms of routed_experts (CUDA graphs: the default decode; also tl.dot_scaled's upcast, the
    kernel's own nibble decode, and tl.dot_scaled with TMA weight tiles) and routed_experts_ref (eager: its
    torch.unique syncs) on one EP rank's MXFP4 experts, over `sets` random routings; weight_GBps = bytes of the
    experts touched / time, TFLOPs = the three GEMMs' FLOPs / time."""
    from ..bench.device_timing import eager_ms, graph_ms

    g = torch.Generator(device=device).manual_seed(0)
    ex = ExpertWeights.from_dense(
        *(
            torch.randn(n_experts, o, i, device=device, generator=g) * i**-0.5
            for o, i in ((inter, d), (inter, d), (d, inter))
        ),
        "mxfp4",
    )
    per_expert = sum(w[0].numel() + s[0].numel() for w, s in ex._pairs())
    res = {}
    for t in tokens:
        xs = [torch.randn(t, d, device=device, generator=g, dtype=torch.bfloat16) for _ in range(sets)]
        ids = [torch.rand(t, n_experts, device=device, generator=g).argsort(1)[:, :k] for _ in range(sets)]
        ws = [torch.rand(t, k, device=device, generator=g) for _ in range(sets)]
        used = sum(i.unique().numel() for i in ids) / sets
        ms = graph_ms(lambda i: routed_experts(xs[i], ids[i], ws[i], ex, 10.0), sets)
        scaled_ms = graph_ms(
            lambda i: routed_experts(xs[i], ids[i], ws[i], ex, 10.0, config={"decode": "scaled"}), sets
        )
        own_ms = graph_ms(lambda i: routed_experts(xs[i], ids[i], ws[i], ex, 10.0, config={"decode": "own"}), sets)
        tma = {"decode": "scaled", "tma": True}
        try:  # TMA descriptors from the host are newer than some Tritons: keep the other numbers if they fail
            tma_ms = graph_ms(lambda i: routed_experts(xs[i], ids[i], ws[i], ex, 10.0, config=tma), sets)
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            tma_ms, res.setdefault("errors", {})[f"tma T={t}"] = float("nan"), repr(e)[:300]
        ref_ms = eager_ms(lambda i: routed_experts_ref(xs[i], ids[i], ws[i], ex, 10.0), sets)
        res[f"T={t}"] = {
            "ms": ms,
            "scaled_ms": scaled_ms,
            "own_decode_ms": own_ms,
            "tma_ms": tma_ms,
            "ref_ms": ref_ms,
            "experts_touched": used,
            "weight_GBps": used * per_expert / ms / 1e6,
            "scaled_weight_GBps": used * per_expert / scaled_ms / 1e6,
            "own_decode_weight_GBps": used * per_expert / own_ms / 1e6,
            "tma_weight_GBps": used * per_expert / tma_ms / 1e6,
            "TFLOPs": 6 * t * k * d * inter / ms / 1e9,
        }
    return res
