"""The CPU cost of the TP process boundary: the in-process engine against TP2 (this process rank 0, one worker) on
the same exact batch (bench forward's), with where the difference goes:

- the step message (build, pickle, one pipe write per worker): bytes and microseconds a step, from the executor;
- the collectives rank 0 enters in a step (counted by wrapping torch.distributed's all_reduce / all_gather): how
  many, and the time spent inside them (their latency plus the wait for the slower rank);
- the control transport alone, pipe against a gloo broadcast (size, then payload) of a message of the same size,
  ping-ponged between two processes; and one all-reduce of a decode step's rows, alone.

    python benchmarks/tp_overhead_cpu.py [--model tiny] [--batch 4] [--context 128] [--new-tokens 1]

Prints one JSON line. Runs in about a minute on an idle 2-core host.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time

import torch
import torch.distributed as dist

from dsserve.bench.forward import bench_forward
from dsserve.distributed.launch import RankProcesses, Rendezvous
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore

PINGS = 200
ROWS, HIDDEN = 4, 256  # a decode step's all-reduce on tiny at batch 4 (fp32)


class _Count:
    """Wraps torch.distributed's collectives in this process: calls and seconds inside them."""

    def __init__(self):
        self.calls, self.seconds, self._saved = 0, 0.0, {}

    def __enter__(self):
        for name in ("all_reduce", "all_gather"):
            fn = self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def run(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            self.calls += 1
            self.seconds += time.perf_counter() - t
            return out

        return run

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def engine_step(args: EngineArgs, batch: int, context: int, new_tokens: int, repeats: int) -> dict:
    core = EngineCore(args)
    try:
        bench_forward(core, batch, context, new_tokens, 1)  # warm
        ex = core.executor
        before = getattr(ex, "stats", None) and (ex.stats.messages, ex.stats.seconds, ex.stats.bytes)
        with _Count() as count:
            r = bench_forward(core, batch, context, new_tokens, repeats)
        out = {"ms_per_step": r.seconds * 1e3, "layers": core.cfg.num_hidden_layers}
        steps = repeats + 1
        out["collectives_per_step"] = count.calls / steps
        out["ms_in_collectives_per_step"] = count.seconds / steps * 1e3
        if before:
            n = ex.stats.messages - before[0]
            out["message_us"] = (ex.stats.seconds - before[1]) / n * 1e6
            out["message_bytes"] = (ex.stats.bytes - before[2]) / n
        return out
    finally:
        core.close()


def _echo(rank: int, conn_in, conn_out) -> None:
    """The far side of the transport ping-pong: echoes pipe messages, then gloo broadcasts."""
    dist.init_process_group("gloo")
    for _ in range(PINGS):
        conn_out.send_bytes(conn_in.recv_bytes())
    for _ in range(PINGS):
        n = torch.zeros(1, dtype=torch.long)
        dist.broadcast(n, 0)
        buf = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, 0)
        dist.broadcast(buf, 1)
    x = torch.ones(ROWS, HIDDEN)
    for _ in range(PINGS):
        dist.all_reduce(x)
    dist.destroy_process_group()
    os._exit(0)


def transport(nbytes: int) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    down_r, down_w = ctx.Pipe(duplex=False)
    up_r, up_w = ctx.Pipe(duplex=False)
    rdv = Rendezvous().resolved()
    procs = RankProcesses.spawn(_echo, [1], 2, rdv, (down_r, up_w))
    os.environ.update(rdv.env(0, 2, 0))
    dist.init_process_group("gloo")
    data = pickle.dumps(bytes(nbytes))
    t = time.perf_counter()
    for _ in range(PINGS):
        down_w.send_bytes(data)
        up_r.recv_bytes()
    pipe = (time.perf_counter() - t) / PINGS
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    t = time.perf_counter()
    for _ in range(PINGS):
        dist.broadcast(torch.tensor([payload.numel()]), 0)
        dist.broadcast(payload, 0)
        dist.broadcast(payload, 1)  # the way back: one broadcast
    gloo = (time.perf_counter() - t) / PINGS
    x = torch.ones(ROWS, HIDDEN)
    t = time.perf_counter()
    for _ in range(PINGS):
        dist.all_reduce(x)
    reduce = (time.perf_counter() - t) / PINGS
    dist.destroy_process_group()
    procs.reap(10)
    # a round trip each: the pipe's message there and back; gloo's size and payload there, the payload back
    return {
        "bytes": len(data),
        "pipe_round_trip_us": pipe * 1e6,
        "gloo_round_trip_us": gloo * 1e6,
        f"gloo_all_reduce_{ROWS}x{HIDDEN}_us": reduce * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args()
    out = {"model": ns.model, "batch": ns.batch, "context": ns.context, "new_tokens": ns.new_tokens}
    for tp in (1, 2):
        args = EngineArgs(
            model=ns.model,
            device="cpu",
            max_num_seqs=max(ns.batch, 8),
            enable_prefix_caching=False,
            tensor_parallel_size=tp,
            kv_cache_memory_bytes=64 << 20,
        )
        # every rank one thread (TP2's ranks take a core each: tp_worker._threads): the same compute a rank
        torch.set_num_threads(1)
        out[f"tp{tp}"] = engine_step(args, ns.batch, ns.context, ns.new_tokens, ns.repeats)
    out["transport"] = transport(int(out["tp2"]["message_bytes"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
