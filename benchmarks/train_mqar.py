"""Can the tiny model learn a keyed in-context lookup at all, and how fast? Multi-query associative recall (MQAR).

    python benchmarks/train_mqar.py --device cuda --pairs 6 --filler 64 --lr 1e-3 --time 450

Each sequence: BOS, ``pairs`` key-value pairs (k v, keys and values single tokens from disjoint ranges of
``values`` ids), ``filler`` random tokens (64 > the tiny window of 32: every lookup then goes through the global KV),
then each key again in a random order followed by its value; the loss is on those values only. The model is the
reference forward exactly as training runs it (``train.step.TrainStep``: QAT, mHC, the MoE, Engram; CUDA graph on a
GPU). Three levels of the loss tell what has formed: ln(values) (the unigram: nothing copied), ln(pairs) (copy one of
the values in the context: no key used), 0 (the keyed lookup). The synthetic retrieval task has no middle level (its
context holds every number), so this is where to watch the lookup form. ``--warm-in`` trains as train.py's warm-in;
``--ablate`` and ``--quiet-start`` are probes of what brakes the lookup (``benchmarks/results/train-tiny-brakes``).
``--filler-min`` draws each sequence's filler from a range, so some pairs sit in the window and some past it, and
``--filler-ramp`` widens that range over the run (curricula for the lookup through the global KV); the curve splits
the value CE into near and far. Prints the curve (step, value CE, near, far), then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time

import torch

from dsserve.layers import moe
from dsserve.models import block
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.loader import resolve_config
from dsserve.models.model import DeepseekForCausalLM
from dsserve.train.step import TrainStep
from dsserve.train.train import prepare_for_training
from dsserve.train.warm_in import WarmIn, warm_in_level


def sequence(
    rng: random.Random, pairs: int, filler: int, values: int, window: int = 0
) -> tuple[list[int], list[bool], list[bool]]:
    """(ids, asked: the row is a value to guess, far: that value's pair lies more than ``window`` rows back)."""
    keys = rng.sample(range(100, 100 + values), pairs)
    vals = [100 + values + rng.randrange(values) for _ in keys]
    ids, asked = [0], [False]
    for k, v in zip(keys, vals):
        ids += [k, v]
        asked += [False, False]
    ids += [max(400, 100 + 2 * values) + rng.randrange(500) for _ in range(filler)]
    asked += [False] * filler
    far = [False] * len(ids)
    for i in rng.sample(range(pairs), pairs):
        far += [False, len(ids) + 1 - (2 + 2 * i) >= window]
        ids += [keys[i], vals[i]]
        asked += [False, True]
    return ids, asked, far


def quiet_start(model, cfg) -> None:
    """--quiet-start (a probe; it did not bring the lookup forward): mHC's mixes start as a plain residual (their
    token-dependent part x 0.01; pre 1/n, post 1, comb 0.95 on the diagonal), the last projection of every branch
    (attention wo_b, the experts' w2, Engram's value rows) x 1 / sqrt(2 x layers)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    small = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    comb = torch.eye(n) * 4.0
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("hc_attn_scale", "hc_ffn_scale")):
                w.fill_(0.01)
            elif name.endswith(("hc_attn_base", "hc_ffn_base")):
                w[:n], w[n : 2 * n], w[2 * n :] = math.log(1 / (n - 1)), 0.0, comb.flatten()
            elif name.endswith(("attn.wo_b.weight", "experts.w2", "shared_experts.w2.weight")):
                w.mul_(small)
            elif name.endswith("engram.wkv.weight"):
                w[n * d :].mul_(small)


def plain_residual_mix(x, fn, base, scale, *rest):
    """--ablate mhc: layers.mhc.hc_mix's (pre, post, comb) of a plain residual stream, whatever the weights (kept in
    the graph at weight 0, so each still gets a gradient and the step's CUDA graph its outputs)."""
    t, n = x.shape[0], x.shape[1]
    keep = 0 * (fn.sum() + base.sum() + scale.sum())
    return (
        x.new_full((t, n), 1.0 / n, dtype=torch.float32) + keep,
        x.new_ones(t, n, dtype=torch.float32),
        torch.eye(n, dtype=torch.float32, device=x.device).expand(t, n, n),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--filler", type=int, default=0, help="random tokens between the pairs and the questions")
    p.add_argument(
        "--filler-min",
        type=int,
        default=None,
        help="draw each sequence's filler from [filler-min, filler] (a curriculum of near and far pairs); "
        "default: always --filler",
    )
    p.add_argument(
        "--filler-ramp",
        default="0,0",
        metavar="START,END",
        help="a curriculum: the filler's upper bound grows from --filler-min at step START to --filler at "
        "END (0,0: --filler throughout)",
    )
    p.add_argument("--values", type=int, default=90, help="distinct keys and values")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--dense",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="attend every visible global entry (the training's dense warm-up) instead of the top-k",
    )
    p.add_argument("--time", type=float, default=120, help="seconds of training")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument(
        "--q-norm-init",
        type=float,
        default=1.0,
        help="start every attention's q_norm weight here (the query's scale, which its RMSNorm fixes)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quiet-start",
        action="store_true",
        help="a probe: start mHC as a plain residual (its token-dependent part x 0.01) and every branch's "
        "last projection x 1/sqrt(2 x layers)",
    )
    p.add_argument(
        "--warm-in",
        default="0,0",
        metavar="START,END",
        help="steps over which mHC and the MoE blend in (train.warm_in; 0,0: whole throughout)",
    )
    p.add_argument(
        "--ablate",
        default="",
        help="probes, not the architecture: a comma list of mhc (every mix fixed "
        "at a plain residual: pre 1/n, post 1, comb the identity), moe (its output zero), engram (none), "
        "ffn (moe and engram), qat (no fake quantisation)",
    )
    a = p.parse_args()
    fill_lo = a.filler if a.filler_min is None else a.filler_min
    try:
        fill_ramp = [int(v) for v in a.filler_ramp.split(",")]
        if len(fill_ramp) != 2 or not 0 <= fill_ramp[0] <= fill_ramp[1]:
            raise ValueError
    except ValueError:
        p.error(f"--filler-ramp wants START,END in steps, 0 <= START <= END, got {a.filler_ramp!r}")
    if a.pairs < 1 or a.pairs > a.values or not 0 <= fill_lo <= a.filler or a.batch < 1:
        p.error("want 1 <= pairs <= values, 0 <= filler-min <= filler, batch >= 1")
    if fill_ramp[1] and fill_lo == a.filler:
        p.error("--filler-ramp widens the filler from --filler-min to --filler: give a --filler-min below --filler")
    ablate, known = set(filter(None, a.ablate.split(","))), {"mhc", "moe", "engram", "ffn", "qat"}
    if ablate - known:
        p.error(f"--ablate takes {', '.join(sorted(known))}; got {', '.join(sorted(ablate - known))}")
    if "ffn" in ablate:
        ablate |= {"moe", "engram"}
    try:
        ramp = [float(v) for v in a.warm_in.split(",")]
        if len(ramp) != 2 or ramp[0] < 0 or ramp[1] < 0 or 0 < ramp[1] < ramp[0]:
            raise ValueError
    except ValueError:
        p.error(f"--warm-in wants START,END in steps, 0 <= START <= END (0,0: off), got {a.warm_in!r}")
    torch.manual_seed(a.seed)
    cfg = resolve_config(a.model)
    if "engram" in ablate:
        cfg = dataclasses.replace(cfg, engram_layer_ids=())
    if "moe" in ablate:
        moe.MoE.forward = lambda self, h, *args, **kw: h * 0
    if "mhc" in ablate:
        block.hc_mix = plain_residual_mix
    model = DeepseekForCausalLM(cfg)
    dummy_weights(model, cfg, seed=a.seed)
    if a.quiet_start:
        quiet_start(model, cfg)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("attn.q_norm.weight"):
                w.fill_(a.q_norm_init)
    cuda = a.device.startswith("cuda")
    model, params = prepare_for_training(model, a.device)  # as train.py
    if "qat" in ablate:
        forward = model.forward_batch
        model.forward_batch = lambda step: forward(dataclasses.replace(step, qat=False))
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=cuda)
    warm = WarmIn(model, *ramp)
    step_fn = TrainStep(model, a.batch, 1 + 4 * a.pairs + a.filler, a.batch, 0.1, a.dense, cuda, pad_id=1)
    rng, curve, step, t0 = random.Random(a.seed), [], 0, time.perf_counter()
    print(
        f"{'step':>6} {'value CE':>9} {'near':>9} {'far':>9} {'s':>6}   "
        f"(unigram {math.log(a.values):.2f}, copy-any {math.log(a.pairs):.2f})"
    )
    while step < a.steps and time.perf_counter() - t0 < a.time:
        fill_hi = (
            a.filler if not fill_ramp[1] else fill_lo + round((a.filler - fill_lo) * warm_in_level(step, *fill_ramp))
        )
        batch = [
            sequence(rng, a.pairs, rng.randint(fill_lo, fill_hi), a.values, cfg.sliding_window) for _ in range(a.batch)
        ]
        weights = [[1.0 if asked[t + 1] else 0.0 for t in range(len(ids) - 1)] for ids, asked, _ in batch]
        step_fn.load([(ids, asked) for ids, asked, _ in batch], weights, sum(map(sum, weights)))
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 50)
        warm.set(step)
        out = step_fn.run()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % a.log_every == 0:
            far = torch.zeros(step_fn.length * a.batch, dtype=torch.bool)  # rows guessing a value past the window
            for i, (ids, _, f) in enumerate(batch):
                far[i * step_fn.length : i * step_fn.length + len(ids) - 1] = torch.tensor(f[1:])
            ce, done = out["ce"].cpu(), step_fn.completion.cpu()
            # a part with no question this step: None (JSON null), printed as "-"
            parts = [
                round(float((ce * m).sum() / m.sum()), 4) if m.any() else None for m in (done, done & ~far, done & far)
            ]
            curve.append([step, *parts])
            shown = " ".join("        -" if v is None else f"{v:9.3f}" for v in parts)
            print(f"{step:6d} {shown} {time.perf_counter() - t0:6.0f}", flush=True)
        step += 1
    print(
        json.dumps(
            {
                "args": vars(a),
                "steps": step,
                "seconds": time.perf_counter() - t0,
                "unigram": math.log(a.values),
                "copy_any": math.log(a.pairs),
                "curve": curve,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
