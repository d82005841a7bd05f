"""Warming the engine up before it serves: synthetic requests through the shapes the first traffic takes, so that
Triton compiles its kernels and the CUDA graphs of those shapes are captured before any user waits for them.

Some kernels take sizes that grow with the context as constexprs (the top-k's BLOCK: the entry count's next power of
two), so longer contexts compile kernels of their own. The rounds:
- a context ladder: one cold prompt reaching the last decode context bucket that fits ``max_model_len`` and the
  cache (at least a whole chunk: the eager prefill's large-row kernels), then one prefix hit on it ending in each
  bucket, from the last one down, each decoding a few tokens alone. With the runners' ``ahead_rows`` on, this
  captures the decode graphs (b, c) of every batch bucket b at every context c, and with bounded replay the row
  graphs at every context: the decoder rows' every row bucket, the encoder rows' from the hit's rows up. Largest
  shapes first, so that later captures reuse their freed scratch;
- per decode batch bucket b up to ``max_num_seqs``: b short prompts at once, then b prefix hits on them (the
  prompts and a few new tokens), each decoding a few tokens: bounded replay's decoder- and encoder-row graphs of b
  hits (the replayed window plus the new rows), and b-row eager kernels;
- a row ladder: prefill steps alone, each of a row count from ``prefill_rows``: every row bucket of the row graphs,
  one less than every power of two up to a whole chunk, the chunk, and one row count per launch variant of the
  attention, the router and the MoE's expert-run kernel (``attention_split_rows``, ``router_split_rows``,
  ``moe_run_rows``: constexprs that follow from the row count). They are prefix hits on a short prompt whose new
  tokens (plus the replayed window, with bounded replay) make that many rows, or cold prompts where the window alone
  is more. Prefill kernels take the next power of two of the row count as a constexpr, and Triton compiles an
  integer argument apart when it is a multiple of 16 (or 1): eager steps of traffic mostly have other row counts.
Encoder-row graphs of fewer rows than a hit's are not built here: they capture on first use.

Its requests carry a cache salt of their own, so no user prompt hits their blocks (freed first, they are also
evicted first). Afterwards the engine's counters start from zero again; the graphs stay captured, and
``dsserve:graph_captures_total`` counts them. docs/engine_history.md has the measurements behind each round.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

import torch

from ..kernels import router
from ..kernels.grouped_moe import expert_run_rows
from ..kernels.sparse_attention import split_rows
from . import jit_compiles
from .decode_graphs import context_bucket
from .decoder_row_graphs import ROW_BUCKETS
from .sampling_params import SamplingParams
from .step_graphs import bucket_sizes

log = logging.getLogger("dsserve")


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    steps: int
    seconds: float
    prefix_hit_tokens: int  # prompt tokens of its hits found in the cache (bounded replay's path ran)
    graph_captures: int  # graphs captured during the warm-up
    nonfinite_logit_rows: int = 0  # sampled rows with NaN or inf logits during the warm-up (a fault)
    round_seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the context ladder, the batch buckets, the rows
    capture_seconds: float = 0.0  # of ``seconds``, the graphs' captures (their warm-up runs and compiles included)
    triton_compiles: int = 0  # Triton compiles during the warm-up
    triton_compile_seconds: float = 0.0  # their share of ``seconds`` (some inside the captures)
    triton_cache_loads: int = 0  # kernels loaded from Triton's disk cache instead (engine.jit_compiles)


def wanted(setting: bool | None, device: torch.device) -> bool:
    """``--warmup``: True or False as given; None (``dsserve serve``'s default) on a GPU only."""
    return setting if setting is not None else device.type == "cuda"


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch buckets a step of up to ``max_num_seqs`` rows can fall in (the last one is the maximum)."""
    return bucket_sizes(max_num_seqs)


def context_ladder(max_len: int, min_context: int) -> list[int]:
    """Every decode context bucket up to ``max_len`` positions."""
    out, c = [], context_bucket(1, min_context)
    while c <= max_len:
        out.append(c)
        c = context_bucket(c + 1, min_context)
    return out


def prefill_rows(max_rows: int, graph_rows: int, extra: tuple[int, ...] = ()) -> list[int]:
    """Row counts for the row ladder: the row graphs' buckets up to ``graph_rows`` (0: no row graphs), 2^k - 1
    for every power of two up to ``max_rows`` (a whole chunk), ``max_rows`` itself, and the ``extra`` ones up to
    it."""
    out = {r for r in ROW_BUCKETS if r <= min(graph_rows, max_rows)} | {max_rows} | {r for r in extra if r <= max_rows}
    p = 2
    while p <= max_rows:
        out.add(p - 1)
        p *= 2
    return sorted(out - {0})


def attention_split_rows(cfg) -> tuple[int, ...]:
    """A row count per split-K variant of the attention kernel, for layers with selected entries and window-only ones
    (kernels.sparse_attention.split_rows)."""
    return tuple(
        sorted(
            {
                r
                for k in (cfg.index_topk, 0)
                for r in split_rows(cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, k)
            }
        )
    )


def router_split_rows(cfg, sms: int, max_rows: int) -> tuple[int, ...]:
    """A row count per launch variant of the router up to ``max_rows`` (kernels.router.split_rows): past 64 rows its
    split of d over the SMs changes with the 64-row tile count."""
    return tuple(router.split_rows(cfg.n_routed_experts, cfg.hidden_size, sms, max_rows))


def moe_run_rows(cfg) -> tuple[int, ...]:
    """A row count per launch variant of the MoE's expert-run kernel (kernels.grouped_moe.expert_run_rows)."""
    return tuple(
        expert_run_rows(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size)
    )


def ahead(decode_graphs, row_graphs: list, on: bool) -> None:
    """The context ladder's steps also build other buckets at their context (every fixed-shape runner's
    ``ahead_rows``): every larger decode batch bucket, and the row graphs' other row buckets."""
    if decode_graphs is not None:
        decode_graphs.ahead_rows = on
    for g in row_graphs:
        g.ahead_rows = on


def warm_up(core, new_tokens: int = 3, seed: int = 0) -> WarmupReport:
    """Runs the rounds above through ``core`` (an idle EngineCore) to completion, then zeroes its counters."""
    if core.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine")
    t0, steps = time.perf_counter(), 0
    captured, capture_s = core.stats.graph_captures, core.stats.graph_capture_seconds
    compiled, compile_s, loaded = jit_compiles.COMPILES.snapshot()
    gen = torch.Generator().manual_seed(seed)
    salt = "dsserve-warmup-" + secrets.token_hex(8)
    cfg, sched = core.cfg, core.scheduler.config
    block = core.kv.layout.block_size
    cap = min(core.max_model_len, core.kv.blocks.num_blocks * block)  # positions a request may reach
    room = cap - new_tokens - 8  # a hit adds 8 tokens, then decodes new_tokens
    # a short prompt: whole blocks past the replay window, so that a hit replays a full window
    short = min(room, (sched.replay_window // block + 2) * block)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = iter(range(1 << 30))

    vocab = min(cfg.vocab_size, core.tokenizer.vocab_size)  # ids the tokenizer knows (the model may pad past it)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def run(prompts: list[list[int]]) -> None:
        nonlocal steps
        for p in prompts:
            core.add_request(f"warmup-{next(ids)}", p, params, cache_salt=salt)
        while core.has_unfinished_requests():
            core.step()
            steps += 1

    if short < 1:
        log.warning("warm-up skipped: max_model_len %d leaves no room for a prompt", core.max_model_len)
        return WarmupReport(0, 0, 0.0, 0, 0)
    graphs = core.runner.decode_graphs
    row_graphs = [g for g in (core.runner.decoder_row_graphs, core.runner.encoder_graphs) if g is not None]
    # prompt lengths whose decode steps stay in each bucket c (positions up to c)
    ladder = [c - new_tokens for c in context_ladder(cap, graphs.min_context if graphs else 1024)]
    longest = prompt(max(ladder[-1:] + [min(sched.max_num_batched_tokens, room)]))
    # with drafts on, a ladder request's verify steps build every larger verify row bucket at its context
    verify = [core.runner.verify_graphs] if core.runner.verify_graphs is not None else []
    ahead(graphs, row_graphs + verify, True)
    try:
        run([longest])
        # the first one a hit in the cold prompt's bucket (its encoder rows fit a row graph); largest first, as in
        # each step (the smaller contexts' captures reuse the larger ones' freed scratch)
        for n_tokens in reversed(ladder):
            run([longest[:n_tokens]])  # alone: together they would decode in the largest bucket only
    finally:
        ahead(graphs, row_graphs + verify, False)
    n = len(ladder) + 1
    t1 = time.perf_counter()
    for b in batch_sizes(sched.max_num_seqs):
        firsts = [prompt(short) for _ in range(b)]
        run(firsts)
        run([p + prompt(8) for p in firsts])
        n += 2 * b
    t2 = time.perf_counter()
    # the row ladder; with bounded replay a hit's rows are the replayed window plus its new tokens
    window = sched.replay_window if sched.swa_bounded_replay else 0
    base = prompt(short)
    run([base])
    n += 1
    max_rows = min(sched.max_num_batched_tokens, room)
    variant_rows = (
        attention_split_rows(cfg) + router_split_rows(cfg, router.sm_count(core.device), max_rows) + moe_run_rows(cfg)
    )
    for rows in prefill_rows(max_rows, max([g.max_rows for g in row_graphs] + [0]), variant_rows):
        new = rows - window
        if new < 1 and rows <= room:
            run([prompt(rows)])
        elif 1 <= new and short + new <= room:
            run([base + prompt(new)])
        else:
            continue
        n += 1
    hits, bad = core.stats.prefix_hit_tokens, core.stats.nonfinite_logit_rows
    core.reset_counts()
    t3 = time.perf_counter()
    report = WarmupReport(
        n,
        steps,
        t3 - t0,
        hits,
        core.stats.graph_captures - captured,
        bad,
        (t1 - t0, t2 - t1, t3 - t2),
        core.stats.graph_capture_seconds - capture_s,
        jit_compiles.COMPILES.count - compiled,
        jit_compiles.COMPILES.seconds - compile_s,
        jit_compiles.COMPILES.loads - loaded,
    )
    log.info(
        "warm-up: %d requests in %d steps, %.1f s (context ladder %.1f, batch buckets %.1f, row ladder %.1f), "
        "%d CUDA graphs captured in %.1f s of it, %d Triton compiles in %.1f s, %d kernels loaded from Triton's "
        "cache",
        report.requests,
        report.steps,
        report.seconds,
        *report.round_seconds,
        report.graph_captures,
        report.capture_seconds,
        report.triton_compiles,
        report.triton_compile_seconds,
        report.triton_cache_loads,
    )
    if bad:  # zeroed with the other counts, so said here
        log.warning("warm-up: non-finite logits in %d sampled rows", bad)
    return report
