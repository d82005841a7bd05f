"""Where a model's bytes go on a machine, from its config alone (nothing allocated): ``dsserve plan`` and the
engine's start-up check.

Weights are counted tensor by tensor from ``release_layout(cfg)`` through the loader's own share rule
(``release_loader.rank_share``), so a GPU's count is what rank 0 of the layout reads, in the runtime form the
options pick: FP8 dense weights stay FP8 (``quantization="fp8"``) or become ``dtype``; MXFP4 experts stay packed
or become FP8 blocks / ``dtype``; Engram tables are FP8 (+ scales) or ``dtype``, on the device or in host memory.
KV: the global records (``accounting.kv_bytes``, per token) and per session the SWA rings, DSpark rings and
compressor state. With TP every rank of a replica holds the same KV (one latent per token cannot be split by
heads): the replica's capacity is one GPU's, and the other TP-1 copies are the cost.

The activation reserve is an estimate (the largest step's hidden streams, MoE intermediates and logits), not a
profile; the CUDA-graph pool reserve defaults to the 2 GiB measured after the warm-up on the release proxy
(docs/decode_graphs.md: 2.03 GiB for 212 graphs).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from ..distributed.layout import ParallelLayout
from .accounting import kv_bytes
from .checkpoint_layout import release_layout, scale_name
from .config import ModelConfig

GRAPH_POOL_BYTES = 2 << 30
# A sized KV cache stops at the larger of what max_num_seqs x max_model_len can hold and this many blocks: the
# block pool keeps host bookkeeping per block (a tiny model would otherwise get ~18 M blocks on an H200).
MAX_SIZED_KV_BLOCKS = 1 << 21
KV_BLOCK_TOKENS = 64
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8, "float16": 2}
KINDS = ("routed experts", "dense FP8 projections", "other weights", "DSpark", "Engram tables")


def plan_dtype(name: str) -> str:
    """The dtype name a plan counts in: vLLM's spellings (``half``, ``bf16``, ...) as the engine reads them, and
    ``auto`` as the GPU resolves it (bfloat16): a plan is of GPUs."""
    from ..engine.args import DTYPE_NAMES

    name = DTYPE_NAMES.get(name, name)
    return "bfloat16" if name == "auto" else name


def parse_bytes(text: str | int) -> int:
    """'141GiB', '141G', '2TiB', '80GB' (decimal GB is taken as GiB, as GPU vendors' sizes are meant), or a number."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size: expected a number with an optional unit K, M, G or T (e.g. 141GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class Machine:
    gpus: int
    gpu_memory: int  # bytes per GPU
    host_memory: int  # bytes


@dataclass(frozen=True)
class PlanOptions:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0  # EPLB's extra slots of the target's MoE layers (with expert parallelism)
    num_redundant_draft_experts: int = 0  # the drafter's
    dtype: str = "bfloat16"
    quantization: str | None = "fp8"
    expert_format: str | None = "mxfp4"
    engram_tables: str = "auto"  # auto | device | host | host-fp8 | host-mmap
    gpu_memory_utilization: float = 0.9
    context: int = 65536  # tokens of one session, for "sessions of this context"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    graph_pool: int = GRAPH_POOL_BYTES  # 0 with --enforce-eager
    rank_layout: ParallelLayout | None = None  # an engine rank's own share (its load layout); None: layout()

    @property
    def ep_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size if self.enable_expert_parallel else 1

    def layout(self) -> ParallelLayout:
        """Rank 0's share as the engine builds it: EP over the DP ranks (each TP rank then cutting its experts'
        intermediate, ``tp_worker.TPRank.layout``), a DEP rank's slots under EPLB's initial placement
        (``dp_rank.build_rank_core``); the routed experts are split over TP x DP ranks either way."""
        ep = self.data_parallel_size if self.enable_expert_parallel else 1
        redundant = (self.num_redundant_experts, self.num_redundant_draft_experts)
        return ParallelLayout(
            tp_size=self.tensor_parallel_size, ep_size=ep, redundant=redundant if any(redundant) and ep > 1 else None
        )


@dataclass
class MemoryPlan:
    cfg: ModelConfig
    machine: Machine
    options: PlanOptions
    weights: dict[str, int]  # per GPU, by kind (runtime form)
    engram_where: str  # device | host | host-fp8
    engram_bytes: int  # the tables' bytes (one copy)
    host_bytes: int  # host memory the tables take on this node (one copy, shared by its DP and TP ranks)
    budget: int  # per GPU: utilisation x memory
    activation: int
    graph_pool: int
    kv_bytes: int  # per GPU for the KV cache (may be negative: does not fit)
    kv_token_bytes: float
    kv_session_bytes: int  # one session of options.context tokens, windows and state included
    problems: list[str] = field(default_factory=list)
    kv_capped: bool = False  # the engine's cap on a sized KV cache (MAX_SIZED_KV_BLOCKS) binds

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_bytes // self.kv_token_bytes)) if self.kv_token_bytes else 0

    @property
    def sessions(self) -> int:
        return max(0, self.kv_bytes // self.kv_session_bytes) if self.kv_session_bytes else 0

    @property
    def tp_duplicate_bytes(self) -> int:
        """KV bytes per replica that only repeat rank 0's (TP ranks hold the same KV)."""
        return (self.options.tensor_parallel_size - 1) * max(0, self.kv_bytes)

    def lines(self) -> list[str]:
        """The plan as log lines (the engine's start-up log; ``dsserve plan`` prints a table of the same)."""
        o, gib = self.options, 2**30
        w = ", ".join(f"{k} {v / gib:.2f}" for k, v in self.weights.items() if v)
        out = [
            f"plan: {self.cfg.name} on {self.machine.gpus} GPU(s) x {self.machine.gpu_memory / gib:.0f} GiB, "
            f"TP {o.tensor_parallel_size} x DP {o.data_parallel_size}"
            + (f", EP {o.ep_size}" if o.enable_expert_parallel else ""),
            f"plan: weights per GPU {self.weight_bytes / gib:.2f} GiB ({w}); Engram tables {self.engram_where} "
            f"{self.engram_bytes / gib:.2f} GiB"
            + (f", host {self.host_bytes / gib:.2f} GiB per node (one copy for every rank)" if self.host_bytes else ""),
            f"plan: budget {o.gpu_memory_utilization:.2f} x GPU = {self.budget / gib:.2f} GiB; activations "
            f"{self.activation / gib:.2f} GiB (estimate), CUDA-graph pool {self.graph_pool / gib:.2f} GiB; KV "
            f"{self.kv_bytes / gib:.2f} GiB = {self.kv_tokens:,} tokens ({self.kv_token_bytes:.0f} B/token) = "
            f"{self.sessions:,} sessions of {o.context:,} tokens per GPU"
            + (" (capped: the most max_num_seqs x max_model_len or 2 M blocks hold)" if self.kv_capped else ""),
        ]
        if o.tensor_parallel_size > 1:
            out.append(
                f"plan: TP {o.tensor_parallel_size} replicates the global KV and window rows on every rank: a replica "
                f"holds {self.kv_tokens:,} tokens, not {o.tensor_parallel_size} x; "
                f"{self.tp_duplicate_bytes / gib:.2f} GiB per replica are copies"
            )
        out += [f"plan: does not fit: {p}" for p in self.problems] or ["plan: fits"]
        return out


def _share_fraction(share: tuple, shape: tuple) -> float:
    if not share:
        return 1.0
    dim, lo, hi = share
    return (hi - lo) / shape[dim]


def weight_bytes(cfg: ModelConfig, layout: ParallelLayout, opts: PlanOptions) -> tuple[dict[str, int], int, int]:
    """Bytes rank 0 of `layout` holds by kind (runtime form), and the Engram tables' bytes (one full copy) in FP8
    (stored bytes) and in ``opts.dtype``."""
    from .release_loader import _fp8_linear_fits, rank_share

    specs = release_layout(cfg)
    item = DTYPE_BYTES[plan_dtype(opts.dtype)]
    kinds = dict.fromkeys(KINDS[:-1], 0.0)
    engram_fp8 = engram_float = 0
    for name, spec in specs.items():
        if spec.quant == "scale":
            continue
        n = math.prod(spec.float_shape)
        scale = specs.get(scale_name(name))
        stored = spec.nbytes + (scale.nbytes if scale else 0)
        if name.endswith("engram.embed.weight"):
            engram_fp8 += stored if spec.quant == "engram_fp8" else n * (1 + 1 / 32)
            engram_float += n * item
            continue
        share = rank_share(name, spec, cfg, layout)
        if share is None:
            continue
        kind = "DSpark" if name.startswith("mtp.") else "other weights"
        b = spec.nbytes if spec.quant == "int32" else n * item  # plain, or dequantised
        if ".experts." in name and name.startswith("layers."):
            kind = "routed experts"
            if opts.expert_format == "mxfp4":
                b = stored if spec.quant == "mxfp4" else n * (0.5 + 1 / 32)
            elif opts.expert_format == "fp8":
                b = n * (1 + 1 / 1024)
        elif spec.quant == "fp8" and opts.quantization == "fp8" and _fp8_linear_fits(name, cfg):
            kind, b = "dense FP8 projections", stored
        elif not cfg.quantized and opts.quantization == "fp8" and _fp8_linear_fits(name, cfg):
            kind, b = "dense FP8 projections", n * (1 + 1 / cfg.weight_block_size**2)
        kinds[kind] += b * _share_fraction(share, spec.shape)
    return {k: int(v) for k, v in kinds.items()}, int(engram_fp8), int(engram_float)


def activation_bytes(cfg: ModelConfig, opts: PlanOptions) -> int:
    """An estimate of a step's live activations: the mHC streams (hc_mult x hidden, fp32, a few live copies), the
    routed experts' intermediates (top-k rows x intermediate x 3), and fp32 logits of the sampled rows."""
    t = opts.max_num_batched_tokens
    streams = t * cfg.hc_mult * cfg.hidden_size * 4 * 8
    moe = t * cfg.num_experts_per_tok * cfg.moe_intermediate_size * 4 * 3
    logits = opts.max_num_seqs * cfg.vocab_size * 4 * 2
    return int(streams + moe + logits)


def plan(cfg: ModelConfig, machine: Machine, opts: PlanOptions) -> MemoryPlan:
    """The memory plan of `cfg` on `machine` with `opts` (module docstring); ``problems`` says what does not fit
    and by how much, naming what to change."""
    tp, dp = opts.tensor_parallel_size, opts.data_parallel_size
    problems = []
    if tp * dp != machine.gpus:
        problems.append(
            f"--tensor-parallel-size {tp} x --data-parallel-size {dp} = {tp * dp} GPUs, but --gpus is {machine.gpus}"
        )
    layout = opts.rank_layout or opts.layout()
    try:
        weights, engram_fp8, engram_float = weight_bytes(cfg, layout, opts)
    except ValueError as e:  # a share that does not split
        raise ValueError(f"this layout cannot split {cfg.name}: {e}") from None
    budget = int(opts.gpu_memory_utilization * machine.gpu_memory)
    activation = activation_bytes(cfg, opts)
    fixed = sum(weights.values()) + activation + opts.graph_pool
    where = opts.engram_tables
    if where == "auto":  # on the device when they fit beside everything else with half the budget left for KV
        where = "device" if fixed + engram_float <= budget * 0.5 else "host-fp8"
    engram = engram_fp8 if where in ("host-fp8", "host-mmap") else engram_float
    on_device = engram if where == "device" else 0
    # one copy per node, whatever the DP and TP ranks: shared through /dev/shm (layers.engram_store), or through the
    # page cache when mapped from the files
    host = 0 if where == "device" else engram
    kv = kv_bytes(cfg)
    token = kv.global_per_token
    per_session = int(opts.context * token) + kv.swa_per_sequence + kv.draft_swa_per_sequence
    per_session += kv.compressor_state_per_sequence
    kv_total = budget - fixed - on_device
    longest = opts.max_model_len or cfg.max_position_embeddings
    most = opts.max_num_seqs * (per_session - int(opts.context * token) + int(longest * token))
    most = max(most, int(MAX_SIZED_KV_BLOCKS * KV_BLOCK_TOKENS * token))
    gib = 2**30
    if kv_total < per_session:
        short = per_session - kv_total
        what = (
            "more GPUs with --enable-expert-parallel, a larger --tensor-parallel-size"
            if sum(weights.values()) > budget / 2
            else "a shorter context, fewer batched tokens"
        )
        problems.append(
            f"per GPU, weights {sum(weights.values()) / gib:.2f} GiB + activations {activation / gib:.2f} GiB + "
            f"graph pool {opts.graph_pool / gib:.2f} GiB"
            + (f" + Engram tables {on_device / gib:.2f} GiB" if on_device else "")
            + f" + one session of {opts.context:,} tokens {per_session / gib:.2f} GiB exceed the budget "
            f"{budget / gib:.2f} GiB ({opts.gpu_memory_utilization} x {machine.gpu_memory / gib:.0f} GiB) by "
            f"{short / gib:.2f} GiB: use {what}"
        )
    if host > machine.host_memory:
        problems.append(
            f"host: the Engram tables take {host / gib:.2f} GiB (one copy per node, shared by its {tp * dp} "
            f"rank(s)), more than --host-memory {machine.host_memory / gib:.0f} GiB by "
            f"{(host - machine.host_memory) / gib:.2f} GiB"
        )
    return MemoryPlan(
        cfg,
        machine,
        opts,
        weights,
        where,
        engram,
        host,
        budget,
        activation,
        opts.graph_pool,
        min(kv_total, most),
        token,
        per_session,
        problems,
        kv_total > most,
    )


# ------------------------------------------------------------------ dsserve plan
def add_plan_args(p) -> None:
    from .presets import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="a preset, a built-in checkpoint or a checkpoint directory")
    p.add_argument("--gpus", type=int, default=None, help="GPUs (default: TP x DP)")
    p.add_argument("--gpu-memory", default="141GiB", help="memory of one GPU, e.g. 141GiB (an H200)")
    p.add_argument("--host-memory", default="2TiB", help="host memory, e.g. 2TiB")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true", help="routed experts split over TP x DP ranks")
    p.add_argument(
        "--num-redundant-experts", type=int, default=0, help="EPLB's redundant expert slots (--enable-eplb's)"
    )
    p.add_argument("--num-redundant-draft-experts", type=int, default=0, help="the drafter's redundant slots")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="the share of a GPU the engine may use")
    p.add_argument("--context", type=int, default=None, help="tokens of one session (default: 65536, or less)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="dtype of the plain weights")
    p.add_argument(
        "--quantization", default="auto", help="auto (the checkpoint's: fp8 when it is quantised) | fp8 | none"
    )
    p.add_argument("--expert-format", default="auto", help="auto (the checkpoint's: mxfp4) | mxfp4 | fp8 | none")
    p.add_argument(
        "--engram-tables",
        default="auto",
        help="auto (device when they fit, else host-fp8) | device | host | host-fp8 | host-mmap",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: no graph-pool reserve")


def options_from(args, cfg: ModelConfig) -> PlanOptions:
    def pick(v, auto):
        return auto if v == "auto" else None if v in (None, "none") else v

    return PlanOptions(
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        num_redundant_experts=args.num_redundant_experts,
        num_redundant_draft_experts=args.num_redundant_draft_experts,
        dtype=args.dtype,
        quantization=pick(args.quantization, "fp8" if cfg.quantized else None),
        expert_format=pick(args.expert_format, "mxfp4" if cfg.quantized else None),
        engram_tables=args.engram_tables,
        gpu_memory_utilization=args.gpu_memory_utilization,
        context=args.context or min(65536, cfg.max_position_embeddings),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        graph_pool=0 if args.enforce_eager else GRAPH_POOL_BYTES,
    )


def run_plan(args) -> int:
    """Print the plan; exit 0 when it fits, 1 when not (the reason is printed)."""
    from rich.console import Console
    from rich.table import Table

    from .loader import resolve_config

    cfg = resolve_config(args.model)
    opts = options_from(args, cfg)
    gpus = args.gpus or opts.tensor_parallel_size * opts.data_parallel_size
    p = plan(cfg, Machine(gpus, parse_bytes(args.gpu_memory), parse_bytes(args.host_memory)), opts)
    gib = 2**30
    t = Table(title=f"{cfg.name} on {gpus} x {p.machine.gpu_memory / gib:.0f} GiB", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("per GPU", justify="right")
    for kind, b in p.weights.items():
        t.add_row(f"weights: {kind}", f"{b / gib:,.2f} GiB")
    t.add_row("weights: total", f"{p.weight_bytes / gib:,.2f} GiB")
    t.add_row(
        f"Engram tables ({p.engram_where})",
        f"{p.engram_bytes / gib:,.2f} GiB" + (" (host)" if p.engram_where != "device" else ""),
    )
    t.add_row("host memory per node (Engram, one copy shared by the ranks)", f"{p.host_bytes / gib:,.2f} GiB")
    t.add_row("activations (estimate)", f"{p.activation / gib:,.2f} GiB")
    t.add_row("CUDA-graph pool reserve", f"{p.graph_pool / gib:,.2f} GiB")
    t.add_row(f"budget ({opts.gpu_memory_utilization} x GPU)", f"{p.budget / gib:,.2f} GiB")
    t.add_row("KV cache", f"{p.kv_bytes / gib:,.2f} GiB" + (" (capped)" if p.kv_capped else ""))
    t.add_row("KV tokens", f"{p.kv_tokens:,} ({p.kv_token_bytes:.0f} B/token)")
    t.add_row(f"sessions of {opts.context:,} tokens", f"{p.sessions:,} ({p.kv_session_bytes / 2**20:,.1f} MiB each)")
    con = Console(width=max(Console().width, 120))
    con.print(t)
    if opts.tensor_parallel_size > 1:
        con.print(p.lines()[3].removeprefix("plan: "))
    if p.fits:
        con.print(f"fits: {p.kv_tokens:,} KV tokens per GPU")
        return 0
    for problem in p.problems:
        con.print(f"does not fit: {problem}")
    return 1


# ------------------------------------------------------------------ the engine's KV budget on a GPU
def gpu_kv_budget(total: int, free: int, utilization: float, activation: int, graph_pool: int) -> int:
    """Bytes for the KV cache on a GPU whose memory is `total` with `free` left after the weights were loaded:
    utilization x total, less what is in use now (this engine's weights, and anything else on the GPU), the
    activation reserve and the CUDA-graph pool, as vLLM's --gpu-memory-utilization sizes it. Raises ValueError
    naming what to change when nothing is left."""
    used = total - free
    kv = int(utilization * total) - used - activation - graph_pool
    if kv <= 0:
        gib = 2**30
        raise ValueError(
            f"no GPU memory left for the KV cache: --gpu-memory-utilization {utilization} x {total / gib:.2f} GiB = "
            f"{utilization * total / gib:.2f} GiB, of which {used / gib:.2f} GiB is in use (weights and anything else "
            f"on the GPU), {activation / gib:.2f} GiB is reserved for activations and {graph_pool / gib:.2f} GiB for "
            f"the CUDA-graph pool ({-kv / gib:.2f} GiB short): raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens, run --enforce-eager, or spread the model over more GPUs"
        )
    return kv


# ------------------------------------------------------------------ defaults that follow the checkpoint
def choose_forms(
    cfg: ModelConfig,
    from_checkpoint: bool,
    on_gpu: bool,
    quantization: str | None,
    expert_format: str | None,
    engram_tables: str,
    machine: Machine | None = None,
    opts: PlanOptions | None = None,
) -> tuple[str | None, str | None, str, list[str]]:
    """The runtime forms an engine uses, and why (issue 53.5). None / "auto" follow the checkpoint on a GPU: its
    FP8 dense weights stay FP8, its MXFP4 experts stay packed, and its Engram tables go to the device when the
    plan has room for them beside the weights with half the budget left for KV, else to host memory (FP8 as
    stored). "none" asks for the dequantised form. The CPU (the reference path, for tiny models) and dummy
    weights dequantise, as before."""
    why = []
    stored = on_gpu and from_checkpoint and cfg.quantized
    q, ef = quantization, expert_format
    if q is None:
        q = "fp8" if stored else None
        why.append(
            "quantization fp8: the checkpoint's FP8 dense weights, kept as stored"
            if q
            else "quantization none: dense weights"
            + (" (the CPU's reference path dequantises)" if from_checkpoint and not on_gpu else "")
        )
    if ef is None:
        ef = "mxfp4" if stored and cfg.expert_dtype == "fp4" else None
        why.append("expert_format mxfp4: the checkpoint's packed experts, kept" if ef else "expert_format none: dense")
    q, ef = (None if v == "none" else v for v in (q, ef))
    et = engram_tables
    if et == "auto":
        if not (on_gpu and cfg.engram_layer_ids):
            et = "device"
            why.append("engram_tables device" + ("" if on_gpu else ": the CPU"))
        else:
            p = plan(cfg, machine, replace(opts, quantization=q, expert_format=ef, engram_tables="auto"))
            et = p.engram_where if p.engram_where == "device" or cfg.quantized else "host"
            gib = 2**30
            why.append(
                f"engram_tables {et}: "
                + (
                    "the tables fit the device budget"
                    if et == "device"
                    else f"{p.engram_bytes / gib:.1f} GiB of tables do not fit beside {p.weight_bytes / gib:.1f} GiB "
                    f"of weights in {p.budget / gib:.1f} GiB with half of it left for KV"
                )
            )
    return q, ef, et, why
