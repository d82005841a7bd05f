"""MoE router (spec 2.5, layers.moe.Gate without hash routing): logits, sqrtsoftplus, biased top-k, weights.

* x [T, d] bf16 / fp16 / fp32 (the reference: any float dtype, fp64 kept); weight [E, d] bf16 / fp16 / fp32;
  bias, bias_alt [E] fp32 (or None); use_alt bool [T] (or None): rows that select with bias_alt (image spans).
* -> ids int64 [T, k]: the k largest biased scores, descending, ties to the LOWER expert id (Gate's stable sort);
  weights fp32 [T, k] (fp64 for fp64 x in the reference): scores[ids] / (sum + 1e-20) * scale.
  scores = sqrt(softplus((x @ W^T in fp32) / temp)); biased = scores + bias, or + bias_alt on use_alt rows.
  As in Gate, use_alt is ignored without bias_alt. NaN / inf logits are not supported.

Kernel (one launch when a program sees every expert and all of d): each program computes a [BT, BE] logit tile
with a K-loop over d (tl.dot, fp32 accumulate; bf16 x bf16 products are exact in fp32, so only the summation
order differs from the reference; other dtype mixes and fp32 run IEEE fp32 dots). With BE covering E and no split
of d, the same program then runs k rounds of (row max, lowest column at the max, mask it out) and writes ids and
weights. Otherwise it stores fp32 partial logits [SPLIT, T, E] and _select_kernel sums them and selects.
Tiles (H200, 132 SMs): T <= 64 is bound by reading W (384 x 5120 bf16 = 3.9 MB) and one program per row block
would stream it through a single SM, so E is split in 32-expert tiles and d into ~one wave of programs (~32 KB of
W each), then a second tiny pass selects. Longer batches: 64 x 128 tiles plus split-K and the same selection pass.
The one-launch variant (BT = 64 rows x all E, 384 padded to 512, per program; 8 warps; BK = 32 for 3 smem stages
in ~108 KB) is kept behind config={"fused": True}: on the H200 at T = 4096 it took 0.236 ms against the split
path's 0.077 ms (benchmarks/results/model-h200), its 64 programs being too few to fill 132 SMs.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from ..layers.moe import Gate

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_E = 1024  # the selection holds a [rows, next_pow2(E)] fp32 tile in registers
# The Triton 3.9 interpreter gets bf16 dots wrong; fp32 dots of the same (exact) products stand in there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _log1p(z):  # log(1 + z) accurate for tiny z (Goldberg); libdevice.log1p is missing from the interpreter
    u = 1.0 + z
    dz = u - 1.0  # the z that 1 + z really added; 0 where z is below half an ulp of 1
    return tl.where(dz == 0.0, z, tl.log(u) * (z / tl.where(dz == 0.0, 1.0, dz)))


@triton.jit
def _pick(
    logits,
    rows,
    cols,
    T,
    E,
    b_ptr,
    ba_ptr,
    u_ptr,
    ids_ptr,
    wo_ptr,
    temp,
    scale,
    BT: tl.constexpr,
    EP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALT: tl.constexpr,
):
    g = tl.math.div_rn(logits, temp)
    sp = tl.where(g > 20.0, g, _log1p(tl.exp(tl.minimum(g, 20.0))))  # torch softplus: threshold 20
    # padded experts score -inf, so every biased score of theirs is -inf and never picked (k <= E)
    s = tl.where(cols[None, :] < E, tl.sqrt_rn(sp), float("-inf"))
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
    else:  # Gate's zero bias (a no-bias call still selects with bias_alt on use_alt rows)
        b = tl.zeros((EP,), tl.float32)
    if HAS_ALT:
        ba = tl.load(ba_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
        alt = tl.load(u_ptr + rows, mask=rows < T, other=0) != 0
    kc = tl.arange(0, KP)
    wt = tl.zeros((BT, KP), tl.float32)
    for j in tl.static_range(K):
        # biased scores rebuilt from s each round: one [rows, EP] tile stays live, picks are masked in s itself
        if HAS_ALT:
            biased = tl.where(alt[:, None], s + ba[None, :], s + b[None, :])
        elif HAS_BIAS:
            biased = s + b[None, :]
        else:
            biased = s
        m = tl.max(biased, axis=1)
        idx = tl.min(tl.where(biased == m[:, None], cols[None, :], EP), axis=1)  # ties: the lower id
        hit = cols[None, :] == idx[:, None]
        sj = tl.sum(tl.where(hit, s, 0.0), axis=1)  # exact: one nonzero term
        s = tl.where(hit, float("-inf"), s)
        tl.store(ids_ptr + rows * K + j, idx.to(tl.int64), mask=rows < T)
        wt = tl.where(kc[None, :] == j, sj[:, None], wt)
    tot = tl.sum(wt, axis=1) + 1e-20
    w = tl.math.div_rn(wt, tot[:, None]) * scale
    tl.store(wo_ptr + rows[:, None] * K + kc[None, :], w, mask=(rows[:, None] < T) & (kc[None, :] < K))


@triton.jit(do_not_specialize=["T"])
def _route_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    ba_ptr,
    u_ptr,
    ids_ptr,
    wo_ptr,
    p_ptr,
    T,
    E,
    sx,
    temp,
    scale,
    D: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
    BK: tl.constexpr,
    K_TILES: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    FUSED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BE + tl.arange(0, BE)
    acc = tl.zeros((BT, BE), tl.float32)
    for t in range(K_TILES):
        kk = (tl.program_id(2) * K_TILES + t) * BK + tl.arange(0, BK)
        xt = tl.load(x_ptr + rows[:, None] * sx + kk[None, :], mask=(rows[:, None] < T) & (kk[None, :] < D), other=0.0)
        # [BK, BE] view of the [E, d] weight: K-major, the B-operand layout the MMAs want
        wt = tl.load(w_ptr + cols[None, :] * D + kk[:, None], mask=(cols[None, :] < E) & (kk[:, None] < D), other=0.0)
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, wt)
    if FUSED:
        _pick(
            acc, rows, cols, T, E, b_ptr, ba_ptr, u_ptr, ids_ptr, wo_ptr, temp, scale, BT, BE, K, KP, HAS_BIAS, HAS_ALT
        )
    else:
        p = p_ptr + tl.program_id(2) * T * E + rows[:, None] * E + cols[None, :]
        tl.store(p, acc, mask=(rows[:, None] < T) & (cols[None, :] < E))


@triton.jit(do_not_specialize=["T"])
def _select_kernel(
    p_ptr,
    b_ptr,
    ba_ptr,
    u_ptr,
    ids_ptr,
    wo_ptr,
    T,
    E,
    temp,
    scale,
    SPLIT: tl.constexpr,
    BT: tl.constexpr,
    EP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALT: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, EP)
    m = (rows[:, None] < T) & (cols[None, :] < E)
    logits = tl.zeros((BT, EP), tl.float32)
    for i in range(SPLIT):
        logits += tl.load(p_ptr + i * T * E + rows[:, None] * E + cols[None, :], mask=m, other=0.0)
    _pick(
        logits, rows, cols, T, E, b_ptr, ba_ptr, u_ptr, ids_ptr, wo_ptr, temp, scale, BT, EP, K, KP, HAS_BIAS, HAS_ALT
    )


def _check(x, weight, bias, k, temp, bias_alt, use_alt, kernel: bool):
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"route: x must be a float [T, d] tensor, got {x.dtype} {tuple(x.shape)}")
    t, d = x.shape
    if weight.dim() != 2 or weight.shape[1] != d or not weight.is_floating_point():
        raise ValueError(f"route: weight must be a float [E, {d}] tensor, got {weight.dtype} {tuple(weight.shape)}")
    e = weight.shape[0]
    for name, b in (("bias", bias), ("bias_alt", bias_alt)):
        if b is not None and (tuple(b.shape) != (e,) or not b.is_floating_point()):
            raise ValueError(f"route: {name} must be None or a float [E={e}] tensor, got {b.dtype} {tuple(b.shape)}")
    if use_alt is not None and (tuple(use_alt.shape) != (t,) or use_alt.dtype != torch.bool):
        raise ValueError(f"route: use_alt must be None or bool [T={t}], got {use_alt.dtype} {tuple(use_alt.shape)}")
    if not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"route: k must be an int in [1, E={e}], got {k!r}")
    if not temp > 0:
        raise ValueError(f"route: temp must be > 0, got {temp!r}")
    if kernel:
        if x.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
            raise ValueError(f"route: kernel dtypes are {KERNEL_DTYPES}, got x {x.dtype}, weight {weight.dtype}")
        if e > MAX_E:
            raise ValueError(f"route: at most {MAX_E} experts in the kernel, got {e}")
        others = [a for a in (weight, bias, bias_alt, use_alt) if a is not None]
        if any(a.device != x.device for a in others):
            raise ValueError(f"route: all tensors must be on x's device {x.device}, got {[a.device for a in others]}")


def route_ref(x, weight, bias, k: int, temp: float, scale: float, bias_alt=None, use_alt=None):
    """Gate.forward itself (non-hash routing), called on a stand-in holding these tensors: no second copy of
    the router's math to drift from the model's."""
    _check(x, weight, bias, k, temp, bias_alt, use_alt, kernel=False)
    if bias is None:
        bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    gate = SimpleNamespace(
        topk=k, temp=temp, scale=scale, hash_routed=False, weight=weight, bias=bias, bias_vl=bias_alt
    )
    return Gate.forward(gate, x, None, use_alt)


SMEM_BUDGET = 160 * 1024  # of the H200's 227 KiB per block: headroom for Triton's own buffers


def _plan(t, e, d, sms, cfg, elem: int = 2):
    """Tile choice (see the module doc); cfg keys override: fused, BT, BE, BK, SPLIT, BT_SELECT, num_warps,
    num_stages. fused forces one program per row block over all experts and all of d. elem: the widest operand's
    bytes (fp32 tiles take twice the shared memory a stage, so fewer stages fit)."""
    ep = max(16, triton.next_power_of_2(e))  # tl.dot wants every dim >= 16
    if cfg.get("fused", False):
        p = dict(BT=64, BE=ep, BK=32, SPLIT=1, num_warps=8, num_stages=3)
    elif t <= 64:
        p = dict(BT=max(16, triton.next_power_of_2(t)), BE=32, BK=128, num_warps=4, num_stages=4)
    else:
        p = dict(BT=64, BE=128, BK=64, num_warps=4, num_stages=3)
    p.update({key: v for key, v in cfg.items() if key != "fused"})
    if "num_stages" not in cfg:
        p["num_stages"] = max(1, min(p["num_stages"], SMEM_BUDGET // (elem * p["BK"] * (p["BT"] + p["BE"]))))
    tiles, k_tiles = triton.cdiv(t, p["BT"]) * triton.cdiv(e, p["BE"]), triton.cdiv(d, p["BK"])
    split = min(k_tiles, p.get("SPLIT", max(1, sms // tiles)))
    p["K_TILES"] = triton.cdiv(k_tiles, split)
    p["SPLIT"] = triton.cdiv(k_tiles, p["K_TILES"])  # no empty programs
    p["FUSED"] = p["SPLIT"] == 1 and p["BE"] >= e
    p.setdefault("BT_SELECT", 8)
    return p, ep


def sm_count(device: torch.device) -> int:
    """The SMs _plan spreads a batch's programs over (1 off the GPU, where the interpreter runs one at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def split_rows(e: int, d: int, sms: int, max_rows: int) -> list[int]:
    """The fewest rows of each launch variant up to ``max_rows``: _plan's tiles and its split of d (K_TILES, and
    SPLIT in _select_kernel) are constexprs that follow from the row count and the SM count alone, so each variant
    compiles apart. A warm-up that runs these row counts builds every variant traffic can meet (engine.warmup).
    The operands' width only moves num_stages, which changes where the tiles do, so it adds no row here."""
    first = {}
    for t in range(1, max_rows + 1):
        first.setdefault(tuple(sorted(_plan(t, e, d, sms, {})[0].items())), t)
    return sorted(first.values())


def route(
    x,
    weight,
    bias,
    k: int,
    temp: float,
    scale: float,
    bias_alt=None,
    use_alt=None,
    *,
    out=None,
    config: dict | None = None,
):
    """Triton route_ref. out: optional (ids int64 [T, k], weights fp32 [T, k]) to write into; config overrides
    the tiles (tests and benchmarks only, see _plan)."""
    _check(x, weight, bias, k, temp, bias_alt, use_alt, kernel=True)
    (t, d), e, dev = x.shape, weight.shape[0], x.device
    if out is None:
        out = (torch.empty(t, k, dtype=torch.int64, device=dev), torch.empty(t, k, dtype=torch.float32, device=dev))
    ids, wo = out
    if (
        tuple(ids.shape) != (t, k)
        or ids.dtype != torch.int64
        or tuple(wo.shape) != (t, k)
        or wo.dtype != torch.float32
        or not (ids.is_contiguous() and wo.is_contiguous())
    ):
        raise ValueError(f"route: out must be contiguous (int64 [{t}, {k}], float32 [{t}, {k}])")
    if t == 0:  # an empty grid is not launchable
        return ids, wo
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    has_alt = bias_alt is not None and use_alt is not None
    b = bias.contiguous() if bias is not None else wo  # else a dummy pointer, never read (HAS_BIAS False)
    ba, u = (bias_alt.contiguous(), use_alt.contiguous().view(torch.uint8)) if has_alt else (b, ids)
    sms = sm_count(dev)
    p, ep = _plan(t, e, d, sms, dict(config or {}), max(x.element_size(), weight.element_size()))
    kp = triton.next_power_of_2(k)
    part = wo if p["FUSED"] else torch.empty(p["SPLIT"], t, e, dtype=torch.float32, device=dev)
    dot_f32 = _INTERPRET or x.dtype == torch.float32 or x.dtype != weight.dtype
    grid = (triton.cdiv(t, p["BT"]), triton.cdiv(e, p["BE"]), p["SPLIT"])
    _route_kernel[grid](
        x,
        weight,
        b,
        ba,
        u,
        ids,
        wo,
        part,
        t,
        e,
        x.stride(0),
        float(temp),
        float(scale),
        D=d,
        BT=p["BT"],
        BE=p["BE"],
        BK=p["BK"],
        K_TILES=p["K_TILES"],
        K=k,
        KP=kp,
        FUSED=p["FUSED"],
        HAS_BIAS=bias is not None,
        HAS_ALT=has_alt,
        DOT_F32=dot_f32,
        num_warps=p["num_warps"],
        num_stages=p["num_stages"],
    )
    if not p["FUSED"]:
        bts = p["BT_SELECT"]
        _select_kernel[(triton.cdiv(t, bts),)](
            part,
            b,
            ba,
            u,
            ids,
            wo,
            t,
            e,
            float(temp),
            float(scale),
            SPLIT=p["SPLIT"],
            BT=bts,
            EP=ep,
            K=k,
            KP=kp,
            HAS_BIAS=bias is not None,
            HAS_ALT=has_alt,
            num_warps=4,
        )
    return ids, wo


def bench(device="cuda", d: int = 5120, e: int = 384, k: int = 6, copies: int = 16) -> dict:
    """Median device ms (CUDA graphs) of route, its one-launch and split forms, and route_ref (the unfused torch
    path) at T in {1, 16, 64, 4096}; the gate weights rotate over `copies` bf16 copies (16 x 3.9 MB > the
    50 MB L2), so that decode reads them from HBM as 40+ layers would. Keys "T=t"."""
    from ..bench.device_timing import graph_ms

    ws = [torch.randn(e, d, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    bias = torch.randn(e, device=device) * 0.1
    res = {}
    for t in (1, 16, 64, 4096):
        x = torch.randn(t, d, device=device, dtype=torch.bfloat16)
        runs = {
            "route": lambda i, c=None: route(x, ws[i % copies], bias, k, 1.0, 1.5, config=c),
            "ref": lambda i: route_ref(x, ws[i % copies], bias, k, 1.0, 1.5),
        }
        row = res[f"T={t}"] = {name: graph_ms(fn, copies) for name, fn in runs.items()}
        for name, c in (("fused", {"fused": True}), ("split", {"fused": False})):
            row[name] = graph_ms(lambda i, c=c: runs["route"](i, c), copies)
        row["ref_over_route"] = row["ref"] / row["route"]
    return res
