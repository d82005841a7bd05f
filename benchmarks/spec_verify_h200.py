"""DSpark speculative decoding's step costs on one H200 (issue 56): the verify step against a plain decode step at
B = 1..32, the draft proposal and the rejection sampler, and the output tokens/s each mean acceptance length would
give.

    python benchmarks/spec_verify_h200.py --out $OUT/spec-verify-h200          # the H200, < 4 minutes
    python benchmarks/spec_verify_h200.py --smoke --out /tmp/spec-verify-smoke  # CPU, tiny shapes, < 2 minutes

On `proxy-h200-release` with dummy weights (dense FP8, routed experts MXFP4, every op through Triton: the engine's
release forms, as benchmarks/model_h200.py builds them), each request with `--context` tokens of synthetic cache
(dsserve.bench.forward), at B in {1, 2, 4, 8, 16, 32}:
- decode: the engine's plain decode step (one row a request) through its decode graphs (CUDA graphs), and eager;
- verify: the step that verifies K drafts a request (1 + K rows a request, the engine's runner; eager: the verify
  step has no fixed-shape runner yet), then its rollback (SequenceKV.save_rows / rollback);
- rejection: the rejection sampler on the verify step's [B (1 + K), V] logits (greedy rows);
- propose: the DSpark stages drafting the next block for each request (Drafter.propose, one request at a time);
- per mean acceptance length L in 1..K + 1 (tokens a verified block gives): output tokens/s = B L / (verify +
  rejection + propose), against B / decode (graphs); `breakeven_L` is the L where drafting starts to pay.
Timings are medians of `--repeats` runs after a warm-up run, synchronised on the device. Prints a line per case,
then the JSON path (spec_verify.json with run_meta provenance and the copy / matmul ceilings of this run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import dsserve.bench.forward as fwd  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.drafter import Drafter  # noqa: E402
from dsserve.engine.request import Request  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.engine.scheduler import ScheduledChunk, StepPlan  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up call, synchronised."""
    fn()
    ts = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def requests(core, b: int, context: int, rows: int, gen: torch.Generator) -> list[Request]:
    cfg = core.cfg
    out = []
    for i in range(b):
        ids = torch.randint(3, cfg.vocab_size - 2, (context + 1,), generator=gen).tolist()
        r = Request(f"spec-{i}", ids[:-1], SamplingParams(temperature=0, max_tokens=64))
        r.output_token_ids.append(ids[-1])
        r.kv = core.kv.new_sequence()
        fwd._fill(core, r, context, rows, gen)
        out.append(r)
    return out


def ingest_noise(core, drafter: Drafter, r: Request, gen: torch.Generator) -> None:
    """A full DSpark ring for ``r`` (synthetic taps of its last window positions), so proposing reads a real window."""
    cfg = core.cfg
    w = cfg.sliding_window
    p = r.num_tokens - 2
    taps = {
        layer: torch.randn(w, cfg.hidden_size, generator=gen).to(core.device, core.model.embed.weight.dtype)
        for layer in cfg.dspark_target_layer_ids
    }
    r.draft_state = drafter.mtp.new_state()
    drafter.mtp.ingest(taps, torch.arange(p - w + 1, p + 1), r.draft_state)


def case(core, drafter: Drafter, b: int, context: int, k: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(b)
    decode_graph = fwd.bench_forward(core, b, context, 1, repeats).seconds
    graphs = core.runner.decode_graphs
    core.runner.decode_graphs = None
    try:
        decode_eager = fwd.bench_forward(core, b, context, 1, repeats).seconds
    finally:
        core.runner.decode_graphs = graphs
    reqs = requests(core, b, context, 1 + k, gen)
    drafts = [torch.randint(3, core.cfg.vocab_size - 2, (k,), generator=gen).tolist() for _ in reqs]
    plan = StepPlan([ScheduledChunk(r, 1 + k, d) for r, d in zip(reqs, drafts)], [])
    if context % core.kv.rollback_multiple:
        raise SystemExit(f"--context must be a multiple of {core.kv.rollback_multiple}")
    holder = {}

    def verify():
        drafter.before(plan)
        holder["out"] = core.runner.execute(plan)
        for r in reqs:
            r.kv.rollback(context, r.all_token_ids)  # every row back out: the next repeat starts where this did
            core.kv.grow(r.kv, context + 1 + k)

    t_verify = timed(verify, repeats)
    sampling, logits = holder["out"]
    t_reject = timed(lambda: core.rejection_sampler(logits.float(), sampling, drafts), repeats)
    for r in reqs:
        ingest_noise(core, drafter, r, gen)
    t_propose = timed(lambda: drafter.propose(reqs), repeats)
    for r in reqs:
        core.kv.release(r.kv)
    spec_step = t_verify + t_reject + t_propose
    by_len = {str(L): b * L / spec_step for L in range(1, k + 2)}
    plain = b / decode_graph
    breakeven = next((L for L in range(1, k + 2) if b * L / spec_step >= plain), None)
    row = {
        "B": b,
        "ctx": context,
        "k": k,
        "decode_graph_ms": decode_graph * 1e3,
        "decode_eager_ms": decode_eager * 1e3,
        "verify_eager_ms": t_verify * 1e3,
        "verify_over_decode_graph": t_verify / decode_graph,
        "verify_over_decode_eager": t_verify / decode_eager,
        "rejection_ms": t_reject * 1e3,
        "propose_ms": t_propose * 1e3,
        "decode_tok_per_s": plain,
        "spec_tok_per_s_by_mean_acceptance_length": by_len,
        "breakeven_L": breakeven,
    }
    print(
        f"B={b} ctx={context} K={k}: decode {decode_graph * 1e3:.2f} ms (eager {decode_eager * 1e3:.2f}), verify "
        f"{t_verify * 1e3:.2f}, rejection {t_reject * 1e3:.2f}, propose {t_propose * 1e3:.2f} ms; breakeven L "
        f"{breakeven}",
        flush=True,
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, < 2 minutes")
    p.add_argument("--out", default="benchmarks/results/spec-verify-h200")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    from model_h200 import build_core, ceilings, free_core

    if a.smoke:
        a.context, a.batches, a.repeats, a.k = 64, "1,2", 2, min(a.k, 3)
    batches = [int(x) for x in a.batches.split(",")]
    t0 = time.time()
    ceil = ceilings()
    model = "tiny" if a.smoke else "proxy-h200-release"
    core, info = build_core(model, (max(batches), a.context + a.k + 2), release=not a.smoke, smoke=a.smoke)
    drafter = Drafter(core.model, a.k, core.stats)
    res = {"meta": run_meta(ceilings=ceil, smoke=a.smoke), "ceilings": ceil, "model": info, "rows": []}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "spec_verify.json")
    try:
        with torch.no_grad():
            for b in batches:
                res["rows"].append(case(core, drafter, b, a.context, a.k, a.repeats))
                res["seconds"] = time.time() - t0
                with open(path, "w") as f:
                    json.dump(res, f, indent=1)
    finally:
        free_core(core)
    print(path)


if __name__ == "__main__":
    main()
