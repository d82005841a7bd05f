"""``dsserve serve``: the engine behind uvicorn, with a graceful SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import logging

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
        help="require 'Authorization: Bearer KEY' on /v1 routes; any of several keys is accepted",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids clients may use; the first is the one responses report (default: MODEL)",
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
        help="accepted: request tools are always rendered into the prompt in DSML (server/chat.py)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="accepted (e.g. deepseek_v4); the DSML tool calls the model writes come back as text in content",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="accepted (e.g. deepseek_v4); the reasoning comes back as text in content, up to </think>",
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
    EngineArgs.add_cli_args(p)


def run_server(ns: argparse.Namespace) -> int:
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
    if ns.kernel_manifest:  # before the model: the workers' CUDA contexts are gone when the KV cache is sized
        try:
            kernel_manifest.precompile(
                ns.kernel_manifest,
                kernel_manifest.default_workers() if ns.precompile_workers is None else ns.precompile_workers,
            )
        except (ValueError, OSError) as e:
            raise SystemExit(f"--kernel-manifest {ns.kernel_manifest}: {e}") from None
    core = EngineCore(args)
    if warmup.wanted(args.warmup, core.device):
        warmup.warm_up(core)  # before the port opens: /health answers once the first shapes are compiled and captured
    if ns.kernel_manifest:
        log.info("kernel manifest %s: %d kernels listed", ns.kernel_manifest, kernel_manifest.save(ns.kernel_manifest))
    names = ns.served_model_name or [args.model]
    for note in serving_notes(ns):
        log.info("%s", note)
    defaults = dict(core.default_sampling)  # the checkpoint's generation_config.json (--generation-config)
    if ns.default_max_tokens is not None:
        defaults["max_tokens"] = ns.default_max_tokens
    if defaults:
        log.info("default sampling parameters: %s", defaults)
    engine = AsyncEngine(core, ns.max_waiting, EngineMetrics(model_name=names[0]))
    app = build_app(
        engine, names, ns.api_key, ns.max_body_bytes, defaults.pop("max_tokens", None), default_sampling=defaults
    )
    if ns.enable_log_requests:
        _log_requests(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        engine.shutdown(ns.shutdown_timeout)  # uvicorn has stopped accepting; drain, then abort the rest
        if ns.kernel_manifest:  # with what serving compiled besides the warm-up
            kernel_manifest.save(ns.kernel_manifest)

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.uvicorn_log_level,
        timeout_graceful_shutdown=ns.shutdown_timeout,
    )
    _GracefulServer(config).run()
    return 0


def serving_notes(ns: argparse.Namespace) -> list[str]:
    """What vLLM's tool, reasoning and stats flags do here today, one line each (logged at start)."""
    out = []
    if ns.enable_auto_tool_choice or ns.tool_call_parser:
        out.append(
            f"tool calling (--tool-call-parser {ns.tool_call_parser}): request tools are rendered into the prompt "
            "in DSML; the model's tool calls are returned as text in `content`, not parsed into `tool_calls`"
        )
    if ns.reasoning_parser:
        out.append(
            f"--reasoning-parser {ns.reasoning_parser}: the reasoning is returned as text in `content`, not split "
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
        shutdown is a normal exit here (status 0)."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _GracefulServer(config):  # noqa: N802 - built lazily so importing this module does not import uvicorn
    return _graceful_server_class()(config)
