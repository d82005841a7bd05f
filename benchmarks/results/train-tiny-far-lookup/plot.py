"""far-lookup.png from this directory's JSON: python plot.py"""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def curve(f, col=1):
    with open(f) as fh:
        c = json.load(fh)["curve"]
    return [r[0] for r in c], [r[col] for r in c]


fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.4))
for name, f in (
    ("in the window, warm-in 800-1600", "warm-window.json"),
    ("64 back, warm-in 800-1600", "warm-far.json"),
    ("64 back, mHC + MoE off", "far-a.json"),
    ("64 back, mHC + MoE + QAT off", "far-b.json"),
):
    a.plot(*curve(f), label=name)
a.axvspan(800, 1600, color="orange", alpha=0.12, label="warm-in ramp (r 0 -> 1)")
a.axhline(1.79, color="grey", linestyle=":", label="copy any value (ln 6)")
a.set(
    title="tiny model, MQAR (6 pairs), H200, one run a GPU",
    xlabel="step (batch 64)",
    ylabel="value CE (nats)",
    ylim=(0, 3),
    xlim=(0, 2700),
)
a.legend(fontsize=8)
for name, f in (("mHC + MoE off", "cur-a.json"), ("warm-in 1000-2000", "cur-b.json")):
    for col, part in ((2, "near"), (3, "far")):
        b.plot(*curve(f, col), label=f"{name}: {part}", linestyle="-" if part == "far" else "--")
b.axhline(1.79, color="grey", linestyle=":")
b.set(
    title="tiny model, filler 0-64 per sequence (two runs on one H200)",
    xlabel="step (batch 64)",
    ylim=(0, 3),
    xlim=(0, 1400),
)
b.legend(fontsize=8)
for name, f in (
    ("full attention, 64 back", "yardstick-full-far.json"),
    ("CED, 64 back", "yardstick-ced-far.json"),
    ("CED, filler 0-64", "yardstick-ced-cur.json"),
    ("CED, in the window", "yardstick-ced-near.json"),
):
    c.plot(*curve(f), label=name)
c.axhline(1.79, color="grey", linestyle=":")
c.set(title="plain 12-layer yardstick (4 runs on one H200)", xlabel="step (batch 64)", ylim=(0, 5), xlim=(0, 2850))
c.legend(fontsize=8)
fig.tight_layout()
fig.savefig("far-lookup.png", dpi=100)
