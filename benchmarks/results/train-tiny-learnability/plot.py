"""learnability.png from this directory's JSON: python plot.py"""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
for name, f in (
    ("in the window, lr 1e-3", "mqar-call2-win_1e3.json"),
    ("64 tokens back (global KV), lr 1e-3", "mqar-call3-mqar_long.json"),
    ("64 back, sparse top-k, lr 3e-3", "mqar-call2-far_sparse_3e3.json"),
):
    with open(f) as fh:
        c = json.load(fh)["curve"]
    a.plot([s for s, _ in c], [v for _, v in c], label=name)
a.axhline(1.79, color="grey", linestyle=":", label="copy any value (ln 6)")
a.set(
    title="tiny model, MQAR (6 pairs, 90 values), H200", xlabel="step (batch 64)", ylabel="value CE (nats)", ylim=(0, 5)
)
a.legend()
with open("reference-cpu.json") as fh:
    reference = json.load(fh)["runs"]
for name, r in reference.items():
    b.plot([s for s, _ in r["curve"]], [v for _, v in r["curve"]], label=name)
b.axhline(1.79, color="grey", linestyle=":")
b.set(title="plain 12-layer yardstick, MQAR (6 pairs, 200 values), CPU", xlabel="step (batch 64)", ylim=(0, 5.5))
b.legend(fontsize=8)
fig.tight_layout()
fig.savefig("learnability.png", dpi=100)
