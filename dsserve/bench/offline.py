"""``dsserve bench latency`` / ``dsserve bench throughput``: in-process timing with ``dsserve.LLM``.

latency: one batch of ``--batch-size`` random-token prompts of ``--input-len`` tokens generating exactly
``--output-len`` tokens each (``ignore_eos``), ``--num-iters`` timed runs after ``--num-iters-warmup``;
reports mean/median/p90 seconds per batch, with prefix caching off (the iterations repeat the prompts).
throughput: ``--num-prompts`` such prompts submitted at once; reports requests/s, total and output tokens/s.
Both print a table, then one JSON line last.
"""

from __future__ import annotations

import json
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from ..engine.args import EngineArgs
from ..engine.llm import LLM
from ..engine.sampling_params import SamplingParams


def _llm_and_prompts(ns, n: int, **overrides):
    llm = LLM(**dict(vars(EngineArgs.from_cli(ns)), **overrides))
    vocab = llm.engine.cfg.vocab_size
    rng = np.random.default_rng(ns.seed or 0)
    prompts = [rng.integers(3, vocab, ns.input_len).tolist() for _ in range(n)]
    return llm, prompts, SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=0.0)


def _spec_counts(llm) -> dict:
    st = llm.engine.stats
    return {
        "num_drafts": st.spec_num_drafts,
        "num_draft_tokens": st.spec_num_draft_tokens,
        "num_accepted_tokens": st.spec_num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(st.spec_accepted_per_pos),
    }


def _spec_decode(llm, before: dict) -> dict:
    """vLLM's speculative decoding counts since ``before`` (``_spec_counts``), with the mean acceptance length;
    empty when drafts are off."""
    spec = llm.engine.args.speculative_config
    if spec is None:
        return {}
    now = _spec_counts(llm)
    d = {k: now[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    old = before["num_accepted_tokens_per_pos"]
    d["num_accepted_tokens_per_pos"] = [
        v - (old[i] if i < len(old) else 0) for i, v in enumerate(now["num_accepted_tokens_per_pos"])
    ]
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    return {"spec_decode": {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens, **d}}


def _spec_rows(res: dict) -> dict:
    spec = res.get("spec_decode")
    if not spec:
        return {}
    return {
        "spec_decode_drafts": spec["num_drafts"],
        "spec_decode_accepted_tokens": spec["num_accepted_tokens"],
        "spec_decode_mean_acceptance_length": spec["mean_acceptance_length"],
    }


def _table(title: str, rows: dict) -> None:
    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in rows.items():
        t.add_row(k, f"{v:,.4f}" if isinstance(v, float) else str(v))
    Console(width=120).print(t)


def run_bench_latency(ns) -> int:
    # every iteration runs the same prompts: with prefix caching on, later ones would time cache hits
    llm, prompts, sp = _llm_and_prompts(ns, ns.batch_size, enable_prefix_caching=False)
    for _ in range(ns.num_iters_warmup):
        llm.generate(prompts, sp, use_tqdm=False)
    times, before = [], _spec_counts(llm)
    for _ in range(ns.num_iters):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "bench": "latency",
        "model": ns.model,
        "batch_size": ns.batch_size,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "num_iters": ns.num_iters,
        "avg_latency_s": float(np.mean(times)),
        "p50_latency_s": float(np.percentile(times, 50)),
        "p90_latency_s": float(np.percentile(times, 90)),
        "output_tokens": n_out,
        "prefix_caching": llm.engine.args.enable_prefix_caching,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),  # 0: prefix caching is off
        "output_tokens_per_s": n_out / float(np.mean(times)),
        "total_tokens_per_s": (n_out + ns.batch_size * ns.input_len) / float(np.mean(times)),
        **_spec_decode(llm, before),
    }
    _table(
        f"bench latency: {ns.model}, batch {ns.batch_size}, in {ns.input_len}, out {ns.output_len}",
        {k: v for k, v in res.items() if k not in ("bench", "spec_decode")} | _spec_rows(res),
    )
    print(json.dumps(res))
    return 0


def run_bench_throughput(ns) -> int:
    llm, prompts, sp = _llm_and_prompts(ns, ns.num_prompts)
    before = _spec_counts(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    res = {
        "bench": "throughput",
        "model": ns.model,
        "num_prompts": ns.num_prompts,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "elapsed_s": dt,
        "requests_per_s": len(outs) / dt,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "tokens_per_s": (n_in + n_out) / dt,
        "output_tokens_per_s": n_out / dt,
        **_spec_decode(llm, before),
    }
    _table(
        f"bench throughput: {ns.model}, {ns.num_prompts} prompts, in {ns.input_len}, out {ns.output_len}",
        {k: v for k, v in res.items() if k not in ("bench", "spec_decode")} | _spec_rows(res),
    )
    print(json.dumps(res))
    return 0


def add_bench_latency_args(p) -> None:
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    EngineArgs.add_cli_args(p)


def add_bench_throughput_args(p) -> None:
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    EngineArgs.add_cli_args(p)
