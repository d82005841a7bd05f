"""Train a small V4.1-architecture model from scratch on the synthetic tasks (issue 10).

    python -m dsserve.train.train --device cuda --steps 1000000 --time-limit 274 --batch 4 --pack 2048 \
        --mix arithmetic=0.4,retrieval=0.4,chat=0.2 --dense-share 0.5 --warmup 20 --drills 8 --prompt-weight 0.5 \
        --out runs/tiny-trained

Every mechanism of the model runs as at inference (the reference forward, fp32): the sliding window, the compressors and
indexers, the MoE, mHC, Engram; ``--warm-in-start/--warm-in-end`` (shares of the run) bring mHC and the MoE in gradually
(``train.warm_in``: with them on from the start the tiny model formed no in-context lookup), and the run ends with the
whole model. ``--min-back-low`` draws each training retrieval problem's distance from [low, the retrieval distance]
instead of always the distance, so facts in the window and far past it come mixed (on multi-query recall the tiny model
formed no lookup 64 rows back alone, and began to with near and far mixed:
``benchmarks/results/train-tiny-far-lookup``); the held-out problems stay at the distance. The QAT fake quants pass
gradients straight through (``quant._straight_through``); the indexers, whose top-k selection has no gradient, learn
from the KL divergence to the main attention's distribution over the entries they score (``CSA2Attention._index_kl``;
their inputs are detached, as DeepSeek trained its sparse attention's indexer). For the first ``dense_steps`` every
compressed layer attends all its visible entries (DeepSeek's dense warm-up): the main attention learns which entries
matter while the indexers learn to find them, then sparse selection takes over. The loss is next-token cross entropy on
each problem's completion, plus ``prompt_weight`` x that of the prompt's tokens (the worked example, the chat's turns,
retrieval's answered drills; a retrieval prompt's random codes only add noise), plus ``kl_weight`` x the mean indexer
KL. Problems are packed into sequences of up to ``pack`` tokens, as pretraining packs documents (a longer problem is
skipped), and every sequence of a step is padded to one length (``step.TrainStep``). Packed problems are isolated
(``--isolate-problems``): no row reads an earlier problem of its sequence, as no request reads another when served.
Not isolated, a pack's dozens of facts hold nearly every key, with other codes, so "copy a code from the context" does
not pay: the step on which multi-query recall's lookup formed (a few pairs a sequence), while packed retrieval stayed
at chance for 3400 steps (``benchmarks/results/train-tiny-packing``). On a GPU an eager step is bound by launching
its ops, so there mHC's Sinkhorn runs as one kernel each way (``--fused-sinkhorn``), the MoE computes every expert on
every row (``--every-expert``: 2.1x fewer ops, the same sums), and with
packing the step is captured once as a CUDA graph
and replayed (``--cuda-graph``; H200: 2 x 2048 tokens 0.09 s a replay against 0.25-0.33 s eager). Batches are
made ahead by ``--data-workers`` processes. ``--time-limit`` runs the schedule (and ``--dense-share``) on the clock and
stops there. At the end (and every ``--heldout-every`` steps) it reports the held-out completion nats of each task
(``train.heldout``: teacher-forced, so it moves before accuracy does). Seeded (a time-limited run's step count follows
its speed); writes the checkpoint (config.json, safetensors, the tokenizer), train.json (data, steps, tokens, the loss
curve) and loss.png under ``--out``. The MoE's selection biases stay at zero (no load-balancing update yet); the DSpark
drafter is not trained.

Data parallel under ``torchrun --nproc-per-node N``: rank r takes sequences r, r + N, ... of each step's batch, the
losses are normalised by the whole batch's counts and the gradients summed (NCCL when each rank has its own GPU; else
gloo, staged through host memory: ranks may share one GPU, which NCCL refuses), so a step equals the single-process
step on the whole batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from ..bench.provenance import run_meta
from .heldout import heldout_nats
from .ranks import Ranks
from .step import TrainStep, problem_align
from .tasks import TASKS, problem, prompt_ids, retrieval_distance
from .warm_in import WarmIn


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny"
    steps: int = 3000
    batch: int = 16  # sequences a step (problems, unless packed)
    lr: float = 2e-3
    warmup: int = 100
    kl_weight: float = 0.1
    prompt_weight: float = 0.25
    seed: int = 0
    mix: tuple = (("arithmetic", 0.4), ("retrieval", 0.3), ("chat", 0.3))
    min_back: int = 0  # retrieval distance in tokens (0: tasks.retrieval_distance)
    min_back_low: int = 0  # > 0: each training retrieval problem's distance drawn from [min_back_low, min_back]
    device: str = "cpu"
    log_every: int = 10
    pack: int = 0  # tokens a training sequence packs problems up to (0: one problem a sequence)
    isolate: bool = True  # packed problems each read only themselves (train.step: isolate_bos), as when served
    dense_steps: int = 0  # the first steps attend every visible global entry (the dense warm-up)
    dense_share: float = 0.0  # ... or the first share of the run (of steps, or of time_limit)
    time_limit: float = 0.0  # seconds: stop there (the schedule runs on the clock); 0: run all steps
    drills: int = 0  # retrieval: answered questions about random facts before the asked one
    fused_sinkhorn: bool = True  # on a GPU: mHC's Sinkhorn as one kernel each way (kernels.sinkhorn)
    every_expert: bool = True  # on a GPU: every routed expert on every row, weighted 0 where not chosen
    cuda_graph: bool = True  # on a GPU with packing: the step captured once as a CUDA graph (train.step)
    data_workers: int = -1  # processes making the batches ahead (-1: none on the CPU, 4 on a GPU)
    init: str = ""  # a checkpoint directory to start from (empty: seeded random weights)
    heldout_n: int = 16  # held-out problems a variant for the completion nats (train.heldout); 0: none
    heldout_every: int = 0  # ... also every that many steps (0: only at the end)
    warm_in_start: float = 0.0  # share of the run where mHC and the MoE start blending in (train.warm_in)
    warm_in_end: float = 0.0  # ... and where they are whole (0: whole from the start)
    dist_backend: str = "auto"  # data parallel: NCCL when each rank has its own GPU, else gloo (train.ranks)


@functools.cache
def _align(model: str, pack: int, isolate: bool) -> int:
    from ..models.loader import resolve_config

    return problem_align(resolve_config(model)) if pack and isolate else 1


def batch_of(cfg: TrainConfig, step: int, tokenizer, min_back: int) -> list[tuple[list[int], list[bool | None]]]:
    """Step's ``batch`` sequences as (token ids, which tokens are completion): train-split problems, tasks drawn by
    the mix; with ``pack`` > 0, each sequence holds problems one after another (each from its BOS) up to ``pack``
    tokens, as pretraining packs documents: the model's per-sequence work is paid once for several problems. With
    ``isolate``, each problem starts at a multiple of ``step.problem_align``: the end-of-sequence tokens padding up to
    it are marked None (no loss on them)."""
    align = _align(cfg.model, cfg.pack, cfg.isolate)
    rng = random.Random(f"batch/{cfg.seed}/{step}")
    tasks, weights = zip(*cfg.mix)
    count = lambda s: len(tokenizer.encode(s, add_bos=False))
    out, ids, completion, j, too_long = [], [], [], 0, {}
    while len(out) < cfg.batch:
        task = rng.choices(tasks, weights)[0]
        back = rng.randint(cfg.min_back_low, min_back) if cfg.min_back_low and task == "retrieval" else min_back
        p = problem(task, "train", (cfg.seed * 1_000_000 + step) * 10_000 + j, count, back, cfg.drills)
        j += 1
        prompt, answer = prompt_ids(tokenizer, p.prompt), tokenizer.encode(p.completion, add_bos=False)
        full = prompt + answer + [tokenizer.eos_id]
        if cfg.pack and len(full) > cfg.pack:  # a step has fixed shapes (train.step): a longer problem is skipped
            too_long[task] = too_long.get(task, 0) + 1
            if too_long[task] > 50:
                raise ValueError(
                    f"pack {cfg.pack} is too short for {task} problems ({len(full)} tokens and more); "
                    f"use a larger --pack or leave {task} out of --mix"
                )
            continue
        pad = -len(ids) % align
        if ids and len(ids) + pad + len(full) > cfg.pack:  # this sequence is full: the problem starts the next one
            out.append((ids, completion))
            ids, completion, pad = [], [], 0
        ids += [tokenizer.eos_id] * pad
        completion += [None] * pad
        ids += full
        completion += [False] * len(prompt) + [True] * (len(answer) + 1)
        if not cfg.pack:
            out.append((ids, completion))
            ids, completion = [], []
    return out


def token_weights(batch: list[tuple[list[int], list[bool | None]]], prompt_weight: float) -> list[list[float]]:
    """Per sequence, the loss weight of each row's next-token prediction (row t predicts token t + 1): 1 for a
    completion's tokens, ``prompt_weight`` for a prompt's, 0 for padding (None)."""
    weight = {True: 1.0, False: prompt_weight, None: 0.0}
    return [[weight[completion[t + 1]] for t in range(len(ids) - 1)] for ids, completion in batch]


_WORKER_TOKENIZER = None


def _batch_job(args) -> list:
    global _WORKER_TOKENIZER
    from ..models.tokenizer import Tokenizer

    cfg, step, min_back = args
    if _WORKER_TOKENIZER is None:
        _WORKER_TOKENIZER = Tokenizer.for_preset(cfg.model)
    return batch_of(cfg, step, _WORKER_TOKENIZER, min_back)


def batches(cfg: TrainConfig, tokenizer, min_back: int, workers: int):
    """Each step's batch in order; with ``workers`` > 0 made that many steps ahead by worker processes (on a GPU a
    captured step takes less time than tokenising its problems)."""
    if workers <= 0:
        yield from (batch_of(cfg, step, tokenizer, min_back) for step in range(cfg.steps))
        return
    import multiprocessing
    from collections import deque

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        ahead = deque()
        for step in range(cfg.steps):
            while len(ahead) < 2 * workers and step + len(ahead) < cfg.steps:
                ahead.append(pool.apply_async(_batch_job, ((cfg, step + len(ahead), min_back),)))
            yield ahead.popleft().get()


def backward_step(model, cfg: TrainConfig, whole: list, dense: bool, ranks: Ranks, held: dict) -> tuple:
    """This rank's share of a step's batch ``whole``: forward and backward (``step.TrainStep``: every sequence padded
    to ``pack`` tokens, or to the batch's longest without packing), the gradients summed over the ranks. ``held``
    keeps the step of the last shape (its CUDA graph). Returns (the step, its outputs)."""
    weights = token_weights(whole, cfg.prompt_weight)
    mine = whole[ranks.rank :: ranks.world]
    length = cfg.pack or max(len(ids) for ids, _ in whole)
    key = (len(mine), length, dense)
    if held.get("key") != key:
        if held.get("step") is not None:
            held["step"].release()
        graph = cfg.cuda_graph and cfg.pack > 0 and cfg.every_expert  # the routed MoE loop reads routing back
        held.update(
            key=key,
            step=TrainStep(
                model,
                len(mine),
                length,
                len(whole),
                cfg.kl_weight,
                dense,
                graph,
                pad_id=held["pad_id"],
                isolate_bos=held["bos_id"] if cfg.pack and cfg.isolate else None,
            ),
        )
    step = held["step"]
    step.load(mine, weights[ranks.rank :: ranks.world], sum(map(sum, weights)))
    out = step.run()
    ranks.sum_grads(step.params)
    return step, out


def prepare_for_training(model, device: str, fused_sinkhorn: bool = True, every_expert: bool = True) -> tuple:
    """The model on ``device`` in training mode with its MoE selection biases at zero and frozen (no load-balancing
    update yet); on a GPU, fewer launches (a tiny model's step is bound by them): mHC's Sinkhorn as one kernel each way,
    every expert on every row. Returns (model, the parameters to optimise)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.bias", "gate.bias_vl")):
                p.zero_()
                p.requires_grad_(False)
    model = model.to(device).train()
    if device.startswith("cuda"):
        from ..kernels.sinkhorn import sinkhorn_trainable

        for block in model.layers:
            if fused_sinkhorn:
                block.sinkhorn = sinkhorn_trainable
            block.ffn.every_expert = every_expert
    return model, [p for p in model.parameters() if p.requires_grad]


def train(cfg: TrainConfig, out_dir: str | None) -> dict:
    from ..models.checkpoint import dummy_weights, load_checkpoint, save_checkpoint
    from ..models.loader import resolve_config
    from ..models.model import DeepseekForCausalLM
    from ..models.tokenizer import TINY_DIR, Tokenizer

    parse_mix(",".join(f"{t}={w}" for t, w in cfg.mix))  # names and shares checked
    if cfg.model not in ("tiny", "tiny-v4"):
        raise ValueError(f"training runs on the tiny shapes (tiny, tiny-v4), not {cfg.model!r}")
    if cfg.steps < 1 or cfg.batch < 1 or cfg.warmup < 1:
        raise ValueError(f"steps, batch and warmup must be >= 1, got {cfg.steps}, {cfg.batch}, {cfg.warmup}")
    settings = (
        "min_back",
        "min_back_low",
        "dense_steps",
        "dense_share",
        "time_limit",
        "drills",
        "prompt_weight",
        "kl_weight",
        "heldout_n",
        "heldout_every",
    )
    negative = {k: getattr(cfg, k) for k in settings if getattr(cfg, k) < 0}
    if negative or not cfg.lr > 0 or cfg.dense_share > 1:
        raise ValueError(
            f"lr must be > 0, dense_share at most 1 and {', '.join(settings)} >= 0; got lr {cfg.lr}, "
            f"dense_share {cfg.dense_share}" + "".join(f", {k} {v}" for k, v in negative.items())
        )
    if cfg.warm_in_end and not 0 <= cfg.warm_in_start <= cfg.warm_in_end <= 1:  # the run must end whole
        raise ValueError(
            f"--warm-in-start and --warm-in-end are shares of the run, 0 <= start <= end <= 1 (end 0: "
            f"off); got {cfg.warm_in_start}, {cfg.warm_in_end}"
        )
    if cfg.data_workers < -1:
        raise ValueError(f"data_workers must be -1 (auto: 0 on the CPU, 4 on a GPU) or >= 0, got {cfg.data_workers}")
    ranks = Ranks(cfg.device, cfg.dist_backend)
    if cfg.batch < ranks.world:
        raise ValueError(f"batch {cfg.batch} gives some of the {ranks.world} ranks no sequence; use >= {ranks.world}")
    cfg = replace(cfg, device=ranks.device(cfg.device))
    torch.manual_seed(cfg.seed)
    mcfg = resolve_config(cfg.model)
    min_back = cfg.min_back or retrieval_distance(mcfg)
    if cfg.min_back_low > min_back:
        raise ValueError(
            f"--min-back-low {cfg.min_back_low} is past the retrieval distance {min_back} (--min-back, "
            f"default {retrieval_distance(mcfg)} for {mcfg.name}); it draws from [low, distance]"
        )
    if cfg.pack and cfg.isolate and not mcfg.is_v41:
        raise ValueError(
            f"isolating packed problems needs V4.1's non-overlapping compression ({mcfg.name} is V4); "
            f"use --no-isolate-problems or --pack 0"
        )
    if not 0 <= cfg.pack <= mcfg.max_position_embeddings:
        raise ValueError(
            f"pack must be 0 (no packing) or up to the model's {mcfg.max_position_embeddings} positions, got {cfg.pack}"
        )
    tokenizer = Tokenizer.for_preset(cfg.model)
    if cfg.pack and cfg.isolate and tokenizer.bos_id is None:  # problems are told apart by their BOS
        raise ValueError(f"isolating packed problems needs a BOS token; {cfg.model}'s tokenizer has none")
    model = DeepseekForCausalLM(mcfg)
    dummy_weights(model, mcfg, seed=cfg.seed)  # a seeded start; the selection biases then at zero (see above)
    if cfg.init:  # go on from a checkpoint (a run in several parts: give each part its own --seed, so new batches)
        if not os.path.isdir(cfg.init) or replace(resolve_config(cfg.init), name=mcfg.name) != mcfg:
            raise ValueError(f"--init {cfg.init!r} must be a checkpoint directory of the {mcfg.name} shape")
        load_checkpoint(model, mcfg, cfg.init)
    model, params = prepare_for_training(model, cfg.device, cfg.fused_sinkhorn, cfg.every_expert)
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=cfg.device.startswith("cuda")
    )  # one launch, not a dozen a parameter
    warm = WarmIn(model, cfg.warm_in_start, cfg.warm_in_end)
    workers = cfg.data_workers if cfg.data_workers >= 0 else (4 if cfg.device.startswith("cuda") else 0)
    held = {"pad_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id}
    curve, tokens, t0 = [], 0, time.perf_counter()
    dense_until = steps_run = 0
    for step, whole in enumerate(batches(cfg, tokenizer, min_back, workers)):
        progress = step / cfg.steps
        if cfg.time_limit:  # the schedule follows rank 0's clock (all ranks must agree on it)
            progress = min(
                1.0,
                max(progress, ranks.sum([time.perf_counter() - t0 if ranks.rank == 0 else 0.0])[0] / cfg.time_limit),
            )
            if progress >= 1 and step:
                break
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr
        dense = step < cfg.dense_steps or progress < cfg.dense_share
        level = warm.set(progress)
        dense_until = step + 1 if dense else dense_until
        ts, out = backward_step(model, cfg, whole, dense, ranks, held)
        steps_run = step + 1
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += sum(len(ids) for ids, _ in whole)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            ce_sum, targets, kl_sum, kl_count, n = ranks.sum(
                [
                    float((out["ce"] * ts.completion).sum()),
                    float(ts.completion.sum()),
                    float(out["kl_sum"]),
                    out["kl_count"],
                    sum(len(ids) for ids, _ in whole[ranks.rank :: ranks.world]),
                ]
            )
            curve.append(
                {
                    "step": step,
                    "lr": lr,
                    "ce": ce_sum / targets,
                    "index_kl": kl_sum / max(kl_count, 1),
                    "tokens": int(n),
                    "target_tokens": int(targets),
                    "warm_in": level,
                }
            )
            if cfg.heldout_n and cfg.heldout_every and step % cfg.heldout_every == 0 and ranks.rank == 0:
                # in the step's mode: during the dense warm-up, what the attention has learnt so far
                curve[-1]["heldout_nats"] = heldout_nats(model, tokenizer, cfg.heldout_n, min_back, dense)
                curve[-1]["heldout_dense"] = dense
            if ranks.rank == 0:
                elapsed = time.perf_counter() - t0
                held_out = curve[-1].get("heldout_nats")
                print(
                    f"step {step:5d}  ce {curve[-1]['ce']:.4f}  index kl {curve[-1]['index_kl']:.4f}  "
                    f"{tokens / elapsed:.0f} tok/s  {elapsed:.1f} s"
                    + (
                        f"  held-out nats{' (dense)' if dense else ''}: "
                        + " ".join(f"{k} {v:.2f}" for k, v in held_out.items())
                        if held_out
                        else ""
                    ),
                    flush=True,
                )
    seconds = time.perf_counter() - t0
    warm.detach()  # whole from here: what is measured and saved is the model itself
    final = heldout_nats(model, tokenizer, cfg.heldout_n, min_back) if cfg.heldout_n and ranks.rank == 0 else None
    if final:
        print(
            "held-out completion nats (as served: top-k, the whole model): "
            + "  ".join(f"{k} {v:.2f}" for k, v in final.items()),
            flush=True,
        )
    summary = {
        "meta": run_meta(),
        "config": asdict(cfg),
        "ranks": ranks.world,
        "model": mcfg.name,
        "min_back": min_back,
        "tokens": tokens,
        "steps_run": steps_run,
        "dense_until": dense_until,
        "seconds": seconds,
        "heldout_nats": final,
        "curve": curve,
        "data": {"tasks": list(TASKS), "split": "train (prompt hash), problems seeded by step and slot"},
    }
    if out_dir and ranks.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model.eval()
        save_checkpoint(model.cpu(), mcfg, out_dir, tokenizer_dir=TINY_DIR)
        with open(os.path.join(out_dir, "train.json"), "w") as f:
            json.dump(summary, f, indent=1)
        _plot(curve, os.path.join(out_dir, "loss.png"), dense_until)
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
    for name in ("model", "device", "dist_backend", "init"):
        p.add_argument(f"--{name.replace('_', '-')}", default=getattr(d, name))
    for name in (
        "steps",
        "batch",
        "warmup",
        "seed",
        "min_back",
        "min_back_low",
        "log_every",
        "pack",
        "dense_steps",
        "drills",
        "heldout_n",
        "heldout_every",
    ):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "kl_weight", "prompt_weight", "dense_share", "time_limit", "warm_in_start", "warm_in_end"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument(
        "--fused-sinkhorn",
        action=argparse.BooleanOptionalAction,
        default=d.fused_sinkhorn,
        help="on a GPU, mHC's Sinkhorn as one Triton kernel each way (default on)",
    )
    p.add_argument(
        "--every-expert",
        action=argparse.BooleanOptionalAction,
        default=d.every_expert,
        help="on a GPU, every routed expert on every row, weighted 0 where not chosen (default on)",
    )
    p.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=d.cuda_graph,
        help="on a GPU with --pack and --every-expert, the step captured as a CUDA graph (default on)",
    )
    p.add_argument(
        "--isolate-problems",
        dest="isolate",
        action=argparse.BooleanOptionalAction,
        default=d.isolate,
        help="with --pack, each problem reads only itself, as when served: no key of the problem before "
        "(V4.1 shapes; default on)",
    )
    p.add_argument(
        "--data-workers",
        type=int,
        default=d.data_workers,
        help="processes making batches ahead (default: 0 on the CPU, 4 on a GPU)",
    )
    p.add_argument(
        "--mix",
        default=",".join(f"{t}={w}" for t, w in d.mix),
        help="tasks and their shares of the draws, e.g. retrieval=1 (default %(default)s)",
    )
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
