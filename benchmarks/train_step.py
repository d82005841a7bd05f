"""The training step eager against captured as a CUDA graph (train.step.TrainStep), on one GPU.

    python benchmarks/train_step.py --seqs 8,2 --length 2048 --out train_step.json

For each number of sequences and each mode (dense entries: the warm-up; sparse: the indexers' top-k), runs two eager
steps, then the capture and replays, synchronising around each; reports the eager and the replayed step time, the
optimizer's, and the peak memory. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dsserve.bench.provenance import run_meta  # noqa: E402


def main() -> int:
    from dsserve.kernels.sinkhorn import sinkhorn_trainable
    from dsserve.models.checkpoint import dummy_weights
    from dsserve.models.loader import resolve_config
    from dsserve.models.model import DeepseekForCausalLM
    from dsserve.models.tokenizer import Tokenizer
    from dsserve.train.step import TrainStep
    from dsserve.train.train import TrainConfig, batch_of, token_weights

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="8,2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--replays", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cuda; cpu only checks the script (no graphs there)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    seqs = [int(s) for s in a.seqs.split(",")]
    cfg = TrainConfig(
        batch=max(seqs), pack=a.length, mix=(("arithmetic", 0.4), ("retrieval", 0.4), ("chat", 0.2)), drills=8
    )
    mcfg, tok = resolve_config("tiny"), Tokenizer.for_preset("tiny")
    model = DeepseekForCausalLM(mcfg)
    dummy_weights(model, mcfg, seed=0)
    model = model.to(a.device).train()
    for block in model.layers:
        block.ffn.every_expert = True
        if a.device == "cuda":
            block.sinkhorn = sinkhorn_trainable
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=a.device == "cuda")
    batch = batch_of(cfg, 0, tok, 416)

    def timed(fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    rows = []
    for dense in (True, False):
        for n in seqs:
            if a.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            step = TrainStep(model, n, a.length, n, 0.1, dense, True, tok.eos_id, isolate_bos=tok.bos_id)
            w = token_weights(batch[:n], 0.5)
            step.load(batch[:n], w, sum(map(sum, w)))
            times = [timed(step.run) for _ in range(3 + a.replays)]  # 2 eager, the capture + a replay, replays
            opt_s = timed(lambda: (torch.nn.utils.clip_grad_norm_(params, 1.0), opt.step()))
            rows.append(
                {
                    "dense": dense,
                    "seqs": n,
                    "tokens": n * a.length,
                    "eager_s": min(times[:2]),
                    "replay_s": min(times[3:]),
                    "optimizer_s": opt_s,
                    "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" else None,
                    "captured": step.graph is not None,
                }
            )
            step.release()
            del step
            if a.device == "cuda":
                torch.cuda.empty_cache()
    print(f"{'mode':>6} {'seqs':>5} {'eager s':>8} {'replay s':>9} {'ratio':>6} {'tok/s replay':>13} {'opt s':>6}")
    for r in rows:
        print(
            f"{'dense' if r['dense'] else 'sparse':>6} {r['seqs']:5d} {r['eager_s']:8.3f} {r['replay_s']:9.3f} "
            f"{r['eager_s'] / r['replay_s']:6.2f} {r['tokens'] / r['replay_s']:13.0f} {r['optimizer_s']:6.3f}"
        )
    out = {
        "meta": run_meta(),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "length": a.length,
        "rows": rows,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
