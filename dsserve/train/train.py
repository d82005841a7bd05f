"""Train a small V4.1-architecture model from scratch on the synthetic tasks (issue 10).

    torchrun --nproc-per-node 4 -m dsserve.train.train --device cuda --steps 400 --batch 32 --pack 2048 \
        --warmup 20 --dense-steps 200 --drills 4 --out runs/tiny-trained

Every mechanism of the model runs as at inference (the reference forward, fp32): the sliding window, the
compressors and indexers, the MoE, mHC, Engram. The QAT fake quants pass gradients straight through
(``quant._straight_through``); the indexers, whose top-k selection has no gradient, learn from the KL divergence to
the main attention's distribution over the entries they score (``CSA2Attention._index_kl``; their inputs are
detached, as DeepSeek trained its sparse attention's indexer). For the first ``dense_steps`` every compressed layer
attends all its visible entries (DeepSeek's dense warm-up): the main attention learns which entries matter while
the indexers learn to find them, then sparse selection takes over. The loss is next-token cross entropy on each
problem's completion, plus ``prompt_weight`` x that of the prompt's tokens (the worked example, the chat's turns,
retrieval's answered drills; a retrieval prompt's random codes only add noise), plus ``kl_weight`` x the mean
indexer KL. Problems are packed into sequences of up to ``pack`` tokens, as pretraining packs documents (the
reference forward's cost is mostly per sequence and per layer, not per token). On a GPU the step is bound by launching
its ops, so there mHC's Sinkhorn runs as one kernel each way (``--fused-sinkhorn``) and the MoE computes every expert
on every row (``--every-expert``): the same sums, 2.1x fewer ops (23.5 K -> 11.2 K for four 512-token sequences,
counted on the CPU). Seeded; writes the checkpoint
(config.json, safetensors, the tokenizer), train.json (data, steps, tokens, the loss curve) and loss.png under
``--out``. The MoE's selection biases stay at zero (no load-balancing update yet); the DSpark drafter is not trained.

Data parallel under ``torchrun --nproc-per-node N``: rank r takes sequences r, r + N, ... of each step's batch, the
losses are normalised by the whole batch's counts and the gradients summed (gloo, staged through host memory: ranks
may share one GPU, which NCCL refuses; the tiny model is launch-bound, so several ranks on one GPU keep it busier
than one), so a step equals the single-process step on the whole batch.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from .ranks import Ranks
from .tasks import TASKS, problem, prompt_ids, retrieval_distance


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny"
    steps: int = 3000
    batch: int = 16          # sequences a step (problems, unless packed)
    lr: float = 2e-3
    warmup: int = 100
    kl_weight: float = 0.1
    prompt_weight: float = 0.25
    seed: int = 0
    mix: tuple = (("arithmetic", 0.4), ("retrieval", 0.3), ("chat", 0.3))
    min_back: int = 0        # retrieval distance in tokens (0: tasks.retrieval_distance)
    device: str = "cpu"
    log_every: int = 10
    pack: int = 0            # tokens a training sequence packs problems up to (0: one problem a sequence)
    dense_steps: int = 0     # the first steps attend every visible global entry (the dense warm-up)
    drills: int = 0          # retrieval: answered questions about random facts before the asked one
    fused_sinkhorn: bool = True  # on a GPU: mHC's Sinkhorn as one kernel each way (kernels.sinkhorn)
    every_expert: bool = True    # on a GPU: every routed expert on every row, weighted 0 where not chosen


def batch_of(cfg: TrainConfig, step: int, tokenizer, min_back: int) -> list[tuple[list[int], list[bool]]]:
    """Step's ``batch`` sequences as (token ids, which tokens are completion): train-split problems, tasks drawn by
    the mix; with ``pack`` > 0, each sequence holds problems one after another (each from its BOS) up to ``pack``
    tokens, as pretraining packs documents: the model's per-sequence work is paid once for several problems."""
    rng = random.Random(f"batch/{cfg.seed}/{step}")
    tasks, weights = zip(*cfg.mix)
    count = (lambda s: len(tokenizer.encode(s, add_bos=False)))
    out, ids, completion, j = [], [], [], 0
    while len(out) < cfg.batch:
        task = rng.choices(tasks, weights)[0]
        p = problem(task, "train", (cfg.seed * 1_000_000 + step) * 10_000 + j, count, min_back, cfg.drills)
        j += 1
        prompt, answer = prompt_ids(tokenizer, p.prompt), tokenizer.encode(p.completion, add_bos=False)
        full = prompt + answer + [tokenizer.eos_id]
        if ids and len(ids) + len(full) > cfg.pack:  # this sequence is full: the problem starts the next one
            out.append((ids, completion))
            ids, completion = [], []
        ids += full
        completion += [False] * len(prompt) + [True] * (len(answer) + 1)
        if not cfg.pack:
            out.append((ids, completion))
            ids, completion = [], []
    return out


def token_weights(batch: list[tuple[list[int], list[bool]]], prompt_weight: float) -> list[list[float]]:
    """Per sequence, the loss weight of each row's next-token prediction (row t predicts token t + 1): 1 for a
    completion's tokens, ``prompt_weight`` for a prompt's."""
    return [[1.0 if completion[t + 1] else prompt_weight for t in range(len(ids) - 1)] for ids, completion in batch]


def step_loss(model, batch: list[tuple[list[int], list[bool]]], cfg: TrainConfig, weight_total: float,
              count_total=lambda n: n, dense: bool = False) -> tuple[torch.Tensor, dict]:
    """One forward of ``batch``'s sequences together (each on its own empty cache): the weighted cross entropy over
    ``weight_total`` (the whole step's weight, all ranks) plus ``kl_weight`` x the indexer KLs' sum over
    ``count_total(local count)`` (their number on all ranks), so the ranks' losses add up to the whole batch's.
    ``dense``: every visible global entry attended (``ForwardContext.dense_entries``), not the indexers' choice."""
    from ..layers.context import SeqRows
    device = cfg.device
    seqs, tokens, at = [], [], 0
    for ids, _ in batch:
        seqs.append(SeqRows(slice(at, at + len(ids)), model.new_cache()))
        tokens += ids
        at += len(ids)
    kl = []
    hidden = model.forward_batch(torch.tensor(tokens, device=device), seqs, index_kl=kl, dense_entries=dense).hidden
    rows, targets, weights, completion, at = [], [], [], [], 0
    for (ids, done), w in zip(batch, token_weights(batch, cfg.prompt_weight)):
        kept = [t for t in range(len(ids) - 1) if w[t] > 0]  # weight 0: no logits needed
        rows += [at + t for t in kept]
        targets += [ids[t + 1] for t in kept]
        weights += [w[t] for t in kept]
        completion += [done[t + 1] for t in kept]
        at += len(ids)
    ce = torch.nn.functional.cross_entropy(model.logits(hidden[torch.tensor(rows, device=device)]).float(),
                                           torch.tensor(targets, device=device), reduction="none")
    w, completion = torch.tensor(weights, device=device), torch.tensor(completion, device=device)
    kl_count = count_total(len(kl))
    kl_sum = torch.stack(kl).sum() if kl else ce.new_zeros(())
    loss = (ce * w).sum() / weight_total + cfg.kl_weight * kl_sum / max(kl_count, 1)
    return loss, {"ce_sum": float(ce.detach()[completion].sum()), "targets": int(completion.sum()),
                  "kl_sum": float(kl_sum.detach()), "kl_count": len(kl), "tokens": len(tokens)}


def backward_step(model, params, cfg: TrainConfig, step: int, tokenizer, min_back: int, ranks: Ranks) -> dict:
    """This rank's share of step ``step``: forward, backward, the gradients summed over the ranks."""
    whole = batch_of(cfg, step, tokenizer, min_back)
    weight_total = sum(map(sum, token_weights(whole, cfg.prompt_weight)))
    loss, info = step_loss(model, whole[ranks.rank::ranks.world], cfg, weight_total,
                           lambda n: int(ranks.sum([float(n)])[0]), dense=step < cfg.dense_steps)
    loss.backward()
    ranks.sum_grads(params)
    return info | {"step_tokens": sum(len(ids) for ids, _ in whole)}


def train(cfg: TrainConfig, out_dir: str | None) -> dict:
    from ..models.checkpoint import dummy_weights, save_checkpoint
    from ..models.loader import resolve_config
    from ..models.model import DeepseekForCausalLM
    from ..models.tokenizer import TINY_DIR, Tokenizer

    parse_mix(",".join(f"{t}={w}" for t, w in cfg.mix))  # names and shares checked
    if cfg.model not in ("tiny", "tiny-v4"):
        raise ValueError(f"training runs on the tiny shapes (tiny, tiny-v4), not {cfg.model!r}")
    if cfg.steps < 1 or cfg.batch < 1 or cfg.warmup < 1:
        raise ValueError(f"steps, batch and warmup must be >= 1, got {cfg.steps}, {cfg.batch}, {cfg.warmup}")
    negative = {k: getattr(cfg, k) for k in ("min_back", "dense_steps", "drills", "prompt_weight", "kl_weight")
                if getattr(cfg, k) < 0}
    if negative or not cfg.lr > 0:
        raise ValueError(f"lr must be > 0 and min_back, dense_steps, drills, prompt_weight, kl_weight >= 0; got lr "
                         f"{cfg.lr}" + "".join(f", {k} {v}" for k, v in negative.items()))
    ranks = Ranks()
    if cfg.batch < ranks.world:
        raise ValueError(f"batch {cfg.batch} gives some of the {ranks.world} ranks no sequence; use >= {ranks.world}")
    cfg = replace(cfg, device=ranks.device(cfg.device))
    torch.manual_seed(cfg.seed)
    mcfg = resolve_config(cfg.model)
    if not 0 <= cfg.pack <= mcfg.max_position_embeddings:
        raise ValueError(f"pack must be 0 (no packing) or up to the model's {mcfg.max_position_embeddings} positions, "
                         f"got {cfg.pack}")
    tokenizer = Tokenizer.for_preset(cfg.model)
    model = DeepseekForCausalLM(mcfg)
    dummy_weights(model, mcfg, seed=cfg.seed)  # a seeded start; the selection biases then at zero (see above)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.bias", "gate.bias_vl")):
                p.zero_()
    model = model.to(cfg.device).train()
    if cfg.device.startswith("cuda"):  # fewer launches: a tiny model's step is bound by them (see the flags)
        from ..kernels.sinkhorn import sinkhorn_trainable
        for block in model.layers:
            if cfg.fused_sinkhorn:
                block.sinkhorn = sinkhorn_trainable
            block.ffn.every_expert = cfg.every_expert
    params = [p for n, p in model.named_parameters() if not n.endswith(("gate.bias", "gate.bias_vl"))]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    min_back = cfg.min_back or retrieval_distance(mcfg)
    curve, tokens, t0 = [], 0, time.perf_counter()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        info = backward_step(model, params, cfg, step, tokenizer, min_back, ranks)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += info["step_tokens"]
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            ce_sum, targets, kl_sum, kl_count, n = ranks.sum([info["ce_sum"], info["targets"], info["kl_sum"],
                                                               info["kl_count"], info["tokens"]])
            curve.append({"step": step, "lr": lr, "ce": ce_sum / targets, "index_kl": kl_sum / max(kl_count, 1),
                          "tokens": int(n), "target_tokens": int(targets)})
            if ranks.rank == 0:
                elapsed = time.perf_counter() - t0
                print(f"step {step:5d}  ce {curve[-1]['ce']:.4f}  index kl {curve[-1]['index_kl']:.4f}  "
                      f"{tokens / elapsed:.0f} tok/s  {elapsed:.1f} s", flush=True)
    summary = {"config": asdict(cfg), "ranks": ranks.world, "model": mcfg.name, "min_back": min_back, "tokens": tokens,
               "seconds": time.perf_counter() - t0, "curve": curve,
               "data": {"tasks": list(TASKS), "split": "train (prompt hash), problems seeded by step and slot"}}
    if out_dir and ranks.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model.eval()
        save_checkpoint(model.cpu(), mcfg, out_dir, tokenizer_dir=TINY_DIR)
        with open(os.path.join(out_dir, "train.json"), "w") as f:
            json.dump(summary, f, indent=1)
        _plot(curve, os.path.join(out_dir, "loss.png"), cfg.dense_steps)
    return summary


def parse_mix(text: str) -> tuple:
    """``task=share,...`` -> ((task, share), ...), every task known and every share > 0."""
    mix = []
    for part in filter(None, text.split(",")):
        task, _, share = part.partition("=")
        try:
            w = float(share)
        except ValueError:
            w = -1.0
        if task not in TASKS or w <= 0:
            raise ValueError(f"mix entry {part!r}: want task=share with a task of {list(TASKS)} and a share > 0")
        mix.append((task, w))
    if not mix:
        raise ValueError(f"mix is empty; give task=share entries of {list(TASKS)}")
    return tuple(mix)


def _plot(curve: list[dict], path: str, dense_steps: int = 0) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [c["step"] for c in curve]
    ax.plot(steps, [c["ce"] for c in curve], label="completion cross entropy")
    ax.plot(steps, [c["index_kl"] for c in curve], label="indexer KL")
    if dense_steps:
        ax.axvline(dense_steps, color="grey", linestyle=":", label="dense entries -> indexers' top-k")
    ax.set(xlabel="step", ylabel="nats", yscale="log", title="training on the synthetic tasks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = TrainConfig()
    for name in ("model", "device"):
        p.add_argument(f"--{name}", default=getattr(d, name))
    for name in ("steps", "batch", "warmup", "seed", "min_back", "log_every", "pack", "dense_steps",
                 "drills"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "kl_weight", "prompt_weight"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--fused-sinkhorn", action=argparse.BooleanOptionalAction, default=d.fused_sinkhorn,
                   help="on a GPU, mHC's Sinkhorn as one Triton kernel each way (default on)")
    p.add_argument("--every-expert", action=argparse.BooleanOptionalAction, default=d.every_expert,
                   help="on a GPU, every routed expert on every row, weighted 0 where not chosen (default on)")
    p.add_argument("--mix", default=",".join(f"{t}={w}" for t, w in d.mix),
                   help="tasks and their shares of the draws, e.g. retrieval=1 (default %(default)s)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        cfg = TrainConfig(**{k: v for k, v in vars(a).items() if k not in ("out", "mix")}, mix=parse_mix(a.mix))
        summary = train(cfg, a.out)
    except ValueError as e:  # a bad option: say which, no traceback
        print(f"dsserve.train: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({k: v for k, v in summary.items() if k != "curve"} | {"last": summary["curve"][-1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
