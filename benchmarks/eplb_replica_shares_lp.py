"""Would uneven replica shares help the draft at EP32? EPLB's placement with each expert's load split evenly over its
replicas, against the same slots with the shares an LP picks (minimise the most-loaded rank on the window's load):
expected balance per layer on the window's load and on the evaluation's (CPU, ~30 s; needs scipy).

    python benchmarks/eplb_replica_shares_lp.py [--problems 6] [--moe draft] [--ep 32]

The recording is ``eplb_balance_cpu.py``'s (same problems, scaling and decode steps).
"""

from __future__ import annotations

import argparse

import torch
from eplb_balance_cpu import SCALE, sequences

from dsserve.distributed.eplb_policy import balance, initial_layer, place
from dsserve.distributed.eplb_sim import expert_load, record_routing, scale_experts, steps_of


def lp_shares(load: list[float], phy2log: list[int], ep: int) -> list[float]:
    """Each slot's share of its expert's load minimising the most-loaded rank (shares of an expert sum to 1)."""
    import numpy as np
    from scipy.optimize import linprog

    per, n = len(phy2log) // ep, len(phy2log)
    cost = np.zeros(n + 1)
    cost[-1] = 1.0  # the most-loaded rank
    a_eq = np.zeros((len(load), n + 1))
    a_ub = np.zeros((ep, n + 1))
    for s, ex in enumerate(phy2log):
        a_eq[ex, s] = 1.0
        a_ub[s // per, s] = load[ex]
    a_ub[:, -1] = -1.0
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(ep), A_eq=a_eq, b_eq=np.ones(len(load)), method="highs")
    return res.x[:n].tolist()


def expected(load: list[float], phy2log: list[int], shares: list[float], ep: int) -> float:
    per = len(phy2log) // ep
    return balance([sum(load[phy2log[s]] * shares[s] for s in range(r * per, (r + 1) * per)) for r in range(ep)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=6)
    ap.add_argument("--moe", choices=("target", "draft"), default="draft")
    ap.add_argument("--ep", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dsserve.models.loader import load_model

    lm = load_model("tiny-trained")
    model, tok = lm.model.eval(), lm.tokenizer
    loads = []
    for split in ("train", "eval"):
        routing = record_routing(model, sequences(tok, split, args.problems), 8)[args.moe == "draft"]
        routing = scale_experts(routing, SCALE[args.moe])
        steps = steps_of(routing, 64 * args.ep, 5 if args.moe == "draft" else 1, 120)
        loads.append(expert_load(steps, routing.n_experts).double().tolist())
    window, evaluation = loads
    e = len(window[0])
    placed = place(window, args.ep, args.ep, old=[initial_layer(e, args.ep, args.ep)] * len(window))
    for layer, p in enumerate(placed):
        even = [1.0 / p.count(ex) for ex in p]
        lp = lp_shares(window[layer], p, args.ep)
        w, v = window[layer], evaluation[layer]
        print(
            f"{args.moe} EP{args.ep} layer {layer}: expected on the window's load even "
            f"{expected(w, p, even, args.ep):.3f} LP {expected(w, p, lp, args.ep):.3f}; on the evaluation's even "
            f"{expected(v, p, even, args.ep):.3f} LP {expected(v, p, lp, args.ep):.3f}"
        )


if __name__ == "__main__":
    main()
