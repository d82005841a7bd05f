"""DSpark speculative decoding on the built-in model, on the CPU: acceptance per task and per draft position, output
tokens/s with drafts off, on (K drafts) and adaptive (K, the confidence head may stop a block early) in the same run,
and where a drafting step's time goes.

    python benchmarks/spec_decode_cpu.py --out benchmarks/results/spec-decode-cpu

The built-in model (``tiny-trained``, greedy) answers held-out problems of each synthetic task (``train.tasks``, the
eval split). Throughput: B = 1 (every problem alone, one after another) and B = 8 (eight more held-out arithmetic
problems at once). The arms alternate: each repeat runs, problem by problem, every arm in an order that rotates with the
repeat, so a busy spell of a shared machine lands on all arms alike; a case's rate is over the median of its repeats'
times, and its speedup the median of the per-repeat ratios (each repeat's arms ran side by side). Rates: output tokens
over wall time (prefill included, as a user sees it) and decode alone (the tokens after each request's first over the
time after every request had its first). Acceptance (from the drafting arms' runs, every repeat counted): per task the
mean acceptance length (1 + accepted drafts per verified block, vLLM's definition), the drafts verified per block and
the acceptance rate at each draft position (blocks whose first i + 1 drafts were all accepted, over blocks). Step
breakdown (a separate pass with timers, B = 1, drafts on): per step, the target forward (prefill and verify steps
apart), the proposal, ingestion and rollback, the rejection sampler, applying the tokens (detokenising, stops) and the
rest. Greedy tokens are checked equal across arms. Writes spec_decode.json (with run_meta provenance) and
spec_decode.png under --out.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.args import EngineArgs  # noqa: E402
from dsserve.engine.core import EngineCore  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.train.tasks import problem, prompt_ids, retrieval_distance  # noqa: E402

ARMS = ("off", "on", "adaptive")


def engine(a, arm: str, batch: int) -> EngineCore:
    spec = None
    if arm != "off":
        spec = {"method": "dspark", "num_speculative_tokens": a.k}
        spec["confidence_threshold"] = a.threshold if arm == "adaptive" else 0.0
    return EngineCore(
        EngineArgs(
            model=a.model,
            device="cpu",
            dtype=a.dtype,
            max_num_seqs=batch,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,  # every request pays its prefill: the arms see the same work
            warmup=False,
            speculative_config=spec,
        )
    )


def generate(eng: EngineCore, prompts: list[list[int]], max_tokens: int):
    """Greedy outputs, the wall seconds, and the decode seconds (from when every request had its first token)."""
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


def spec_counts(eng: EngineCore) -> list:
    st = eng.stats
    return [st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens, list(st.spec_accepted_per_pos)]


def acceptance_of(counts: list, k: int) -> dict:
    blocks, drafted, accepted, per_pos = counts
    per_pos = per_pos + [0] * (k - len(per_pos))
    return {
        "blocks": blocks,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "mean_drafts_per_block": drafted / blocks if blocks else 0.0,
        "mean_acceptance_length": 1 + accepted / blocks if blocks else 0.0,
        "mean_accepted_drafts": accepted / blocks if blocks else 0.0,
        "acceptance_per_position": [n / blocks for n in per_pos] if blocks else [],
    }


def add_counts(into: list, before: list, after: list) -> None:
    for i in range(3):
        into[i] += after[i] - before[i]
    for i, n in enumerate(after[3]):
        if i >= len(into[3]):
            into[3].append(0)
        into[3][i] += n - (before[3][i] if i < len(before[3]) else 0)


def interleaved(engines: dict, cases: list[list[list[int]]], a, counts: dict | None = None):
    """Every repeat runs each case (a list of prompts run together) on every arm, the arms' order rotating with the
    repeat. Returns per arm per repeat [tokens, seconds, decode tokens, decode seconds] summed over the cases, and
    per arm the greedy outputs of the first repeat. ``counts``: case index -> arm -> acceptance counts, added to."""
    arms = list(engines)
    runs = {arm: [] for arm in arms}
    outs = {arm: [] for arm in arms}
    for rep in range(a.repeats):
        order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
        tot = {arm: [0, 0.0, 0, 0.0] for arm in arms}
        for ci, prompts in enumerate(cases):
            for arm in order:
                eng = engines[arm]
                before = spec_counts(eng)
                got, secs, dec = generate(eng, prompts, a.max_tokens)
                if counts is not None and arm != "off":
                    add_counts(counts.setdefault(ci, {}).setdefault(arm, [0, 0, 0, []]), before, spec_counts(eng))
                n = sum(len(o) for o in got)
                for i, v in enumerate((n, secs, n - len(got), dec)):
                    tot[arm][i] += v
                if rep == 0:
                    outs[arm].append(got)
        for arm in arms:
            runs[arm].append(tot[arm])
    return runs, outs


def summary(runs: dict) -> dict:
    """Per arm the rates over its median repeat times, and per drafting arm the median of the per-repeat ratios to
    drafts off (output and decode alone), with every repeat's ratio."""
    row = {}
    for arm, reps in runs.items():
        toks, dtoks = reps[0][0], reps[0][2]
        row[arm] = _rate(toks, statistics.median(r[1] for r in reps), dtoks, statistics.median(r[3] for r in reps))
        row[arm]["repeat_seconds"] = [r[1] for r in reps]
    for arm in runs:
        if arm == "off":
            continue
        ratios = [o[1] / r[1] for o, r in zip(runs["off"], runs[arm])]
        dratios = [o[3] / r[3] for o, r in zip(runs["off"], runs[arm])]
        row[arm]["speedup"], row[arm]["decode_speedup"] = statistics.median(ratios), statistics.median(dratios)
        row[arm]["speedup_per_repeat"], row[arm]["decode_speedup_per_repeat"] = ratios, dratios
    return row


def breakdown(eng: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict:
    """Where an engine's steps spend their time (milliseconds per step, over one pass of ``prompts`` one at a time):
    timers around the step's parts, the forward split into prefill steps and the others (verify or plain decode)."""
    spent, calls, restore = defaultdict(float), defaultdict(int), []

    def timed(obj, name, key):
        f = getattr(obj, name)

        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                k = key(*args) if callable(key) else key
                spent[k] += time.perf_counter() - t
                calls[k] += 1

        setattr(obj, name, wrapper)
        restore.append((obj, name))

    def forward(plan):
        return "forward, prefill steps" if any(c.num_tokens - c.num_drafts > 2 for c in plan.chunks) else "forward"

    timed(eng.executor, "execute", forward)
    if eng.drafter is not None:
        timed(eng.drafter, "propose", "proposal (Drafter.propose)")
        timed(eng.drafter, "ingest", "ingestion (Drafter.ingest)")
        timed(eng.drafter, "settle", "rollback (Drafter.settle)")
        timed(eng.drafter, "before", "save_rows (Drafter.before)")
        timed(eng.rejection_sampler, "decide", "rejection sampler")
        timed(eng, "_commit", "apply tokens (detokenise, stops, metrics)")
    timed(eng, "step", "step")
    try:
        for p in prompts:
            generate(eng, [p], max_tokens)
    finally:
        for obj, name in restore:
            delattr(obj, name)
    steps = calls["step"]
    out = {
        k: {"ms_per_step": 1000 * v / steps, "ms_per_call": 1000 * v / calls[k], "calls": calls[k]}
        for k, v in spent.items()
    }
    rest = spent["step"] - sum(v for k, v in spent.items() if k != "step")
    out["rest of the step"] = {"ms_per_step": 1000 * rest / steps, "calls": steps}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-trained")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=5, help="drafts a request a step (1..5)")
    ap.add_argument("--threshold", type=float, default=0.5, help="the adaptive arm's confidence_threshold")
    ap.add_argument("--tasks", default="arithmetic,chat,retrieval")
    ap.add_argument("--problems", type=int, default=2, help="held-out problems per task")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-back", type=int, default=0, help="retrieval distance (0: the model's default)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 is steadier on a shared machine)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per case; medians count")
    ap.add_argument("--out", default="benchmarks/results/spec-decode-cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t_start = time.time()

    engines1 = {arm: engine(a, arm, 1) for arm in ARMS}
    tok, cfg = engines1["off"].tokenizer, engines1["off"].cfg
    min_back = a.min_back or retrieval_distance(cfg)
    count = lambda s: len(tok.encode(s))  # noqa: E731
    tasks = [t for t in a.tasks.split(",") if t]
    prompts = {
        t: [prompt_ids(tok, problem(t, "eval", i, count, min_back).prompt) for i in range(a.problems)] for t in tasks
    }
    cases = [[p] for t in tasks for p in prompts[t]]
    for eng in engines1.values():  # first-call costs (allocations, lazy tables) stay out of the timed runs
        generate(eng, cases[0], 4)

    # B = 1: each problem alone, the arms interleaved
    counts: dict = {}
    runs1, outs1 = interleaved(engines1, cases, a, counts)
    same = all(outs1[arm] == outs1["off"] for arm in ARMS)
    acceptance = {}
    for ti, t in enumerate(tasks):
        acceptance[t] = {}
        for arm in ("on", "adaptive"):
            total = [0, 0, 0, []]
            for ci in range(ti * a.problems, (ti + 1) * a.problems):
                c = counts[ci][arm]
                add_counts(total, [0, 0, 0, []], c)
            acceptance[t][arm] = acceptance_of(total, a.k)
        acceptance[t]["prompt_tokens"] = [len(p) for p in prompts[t]]
        acceptance[t]["output_tokens"] = [len(o[0]) for o in outs1["off"][ti * a.problems : (ti + 1) * a.problems]]
        print(
            f"{t}: mean acceptance length {acceptance[t]['on']['mean_acceptance_length']:.2f} (K = {a.k}), "
            f"{acceptance[t]['adaptive']['mean_acceptance_length']:.2f} adaptive "
            f"({acceptance[t]['adaptive']['mean_drafts_per_block']:.2f} drafts a block)"
        )
    throughput = {"B1": summary(runs1)}
    for arm in ("on", "adaptive"):
        total = [0, 0, 0, []]
        for ci in counts:
            add_counts(total, [0, 0, 0, []], counts[ci][arm])
        throughput["B1"][arm]["acceptance"] = acceptance_of(total, a.k)
    step_breakdown = {arm: breakdown(engines1[arm], [c[0] for c in cases], a.max_tokens) for arm in ARMS}
    del engines1

    # B = 8: held-out arithmetic problems, all at once, the arms interleaved
    batch = [prompt_ids(tok, problem("arithmetic", "eval", 100 + i, count, min_back).prompt) for i in range(8)]
    engines8 = {arm: engine(a, arm, 8) for arm in ARMS}
    for eng in engines8.values():
        generate(eng, batch, 4)
    counts8: dict = {}
    runs8, outs8 = interleaved(engines8, [batch], a, counts8)
    same &= all(outs8[arm] == outs8["off"] for arm in ARMS)
    throughput["B8"] = summary(runs8)
    for arm in ("on", "adaptive"):
        throughput["B8"][arm]["acceptance"] = acceptance_of(counts8[0][arm], a.k)
    for name, row in throughput.items():
        for arm in ("on", "adaptive"):
            print(
                f"{name} {arm}: drafts off {row['off']['output_tok_per_s']:.2f} tok/s, {arm} "
                f"{row[arm]['output_tok_per_s']:.2f} tok/s (median ratio {row[arm]['speedup']:.2f}x); decode alone "
                f"{row['off']['decode_tok_per_s']:.2f} vs {row[arm]['decode_tok_per_s']:.2f} "
                f"({row[arm]['decode_speedup']:.2f}x); mean acceptance length "
                f"{row[arm]['acceptance']['mean_acceptance_length']:.2f}"
            )

    has_draft = any(k.startswith("mtp.") for k in _checkpoint_keys(a.model))
    result = {
        "meta": run_meta(model=a.model, dtype=a.dtype, threads=a.threads, repeats=a.repeats),
        "k": a.k,
        "confidence_threshold": a.threshold,
        "max_tokens": a.max_tokens,
        "problems_per_task": a.problems,
        "retrieval_min_back": min_back,
        "draft_weights": "from the checkpoint" if has_draft else "none in the checkpoint (random init)",
        "greedy_tokens_equal_drafts_off": same,
        "acceptance": acceptance,
        "throughput": throughput,
        "step_breakdown_ms_B1": step_breakdown,
        "seconds": time.time() - t_start,
    }
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "spec_decode.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(a.out, "spec_decode.png"))
    print("tokens equal across arms:", same)
    print(f"{result['seconds']:.0f} s; {path}")


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

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    k = result["k"]
    for t, acc in result["acceptance"].items():
        on = acc["on"]
        left.plot(
            range(1, k + 1),
            on["acceptance_per_position"],
            marker="o",
            label=f"{t} (mean length {on['mean_acceptance_length']:.2f})",
        )
    left.set(
        xlabel="draft position", ylabel="blocks accepted through it", ylim=(0, 1), title=f"DSpark acceptance, K = {k}"
    )
    left.legend(fontsize=8)
    names = list(result["throughput"])
    labels = {
        "off": "drafts off",
        "on": f"K = {k}",
        "adaptive": f"K = {k}, adaptive ({result['confidence_threshold']})",
    }
    for j, arm in enumerate(ARMS):
        rates = [result["throughput"][b][arm]["output_tok_per_s"] for b in names]
        bars = right.bar([i + (j - 1) * 0.27 for i in range(len(names))], rates, 0.27, label=labels[arm])
        if arm != "off":
            right.bar_label(bars, [f"{result['throughput'][b][arm]['speedup']:.2f}x" for b in names], fontsize=8)
    right.set_xticks(list(range(len(names))), [b.replace("B", "B = ") for b in names])
    right.set(
        ylabel="output tokens/s (prefill included)",
        title=f"{result['meta']['model']} on {result['meta']['device']}, medians of {result['meta']['repeats']} "
        "interleaved repeats",
    )
    right.title.set_fontsize(9)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
