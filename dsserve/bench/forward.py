"""``dsserve bench forward``: time the engine's real execute path on an exact batch.

A batch is B requests, each with C tokens already in the cache and N new rows (N = 1: a decode step;
N > 1: a prefill chunk on top of a cached prefix). The caches are filled with synthetic values, so no
prefill is needed to reach context C. Time is wall time, on a GPU from a synchronised start to a
synchronised end; the breakdown comes from hooks on the modules of each stage (host time: on a GPU it
shows where launches are issued, not where the device spends its time). With ``--tensor-parallel-size`` or
``--data-parallel-size`` above 1 every rank is spawned and runs the same batch, timed in lockstep
(``forward_parallel``). FLOP/s counts 2 x active parameters per row; bandwidth counts the active weights read once
per step plus the KV rows the step reads.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..engine.args import EngineArgs
from ..engine.core import EngineCore
from ..engine.request import Request
from ..engine.sampling_params import SamplingParams
from ..engine.scheduler import ScheduledChunk, StepOutput, StepPlan
from ..layers import attention_paged
from ..layers.attention import CSA2Attention
from ..models.accounting import param_counts


@dataclass
class ForwardResult:
    batch: int
    context: int
    new_tokens: int
    seconds: float  # median over the timed repeats
    stages: dict  # stage -> median seconds
    tokens_per_s: float
    tflops: float
    gbytes_per_s: float
    times: list = field(default_factory=list)  # seconds of each timed repeat, in order


class _Timer:
    """Accumulates wall time per stage through forward pre/post hooks (nested stages are fine)."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self._start: dict[int, float] = {}

    def hook(self, module, stage):
        def pre(_m, _a):
            self._start[id(_m)] = time.perf_counter()

        def post(_m, _a, _o):
            self.total[stage] = self.total.get(stage, 0.0) + time.perf_counter() - self._start.pop(id(_m))

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    @contextmanager
    def around(self, stage):
        t = time.perf_counter()
        yield
        self.total[stage] = self.total.get(stage, 0.0) + time.perf_counter() - t


_NOISE: dict = {}  # synthetic rows, drawn once per (context, device, widths) on the cache's device


def _fill(core: EngineCore, req: Request, context: int, new_tokens: int, gen: torch.Generator) -> None:
    """Give ``req`` a cache at ``context`` tokens with synthetic entries, as if its prefix had run. The rows are
    drawn once on the device and shared by every request (at B 128 x 128K a per-request CPU randn took about 1 s
    each); the values do not change the work. ``gen`` seeds the first draw."""
    cfg, kv = core.cfg, req.kv
    core.kv.grow(kv, context + new_tokens)
    key = (context, str(core.device), cfg.head_dim, cfg.index_head_dim)
    if _NOISE.get("key") != key:
        seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
        g = torch.Generator(device=core.device).manual_seed(seed)
        _NOISE.update(
            key=key,
            main=torch.randn(context, cfg.head_dim, generator=g, device=core.device),
            idx=torch.randn(context, cfg.index_head_dim, generator=g, device=core.device),
        )
    for src, (ratio, _) in core.kv.layout.sources.items():
        n = context // ratio
        kv.push_global(src, _NOISE["main"][:n], _NOISE["idx"][:n] if core.kv.index else None)
    w = min(cfg.sliding_window, context)
    pos = torch.arange(context - w, context, device=core.device)
    for layer in core.kv.layout.window_layers:
        kv.push_window(layer, _NOISE["main"][context - w : context], pos)
    kv.num_tokens = req.num_computed_tokens = context
    kv.host_table()  # a running request's host copy of its table is built as it grows, not in its next step


def release_noise() -> None:
    """Drop the synthetic rows (before freeing a model to build another)."""
    _NOISE.clear()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_forward(
    core: EngineCore,
    batch: int,
    context: int,
    new_tokens: int,
    repeats: int = 3,
    barrier: Callable[[], None] | None = None,
) -> ForwardResult:
    """``barrier``: called before each run's clock starts (ranks timed in lockstep: bench.forward_parallel)."""
    cfg, model = core.cfg, core.model
    gen = torch.Generator().manual_seed(0)
    timer = _Timer()
    hooks = []
    for block in model.layers:
        side = (
            "encoder"
            if block.role.side == "encoder"
            else ("boundary" if block.role.index == cfg.encoder_layers and cfg.is_v41 else "decoder")
        )
        hooks += timer.hook(block, side)
        hooks += timer.hook(block.attn, "attention")
        hooks += timer.hook(block.ffn, "moe")
    # the selection stage (indexer query, scores, top-k) of either attention path
    selects = (attention_paged._select, CSA2Attention._select)

    def timed(fn):
        def run(*a, **k):
            with timer.around("indexer"):
                return fn(*a, **k)

        return run

    attention_paged._select, CSA2Attention._select = (timed(f) for f in selects)
    runs, reqs = [], []
    decode = new_tokens == 1  # a running batch: the same requests decode one more token each repeat
    try:
        for rep in range(repeats + 1):  # the first run warms up (and captures the decode step's CUDA graph)
            if decode and reqs:
                for r in reqs:
                    r.output_token_ids.append(int(torch.randint(3, cfg.vocab_size - 2, (1,), generator=gen)))
            else:
                reqs = []
                for b in range(batch):
                    ids = torch.randint(3, cfg.vocab_size - 2, (context + new_tokens,), generator=gen).tolist()
                    r = Request(f"bench-{rep}-{b}", ids, SamplingParams(temperature=0, max_tokens=repeats + 1))
                    r.kv = core.kv.new_sequence()
                    _fill(core, r, context, new_tokens + (repeats if decode else 0), gen)
                    reqs.append(r)
            plan = StepPlan([ScheduledChunk(r, new_tokens) for r in reqs], [])
            timer.total.clear()
            _sync(core.device)
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            sampling, logits = core.executor.execute(plan)  # under TP: every rank runs it, rank 0 times it
            core.scheduler.update(plan, StepOutput())  # the rows are in the cache: the next repeat decodes on
            with timer.around("sampler"):
                core.sampler(logits.float(), sampling)
            _sync(core.device)  # the step ends when the device is done, not when its launches are
            elapsed = time.perf_counter() - t0
            if not decode or rep == repeats:
                for r in reqs:
                    core.kv.release(r.kv)
            if rep:
                runs.append((elapsed, dict(timer.total)))
    finally:
        attention_paged._select, CSA2Attention._select = selects
        for h in hooks:
            h.remove()
    times = [t for t, _ in runs]
    runs.sort(key=lambda x: x[0])
    seconds, stages = runs[len(runs) // 2]
    rows = batch * new_tokens
    active = param_counts(cfg).active_decode  # no replay here: every row runs every layer
    flops = 2.0 * active * rows
    elem = torch.finfo(next(model.parameters()).dtype).bits / 8
    kv_bytes = batch * (context * core.kv.layout.global_bytes_per_token() + core.kv.layout.bytes_per_window_slot)
    weight_bytes = active * elem
    return ForwardResult(
        batch,
        context,
        new_tokens,
        seconds,
        stages,
        rows / seconds,
        flops / seconds / 1e12,
        (weight_bytes + kv_bytes) / seconds / 1e9,
        times,
    )


def bench_args(args: EngineArgs, ns) -> EngineArgs:
    """The engine arguments of a bench run: a cache that holds the batch at its longest context, no prefix cache."""
    from ..kv.paged import KVLayout
    from ..models.loader import resolve_config

    lay = KVLayout.build(resolve_config(args.model), args.block_size, args.kv_cache_dtype)
    blocks = ns.batch * (math.ceil((max(ns.context) + ns.new_tokens) / lay.block_size) + 1)
    seqs = max(args.max_num_seqs, ns.batch)
    memory = blocks * lay.bytes_per_block + seqs * lay.bytes_per_slot + (1 << 20)
    return EngineArgs(
        **{
            **asdict(args),
            "max_num_seqs": seqs,
            "enable_prefix_caching": False,
            "kv_cache_memory": args.kv_cache_memory or memory,
        }
    )


def run_bench_forward(ns) -> int:
    from rich.console import Console
    from rich.table import Table

    args = bench_args(EngineArgs.from_cli(ns), ns)
    if args.tensor_parallel_size > 1 or args.data_parallel_size > 1:  # every rank spawned, timed in lockstep
        from .forward_parallel import run_bench_forward_parallel

        return run_bench_forward_parallel(ns, args)
    core = EngineCore(args)
    try:
        results = [bench_forward(core, ns.batch, c, ns.new_tokens, ns.repeats) for c in ns.context]
    finally:
        core.close()
    t = Table(
        title=f"bench forward: {core.cfg.name}, batch {ns.batch}, new tokens {ns.new_tokens}, "
        f"{args.dtype}, {'CPU' if not torch.cuda.is_available() else 'CUDA'}"
    )
    # stage columns are ms per step; the side columns (encoder, boundary layer, decoder) and the op columns
    # (attention, indexer, moe) are two cuts of the same time
    boundary = f"layer {core.cfg.encoder_layers}"
    for col in (
        "context",
        "ms/step",
        "tok/s",
        "TFLOP/s",
        "GB/s",
        "encoder",
        boundary,
        "decoder",
        "attention",
        "indexer",
        "moe",
        "sampler",
    ):
        t.add_column(col, justify="right")
    for r in results:
        ms = lambda k: f"{r.stages.get(k, 0.0) * 1e3:.1f}"  # noqa: E731
        t.add_row(
            str(r.context),
            f"{r.seconds * 1e3:.1f}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.tflops:.4f}",
            f"{r.gbytes_per_s:.2f}",
            ms("encoder"),
            ms("boundary"),
            ms("decoder"),
            ms("attention"),
            ms("indexer"),
            ms("moe"),
            ms("sampler"),
        )
    Console(width=max(Console().width, 150)).print(t)
    print(json.dumps({"bench": "forward", "model": core.cfg.name, "results": [asdict(r) for r in results]}))
    return 0


def add_bench_forward_args(p) -> None:
    p.add_argument("--batch", type=int, default=4, help="requests in the step (default: 4)")
    p.add_argument("--context", type=int, nargs="+", default=[128, 512], help="cached tokens per request")
    p.add_argument("--new-tokens", type=int, default=1, help="rows per request: 1 = decode (default: 1)")
    p.add_argument("--repeats", type=int, default=3)
    EngineArgs.add_cli_args(p)
