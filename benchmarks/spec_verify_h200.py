"""DSpark speculative decoding's step costs on one H200 (issue 56): the verify step (graphed and eager) against a
plain decode step (graphed) at B = 1..32 and K = 3, 5, the draft proposal batched and one request at a time, the
rejection sampler, and the output tokens/s each mean acceptance length would give.

    python benchmarks/spec_verify_h200.py --out $OUT/spec-verify-h200          # the H200, < 4 minutes
    python benchmarks/spec_verify_h200.py --propose-only --out $OUT/propose    # the proposal paths alone
    python benchmarks/spec_verify_h200.py --smoke --out /tmp/spec-verify-smoke  # CPU, tiny shapes, < 2 minutes
    python benchmarks/spec_verify_h200.py --engine-proxy 1,8 --out $OUT/sv     # + the engine on the proxy, off vs on
    python benchmarks/spec_verify_h200.py --engine-proxy-only --out $OUT/ep     # that engine run alone

On `proxy-h200-release` with dummy weights (dense FP8, routed experts MXFP4, every op through Triton: the engine's
release forms, as benchmarks/model_h200.py builds them), each request with `--context` tokens of synthetic cache
(dsserve.bench.forward), per K and B:
- decode: the engine's plain decode step (one row a request) through its decode graphs (CUDA graphs);
- verify: the step that verifies K drafts a request (1 + K rows a request, the engine's runner) through the verify
  graphs (engine.verify_graphs, CUDA graphs) and eager (forward_batch), each followed by its rollback
  (SequenceKV.save_rows / rollback, as the engine does after a step that accepted nothing); the two steps' logits
  are compared in the same run (argmax agreement, largest difference);
- rejection: the rejection sampler on the verify step's [B (1 + K), V] logits (greedy rows);
- propose: the DSpark stages drafting the next block for each request (each with a full ring), batched and eager
  (DSpark.propose_batch on the torch ops, the drafter's path before proposal graphs), batched and eager on the kernel
  ops, from CUDA graphs (Drafter.propose through engine.propose_graphs.ProposeGraphs, its drafts read back: the
  engine's path on a GPU, after a warm-up call that captures the bucket), and one request at a time (DSpark.propose
  per request); the graph's drafts are compared with the kernel-op batched ones (the same ops: expected equal) and
  the torch-op ones (bf16 rounding);
- per mean acceptance length L in 1..K + 1 (tokens a verified block gives): output tokens/s = B L / (verify +
  rejection + propose), graphed verify with the proposal graph (the engine's path on a GPU; the batched proposal
  where the graph failed) and eager verify with per-request proposal (before), against B / decode (graphs);
  `breakeven_L` is the L where drafting starts to pay.
`--propose-only` times the proposal paths alone (no KV cache filled, no decode or verify step; default K = 5 and
B = 1, 8, 32), then the engine check: on the proxy that is the build (about a minute) and a few seconds a case.
Every step above is timed the same way: medians of `--repeats` runs after a warm-up run (which captures the graph),
synchronised on the device. Cases run in order until `--budget-s` has passed (the rest are listed as skipped).
Then an end-to-end check (`engine_check`): the engine on the built-in trained model (tiny-trained), 8 problems at
once (4 with --smoke), greedy, drafts off and on (K = the largest of `--ks`): same tokens, the steps that ran in
verify graphs, the mean acceptance length and both arms' output rates. Prints a line per case, then the JSON path
(spec_verify.json with run_meta provenance and the copy / matmul ceilings of this run). `--smoke` (the CPU) runs the
same code with the paged path on the torch reference ops and fixed-shape steps without capture. `--engine-proxy B,..`
adds the engine itself on the proxy, drafts off and on (`engine_proxy`): with the proxy's random drafter nothing is
accepted, so its decode phase times a whole drafting step as the engine runs it, host included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

SMOKE = "--smoke" in sys.argv
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import dsserve.bench.forward as fwd  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.drafter import Drafter  # noqa: E402
from dsserve.engine.propose_graphs import ProposeGraphs  # noqa: E402
from dsserve.engine.request import Request  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.engine.scheduler import ScheduledChunk, StepPlan  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up call, synchronised."""
    fn()
    ts = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def requests(core, b: int, context: int, rows: int, gen: torch.Generator, fill: bool = True) -> list[Request]:
    """``b`` requests of ``context`` tokens and one output token; ``fill``: with a cache of synthetic context (else
    no cache: enough for the proposal, which reads only the DSpark rings)."""
    cfg = core.cfg
    out = []
    for i in range(b):
        ids = torch.randint(3, cfg.vocab_size - 2, (context + 1,), generator=gen).tolist()
        r = Request(f"spec-{i}", ids[:-1], SamplingParams(temperature=0, max_tokens=64))
        r.output_token_ids.append(ids[-1])
        if fill:
            r.kv = core.kv.new_sequence()
            fwd._fill(core, r, context, rows, gen)
        out.append(r)
    return out


def ingest_noise(core, drafter: Drafter, r: Request, gen: torch.Generator) -> None:
    """A full DSpark ring for ``r`` (synthetic taps of its last window positions), so proposing reads a real window."""
    cfg = core.cfg
    w = cfg.sliding_window
    p = r.num_tokens - 2
    taps = {
        layer: torch.randn(w, cfg.hidden_size, generator=gen).to(core.device, core.model.embed.weight.dtype)
        for layer in cfg.dspark_target_layer_ids
    }
    r.draft_state = drafter.mtp.new_state()
    drafter.mtp.ingest(taps, torch.arange(p - w + 1, p + 1), r.draft_state)


def propose_one_at_a_time(drafter: Drafter, reqs: list[Request]) -> None:
    """The drafter's proposal one request at a time (DSpark.propose each, its drafts read back each)."""
    m = drafter.model
    for r in reqs:
        d, _, _ = drafter.mtp.propose(r.output_token_ids[-1], r.num_tokens - 2, r.draft_state, m.embed, m.head)
        r.draft_token_ids = d[: drafter.k].tolist()


def propose_batched(drafter: Drafter, reqs: list[Request], ops=None) -> None:
    """The batched pass (``DSpark.propose_batch``, eager, on the torch ops or ``ops``), its drafts read back."""
    m = drafter.model
    ys = [r.output_token_ids[-1] for r in reqs]
    ps, states = [r.num_tokens - 2 for r in reqs], [r.draft_state for r in reqs]
    drafts, _ = drafter.mtp.propose_batch(ys, ps, states, m.embed, m.head, ops=ops)
    for r, d in zip(reqs, drafts[:, : drafter.k].tolist()):
        r.draft_token_ids = d


def propose_as_the_engine(drafter: Drafter, reqs: list[Request]) -> None:
    """``Drafter.propose`` as the engine calls it (its tokens and positions on the device; with proposal graphs its
    pass replayed), then its drafts read back and handed out."""
    dev = drafter.model.embed.weight.device
    ys = torch.tensor([r.output_token_ids[-1] for r in reqs], device=dev)
    ps = torch.tensor([r.num_tokens - 2 for r in reqs], device=dev)
    proposal = drafter.propose(reqs, ys, ps)
    Drafter.hand_out(reqs, proposal, [t.cpu() for t in proposal.tensors()])


def propose_times(core, drafter: Drafter, graphs: ProposeGraphs, reqs: list[Request], gen, repeats: int) -> dict:
    """The proposal of every request's next block (each given a full ring first): batched on the torch ops (the
    drafter without graphs), batched on the kernel ops, from the proposal graphs (after a warm-up call that
    captures), one request at a time; the graph's drafts against both batched ones'. Times in seconds."""
    for r in reqs:
        ingest_noise(core, drafter, r, gen)
    b, out = len(reqs), {}

    def drafts() -> list[list[int]]:
        return [list(r.draft_token_ids) for r in reqs]

    out["batched"] = timed(lambda: propose_batched(drafter, reqs), repeats)
    torch_ops = drafts()
    out["batched_kernel_ops_error"], kernel_ops = None, None
    try:
        out["batched_kernel_ops"] = timed(lambda: propose_batched(drafter, reqs, drafter.model.kernel_ops), repeats)
        kernel_ops = drafts()
    except Exception as e:  # recorded; the graph (the same ops) is still tried
        traceback.print_exc()
        out["batched_kernel_ops_error"], out["batched_kernel_ops"] = f"{type(e).__name__}: {e}", float("nan")
    graph_drafter = Drafter(drafter.model, drafter.k, core.stats, graphs=graphs)
    out["graph_error"] = None
    replays = graphs.replays
    try:
        out["graph"] = timed(lambda: propose_as_the_engine(graph_drafter, reqs), repeats)
        if graphs.capture is not None and graphs.replays != replays + repeats + 1:
            raise RuntimeError(f"the proposal did not replay its graph: {graphs.report()}")
        graph = drafts()
        if kernel_ops is not None:
            out["graph_same_drafts_as_kernel_ops"] = sum(g == k for g, k in zip(graph, kernel_ops)) / b
        out["graph_same_drafts_as_torch_ops"] = sum(g == t for g, t in zip(graph, torch_ops)) / b
    except Exception as e:  # recorded, and the other numbers still taken: the GPU run is not repeated lightly
        traceback.print_exc()
        out["graph_error"], out["graph"] = f"{type(e).__name__}: {e}", float("nan")
    out["one_at_a_time"] = timed(lambda: propose_one_at_a_time(drafter, reqs), repeats)
    out["batched_same_drafts_as_one_at_a_time"] = sum(list(r.draft_token_ids) == d for r, d in zip(reqs, torch_ops)) / b
    return out


def propose_row(t: dict) -> dict:
    """The JSON columns of ``propose_times``."""
    return {
        "propose_batched_ms": t["batched"] * 1e3,
        "propose_batched_kernel_ops_ms": t["batched_kernel_ops"] * 1e3,
        "propose_batched_kernel_ops_error": t["batched_kernel_ops_error"],
        "propose_graph_ms": t["graph"] * 1e3,
        "propose_graph_error": t["graph_error"],  # then the tok/s columns use the batched proposal
        "propose_one_at_a_time_ms": t["one_at_a_time"] * 1e3,
        "propose_batched_same_drafts": t["batched_same_drafts_as_one_at_a_time"],
        "propose_graph_same_drafts_as_kernel_ops": t.get("graph_same_drafts_as_kernel_ops"),
        "propose_graph_same_drafts_as_torch_ops": t.get("graph_same_drafts_as_torch_ops"),
    }


def propose_line(t: dict) -> str:
    same = t.get("graph_same_drafts_as_kernel_ops")
    return (
        f"propose batched {t['batched'] * 1e3:.2f} (kernel ops {t['batched_kernel_ops'] * 1e3:.2f}), graph "
        f"{t['graph'] * 1e3:.2f}, one at a time {t['one_at_a_time'] * 1e3:.2f} ms (graph same drafts as kernel "
        f"ops {same if same is None else f'{same:.2f}'}, as torch ops "
        f"{t.get('graph_same_drafts_as_torch_ops') or 0:.2f}; batched as one at a time "
        f"{t['batched_same_drafts_as_one_at_a_time']:.2f})"
    )


def propose_case(core, drafter: Drafter, graphs: ProposeGraphs, b: int, context: int, repeats: int) -> dict:
    """``--propose-only``: the proposal paths alone at B = ``b`` (requests without a cache)."""
    gen = torch.Generator().manual_seed(b)
    t = propose_times(core, drafter, graphs, requests(core, b, context, 0, gen, fill=False), gen, repeats)
    print(f"K={drafter.k} B={b}: " + propose_line(t), flush=True)
    return {"B": b, "ctx": context, "k": drafter.k, **propose_row(t)}


def step_timer(core, reqs: list[Request], plan: StepPlan, context: int, holder: dict):
    """One step of ``plan`` through the runner, then every row rolled back (the next repeat starts where this
    did): a decode (one row a request) or a verify step (1 + K)."""

    def step():
        for c in plan.chunks:
            c.request.kv.save_rows(context, c.num_tokens)
        holder["out"] = core.runner.execute(plan)
        for c in plan.chunks:
            r = c.request
            r.kv.rollback(context, r.all_token_ids)
            core.kv.grow(r.kv, context + c.num_tokens)

    return step


def case(core, drafter: Drafter, verify_graphs, graphs: ProposeGraphs, b: int, context: int, repeats: int) -> dict:
    k = drafter.k
    gen = torch.Generator().manual_seed(b)
    runner = core.runner
    reqs = requests(core, b, context, 1 + k, gen)
    drafts = [torch.randint(3, core.cfg.vocab_size - 2, (k,), generator=gen).tolist() for _ in reqs]
    decode, out = StepPlan([ScheduledChunk(r, 1) for r in reqs], []), {}
    verify = StepPlan([ScheduledChunk(r, 1 + k, d) for r, d in zip(reqs, drafts)], [])
    graph_steps = runner.graph_steps
    t_decode = timed(step_timer(core, reqs, decode, context, out), repeats)
    assert runner.graph_steps == graph_steps + repeats + 1, "the decode step did not run in fixed shapes"
    runner.verify_graphs, graph_error = verify_graphs, None
    runs = verify_graphs.runs
    try:
        t_verify_graph = timed(step_timer(core, reqs, verify, context, out), repeats)
        if verify_graphs.runs != runs + repeats + 1:
            raise RuntimeError(f"the verify step did not run in fixed shapes: {verify_graphs.report()['fallbacks']}")
        _, logits_graph = out["out"]
    except Exception as e:  # recorded, and the eager numbers still taken: the GPU run is not repeated lightly
        traceback.print_exc()
        graph_error, t_verify_graph, logits_graph = f"{type(e).__name__}: {e}", float("nan"), None
        for r in reqs:  # the failed step's rows, if it got that far
            if r.kv._saved is not None:
                r.kv.rollback(context, r.all_token_ids)
            core.kv.grow(r.kv, context + 1 + k)
    runner.verify_graphs = None
    t_verify_eager = timed(step_timer(core, reqs, verify, context, out), repeats)
    sampling, logits_eager = out["out"]
    e = logits_eager.float()
    a = e if logits_graph is None else logits_graph.float()
    agree = float((a.argmax(-1) == e.argmax(-1)).float().mean())
    diff = float((a - e).abs().max())
    t_reject = timed(lambda: core.rejection_sampler(a, sampling, drafts), repeats)
    prop = propose_times(core, drafter, graphs, reqs, gen, repeats)
    for r in reqs:
        core.kv.release(r.kv)
    t_propose = prop["batched"] if prop["graph_error"] else prop["graph"]
    spec = (t_verify_eager if graph_error else t_verify_graph) + t_reject + t_propose
    before = t_verify_eager + t_reject + prop["one_at_a_time"]
    plain = b / t_decode
    by_len = {str(L): b * L / spec for L in range(1, k + 2)}
    breakeven = next((L for L in range(1, k + 2) if b * L / spec >= plain), None)
    row = {
        "B": b,
        "ctx": context,
        "k": k,
        "decode_graph_ms": t_decode * 1e3,
        "verify_graph_ms": t_verify_graph * 1e3,
        "verify_eager_ms": t_verify_eager * 1e3,
        "verify_graph_over_decode_graph": t_verify_graph / t_decode,
        "verify_eager_over_verify_graph": t_verify_eager / t_verify_graph,
        "verify_graph_error": graph_error,  # then the graphed columns are the eager step's
        "verify_graph_vs_eager_argmax_agree": agree,
        "verify_graph_vs_eager_max_abs_logit_diff": diff,
        "rejection_ms": t_reject * 1e3,
        **propose_row(prop),
        "decode_tok_per_s": plain,
        "spec_tok_per_s_by_mean_acceptance_length": by_len,
        "spec_tok_per_s_by_mean_acceptance_length_eager_one_at_a_time": {
            str(L): b * L / before for L in range(1, k + 2)
        },
        "breakeven_L": breakeven,
    }
    print(
        f"K={k} B={b} ctx={context}: decode graph {t_decode * 1e3:.2f} ms; verify graph {t_verify_graph * 1e3:.2f}, "
        f"eager {t_verify_eager * 1e3:.2f} (argmax agree {agree:.3f}, max |diff| {diff:.3g}); rejection "
        f"{t_reject * 1e3:.2f} ms; breakeven L {breakeven}",
        flush=True,
    )
    print("  " + propose_line(prop))
    which = "batched proposal" if prop["graph_error"] else "proposal graph"
    print(
        f"  tok/s by L ({which}): " + ", ".join(f"L={L} {v:.0f}" for L, v in by_len.items()) + f"; decode {plain:.0f}"
    )
    return row


def engine_check(smoke: bool, k: int, max_tokens: int = 32) -> dict:
    """The engine end to end on the built-in trained model (tiny-trained: real DSpark acceptance): 8 held-out
    arithmetic problems at once, greedy, drafts off then on (K = ``k``). On the GPU the engine's own graphs (decode
    graphs drafts off, verify and proposal graphs drafts on, captured on first use); on the CPU the paged path on
    the torch references in fixed shapes without capture. Same tokens expected (up to fp32 near-ties on the GPU),
    the verify steps in fixed shapes, the output rate of each arm (tiny shapes: host-bound, not the H200 proxy's)."""
    from dsserve.engine.args import EngineArgs
    from dsserve.engine.core import EngineCore
    from dsserve.train.tasks import problem, prompt_ids

    kw = dict(model="tiny-trained", dtype="float32", max_num_seqs=8, enable_prefix_caching=False, warmup=False)
    if DEV == "cpu":  # drafts on in fixed shapes (async_scheduling asks for them), drafts off eager (quicker here)
        kw.update(device="cpu", attention_backend="paged", reference_ops="all")
    n_req = 4 if smoke else 8
    out, toks = {}, {}
    for arm, spec in (("off", None), ("on", {"method": "dspark", "num_speculative_tokens": k})):
        eng = EngineCore(EngineArgs(**kw, speculative_config=spec, async_scheduling=DEV == "cpu" and spec is not None))
        ps = [prompt_ids(eng.tokenizer, problem("arithmetic", "eval", 100 + i).prompt) for i in range(n_req)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        got = {}
        for rep in range(2):  # the first run captures the graphs its shapes need; the second is timed
            for i, p in enumerate(ps):
                eng.add_request(f"{rep}-{i}", p, params)
            _sync()
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        got[o.request_id] = o.outputs[0].token_ids
            _sync()
            secs = time.perf_counter() - t
            if rep == 0:
                eng.reset_counts()
        toks[arm] = [got[f"1-{i}"] for i in range(n_req)]
        n = sum(len(t) for t in toks[arm])
        st = eng.stats
        out[arm] = {"output_tokens": n, "seconds": secs, "output_tok_per_s": n / secs}
        if spec:
            vg = eng.runner.verify_graphs
            out[arm].update(
                mean_acceptance_length=st.spec_mean_acceptance_length,
                verify_graph_steps=st.verify_graph_steps,
                propose_graph_steps=st.propose_graph_steps,
                steps=st.steps,
                verify_graphs=None if vg is None else vg.report(),
                **eng.drafter.report(),
            )
        del eng
    same = [a == b for a, b in zip(toks["on"], toks["off"])]
    out["same_tokens"] = sum(same) / len(same)
    out["speedup"] = out["on"]["output_tok_per_s"] / out["off"]["output_tok_per_s"]
    on = out["on"]
    print(
        f"engine (tiny-trained, B={n_req}, K={k}): drafts off {out['off']['output_tok_per_s']:.0f} tok/s, on "
        f"{on['output_tok_per_s']:.0f} tok/s ({out['speedup']:.2f}x), mean acceptance length "
        f"{on['mean_acceptance_length']:.2f}, {on['verify_graph_steps']} of {on['steps']} steps in verify graphs, "
        f"{on['propose_graph_steps']} proposals in proposal graphs, same tokens {out['same_tokens']:.2f}",
        flush=True,
    )
    return out


def engine_proxy(smoke: bool, k: int, batches: list[int], prompt_len: int, new_tokens: int) -> dict:
    """The engine end to end on the proxy (``--engine-proxy``): B requests of ``prompt_len`` random prompt tokens,
    greedy, ``new_tokens`` each (EOS ignored), drafts off and on (K = ``k``), one engine per arm (the model rebuilt:
    the engine quantises it in place). The proxy's drafter has random weights, so drafts on accepts almost nothing
    (mean acceptance length ~1): its decode phase measures what a whole drafting step costs in the engine (verify
    graph, rejection, ingestion, the proposal graph, the host's one read, settle and rollback, planning), and
    ``tok_per_s_at_L`` is B L / that step time. Each B runs twice, the first capturing its graphs; the second is
    timed from the moment every request has its first token."""
    from model_h200 import build_core, free_core, reduced

    from dsserve.models.loader import resolve_config

    model = "tiny" if smoke else "proxy-h200-release"
    out = {"prompt_len": prompt_len, "new_tokens": new_tokens, "k": k}
    for arm, spec in (("off", None), ("on", {"method": "dspark", "num_speculative_tokens": k})):
        kv_tokens = (max(batches), prompt_len + new_tokens + 2 * k + 8)
        core, info = build_core(model, kv_tokens, release=not smoke, smoke=smoke, speculative_config=spec)
        out[f"model_{arm}"] = info
        if info.get("reduced_layers_to_fit"):  # (a card smaller than the H200) both arms run the same layers
            model = reduced(resolve_config(model) if isinstance(model, str) else model, info["layers"])
        gen, rows = torch.Generator().manual_seed(7), {}
        vocab = core.model.cfg.vocab_size
        try:
            for b in batches:
                params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
                for rep in range(2):
                    for i in range(b):
                        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=gen).tolist()
                        core.add_request(f"{b}-{rep}-{i}", ids, params)
                    core.reset_counts()
                    steps, t_first, counts, before = 0, None, {}, 0
                    _sync()
                    while core.has_unfinished_requests():
                        for o in core.step():  # token_ids: all of the request's so far
                            counts[o.request_id] = len(o.outputs[0].token_ids)
                        if t_first is not None:
                            steps += 1
                        elif sum(1 for n in counts.values() if n) == b:
                            _sync()
                            t_first, before = time.perf_counter(), sum(counts.values())
                    _sync()
                    secs = time.perf_counter() - t_first
                st = core.stats
                decoded = sum(counts.values()) - before
                row = {"decode_tokens": decoded, "decode_seconds": secs, "steps": steps, "tok_per_s": decoded / secs}
                row["step_ms"] = secs / max(1, steps) * 1e3
                if spec:
                    row.update(
                        mean_acceptance_length=st.spec_mean_acceptance_length,
                        verify_graph_steps=st.verify_graph_steps,
                        propose_graph_steps=st.propose_graph_steps,
                        tok_per_s_at_L={str(L): b * L / (row["step_ms"] / 1e3) for L in range(1, k + 2)},
                    )
                rows[str(b)] = row
                print(f"engine proxy drafts {arm} B={b}: {row['tok_per_s']:.0f} tok/s, {row['step_ms']:.2f} ms a step"
                      + (f", L {row['mean_acceptance_length']:.2f}" if spec else ""), flush=True)  # fmt: skip
        finally:
            free_core(core)
        out[arm] = rows
    for b in map(str, batches):
        on, off = out["on"][b], out["off"][b]
        on["step_over_decode_step"] = on["step_ms"] / off["step_ms"]
        on["breakeven_L"] = next((L for L in range(1, k + 2) if on["tok_per_s_at_L"][str(L)] > off["tok_per_s"]), None)
    return out


def plot_engine_proxy(res: dict, png: str) -> None:
    """``--engine-proxy-only``: output tokens/s by B, drafts off (measured) against drafts on at each mean acceptance
    length L (B L over the measured drafting step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = res["engine_proxy"]
    bs = sorted(int(b) for b in ep["off"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(bs, [ep["off"][str(b)]["tok_per_s"] for b in bs], "k-o", label="drafts off (measured)")
    for L in range(1, ep["k"] + 2):
        ax.plot(bs, [ep["on"][str(b)]["tok_per_s_at_L"][str(L)] for b in bs], "--", label=f"drafts on, L = {L}")
    ax.set(xscale="log", yscale="log", xlabel="requests B", ylabel="output tokens/s",
           title=f"engine on the proxy, K = {ep['k']} ({res['meta'].get('device', '')})")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot(res: dict, png: str) -> None:
    """Left: the verify step's time over a plain decode step's, graphed and eager, by B and K. Right: output tokens/s
    by B, plain decode against drafting at each mean acceptance length L (the largest K)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    if not rows:
        return
    if res.get("propose_only"):  # one panel: the proposal paths' ms by B
        fig, ax = plt.subplots(figsize=(6, 4))
        bs = [r["B"] for r in rows]
        for key, label in (("propose_batched_ms", "batched, torch ops"), ("propose_batched_kernel_ops_ms",
                           "batched, kernel ops"), ("propose_graph_ms", "graph"), ("propose_one_at_a_time_ms",
                           "one request at a time")):  # fmt: skip
            ax.plot(bs, [r.get(key) or float("nan") for r in rows], "o-", label=label)
        ax.set(xscale="log", yscale="log", xlabel="requests B", ylabel="ms a proposal (K = 5)",
               title=f"DSpark proposal ({res['meta'].get('device', '')})")  # fmt: skip
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for k in sorted({r["k"] for r in rows}):
        rs = [r for r in rows if r["k"] == k]
        bs = [r["B"] for r in rs]
        ax.plot(bs, [r["verify_graph_ms"] / r["decode_graph_ms"] for r in rs], "o-", label=f"K={k} verify graph")
        ax.plot(bs, [r["verify_eager_ms"] / r["decode_graph_ms"] for r in rs], "x--", label=f"K={k} verify eager")
    ax.set(xscale="log", xlabel="requests B", ylabel="step time / plain decode step (graphs)", title="verify step")
    ax.legend(fontsize=8)
    k = max(r["k"] for r in rows)
    rs = [r for r in rows if r["k"] == k]
    bs = [r["B"] for r in rs]
    bx.plot(bs, [r["decode_tok_per_s"] for r in rs], "k-o", label="plain decode (graphs)")
    for L in range(1, k + 2):
        bx.plot(bs, [r["spec_tok_per_s_by_mean_acceptance_length"][str(L)] for r in rs], "--", label=f"K={k}, L={L}")
    bx.set(
        xscale="log",
        yscale="log",
        xlabel="requests B",
        ylabel="output tokens/s",
        title=f"{res['model'].get('model', '')} ({res['meta'].get('device', '')})",
    )
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, < 2 minutes")
    p.add_argument("--out", default="benchmarks/results/spec-verify-h200")
    p.add_argument("--ks", default=None, help="drafts a request, comma-separated (default 3,5; --propose-only: 5)")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batches", default=None, help="default 1,2,4,8,16,32 (--propose-only: 1,8,32)")
    p.add_argument(
        "--propose-only",
        action="store_true",
        help="time only the proposal paths (batched, kernel ops, graph, one at a time), then the engine check",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=150.0, help="start no proxy case after this many seconds")
    p.add_argument("--no-engine-check", action="store_true", help="skip the end-to-end engine check")
    p.add_argument(
        "--engine-proxy",
        default="",
        help="B values (e.g. 1,8): the engine end to end on the proxy, drafts off and on (engine_proxy), last",
    )
    p.add_argument("--engine-proxy-only", action="store_true", help="only --engine-proxy (default B: 1,8)")
    p.add_argument("--engine-prompt", type=int, default=1024, help="--engine-proxy's prompt tokens a request")
    p.add_argument("--engine-tokens", type=int, default=64, help="--engine-proxy's new tokens a request")
    p.add_argument("--replot", default="", help="only redraw the PNG beside this spec_verify.json")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            res = json.load(f)
        png = os.path.join(os.path.dirname(a.replot), "spec_verify.png")
        (plot_engine_proxy if res.get("engine_proxy_only") else plot)(res, png)
        return
    from model_h200 import build_core, ceilings, free_core

    from dsserve.engine.verify_graphs import VerifyGraphs

    a.ks = a.ks or ("5" if a.propose_only else "3,5")
    a.batches = a.batches or ("1,8,32" if a.propose_only else "1,2,4,8,16,32")
    if a.smoke:
        a.context, a.batches, a.repeats = 64, "1,2", 2
    batches, ks = [int(x) for x in a.batches.split(",")], [int(x) for x in a.ks.split(",")]
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "spec_verify.json")
    ceil = ceilings()
    if a.engine_proxy_only:
        res = {"meta": run_meta(ceilings=ceil, smoke=a.smoke), "ceilings": ceil, "engine_proxy_only": True}
        bs_e = [int(x) for x in (a.engine_proxy or "1,8").split(",")]
        res["engine_proxy"] = engine_proxy(a.smoke, max(ks), bs_e, a.engine_prompt, a.engine_tokens)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
        plot_engine_proxy(res, os.path.join(a.out, "spec_verify.png"))
        print(path)
        return
    model = "tiny" if a.smoke else "proxy-h200-release"
    kv_tokens = (max(batches), 64 if a.propose_only else a.context + max(ks) + 2)  # the proposal reads no cache
    core, info = build_core(model, kv_tokens, release=not a.smoke, smoke=a.smoke)
    if a.context % core.kv.rollback_multiple:
        raise SystemExit(f"--context must be a multiple of {core.kv.rollback_multiple}")
    bs = core.kv.layout.block_size
    min_context = -(-1024 // (2 * bs)) * 2 * bs
    if DEV == "cpu":  # the engine's GPU path, on the torch references, in fixed shapes without capture
        from dsserve.engine.decode_graphs import DecodeGraphs
        from dsserve.kernels.ops import KernelOps

        core.model.kernel_ops = KernelOps.for_device(core.device, "all")
        core.runner.decode_graphs = DecodeGraphs(core.model, core.kv, max(batches), None, min_context=min_context)
    capture = core.graph_capture
    res = {"meta": run_meta(ceilings=ceil, smoke=a.smoke), "ceilings": ceil, "model": info, "rows": [], "skipped": []}
    res["propose_only"] = a.propose_only
    # the proposal does not depend on K (the drafter keeps the first K drafts): one set of graphs for every K
    proposals = ProposeGraphs(core.model, max(batches), capture, ops=core.model.kernel_ops)
    try:
        with torch.no_grad():
            for k in ks:
                drafter = Drafter(core.model, k, core.stats)
                graphs = VerifyGraphs(core.model, core.kv, max(batches), k, capture, min_context=min_context)
                for b in batches:
                    if time.time() - t0 > a.budget_s:
                        res["skipped"].append({"k": k, "B": b, "why": f"past --budget-s {a.budget_s}"})
                        print(f"K={k} B={b}: skipped (past --budget-s {a.budget_s})", flush=True)
                        continue
                    if a.propose_only:
                        res["rows"].append(propose_case(core, drafter, proposals, b, a.context, a.repeats))
                    else:
                        res["rows"].append(case(core, drafter, graphs, proposals, b, a.context, a.repeats))
                        res.setdefault("verify_graphs", {})[str(k)] = graphs.report()
                    res["proposal_graphs"] = proposals.report()
                    res["seconds"] = time.time() - t0
                    with open(path, "w") as f:
                        json.dump(res, f, indent=1, default=str)
                core.runner.verify_graphs = None
    finally:
        free_core(core)
    try:
        if not a.no_engine_check:
            res["engine_check"] = engine_check(a.smoke, max(ks), 8 if a.smoke else 32)
    except Exception as e:  # recorded beside the proxy's numbers
        traceback.print_exc()
        res["engine_check"] = {"error": f"{type(e).__name__}: {e}"}
    if a.engine_proxy:
        try:
            bs_e = [int(x) for x in a.engine_proxy.split(",")]
            res["engine_proxy"] = engine_proxy(a.smoke, max(ks), bs_e, a.engine_prompt, a.engine_tokens)
        except Exception as e:  # recorded beside the rest
            traceback.print_exc()
            res["engine_proxy"] = {"error": f"{type(e).__name__}: {e}"}
    res["seconds"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    try:
        if not a.propose_only:
            plot(res, os.path.join(a.out, "spec_verify.png"))
    except Exception:  # the numbers are written; a figure can be redrawn with --replot
        traceback.print_exc()
    print(path)


if __name__ == "__main__":
    main()
