"""DSpark speculative decoding on the built-in model, on the CPU: acceptance per task and per draft position, and output
tokens/s with drafts on against drafts off in the same run.

    python benchmarks/spec_decode_cpu.py --out benchmarks/results/spec-decode-cpu

The built-in model (``tiny-trained``, greedy) answers held-out problems of each synthetic task (``train.tasks``, the
eval split). Acceptance: every problem of a task with K drafts a step, one request at a time; per task the mean
acceptance length (1 + accepted drafts per verified block, vLLM's definition) and the acceptance rate at each draft
position (blocks whose first i + 1 drafts were all accepted, over blocks; the counts include the --repeats runs).
Throughput: B = 1 (the problems above, one after another) and B = 8 (eight more held-out arithmetic problems at
once), drafts off then on, output tokens over wall time (prefill included, as a user sees it) and decode alone (the
tokens after each request's first over the time after every request had its first); each case the fastest of
--repeats runs. Greedy tokens are checked equal with drafts on and off. Writes spec_decode.json (with run_meta
provenance) and spec_decode.png under --out.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.args import EngineArgs  # noqa: E402
from dsserve.engine.core import EngineCore  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.train.tasks import problem, prompt_ids, retrieval_distance  # noqa: E402


def engine(a, k: int | None, batch: int) -> EngineCore:
    spec = None if k is None else {"method": "dspark", "num_speculative_tokens": k}
    return EngineCore(
        EngineArgs(
            model=a.model,
            device="cpu",
            dtype=a.dtype,
            max_num_seqs=batch,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,  # every request pays its prefill: the two arms see the same work
            warmup=False,
            speculative_config=spec,
        )
    )


def generate(eng: EngineCore, prompts: list[list[int]], max_tokens: int, repeats: int = 1):
    """Greedy outputs, the wall seconds, and the decode seconds (from when every request had its first token): the
    fastest of ``repeats`` runs (the machine may be shared: the minimum is the run least disturbed)."""
    runs = [_generate(eng, prompts, max_tokens) for _ in range(repeats)]
    return runs[0][0], min(r[1] for r in runs), min(r[2] for r in runs)


def _generate(eng: EngineCore, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    out, started, t0, t_first = {}, set(), time.perf_counter(), None
    while eng.has_unfinished_requests():
        for o in eng.step():
            started.add(o.request_id)
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
        if t_first is None and len(started) == len(prompts):
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    return [out[str(i)] for i in range(len(prompts))], t1 - t0, t1 - (t_first or t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-trained")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=5, help="drafts a request a step (1..5)")
    ap.add_argument("--tasks", default="arithmetic,chat,retrieval")
    ap.add_argument("--problems", type=int, default=4, help="held-out problems per task")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--min-back", type=int, default=0, help="retrieval distance (0: the model's default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case; the fastest counts")
    ap.add_argument("--out", default="benchmarks/results/spec-decode-cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t_start = time.time()

    probe = engine(a, None, 1)
    tok, cfg = probe.tokenizer, probe.cfg
    min_back = a.min_back or retrieval_distance(cfg)
    count = lambda s: len(tok.encode(s))  # noqa: E731
    tasks = [t for t in a.tasks.split(",") if t]
    prompts = {
        t: [prompt_ids(tok, problem(t, "eval", i, count, min_back).prompt) for i in range(a.problems)] for t in tasks
    }
    del probe

    # B = 1: each problem alone, drafts off then on (acceptance per task from the drafts-on runs)
    on1, off1 = engine(a, a.k, 1), engine(a, None, 1)
    acceptance, same, arms = {}, True, {"off": [0, 0.0, 0, 0.0], "on": [0, 0.0, 0, 0.0]}
    for t in tasks:
        on1.reset_counts()
        got, ref = [], []
        for p in prompts[t]:
            for arm, eng, into in (("off", off1, ref), ("on", on1, got)):
                outs, secs, dec = generate(eng, [p], a.max_tokens, a.repeats)
                into.append(outs[0])
                for i, v in enumerate((len(outs[0]), secs, len(outs[0]) - 1, dec)):
                    arms[arm][i] += v
        same &= got == ref
        st = on1.stats
        acceptance[t] = {
            "blocks": st.spec_num_drafts,
            "draft_tokens": st.spec_num_draft_tokens,
            "accepted_tokens": st.spec_num_accepted_tokens,
            "mean_acceptance_length": st.spec_mean_acceptance_length,
            "mean_accepted_drafts": st.spec_mean_acceptance_length - 1 if st.spec_num_drafts else 0.0,
            "acceptance_per_position": [n / st.spec_num_drafts for n in st.spec_accepted_per_pos]
            if st.spec_num_drafts
            else [],
            "prompt_tokens": [len(p) for p in prompts[t]],
            "output_tokens": [len(g) for g in got],
        }
        print(f"{t}: mean acceptance length {st.spec_mean_acceptance_length:.2f} over {st.spec_num_drafts} blocks")
    throughput = {"B1": {arm: _rate(*v) for arm, v in arms.items()}}
    # B = 8: held-out arithmetic problems, all at once, drafts off then on
    batch = [prompt_ids(tok, problem("arithmetic", "eval", 100 + i, count, min_back).prompt) for i in range(8)]
    row, toks = {}, {}
    for arm, k in (("off", None), ("on", a.k)):
        eng = engine(a, k, 8)
        outs, secs, dec = generate(eng, batch, a.max_tokens, a.repeats)
        n = sum(len(o) for o in outs)
        row[arm], toks[arm] = _rate(n, secs, n - len(outs), dec), outs
        if k:
            row[arm]["mean_acceptance_length"] = eng.stats.spec_mean_acceptance_length
    same &= toks["on"] == toks["off"]
    throughput["B8"] = row
    for name, row in throughput.items():
        row["speedup"] = row["on"]["output_tok_per_s"] / row["off"]["output_tok_per_s"]
        row["decode_speedup"] = row["on"]["decode_tok_per_s"] / row["off"]["decode_tok_per_s"]
        print(
            f"{name}: drafts off {row['off']['output_tok_per_s']:.2f} tok/s, on {row['on']['output_tok_per_s']:.2f}"
            f" tok/s ({row['speedup']:.2f}x); decode alone {row['off']['decode_tok_per_s']:.2f} vs "
            f"{row['on']['decode_tok_per_s']:.2f} ({row['decode_speedup']:.2f}x)"
        )

    has_draft = any(k.startswith("mtp.") for k in _checkpoint_keys(a.model))
    result = {
        "meta": run_meta(model=a.model, dtype=a.dtype, threads=a.threads, repeats=a.repeats),
        "k": a.k,
        "max_tokens": a.max_tokens,
        "problems_per_task": a.problems,
        "retrieval_min_back": min_back,
        "draft_weights": "from the checkpoint" if has_draft else "none in the checkpoint (random init)",
        "greedy_tokens_equal_drafts_off": same,
        "acceptance": acceptance,
        "throughput": throughput,
        "seconds": time.time() - t_start,
    }
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "spec_decode.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(a.out, "spec_decode.png"))
    print("tokens equal with drafts on and off:", same)
    print(path)


def _rate(tokens: int, seconds: float, decode_tokens: int, decode_seconds: float) -> dict:
    """Output tokens over wall time (prefill included), and the tokens after each request's first over the time
    after every request had its first (decode alone)."""
    return {
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tok_per_s": tokens / seconds,
        "decode_tokens": decode_tokens,
        "decode_seconds": decode_seconds,
        "decode_tok_per_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
    }


def _checkpoint_keys(model: str) -> list[str]:
    from safetensors import safe_open

    from dsserve.models.presets import model_dir

    path = os.path.join(model_dir(model), "model.safetensors")
    if not os.path.exists(path):
        return []
    with safe_open(path, "pt") as f:
        return list(f.keys())


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    k = result["k"]
    for t, acc in result["acceptance"].items():
        rates = acc["acceptance_per_position"] + [0.0] * (k - len(acc["acceptance_per_position"]))
        left.plot(range(1, k + 1), rates, marker="o", label=f"{t} (mean length {acc['mean_acceptance_length']:.2f})")
    left.set(xlabel="draft position", ylabel="blocks accepted through it", ylim=(0, 1), title="DSpark acceptance")
    left.legend(fontsize=8)
    names = list(result["throughput"])
    off = [result["throughput"][b]["off"]["decode_tok_per_s"] for b in names]
    on = [result["throughput"][b]["on"]["decode_tok_per_s"] for b in names]
    x = range(len(names))
    right.bar([i - 0.2 for i in x], off, 0.4, label="drafts off")
    right.bar([i + 0.2 for i in x], on, 0.4, label=f"drafts on (K={k})")
    right.set_xticks(list(x), [b.replace("B", "B = ") for b in names])
    right.set(
        ylabel="decode tokens/s (after the first token)",
        title=f"{result['meta']['model']} on {result['meta']['device']}",
    )
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
