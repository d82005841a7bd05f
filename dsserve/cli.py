"""The ``dsserve`` command line.

Each subcommand is a row of ``COMMANDS``: its name, its one-line help and the function that adds its arguments and
sets ``func``. Only the subcommand on the command line gets its arguments built, so ``dsserve --help`` imports
neither torch nor the server, and one subcommand's optional imports never break another.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_USAGE = 2


def load_model_config(model: str):
    """MODEL is a preset name, a built-in checkpoint, a checkpoint directory or a Hugging Face id."""
    from .models.hub import resolve_model
    from .models.loader import resolve_config

    return resolve_config(resolve_model(model))


def _fmt_params(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:,.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:,.2f} M"
    return f"{n:,.0f}"


def _fmt_bytes(n: float) -> str:
    exact = f"{n:,.0f} B" if n == int(n) else f"{n:,.2f} B"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{exact} ({n / div:,.2f} {unit})"
    return exact


# ------------------------------------------------------------------ info

_PART_LABELS = {
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "attention": "attention",
    "embed_head": "embed + head + final norm",
    "mhc": "mHC",
    "router_compressor_indexer_norms": "routers, compressors, indexers, norms",
    "engram_projections": "Engram projections",
}


def cmd_info(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .models.accounting import kv_bytes, param_counts

    cfg = load_model_config(args.model)
    con = Console(width=max(Console().width, 120))
    pc, kv = param_counts(cfg), kv_bytes(cfg)

    t = Table(title=f"{cfg.name} ({cfg.family})", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    rows = [
        (
            "layers",
            f"{cfg.num_hidden_layers}"
            + (
                f" (encoder 0–{cfg.encoder_layers - 1}, decoder {cfg.encoder_layers}–{cfg.num_hidden_layers - 1})"
                if cfg.is_v41
                else ""
            ),
        ),
        ("hidden / vocab", f"{cfg.hidden_size} / {cfg.vocab_size}"),
        (
            "attention",
            f"{cfg.num_attention_heads} heads × {cfg.head_dim} (rope {cfg.qk_rope_head_dim}), "
            f"q_lora {cfg.q_lora_rank}, o {cfg.o_groups}×{cfg.o_lora_rank}, window {cfg.sliding_window}",
        ),
        ("indexer", f"{cfg.index_n_heads} × {cfg.index_head_dim}, top-{cfg.index_topk}"),
        (
            "MoE",
            f"{cfg.n_routed_experts} routed (top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} shared, "
            f"width {cfg.moe_intermediate_size}"
            + (f", {cfg.num_hash_layers} hash layers" if cfg.num_hash_layers else ""),
        ),
        ("mHC", f"{cfg.hc_mult} copies, {cfg.hc_sinkhorn_iters} Sinkhorn iters"),
        ("rms_norm_eps", f"{cfg.rms_norm_eps:g}"),
    ]
    if cfg.engram_layer_ids:
        from .layers.engram_hash import engram_rows_per_layer

        er = engram_rows_per_layer(cfg)
        rows.append(
            (
                "Engram",
                f"layers {list(cfg.engram_layer_ids)}, orders {list(cfg.engram_orders)} × "
                f"{cfg.engram_n_heads} heads × {cfg.engram_head_dim}; rows "
                + ", ".join(f"L{k}: {v:,}" for k, v in er.items()),
            )
        )
    if cfg.is_v41:
        rows.append(
            (
                "DSpark",
                f"{cfg.num_nextn_predict_layers} stages, block {cfg.dspark_block_size}, "
                f"{cfg.dspark_n_routed_experts} experts top-{cfg.dspark_num_experts_per_tok}, "
                f"taps {list(cfg.dspark_target_layer_ids)}",
            )
        )
    elif cfg.num_nextn_predict_layers:
        rows.append(("MTP", f"{cfg.num_nextn_predict_layers} layer(s)"))
    rows.append(
        (
            "quantisation",
            f"dense FP8 {cfg.weight_block_size}×{cfg.weight_block_size}, experts "
            f"{cfg.expert_dtype}, QAT {'on' if cfg.qat else 'off'}",
        )
    )
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)

    rt = Table(title="layer roles")
    for col in ("layer", "side", "mode", "ratio", "KV source", "index source", "extras"):
        rt.add_column(col, justify="right" if col in ("layer", "ratio") else "left")
    dash = lambda x: "–" if x is None else str(x)  # noqa: E731
    for r in cfg.roles:
        rt.add_row(str(r.index), r.side, r.mode, str(r.ratio), dash(r.kv_source), dash(r.index_source), r.extras)
    con.print(rt)

    pt = Table(title="parameters")
    pt.add_column("part")
    pt.add_column("params", justify="right")
    for k, v in pc.parts.items():
        pt.add_row(_PART_LABELS.get(k, k), _fmt_params(v))
    pt.add_row("[bold]backbone[/bold]", f"[bold]{_fmt_params(pc.backbone)}[/bold]")
    if pc.engram_tables:
        pt.add_row("Engram tables", _fmt_params(pc.engram_tables))
    pt.add_row("DSpark" if cfg.is_v41 else "MTP", _fmt_params(pc.draft))
    pt.add_row("[bold]total[/bold]", f"[bold]{_fmt_params(pc.total)}[/bold] ({pc.total:,})")
    pt.add_row("active / prefill token" + (" (CED)" if cfg.is_v41 else ""), _fmt_params(pc.active_prefill))
    pt.add_row("active / decode token", _fmt_params(pc.active_decode))
    con.print(pt)

    kt = Table(title="KV cache")
    kt.add_column("kind")
    kt.add_column("bytes", justify="right")
    kt.add_row(f"global main KV / token ({kv.main_entry} B/entry)", _fmt_bytes(kv.main_per_token))
    kt.add_row(f"global index K / token ({kv.index_entry} B/entry)", _fmt_bytes(kv.index_per_token))
    kt.add_row("[bold]global / token[/bold]", f"[bold]{_fmt_bytes(kv.global_per_token)}[/bold]")
    kt.add_row("global / token, BF16 debug layout", _fmt_bytes(kv.bf16_global_per_token))
    kt.add_row(
        f"SWA ring / sequence ({kv.swa_row} B/row × {cfg.sliding_window} × {cfg.num_hidden_layers})",
        _fmt_bytes(kv.swa_per_sequence),
    )
    kt.add_row("draft SWA rings / sequence", _fmt_bytes(kv.draft_swa_per_sequence))
    kt.add_row("compressor state / sequence", _fmt_bytes(kv.compressor_state_per_sequence))
    con.print(kt)
    return 0


def _add_info(p):
    p.add_argument(
        "model", metavar="MODEL", help="a preset name, a built-in checkpoint (tiny-trained) or a checkpoint directory"
    )
    p.set_defaults(func=cmd_info)


# ------------------------------------------------------------------ generate


def cmd_generate(args) -> int:
    import time

    from .engine.args import EngineArgs
    from .engine.llm import LLM
    from .engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = ["The quick brown fox"]
    llm = LLM(**vars(EngineArgs.from_cli(args)))
    if llm.engine.args.load_format == "auto" and not os.path.isdir(llm.engine.model_path):
        print(
            f"[{args.model}: seeded random weights (--load-format dummy); the text is not meaningful]", file=sys.stderr
        )
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for o in outs:
        print(f"{o.prompt}{o.outputs[0].text}")
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    print(
        f"[{len(outs)} requests: {n_in} prompt + {n_out} generated tokens in {dt:.2f} s, "
        f"{n_out / dt:.1f} output tokens/s]",
        file=sys.stderr,
    )
    return 0


def _add_generate(p):
    from .engine.args import EngineArgs

    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_generate)


# ------------------------------------------------------------------ serve


def _add_serve(p):
    from .server.serve import add_serve_args, run_server

    add_serve_args(p)
    p.set_defaults(func=run_server)


# ------------------------------------------------------------------ bench


def _add_bench_forward(p):
    from .bench.forward import add_bench_forward_args, run_bench_forward

    add_bench_forward_args(p)
    p.set_defaults(func=run_bench_forward)


def _add_bench_agentx(p):
    from .bench.agentx import add_bench_agentx_args, run_bench_agentx

    add_bench_agentx_args(p)
    p.set_defaults(func=run_bench_agentx)


def _add_bench_latency(p):
    from .bench.offline import add_bench_latency_args, run_bench_latency

    add_bench_latency_args(p)
    p.set_defaults(func=run_bench_latency)


def _add_bench_throughput(p):
    from .bench.offline import add_bench_throughput_args, run_bench_throughput

    add_bench_throughput_args(p)
    p.set_defaults(func=run_bench_throughput)


def _add_router(p):
    from .disagg.router import add_router_args, run_router

    add_router_args(p)
    p.set_defaults(func=run_router)


def _add_bench_serve(p):
    from .bench.serve import add_bench_serve_args, run_bench_serve

    add_bench_serve_args(p)
    p.set_defaults(func=run_bench_serve)


BENCH_KINDS = {
    "forward": ("time the execute path on an exact batch (B requests at context C)", _add_bench_forward),
    "agentx": ("closed-loop AgentX-like trace replay against an OpenAI-compatible server", _add_bench_agentx),
    "latency": ("in-process: time one batch generating a fixed number of tokens", _add_bench_latency),
    "throughput": ("in-process: tokens/s for N prompts submitted at once", _add_bench_throughput),
    "serve": (
        "vLLM's bench serve: TTFT/TPOT/ITL/E2EL and throughput against an OpenAI-compatible server",
        _add_bench_serve,
    ),
}


# ------------------------------------------------------------------ eval


def _add_eval(p):
    from .bench.eval import add_eval_args, run_eval

    add_eval_args(p)
    p.set_defaults(func=run_eval)


def _add_plan(p):
    from .models.memory_plan import add_plan_args, run_plan

    add_plan_args(p)
    p.set_defaults(func=run_plan)


# ------------------------------------------------------------------ entry point


COMMANDS = {
    "info": ("print a model's config, layer roles, parameter counts and KV bytes", _add_info),
    "plan": ("per-GPU weight, KV and host bytes of a model on a machine and layout, and whether it fits", _add_plan),
    "generate": ("generate text for one or more prompts with the batched engine", _add_generate),
    "serve": ("serve the model over an OpenAI-compatible HTTP API", _add_serve),
    "router": (
        "an OpenAI-compatible front over prefill and decode instances (P/D disaggregation, docs/disaggregation.md)",
        _add_router,
    ),
    "bench": ("benchmarks", BENCH_KINDS),
    "eval": (
        "accuracy on held-out synthetic problems (arithmetic, retrieval, chat), "
        "bounded replay off / on, cold / after a prefix hit",
        _add_eval,
    ),
}


def _add_chosen(sub, table: dict, argv: list[str]) -> None:
    """Add every name of ``table`` as a subparser; build the arguments of the one that ``argv`` names first (a
    nested table is a level of subcommands, as ``bench KIND``). The others stay bare: a listing shows only their
    help line, and their imports are not made."""
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_line, build) in table.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name != chosen:
            continue
        if isinstance(build, dict):
            _add_chosen(p.add_subparsers(dest=name, metavar="KIND"), build, argv[argv.index(name) + 1 :])
        else:
            build(p)


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsserve", description="DeepSeek-V4.1-Flash / V4-Flash serving engine")
    _add_chosen(ap.add_subparsers(dest="command", metavar="COMMAND"), COMMANDS, argv)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = _build_parser(argv)
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    from .models.checkpoint import CheckpointError
    from .models.config import ConfigError
    from .models.model import ModelInputError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ModelInputError, ValueError, OSError) as e:  # user input: no traceback
        print(f"dsserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
