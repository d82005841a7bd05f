"""curriculum.png from this directory's JSON: python plot.py"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(f):
    with open(f) as fh:
        return json.load(fh)


fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.4))
# A and B start from scratch at the full distance; R2 goes on from A at 64 back, R3 from R2 at 128 back
chains = [
    ("A: from scratch, 16-416 back", ["A.json"]),
    ("B: as A, warm-in 0.6-0.95, top-k after 0.8", ["B.json"]),
    ("A -> R2 (16-64 back) -> R3 (16-128 back)", ["A.json", "R2.json", "R3.json"]),
]
for name, files in chains:
    base, xs, far, near, arith = 0, [], [], [], []
    for f in files:
        d = load(f)
        for r in d["curve"]:
            if "heldout_nats" in r and not (base and r["step"] == 0):
                xs.append(base + r["step"])
                far.append(r["heldout_nats"]["retrieval"])
                near.append(r["heldout_nats"]["retrieval-near"])
                arith.append(r["heldout_nats"]["arithmetic"])
        base += d["steps_run"]
    (line,) = a.plot(xs, far, marker="o", label=f"{name}: asked fact")
    a.plot(xs, near, marker="x", linestyle="--", color=line.get_color(), label=f"{name}: last fact")
    b.plot(xs, arith, marker="o", color=line.get_color(), label=name)
base = 0
for f in ("A.json", "R2.json"):
    base += load(f)["steps_run"]
    a.axvline(base, color="grey", linestyle=":")
a.axhline(9.0, color="grey", linestyle="-.", label="chance (2 ln 90)")
a.set(
    title="held-out retrieval code nats (dense, r = 0; each run at its own distance)",
    xlabel="step (8 x 2048 tokens)",
    ylabel="nats",
    ylim=(0, 10),
)
a.legend(fontsize=7)
b.set(
    title="held-out arithmetic completion nats (worked solution + answer)",
    xlabel="step (8 x 2048 tokens)",
    ylabel="nats",
    yscale="log",
)
b.legend(fontsize=7)
fig.tight_layout()
fig.savefig(os.path.join(os.path.dirname(os.path.abspath(__file__)), "curriculum.png"), dpi=110)
