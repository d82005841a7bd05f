"""Teacher-forced held-out retrieval of a checkpoint at warm-in level r = 0, dense entries or top-k, with and without
drills: python probe.py CHECKPOINT [N] [BACKS]. Pilot 1 was probed with the tasks of before this commit (the asked
fact always the first); run now, it draws the new problems."""

import sys

import torch

from dsserve.models.checkpoint import load_checkpoint
from dsserve.models.loader import resolve_config
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.tokenizer import Tokenizer
from dsserve.train.heldout import near
from dsserve.train.tasks import problem, prompt_ids
from dsserve.train.warm_in import WarmIn

path = sys.argv[1]
cfg = resolve_config(path)
m = DeepseekForCausalLM(cfg)
load_checkpoint(m, cfg, path)
m.eval()
WarmIn(m, 1.0, 1.0).set(0.0)
tok = Tokenizer.from_dir(path)


def count(s):
    return len(tok.encode(s, add_bos=False))


@torch.no_grad()
def nats(ps, dense):
    tot, right = 0.0, 0
    for p in ps:
        a, b = prompt_ids(tok, p.prompt), tok.encode(p.completion, add_bos=False)
        h = m.forward(torch.tensor(a + b), dense_entries=dense).hidden
        lp = torch.log_softmax(m.logits(h[len(a) - 1 : len(a) - 1 + len(b)]).float(), -1)
        tot -= float(lp.gather(1, torch.tensor(b)[:, None]).sum())
        right += bool((lp.argmax(-1) == torch.tensor(b)).all())
    return round(tot / len(ps), 2), right


n = int(sys.argv[2]) if len(sys.argv) > 2 else 24
for back in [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "64").split(",")]:
    for drills in (0, 30):
        ps = [problem("retrieval", "eval", i, count, back, drills) for i in range(n)]
        for dense in (True, False):
            r = f"back {back} drills {drills} {'dense' if dense else 'top-k'}: asked {nats(ps, dense)}"
            if not drills:
                r += f" last {nats([near(p) for p in ps], dense)}"
            print(r, flush=True)
