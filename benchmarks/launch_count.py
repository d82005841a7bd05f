"""Kernel launches of one decode step, counted on the CPU: what the host must issue per step on a GPU.

    python benchmarks/launch_count.py --model tiny --batches 1,9 --out benchmarks/results/launch-count-cpu
    python benchmarks/launch_count.py --model tiny --hit 1024,256 --out benchmarks/results/launch-count-cpu-hit

The engine runs the batched paged path (bf16, as on the GPU) with every kernelised op on its torch reference (no
interpreter); each reference call counts as one launch (its kernel's), every other top-level torch op that runs
a kernel as one (views, allocations and conversions that do not copy are not counted). Eager decode on the
H200 is bound by exactly these launches (benchmarks/results/model-h200: 6300-16600 a step, ~30 us of host time
each), and each one that survives into a CUDA graph still costs the device a few microseconds. Prints a table
(top call sites at the smallest batch, and what each extra sequence adds), then one JSON line. ``--hit CACHED,FRESH``
counts instead the eager prefill step of a prompt whose first CACHED tokens are in the prefix cache (issue 9's TTFT
after a hit, host-bound on the H200), bounded replay on and off.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # references, not interpreted kernels: counting, not running them

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from dsserve.bench.provenance import run_meta  # noqa: E402

# ops that launch no kernel: views, metadata, allocations; a conversion launches only if it really copies
_NO_LAUNCH = {
    "aten::" + n
    for n in (
        "view",
        "reshape",
        "_reshape_alias",
        "unflatten",
        "flatten",
        "select",
        "slice",
        "expand",
        "expand_as",
        "as_strided",
        "permute",
        "transpose",
        "t",
        "unsqueeze",
        "squeeze",
        "detach",
        "alias",
        "unbind",
        "split",
        "chunk",
        "narrow",
        "diagonal",
        "view_as",
        "view_as_real",
        "view_as_complex",
        "empty",
        "empty_like",
        "empty_strided",
        "lift_fresh",
        "resize_",
        "_unsafe_view",
        "split_with_sizes",
        "numpy_T",
        "result_type",
        "size",
        "stride",
        "is_nonzero",
        "_local_scalar_dense",
        "item",
        "to",
        "contiguous",
        "type_as",
        "float",
        "long",
        "int",
        "set_",
        "dim",
    )
}
_COPIES = {"aten::_to_copy", "aten::copy_", "aten::clone"}


def _launches(e) -> bool:
    """Whether a top-level op runs a kernel: not a view / allocation, and a conversion only if it copies."""
    if e.name not in _NO_LAUNCH:
        return True
    stack = list(e.cpu_children)
    while stack:
        c = stack.pop()
        if c.name in _COPIES:
            return True
        stack.extend(c.cpu_children)
    return False


def _sites(prof) -> tuple[int, collections.Counter]:
    """Launches by call site: the innermost dsserve frame, or the *_ref kernel reference it runs inside (one)."""
    sites, seen = collections.Counter(), set()
    for e in prof.events():
        if not e.name.startswith("aten::") or (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            continue
        if not _launches(e):
            continue
        p, chain, ref = e.cpu_parent, [], None
        while p is not None:  # the innermost dsserve frame names the site; a *_ref ancestor is one kernel
            if "dsserve/kernels/" in p.name and "_ref" in p.name.split(":")[-1]:
                ref = p
            if "dsserve/" in p.name:
                chain.append(p.name.split("dsserve/")[-1])
            p = p.cpu_parent
        if ref is not None:
            if id(ref) not in seen:
                seen.add(id(ref))
                sites["[kernel] " + ref.name.split("dsserve/")[-1]] += 1
            continue
        sites[chain[0] if chain else "(outside dsserve)"] += 1
    return sum(sites.values()), sites


def count(
    model: str, batch: int, dtype: str = "bfloat16", steps_before: int = 2, fixed_shape: bool = False
) -> tuple[int, collections.Counter]:
    """fixed_shape: the decode step as a CUDA graph would capture it (DecodeGraphs' forward_decode, run eagerly
    here), counting only that forward (its buffers' refill is host work)."""
    from dsserve import LLM, SamplingParams
    from dsserve.engine.decode_graphs import DecodeGraphs

    llm = LLM(
        model=model,
        dtype=dtype,
        attention_backend="paged",
        reference_ops="all",
        enable_prefix_caching=False,
        seed=0,
        max_num_seqs=max(16, batch),
    )
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=steps_before + 2, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", list(range(5, 45 + i)), sp)  # ragged prompts, one prefill step, then decodes
    captured = {}
    if fixed_shape:
        eng.runner.decode_graphs = DecodeGraphs(
            eng.model, eng.kv, eng.args.max_num_seqs, capture=None, batch_buckets=(batch,)
        )
        forward = eng.model.forward_decode

        def profiled(b):
            if not captured.get("on"):
                return forward(b)
            with profile(activities=[ProfilerActivity.CPU], with_stack=True) as p:
                out = forward(b)
            captured["prof"] = p
            return out

        eng.model.forward_decode = profiled
    prof = None
    for step in range(steps_before + 1):
        if step == steps_before and fixed_shape:
            captured["on"] = True
            eng.step()
            prof = captured["prof"]
        elif step == steps_before:
            with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
                eng.step()
        else:
            eng.step()
    return _sites(prof)


def count_hit(
    model: str, cached: int, fresh: int, dtype: str = "bfloat16", replay: bool = True
) -> tuple[int, collections.Counter]:
    """The eager prefill step of a prompt whose first ``cached`` tokens are in the prefix cache, ``fresh`` new ones
    after them (issue 9's hit case: on the GPU such a step is host-bound, ~30 us a launch)."""
    from dsserve import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,
        attention_backend="paged",
        reference_ops="all",
        enable_prefix_caching=True,
        swa_bounded_replay=replay,
        seed=0,
        max_num_batched_tokens=max(2048, cached + fresh),
    )
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefix = [5 + (7 * i) % 200 for i in range(cached)]
    eng.add_request("earlier", prefix, sp)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("hit", prefix + [6 + (11 * i) % 200 for i in range(fresh)], sp)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        eng.step()
    hit = eng.stats.as_dict()["prefix_hit_tokens"]
    if hit < cached - 2 * eng.kv.layout.block_size:
        raise SystemExit(f"launch_count: the prompt found {hit} of its {cached} earlier tokens in the prefix cache")
    return _sites(prof)


def plot(sites: collections.Counter, extra: dict, path: str, titles: tuple[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 5))
    top = sites.most_common(15)[::-1]
    ax[0].barh([k[:45] for k, _ in top], [v for _, v in top])
    ax[0].set(xlabel="launches", title=titles[0])
    top = sorted(extra.items(), key=lambda kv: kv[1])[-10:]
    ax[1].barh([k[:45] for k, _ in top], [v for _, v in top])
    ax[1].set(xlabel="launches", title=titles[1])
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--batches", default="1,9", help="two batch sizes: the per-sequence cost is their difference")
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype (bfloat16: the GPU's conversions)")
    p.add_argument("--fixed-shape", action="store_true", help="the step's forward as a CUDA graph captures it")
    p.add_argument(
        "--hit",
        default="",
        help="CACHED,FRESH: count instead the prefill step of a prompt whose first "
        "CACHED tokens are in the prefix cache, replay on and off",
    )
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.hit:
        return hit_main(a)
    b0, b1 = (int(v) for v in a.batches.split(","))
    t = time.perf_counter()
    (n0, s0), (n1, s1) = (count(a.model, b, a.dtype, fixed_shape=a.fixed_shape) for b in (b0, b1))
    per_seq = (n1 - n0) / (b1 - b0)
    extra = {k: (s1[k] - s0[k]) / (b1 - b0) for k in set(s0) | set(s1)}
    print(
        f"{a.model} ({a.dtype}): launches per decode step: B={b0}: {n0}, B={b1}: {n1}, per extra sequence {per_seq:.1f}"
    )
    print(f"{'launches at B=%d' % b0:>18s}  call site")
    for k, v in s0.most_common(25):
        print(f"{v:18d}  {k}")
    print(f"{'per extra seq':>18s}  call site")
    for k, v in sorted(extra.items(), key=lambda kv: -kv[1])[:10]:
        print(f"{v:18.1f}  {k}")
    res = {
        "meta": run_meta(),
        "model": a.model,
        "dtype": a.dtype,
        "fixed_shape": a.fixed_shape,
        "batches": [b0, b1],
        "launches": [n0, n1],
        "per_extra_sequence": per_seq,
        "sites": dict(s0.most_common(40)),
        "extra_per_sequence": dict(sorted(extra.items(), key=lambda kv: -kv[1])[:15]),
        "seconds": time.perf_counter() - t,
        "torch": torch.__version__,
    }
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "launch_count.json"), "w") as f:
            json.dump(res, f, indent=1)
        plot(
            s0,
            extra,
            os.path.join(a.out, "launch_count.png"),
            (f"one decode step at B={b0}: top call sites", "what each extra sequence adds"),
        )
    print(json.dumps({k: res[k] for k in ("model", "dtype", "batches", "launches", "per_extra_sequence")}))


def hit_main(a) -> None:
    cached, fresh = (int(v) for v in a.hit.split(","))
    t = time.perf_counter()
    (n_on, s_on), (n_off, s_off) = (count_hit(a.model, cached, fresh, a.dtype, replay) for replay in (True, False))
    print(
        f"{a.model} ({a.dtype}): launches of the prefill step after a hit ({cached} cached + {fresh} fresh tokens): "
        f"replay on {n_on}, replay off {n_off}"
    )
    print(f"{'replay on':>18s}  call site")
    for k, v in s_on.most_common(25):
        print(f"{v:18d}  {k}")
    res = {
        "meta": run_meta(),
        "model": a.model,
        "dtype": a.dtype,
        "hit": [cached, fresh],
        "launches": {"replay_on": n_on, "replay_off": n_off},
        "sites_replay_on": dict(s_on.most_common(40)),
        "sites_replay_off": dict(s_off.most_common(40)),
        "seconds": time.perf_counter() - t,
        "torch": torch.__version__,
    }
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "launch_count.json"), "w") as f:
            json.dump(res, f, indent=1)
        more = {k: s_on[k] - s_off[k] for k in set(s_on) | set(s_off) if s_on[k] > s_off[k]}
        plot(
            s_on,
            more,
            os.path.join(a.out, "launch_count.png"),
            (f"prefill after a hit ({cached} + {fresh}), replay on", "replay on beyond replay off"),
        )
    print(json.dumps({k: res[k] for k in ("model", "dtype", "hit", "launches")}))


if __name__ == "__main__":
    sys.exit(main())
