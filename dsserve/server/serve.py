"""``dsserve serve``: the engine behind uvicorn, with a graceful SIGTERM.

Start-up: the port is bound first (a port in use is a one-line error before any loading), then the model is
built and warmed up, then the socket listens and a "ready" line says where and after how long. SIGTERM: new
connections are refused, in-flight requests get ``--shutdown-timeout`` seconds, then each remaining one is cut
(a stream gets a final "abort" chunk, an error event and ``[DONE]``; a plain request a 503) and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import logging
import os
import socket
import threading
import time

from ..engine.args import EngineArgs

log = logging.getLogger("dsserve.server")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "served_model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a preset name, a built-in checkpoint or a checkpoint directory (default: --model)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every path under /v1 (/v1/models included) and on "
        "/reset_prefix_cache; /health, /metrics, /version, /tokenize and /detokenize stay open, as in vLLM. Any "
        "of several keys is accepted. Default: $DSSERVE_API_KEY, else $VLLM_API_KEY (an environment variable "
        "keeps the key out of ps)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids clients may use; the first is the one responses report (default: MODEL; for a "
        "checkpoint directory its last path component, so no local path is shown; the full MODEL is accepted too)",
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="multi-node DP: run this node's DP ranks for node 0's front end, no API server (implied by "
        "--node-rank > 0; docs/parallel.md)",
    )
    p.add_argument("--max-waiting", type=int, default=1024, help="queued requests before 503 (default: 1024)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger bodies get 413 (default: 8 MiB)")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a request that sets none (default: the rest of the context, as vLLM's)",
    )
    # vLLM's serving flags, with its spellings
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: warning; info logs every request line)",
    )
    p.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request's id, prompt length and sampling parameters as it arrives (default: off)",
    )
    p.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        help="vLLM's older spelling of --no-enable-log-requests",
    )
    p.add_argument(
        "--disable-log-stats", action="store_true", help="accepted; no effect: dsserve logs no periodic stats lines"
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted, no effect: request tools are always rendered into the prompt and the model's calls parsed "
        "(tool_choice auto is the default; docs/tool_calling.md)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="accepted (e.g. deepseek_v4), no effect: the model's DSML tool calls are always parsed into "
        "tool_calls, in the served model's dialect (V4 or V4.1)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="accepted (e.g. deepseek_v4), no effect: in thinking mode the reasoning is always returned apart, as "
        "reasoning_content (and vLLM's reasoning)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default: 30)",
    )
    p.add_argument(
        "--kernel-manifest",
        default=None,
        metavar="FILE",
        help="a list of the Triton kernels this server compiles: at start, those it lists compile in "
        "parallel worker processes before the model is built; after the warm-up and at shutdown "
        "it is rewritten with every kernel compiled (engine/kernel_manifest.py). Default: none",
    )
    p.add_argument(
        "--precompile-workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes for --kernel-manifest (default: the CPU count, at most 16; 0: in this process)",
    )
    # ---- HTTP compatibility with vLLM's server: CORS (vLLM's flags and defaults) and metric names
    p.add_argument(
        "--allowed-origins",
        type=_name_list,
        default=["*"],
        help='CORS allowed origins, a JSON list or comma-separated (default: ["*"], as vLLM)',
    )
    p.add_argument("--allowed-methods", type=_name_list, default=["*"], help='CORS allowed methods (default: ["*"])')
    p.add_argument("--allowed-headers", type=_name_list, default=["*"], help='CORS allowed headers (default: ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (default: off)")
    p.add_argument(
        "--metrics-names",
        choices=("dsserve", "vllm"),
        default="dsserve",
        help="/metrics names: dsserve:* (default), or vllm: every metric vLLM also has under vLLM's name, type, "
        "buckets and labels (its Grafana dashboard works unchanged); dsserve's own metrics stay dsserve:*",
    )
    EngineArgs.add_cli_args(p)


def api_key_from(ns: argparse.Namespace, environ=os.environ) -> str | None:
    """--api-key, else $DSSERVE_API_KEY, else vLLM's $VLLM_API_KEY; None (no key) when all are unset or empty."""
    return ns.api_key or environ.get("DSSERVE_API_KEY") or environ.get("VLLM_API_KEY") or None


def served_name(model: str, served_model_name: str | list[str] | None) -> str:
    """The id clients see: the first --served-model-name, else MODEL, where a directory shows only its last
    component."""
    return served_names(model, served_model_name)[0]


def served_names(model: str, served_model_name: str | list[str] | None) -> list[str]:
    """Every id a request may name (--served-model-name a b: both; the first is reported)."""
    if served_model_name:
        return [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    return [os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model]


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model is loaded (uvicorn's options: SO_REUSEADDR, IPv6 for a
    host with a colon); a port in use is an OSError of one line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = (
            "is in use (another server?); stop it or pick another --port"
            if e.errno == errno.EADDRINUSE
            else f"cannot be bound: {e}"
        )
        raise OSError(f"port {port} on {host} {why}") from None
    return sock


def _name_list(text: str) -> list[str]:
    """'["a", "b"]' (vLLM's JSON form) or 'a,b'."""
    import json

    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


def cors_options(ns: argparse.Namespace) -> dict:
    """CORSMiddleware's arguments from the flags."""
    return dict(
        allow_origins=ns.allowed_origins,
        allow_methods=ns.allowed_methods,
        allow_headers=ns.allowed_headers,
        allow_credentials=ns.allow_credentials,
    )


# the variables torchrun's agent gives its worker (torch.distributed.elastic's LocalElasticAgent._start_workers)
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def take_torchrun_node(ns: argparse.Namespace, environ=os.environ) -> bool:
    """Under ``torchrun --nnodes N --nproc-per-node 1 --node-rank R --master-addr A --master-port P -m dsserve serve
    ...``: this node's place from torchrun's variables, wherever the flags leave it at its default: --nnodes
    WORLD_SIZE / LOCAL_WORLD_SIZE, --node-rank GROUP_RANK, --master-addr MASTER_ADDR, and with N > 1 --master-port
    P + 1 (the ranks' torch world; --data-parallel-rpc-port, node 0's front end, follows at P + 2), because
    torchrun's agent on node 0 holds P itself (its TCPStore) for as long as it runs. Node 0 then serves HTTP; the
    others run headless.

    The variables are then removed from ``environ``: dsserve spawns its own rank processes and gives each the world it
    joins, and a leftover would mislead them (TORCHELASTIC_USE_AGENT_STORE=True makes every rank a client of a store
    at dsserve's port that no one hosts; WORLD_SIZE / LOCAL_WORLD_SIZE would count other nodes). Returns whether
    torchrun started this process. --nproc-per-node > 1 is refused (SystemExit): one dsserve per node."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return False
    local, world = int(environ.get("LOCAL_WORLD_SIZE", 1)), int(environ.get("WORLD_SIZE", 1))
    if local != 1:
        raise SystemExit(
            f"torchrun --nproc-per-node {local}: run one dsserve per node (--nproc-per-node 1); it spawns its own "
            "rank processes (-dp: the node's share of the DP ranks, -tp: each rank's TP workers)"
        )
    if ns.data_parallel_size_local is None:  # vLLM's form names the node itself
        if ns.nnodes == 1:
            ns.nnodes = world
        if ns.node_rank == 0:
            ns.node_rank = int(environ.get("GROUP_RANK", 0))
    if ns.master_addr is None:
        ns.master_addr = environ.get("MASTER_ADDR")
    if (ns.nnodes > 1 or world > 1) and ns.master_port is None and "MASTER_PORT" in environ:
        ns.master_port = int(environ["MASTER_PORT"]) + 1  # the RPC port's default is one above: P + 2
    for name in TORCHRUN_VARIABLES:
        environ.pop(name, None)
    return True


def run_server(ns: argparse.Namespace) -> int:
    t0 = time.monotonic()
    if take_torchrun_node(ns):
        import signal

        # torchrun's agent passes the SIGTERM / SIGINT it gets (a scheduler, Ctrl-C) to the worker's whole process
        # group, dsserve's rank processes included: they ignore it (the disposition passes to every process spawned
        # from here) and end as on one node, closed by this process once it has drained, or through their death
        # pipes. This process takes the signals again once serving (GracefulServer, serve_headless); the
        # agent's SIGKILL, 30 s on, ends a start-up.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    if ns.headless or ns.node_rank > 0:  # another node's DP ranks, for node 0's front end: no HTTP port here
        return _serve_headless(ns)
    sock = bind(ns.host, ns.port)  # before the model: a port in use should not cost a model load
    try:
        return _serve(ns, sock, t0)
    finally:
        sock.close()


def _serve_headless(ns: argparse.Namespace) -> int:
    from ..distributed.dp_transport import WorldMismatch, serve_headless
    from ..engine.core import log_to_stderr

    if ns.served_model:
        ns.model = ns.served_model
    args = EngineArgs.from_cli(ns)
    if args.nnodes < 2 or args.node_rank == 0:
        raise SystemExit(
            "--headless runs a node's DP ranks for node 0's front end: it needs --nnodes > 1 and --node-rank > 0 "
            "(node 0 runs the front end)"
        )
    log_to_stderr()
    try:
        return serve_headless(args, uniform_routing=args.uniform_routing)
    except WorldMismatch as e:
        raise SystemExit(str(e)) from None


def _serve(ns: argparse.Namespace, sock: socket.socket, t0: float) -> int:
    import uvicorn

    from ..engine import kernel_manifest, warmup
    from ..engine.core import EngineCore, log_to_stderr
    from .app import build_app
    from .async_engine import AsyncEngine
    from .metrics import EngineMetrics

    if ns.served_model:
        ns.model = ns.served_model
    args = EngineArgs.from_cli(ns)
    if ns.precompile_workers is not None and ns.precompile_workers < 0:
        raise SystemExit(f"--precompile-workers must be >= 0, got {ns.precompile_workers}")
    log_to_stderr()
    name = served_name(args.model, ns.served_model_name)  # the reported one
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    log.info("dsserve serve: model %s, served as %r, will listen on %s", args.model, name, url)
    if ns.kernel_manifest:  # before the model: the workers' CUDA contexts are gone when the KV cache is sized
        try:
            kernel_manifest.precompile(
                ns.kernel_manifest,
                kernel_manifest.default_workers() if ns.precompile_workers is None else ns.precompile_workers,
            )
        except (ValueError, OSError) as e:
            raise SystemExit(f"--kernel-manifest {ns.kernel_manifest}: {e}") from None
    if args.uniform_routing and not (args.data_parallel_size > 1 and args.enable_expert_parallel):
        raise SystemExit("--uniform-routing needs -dp > 1 and --enable-expert-parallel (it routes the EP ranks' rows)")
    if args.data_parallel_size > 1:  # one engine core per rank, each in its own process (they warm up alone)
        from ..distributed.dp_client import DPClient

        core = DPClient(args, uniform_routing=args.uniform_routing)
    else:
        core = EngineCore(args)
        if warmup.wanted(args.warmup, core.device):
            warmup.warm_up(core)  # before the port opens: /health answers once the first shapes are compiled
    if ns.kernel_manifest:
        log.info("kernel manifest %s: %d kernels listed", ns.kernel_manifest, kernel_manifest.save(ns.kernel_manifest))
    names = served_names(args.model, ns.served_model_name)
    for note in serving_notes(ns):
        log.info("%s", note)
    defaults = dict(core.default_sampling)  # the checkpoint's generation_config.json (--generation-config)
    if ns.default_max_tokens is not None:
        defaults["max_tokens"] = ns.default_max_tokens
    if defaults:
        log.info("default sampling parameters: %s", defaults)
    metrics = EngineMetrics(model_name=names[0], max_model_len=core.max_model_len, names=ns.metrics_names)
    engine = AsyncEngine(core, ns.max_waiting, metrics)
    app = build_app(
        engine,
        names,
        api_key_from(ns),
        ns.max_body_bytes,
        defaults.pop("max_tokens", None),
        # without --served-model-name, a directory's full path is accepted beside its shown last component; with
        # it, only the served names are (vLLM's rule)
        aliases=() if ns.served_model_name else (args.model, ns.served_model),
        cors=cors_options(ns),
        default_sampling=defaults,
    )
    if ns.enable_log_requests:
        _log_requests(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        engine.shutdown(ns.shutdown_timeout)  # uvicorn has stopped accepting; drain, then abort the rest
        if hasattr(core, "close"):  # DP ranks: stopped, none left behind
            core.close()
        if ns.kernel_manifest:  # with what serving compiled besides the warm-up
            kernel_manifest.save(ns.kernel_manifest)

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(  # uvicorn's own graceful timeout is only a backstop: the engine cuts at the deadline
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.uvicorn_log_level,
        timeout_graceful_shutdown=ns.shutdown_timeout + 5,
    )

    def ready():
        log.info("ready: %s serves %r (start-up took %.1f s)", url, name, time.monotonic() - t0)

    def stopping():
        log.info("shutting down: in-flight requests get %g s (--shutdown-timeout), then are cut", ns.shutdown_timeout)
        engine.begin_drain(ns.shutdown_timeout)

    server = _GracefulServer(config, ready, stopping)

    def stop_when_lost():  # a TP worker or a DP rank died: requests got their 503s; the server exits non-zero
        engine.died.wait()
        server.should_exit = True

    threading.Thread(target=stop_when_lost, name="dsserve-engine-lost", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        core.close()  # the TP workers, if any: stopped and reaped
    gc.freeze()  # the interpreter's exit then skips a last collection over every object: 0.4 s instead of 1.2-2 s
    if engine.death is not None:
        log.error("exiting with status 1: %s", engine.death)
        return 1
    return 0


def serving_notes(ns: argparse.Namespace) -> list[str]:
    """What vLLM's tool, reasoning and stats flags do here today, one line each (logged at start)."""
    out = []
    if ns.enable_auto_tool_choice or ns.tool_call_parser:
        out.append(
            f"tool calling (--tool-call-parser {ns.tool_call_parser}): no effect, the model's DSML tool calls are "
            "always parsed into `tool_calls` (dsserve.parsers, in the served model's dialect)"
        )
    if ns.reasoning_parser:
        out.append(
            f"--reasoning-parser {ns.reasoning_parser}: no effect, in thinking mode the reasoning is always split "
            "into `reasoning_content`"
        )
    if ns.disable_log_stats:
        out.append("--disable-log-stats: no effect, dsserve logs no periodic stats (see /metrics)")
    return out


def _log_requests(engine) -> None:
    """--enable-log-requests: one INFO line per request as it enters the engine."""
    submit = engine.submit

    def logged(request_id, prompt_ids, params, *a, **kw):
        log.info("request %s: %d prompt tokens, %s", request_id, len(prompt_ids), params)
        return submit(request_id, prompt_ids, params, *a, **kw)

    engine.submit = logged


def _graceful_server_class():
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, so the process dies of the signal; a drained
        shutdown is a normal exit here (status 0). ``on_ready`` runs once the socket listens; ``on_stop`` as
        the shutdown begins (uvicorn has stopped its main loop; connections are still open)."""

        def __init__(self, config, on_ready, on_stop):
            super().__init__(config)
            self.on_ready, self.on_stop = on_ready, on_stop

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                self.on_ready()

        async def shutdown(self, sockets=None):
            self.on_stop()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _GracefulServer(config, on_ready, on_stop):  # noqa: N802 - built lazily: importing this module imports no uvicorn
    return _graceful_server_class()(config, on_ready, on_stop)
