"""TP2 on two GPUs (NCCL), for a machine with at least 2: the engine's tensor-parallel path against the one-GPU
engine on the same requests, eager and with CUDA graphs, and `bench forward`'s decode step at TP1 and TP2.

    python benchmarks/tp_engine_gpu.py --out $OUT      # about 2-3 minutes on 2 x H200 (tiny preset)

Writes $OUT/tp_engine_gpu.json: per mode the greedy-token agreement over 16 requests (bf16: a near tie may flip a
token, so it is reported, not asserted), the largest logit difference, and the ms per decode step. Fails loudly
(non-zero exit, the traceback) if the TP2 engine does not run at all.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dsserve.bench.forward import bench_forward
from dsserve.engine.llm import LLM
from dsserve.engine.sampling_params import SamplingParams


def run(opts: dict, tp: int, prompts: list[list[int]]) -> dict:
    llm = LLM(tensor_parallel_size=tp, **opts)
    logits, execute = {}, llm.engine.executor.execute

    def recorded(plan):
        sampling, rows = execute(plan)
        for r, row in zip(sampling, rows):
            logits.setdefault(r.request_id, []).append(row.float().cpu())
        return sampling, rows

    llm.engine.executor.execute = recorded
    try:
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=16))
        tokens = {}
        while llm.engine.has_unfinished_requests():
            for o in llm.engine.step():
                if o.finished:
                    tokens[o.request_id] = o.outputs[0].token_ids
        seconds = time.perf_counter() - t
        del llm.engine.executor.execute
        step = bench_forward(llm.engine, 8, 512, 1, 5)
        return {"tokens": tokens, "logits": logits, "seconds": seconds, "ms_per_decode_step": step.seconds * 1e3}
    finally:
        llm.engine.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--model", default="tiny")
    ns = p.parse_args()
    assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
    os.makedirs(ns.out, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8000, (20 + 37 * i,), generator=g).tolist() for i in range(16)]
    report = {}
    for eager in (True, False):
        opts = dict(model=ns.model, device="cuda", enforce_eager=eager, max_num_seqs=16, kv_cache_memory_bytes=1 << 30)
        one, two = run(opts, 1, prompts), run(opts, 2, prompts)
        same = sum(one["tokens"][k] == two["tokens"][k] for k in one["tokens"])
        diff = max(
            (torch.stack(one["logits"][k][:n]) - torch.stack(two["logits"][k][:n])).abs().max().item()
            for k in one["logits"]
            for n in [min(len(one["logits"][k]), len(two["logits"][k]))]
        )
        report["eager" if eager else "graphs"] = {
            "requests_with_equal_tokens": f"{same}/16",
            "max_logit_diff": diff,
            "tp1_ms_per_decode_step": one["ms_per_decode_step"],
            "tp2_ms_per_decode_step": two["ms_per_decode_step"],
            "tp1_run_s": one["seconds"],
            "tp2_run_s": two["seconds"],
        }
        print(json.dumps(report), flush=True)
        with open(os.path.join(ns.out, "tp_engine_gpu.json"), "w") as f:  # after each mode: eager first
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
