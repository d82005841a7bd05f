"""Train a small V4.1-architecture model from scratch on the synthetic tasks (issue 10).

    python -m dsserve.train.train --model tiny --steps 3000 --batch 16 --device cuda --out runs/tiny-trained

Every mechanism of the model runs as at inference (the reference forward, fp32): the sliding window, the
compressors and indexers, the MoE, mHC, Engram. The QAT fake quants pass gradients straight through
(``quant._straight_through``); the indexers, whose top-k selection has no gradient, learn from the KL divergence to
the main attention's distribution over the entries they score (``CSA2Attention._index_kl``; their inputs are
detached, as DeepSeek trained its sparse attention's indexer). The loss is next-token cross entropy on each
problem's completion (the prompt is context) plus ``kl_weight`` x the mean indexer KL. Seeded; writes the
checkpoint (config.json, safetensors, the tokenizer), train.json (data, steps, tokens, the loss curve) and
loss.png under ``--out``. The MoE's selection biases stay at zero (no load-balancing update yet).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

from .tasks import TASKS, problem, prompt_ids, retrieval_distance


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny"
    steps: int = 3000
    batch: int = 16          # problems a step
    lr: float = 2e-3
    warmup: int = 100
    kl_weight: float = 0.1
    seed: int = 0
    mix: tuple = (("arithmetic", 0.4), ("retrieval", 0.3), ("chat", 0.3))
    min_back: int = 0        # retrieval distance in tokens (0: tasks.retrieval_distance)
    device: str = "cpu"
    log_every: int = 10


def batch_of(cfg: TrainConfig, step: int, tokenizer, min_back: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the first completion token) of step's problems: train split, tasks drawn by the mix."""
    rng = random.Random(f"batch/{cfg.seed}/{step}")
    tasks, weights = zip(*cfg.mix)
    count = (lambda s: len(tokenizer.encode(s, add_bos=False)))
    out = []
    for j in range(cfg.batch):
        task = rng.choices(tasks, weights)[0]
        p = problem(task, "train", cfg.seed * 10_000_000 + step * cfg.batch + j, count, min_back)
        ids = prompt_ids(tokenizer, p.prompt)
        full = ids + tokenizer.encode(p.completion, add_bos=False) + [tokenizer.eos_id]
        out.append((full, len(ids)))
    return out


def step_loss(model, batch: list[tuple[list[int], int]], kl_weight: float, device) -> tuple[torch.Tensor, dict]:
    """One forward of the batch's sequences together (each on its own empty cache)."""
    from ..layers.context import SeqRows
    seqs, tokens, at = [], [], 0
    for ids, _ in batch:
        seqs.append(SeqRows(slice(at, at + len(ids)), model.new_cache()))
        tokens += ids
        at += len(ids)
    kl = []
    hidden = model.forward_batch(torch.tensor(tokens, device=device), seqs, index_kl=kl).hidden
    logits = model.logits(hidden).float()
    targets, rows, at = [], [], 0
    for ids, start in batch:  # row t predicts token t + 1: the completion's tokens
        rows += range(at + start - 1, at + len(ids) - 1)
        targets += ids[start:]
        at += len(ids)
    ce = torch.nn.functional.cross_entropy(logits[torch.tensor(rows, device=device)],
                                           torch.tensor(targets, device=device))
    index_kl = torch.stack(kl).mean() if kl else ce.new_zeros(())
    return ce + kl_weight * index_kl, {"ce": float(ce.detach()), "index_kl": float(index_kl.detach()), "tokens": len(tokens),
                                       "target_tokens": len(targets)}


def train(cfg: TrainConfig, out_dir: str | None) -> dict:
    from ..models.checkpoint import dummy_weights, save_checkpoint
    from ..models.loader import resolve_config
    from ..models.model import DeepseekForCausalLM
    from ..models.tokenizer import TINY_DIR, Tokenizer

    if cfg.model not in ("tiny", "tiny-v4"):
        raise ValueError(f"training runs on the tiny shapes (tiny, tiny-v4), not {cfg.model!r}")
    if cfg.steps < 1 or cfg.batch < 1 or cfg.warmup < 1:
        raise ValueError(f"steps, batch and warmup must be >= 1, got {cfg.steps}, {cfg.batch}, {cfg.warmup}")
    torch.manual_seed(cfg.seed)
    mcfg = resolve_config(cfg.model)
    tokenizer = Tokenizer.for_preset(cfg.model)
    model = DeepseekForCausalLM(mcfg)
    dummy_weights(model, mcfg, seed=cfg.seed)  # a seeded start; the selection biases then at zero (see above)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.bias", "gate.bias_vl")):
                p.zero_()
    model = model.to(cfg.device).train()
    params = [p for n, p in model.named_parameters() if not n.endswith(("gate.bias", "gate.bias_vl"))]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    min_back = cfg.min_back or retrieval_distance(mcfg)
    curve, tokens, t0 = [], 0, time.perf_counter()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, info = step_loss(model, batch_of(cfg, step, tokenizer, min_back), cfg.kl_weight, cfg.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += info["tokens"]
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            curve.append({"step": step, "lr": lr, "loss": float(loss.detach()), **info})
            print(f"step {step:5d}  loss {curve[-1]['loss']:.4f}  ce {info['ce']:.4f}  index kl {info['index_kl']:.4f}  "
                  f"{tokens / (time.perf_counter() - t0):.0f} tok/s", flush=True)
    summary = {"config": asdict(cfg), "model": mcfg.name, "min_back": min_back, "tokens": tokens,
               "seconds": time.perf_counter() - t0, "curve": curve,
               "data": {"tasks": list(TASKS), "split": "train (prompt hash), problems seeded by step and slot"}}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        model.eval()
        save_checkpoint(model.cpu(), mcfg, out_dir, tokenizer_dir=TINY_DIR)
        with open(os.path.join(out_dir, "train.json"), "w") as f:
            json.dump(summary, f, indent=1)
        _plot(curve, os.path.join(out_dir, "loss.png"))
    return summary


def _plot(curve: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [c["step"] for c in curve]
    ax.plot(steps, [c["ce"] for c in curve], label="completion cross entropy")
    ax.plot(steps, [c["index_kl"] for c in curve], label="indexer KL")
    ax.set(xlabel="step", ylabel="nats", yscale="log", title="training on the synthetic tasks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = TrainConfig()
    for name in ("model", "device"):
        p.add_argument(f"--{name}", default=getattr(d, name))
    for name in ("steps", "batch", "warmup", "seed", "min_back", "log_every"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "kl_weight"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(a).items() if k != "out"})
    try:
        summary = train(cfg, a.out)
    except ValueError as e:  # a bad option: say which, no traceback
        print(f"dsserve.train: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"} | {"last": summary["curve"][-1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
