"""The engine core: requests in, one scheduled batched step at a time, ``RequestOutput``s out.

One loop for both fronts (the offline ``LLM`` and, later, the server): ``add_request`` validates before a
request enters, ``step`` schedules, runs the model, samples, detokenises, checks stops and frees finished
requests' KV.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from ..disagg.transport import KVTransferError
from ..distributed.layout import ParallelLayout
from ..distributed.tp_worker import TPRank, start_tensor_parallel
from ..kernels.ops import KernelOps
from ..kv.paged import KVLayout, PagedKVCache
from ..layers.engram_store import EngramStore, spawning
from ..layers.moe import MoE
from ..models.hub import TOKENIZER_FILES, resolve_model
from ..models.loader import DTYPES, LoadedModel, load_model
from ..models.presets import model_dir
from ..models.quantize import quantize_dense_fp8, quantize_experts, use_act_quant, use_fp8_kernels
from ..models.tokenizer import TooManyTokens
from . import graph_scratch, jit_compiles
from .args import EngineArgs, EngineArgsError
from .decode_graphs import DecodeGraphs
from .decoder_row_graphs import DecoderRowGraphs
from .detokenizer import StopChecker
from .drafter import Drafter
from .encoder_graphs import EncoderGraphs
from .executor import LocalExecutor, TPExecutor
from .generation_config import default_sampling
from .graph_capture import GraphCapture
from .outputs import CompletionOutput, RequestOutput, make_logprob_dict
from .propose_graphs import ProposeGraphs
from .rejection_sampler import RejectionSampler
from .request import Request, RequestStatus
from .runner import ModelRunner
from .sampler import Sampler, make_generator, row_logprobs
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig, StepOutput, StepPlan
from .stats import EngineStats
from .step_check import StepCheck
from .structured_output import GrammarMask, Grammars
from .verify_graphs import VerifyGraphs, verify_max_seqs

log = logging.getLogger("dsserve")
CPU_KV_CACHE_MEMORY = 256 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineArgsError(f"device {name!r} was asked for but this PyTorch sees no CUDA GPU; use --device cpu")
    return dev


def kv_cache_budget(
    args: EngineArgs, device: torch.device = torch.device("cpu"), cfg=None, graphs: bool = False
) -> int:
    """Bytes for the KV cache: given (--kv-cache-memory-bytes, alias --kv-cache-memory), or a fraction of the memory
    free now, or on a GPU what --gpu-memory-utilization leaves after the weights (loaded by now), the activation
    reserve of `cfg` and, with CUDA graphs, the graph pool (models.memory_plan.gpu_kv_budget); the CPU: 256 MiB."""
    if args.kv_cache_memory_bytes or args.kv_cache_memory:
        return args.kv_cache_memory_bytes or args.kv_cache_memory
    if args.kv_cache_memory_fraction:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0] * args.kv_cache_memory_fraction)
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(free * args.kv_cache_memory_fraction)
    if device.type == "cuda" and cfg is not None:
        from ..models.memory_plan import GRAPH_POOL_BYTES, PlanOptions, activation_bytes, gpu_kv_budget

        free, total = torch.cuda.mem_get_info(device)
        opts = PlanOptions(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
        pool = GRAPH_POOL_BYTES if graphs else 0
        try:
            return gpu_kv_budget(total, free, args.gpu_memory_utilization, activation_bytes(cfg, opts), pool)
        except ValueError as e:
            raise EngineArgsError(str(e)) from None
    return CPU_KV_CACHE_MEMORY


def choose_forms(
    args: EngineArgs,
    device: torch.device,
    loaded: LoadedModel | None = None,
    model_path: str | None = None,
    layout: ParallelLayout | None = None,
) -> EngineArgs:
    """``args`` with --quantization / --expert-format / --engram-tables made concrete (models.memory_plan.
    choose_forms: a checkpoint runs as stored on a GPU) and the reasons logged; on a GPU the memory plan is logged
    too, and weights that cannot fit the budget fail here, before anything is loaded. ``model_path``: where
    ``args.model`` resolved to (a Hugging Face id's local snapshot); default ``args.model``. ``layout``: this
    rank's share of a checkpoint (a TP or DEP rank's load layout: the plan counts what it reads); None: all."""
    from dataclasses import replace

    from ..models import memory_plan as mp
    from ..models.loader import resolve_config
    from ..models.presets import model_dir

    on_gpu = device.type == "cuda" and loaded is None
    path = model_path or model_dir(args.model)
    cfg = loaded.cfg if loaded is not None else resolve_config(path)
    from_checkpoint = loaded is None and args.load_format != "dummy" and os.path.isdir(path)
    machine = opts = None
    if on_gpu:
        free, total = torch.cuda.mem_get_info(device)
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        machine = mp.Machine(1, total, host)
        opts = mp.PlanOptions(
            dtype=args.torch_dtype_name(device.type),
            gpu_memory_utilization=args.gpu_memory_utilization,
            context=args.max_model_len or cfg.max_position_embeddings,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            graph_pool=0 if args.enforce_eager else mp.GRAPH_POOL_BYTES,
            rank_layout=layout if from_checkpoint else None,  # a preset is built whole, then cut
        )
    if args.engram_tables == "host-mmap" and not from_checkpoint:
        raise EngineArgsError("engram_tables='host-mmap' maps a checkpoint's files; this model has none (a preset)")
    q, ef, et, why = mp.choose_forms(
        cfg, from_checkpoint, on_gpu, args.quantization, args.expert_format, args.engram_tables, machine, opts
    )
    if why and (on_gpu or from_checkpoint):
        _say("formats: %s", "; ".join(why))
    if on_gpu:
        p = mp.plan(cfg, machine, replace(opts, quantization=q, expert_format=ef, engram_tables=et))
        for line in p.lines():
            _say("%s", line)
        on_device = p.weight_bytes + (p.engram_bytes if et == "device" else 0)
        if on_device > p.budget:
            raise EngineArgsError(
                f"{cfg.name} does not fit this GPU: " + "; ".join(p.problems) + " (see `dsserve plan`)"
            )
    return replace(args, quantization=q, expert_format=ef, engram_tables=et)


def log_to_stderr() -> None:
    """Start-up facts go to stderr like vLLM's (level and time first: a stall in a server's log can then be matched
    to the requests it held up), unless the user configured logging for "dsserve"."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _say(msg: str, *a) -> None:
    log_to_stderr()
    log.info(msg, *a)


class RequestError(ValueError):
    """A request the engine cannot take; raised before it enters, so nothing else is affected."""


@dataclass
class _Tracked:
    request: Request
    stops: StopChecker
    logprobs: list | None
    cumulative_logprob: float | None
    prompt_logprobs: list | None = None  # built once, after the prefill


@dataclass
class _Launched:
    """A step that sampled: its tokens on the device, and their copy to the host under way."""

    plan: StepPlan  # what ran; its requests' progress moves when the tokens are read (Scheduler.update)
    requests: list[Request]  # the rows that sample, in order
    sampled: torch.Tensor  # [B] int64 on the device
    host: torch.Tensor  # [B] the copy (pinned on a GPU)
    ready: "torch.cuda.Event | None"  # recorded after the copy
    logprobs: tuple | None  # the sampler's logprob tensors, copied like the tokens (None: no row asked)
    want: tuple  # per row: the top-n logprobs it asked for, or None
    nonfinite: torch.Tensor  # how many rows' logits had a NaN or inf (a scalar, copied like the tokens)


@dataclass
class _Unsampled:
    """A decode step launched ahead with constrained rows: sampled once the host has read the previous step's
    tokens, which their grammars accept before the masks are filled (the forward runs meanwhile; SGLang's overlap
    scheduler delays a constrained batch's sampling the same way)."""

    plan: StepPlan
    requests: list[Request]  # the rows that sample, in order
    logits: torch.Tensor


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``t``, issued without waiting."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _read_together(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors``, after one wait for the device (none on the CPU)."""
    if not any(t.device.type == "cuda" for t in tensors):
        return tensors
    host = [_to_host(t) if t.device.type == "cuda" else t for t in tensors]
    torch.cuda.current_stream().synchronize()
    return host


class EngineCore:
    def __init__(
        self,
        args: EngineArgs,
        loaded: LoadedModel | None = None,
        tp_rank: TPRank | None = None,
        model_pass=None,
        load_kwargs: dict | None = None,
    ):
        """``loaded``: a model already built (benchmarks build dummy-weight proxies straight on the device);
        None loads ``args.model``. ``tp_rank``: this process's place in a TP group (a worker's engine,
        distributed.tp_worker); None with ``tensor_parallel_size`` > 1: this engine is TP rank 0 and starts the
        workers. ``model_pass``: model -> model, run on the loaded model before it moves to the device (a DP
        rank's expert-parallel pass: distributed.dp_rank). ``load_kwargs``: ``load_model``'s share of a checkpoint
        for a rank without TP (a DEP rank's layout and EP group, ``dp_rank.build_rank_core``; a TP rank's come from
        ``tp_rank``)."""
        self.args = args
        # the node's one copy of the host Engram tables: a rank's group's (spawned with one), else this engine's
        # own when it spawns TP workers (removed by name once they all hold it: seal below)
        self.engram_store = EngramStore.inherited()
        self._own_store = None
        started = None  # the TP workers this engine spawned (a worker's or a DP rank's engine is given its place)
        if tp_rank is None and args.tensor_parallel_size > 1:
            if self.engram_store is None:
                self.engram_store = self._own_store = EngramStore.for_children()
            with spawning(self._own_store):
                tp_rank = started = start_tensor_parallel(args)
        self.tp = tp_rank
        try:
            self._build(args, loaded, model_pass, load_kwargs)
        except BaseException:
            if started is not None:  # its workers wait in the start's collectives: they go with the failed start
                started.procs.reap(2.0)
                started.leave()
            if self._own_store is not None:
                self._own_store.seal()
            raise

    def _build(self, args: EngineArgs, loaded: LoadedModel | None, model_pass, load_kwargs: dict | None) -> None:
        """The rest of ``__init__`` once the TP ranks (if any) are up: model, cache, runners, executor, sampler."""
        jit_compiles.watch()  # process-wide; this engine counts the compiles from here on (its model's build too)
        self._jit_base = jit_compiles.COMPILES.snapshot()
        self.device = resolve_device(args.device)  # first: a dummy model with packed experts is built there
        # a Hugging Face id: its local snapshot (a model given already built is not looked up)
        self.model_path = model_dir(resolve_model(args.model) if loaded is None else args.model)
        share = (load_kwargs or {}).get("layout") if self.tp is None else self.tp.layout()
        args = self.args = choose_forms(args, self.device, loaded, self.model_path, share)
        lm = loaded or load_model(
            self.model_path,
            args.load_format,
            args.torch_dtype_name(self.device.type),
            args.seed or 0,
            qat=args.qat,
            expert_format=args.expert_format,
            device=self.device,
            quantization=args.quantization,  # a checkpoint loads straight into these forms (release_loader)
            engram_tables=args.engram_tables,
            tokenizer=None if args.tokenizer is None else resolve_model(args.tokenizer, TOKENIZER_FILES),
            engram_store=self.engram_store,
            **((load_kwargs or {}) if self.tp is None else self.tp.load_kwargs()),
        )
        self.load_report = lm.report  # a checkpoint's: bytes read, seconds, tensors by runtime form; None otherwise
        if self.tp is not None and lm.load_format != "safetensors":  # a checkpoint was read as this rank's share
            lm.model = self.tp.shard(lm.model)
        if lm.report is not None:  # a checkpoint: what was read, how fast, and into which runtime forms
            r = lm.report
            _say(
                "loaded %s: %.2f GB in %.1f s (%.0f MB/s); tensors by form: %s",
                args.model,
                r.bytes_read / 1e9,
                r.seconds,
                r.bytes_read / max(r.seconds, 1e-9) / 1e6,
                ", ".join(f"{k} {v}" for k, v in r.forms.items()),
            )
        if model_pass is not None:
            lm.model = model_pass(lm.model)
        if loaded is not None and args.expert_format:  # layers already packed in that format are left alone
            quantize_experts(lm.model, args.expert_format, keep_dense=self.device.type == "cpu")
        if args.engram_tables != "device":  # before .to(device): the real tables are hundreds of GB
            fmt = "fp8" if args.engram_tables == "host-fp8" else "float"
            for i, block in enumerate(lm.model.layers):
                if block.engram is not None and block.engram.table is None:
                    try:
                        block.engram.move_table_to_host(fmt, store=self.engram_store, key=f"layers.{i}.engram")
                    except ValueError as e:  # e.g. an FP8 layout the table's width does not fit
                        raise EngineArgsError(f"engram_tables={args.engram_tables!r}: {e}") from None
        self.model, self.cfg, self.tokenizer = lm.model.to(self.device), lm.cfg, lm.tokenizer
        if args.tokenizer is not None:
            if self.tokenizer.vocab_size > self.cfg.vocab_size:
                raise EngineArgsError(
                    f"tokenizer {args.tokenizer!r} has {self.tokenizer.vocab_size} ids; the model's vocabulary has "
                    f"{self.cfg.vocab_size}"
                )
        self.default_sampling = default_sampling(args.generation_config, self.model_path if loaded is None else None)
        for note in args.notes():
            _say("%s", note)
        backend = args.attention_backend
        if backend == "auto":
            backend = "paged" if self.device.type == "cuda" else "reference"
        ops = KernelOps.for_device(self.device, args.reference_ops)
        if backend == "paged":
            self.model.kernel_ops = ops
        if args.quantization == "fp8":
            quantize_dense_fp8(self.model, self.cfg.weight_block_size)
            use_fp8_kernels(self.model, ops.uses_triton("linear"))
        if args.act_quant:
            use_act_quant(self.model, True)
        dtype = DTYPES[args.torch_dtype_name(self.device.type)]
        replay = args.swa_bounded_replay and self.cfg.is_v41
        # Exact mode keeps window rows with the cached blocks, so a hit restores the window exactly.
        layout = KVLayout.build(
            self.cfg,
            args.block_size,
            args.kv_cache_dtype,
            dtype,
            window_in_blocks=args.enable_prefix_caching and not replay,
        )
        self.max_model_len = args.max_model_len or self.cfg.max_position_embeddings
        graphs_on = backend == "paged" and self.device.type == "cuda" and not args.enforce_eager
        budget = kv_cache_budget(args, self.device, self.cfg, graphs_on)
        # A sized (not given) budget stops at what max_num_seqs sequences of max_model_len can hold or 2 M blocks,
        # the larger: the block pool keeps host bookkeeping per block (a tiny model would get ~18 M on an H200).
        from ..models.memory_plan import MAX_SIZED_KV_BLOCKS

        most = (
            max(
                args.max_num_seqs * (-(-self.max_model_len // layout.block_size) * layout.bytes_per_block),
                MAX_SIZED_KV_BLOCKS * layout.bytes_per_block,
            )
            + args.max_num_seqs * layout.bytes_per_slot
        )
        if self.device.type == "cuda" and not (args.kv_cache_memory_bytes or args.kv_cache_memory) and budget > most:
            _say("KV cache: %.2f GiB left for it, capped at %.2f GiB", budget / 2**30, most / 2**30)
            budget = most
        if self.tp is not None:  # every TP rank's cache has the same blocks: rank 0 sends block ids
            budget = self.tp.smallest(budget)
        if self._own_store is not None:  # every TP rank joined the collective above after its load
            self._own_store.seal()
        blocks, slots = layout.plan(budget, args.max_num_seqs)
        self.kv = PagedKVCache(
            layout,
            blocks,
            slots,
            dtype,
            prefix_caching=args.enable_prefix_caching,
            engram_token_map=self.model.engram_token_map,
            device=self.device,
        )
        # P/D disaggregation: a hand-off's blocks are prefix-cache blocks, so the connector needs the prefix cache
        from ..disagg.connector import KVConnector

        self.kv_connector = (
            KVConnector(self.kv, self.cfg.name, args.kv_transfer_timeout) if args.enable_prefix_caching else None
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                policy=args.scheduling_policy,
                enable_chunked_prefill=args.enable_chunked_prefill,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                swa_bounded_replay=replay,
                replay_window=args.replay_window or self.cfg.sliding_window,
                enable_prefix_caching=args.enable_prefix_caching,
                session_retention_s=args.session_retention,
            ),
            self.kv,
            self.kv_connector,
        )
        self.stats = EngineStats(layout, self.cfg)
        graphs = decoder_row_graphs = encoder_graphs = self.graph_capture = None
        min_context = -(-1024 // (2 * layout.block_size)) * 2 * layout.block_size
        if backend == "paged" and self.device.type == "cuda" and not args.enforce_eager:
            capture = self.graph_capture = GraphCapture(shared_pool=graph_scratch.shared_pool())
            graphs = DecodeGraphs(self.model, self.kv, args.max_num_seqs, capture, min_context=min_context)
            if replay:
                rows = (self.model, self.kv, min(1024, args.max_num_batched_tokens), args.max_num_seqs, capture)
                decoder_row_graphs = DecoderRowGraphs(*rows, min_context=min_context)
                if args.encoder_graphs:
                    encoder_graphs = EncoderGraphs(*rows, min_context=min_context)
        elif backend == "paged" and args.async_scheduling:  # fixed shapes, eager (the CPU)
            graphs = DecodeGraphs(self.model, self.kv, args.max_num_seqs, None, min_context=min_context)
        self.drafter = verify_graphs = None
        if args.speculative_config is not None:
            try:
                spec = args.speculative_config
                self.drafter = Drafter(self.model, spec.num_speculative_tokens, self.stats, spec.confidence_threshold)
            except ValueError as e:
                raise EngineArgsError(f"speculative_config: {e}") from None
            if self.cfg.sliding_window < self.drafter.k + 2:
                raise EngineArgsError(f"speculative_config: {self.cfg.name}'s window is shorter than a verify chunk")
            # Every step's rows feed the DSpark rings, so each needs its taps: verify steps (and plain decodes) run in
            # fixed shapes through VerifyGraphs, which returns them; the other fixed-shape runners do not.
            if graphs is not None:  # (on the CPU: fixed shapes without capture, as the decode steps')
                k = self.drafter.k
                seqs = verify_max_seqs(args.max_num_seqs, k)
                verify_graphs = VerifyGraphs(self.model, self.kv, seqs, k, self.graph_capture, min_context)
            # The proposal in fixed shapes, as CUDA graphs too for the requests a verify graph takes; not captured
            # where the stages' pass is a collective (TP, expert parallel: its passes are counted per MoE call, which
            # a replay does not make)
            seqs = verify_max_seqs(args.max_num_seqs, self.drafter.k)
            if self.graph_capture is not None and self.tp is None and all(type(s.ffn) is MoE for s in self.model.mtp):
                self.drafter.graphs = ProposeGraphs(self.model, seqs, self.graph_capture, self.model.kernel_ops)
            else:
                self.drafter.graphs = ProposeGraphs(self.model, seqs, None)
            graphs = decoder_row_graphs = encoder_graphs = None
            _say(
                "speculative decoding: DSpark, %d drafts a request a step (adaptive K: %s)",
                self.drafter.k,
                f"confidence threshold {self.drafter.threshold}" if self.drafter.threshold else "off",
            )
        # Asynchronous scheduling runs only fixed-shape decode steps ahead: they take their tokens from the device.
        # (under TP the step ahead would take rank 0's device tokens, which the workers do not have)
        self.async_scheduling = graphs is not None and args.async_scheduling is not False and self.tp is None
        if args.async_scheduling and self.drafter is not None:
            _say("async scheduling is off: steps with drafts are synchronous (the next step's rows are the drafts)")
        elif args.async_scheduling and not self.async_scheduling:
            _say(
                "async scheduling is off: it needs fixed-shape decode steps (the paged attention backend; this engine "
                "runs %s on %s)",
                backend,
                self.cfg.name,
            )
        self._in_flight: _Launched | None = None  # a step whose tokens the host has not read yet
        # DP ranks in lockstep (distributed.dp_rank.Lockstep): sees every plan before its forward, so that a rank
        # with an empty plan joins its peers' forward; None: a lone engine
        self.lockstep = None
        self.grammar_ahead = True  # constrained requests run ahead too (False: they wait for the read, as before)
        self.runner = ModelRunner(
            self.model, args.replay_form, graphs, decoder_row_graphs, encoder_graphs, verify_graphs
        )
        self.executor = (
            TPExecutor(self.runner, self.tp)
            if self.tp is not None and self.tp.rank == 0
            else LocalExecutor(self.runner)
        )
        self.step_check = StepCheck.from_env(self.device)  # a diagnostic: waits for the device after every step
        if self.step_check:
            self.step_check.attach(self.model)
        # unseeded requests draw from one engine generator: with --seed a run's samples repeat, as vLLM's
        self.sampler = Sampler(
            eos_token_id=self.tokenizer.eos_id,
            generator=None if args.seed is None else make_generator(args.seed, self.device),
        )
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.grammars = Grammars(self.tokenizer, self.cfg.vocab_size)  # structured output: compiled on first use
        self._tracked: dict[str, _Tracked] = {}
        r = self.kv.report()
        _say(
            "KV cache: %d global blocks x %d tokens = %.1f MiB (%.0f B/token), %d window slots = %.1f MiB (%d B/row)",
            r["global_blocks"],
            r["block_size"],
            r["global_bytes"] / 2**20,
            r["global_bytes_per_token"],
            r["window_slots"],
            r["window_bytes"] / 2**20,
            r["window_row_bytes"],
        )

    # ------------------------------------------------------------------------- requests
    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a ``RequestError`` saying what is wrong and what is allowed. Reads only
        the engine's configuration, so a front end may call it from another thread."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.cfg.vocab_size)  # a bad logit_bias id must not fail a whole step later
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt, add_bos=True, max_tokens=self.max_model_len - 1)
            except TooManyTokens as e:  # counted before the ids were built
                raise RequestError(self._too_long(e.n)) from None
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be ints in [0, {self.cfg.vocab_size}); got {bad[:5]}")
        if params.grammar is not None:
            self.grammars.compiled(*params.grammar)  # a GrammarError (ValueError) names what is wrong
        if len(ids) >= self.max_model_len:
            raise RequestError(self._too_long(len(ids)))
        need = -(
            -min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len) // self.kv.layout.block_size
        )
        if need > self.kv.blocks.num_blocks:
            raise RequestError(
                f"the request needs up to {need} KV blocks but the cache has "
                f"{self.kv.blocks.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        return ids

    def _too_long(self, n: int) -> str:
        return (
            f"the prompt has {n} tokens; this model allows at most "
            f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})"
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        session_id: str | None = None,
        kv_transfer: dict | None = None,
    ) -> Request:
        """``kv_transfer``: P/D hand-off parameters (``{"do_remote_decode": true}`` on a prefill instance: the
        request stops after its first token and its prompt's KV is staged for a decode instance; on a decode
        instance the ``kv_transfer_params`` a prefill instance returned, with ``remote_url``)."""
        params = params if params is not None else SamplingParams()
        if request_id in self._tracked:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        ids = self.validate(prompt, params)
        text = prompt if isinstance(prompt, str) else None
        req = Request(
            request_id, ids, params, prompt=text, priority=priority, cache_salt=cache_salt, session_id=session_id
        )
        if kv_transfer:
            self._check_kv_transfer(kv_transfer)
            req.kv_transfer = dict(kv_transfer)
            if kv_transfer.get("do_remote_decode"):  # P runs the prompt and one token; D samples from its replay
                params = req.params = replace(params, max_tokens=1, min_tokens=0)
        if params.grammar is not None:
            req.grammar = self.grammars.grammar(*params.grammar)
        stops = StopChecker(
            self.tokenizer, ids, params, eos_token_id=self.tokenizer.eos_id, max_model_len=self.max_model_len
        )
        want_lp = params.logprobs is not None
        try:
            self.scheduler.add(req)
        except KVTransferError as e:
            raise RequestError(str(e)) from None
        self._tracked[request_id] = _Tracked(req, stops, [] if want_lp else None, 0.0 if want_lp else None)
        return req

    def _check_kv_transfer(self, kt: dict) -> None:
        role = self.args.kv_role
        if self.kv_connector is None:
            raise RequestError("kv_transfer_params need prefix caching on this instance (--enable-prefix-caching)")
        if kt.get("do_remote_decode") and role == "decode":
            raise RequestError("this is a decode instance (--kv-role decode): it takes no do_remote_decode request")
        if kt.get("transfer_id") and role == "prefill":
            raise RequestError("this is a prefill instance (--kv-role prefill): it loads no remote KV")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return None
        self.scheduler.abort(request_id)
        t.request.status = RequestStatus.FINISHED_ABORTED
        return self._output(t, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (an AgentX point starts cold: bench.agentx); False while requests run."""
        return not self.has_unfinished_requests() and self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        """One scheduled step; returns the outputs of the tokens the host read in it. With asynchronous
        scheduling a step's tokens are read in the next call, after that call launched the next decode step from
        them on the device when it could (``_launch_ahead``)."""
        t0 = time.perf_counter()
        self.kv.blocks.expire_holds(time.monotonic())
        if self.drafter is not None:
            results = self._step_speculative()
            self.stats.step_done(time.perf_counter() - t0, 0.0)
            return results
        results, wait = [], 0.0
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            ahead = self._launch_ahead(prev)
            out, wait = self._read(prev, ahead)
            if isinstance(ahead, _Unsampled):  # its grammars have accepted prev's tokens in the read
                ahead = self._sample(ahead.plan, ahead.requests, ahead.logits)
            if ahead is not None:
                self._in_flight = ahead
                self.stats.step_done(time.perf_counter() - t0 - wait, wait)
                return out
            results = out  # the next step depends on what the host just read: run it the synchronous way
        plan = self.scheduler.schedule()
        results += self._remote_kv_failures()
        if self.lockstep is not None:
            self.lockstep.before_forward(plan)
        if not plan.chunks:
            return results
        self.stats.admitted(plan)
        before = self.step_check and self._runner_runs()
        starts = [c.request.num_computed_tokens for c in plan.chunks]
        sampling, logits = self.executor.execute(plan)
        if self.step_check:
            self._check_step("scheduled", logits, plan, starts, before)
        self._count_runs()
        self.scheduler.register_full_blocks([c.request for c in plan.chunks])
        if not sampling:
            self.scheduler.update(plan, StepOutput())
            self.stats.step_done(time.perf_counter() - t0 - wait, wait)
            return results
        launched = self._sample(plan, sampling, logits)
        if self.async_scheduling:
            self._in_flight = launched  # read in the next call, after it launched the next step (if it can)
        else:
            out, w = self._read(launched, None)
            results, wait = results + out, wait + w
        self.stats.step_done(time.perf_counter() - t0 - wait, wait)
        return results

    def close(self) -> None:
        """Stops the TP workers, if any (idempotent); the engine runs no step after this."""
        self.executor.close()
        if self._own_store is not None:
            self._own_store.seal()

    def reset_counts(self) -> None:
        """Counts start again from zero (after the warm-up: engine.warmup); captured graphs and their pools stay."""
        self.stats = EngineStats(self.stats.layout, self.cfg)
        if self.drafter is not None:
            self.drafter.stats = self.stats
            if self.drafter.graphs is not None:
                self.drafter.graphs.reset_counts()
        self._jit_base = jit_compiles.COMPILES.snapshot()
        self.runner.reset_counts()
        self._count_runs()

    def _count_runs(self) -> None:
        self.stats.decoder_rows_skipped = self.runner.decoder_rows_skipped
        self.stats.graph_steps = self.runner.graph_steps
        self.stats.replay_graph_steps = (
            0 if self.runner.decoder_row_graphs is None else self.runner.decoder_row_graphs.runs
        )
        self.stats.encoder_graph_steps = 0 if self.runner.encoder_graphs is None else self.runner.encoder_graphs.runs
        self.stats.verify_graph_steps = 0 if self.runner.verify_graphs is None else self.runner.verify_graphs.runs
        n, secs, loads = jit_compiles.COMPILES.snapshot()
        self.stats.triton_compiles, self.stats.triton_compile_seconds = n - self._jit_base[0], secs - self._jit_base[1]
        self.stats.triton_cache_loads = loads - self._jit_base[2]
        if self.graph_capture is not None:
            self.stats.graph_captures = self.graph_capture.captured
            self.stats.graph_capture_seconds = self.graph_capture.seconds
            self.stats.graph_pool_bytes = self.graph_capture.pool_bytes

    def _sample(self, plan: StepPlan, sampling: list[Request], logits: torch.Tensor) -> _Launched:
        logits = logits.float()
        # the model's own logits (before the sampler masks any), counted on the device and read with the tokens:
        # a fault shows in the metrics without a wait per step
        nonfinite = torch.isfinite(logits).all(1).logical_not().sum()  # one pass over [B, V], then B values
        # the grammar masks are filled on the host while the device runs the forward, and applied in the sampler
        out = self.sampler(logits, sampling, GrammarMask.fill(sampling, self.cfg.vocab_size))
        ids, lps = out.sampled_token_ids, out.logprob_tensors
        ready = None
        if ids.device.type == "cuda":  # the step's one copy back: tokens and logprobs, waited for in _read
            host = _to_host(ids)
            nonfinite = _to_host(nonfinite)
            lps = None if lps is None else tuple(None if t is None else _to_host(t) for t in lps)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = ids
        return _Launched(plan, sampling, ids, host, ready, lps, out.want, nonfinite)

    def _launch_ahead(self, prev: _Launched) -> _Launched | _Unsampled | None:
        """The next decode step of ``prev``'s requests, launched before the host reads ``prev``'s tokens (they
        are its inputs, taken on the device), when that step is certain to be what the scheduler would plan:
        nobody waits (or the batch is full), every running request is one of ``prev``'s and will not finish by
        length, its sampling needs no host history, and the cache has room. None: the caller reads ``prev``
        first. ``prev``'s progress is not applied yet: each request's pending token goes at ``num_tokens``. With a
        constrained row the step is returned unsampled: the caller samples it after reading ``prev``."""
        sched, graphs = self.scheduler, self.runner.decode_graphs
        if len(sched.running) != len(prev.requests):  # e.g. a prompt still has chunks to run
            return None
        if sched.remote and self.kv_connector.has_arrivals():  # a P/D hand-off's KV arrived: admit it now
            return None
        if sched.waiting and len(sched.running) < sched.config.max_num_seqs:  # full: none would be admitted
            return None
        if len(prev.requests) > sched.config.max_num_batched_tokens:
            return None
        row_of = {id(r): i for i, r in enumerate(prev.requests)}
        for r in sched.running:
            if id(r) not in row_of or not self._may_run_ahead(r):
                return None
        if sum(self.kv.blocks_needed(r.kv, r.num_tokens + 1) for r in sched.running) > self.kv.blocks.num_free:
            return None
        order = sched._by_priority(sched.running)  # the order schedule() would give
        plan = StepPlan([ScheduledChunk(r, 1) for r in order], [])
        key = graphs.key(plan, ahead=True)
        if key is None:
            return None
        for r in order:
            self.kv.grow(r.kv, r.num_tokens + 1)
        rows = [row_of[id(r)] for r in order]
        tokens = prev.sampled
        if rows != list(range(len(rows))):  # (a pinned upload: a pageable one would wait for the device)
            idx = torch.tensor(rows, pin_memory=tokens.device.type == "cuda")
            tokens = tokens[idx.to(tokens.device, non_blocking=True)]
        logits = graphs.run(plan, key, tokens)
        if self.step_check:
            self._check_step("ahead", logits, plan, [r.num_tokens for r in order], None, decode=key)
        self.runner.graph_steps += 1
        self.stats.ahead_steps += 1
        self._count_runs()
        if any(r.grammar is not None for r in order):
            return _Unsampled(plan, order, logits)
        return self._sample(plan, order, logits)

    def _runner_runs(self) -> dict:
        runners = {"encoder_rows": self.runner.encoder_graphs, "decoder_rows": self.runner.decoder_row_graphs}
        out = {k: (g.runs, g.last_key) for k, g in runners.items() if g is not None}
        dec = self.runner.decode_graphs
        out["decode"] = (self.runner.graph_steps, None if dec is None else dec.last_key)
        return out

    def _check_step(
        self, label: str, logits: torch.Tensor, plan: StepPlan, starts: list[int], before: dict | None, **took
    ) -> None:
        """StepCheck's wait and check, with the step's rows (from ``starts``) and the fixed-shape runners that
        took it."""
        if before is not None:
            took.update({k: key or "taken" for k, (n, key) in self._runner_runs().items() if n != before[k][0]})
        seqs = [(start, c.num_tokens) for start, c in zip(starts, plan.chunks)]
        self.step_check.after(label, logits, seqs, **took)

    def _may_run_ahead(self, r: Request) -> bool:
        """Whether r's next step can run before the host reads its pending token: that token cannot end it by
        length, and its sampling reads no token history (penalties, min_tokens still banning stops). A grammar's
        matcher is history too, but a step with constrained rows samples after the read (``_Unsampled``)."""
        p, n_out = r.params, len(r.output_token_ids) + 1  # counting the pending token
        if (p.max_tokens is not None and n_out >= p.max_tokens) or r.num_tokens + 1 >= self.max_model_len:
            return False
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            return False
        if r.grammar is not None and not self.grammar_ahead:
            return False
        return len(r.output_token_ids) >= p.min_tokens

    def _read(self, launched: _Launched, ahead: _Launched | None) -> tuple[list[RequestOutput], float]:
        """Waits for ``launched``'s tokens on the host, then has the scheduler apply its step (``Scheduler.update``),
        checks stops and frees finished requests. ``ahead``: the step already launched on these tokens (their Engram
        histories are pushed now, and its rows of requests finished here are dropped when it is read). Returns the
        outputs and the wait."""
        t1 = time.perf_counter()
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens = launched.host.tolist()  # here the host waits for the device
        wait = time.perf_counter() - t1
        bad = int(launched.nonfinite)
        if bad:
            self.stats.nonfinite_logit_rows += bad
            log.warning(
                "non-finite logits in %d of a step's %d sampled rows (%d rows so far)",
                bad,
                len(tokens),
                self.stats.nonfinite_logit_rows,
            )
        logprobs = row_logprobs(launched.logprobs, launched.want)
        if ahead is not None:
            tok_of = {id(r): tok for r, tok in zip(launched.requests, tokens)}
            self.model.push_decode_history([r.kv for r in ahead.requests], [tok_of[id(r)] for r in ahead.requests])
        now = time.monotonic()
        results, accepted, row_of = [], {}, {}
        for i, req in enumerate(launched.requests):
            t = self._tracked.get(req.request_id)
            if t is None or t.request is not req or req.status.finished:
                continue  # aborted, or finished while this step ran ahead of reading its last token
            accepted[req.request_id], row_of[req.request_id] = [tokens[i]], i
        for req in self.scheduler.update(launched.plan, StepOutput(accepted)):
            i = row_of[req.request_id]
            results.append(self._commit(self._tracked[req.request_id], [tokens[i]], [logprobs[i]], now))
        if ahead is not None:
            self.scheduler.register_full_blocks([r for r in ahead.requests if not r.status.finished])
        return results, wait

    def _commit(self, t: _Tracked, tokens: list[int], logprobs: list, now: float) -> RequestOutput:
        """The tokens a step accepted for ``t``'s request (the scheduler appended them), in order: its grammar,
        metrics, logprobs and stop checks follow each; a stop (or length) inside them finishes the request there
        and drops the tokens after it. Returns its output."""
        req = t.request
        for n, (tok, lp) in enumerate(zip(tokens, logprobs)):
            if req.grammar is not None:  # the scheduler appended tok; the grammar follows it
                req.grammar.accept(tok)
            req.metrics.record_token(now)
            if t.logprobs is not None and lp is not None:
                detok = self.tokenizer if req.params.detokenize else None
                t.logprobs.append(
                    make_logprob_dict(
                        tok, lp.sampled_logprob, lp.sampled_rank, lp.top_token_ids, lp.top_logprobs, detok
                    )
                )
                t.cumulative_logprob += lp.sampled_logprob
            t.stops.append(tok)
            if t.stops.finished:
                if n + 1 < len(tokens):
                    del req.output_token_ids[n + 1 - len(tokens) :]
                status = (
                    RequestStatus.FINISHED_STOPPED if t.stops.finish_reason == "stop" else RequestStatus.FINISHED_LENGTH
                )
                self.scheduler.finish(req, status)
                req.metrics.finished_time = now
                self._tracked.pop(req.request_id)
                break
        return self._output(t, t.stops.finish_reason)

    def _step_speculative(self) -> list[RequestOutput]:
        """One synchronous step with DSpark drafts (engine.drafter): the scheduled rows (verify chunks carry their
        drafts) in one forward, the rejection sampler's verdict, the rows into the drafter's rings and the next
        drafts proposed from the verdict, all on the device; then the host's one wait, for the verdict and the
        drafts together; then the rejected rows rolled back and the accepted tokens applied."""
        plan = self.scheduler.schedule()
        failed = self._remote_kv_failures()
        if self.lockstep is not None:  # DEP: an idle rank joins its peers' forward and draft passes in here
            self.lockstep.before_forward(plan)
        if not plan.chunks:
            return failed
        self.stats.admitted(plan)
        self.drafter.before(plan)
        sampling, logits = self.executor.execute(plan, speculative=True)  # TP: the workers run it and ingest
        self._count_runs()
        drafts = [c.draft_token_ids for c in plan.chunks if c.samples]
        pending = None
        if sampling:
            nonfinite = torch.isfinite(logits).all(1).logical_not().sum()
            pending = self.rejection_sampler.decide(logits.float(), sampling, drafts)
        self.drafter.ingest(plan, self.runner.last_forward)
        proposers, last_tokens, positions = self.drafter.inputs(plan, pending) if sampling else ([], None, None)
        # TP: the workers are sent the proposal's inputs (read here) and join the pass
        proposal = self.executor.draft_pass(proposers, last_tokens, positions, self.drafter.propose)
        accepted, lps = {}, []
        if sampling:  # the host's one wait: the verdict, the non-finite rows and the next drafts
            tensors = [nonfinite, *pending.tensors(), *proposal.tensors()]
            host = _read_together(tensors)
            self.stats.nonfinite_logit_rows += int(host[0])
            verdict = pending.to_host(host[1 : 1 + len(pending.tensors())])
            accepted = {r.request_id: t for r, t in zip(sampling, verdict.token_ids)}
            lps = self._verify_logprobs(verdict, sampling, drafts)
        rolled = self.drafter.settle(plan, accepted)
        self.executor.settle(plan, accepted)  # TP: the workers roll back the same rows
        if self.lockstep is not None:  # DEP: the draft passes its peers run and it did not, with zero rows
            self.lockstep.after_propose()  # (after the settle: a TP worker takes its messages in order)
        self.scheduler.register_full_blocks([c.request for c in plan.chunks])
        now, results = time.monotonic(), []
        for req in self.scheduler.update(plan, StepOutput(accepted, rolled)):
            results.append(self._commit(self._tracked[req.request_id], accepted[req.request_id], lps[req], now))
        if sampling:
            self.drafter.hand_out(sampling, proposal, host[len(host) - len(proposal.tensors()) :])
        return failed + results

    def _remote_kv_failures(self) -> list[RequestOutput]:
        """Aborted outputs, with their HTTP status and reason, of requests whose remote KV (P/D) could not be loaded."""
        out = []
        for req, status, reason in self.scheduler.take_failed():
            t = self._tracked.pop(req.request_id, None)
            if t is not None:
                o = self._output(t, "abort")
                o.error = (status, reason)
                out.append(o)
        return out

    @staticmethod
    def _verify_logprobs(verdict, sampling: list[Request], drafts: list[list[int]]) -> dict:
        """Request -> per accepted token its ``RowLogprobs`` (or None), from the verdict's rows."""
        want = [r.params.logprobs for r, d in zip(sampling, drafts) for _ in range(len(d) + 1)]
        rows, out, at = row_logprobs(verdict.logprobs, want), {}, 0
        for r, d, toks in zip(sampling, drafts, verdict.token_ids):
            out[r] = rows[at : at + len(toks)]
            at += len(d) + 1
        return out

    def _output(self, t: _Tracked, finish_reason: str | None) -> RequestOutput:
        req = t.request
        # Unfinished outputs carry only what may be streamed: the tail that could still match a stop string
        # is held back until it cannot.
        text = t.stops.text if finish_reason is not None else t.stops.streamed_text()
        comp = CompletionOutput(
            0,
            text,
            list(req.output_token_ids),
            t.cumulative_logprob,
            None if t.logprobs is None else list(t.logprobs),
            finish_reason,
            t.stops.stop_reason,
        )
        out = RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [comp],
            finished=finish_reason is not None,
            metrics=req.metrics,
            prompt_logprobs=self._prompt_logprobs(t),
            num_cached_tokens=req.num_cached_tokens,
        )
        if req.kv_transfer is not None:
            out.kv_transfer_params = self.scheduler.kv_transfer_params.pop(req.request_id, None)
            st = req.kv_transfer_stats
            if st is not None and req.metrics.first_token_time is not None and req.metrics.first_scheduled_time:
                st["replay_s"] = req.metrics.first_token_time - req.metrics.first_scheduled_time
            out.kv_transfer_stats = st
        return out

    def _prompt_logprobs(self, t: _Tracked) -> list | None:
        """vLLM's shape: None for the first prompt token, then per token a ``{token_id: Logprob}`` dict."""
        req = t.request
        if t.prompt_logprobs is None and req.prompt_logprobs is not None and all(req.prompt_logprobs[1:]):
            detok = self.tokenizer if req.params.detokenize else None
            t.prompt_logprobs = [None] + [make_logprob_dict(*row, detok) for row in req.prompt_logprobs[1:]]
        return t.prompt_logprobs
