"""Greedy accuracy of a checkpoint at warm-in level r (default 0) by full recompute (the reference forward, no cache),
dense entries or the indexers' top-k: python probe_gen.py CHECKPOINT N BACK [r]. Prints per task correct / n."""

import sys

import torch

from dsserve.layers.context import SeqRows
from dsserve.models.checkpoint import load_checkpoint
from dsserve.models.loader import resolve_config
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.tokenizer import Tokenizer
from dsserve.train.tasks import final_answer, problem, prompt_ids
from dsserve.train.warm_in import WarmIn

path, n, back = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
cfg = resolve_config(path)
m = DeepseekForCausalLM(cfg)
load_checkpoint(m, cfg, path)
m.eval()
WarmIn(m, 0.0, 1.0).set(r)  # a ramp over [0, 1]: the level is r itself
tok = Tokenizer.from_dir(path)
count = lambda s: len(tok.encode(s, add_bos=False))
MAX = {"arithmetic": 64, "retrieval": 8}


@torch.no_grad()
def greedy(prompts, steps, dense):
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        tokens, rows, at = [], [], 0
        for s in seqs:
            rows.append(SeqRows(slice(at, at + len(s)), m.new_cache()))
            tokens += s
            at += len(s)
        h = m.forward_batch(torch.tensor(tokens), rows, dense_entries=dense).hidden
        last = torch.tensor([x.rows.stop - 1 for x in rows])
        nxt = m.logits(h[last]).argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
    return [tok.decode(s[len(p) :]) for s, p in zip(seqs, prompts)]


for task in ("retrieval", "arithmetic"):
    ps = [problem(task, "eval", i, count, back) for i in range(n)]
    for dense in (True, False):
        texts = greedy([prompt_ids(tok, p.prompt) for p in ps], MAX[task], dense)
        right = sum(final_answer(t) == p.answer for t, p in zip(texts, ps))
        print(f"{task} back {back} r {r} {'dense' if dense else 'top-k'}: {right}/{n}  e.g. {texts[0]!r}", flush=True)
