"""Greedy tokens' logprobs of a bf16 engine against an fp32 oracle on the same weights (the reference forward)."""

import copy

import torch

from dsserve import SamplingParams

# ragged prompts longer than the tiny models' window: ring, compressor and indexer all run
PROMPTS = [[5 + (i * 37 + j * 11) % 900 for j in range(150 + 20 * i)] for i in range(3)]


def logprob_errors(llm, device: str, prompts=PROMPTS, max_tokens: int = 4) -> list[float]:
    """|logprob - oracle logprob| for the top-5 candidates of every generated token, sorted."""
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, ignore_eos=True), use_tqdm=False
    )
    oracle = copy.deepcopy(llm.engine.model).float()
    oracle.kernel_ops = None
    errs = []
    with torch.no_grad():
        for p, out in zip(prompts, outs):
            o = out.outputs[0]
            toks = torch.tensor(p + o.token_ids[:-1], device=device)
            ref = torch.log_softmax(oracle.reference_logits(toks)[len(p) - 1 :].float(), -1)
            errs += [abs(lp.logprob - float(ref[s, t])) for s, d in enumerate(o.logprobs) for t, lp in d.items()]
    return sorted(errs)
