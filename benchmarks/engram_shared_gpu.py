"""The shared Engram tables (layers.engram_store) on one CUDA GPU: pinned, read in place, and served by DP ranks.

1. Table level: a 1 M-row FP8 table (264 MB) built privately and through a store, the store's table mapped a second
   time as another rank would: each is pinned (``cudaHostRegister`` of the shared mapping), ``device_gather`` (the
   kernel reading pinned host memory in place) and ``prefetch`` give the private table's rows bit for bit, and the
   ms of a 128 x 24-row ``device_gather`` and ``prefetch().wait()`` are the same for private and shared (median of
   ``triton.testing.do_bench``, measured side by side in this run: no separate ceiling applies, the private table
   is the reference).
2. Engine level: ``-dp 2`` on this one GPU (both ranks on cuda:0), tiny, ``--engram-tables host-fp8``, eager: both
   ranks map the same /dev/shm inode per table, and the greedy tokens of 6 requests (one at a time, alternating
   ranks) equal a lone engine's bit for bit.

    python benchmarks/engram_shared_gpu.py --out $OUT      # about 1-2 minutes on one H100/H200

Writes $OUT/engram_shared_gpu.json (and prints it as the last line); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch


def table_level() -> dict:
    from triton.testing import do_bench

    from dsserve.layers.engram_store import EngramStore
    from dsserve.layers.engram_table import EngramTable

    rows, dim = 1 << 20, 256
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, dim, generator=g) * 0.1
    store = EngramStore.for_children()
    out = {"dev_shm_free_gib": os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize / 2**30}
    try:
        private = EngramTable.from_weight(w, "fp8")
        t0 = time.perf_counter()
        shared = EngramTable.from_weight(w, "fp8", store=store, key="layers.1.engram")
        out["shared_fill_and_pin_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        peer = EngramTable.from_weight(w, "fp8", store=EngramStore(store.prefix), key="layers.1.engram")
        out["peer_map_and_pin_s"] = time.perf_counter() - t0
    finally:
        store.seal()
    out["pinned"] = {"private": private.memory.pinned, "shared": shared.memory.pinned, "peer": peer.memory.pinned}
    out["peer_created"] = peer.memory.created
    ids = torch.randint(0, rows, (128, 24), generator=g).cuda()
    want = private.device_gather(ids, torch.bfloat16)
    out["device_gather_equal"] = all(torch.equal(t.device_gather(ids, torch.bfloat16), want) for t in (shared, peer))
    out["prefetch_equal"] = all(
        torch.equal(t.prefetch(ids, "cuda", torch.bfloat16).wait(), want) for t in (shared, peer)
    )
    for name, t in (("private", private), ("shared", shared), ("peer", peer)):
        out[f"device_gather_ms_{name}"] = do_bench(lambda: t.device_gather(ids, torch.bfloat16), return_mode="median")
        out[f"prefetch_wait_ms_{name}"] = do_bench(
            lambda: t.prefetch(ids, "cuda", torch.bfloat16).wait(), return_mode="median"
        )
    return out


def inodes(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and "dsserve-engram-" in parts[5]:
                out[parts[5].split("-", 4)[-1].split(" ")[0]] = int(parts[4])
    return out


def engine_level(device: str = "cuda") -> dict:
    from dsserve.distributed.dp_client import DPClient
    from dsserve.engine.args import EngineArgs
    from dsserve.engine.core import EngineCore
    from dsserve.engine.sampling_params import SamplingParams

    opts = dict(
        model="tiny",
        device=device,
        dtype="float32" if device == "cuda" else "float64",  # the CPU dry run: fp64 (its ranks run on fewer threads)
        engram_tables="host-fp8",
        enforce_eager=True,
        warmup=False,
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
        seed=0,
    )
    reqs = {f"r{i}": [3 + (i * 131 + j * 17) % 7000 for j in range(n)] for i, n in enumerate((5, 40, 23, 64, 11, 30))}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(engine, dp: bool) -> dict:
        """One request at a time (rank i % 2 under DP): every forward has the same rows in both engines, so the
        tokens must be equal bit for bit, not just up to batch-shape rounding."""
        done = {}
        for i, (rid, ids) in enumerate(reqs.items()):
            engine.add_request(rid, ids, params, **({"rank": i % 2} if dp else {}))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        done[o.request_id] = o.outputs[0].token_ids
        return done

    t0 = time.perf_counter()
    client = DPClient(EngineArgs(**opts, data_parallel_size=2))
    start_s = time.perf_counter() - t0
    try:
        maps = [inodes(pid) for pid in client.pids]
        got = run(client, True)
        routed = list(client.router.routed)
    finally:
        client.close()
    single = EngineCore(EngineArgs(**opts))
    want = run(single, False)
    return {
        "dp2_start_s": start_s,
        "tables_mapped": sorted(maps[0]),
        "same_inodes": bool(maps[0]) and maps[0] == maps[1],
        "routed": routed,
        "tokens_equal": got == want,
        "mismatched": sorted(r for r in want if got.get(r) != want[r]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    from dsserve.bench.provenance import run_meta

    result, ok = {"meta": run_meta()}, True
    for name, fn in (("table", table_level), ("engine", engine_level)):
        try:
            result[name] = fn()
        except Exception:
            result[name] = {"error": traceback.format_exc()}
            ok = False
    t, e = result["table"], result["engine"]
    ok = ok and all(t["pinned"].values()) and t["device_gather_equal"] and t["prefetch_equal"]
    ok = ok and not t["peer_created"] and e["same_inodes"] and e["tokens_equal"]
    result["ok"] = ok
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "engram_shared_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
