"""What the DP process boundary costs a step, on the CPU: ``python -m dsserve.bench.dp_overhead``.

The same B greedy requests decode N tokens (a) on an in-process ``EngineCore``, (b) on one rank behind a
``DPClient`` (the pipe each way, pickled outputs, the front end's wait), (c) on both ranks of a DEP2 group (each rank
the same B requests, pinned: the lockstep gather and the EP all-to-alls on top), and with ``--tp T`` (d) on a DEP2
group whose ranks are each tensor parallel over T processes (TP x DEP2: the step messages to the TP workers and the
TP all-reduces on top), (e) on two independent replicas (DP2, no EP) without and with TP inside. Per step: the front
end's wall time, the rank's own step time (EngineStats), for DEP2 the gather's share, under TP the step messages'.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from dataclasses import replace

import torch

from ..engine.args import EngineArgs
from ..engine.core import EngineCore
from ..engine.sampling_params import SamplingParams


def _run(engine, prompts, params, pin=None) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        kw = {} if pin is None else {"rank": pin(i)}
        engine.add_request(f"q{time.monotonic_ns()}-{i}", p, params, **kw)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def measure(model: str, batch: int, tokens: int, prompt_len: int, tp: int = 1) -> dict:
    torch.set_num_threads(1)  # as each rank: one thread a process
    from ..distributed.dp_client import DPClient

    args = EngineArgs(model=model, dtype="float32", device="cpu", max_num_seqs=2 * batch, seed=0, max_model_len=512)
    prompts = [[3 + (i * 97 + j * 13) % 5000 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = {"model": model, "batch_per_rank": batch, "decode_tokens": tokens, "prompt_len": prompt_len, "tp": tp}

    core = EngineCore(args)
    _run(core, prompts, params)  # first shapes
    s0, h0 = core.stats.steps, core.stats.step_host_seconds + core.stats.step_wait_seconds
    wall = _run(core, prompts, params)
    steps = core.stats.steps - s0
    out["in_process_ms_per_step"] = 1e3 * wall / steps
    out["in_process_engine_ms_per_step"] = (
        1e3 * (core.stats.step_host_seconds + core.stats.step_wait_seconds - h0) / steps
    )
    outs = []
    for i, p in enumerate(prompts):
        core.add_request(f"pk{i}", p, SamplingParams(temperature=0, max_tokens=2))
    while core.has_unfinished_requests():
        outs = core.step() or outs
    out["outputs_pickle_bytes"] = len(pickle.dumps(outs))

    runs = [("dp1", 1, False, 1), ("dep2", 2, True, 1)]
    if tp > 1:  # and the same with TP inside each rank, with EP and without (two independent replicas)
        runs += [(f"dep2_tp{tp}", 2, True, tp), ("dp2", 2, False, 1), (f"dp2_tp{tp}", 2, False, tp)]
    for label, dp, ep, t in runs:
        one = replace(args, data_parallel_size=dp, enable_expert_parallel=ep, tensor_parallel_size=t)
        client = DPClient(one, rank_threads=1)
        try:
            both = prompts * dp
            _run(client, both, params, pin=lambda i: i // batch)
            before = list(client.rank_loads)
            m0 = client.messages
            wall = _run(client, both, params, pin=lambda i: i // batch)
            r0, r1 = before[0], client.rank_loads[0]
            steps = r1.steps - r0.steps
            out[f"{label}_ms_per_step"] = 1e3 * wall / steps
            out[f"{label}_rank_step_ms"] = 1e3 * (r1.step_seconds - r0.step_seconds) / steps
            out[f"{label}_messages_per_step"] = (client.messages - m0) / steps
            if t > 1:
                tp_s = r1.tp_message_seconds - r0.tp_message_seconds
                out[f"{label}_tp_message_ms_per_step"] = 1e3 * tp_s / steps
            if ep:
                out[f"{label}_gather_ms_per_step"] = 1e3 * (r1.sync_seconds - r0.sync_seconds) / steps
                out[f"{label}_ep_balance"] = client.ep_balance.summary()["step_balance_p50"]
        finally:
            client.close()
    out["dp1_boundary_ms_per_step"] = out["dp1_ms_per_step"] - out["in_process_ms_per_step"]
    if tp > 1:
        out[f"dep2_tp{tp}_minus_dep2_ms_per_step"] = out[f"dep2_tp{tp}_ms_per_step"] - out["dep2_ms_per_step"]
        out[f"dp2_tp{tp}_minus_dp2_ms_per_step"] = out[f"dp2_tp{tp}_ms_per_step"] - out["dp2_ms_per_step"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=8, help="requests per rank")
    p.add_argument("--tokens", type=int, default=32, help="tokens each decodes")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tp", type=int, default=1, help="also run DEP2 with each rank tensor parallel over this many")
    a = p.parse_args(argv)
    print(json.dumps(measure(a.model, a.batch, a.tokens, a.prompt_len, a.tp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
