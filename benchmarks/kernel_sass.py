"""Instructions a weight element costs in the routed-expert up kernel, read from its sm_90 SASS (issue 8).

Compiles grouped_moe's up kernel offline for the H200 (Triton's bundled ptxas and nvdisasm; no GPU needed) for each
MXFP4 decode (tl.dot_scaled, the PTX decode, the kernel's own fp32 decode) on a decode tile, finds the K loop (the
backward branch) and counts its SASS by opcode. One K step decodes 2 x BN x BK weights (W1 and W3) over
num_warps x 32 threads, so instructions per element = loop instructions / (2 BN BK / threads): the issue budget
per weight an SM spends, which bounds bandwidth when the SMs are issue-bound.

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
from dsserve.kernels import grouped_moe as G  # noqa: E402

D, INTER = 5120, 2304
POINTERS = ("x_ptr", "tiles_ptr", "order_ptr", "rw_ptr", "w1_ptr", "s1_ptr", "w3_ptr", "s3_ptr", "h_ptr")


def compile_up(decode: str, bm: int, bn: int, bk: int, warps: int, stages: int):
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
    }
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    # what the launcher specialises at run time: 16-byte aligned pointers, the row stride a multiple of 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in POINTERS + ("sxm",)}
    src = ASTSource(fn=G._up_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


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
    res = {
        "meta": run_meta(target="sm_90 (offline)", device_note="SASS compiled offline, no GPU ran"),
        "rows": rows,
    }
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "kernel_sass.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: round(v["per_weight"], 2) for k, v in rows.items()}))


if __name__ == "__main__":
    main()
