"""Instructions a weight element costs in the routed-expert up kernel, read from its sm_90 SASS (issues 8, 59).

Compiles grouped_moe's up kernel offline for the H200 (Triton's bundled ptxas and nvdisasm; no GPU needed) for each
MXFP4 decode (tl.dot_scaled, the PTX decode, the kernel's own fp32 decode) on a decode tile, and grouped_moe_a8's
W4A8 up kernel (e2m1 -> e4m3 in registers, fp8 wgmma), finds the K loop (the backward branch) and counts its SASS
by opcode. One K step decodes 2 x BN x BK weights (W1 and W3) over num_warps x 32 threads, so instructions per
element = loop instructions / (2 BN BK / threads): the issue budget per weight an SM spends, which bounds bandwidth
when the SMs are issue-bound. It also compiles the W4A8 down kernel and fp8_linear's W8A8 kernel (swapped and
not), so a run here shows that every new kernel builds for sm_90 before a GPU is lent.

    python benchmarks/kernel_sass.py --out benchmarks/results/decode-gemms-h200

Prints a table, then one JSON line; writes kernel_sass.json under --out.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.kernels import fp8_linear as F  # noqa: E402
from dsserve.kernels import grouped_moe as G  # noqa: E402
from dsserve.kernels import grouped_moe_a8 as A  # noqa: E402

D, INTER = 5120, 2304
POINTERS = ("x_ptr", "tiles_ptr", "order_ptr", "rw_ptr", "w1_ptr", "s1_ptr", "w3_ptr", "s3_ptr", "h_ptr")


def compile_up(decode: str, bm: int, bn: int, bk: int, warps: int, stages: int, aq_h: bool = False):
    w = "*i32" if decode == "asm" else "*u8"
    sig = {
        "x_ptr": "*bf16",
        "sxm": "i32",
        "tiles_ptr": "*i32",
        "order_ptr": "*i64",
        "rw_ptr": "*fp32",
        "w1_ptr": w,
        "s1_ptr": "*u8",
        "w3_ptr": w,
        "s3_ptr": "*u8",
        "h_ptr": "*bf16",
        "n_tiles": "i32",
        "n_experts": "i32",
        "limit": "fp32",
    }
    const = {
        "KSLOT": 6,
        "D": D,
        "I": INTER,
        "FMT": 2,
        "BM": bm,
        "BN": bn,
        "BK": bk,
        "GROUP_M": 8,
        "DOT_F32": False,
        "SCALED": decode == "scaled",
        "TMA": False,
        "ASM": decode == "asm",
        "AQ_H": aq_h,
    }
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    # what the launcher specialises at run time: 16-byte aligned pointers, the row stride a multiple of 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in POINTERS + ("sxm",)}
    src = ASTSource(fn=G._up_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def _compile(fn, sig: dict, const: dict, warps: int, stages: int):
    sig = {**sig, **{k: "constexpr" for k in const}}
    names = list(sig)
    # what the launcher specialises at run time: 16-byte aligned pointers
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def compile_up_a8(bm: int, bn: int, bk: int, warps: int, stages: int, swap: bool, asm: bool = True, fmt: int = 2):
    """grouped_moe_a8's up kernel, bf16 rows: W4A8 (fmt 2, MXFP4 experts) or W8A8 (fmt 1, FP8 experts)."""
    sig = {f"{n}_ptr": t for n, t in (("q", "*u8"), ("qs", "*fp32"), ("tiles", "*i32"), ("order", "*i64"))}
    sig.update({"rw_ptr": "*fp32", "w1_ptr": "*u8", "s1_ptr": "*u8", "w3_ptr": "*u8", "s3_ptr": "*u8"})
    sig.update({"hq_ptr": "*u8", "hs_ptr": "*fp32", "n_tiles": "i32", "n_experts": "i32", "limit": "fp32"})
    const = {"KSLOT": 6, "D": D, "I": INTER, "FMT": fmt, "DT": triton.language.bfloat16, "BM": bm, "BN": bn}
    const.update({"BK": bk, "GROUP_M": 8, "SWAP": swap, "ASM": asm})
    return _compile(A._up_a8_kernel, sig, const, warps, stages)


def compile_down_a8(bm: int, bn: int, bk: int, warps: int, stages: int, swap: bool):
    sig = {"hq_ptr": "*u8", "hs_ptr": "*fp32", "tiles_ptr": "*i32", "order_ptr": "*i64", "w2_ptr": "*u8"}
    sig.update({"s2_ptr": "*u8", "y_ptr": "*bf16", "n_tiles": "i32", "n_experts": "i32"})
    const = {"D": D, "I": INTER, "FMT": 2, "BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "SWAP": swap, "ASM": True}
    return _compile(A._down_a8_kernel, sig, const, warps, stages)


def compile_w8a8(
    n_k: tuple, bm: int, bn: int, bk: int, k_tiles: int, split: int, swap: bool, warps: int, stages: int, fuse=False
):
    """fp8_linear's W8A8 kernel on a [N, K] = n_k weight (32x32 blocks, act groups of 32); fuse: the activation
    quantisation inside (bf16 rows in)."""
    sig = {"q_ptr": "*bf16" if fuse else "*u8", "qs_ptr": "*bf16" if fuse else "*fp32", "w_ptr": "*u8"}
    sig.update({"s_ptr": "*u8", "o_ptr": "*bf16", "part_ptr": "*fp32"})
    sig.update({"cnt_ptr": "*i32", "M": "i32", "N": "i32", "sqm": "i32", "ssm": "i32", "ssg": "i32", "som": "i32"})
    sig["sos"] = "i32"
    const = {"K": n_k[1], "BLOCK": 32, "G": 32, "BM": bm, "BN": bn, "BK": bk, "K_TILES": k_tiles, "SPLIT": split}
    const.update({"SWAP": swap, "GROUP_N": 0, "FUSE_Q": fuse})
    return _compile(F._w8a8_kernel, sig, const, warps, stages)


def sass_lines(kernel) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()


def k_loop(lines: list[str]) -> dict:
    """Opcode counts of the longest loop (a label reached by a later branch)."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = [
        (labels[m.group(1)], i)
        for i, line in enumerate(lines)
        if (m := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)) and labels.get(m.group(1), i) < i
    ]
    a, b = max(loops, key=lambda ab: ab[1] - ab[0])
    ops = {}
    for line in lines[a : b + 1]:
        if re.match(r"\s+/\*[0-9a-f]+\*/\s", line):
            words = line.split("*/", 1)[1].strip().split()
            op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
            ops[op] = ops.get(op, 0) + 1
    return ops


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = {}
    # the decode tiles each decode runs with by default (grouped_moe._config): BM 16, 4 warps
    for decode, bn, bk, stages in (
        ("scaled", 64, 128, 1),
        ("scaled", 64, 128, 2),
        ("asm", 64, 256, 2),
        ("asm", 128, 256, 2),
        ("own", 64, 128, 2),
    ):
        ops = k_loop(sass_lines(compile_up(decode, 16, bn, bk, 4, stages)))
        n = sum(ops.values())
        per = n / (2 * bn * bk / 128)
        top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8])
        rows[f"{decode} BN={bn} BK={bk} stages={stages}"] = {"loop_instructions": n, "per_weight": per, "top": top}
        print(
            f"{decode:6s} BN={bn:3d} BK={bk} stages={stages}: {n:5d} instructions a K step, {per:.2f} a weight, {top}",
            flush=True,
        )
    # W4A8 (grouped_moe_a8): its default decode tile (config_a8: BM 8 up to 8 rows an expert, BN 64, BK 256,
    # swapped, 4 warps, 4 stages), wider and taller ones, and the unswapped orientation (BM >= 16 there)
    for bm, bn, bk, swap in ((8, 64, 256, True), (8, 128, 256, True), (16, 64, 256, True), (16, 64, 256, False)):
        ops = k_loop(sass_lines(compile_up_a8(bm, bn, bk, 4, 4, swap)))
        n = sum(ops.values())
        per = n / (2 * bn * bk / 128)
        top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])
        key = f"w4a8 BM={bm} BN={bn} BK={bk} swap={swap}"
        rows[key] = {"loop_instructions": n, "per_weight": per, "top": top, "fp8_mma": ops.get("QGMMA", 0)}
        print(f"{key}: {n:5d} instructions a K step, {per:.2f} a weight, {top}", flush=True)
    # W8A8 dense (fp8_linear): decode tile on wq_a (BM 8 swapped, BN 64, BK 128, split K); 1 byte a weight, no
    # conversion: the loop is loads, wgmma and the per-32 rescale
    for fuse in (False, True):
        ops = k_loop(sass_lines(compile_w8a8((1280, 5120), 8, 64, 128, 4, 10, True, 4, 4, fuse)))
        n = sum(ops.values())
        top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])
        key = f"w8a8 BM=8 BN=64 BK=128 swap=True{' fused quant' if fuse else ''}"
        rows[key] = {"loop_instructions": n, "per_weight": n / (64 * 128 / 128), "top": top}
        print(f"{key}: {n:5d} instructions a K step, {n / 64:.2f} a weight, {top}", flush=True)
    builds = {}  # the other new kernels: does each build for sm_90, and does it use fp8 wgmma (QGMMA)?
    for key, fn in (
        ("w4a8 down BM=8 BN=64 BK=256 swap", lambda: compile_down_a8(8, 64, 256, 4, 4, True)),
        ("w4a8 up BM=64 BN=128 BK=128", lambda: compile_up_a8(64, 128, 128, 8, 3, False)),
        ("w8a8 experts (FP8) up BM=8 BN=128 BK=256", lambda: compile_up_a8(8, 128, 256, 4, 4, True, fmt=1)),
        (
            "grouped up with act_quant_h (W4A8 prefill on bf16 tiles)",
            lambda: compile_up("scaled", 128, 128, 128, 8, 3, True),
        ),
        ("w8a8 wq_a M<=8 split swap", lambda: compile_w8a8((1280, 5120), 8, 64, 128, 4, 10, True, 4, 4)),
        ("w8a8 wo_b M=64 no split", lambda: compile_w8a8((5120, 8192), 64, 64, 128, 64, 1, False, 4, 4)),
    ):
        lines = sass_lines(fn())
        builds[key] = {op: sum(op in ln for ln in lines) for op in ("QGMMA", "HGMMA", "HMMA")}
        print(f"{key}: builds, {builds[key]}", flush=True)
    res = {
        "meta": run_meta(target="sm_90 (offline)", device_note="SASS compiled offline, no GPU ran"),
        "rows": rows,
        "builds": builds,
    }
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "kernel_sass.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: round(v["per_weight"], 2) for k, v in rows.items()}))


if __name__ == "__main__":
    main()
