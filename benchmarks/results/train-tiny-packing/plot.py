"""packing.png from this directory's JSON: python plot.py"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(f):
    with open(f) as fh:
        return json.load(fh)


fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.4))
for name, f in (("mHC + MoE off", "mqar-mix-off.json"), ("warm-in 1800-2600", "mqar-mix-warm.json")):
    c = load(f)["curve"]
    for col, part in ((2, "near"), (3, "far")):
        a.plot(
            [r[0] for r in c], [r[col] for r in c], label=f"{name}: {part}", linestyle="-" if part == "far" else "--"
        )
a.axvspan(1800, 2600, color="orange", alpha=0.12, label="warm-in ramp (r 0 -> 1)")
a.axhline(1.79, color="grey", linestyle=":", label="copy any value (ln 6)")
a.set(
    title="tiny, MQAR, filler 0-64 a sequence (two runs on one H200)",
    xlabel="step (batch 64)",
    ylabel="value CE (nats)",
    ylim=(0, 3),
    xlim=(0, 3800),
)
a.legend(fontsize=8)
runs = [
    ("packed mix (GPU, top-k; part 2 from part 1)", ["packed-mix-part1.json", "packed-mix-part2.json"]),
    ("packed, few facts (GPU, top-k)", ["packed-few-facts.json"]),
    ("isolated, old task: a shortcut (CPU, top-k)", ["isolated-few-facts-cpu.json"]),
]
for name, files in runs:
    if not all(os.path.exists(f) for f in files):
        continue
    base, xs, far, near = 0, [], [], []
    for f in files:
        d = load(f)
        for r in d["curve"]:
            if "heldout_nats" in r:
                xs.append(base + r["step"])
                far.append(r["heldout_nats"]["retrieval"])
                near.append(r["heldout_nats"]["retrieval-near"])
        base += d["steps_run"]
    (line,) = b.plot(xs, far, marker="o", label=f"{name}: asked fact {load(files[0])['min_back']}+ back")
    b.plot(xs, near, marker="x", linestyle="--", color=line.get_color(), label=f"{name}: last fact")
steps, far, near = [], [], []
with open("isolated-fixed-task-cpu.log") as fh:  # pilot 2: stopped by hand, its held-out nats from the log
    for line in fh:
        if "held-out" in line and not line.startswith("step     0"):
            words = line.split()
            steps.append(int(words[1]))
            far.append(float(words[words.index("retrieval") + 1]))
            near.append(float(words[words.index("retrieval-near") + 1]))
(line,) = b.plot(steps, far, marker="o", label="isolated, fixed task (CPU, dense): asked fact 64+ back")
b.plot(steps, near, marker="x", linestyle="--", color=line.get_color(), label="isolated, fixed task (CPU): last fact")
b.axhline(9.0, color="grey", linestyle=":", label="chance (2 ln 90)")
b.set(title="retrieval, held-out completion nats (mHC + MoE at r = 0)", xlabel="step", ylabel="nats", ylim=(0, 12))
b.legend(fontsize=7)
fig.tight_layout()
fig.savefig("packing.png", dpi=100)
