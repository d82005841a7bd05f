"""Prometheus metrics for the server, named like vLLM's (``vllm:`` -> ``dsserve:``) so its dashboards carry over.

``EngineMetrics`` owns its own ``CollectorRegistry`` (not the global one), so tests and several servers in one
process do not collide. The engine loop thread calls ``observe_step`` after every step (gauges from the
scheduler and KV pools; counters from the deltas of ``engine.stats`` since the previous call) and
``observe_output`` for every ``RequestOutput`` (tokens, inter-token latency; on finish the per-request
histograms). The HTTP thread calls ``render``. prometheus_client objects are thread-safe; our own
bookkeeping is guarded by a lock. Times come from ``RequestMetrics`` (the engine's ``time.monotonic`` clock).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

FINISH_REASONS = ("stop", "length", "abort")
ERROR_KINDS = ("bad_request", "unavailable", "internal", "kv_transfer")  # exported at 0 from the start
REJECTION_STATUSES = (400, 401, 404, 413, 499, 500, 503)  # exported at 0 from the start; others as they come
KV_KINDS = ("global", "window")
# the engine stats vLLM also exports (the first two also under vLLM's deprecated gpu_ names)
VLLM_STAT_COUNTERS = (
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
)
GPU_PREFIXED = ("prefix_query_tokens", "prefix_hit_tokens")
# Buckets as in vLLM's v1 PrometheusStatLogger.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# engine.stats field -> counter name (all monotone within one EngineStats)
STAT_COUNTERS = {
    "prefix_query_tokens": ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_hit_tokens": ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "spec_num_drafts": ("spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    "replayed_rows": ("replayed_rows", "Rows run again through the encoder to rebuild windows after a hit."),
    "prefill_rows": ("prefill_rows", "Prefill rows run through the model."),
    "decoder_rows_skipped": ("decoder_rows_skipped", "Prefill rows that did not run the decoder (bounded replay)."),
    "graph_steps": ("decode_graph_steps", "Decode steps run in fixed shapes (replayed CUDA graphs on a GPU)."),
    "replay_graph_steps": (
        "replay_graph_steps",
        "Steps whose decoder rows ran in fixed shapes after bounded "
        "replay's narrowing (replayed CUDA graphs on a GPU).",
    ),
    "encoder_graph_steps": (
        "encoder_graph_steps",
        "Replayed steps whose encoder rows ran in fixed shapes (CUDA graphs on a GPU).",
    ),
    "graph_captures": (
        "graph_captures",
        "CUDA graphs captured (each capture stalls the step that needs it once; the warm-up's included).",
    ),
    "graph_capture_seconds": (
        "graph_capture_seconds",
        "Wall time of those captures, their warm-up runs included "
        "(Triton's first compiles of their shapes too): the time their steps waited.",
    ),
    "graph_pool_bytes": (
        "graph_pool_bytes",
        "Device memory reserved by the captured CUDA graphs' memory pool "
        "(one shared pool; DSSERVE_GRAPH_POOL=own: a pool per graph).",
    ),
    "triton_compiles": (
        "triton_compiles",
        "Triton kernels compiled while serving, the warm-up's not counted: "
        "each stalls the step that first launches its shape (where Triton has no compilation "
        "listener, loads from its disk cache count here too).",
    ),
    "triton_compile_seconds": (
        "triton_compile_seconds",
        "Wall time of those compiles: the time their steps "
        "waited (those inside graph captures are in graph_capture_seconds too).",
    ),
    "triton_cache_loads": (
        "triton_cache_loads",
        "Triton kernels loaded from Triton's disk cache while serving "
        "(compiled by an earlier process or a --kernel-manifest precompile): a few ms each.",
    ),
    "ahead_steps": (
        "async_ahead_steps",
        "Decode steps launched from the previous step's tokens on the device, "
        "before the host read them (asynchronous scheduling).",
    ),
    "nonfinite_logit_rows": (
        "nonfinite_logit_rows",
        "Sampled rows whose logits had a NaN or inf (a fault: 0 in a sound run; DSSERVE_CHECK_STEPS names the step).",
    ),
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


@dataclass
class _Seen:
    num_tokens: int = 0
    last_token_time: float | None = None
    prompt_counted: bool = False


@dataclass
class _Group:
    """The n requests a front end runs for one prompt (vLLM's parent request)."""

    left: int
    max_tokens: int | None
    longest: int = 0


ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
METRICS_NAMES = ("dsserve", "vllm")


class EngineMetrics:
    """``names``: "dsserve" (the default) exports everything as ``dsserve:*`` with the label ``model_name``;
    "vllm" exports every metric vLLM also has under vLLM's name, type, buckets and labels (``model_name`` and
    ``engine="0"``, vLLM v1's), so vLLM's dashboards and alerts work unchanged; dsserve's own metrics stay
    ``dsserve:*`` either way."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        model_name: str = "tiny",
        max_model_len: int = 131072,
        names: str = "dsserve",
    ):
        if names not in METRICS_NAMES:
            raise ValueError(f"metrics names must be one of {METRICS_NAMES}, not {names!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name, self.names = model_name, names
        self._lock = threading.Lock()
        self._requests: dict[str, _Seen] = {}
        self._groups: dict[str, _Group] = {}
        self._last_stats: dict[str, int] = {}
        self._stats_obj = None
        self._preemptions: dict[str, int] = {}
        self._iteration_tokens = 0  # tokens of the step(s) observed since the last observe_step
        self._http_installed = False
        reg, vllm = self.registry, names == "vllm"
        # vLLM's own metrics: vLLM's names and labels under names="vllm"
        shared_labels = ["model_name", "engine"] if vllm else ["model_name"]
        self._shared = (model_name, "0") if vllm else (model_name,)
        prefix = "vllm" if vllm else "dsserve"

        def counter(name, doc, extra=(), own=False):
            if own:
                return Counter(f"dsserve:{name}", doc, ["model_name", *extra], registry=reg)
            return Counter(f"{prefix}:{name}", doc, shared_labels + list(extra), registry=reg)

        def gauge(name, doc, extra=(), own=False):
            if own:
                return Gauge(f"dsserve:{name}", doc, ["model_name", *extra], registry=reg)
            return Gauge(f"{prefix}:{name}", doc, shared_labels + list(extra), registry=reg)

        def hist(name, doc, buckets):
            return Histogram(f"{prefix}:{name}", doc, shared_labels, buckets=buckets, registry=reg).labels(
                *self._shared
            )

        self.request_success = counter(
            "request_success", "Count of successfully processed requests.", ["finished_reason"]
        )
        self.request_errors = counter("request_errors", "Requests that failed, by kind.", ["kind"], own=True)
        self.rejected = counter(
            "rejected_requests",
            "HTTP responses with an error status (schema 400s, 401, 404, 413, 499, 503, 500 ...), by status.",
            ["status"],
            own=True,
        )
        for r in FINISH_REASONS:
            self.request_success.labels(*self._shared, r)
        for k in ERROR_KINDS:
            self.request_errors.labels(model_name, k)
        for code in REJECTION_STATUSES:
            self.rejected.labels(model_name, str(code))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(*self._shared)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.").labels(
            *self._shared
        )
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.").labels(
            *self._shared
        )
        self.stat_counters = {
            f: counter(n, d, own=f not in VLLM_STAT_COUNTERS).labels(
                *(self._shared if f in VLLM_STAT_COUNTERS else (model_name,))
            )
            for f, (n, d) in STAT_COUNTERS.items()
        }
        self.deprecated_counters = {}  # vLLM's pre-0.9 names, which its example dashboard still reads
        if vllm:
            self.deprecated_counters = {
                f: counter(f"gpu_{n}", f"{d} DEPRECATED: Use vllm:{n} instead.").labels(*self._shared)
                for f, (n, d) in STAT_COUNTERS.items()
                if f in GPU_PREFIXED
            }
        self.spec_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ["position"]
        )
        self._spec_per_pos_seen: list[int] = []
        self.spec_mean_len = gauge(
            "spec_decode_mean_acceptance_length",
            "Tokens a verified draft block gave on average since the start: 1 + accepted drafts (0: no block yet).",
            own=True,
        ).labels(model_name)

        self.num_running = gauge("num_requests_running", "Number of requests in model execution batches.").labels(
            *self._shared
        )
        self.num_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.").labels(
            *self._shared
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc",
            "KV-cache usage by kind (global blocks, window slots). 1 means 100 percent usage.",
            ["kind"],
            own=True,
        )
        self.kv_blocks = gauge(
            "kv_cache_blocks", "KV-cache blocks (global) or slots (window), by state.", ["kind", "state"], own=True
        )
        for kind in KV_KINDS:
            self.kv_usage.labels(model_name, kind)
            for state in ("used", "total"):
                self.kv_blocks.labels(model_name, kind, state)
        self.vllm_kv_usage = []  # vLLM's single usage gauge (and its deprecated name): the global blocks' usage
        if vllm:
            self.vllm_kv_usage = [
                gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(*self._shared),
                gauge(
                    "gpu_cache_usage_perc",
                    "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
                ).labels(*self._shared),
            ]

        # data parallelism (distributed.dp_client): each rank's load and cache, and the EP balance
        self.rank_requests = gauge(
            "dp_rank_requests", "Requests of a DP rank, running or waiting.", ["rank", "state"], own=True
        )
        self.rank_kv_usage = gauge(
            "dp_rank_kv_cache_usage_perc", "A DP rank's global KV blocks in use.", ["rank"], own=True
        )
        self.rank_hit_rate = gauge(
            "dp_rank_prefix_cache_hit_rate",
            "A DP rank's prefix cache hits / queries, in tokens, since the start.",
            ["rank"],
            own=True,
        )
        self.rank_routed = gauge(
            "dp_rank_requests_routed", "Requests the front end routed to a DP rank.", ["rank"], own=True
        )
        self.rank_idle_steps = gauge(
            "dp_rank_idle_steps", "Lockstep forwards a DEP rank joined with no rows of its own.", ["rank"], own=True
        )
        self.ep_balance = gauge(
            "ep_balance",
            "Per MoE layer over the window: mean / max over EP ranks of the rows their routed experts ran (1: even).",
            ["layer"],
            own=True,
        )
        self.ep_step_balance = gauge(
            "ep_step_balance",
            "The last lockstep step: sum over MoE layers of mean rows per EP rank / sum of max rows per EP rank.",
            own=True,
        ).labels(model_name)
        self.ep_rows_per_rank = gauge(
            "ep_rows_per_rank_per_step", "Expert rows an EP rank ran per MoE layer and step, over the window.", own=True
        ).labels(model_name)
        self.ep_rows = counter(
            "ep_expert_rows",
            "Rows the routed experts of an EP rank ran in a MoE layer (lockstep steps every rank reported): a "
            "window's balance per layer is mean over ranks / max over ranks of its increase.",
            ["layer", "rank"],
            own=True,
        )
        self.ep_steps = counter(
            "ep_steps", "Lockstep steps of the EP ranks counted in ep_expert_rows.", own=True
        ).labels(model_name)
        self._rank_stats: dict[int, dict] = {}  # a DP rank -> its last reported counters
        self._ep_seen: tuple[int, list] = (0, [])

        # EPLB (--enable-eplb, distributed.eplb): the ranks' figures, per MoE model (target | draft) and layer
        from ..distributed.eplb import BALANCE_KINDS

        self.eplb_balance = {
            kind: gauge(
                f"eplb_balance_{kind}",
                f"EP balance, mean / max over EP ranks of the rows their experts ran ({doc}); layer 'all': sum over "
                "layers of the means / sum of the maxes.",
                ["model", "layer"],
                own=True,
            )
            for kind, doc in BALANCE_KINDS.items()
        }
        self.eplb_rebalances = counter("eplb_rebalances", "EPLB rebalances that moved experts.", ["model"], own=True)
        self.eplb_bytes_moved = counter(
            "eplb_bytes_moved", "Expert weight bytes EPLB moved over the EP group.", ["model"], own=True
        )
        self.eplb_bytes_moved_last = gauge(
            "eplb_bytes_moved_last_rebalance", "Expert weight bytes the last EPLB rebalance moved.", ["model"], own=True
        )
        self.eplb_steps_waited = counter(
            "eplb_steps_waited", "Lockstep steps that waited for one EPLB weight transfer chunk.", own=True
        ).labels(model_name)
        self.eplb_buffer_bytes = gauge(
            "eplb_transfer_buffer_bytes",
            "The EPLB transfer buffer for moved expert weights: its peak so far (the largest over the ranks) and "
            "its bound (one layer's slots of a rank).",
            ["model", "kind"],
            own=True,
        )
        self._eplb_seen: dict[str, int] = {}  # counters' totals already exported
        self._eplb_set: set[tuple[str, str, str]] = set()  # (kind, model, layer) balance gauges set

        tok = build_1_2_5_buckets(max_model_len)
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds "
            "(per token, as vLLM's; same samples as inter_token_latency).",
            ITL_BUCKETS,
        )
        self.request_tpot = hist(
            "request_time_per_output_token_seconds",
            "Histogram of each request's mean time per output token in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = hist(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = hist(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = hist(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = hist(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_per_token = hist(
            "time_per_prefill_token_request_seconds",
            "Time spent per token during prefill phase in seconds.",
            PREFILL_TOKEN_BUCKETS,
        )
        from ..disagg.metrics import KVTransferMetrics

        self.kv_transfer = KVTransferMetrics(reg, model_name)  # P/D hand-offs (docs/disaggregation.md)
        self.req_prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.", tok)
        self.req_generation_tokens = hist("request_generation_tokens", "Number of generation tokens processed.", tok)
        self.iteration_tokens = hist(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.max_generation_tokens = hist(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", tok
        )
        self.params_n = hist("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tok
        )

    # ------------------------------------------------------------------------- engine loop thread
    def observe_step(self, engine) -> None:
        """Gauges from the scheduler and KV pools; counters from the deltas of ``engine.stats`` and of the
        live requests' preemption counts since the last call (call it after every step, and once at start so
        that every gauge has its value from the start). The tokens the outputs observed since the previous
        call carried make one ``iteration_tokens_total`` sample (``end_step``)."""
        if hasattr(engine, "rank_loads"):  # a DP front end: the ranks' reported loads
            self._observe_ranks(engine)
            return
        sched, kv, m = engine.scheduler, engine.kv, self.model_name
        self.num_running.set(len(sched.running))
        self.num_waiting.set(len(sched.waiting))
        for kind, pool in zip(KV_KINDS, (kv.blocks, kv.slots)):
            usage = pool.num_used / pool.num_blocks if pool.num_blocks else 0.0
            self.kv_usage.labels(m, kind).set(usage)
            self.kv_blocks.labels(m, kind, "used").set(pool.num_used)
            self.kv_blocks.labels(m, kind, "total").set(pool.num_blocks)
            if kind == "global":  # the paged cache, vLLM's "KV cache"; window slots are one per running request
                for g in self.vllm_kv_usage:
                    g.set(usage)
        self.end_step()
        with self._lock:
            stats = engine.stats
            if stats is not self._stats_obj:  # a new engine: its counts start from zero
                self._stats_obj, self._last_stats, self._spec_per_pos_seen = stats, {}, []
            for field, c in self.stat_counters.items():
                v = getattr(stats, field)
                d = v - self._last_stats.get(field, 0)
                if d > 0:
                    c.inc(d)
                    if field in self.deprecated_counters:
                        self.deprecated_counters[field].inc(d)
                self._last_stats[field] = v
            per_pos = list(getattr(stats, "spec_accepted_per_pos", ()))
            for i, v in enumerate(per_pos):
                d = v - (self._spec_per_pos_seen[i] if i < len(self._spec_per_pos_seen) else 0)
                if d > 0:
                    self.spec_per_pos.labels(*self._shared, str(i)).inc(d)
            self._spec_per_pos_seen = per_pos
            self.spec_mean_len.set(getattr(stats, "spec_mean_acceptance_length", 0.0))
            # A preempted request goes back to the waiting queue, so it is still live at the next call.
            now = {rid: r.num_preemptions for rid, r in sched.requests.items()}
            d = sum(max(0, n - self._preemptions.get(rid, 0)) for rid, n in now.items())
            if d:
                self.num_preemptions.inc(d)
            self._preemptions = now

    def _observe_ranks(self, client) -> None:
        """The DP front end's view: totals over the ranks in the shared gauges and counters, each rank's load with
        a ``rank`` label, and the EP balance of the lockstep steps."""
        m, loads = self.model_name, client.rank_loads
        self.num_running.set(sum(x.running for x in loads))
        self.num_waiting.set(sum(x.waiting for x in loads))
        used, total = sum(x.kv_used for x in loads), sum(x.kv_total for x in loads)
        self.kv_usage.labels(m, "global").set(used / total if total else 0.0)
        self.kv_blocks.labels(m, "global", "used").set(used)
        self.kv_blocks.labels(m, "global", "total").set(total)
        for g in self.vllm_kv_usage:
            g.set(used / total if total else 0.0)
        self.end_step()
        with self._lock:
            for r, x in enumerate(loads):
                rank = str(r)
                self.rank_requests.labels(m, rank, "running").set(x.running)
                self.rank_requests.labels(m, rank, "waiting").set(x.waiting)
                self.rank_kv_usage.labels(m, rank).set(x.kv_used / x.kv_total if x.kv_total else 0.0)
                q, h = x.prefix_query_tokens, x.prefix_hit_tokens
                self.rank_hit_rate.labels(m, rank).set(h / q if q else 0.0)
                self.rank_routed.labels(m, rank).set(client.router.routed[r])
                self.rank_idle_steps.labels(m, rank).set(x.idle_steps)
                self._count_rank(r, x.counters)
            drafts = sum(x.counters.get("spec_num_drafts", 0) for x in loads)
            accepted = sum(x.counters.get("spec_num_accepted_tokens", 0) for x in loads)
            self.spec_mean_len.set(1.0 + accepted / drafts if drafts else 0.0)
            bal = client.ep_balance
            if bal.steps:
                steps, seen = self._ep_seen
                for layer, (b, rows) in enumerate(zip(bal.layer_balance(), bal.window)):
                    self.ep_balance.labels(m, str(layer)).set(b)
                    for r, n in enumerate(rows):
                        before = seen[layer][r] if layer < len(seen) else 0
                        if n > before:
                            self.ep_rows.labels(m, str(layer), str(r)).inc(n - before)
                if bal.steps > steps:
                    self.ep_steps.inc(bal.steps - steps)
                self._ep_seen = (bal.steps, [list(v) for v in bal.window])
                self.ep_step_balance.set(bal.step_ratios[-1] if bal.step_ratios else 1.0)
                self.ep_rows_per_rank.set(bal.summary()["rows_per_rank_per_step"])
            if client.eplb:
                self._observe_eplb(client.eplb)

    def _count_rank(self, rank: int, counters: dict) -> None:
        """A DP rank's engine counters into the shared ones: their increase since its last report."""
        last = self._rank_stats.get(rank, {})
        for field, c in self.stat_counters.items():
            d = counters.get(field, 0) - last.get(field, 0)
            if d > 0:
                c.inc(d)
                if field in self.deprecated_counters:
                    self.deprecated_counters[field].inc(d)
        before = last.get("spec_accepted_per_pos", [])
        for i, v in enumerate(counters.get("spec_accepted_per_pos", [])):
            d = v - (before[i] if i < len(before) else 0)
            if d > 0:
                self.spec_per_pos.labels(*self._shared, str(i)).inc(d)
        self._rank_stats[rank] = counters

    def _observe_eplb(self, reports: dict) -> None:
        """The ranks' last ``eplb.EplbReport``s: rank 0's figures (every rank holds the same), the buffer's peak
        over the ranks; a balance kind a rank no longer reports (the last rebalance's ``after`` not yet measured)
        is removed."""
        m, first = self.model_name, reports[min(reports)]
        now = set()
        for fig in first.models:
            for kind, (overall, layers) in fig.balance.items():
                for layer, b in (("all", overall), *((str(i), x) for i, x in enumerate(layers))):
                    self.eplb_balance[kind].labels(m, fig.model, layer).set(b)
                    now.add((kind, fig.model, layer))
            peak = max(f.staging_peak for r in reports.values() for f in r.models if f.model == fig.model)
            self.eplb_buffer_bytes.labels(m, fig.model, "peak").set(peak)
            self.eplb_buffer_bytes.labels(m, fig.model, "bound").set(fig.staging_bound)
            self.eplb_bytes_moved_last.labels(m, fig.model).set(fig.bytes_moved_last)
            for name, counter, total in (
                ("rebalances", self.eplb_rebalances, fig.rebalances),
                ("bytes", self.eplb_bytes_moved, fig.bytes_moved_total),
            ):
                key = f"{name}/{fig.model}"
                child = counter.labels(m, fig.model)  # exported at 0 before the first rebalance
                if total > self._eplb_seen.get(key, 0):
                    child.inc(total - self._eplb_seen.get(key, 0))
                    self._eplb_seen[key] = total
        if first.steps_waited > self._eplb_seen.get("waited", 0):
            self.eplb_steps_waited.inc(first.steps_waited - self._eplb_seen.get("waited", 0))
            self._eplb_seen["waited"] = first.steps_waited
        for kind, model, layer in self._eplb_set - now:
            self.eplb_balance[kind].remove(m, model, layer)
        self._eplb_set = now

    def end_step(self) -> None:
        """The outputs observed since the last call make one step: one ``iteration_tokens_total`` sample of their
        prompt and generation tokens (call it after a step's outputs; ``observe_step`` calls it too, for a
        driver that observes a step's outputs after the step's gauges)."""
        with self._lock:
            if self._iteration_tokens:
                self.iteration_tokens.observe(self._iteration_tokens)
                self._iteration_tokens = 0

    def observe_output(self, out) -> None:
        """One streamed ``RequestOutput``: new generation tokens and their inter-token latencies; when it is
        finished, the success counter by reason and the per-request histograms; then forget the request."""
        comp, m, rid = out.outputs[0], out.metrics, out.request_id
        with self._lock:
            seen = self._requests.setdefault(rid, _Seen())
            n_new = len(comp.token_ids) - seen.num_tokens
            t = m.last_token_time if m is not None else None
            if n_new > 0:
                self.generation_tokens.inc(n_new)
                self._iteration_tokens += n_new
                if not seen.prompt_counted:  # the prompt went through the model once it sampled a token
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    self._iteration_tokens += len(out.prompt_token_ids)
                    seen.prompt_counted = True
                prev, gaps = seen.last_token_time, n_new
                if prev is None and m is not None:
                    prev, gaps = m.first_token_time, n_new - 1  # the first token has no gap before it
                if prev is not None and t is not None and gaps > 0:
                    gap = max(0.0, t - prev) / gaps
                    for _ in range(gaps):
                        self.itl.observe(gap)
                        self.tpot.observe(gap)
                seen.num_tokens, seen.last_token_time = len(comp.token_ids), t
            if not out.finished:
                return
            self._requests.pop(rid, None)
            if getattr(out, "kv_transfer_stats", None) or getattr(out, "kv_transfer_params", None):
                self.kv_transfer.observe(out)
            group = self._groups.pop(rid, None) or _Group(1, None)
            group.left -= 1
            group.longest = max(group.longest, len(comp.token_ids))
            if group.left == 0:  # vLLM: once per parent request, the longest of its n completions
                self.max_generation_tokens.observe(group.longest)
        if group.max_tokens:
            self.params_max_tokens.observe(group.max_tokens)
        reason = comp.finish_reason if comp.finish_reason in FINISH_REASONS else "abort"
        self.request_success.labels(*self._shared, reason).inc()
        self.req_prompt_tokens.observe(len(out.prompt_token_ids))
        self.req_generation_tokens.observe(len(comp.token_ids))
        if m is None:
            return
        end = m.finished_time if m.finished_time is not None else time.monotonic()  # abort sets none
        self.e2e.observe(max(0.0, end - m.arrival_time))
        for h, v in ((self.ttft, m.ttft), (self.queue, m.time_in_queue), (self.request_tpot, m.tpot)):
            if v is not None:
                h.observe(max(0.0, v))
        s, f, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        if s is not None and f is not None and last is not None:
            self.prefill.observe(max(0.0, f - s))
            if out.prompt_token_ids:
                self.prefill_per_token.observe(max(0.0, f - s) / len(out.prompt_token_ids))
            self.decode.observe(max(0.0, last - f))
            self.inference.observe(max(0.0, last - s))

    def observe_error(self, kind: str) -> None:
        self.request_errors.labels(self.model_name, kind).inc()

    # ------------------------------------------------------------------------- HTTP side
    def observe_request(self, request_ids: list[str], n: int, max_tokens: int | None) -> None:
        """A front end is about to submit the ``n`` requests it runs for one prompt (call it before submitting):
        ``request_params_n`` now; ``request_params_max_tokens`` per finished request and, once all have
        finished, ``request_max_num_generation_tokens`` (vLLM's per parent request)."""
        self.params_n.observe(n)
        group = _Group(len(request_ids), max_tokens)
        with self._lock:
            for rid in request_ids:
                self._groups[rid] = group

    def forget_requests(self, request_ids: list[str]) -> None:
        """Requests registered by ``observe_request`` that were never submitted."""
        with self._lock:
            for rid in request_ids:
                self._groups.pop(rid, None)

    def observe_rejection(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def install_http(self, app) -> None:
        """Adds the HTTP layer's metrics to this registry: ``http_requests_total`` and
        ``http_request_duration_seconds`` (prometheus-fastapi-instrumentator's names and labels, as vLLM's
        server exports them), every error status counted in ``dsserve:rejected_requests_total``, and
        prometheus_client's process, platform and GC collectors (``process_*``, ``python_*``), which vLLM's
        /metrics also has. Once per registry."""
        from prometheus_client.gc_collector import GCCollector
        from prometheus_client.platform_collector import PlatformCollector
        from prometheus_client.process_collector import ProcessCollector

        if self._http_installed:
            raise RuntimeError("this EngineMetrics already serves an app")
        self._http_installed = True
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        requests = Counter(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
            registry=self.registry,
        )
        duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler.",
            ["method", "handler"],
            buckets=(0.1, 0.5, 1.0),
            registry=self.registry,
        )
        app.add_middleware(HttpMetrics, metrics=self, requests=requests, duration=duration)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class HttpMetrics:
    """Plain ASGI (a BaseHTTPMiddleware would hide a client's disconnect from the routes): counts every HTTP
    response by method, status class ("2xx", as the instrumentator groups them) and route ("none" for a path no
    route has), times it to its last body byte, and counts every error status in ``rejected_requests``."""

    def __init__(self, inner, metrics: EngineMetrics, requests: Counter, duration: Histogram):
        self.inner, self.metrics, self.requests, self.duration = inner, metrics, requests, duration
        self.paths: set[str] | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        if self.paths is None:
            self.paths = {getattr(r, "path", None) for r in scope["app"].routes} - {None}
        start, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.inner(scope, receive, sending)
        finally:
            handler = scope["path"] if scope["path"] in self.paths else "none"
            self.requests.labels(scope["method"], f"{status[0] // 100}xx", handler).inc()
            self.duration.labels(scope["method"], handler).observe(time.perf_counter() - start)
            if status[0] >= 400:
                self.metrics.observe_rejection(status[0])
