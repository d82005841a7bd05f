"""EPLB balance on the built-in model's routing at simulated EP sizes 2, 8 and 32, target and DSpark draft (CPU).

    python benchmarks/eplb_balance_cpu.py [--problems 12] [--out benchmarks/results/eplb-balance-cpu]

The built-in model (tiny-trained: 8 experts top-2, drafter 4 experts top-2) routes problems of its tasks
(arithmetic, retrieval, chat; ``train`` split for the load window, ``eval`` split for the measured steps, so the
placement never sees the steps it is judged on). Its routing is widened to the release's expert counts scaled down
by 4 (target 384 -> 96, draft 128 -> 32: each expert split into sub-experts by a hash of the row's token,
``eplb_sim.scale_experts``) and replayed on simulated ranks (``eplb_sim.simulate``: DP attention's rows per rank, the
live replica choice). Per EP size: balance (mean / max tokens per rank, summed over layers) per step (mean over the
steps) and over the whole evaluation, for the contiguous placement without redundancy ("none"), EPLB's placement
from the window with one (and two) redundant slots a rank ("eplb"; also without redundancy, "eplb_r0"), and the
same steps with uniformly random routing ("uniform", the balanced reference); the share of the gap recovered is
(eplb - none) / (uniform - none). "oracle": the policy given the evaluation's own load (what a window that predicted
it exactly would reach); ``eplb_expected_balance``: EPLB's placement's expected balance on the window's load and on
the evaluation's (their difference is the window's prediction error, not the packing's). Transfer bytes per
rebalance: the moves' count times one expert's bytes at the release's size (MXFP4, 3 x 5120 x 2304 x 0.53125 B),
the first rebalance (from the initial placement) and a steady-state one (window A -> window B).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dsserve.bench.provenance import run_meta
from dsserve.distributed.eplb import layer_balance
from dsserve.distributed.eplb_policy import initial_layer, place, rank_loads
from dsserve.distributed.eplb_sim import expert_load, record_routing, scale_experts, simulate, steps_of
from dsserve.distributed.eplb_transfer import plan_layer

RELEASE_EXPERT_BYTES = int(3 * 5120 * 2304 * 0.53125)  # one MXFP4 expert with its scales: 18.8 MB
SCALE = {"target": 12, "draft": 8}  # 8 -> 96 (384 / 4), 4 -> 32 (128 / 4)
EP_SIZES = (2, 8, 32)
MIN_GAINS = (0.0, 0.005, 0.02)  # a steady rebalance's moves with each --eplb-min-gain
REDUNDANT_PER_RANK = (1, 2)  # redundant slots a rank (the figure shows 1)
MAX_TOKENS = 256  # a chat problem is ~1000 tokens: its first 256 (the CPU budget)


def sequences(tok, split: str, n: int) -> list[torch.Tensor]:
    from dsserve.train.tasks import problem, prompt_ids

    count = lambda s: len(tok.encode(s, add_bos=False))  # noqa: E731
    out = []
    for task in ("arithmetic", "retrieval", "chat"):
        for i in range(n):
            p = problem(task, split, i, count, 64)
            out.append(torch.tensor(prompt_ids(tok, p.prompt + p.completion)[:MAX_TOKENS]))
    return out


def moves(old, new, ep):
    return sum(len(plan_layer(i, tuple(o), tuple(p), ep).remote) for i, (o, p) in enumerate(zip(old, new)))


def run_case(name, train, evalr, ep, redundant, slots, chunk, n_window, n_eval):
    e, n_layers = train.n_experts, train.ids[0].shape[0]
    win = steps_of(train, slots, chunk, n_window)
    ev = steps_of(evalr, slots, chunk, n_eval)
    load = expert_load(win, e).tolist()
    start = [initial_layer(e, redundant, ep)] * n_layers
    eplb = place(load, ep, redundant, old=start)
    eplb_r0 = place(load, ep, 0)
    none = [initial_layer(e, 0, ep)] * n_layers
    first_half, second_half = win.split(len(win) // 2)
    a = place(expert_load(first_half, e).tolist(), ep, redundant, old=start)
    steady = {
        str(g): moves(a, place(expert_load(second_half, e).tolist(), ep, redundant, old=a, min_gain=g), ep)
        for g in MIN_GAINS
    }
    eval_load = expert_load(ev, e).tolist()
    runs = {
        "none": simulate(ev, none, e, ep),
        "eplb": simulate(ev, eplb, e, ep),
        "eplb_r0": simulate(ev, eplb_r0, e, ep),
        "oracle": simulate(ev, place(eval_load, ep, redundant), e, ep),
        "uniform": simulate(ev, none, e, ep, uniform_seed=0),
    }
    # the placement's expected balance (each expert's load split evenly over its replicas) on the window's load,
    # which it was made for, and on the evaluation's: the difference is what the window does not predict
    expected = {
        name: float(layer_balance(torch.tensor([rank_loads(row, p, ep) for row, p in zip(ld, eplb)])))
        for name, ld in (("window_load", load), ("eval_load", eval_load))
    }
    step = {k: float(layer_balance(v).mean()) for k, v in runs.items()}
    window = {k: float(layer_balance(v.sum(0))) for k, v in runs.items()}
    per_layer = {k: layer_balance(v.sum(0)[:, None, :]).tolist() for k, v in runs.items()}

    def gap(f):
        d = f["uniform"] - f["none"]
        return None if d <= 0 else (f["eplb"] - f["none"]) / d

    first = moves(start, eplb, ep)
    return {
        "moe": name,
        "experts": e,
        "ep": ep,
        "redundant": redundant,
        "layers": n_layers,
        "rows_per_step": slots * chunk,
        "pairs_per_rank_per_step": slots * chunk * train.ids[0].shape[2] / ep,
        "window_steps": len(win),
        "eval_steps": len(ev),
        "balance_step": step,
        "balance_window": window,
        "gap_recovered_step": gap(step),
        "gap_recovered_window": gap(window),
        "gap_recovered_step_oracle": (step["oracle"] - step["none"]) / (step["uniform"] - step["none"]),
        "eplb_expected_balance": expected,
        "balance_window_per_layer": per_layer,
        "moves_first_rebalance": first,
        "moves_steady_rebalance_by_min_gain": steady,
        "bytes_first_rebalance_release_expert": first * RELEASE_EXPERT_BYTES,
        "bytes_steady_rebalance_release_expert_by_min_gain": {g: m * RELEASE_EXPERT_BYTES for g, m in steady.items()},
        "staging_bound_bytes_release_expert": (e + redundant) // ep * RELEASE_EXPERT_BYTES,
    }


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, name in zip(axes[:2], ("target", "draft")):
        rows = [r for r in results if r["moe"] == name and r["redundant"] == r["ep"]]
        x = range(len(rows))
        for j, (k, c) in enumerate((("none", "tab:red"), ("eplb", "tab:green"), ("uniform", "tab:gray"))):
            ax.bar([i + 0.27 * (j - 1) for i in x], [r["balance_step"][k] for r in rows], 0.27, label=k, color=c)
        ax.set_xticks(list(x), [f"EP{r['ep']}\n{r['experts']}+{r['redundant']} slots" for r in rows])
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{name}: balance per step (mean/max tokens a rank)")
        for i, r in enumerate(rows):
            ax.text(i, 1.0, f"{100 * r['gap_recovered_step']:.0f}%", ha="center", fontsize=9)
        ax.legend(loc="lower left", fontsize=8)
    r8 = next(r for r in results if r["moe"] == "target" and r["ep"] == 8 and r["redundant"] == 8)
    for k, c in (("none", "tab:red"), ("eplb", "tab:green"), ("uniform", "tab:gray")):
        axes[2].plot(r8["balance_window_per_layer"][k], marker="o", color=c, label=k)
    axes[2].set_title("target EP8: balance per layer over the evaluation")
    axes[2].set_xlabel("layer")
    axes[2].set_ylim(0, 1.05)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=12, help="problems per task and split")
    ap.add_argument("--draft-every", type=int, default=8, help="a draft block every that many positions")
    ap.add_argument("--out", default="benchmarks/results/eplb-balance-cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dsserve.models.loader import load_model

    t0 = time.perf_counter()
    lm = load_model("tiny-trained")
    model, tok = lm.model.eval(), lm.tokenizer
    routing = {}
    for split in ("train", "eval"):
        target, draft = record_routing(model, sequences(tok, split, args.problems), args.draft_every)
        routing[split] = {
            "target": scale_experts(target, SCALE["target"]),
            "draft": scale_experts(draft, SCALE["draft"]),
        }
    recorded_s = time.perf_counter() - t0
    results = []
    for name in ("target", "draft"):
        for ep, per_rank in ((ep, n) for ep in EP_SIZES for n in REDUNDANT_PER_RANK):
            # a decode step: one row a request (target), one 5-row block a request (draft); 64 requests a rank
            slots, chunk = 64 * ep, 1 if name == "target" else 5
            results.append(
                run_case(name, routing["train"][name], routing["eval"][name], ep, per_rank * ep, slots, chunk, 120, 120)
            )
            r = results[-1]
            print(
                f"{name:6s} EP{ep:<3d} {r['experts']}+{r['redundant']} slots: per step none "
                f"{r['balance_step']['none']:.3f} eplb {r['balance_step']['eplb']:.3f} (r0 "
                f"{r['balance_step']['eplb_r0']:.3f}) uniform {r['balance_step']['uniform']:.3f} -> "
                f"{100 * r['gap_recovered_step']:.1f}% of the gap (oracle {r['balance_step']['oracle']:.3f}, "
                f"{100 * r['gap_recovered_step_oracle']:.1f}%); window {100 * r['gap_recovered_window']:.1f}%; "
                f"expected on the window's load {r['eplb_expected_balance']['window_load']:.3f}, on the evaluation's "
                f"{r['eplb_expected_balance']['eval_load']:.3f}; "
                f"moves {r['moves_first_rebalance']} first, steady {r['moves_steady_rebalance_by_min_gain']}",
                flush=True,
            )
    tokens = {s: {k: sum(x.shape[1] for x in v.ids) for k, v in routing[s].items()} for s in routing}
    os.makedirs(args.out, exist_ok=True)
    out = {
        "meta": run_meta(),
        "model": "tiny-trained",
        "tasks": ["arithmetic", "retrieval", "chat"],
        "problems_per_task_and_split": args.problems,
        "max_tokens_per_problem": MAX_TOKENS,
        "rows_recorded": tokens,
        "expert_scale": SCALE,
        "release_expert_bytes": RELEASE_EXPERT_BYTES,
        "recording_s": round(recorded_s, 1),
        "results": results,
    }
    with open(os.path.join(args.out, "eplb_balance.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(results, os.path.join(args.out, "eplb_balance.png"))
    print(f"wrote {args.out}/eplb_balance.json and .png ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
