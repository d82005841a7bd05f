"""Engine options: one frozen dataclass, named like vLLM's CLI flags, shared by ``LLM(...)`` and the CLI."""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, dataclass, field, fields

from ..models.presets import DEFAULT_MODEL

# vLLM's spellings of --dtype -> the dtype names the loader knows ("auto" is resolved per device: torch_dtype_name)
DTYPE_NAMES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
    "float64": "float64",
}
# vLLM's --kv-cache-dtype values that name this family's cache -> dsserve's: the release's packed records are FP8
# (FP4 index keys), which is what vLLM's fp8 / fp8_ds_mla mean for DeepSeek V4
KV_CACHE_DTYPE_NAMES = {
    "auto": "auto",
    "fp8": "auto",
    "fp8_e4m3": "auto",
    "fp8_ds_mla": "auto",
    "bf16": "bf16",
    "bfloat16": "bf16",
}
PARALLEL_ISSUE = "not yet supported: parallel execution is issue 54; dsserve runs tensor (-tp) and data (-dp) parallel"
CLI_ALIASES = {  # vLLM's short flags
    "tensor_parallel_size": ("-tp",),
    "data_parallel_size": ("-dp",),
    "pipeline_parallel_size": ("-pp",),
    "master_addr": ("--data-parallel-address",),
    "quantization": ("-q",),
}


def _h(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` as this engine takes it: the model's own DSpark drafter (spec 1.6), K drafts a
    request a step. Whether the model has the stages and K fits its block is checked when the engine loads it.
    ``confidence_threshold`` (adaptive K, dsserve's own key): a block stops before the first draft at which the DSpark
    confidence head's estimate that every draft so far is accepted falls below it; 0: every block drafts K."""

    method: str = "dspark"
    num_speculative_tokens: int = 3
    confidence_threshold: float = 0.0

    METHODS = ("dspark", "mtp", "deepseek_mtp")  # vLLM's names for a model's own draft layers: DSpark here
    MAX_TOKENS = 5  # the DSpark block (spec 1.6)

    @classmethod
    def parse(cls, spec) -> "SpeculativeConfig":
        """From a JSON string, a dict, or an instance; an ``EngineArgsError`` names what is wrong."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise EngineArgsError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(spec, dict):
            raise EngineArgsError(f"speculative_config must be a JSON object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - {"method", "num_speculative_tokens", "model", "confidence_threshold"})
        if unknown:
            raise EngineArgsError(
                f"speculative_config: unknown key(s) {unknown}; dsserve takes method, num_speculative_tokens and "
                "confidence_threshold"
            )
        method = spec.get("method", "dspark")
        if method not in cls.METHODS:
            raise EngineArgsError(
                f"speculative_config method {method!r}: dsserve drafts with the model's DSpark stages; use 'dspark'"
            )
        if spec.get("model") is not None:
            raise EngineArgsError("speculative_config model: DSpark drafts with the target's own stages; leave it out")
        k = spec.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cls.MAX_TOKENS:
            raise EngineArgsError(
                f"speculative_config num_speculative_tokens must be an int in 1..{cls.MAX_TOKENS} (the DSpark "
                f"block), got {k!r}"
            )
        t = spec.get("confidence_threshold", cls.confidence_threshold)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < 1.0:
            raise EngineArgsError(
                f"speculative_config confidence_threshold must be a number in [0, 1) (0: no adaptive K), got {t!r}"
            )
        return cls("dspark", k, float(t))


class EngineArgsError(ValueError):
    """An engine option that does not exist or has a value it cannot take."""


@dataclass(frozen=True)
class EngineArgs:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=_h(
            "a preset name, a built-in checkpoint (tiny-trained), a checkpoint directory or a Hugging Face id (from "
            "the local Hugging Face cache, downloaded where the network allows)"
        ),
    )
    load_format: str = field(default="auto", metadata=_h("auto | safetensors | dummy"))
    dtype: str = field(
        default="auto",
        metadata=_h(
            "auto (bfloat16 on a GPU, float32 on the CPU) | half | float16 | bfloat16 | float | float32 | float64"
        ),
    )
    seed: int | None = field(
        default=0, metadata=_h("seed of the dummy weights and of the sampling of unseeded requests (None: unseeded)")
    )
    tokenizer: str | None = field(default=None, metadata=_h("a tokenizer directory or model name (None: the model's)"))
    tokenizer_mode: str = field(
        default="auto", metadata=_h("accepted for vLLM's launch lines; no effect: this family has one tokenizer")
    )
    trust_remote_code: bool = field(
        default=False, metadata=_h("accepted for vLLM's launch lines; no effect: the model code is built in")
    )
    generation_config: str = field(
        default="auto",
        metadata=_h(
            "default sampling parameters: auto (the model directory's generation_config.json) | vllm (none: "
            "SamplingParams' own) | a directory holding a generation_config.json"
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_h(
            "tensor-parallel ranks: this process is rank 0 and spawns the others (one process each, "
            "--distributed-executor-backend mp), which run the same model cut by the TP pass on their own GPU, or "
            "their share of the CPU's cores (docs/parallel.md)"
        ),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=_h(
            "engine cores, one process each with its own scheduler and KV cache; requests are routed to the least "
            "loaded, keeping a session on one rank (distributed.dp_client)"
        ),
    )
    pipeline_parallel_size: int = field(default=1, metadata=_h(f"1 ({PARALLEL_ISSUE})"))
    distributed_executor_backend: str = field(
        default="mp", metadata=_h("mp: one spawned process per TP rank (the only backend; ray is not supported)")
    )
    nnodes: int = field(
        default=1, metadata=_h("nodes of a multi-node run (unset under torchrun: WORLD_SIZE / LOCAL_WORLD_SIZE)")
    )
    node_rank: int = field(default=0, metadata=_h("this node's index (torchrun's GROUP_RANK when unset)"))
    master_addr: str | None = field(
        default=None, metadata=_h("the rendezvous host (torchrun's MASTER_ADDR; one node: 127.0.0.1)")
    )
    master_port: int | None = field(
        default=None,
        metadata=_h(
            "the rendezvous port (serve under torchrun: MASTER_PORT + 1, as its agent holds MASTER_PORT; one node: a "
            "free port)"
        ),
    )
    data_parallel_rpc_port: int | None = field(
        default=None,
        metadata=_h(
            "multi-node DP: the port of node 0's front end (on --master-addr) where the other nodes' ranks connect "
            "(None: --master-port + 1)"
        ),
    )
    data_parallel_size_local: int | None = field(
        default=None,
        metadata=_h(
            "vLLM's multi-node DP form: DP ranks on this node; with --data-parallel-start-rank it sets --nnodes "
            "(-dp / this) and --node-rank (start / this); --master-port defaults to --data-parallel-rpc-port - 1"
        ),
    )
    data_parallel_start_rank: int = field(default=0, metadata=_h("vLLM's: the first DP rank of this node"))
    enable_expert_parallel: bool = field(
        default=False,
        metadata=_h(
            "with data_parallel_size > 1: spread the routed experts over the DP ranks (DEP: DP attention + expert "
            "parallel, the ranks stepping in lockstep); with one rank every expert is local, so it changes nothing"
        ),
    )
    enable_eplb: bool = field(
        default=False,
        metadata=_h(
            "expert-parallel load balancing (docs/eplb.md): redundant expert slots, placed by the recorded load and "
            "rebalanced live; takes effect with expert parallelism over several ranks"
        ),
    )
    num_redundant_experts: int = field(default=0, metadata=_h("EPLB: the target's extra expert slots (E + R over EP)"))
    num_redundant_draft_experts: int = field(default=0, metadata=_h("EPLB: the DSpark drafter's extra expert slots"))
    eplb_window_size: int = field(default=1000, metadata=_h("EPLB: steps of recorded load a placement is made from"))
    eplb_step_interval: int = field(default=3000, metadata=_h("EPLB: steps between rebalances"))
    eplb_transfer_chunk: int = field(
        default=32, metadata=_h("EPLB: expert moves in one chunk of weight transfers; one chunk a step boundary")
    )
    eplb_min_gain: float = field(
        default=0.02,
        metadata=_h("EPLB: a layer's experts move only if its expected most-loaded rank drops by more than this share"),
    )
    eplb_figures_interval: int = field(
        default=100,
        metadata=_h(
            "EPLB: steps between refreshes of the balance figures in /metrics (one all-reduce of the window's "
            "per-rank rows); 0: at each rebalance only"
        ),
    )
    uniform_routing: bool = field(
        default=False,
        metadata=_h(
            "benchmark reference with -dp > 1 and --enable-expert-parallel: every MoE layer routes each row to top-k "
            "experts drawn uniformly, the balanced reference of the EP balance figures (changes outputs; never for "
            "serving)"
        ),
    )
    speculative_config: str | dict | None = field(
        default=None,
        metadata=_h(
            'JSON (vLLM\'s form): {"method": "dspark", "num_speculative_tokens": K}, K in 1..the draft block size '
            "(5); the model's DSpark stages draft K tokens a request a step and the target verifies them exactly; "
            '"confidence_threshold": t in [0, 1) stops a block early where the confidence head\'s estimate that '
            "every draft so far is accepted falls below t (adaptive K; 0: off)"
        ),
    )
    swap_space: float = field(
        default=4.0, metadata=_h("GiB, accepted; no effect: a preempted request is recomputed, never swapped")
    )
    qat: bool | None = field(default=None, metadata=_h("quantisation-aware numerics of the release (None: on)"))
    max_num_batched_tokens: int = field(default=2048, metadata=_h("token budget of one step"))
    max_num_seqs: int = field(default=64, metadata=_h("running requests at most"))
    max_model_len: int | None = field(default=None, metadata=_h("None: the model's max_position_embeddings"))
    kv_cache_memory: int | None = field(default=None, metadata=_h("bytes for the KV cache (alias of the next)"))
    kv_cache_memory_bytes: int | None = field(
        default=None, metadata=_h("bytes for the KV cache (vLLM's flag; overrides --gpu-memory-utilization)")
    )
    kv_cache_memory_fraction: float | None = field(
        default=None, metadata=_h("or this fraction of the memory free now (none of these: see the next)")
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_h(
            "the share of the GPU's memory this engine may use: the KV cache gets what is left of it after the "
            "weights, the activations and the CUDA-graph pool, as vLLM sizes it (the CPU: 256 MiB)"
        ),
    )
    block_size: int | None = field(default=None, metadata=_h("tokens per KV block (None: 64; V4: 128)"))
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_h("auto (the release's packed FP4/FP8 records; also fp8, fp8_e4m3, fp8_ds_mla) | bf16 (bfloat16)"),
    )
    scheduling_policy: str = field(default="fcfs", metadata=_h("fcfs | priority"))
    enable_chunked_prefill: bool = field(default=True, metadata=_h("split long prompts across steps"))
    long_prefill_token_threshold: int = field(default=0, metadata=_h("cap on one prompt's chunk per step (0: none)"))
    swa_bounded_replay: bool = field(default=True, metadata=_h("V4.1 bounded replay; off = exact mode"))
    replay_window: int | None = field(default=None, metadata=_h("replayed rows (None: the sliding window)"))
    replay_form: str = field(
        default="report",
        metadata=_h("report: narrow at layer 20 (TRT-LLM) | vllm: layer 20 on all rows, later layers narrowed"),
    )
    enable_prefix_caching: bool = field(default=True, metadata=_h("cache the global KV of full blocks"))
    session_retention: float = field(
        default=0.0, metadata=_h("seconds a finished session request's blocks stay ahead of LRU (0: off)")
    )
    kv_role: str = field(
        default="both",
        metadata=_h(
            "P/D disaggregation (docs/disaggregation.md): prefill (run prompts, hand their KV to a decode instance) "
            "| decode (continue requests whose prompt KV a prefill instance ran) | both"
        ),
    )
    kv_transfer_timeout: float = field(
        default=30.0, metadata=_h("seconds a decode instance waits for a hand-off's KV before failing the request")
    )
    quantization: str | None = field(
        default=None,
        metadata=_h(
            "fp8: the dense projections the release stores in FP8 (attention, indexer wq_b, shared experts, Engram "
            "wkv) in its e4m3 weights with 32x32 (V4: 128x128) ue8m0 block scales, through the Triton FP8 kernel on "
            "GPU | none: dense (dequantised) | None: follow the checkpoint (on a GPU a quantised checkpoint stays FP8; "
            "the CPU and dummy weights: dense)"
        ),
    )
    expert_format: str | None = field(
        default=None,
        metadata=_h(
            "the routed experts' storage: mxfp4 (the release's) | fp8 (32x32 ue8m0 blocks) | none: dense | None: "
            "follow the checkpoint (on a GPU its MXFP4 experts stay packed; the CPU and dummy weights: dense). With "
            "dummy weights they are built on the device and packed layer by layer (the release proxy fits one "
            "H200); the dense copies are kept, rounded, only on the CPU"
        ),
    )
    act_quant: bool = field(
        default=False,
        metadata=_h(
            "the release's activation rounding (spec 2.12, act_quant): inputs of the FP8 projections (--quantization "
            "fp8) and of the packed routed experts quantised to e4m3 per 32 channels with power-of-two scales, in "
            "every path; on a GPU they then run as W8A8 / W4A8 on FP8 tensor cores"
        ),
    )
    engram_tables: str = field(
        default="auto",
        metadata=_h(
            "where the Engram n-gram tables live: auto (on a GPU: the device when the memory plan has room, else "
            "host memory in the checkpoint's form; the CPU: device) | device | host (pinned host memory, the model's "
            "values; each step's rows are copied on a side stream while earlier layers run) | host-fp8 (host, in "
            "the release's FP8 layout, half the bytes of bf16) | host-mmap (a checkpoint's FP8 tables memory-mapped "
            "from its files: no copy, pages shared by every engine of the host; rows gathered on the host, not by the "
            "in-place GPU kernel of a pinned table)"
        ),
    )
    device: str = field(default="auto", metadata=_h("auto (cuda when a GPU is visible) | cpu | cuda | cuda:N"))
    attention_backend: str = field(
        default="auto",
        metadata=_h(
            "paged: attention batched over the paged pools through the kernels | reference: the per-sequence "
            "reference path | auto: paged on cuda, reference on cpu"
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_h(
            "run every step eagerly; otherwise on a GPU (paged backend) decode steps, and (V4.1) "
            "the decoder rows of other "
            "steps after bounded replay's narrowing (and their encoder rows, unless --no-encoder-graphs), run as CUDA "
            "graphs captured per row and context bucket on first use (or in the warm-up: --warmup)"
        ),
    )
    encoder_graphs: bool = field(
        default=True,
        metadata=_h(
            "with bounded replay and CUDA graphs: a step that narrows and fits a row bucket (up to 1024 rows: a prefix "
            "hit's replayed and new rows, a short prompt) runs its encoder layers as a CUDA graph too (a hit's TTFT "
            "0.66-0.86x on the release proxy); --no-encoder-graphs runs them eagerly, the decoder rows still as graphs"
        ),
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata=_h(
            "launch the next decode step before the host has read the current one's tokens (it takes them from the "
            "device), so scheduling, refills and output processing overlap the device's work; a step's tokens reach "
            "the outputs after the next step is launched. Steps with prefill chunks, arrivals, penalties or unmet "
            "min_tokens run the synchronous way. None: on wherever decode steps run in fixed shapes (a GPU's CUDA "
            "graphs); True also runs the CPU's paged decode steps in fixed shapes"
        ),
    )
    warmup: bool | None = field(
        default=None,
        metadata=_h(
            "before the first request, run synthetic requests up every decode context bucket, through every "
            "decode batch bucket (fresh and as prefix hits) and through a ladder of prefill row counts, so that "
            "Triton compiles and the CUDA graphs of those shapes capture before anyone waits (engine/warmup.py). "
            "None: on for `dsserve serve` on a GPU, off otherwise"
        ),
    )
    reference_ops: str = field(
        default="",
        metadata=_h(
            "ops that run their torch reference instead of Triton (on the paged backend), for bisecting: a comma "
            "list of attention, indexer, topk, kv_write, linear, router, moe, mhc, rowwise, entry_rows, engram_rows, "
            "engram_mix, swiglu, window_rows, or all, or '' for none"
        ),
    )

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise EngineArgsError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise EngineArgsError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}"
            )
        object.__setattr__(self, "kv_cache_dtype", KV_CACHE_DTYPE_NAMES[self.kv_cache_dtype])
        if self.data_parallel_size < 1:
            raise EngineArgsError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.tensor_parallel_size > 1 and self.data_parallel_size > 1 and self.enable_expert_parallel:
            for name in ("enable_eplb", "uniform_routing"):
                if getattr(self, name):
                    raise EngineArgsError(
                        f"{name} with tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                        f"{self.data_parallel_size}: built for DEP ranks without TP only; drop {name} or use "
                        "tensor_parallel_size=1"
                    )
        for name in ("pipeline_parallel_size",):
            if getattr(self, name) != 1:
                raise EngineArgsError(f"{name}={getattr(self, name)}: {PARALLEL_ISSUE} (use 1)")
        if self.tensor_parallel_size < 1:
            raise EngineArgsError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend != "mp":
            raise EngineArgsError(
                f"distributed_executor_backend {self.distributed_executor_backend!r}: only 'mp' (one spawned process "
                "per rank) is supported"
            )
        if self.data_parallel_size_local is not None:
            self._nodes_from_vllm_flags()
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise EngineArgsError(f"node_rank must lie in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            self._check_nodes()
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        try:
            self.eplb_config()
        except ValueError as e:
            raise EngineArgsError(str(e)) from None
        if self.swap_space < 0:
            raise EngineArgsError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.quantization not in (None, "fp8", "none"):
            raise EngineArgsError(f"quantization must be fp8, none or None, got {self.quantization!r}")
        if self.expert_format not in (None, "fp8", "mxfp4", "none"):  # models.quantize.EXPERT_FORMATS
            raise EngineArgsError(
                f"expert_format must be mxfp4, fp8 or None, got {self.expert_format!r} (or none: dense experts)"
            )
        if self.attention_backend not in ("auto", "paged", "reference"):
            raise EngineArgsError(f"attention_backend must be auto, paged or reference, got {self.attention_backend!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise EngineArgsError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        from ..kernels.ops import parse_reference_ops

        try:
            parse_reference_ops(self.reference_ops)
        except ValueError as e:
            raise EngineArgsError(str(e)) from None
        if self.engram_tables not in ("auto", "device", "host", "host-fp8", "host-mmap"):
            raise EngineArgsError(
                f"engram_tables must be device, host or host-fp8 (or auto, host-mmap), got {self.engram_tables!r}"
            )
        if self.replay_form not in ("report", "vllm"):
            raise EngineArgsError(f"replay_form must be 'report' or 'vllm', got {self.replay_form!r}")
        if self.replay_window is not None and self.replay_window < 1:
            raise EngineArgsError(f"replay_window must be >= 1, got {self.replay_window}")
        if self.kv_role not in ("prefill", "decode", "both"):
            raise EngineArgsError(f"kv_role must be prefill, decode or both, got {self.kv_role!r}")
        if self.kv_role != "both" and not self.enable_prefix_caching:
            raise EngineArgsError(
                f"kv_role {self.kv_role!r} needs prefix caching (a hand-off's blocks are prefix-cache blocks); "
                "drop --no-enable-prefix-caching"
            )
        if self.kv_transfer_timeout <= 0:
            raise EngineArgsError(f"kv_transfer_timeout must be > 0 seconds, got {self.kv_transfer_timeout}")
        if self.session_retention < 0:
            raise EngineArgsError(f"session_retention must be >= 0 seconds, got {self.session_retention}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise EngineArgsError(f"{name} must be >= 1, got {getattr(self, name)}")
        f = self.kv_cache_memory_fraction
        if f is not None and not 0 < f <= 1:
            raise EngineArgsError(f"kv_cache_memory_fraction must be in (0, 1], got {f}")
        for name in ("kv_cache_memory", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise EngineArgsError(f"{name} must be a positive number of bytes, got {getattr(self, name)}")
        if None not in (self.kv_cache_memory, self.kv_cache_memory_bytes) and (
            self.kv_cache_memory != self.kv_cache_memory_bytes
        ):
            raise EngineArgsError(
                f"kv_cache_memory ({self.kv_cache_memory}) and kv_cache_memory_bytes ({self.kv_cache_memory_bytes}) "
                "are the same setting: give one"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineArgsError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def eplb_config(self):
        """The EPLB settings as ``distributed.eplb.EplbConfig`` (checked there)."""
        from ..distributed.eplb import EplbConfig

        return EplbConfig(
            window_size=self.eplb_window_size,
            step_interval=self.eplb_step_interval,
            num_redundant_experts=self.num_redundant_experts,
            num_redundant_draft_experts=self.num_redundant_draft_experts,
            transfer_chunk=self.eplb_transfer_chunk,
            min_gain=self.eplb_min_gain,
            figures_interval=self.eplb_figures_interval,
        )

    def torch_dtype_name(self, device_type: str) -> str:
        """The loader's dtype name on a device of this type: ``auto`` is bfloat16 on a GPU, float32 on the CPU."""
        name = DTYPE_NAMES[self.dtype]
        if name == "auto":
            return "bfloat16" if device_type == "cuda" else "float32"
        return name

    def notes(self) -> list[str]:
        """One line per vLLM option that was set but changes nothing here, saying why (logged at start)."""
        out = []
        if self.tokenizer_mode != "auto":
            out.append(f"tokenizer_mode {self.tokenizer_mode!r}: no effect, this family has one tokenizer")
        if self.trust_remote_code:
            out.append("trust_remote_code: no effect, no remote code is run (the model code is built in)")
        if self.enable_expert_parallel and self.data_parallel_size == 1:
            out.append("enable_expert_parallel: no effect on one device (every expert is local)")
        ep = self.data_parallel_size > 1 and self.enable_expert_parallel
        if (self.enable_eplb or self.num_redundant_experts or self.num_redundant_draft_experts) and not ep:
            out.append("enable_eplb / num_redundant_*experts: no effect without -dp > 1 and --enable-expert-parallel")
        elif (self.num_redundant_experts or self.num_redundant_draft_experts) and not self.enable_eplb:
            out.append("num_redundant_*experts: no effect without --enable-eplb")
        if self.uniform_routing and not (self.data_parallel_size > 1 and self.enable_expert_parallel):
            out.append("uniform_routing: no effect without -dp > 1 and --enable-expert-parallel (a balance reference)")
        if self.swap_space != 4.0:
            out.append(f"swap_space {self.swap_space} GiB: no effect, a preempted request is recomputed")
        if self.act_quant and self.quantization != "fp8" and self.expert_format in (None, "none"):
            out.append("act_quant: no effect, nothing is stored in FP8 / FP4 (see --quantization, --expert-format)")
        return out

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise EngineArgsError(f"unknown engine option(s) {unknown}; options are {sorted(names)}")
        return cls(**kw)

    def _nodes_from_vllm_flags(self) -> None:
        """vLLM's --data-parallel-size-local L --data-parallel-start-rank S as --nnodes D/L --node-rank S/L (dsserve
        splits the ranks evenly over the nodes)."""
        local, start, dp = self.data_parallel_size_local, self.data_parallel_start_rank, self.data_parallel_size
        if local < 1 or dp % local or start % local or not 0 <= start < dp:
            raise EngineArgsError(
                f"data_parallel_size_local={local}, data_parallel_start_rank={start} with data_parallel_size={dp}: "
                "dsserve runs the same number of DP ranks on every node, so the local size must divide "
                "data_parallel_size and the start rank be a multiple of it, below data_parallel_size"
            )
        if self.nnodes not in (1, dp // local) or self.node_rank not in (0, start // local):
            raise EngineArgsError(
                f"--nnodes {self.nnodes} --node-rank {self.node_rank} contradict --data-parallel-size-local {local} "
                f"--data-parallel-start-rank {start} (nodes {dp // local}, node {start // local}): give one form"
            )
        object.__setattr__(self, "nnodes", dp // local)
        object.__setattr__(self, "node_rank", start // local)
        if not self.master_port and self.data_parallel_rpc_port and self.nnodes > 1:
            object.__setattr__(self, "master_port", self.data_parallel_rpc_port - 1)  # as R defaults to P + 1

    def _check_nodes(self) -> None:
        """A multi-node deployment splits the DP ranks evenly over the nodes; TP stays within a node."""
        if self.tensor_parallel_size > 1:
            raise EngineArgsError(
                f"tensor_parallel_size={self.tensor_parallel_size} with nnodes={self.nnodes}: tensor parallel across "
                "nodes is not supported (its step messages travel on one host's pipes), nor TP inside DP ranks on "
                "several nodes yet; across nodes run data/expert parallel (-dp D --enable-expert-parallel, D a "
                "multiple of --nnodes), or -tp with -dp on one node"
            )
        if self.data_parallel_size % self.nnodes:
            raise EngineArgsError(
                f"data_parallel_size={self.data_parallel_size} over nnodes={self.nnodes}: every node holds the same "
                "number of DP ranks, so data_parallel_size must be a multiple of nnodes"
            )
        if not self.master_port:
            raise EngineArgsError(
                f"nnodes={self.nnodes} needs --master-port (and --master-addr: node 0's address), the same on all nodes"
            )

    def dp_ranks_of_node(self) -> range:
        """The global DP ranks this node runs (node n of N: ranks n*D/N .. (n+1)*D/N - 1)."""
        local = self.data_parallel_size // self.nnodes
        return range(self.node_rank * local, (self.node_rank + 1) * local)

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flags = ("--" + f.name.replace("_", "-"), *CLI_ALIASES.get(f.name, ()))
            default = f.default if f.default is not MISSING else None
            doc = f.metadata.get("help", "")
            doc = f"{doc} (default: {default})"
            if f.type in ("bool", "bool | None"):
                p.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=doc)
            else:
                kind = int if f.type.startswith("int") else float if f.type.startswith("float") else str
                p.add_argument(*flags, dest=f.name, type=kind, default=default, help=doc)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
