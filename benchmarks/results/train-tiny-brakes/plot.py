"""brakes.png from this directory's JSON: python plot.py"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def curve(f):
    with open(f) as fh:
        c = json.load(fh)["curve"]
    return [s for s, _ in c], [v for _, v in c]


fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.4))
for name, f in (
    ("as it was (serving init)", "tiny-base-long.json"),
    ("mHC off", "tiny-ablate-mhc.json"),
    ("MoE + Engram off", "tiny-ablate-ffn.json"),
    ("QAT off", "tiny-ablate-qat.json"),
    ("mHC + QAT off", "tiny-ablate-mhc-qat.json"),
    ("MoE + Engram + QAT off", "tiny-ablate-ffn-qat.json"),
    ("mHC + MoE + Engram off", "tiny-ablate-mhc-ffn.json"),
    ("all three off", "tiny-ablate-mhc-ffn-qat.json"),
    ("mHC + Engram off (CPU)", "tiny-ablate-mhc-engram-cpu.json"),
    ("mHC + MoE off (CPU)", "tiny-ablate-mhc-moe-cpu.json"),
    ("quiet start (CPU)", "tiny-quiet-start-cpu.json"),
):
    if os.path.exists(f):
        a.plot(*curve(f), label=name, linewidth=2.2 if "quiet" in name else 1.2)
a.axhline(1.79, color="grey", linestyle=":", label="copy any value (ln 6)")
a.set(
    title="tiny model, MQAR in the window (6 pairs, 90 values), H200",
    xlabel="step (batch 64)",
    ylabel="value CE (nats)",
    ylim=(0, 3),
    xlim=(0, 3300),
)
a.legend(fontsize=8)
for name, f in (
    ("+ q LoRA, sink, grouped wo, seed 0", "yardstick-all3-seed0.json"),
    ("+ q LoRA, sink, grouped wo, seed 1", "yardstick-all3-seed1.json"),
    ("+ q LoRA, seed 1", "yardstick-qlora-seed1.json"),
    ("+ q LoRA, q_norm weight 4 (CPU)", "yardstick-qlora-qnw4-cpu.json"),
):
    b.plot(*curve(f), label=name)
b.axhline(1.79, color="grey", linestyle=":")
b.set(title="plain 12-layer yardstick, MQAR (6 pairs, 200 values), H200", xlabel="step (batch 64)", ylim=(0, 5.5))
b.legend(fontsize=8)
fig.tight_layout()
fig.savefig("brakes.png", dpi=100)
