"""DSpark speculative decoding under tensor parallel on the CPU: one engine and TP2 (this process rank 0, one worker),
drafts off and on, on the same greedy batch of the built-in trained model: output tokens/s, steps, acceptance, and
the control messages rank 0 sends (step messages and, with drafts, the DraftPass and the Settle after each step:
count, bytes, and the seconds spent building, pickling and writing them).

    python benchmarks/tp_spec_cpu.py [--batch 4] [--new-tokens 32] [--k 3]

Prints one JSON line per case. Checks the four cases' tokens are equal. About a minute on an idle 2-core host (the
TP2 cases' two ranks share its cores, so TP2 is not faster here: this measures the overhead, not a speed-up).
"""

import argparse
import json
import time

import torch

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams

PROMPTS = ["12+7=", "Q: 3*4 A:", "abcabcabc", "Hello, how", "9-5=", "x y x y x", "7*8=", "Q: 2+2 A:"]


def case(tp: int, k: int | None, batch: int, new_tokens: int) -> tuple[dict, dict]:
    spec = None if k is None else {"method": "dspark", "num_speculative_tokens": k}
    args = EngineArgs(
        model="tiny-trained", device="cpu", dtype="float32", tensor_parallel_size=tp, speculative_config=spec, seed=0
    )
    core = EngineCore(args)
    posted = {}  # message kind -> seconds of each (build, pickle, write)
    if tp > 1:
        post = core.executor._post

        def timed(msg, t0):
            post(msg, t0)
            posted.setdefault(type(msg).__name__, []).append(time.perf_counter() - t0)

        core.executor._post = timed
    try:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for i in range(batch):
            core.add_request(f"r{i}", core.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params)
        t0, steps, done = time.perf_counter(), 0, {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
        wall = time.perf_counter() - t0
        s, row = core.stats, {"tp": tp, "k": k, "batch": batch, "steps": steps, "wall_s": round(wall, 3)}
        row["output_tok_s"] = round(batch * new_tokens / wall, 1)
        if s.spec_num_drafts:
            row["mean_acceptance_length"] = round(1 + s.spec_num_accepted_tokens / s.spec_num_drafts, 3)
        m = getattr(core.executor, "stats", None)
        if m is not None:
            row.update(messages=m.messages, message_bytes=m.bytes, max_message_bytes=m.max_bytes)
            for kind, secs in posted.items():
                row[f"{kind}_us_median"] = round(1e6 * sorted(secs)[len(secs) // 2], 1)
        return row, done
    finally:
        core.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    want = None
    for tp, k in ((1, None), (1, a.k), (2, None), (2, a.k)):
        row, tokens = case(tp, k, a.batch, a.new_tokens)
        want = tokens if want is None else want
        row["tokens_equal"] = tokens == want
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
