"""Issue 56's drafter training (``dsserve.train.draft``) on one GPU in one go, for when the CPU is too slow.

    python benchmarks/train_draft_h200.py --out $OUT

The built-in model's backbone stays frozen; its drafter (the three DSpark stages, the Markov and confidence heads) is
trained from fresh seeded weights on ``--problems`` training problems for ``--time-limit`` seconds, shipped into
``$OUT/checkpoint`` (a copy of the built-in checkpoint whose backbone bytes are checked unchanged), and its held-out
acceptance measured on what was shipped (on the host CPU, as the CPU measurement). Writes $OUT/draft.json (settings,
loss curve, acceptance, backbone digests, provenance), $OUT/draft_loss.png, $OUT/draft_state.pt and the checkpoint;
prints one JSON line. To ship it: copy ``$OUT/checkpoint/model.safetensors`` over ``dsserve/data/tiny-trained/``'s
(``tests/train/test_draft.py`` checks the backbone digest).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dsserve.train.draft import DraftConfig, train_draft
from dsserve.train.train import parse_mix


def main() -> int:
    d = DraftConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--problems", type=int, default=2000)
    p.add_argument("--backbone-batch", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds of drafter training (after the pass)")
    p.add_argument("--heldout-n", type=int, default=16)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--mix", default=",".join(f"{t}={w}" for t, w in d.mix))
    p.add_argument("--continuation", default=d.continuation, choices=("gold", "target"))
    p.add_argument("--continuation-tokens", type=int, default=d.continuation_tokens)
    p.add_argument("--from-init", action="store_true", help="fine-tune the built-in drafter, not fresh weights")
    a = p.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; use --device cpu (slow) or run on the GPU machine")
    cfg = DraftConfig(
        seed=a.seed,
        problems=a.problems,
        backbone_batch=a.backbone_batch,
        batch=a.batch,
        lr=a.lr,
        steps=1_000_000,
        time_limit=a.time_limit,
        heldout_n=a.heldout_n,
        log_every=50,
        save_every=500,
        device=a.device,
        mix=parse_mix(a.mix),
        continuation=a.continuation,
        continuation_tokens=a.continuation_tokens,
        from_init=a.from_init,
    )
    t0 = time.perf_counter()
    summary = train_draft(cfg, a.out, log=lambda s: print(s, flush=True))
    print(
        json.dumps(
            {
                "seconds": time.perf_counter() - t0,
                "steps_run": summary["steps_run"],
                "ship": summary.get("ship"),
                "acceptance": summary.get("acceptance"),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
