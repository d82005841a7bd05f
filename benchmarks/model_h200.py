"""The whole model on one H200 (issue 8): decode and prefill against their floors, kernel ratios, a peer.

    python benchmarks/model_h200.py --out benchmarks/results/model-h200
    python benchmarks/model_h200.py --smoke --out /tmp/model-smoke     # CPU, tiny shapes, < 60 s

Sections (each skippable with --skip a,b; the JSON is rewritten after each, so a cut-short run keeps its numbers):
- ceilings: copy bandwidth (bytes read + written), bf16 and fp8 matmul rates, measured in this run;
- decode: the engine's execute path (dsserve.bench.forward) on `proxy-h200-release` with dummy weights, dense
  projections FP8 and routed experts MXFP4 (keep_dense=False), Engram tables in pinned host memory in the FP8
  layout (--engram-tables; host rows prefetched on a side stream), every op through Triton (reference_ops ""), at
  B in {1, 8, 32, 128} x context {8K, 128K}; floor = bytes a step must move / copy bandwidth, where bytes =
  the non-expert weights read once (embedding table, Engram tables and draft modules excluded) + the routed
  experts touched (expected distinct experts of B x top-k draws from E under uniform routing) + per row and
  layer the window and top-k KV rows and the indexer keys scored + the embedding and Engram rows gathered; each
  case timed with the engine's CUDA graphs of decode steps (captured in the warm-up repeat) and eager, and the
  eager step's device-busy time under the profiler;
- prefill: 8K and 32K new tokens cold (in 8K chunks, as the engine chunks) and 8K new on 128K cached; floor =
  the FLOPs (2 x active params per row, the LM head on one row a chunk, + sparse attention over each layer's window
  and selected entries + indexer scoring: a source's indexer scores every visible entry, a consumer's the candidate
  pool; dsserve/bench/floors.py) at the bf16 matmul rate;
- kernels: the bench() of the router, mHC and grouped-MoE kernels (fused vs the unfused torch path) and of
  Engram's lookup if a module provides one; a missing or failing bench is recorded as an error;
- peer: transformers' DeepseekV4ForCausalLM (bf16) against dsserve on the same V4-Flash weights (`v4-flash`
  widths, routed experts cut to fit twice in memory): decode tokens/s at B 1 and 16, prefill tokens/s at 8K.
Timings are medians of few repeats (the whole run must fit 10 minutes). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE, os.path.join(os.path.dirname(HERE), "tests", "models")]

import dsserve.bench.forward as fwd  # noqa: E402
from dsserve.bench import floors  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.args import EngineArgs  # noqa: E402
from dsserve.models.accounting import param_counts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _wall_ms(fn, sets: int = 1, calls: int = 2) -> float:
    """CPU stand-in for device_timing's timers (smoke mode): median wall ms of a few calls."""
    fn(0)
    ts = []
    for i in range(calls):
        t = time.perf_counter()
        fn(i % sets)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def ceilings() -> dict:
    if DEV == "cuda":
        from attention_h200 import ceilings as gpu_ceilings

        return gpu_ceilings()
    n, m = 1 << 24, 256
    a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    x, y = torch.randn(m, m), torch.randn(m, m)
    copy = 2 * n / _wall_ms(lambda _: b.copy_(a), calls=5) / 1e6
    mm = 2 * m**3 / _wall_ms(lambda _: x @ y, calls=5) / 1e9
    return {"copy_GBps": copy, "bf16_TFLOPs": mm, "fp8_TFLOPs": mm}


# ------------------------------------------------------------------ the model under test
def is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name


def model_bytes(cfg, release: bool) -> float:
    """Estimated device bytes of the model: MXFP4 (or bf16) routed experts, bf16 for the rest."""
    pc = param_counts(cfg)
    experts = pc.parts["routed_experts"]
    rest = sum(pc.parts.values()) - experts + pc.engram_tables + pc.draft
    return experts * ((0.5 + 1 / 32) if release else 2) + rest * 2


def reduced(cfg, n: int):
    """``cfg`` cut to at most ``n`` layers: the most that keep a valid schedule (a cut may not leave a layer reading
    its global KV or its index from a layer cut away)."""
    from dsserve.models.config import ConfigError

    for m in range(n, 0, -1):
        try:
            return replace(cfg, num_hidden_layers=m)
        except ConfigError:
            continue
    raise ConfigError(f"config {cfg.name!r}: no cut to {n} layers or fewer keeps a valid schedule")


def build_core(
    cfg_or_name, kv_tokens: tuple[int, int], release: bool, smoke: bool, engram_tables: str = "device", **engine_kw
):
    """An EngineCore around a model built on the device with dummy weights. release: routed experts packed
    MXFP4 layer by layer as they are filled (models.dummy_build: the fp32 experts of all layers never coexist),
    dense FP8, and the Engram tables where `engram_tables` says (an EngineArgs value); `engine_kw`: more EngineArgs
    (speculative_config, ...)."""
    from dsserve.engine.core import EngineCore
    from dsserve.kv.layout import KVLayout
    from dsserve.models.dummy_build import build_dummy_model
    from dsserve.models.loader import LoadedModel, resolve_config
    from dsserve.models.tokenizer import Tokenizer, engram_token_map

    cfg = resolve_config(cfg_or_name) if isinstance(cfg_or_name, str) else cfg_or_name
    dtype = "float32" if DEV == "cpu" else "bfloat16"
    info = {
        "model": cfg.name,
        "layers": cfg.num_hidden_layers,
        "routed_experts": cfg.n_routed_experts,
        "expert_format": "mxfp4" if release else dtype,
        "dense_format": "fp8" if release else dtype,
        "estimated_bytes": model_bytes(cfg, release),
    }
    if DEV == "cuda":
        free = torch.cuda.mem_get_info()[0]
        info["free_bytes"] = free
        if info["estimated_bytes"] > 0.8 * free:  # keep a fifth for KV, activations and Triton workspaces
            n = int(cfg.num_hidden_layers * 0.8 * free / info["estimated_bytes"])
            cfg = reduced(cfg, n)
            info.update(layers=cfg.num_hidden_layers, reduced_layers_to_fit=True)
    tok_name = (
        cfg.name
        if cfg.name in ("tiny", "tiny-v4", "v41-flash", "v4-flash", "proxy-h200")
        else ("v4-flash" if not cfg.is_v41 else "proxy-h200")
    )
    tokenizer = Tokenizer.for_preset(tok_name)
    # release: each layer's experts filled and packed in turn on the device (the dense copies dropped)
    net = build_dummy_model(cfg, 0, "mxfp4" if release else None, DEV, keep_dense=False)
    net = net.to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    token_map = engram_token_map(cfg, tokenizer)
    if token_map is not None:
        net.engram_token_map = torch.as_tensor(token_map, dtype=torch.long)
    lay = KVLayout.build(cfg, None, "auto")
    seqs, tokens = kv_tokens
    blocks = seqs * (math.ceil(tokens / lay.block_size) + 1)
    args = EngineArgs(
        model="tiny",
        dtype=dtype,
        seed=0,
        quantization="fp8" if release else None,
        expert_format="mxfp4" if release else None,
        engram_tables=engram_tables if release else "device",
        max_num_seqs=seqs,
        enable_prefix_caching=False,
        reference_ops="" if DEV == "cuda" else "all",  # the CPU smoke: no interpreted kernels
        kv_cache_memory=blocks * lay.bytes_per_block + seqs * lay.bytes_per_slot + (1 << 20),
        **engine_kw,
    )
    core = EngineCore(args, loaded=LoadedModel(net, cfg, tokenizer, "dummy"))
    if DEV == "cuda":
        info["allocated_bytes"] = torch.cuda.memory_allocated()
    return core, info


def free_core(core) -> None:
    """Drops everything ``core`` holds (its model, caches, graphs and their pools: the drafter's and the runner's
    too), so that the next build has the device's memory back."""
    vars(core).clear()
    fwd.release_noise()
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ floors
def weight_bytes(core) -> tuple[float, float]:
    """(bytes read once per decode step outside the routed experts, bytes of one routed expert of one layer)."""
    skip = ("engram.embed", "dspark", "mtp")
    dense, seen = 0, set()
    for name, t in list(core.model.named_parameters()) + list(core.model.named_buffers()):
        if (
            is_routed_expert(name)
            or any(s in name for s in skip)
            or name == "embed.weight"
            or name.endswith("tid2eid")
            or name.endswith("engram_token_map")
        ):
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:  # views of one weight (the shared expert's fused w13 and its w1, w3)
            continue
        seen.add(storage.data_ptr())
        dense += storage.nbytes()
    per_expert = []
    for layer in core.model.layers:
        p = layer.ffn.expert_weights()
        ts = [t for t in (p.w1, p.w3, p.w2, p.s1, p.s3, p.s2) if t is not None]
        per_expert.append(sum(t.numel() * t.element_size() for t in ts) / ts[0].shape[0])
    return float(dense), sum(per_expert) / len(per_expert)


def kv_rows_read(cfg, model, context: int) -> dict:
    """Per decode row: the KV bytes its attention and indexers read, and its indexer FLOPs (bench/floors.py:
    a source indexer scores every visible index key, a consumer the candidate pool)."""
    return floors.kv_row_bytes(cfg, context)


def expected_experts(n_exp: int, k: int, b: int) -> float:
    """Distinct experts touched by b rows of k distinct uniform draws from n_exp."""
    return n_exp * (1 - (1 - k / n_exp) ** b)


def decode_floor(core, b: int, context: int, ceil: dict) -> dict:
    cfg = core.cfg
    dense, per_expert = weight_bytes(core)
    layers = len(core.model.layers)
    touched = expected_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, b)
    elem = next(core.model.parameters()).element_size()
    kv = kv_rows_read(cfg, core.model, context)
    engram = len(cfg.engram_layer_ids) * cfg.engram_columns * cfg.engram_head_dim * elem
    rows = b * (kv["kv_bytes"] + engram + cfg.hidden_size * elem)
    total = dense + layers * touched * per_expert + rows
    return {
        "floor_bytes": total,
        "floor_ms": total / ceil["copy_GBps"] / 1e6,
        "experts_touched": touched,
        "dense_weight_bytes": dense,
        "expert_bytes": layers * touched * per_expert,
        "row_bytes": rows,
    }


def prefill_flops(core, context: int, new: int) -> float:
    """One chunk's FLOPs (bench/floors.py), the LM head on its last row only, as the engine computes logits."""
    return floors.prefill_flops(core.cfg, context, new, logit_rows=1)


def device_busy(core, b: int, context: int) -> dict:
    """One more decode step under torch.profiler: the device time of its kernels and copies summed (what the step
    would cost with the host's launch path out of the way, as in a CUDA graph), its launch count, the top kernels.
    Eager steps here are bound by the host: thousands of small launches, so wall time and this differ."""
    from torch.profiler import ProfilerActivity, profile

    from dsserve.engine.request import Request
    from dsserve.engine.sampling_params import SamplingParams
    from dsserve.engine.scheduler import ScheduledChunk, StepPlan

    gen, reqs = torch.Generator().manual_seed(1), []
    vocab = core.cfg.vocab_size
    for i in range(b):  # random ids as bench_forward draws them: one id in every row would route every row alike
        ids = torch.randint(3, vocab - 2, (context + 1,), generator=gen).tolist()
        r = Request(f"busy-{i}", ids, SamplingParams(temperature=0, max_tokens=1))
        r.kv = core.kv.new_sequence()
        fwd._fill(core, r, context, 1, gen)
        reqs.append(r)
    _sync()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])) as prof:
        core.runner.execute(StepPlan([ScheduledChunk(r, 1) for r in reqs], []))
        _sync()
    wall_ms = (time.perf_counter() - t) * 1e3
    for r in reqs:
        core.kv.release(r.kv)
    per_kernel, launches = {}, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:  # kernels and copies as the device ran them
            per_kernel[e.name[:60]] = per_kernel.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 1e3
        elif e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
            launches += 1
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]
    # the CPU smoke has no device: the profiled step's wall time stands in
    return {"busy_ms": sum(per_kernel.values()) if DEV == "cuda" else wall_ms, "launches": launches, "top": dict(top)}


# ------------------------------------------------------------------ sections
def decode(plan: dict, ceil: dict, res: dict) -> list[dict]:
    core, info = build_core(
        plan["model"], plan["kv_tokens"], release=True, smoke=SMOKE, engram_tables=plan["engram_tables"]
    )
    info["engram_tables"] = plan["engram_tables"]
    res["decode_model"] = info
    rows = res["decode"] = []  # filled row by row and saved after each: a run cut by its time limit keeps them
    try:
        graphs = core.runner.decode_graphs  # None on the CPU smoke: no capture there
        for ctx in plan["contexts"]:
            for b in plan["batches"]:
                # the engine's default (decode steps as CUDA graphs; the warm-up repeat captures), then eager
                r = fwd.bench_forward(core, b, ctx, 1, plan["repeats"])
                core.runner.decode_graphs = None
                try:
                    e = fwd.bench_forward(core, b, ctx, 1, plan["repeats"]) if graphs is not None else r
                    busy = device_busy(core, b, ctx)
                finally:
                    core.runner.decode_graphs = graphs
                f = decode_floor(core, b, ctx, ceil)
                ms = r.seconds * 1e3
                rows.append(
                    {
                        "B": b,
                        "ctx": ctx,
                        "ms": ms,
                        "graphs": graphs is not None,
                        "eager_ms": e.seconds * 1e3,
                        "eager_over_graph": e.seconds / r.seconds,
                        "tokens_per_s": r.tokens_per_s,
                        "floor_ms": f["floor_ms"],
                        "over_floor": ms / f["floor_ms"],
                        "device_busy_ms": busy["busy_ms"],
                        "busy_over_floor": busy["busy_ms"] / f["floor_ms"],
                        "launches": busy["launches"],
                        "top_kernels_ms": busy["top"],
                        "goal_met": (ms / f["floor_ms"] <= 1.25) if b <= 32 else None,
                        **{k: v for k, v in f.items() if k != "floor_ms"},
                        "eager_stages_ms": {k: v * 1e3 for k, v in e.stages.items()},
                    }
                )
                print(
                    f"decode B={b} ctx={ctx}: {ms:.2f} ms graphs, {e.seconds * 1e3:.2f} eager "
                    f"(floor {f['floor_ms']:.2f})",
                    flush=True,
                )
                save(res)
        if graphs is not None:
            res["decode_graphs"] = graphs.report()
        for new, ctxs in plan["prefill"]:
            secs = flops = 0.0
            for c in ctxs:  # the engine's chunks, each on the cache the previous ones left
                r = fwd.bench_forward(core, 1, c, new, plan["prefill_repeats"])
                secs += r.seconds
                flops += prefill_flops(core, c, new)
            n = new * len(ctxs)
            floor_ms = flops / ceil["bf16_TFLOPs"] / 1e9
            rows.append(
                {
                    "op": "prefill",
                    "new_tokens": n,
                    "cached": ctxs[0],
                    "chunk": new,
                    "ms": secs * 1e3,
                    "tokens_per_s": n / secs,
                    "flops": flops,
                    "floor_ms": floor_ms,
                    "matmul_fraction": floor_ms / (secs * 1e3),
                    "goal_met": floor_ms / (secs * 1e3) >= 0.5,
                }
            )
            print(f"prefill {n} new on {ctxs[0]}: {secs * 1e3:.1f} ms (floor {floor_ms:.1f})", flush=True)
            save(res)
    finally:
        free_core(core)
    return rows


def kernels(plan: dict, ceil: dict, res: dict) -> dict:
    import importlib

    import dsserve.bench.device_timing as dt

    if DEV == "cpu":  # the kernel benches time through CUDA graphs: wall time stands in for the smoke test
        dt.graph_ms = dt.eager_ms = _wall_ms
    out = {}
    for name, mod, kw in plan["kernels"]:
        try:
            m = importlib.import_module(mod)
            fn = getattr(m, "bench", None)
            if DEV == "cpu":  # interpreted kernels at the benches' fixed T = 4096 take minutes: plumbing only
                for op in ("route", "mhc_site", "mhc_expand", "routed_experts"):
                    if hasattr(m, op + "_ref"):
                        setattr(m, op, lambda *a, _r=getattr(m, op + "_ref"), config=None, **k: _r(*a, **k))
            if fn is None:
                raise AttributeError(f"{mod} has no bench()")
            t = time.perf_counter()
            out[name] = {"result": fn(DEV, **kw), "seconds": time.perf_counter() - t}
        except Exception as e:  # one kernel's failure must not cost the others' numbers
            out[name] = {"error": repr(e)}
        print(f"kernels {name}: {'error ' + out[name]['error'] if 'error' in out[name] else 'ok'}", flush=True)
    return out


def peer(plan: dict, ceil: dict, res: dict) -> dict:
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError as e:
        return {"skipped": f"transformers lacks DeepseekV4ForCausalLM: {e}"}
    core, info = build_core(plan["peer_model"], plan["peer_kv_tokens"], release=False, smoke=SMOKE)
    out = {"model": info, "repeats": plan["peer_repeats"], "dsserve_runs": [], "transformers_runs": []}
    try:
        for _ in range(plan["peer_repeats"]):
            run = {}
            for b in (1, 16):
                r = fwd.bench_forward(core, b, plan["peer_ctx"], 1, plan["repeats"])
                run[f"decode_B{b}_tokens_per_s"] = r.tokens_per_s
            r = fwd.bench_forward(core, 1, 0, plan["peer_prefill"], plan["prefill_repeats"])
            run["prefill_tokens_per_s"] = r.tokens_per_s
            out["dsserve_runs"].append(run)
        hf = hf_from_core(core)
    finally:
        free_core(core)
    for _ in range(plan["peer_repeats"]):  # each run times its own decode steps and prefill: the spread is the point
        out["transformers_runs"].append(hf_tokens_per_s(hf, plan["peer_ctx"], plan["peer_prefill"], plan["peer_steps"]))
    del hf
    gc.collect()
    keys = ("decode_B1_tokens_per_s", "decode_B16_tokens_per_s", "prefill_tokens_per_s")
    for side in ("dsserve", "transformers"):
        runs = out[f"{side}_runs"]
        out[side] = {k: statistics.median(r[k] for r in runs) for k in keys}
        out[f"{side}_spread"] = {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in keys}
    for k in keys:  # ratios of medians; the spreads above bound how far each could move
        out[f"{k}_ratio"] = out["dsserve"][k] / out["transformers"][k]
    return out


# ------------------------------------------------------------------ the peer
def hf_from_core(core):
    """transformers' DeepseekV4ForCausalLM holding the dsserve model's weights (renamed through the test bridge),
    built in the model's dtype on its device."""
    from hf_v4_bridge import hf_config_from, release_to_hf_state_dict
    from transformers import DeepseekV4ForCausalLM

    from dsserve.models.checkpoint import model_name_for, release_layout

    sd, rel = core.model.state_dict(), {}
    for name, spec in release_layout(core.cfg).items():
        if spec.quant != "scale":
            mname, e = model_name_for(name)
            rel[name] = sd[mname] if e is None else sd[mname][e]
    hf_sd = release_to_hf_state_dict(rel, core.cfg)
    del sd, rel
    dtype = next(core.model.parameters()).dtype
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16: an fp32 build would need twice the memory
    try:
        with torch.device(DEV):
            hf = DeepseekV4ForCausalLM(hf_config_from(core.cfg)).eval()
    finally:
        torch.set_default_dtype(old)
    hf.load_state_dict(hf_sd, strict=True)
    return hf


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def hf_tokens_per_s(hf, ctx: int, prefill: int, steps: int) -> dict:
    """Decode: B prompts of ctx tokens through the model's cache, then `steps` greedy steps timed; prefill: one
    prompt of `prefill` tokens, timed after a short warm-up."""
    vocab = hf.config.vocab_size
    out = {}
    for b in (1, 16):
        try:
            ids = torch.randint(3, vocab - 2, (b, ctx), device=DEV)
            o = hf(input_ids=ids, use_cache=True)
            cache = o.past_key_values
            nxt = o.logits[:, -1:].argmax(-1)
            o = hf(input_ids=nxt, past_key_values=cache, use_cache=True)  # warm-up step
            _sync()
            t = time.perf_counter()
            for _ in range(steps):
                o = hf(input_ids=o.logits[:, -1:].argmax(-1), past_key_values=o.past_key_values, use_cache=True)
            _sync()
            out[f"decode_B{b}_tokens_per_s"] = b * steps / (time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 -- the peer's failure is a result, not a crash
            out[f"decode_B{b}_error"] = repr(e)
            out[f"decode_B{b}_tokens_per_s"] = float("nan")
        del ids
    try:
        hf(input_ids=torch.randint(3, vocab - 2, (1, 64), device=DEV))
        ids = torch.randint(3, vocab - 2, (1, prefill), device=DEV)
        _sync()
        t = time.perf_counter()
        hf(input_ids=ids, use_cache=False, logits_to_keep=1)
        _sync()
        out["prefill_tokens_per_s"] = prefill / (time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001
        out["prefill_error"] = repr(e)
        out["prefill_tokens_per_s"] = float("nan")
    return out


# ------------------------------------------------------------------ run
def plans(smoke: bool) -> dict:
    from dsserve.models.presets import preset

    if smoke:
        k = [
            ("router", "dsserve.kernels.router", dict(d=64, e=16, k=2, copies=2)),
            ("mhc", "dsserve.kernels.mhc", dict(n=4, d=64, copies=2)),
            (
                "grouped_moe",
                "dsserve.kernels.grouped_moe",
                dict(d=64, inter=64, n_experts=8, k=2, sets=1, tokens=(1, 8)),
            ),
            ("engram", "dsserve.layers.engram_table", dict(table_gb=0.001, tokens=(1, 2))),
        ]
        return {
            "model": "tiny",
            "contexts": (64, 128),
            "batches": (1, 2),
            "kv_tokens": (2, 256),
            "prefill": [(32, [0]), (32, [0, 32]), (32, [128])],
            "repeats": 1,
            "prefill_repeats": 1,
            "kernels": k,
            "peer_model": preset("tiny-v4").with_options(qat=False),
            "peer_kv_tokens": (16, 128),
            "peer_ctx": 32,
            "peer_prefill": 64,
            "peer_steps": 2,
        }
    k = [
        ("router", "dsserve.kernels.router", {}),
        ("mhc", "dsserve.kernels.mhc", {}),
        ("grouped_moe", "dsserve.kernels.grouped_moe", dict(tokens=(1, 8, 32, 128))),
        ("engram", "dsserve.layers.engram_table", dict(table_gb=2.0)),
    ]
    # The peer: V4-Flash widths with 16 routed experts (top-6): about 24 B params, 49 GB in bf16, so the
    # dsserve copy and transformers' copy fit together while the weights are handed over.
    peer_cfg = replace(preset("v4-flash").with_options(qat=False), name="v4-flash-peer16", n_routed_experts=16)
    return {
        "model": "proxy-h200-release",
        "contexts": (8192, 131072),
        "batches": (1, 8, 32, 128),
        "kv_tokens": (128, 131072 + 8192 + 1),
        "prefill": [(8192, [0]), (8192, [0, 8192, 16384, 24576]), (8192, [131072])],
        "repeats": 2,
        "prefill_repeats": 1,
        "kernels": k,
        "peer_model": peer_cfg,
        "peer_kv_tokens": (16, 8192 + 2),
        "peer_ctx": 1024,
        "peer_prefill": 8192,
        "peer_steps": 8,
    }


OUT_JSON = []  # the path main() writes to


def save(res: dict) -> None:
    if OUT_JSON:
        with open(OUT_JSON[0], "w") as f:
            json.dump(res, f, indent=1, default=str)


def _finite(x) -> bool:
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_finite(v) for v in x)
    return not isinstance(x, float) or math.isfinite(x)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    dec = [r for r in res.get("decode", []) if "B" in r]
    for ctx in sorted({r["ctx"] for r in dec}):
        pts = sorted(
            (r["B"], r["ms"], r["floor_ms"], r.get("device_busy_ms", float("nan"))) for r in dec if r["ctx"] == ctx
        )
        (line,) = ax[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"ctx {ctx}: step (graphs)")
        ax[0].plot(
            [p[0] for p in pts],
            [r["eager_ms"] for r in sorted(dec, key=lambda r: r["B"]) if r["ctx"] == ctx],
            "^-.",
            color=line.get_color(),
            alpha=0.5,
            label=f"ctx {ctx}: eager step",
        )
        ax[0].plot(
            [p[0] for p in pts], [p[3] for p in pts], "s--", color=line.get_color(), label=f"ctx {ctx}: device busy"
        )
        ax[0].plot([p[0] for p in pts], [p[2] for p in pts], ":", color=line.get_color())
    ax[0].set(
        xscale="log",
        yscale="log",
        xlabel="batch",
        ylabel="ms per decode step",
        title="whole-model decode (dotted: bytes floor)",
    )
    if dec:
        ax[0].legend()
    pre = [r for r in res.get("decode", []) if r.get("op") == "prefill"]
    ax[1].barh([f"{r['new_tokens']} new on {r['cached']}" for r in pre], [r["matmul_fraction"] for r in pre])
    ax[1].axvline(0.5, ls=":", color="k")
    ax[1].set(xlabel="fraction of the measured matmul rate", title="prefill")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/model-h200")
    p.add_argument("--skip", default="", help="comma list of sections to skip: decode,prefill,kernels,peer")
    p.add_argument("--smoke", action="store_true", help="every section on tiny shapes (CPU ok), < 60 s")
    p.add_argument(
        "--batches", default="", help="decode batch sizes, comma list (default 1,8,32,128; none: prefill only)"
    )
    p.add_argument("--contexts", default="", help="decode contexts, comma list (default 8192,131072)")
    p.add_argument("--peer-repeats", type=int, default=5, help="timed runs of each peer side (median and spread)")
    p.add_argument("--engram-tables", default="host-fp8", help="where the proxy's Engram tables live (EngineArgs)")
    a = p.parse_args()
    skip = set(a.skip.split(",")) - {""}
    torch.manual_seed(0)
    plan = plans(a.smoke)
    plan["engram_tables"] = a.engram_tables
    plan["peer_repeats"] = 1 if a.smoke else a.peer_repeats
    for key, val in (("batches", a.batches), ("contexts", a.contexts)):
        if val:
            plan[key] = () if val == "none" else tuple(int(v) for v in val.split(","))
    if "prefill" in skip:
        plan["prefill"] = []
    res = {
        "meta": run_meta(smoke=a.smoke),
        "ceilings": ceilings(),
        "seconds": {},
    }
    os.makedirs(a.out, exist_ok=True)
    OUT_JSON.append(os.path.join(a.out, "model.json"))
    for name, fn in (("decode", decode), ("kernels", kernels), ("peer", peer)):
        if name in skip:
            continue
        t = time.perf_counter()
        try:
            res[name] = fn(plan, res["ceilings"], res)
        except Exception as e:  # keep the other sections' numbers; the error is part of the result
            res.setdefault("errors", {})[name] = repr(e)
            print(f"section {name} failed: {e!r}", flush=True)
        res["seconds"][name] = time.perf_counter() - t
        save(res)
    c = res["ceilings"]
    print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, bf16 {c['bf16_TFLOPs']:.1f} TFLOP/s, fp8 {c['fp8_TFLOPs']:.1f}")
    print(
        f"{'case':34s} {'ms':>10s} {'floor ms':>10s} {'ratio':>7s} {'tok/s':>10s} {'busy ms':>9s} {'ratio':>7s} "
        f"{'eager ms':>9s}"
    )
    for r in res.get("decode", []):
        if "B" in r:
            print(
                f"{'decode B=%d ctx=%d' % (r['B'], r['ctx']):34s} {r['ms']:10.2f} {r['floor_ms']:10.2f} "
                f"{r['over_floor']:6.2f}x {r['tokens_per_s']:10.0f} {r['device_busy_ms']:9.2f} "
                f"{r['busy_over_floor']:6.2f}x {r['eager_ms']:9.2f}"
            )
        else:
            print(
                f"{'prefill %d new on %d' % (r['new_tokens'], r['cached']):34s} {r['ms']:10.1f} "
                f"{r['floor_ms']:10.1f} {r['matmul_fraction']:6.0%}  {r['tokens_per_s']:10.0f}"
            )
    for name, r in res.get("kernels", {}).items():
        print(f"kernel {name}: " + (r["error"] if "error" in r else json.dumps(r["result"], default=str)[:300]))
    peer_res = res.get("peer", {})
    for k, v in peer_res.get("dsserve", {}).items():
        lo, hi = peer_res["transformers_spread"][k]
        print(f"peer {k}: dsserve {v:,.1f}  transformers {peer_res['transformers'][k]:,.1f} (runs {lo:,.1f}-{hi:,.1f})")
    if "decode" in res:
        plot(res, os.path.join(a.out, "model.png"))
    save(res)
    summary = {
        "ceilings": c,
        "errors": res.get("errors", {}),
        "finite": _finite({k: res.get(k) for k in ("decode", "peer")}),
        "sections": [k for k in ("decode", "kernels", "peer") if k in res],
    }
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
