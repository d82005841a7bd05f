"""Host memory of a DP engine's ranks with the Engram tables shared (one copy per node, layers.engram_store) against
a private copy per rank (``DSSERVE_ENGRAM_STORE=private``), on a tiny model whose tables dominate.

The model is ``tiny`` with ``engram_vocab_size`` raised (default 131072: two tables of ~1.58 M rows x 32, 404 MB in
fp32 with ``--engram-tables host``), written as a config-only directory and built with seeded dummy weights in each
rank. For DP 2 and 4, both ways, the front end starts the ranks, serves one short request, and sums each rank's
``/proc/<pid>/smaps_rollup``: RSS (a shared page counted in every rank that maps it), PSS (a shared page divided
among them: the sum is what the ranks take from the node), and its anonymous and shared-memory parts (a private
table is anonymous memory; a shared one is shared memory).

    python benchmarks/engram_shared_cpu.py [--dp 2 4] [--engram-vocab 32768] [--out DIR]

Prints a table and, last, one JSON line (written to DIR/results.json with --out). About 2 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time

FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Private_Clean", "Private_Dirty")


def rollup(pid: int) -> dict[str, int]:
    """Bytes of ``FIELDS`` from /proc/<pid>/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, rest = line.partition(":")
            if k in FIELDS:
                out[k] = int(rest.split()[0]) * 1024
    return out


def model_dir(engram_vocab: int) -> str:
    from dsserve.models.presets import preset
    from dsserve.models.tokenizer import TINY_DIR

    cfg = dataclasses.replace(preset("tiny"), engram_vocab_size=engram_vocab)
    d = tempfile.mkdtemp(prefix="engram-shared-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    for fn in os.listdir(TINY_DIR):
        shutil.copyfile(os.path.join(TINY_DIR, fn), os.path.join(d, fn))
    return d


def measure(path: str, dp: int, shared: bool, tables: str) -> dict:
    from dsserve.distributed.dp_client import DPClient
    from dsserve.engine.args import EngineArgs
    from dsserve.engine.sampling_params import SamplingParams
    from dsserve.layers.engram_store import ENV, PRIVATE

    args = EngineArgs(
        model=path,
        load_format="dummy",
        device="cpu",
        dtype="float32",
        engram_tables=tables,
        data_parallel_size=dp,
        max_num_seqs=4,
        max_model_len=256,
        kv_cache_memory_bytes=8 << 20,
        warmup=False,
        seed=0,
    )
    before = os.environ.get(ENV)
    if not shared:
        os.environ[ENV] = PRIVATE
    t0 = time.perf_counter()
    try:
        client = DPClient(args, rank_threads=1)
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
    start_s = time.perf_counter() - t0
    try:
        for r in range(dp):  # every rank serves: its tables are in use, as in a server
            client.add_request(f"r{r}", [3 + 17 * j for j in range(20)], SamplingParams(max_tokens=2), rank=r)
        while client.has_unfinished_requests():
            client.step()
        ranks = [rollup(pid) for pid in client.pids]
    finally:
        client.close()
    total = {k: sum(r.get(k, 0) for r in ranks) for k in FIELDS}
    return {"dp": dp, "shared": shared, "start_s": round(start_s, 1), "sum": total, "ranks": ranks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--engram-vocab", type=int, default=131072)
    p.add_argument("--engram-tables", default="host", choices=["host", "host-fp8"])
    p.add_argument("--out", default=None, help="a folder for results.json")
    a = p.parse_args()

    from dsserve.bench.provenance import run_meta
    from dsserve.layers.engram_hash import engram_rows_per_layer
    from dsserve.models.loader import resolve_config

    path = model_dir(a.engram_vocab)
    cfg = resolve_config(path)
    width = cfg.engram_head_dim * 4 if a.engram_tables == "host" else cfg.engram_head_dim * 33 // 32
    table_bytes = sum(n * width for n in engram_rows_per_layer(cfg).values())
    rows = []
    try:
        for dp in a.dp:
            for shared in (False, True):
                rows.append(measure(path, dp, shared, a.engram_tables))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    mb = 1e6
    print(f"Engram tables: {table_bytes / mb:.1f} MB ({a.engram_tables}, one copy); sums over the rank processes")
    print(
        f"{'DP':>3} {'tables':>8} {'RSS MB':>9} {'PSS MB':>9} {'PSS anon MB':>12} {'PSS shmem MB':>13} {'start s':>8}"
    )
    for r in rows:
        s = r["sum"]
        print(
            f"{r['dp']:>3} {'shared' if r['shared'] else 'per rank':>8} {s['Rss'] / mb:>9.1f} {s['Pss'] / mb:>9.1f} "
            f"{s['Pss_Anon'] / mb:>12.1f} {s['Pss_Shmem'] / mb:>13.1f} {r['start_s']:>8.1f}"
        )
    saved = {}
    for dp in a.dp:
        priv, shar = (next(r for r in rows if r["dp"] == dp and r["shared"] is s) for s in (False, True))
        saved[dp] = {
            "pss_saved_bytes": priv["sum"]["Pss"] - shar["sum"]["Pss"],
            "expected_bytes": (dp - 1) * table_bytes,
        }
        print(
            f"DP{dp}: PSS saved {saved[dp]['pss_saved_bytes'] / mb:.1f} MB, (DP-1) x tables = "
            f"{saved[dp]['expected_bytes'] / mb:.1f} MB"
        )
    result = {
        "meta": run_meta(),
        "engram_vocab_size": a.engram_vocab,
        "engram_tables": a.engram_tables,
        "table_bytes": table_bytes,
        "runs": rows,
        "saved": saved,
    }
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
