"""A checkpoint started on a GPU as a user starts it: the forms chosen by default, the KV cache sized by
--gpu-memory-utilization, and a release-format checkpoint loaded from its files (issues 53, 62; checked on the
H200 by issue 59).

Each case runs in its own subprocess (a fresh CUDA context, so the memory it reads is its own):

- `utilization`: the built-in checkpoint with no form flags at u = 0.5 and 0.9: the forms the engine chose (a
  checkpoint runs as stored: FP8 dense, MXFP4 experts), the KV blocks it sized, the device memory in use after
  start-up and after a batch of greedy requests (torch.cuda.mem_get_info: every allocation of the process, the
  CUDA context included), against u x total. vLLM's rule, which the engine follows: the process stays within
  u x total.
- `release`: a release-format checkpoint of random bytes (`checkpoint.write_random_release`, the tiny layers with a
  1.2 M vocabulary and 32 MXFP4 experts of width 2048, ~2.1 GB on disk) started on the GPU: load time, the peak
  device memory during the load against the bytes the model holds (no dense copy of a quantised tensor on the
  way), and a few greedy tokens that are finite.

    python benchmarks/gpu_start_h200.py --out benchmarks/results/gpu-start-h200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_UTIL = r"""
import json, sys, time, torch
from dsserve import LLM, SamplingParams
u = float(sys.argv[1])
free0, total = torch.cuda.mem_get_info()
t = time.perf_counter()
llm = LLM("tiny-trained", device="cuda", gpu_memory_utilization=u, max_num_seqs=32)
start_s = time.perf_counter() - t
a = llm.engine.args
free1, _ = torch.cuda.mem_get_info()
prompts = [{"prompt_token_ids": [5 + (7 * i + j) % 200 for j in range(40 + i)]} for i in range(32)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
torch.cuda.synchronize()
free2, _ = torch.cuda.mem_get_info()
print(json.dumps({
    "utilization": u, "total_bytes": total, "used_before_bytes": total - free0,
    "used_after_start_bytes": total - free1, "used_after_requests_bytes": total - free2,
    "budget_bytes": int(u * total), "max_reserved_bytes": torch.cuda.max_memory_reserved(),
    "kv_blocks": llm.engine.kv.blocks.num_blocks, "block_size": a.block_size,
    "forms": {"quantization": a.quantization, "expert_format": a.expert_format, "engram_tables": a.engram_tables,
              "dtype": str(a.dtype)},
    "start_s": start_s, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
    "first_tokens": list(outs[0].outputs[0].token_ids[:12]),
}))
"""

_RELEASE = r"""
import json, math, sys, time, torch
from dsserve import LLM, SamplingParams
path = sys.argv[1]
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
t = time.perf_counter()
llm = LLM(path, tokenizer=sys.argv[2], device="cuda", gpu_memory_utilization=0.5, max_num_seqs=4, warmup=False,
          enforce_eager=True)
load_s = time.perf_counter() - t
model_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters() if p.is_cuda)
model_bytes += sum(b.numel() * b.element_size() for b in llm.engine.model.buffers() if b.is_cuda)
peak = torch.cuda.max_memory_allocated() - base
a = llm.engine.args
greedy = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
outs = llm.generate([{"prompt_token_ids": list(range(3, 35))}], greedy, use_tqdm=False)
print(json.dumps({
    "load_s": load_s, "peak_allocated_bytes": peak, "model_device_bytes": model_bytes,
    "forms": {"quantization": a.quantization, "expert_format": a.expert_format, "engram_tables": a.engram_tables},
    "tokens": list(outs[0].outputs[0].token_ids),
}))
"""


def child(code: str, *argv: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"error": r.stderr[-3000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="utilization,release")
    a = ap.parse_args()
    from dsserve.bench.provenance import run_meta

    res = {"meta": run_meta(), "utilization": [], "release": None}
    cases = a.cases.split(",")
    if "utilization" in cases:
        for u in (0.05, 0.08, 0.9):  # small shares: below the 2 M-block cap, so the share sizes the cache
            r = child(_UTIL, str(u))
            if "error" not in r:
                r["within_budget"] = r["used_after_requests_bytes"] <= r["budget_bytes"]
            res["utilization"].append(r)
            print(json.dumps(r)[:600], flush=True)
    if "release" in cases:
        from dsserve.models.checkpoint import write_random_release
        from dsserve.models.presets import preset

        cfg = preset("tiny").with_options(
            vocab_size=1_200_000,
            n_routed_experts=32,
            moe_intermediate_size=2048,
            engram_vocab_size=700_000,
            name="bench-2g",
        )
        tmp = tempfile.mkdtemp(prefix="dsserve-gpu-release-")
        written = write_random_release(cfg, tmp, max_shard_bytes=512 << 20)
        from dsserve.models.presets import model_dir

        r = child(_RELEASE, tmp, model_dir("tiny-trained"))  # random weights: any tokenizer; ids in, ids out
        r["checkpoint_bytes"] = written
        if "error" not in r:
            r["peak_over_model"] = r["peak_allocated_bytes"] / r["model_device_bytes"]
        res["release"] = r
        print(json.dumps(r)[:800], flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_start.json"), "w") as f:
        json.dump(res, f, indent=1)
    gib = 2**30
    for r in res["utilization"]:
        if "error" in r:
            print("utilization: error", r["error"][-400:])
            continue
        print(
            f"u={r['utilization']}: budget {r['budget_bytes'] / gib:.2f} GiB, used after start "
            f"{r['used_after_start_bytes'] / gib:.2f}, after requests {r['used_after_requests_bytes'] / gib:.2f} GiB, "
            f"{r['kv_blocks']} KV blocks, forms {r['forms']}"
        )
    r = res["release"]
    if r:
        print(
            "release:",
            "error " + r["error"][-400:]
            if "error" in r
            else f"load {r['load_s']:.1f} s, peak {r['peak_allocated_bytes'] / gib:.2f} GiB vs model "
            f"{r['model_device_bytes'] / gib:.2f} GiB, forms {r['forms']}",
        )
    print(
        json.dumps(
            {
                "utilization_ok": all(r.get("within_budget") for r in res["utilization"]),
                "release_ok": bool(r) and "error" not in r,
            }
        )
    )


if __name__ == "__main__":
    main()
