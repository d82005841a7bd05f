"""P/D hand-off cost on the CPU: bytes and time a decode instance spends to take over a request, shipping the global KV
only (the decode side replays the last W prompt rows) against receiving the windows too (exact mode: the prefix
cache's blocks with every token's window rows, so nothing is replayed); then the release layout by accounting.

    python benchmarks/pd_transfer_cpu.py --out benchmarks/results/pd-transfer-cpu

Tiny, measured: a prefill engine and a decode engine in this process (the tiny model, the release's packed record
formats), the blocks pulled over a real loopback socket (``disagg.transport.fetch_blocks`` against a small HTTP
server over the prefill engine's staged hand-off). Per prompt length and mode: bytes moved, the pull's wall time and
the decode side's admission-to-first-token time (the bounded replay in replay mode; the tail past the last full
block in exact mode). Release layout (v41-flash), by accounting: bytes at 8K / 32K / 128K prompts against both
window-carrying alternatives, and the replay's compute (128 rows through the model) in FLOPs.
"""

import argparse
import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import torch

import dsserve.disagg.connector as connector_mod
from dsserve import LLM, SamplingParams
from dsserve.bench.provenance import run_meta
from dsserve.disagg.accounting import handoff_bytes
from dsserve.kv.layout import KVLayout
from dsserve.models.accounting import param_counts
from dsserve.models.presets import preset


def serve_exports(engines: dict) -> tuple[ThreadingHTTPServer, str]:
    """GET /kv_transfer/{id}?first&count over the staged hand-offs of ``engines`` (a mode -> engine map; the id is
    looked up in each)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            u = urlparse(self.path)
            tid, q = u.path.rsplit("/", 1)[1], parse_qs(u.query)
            for e in engines.values():
                try:
                    chunks = list(e.kv_connector.export_chunks(tid, int(q["first"][0]), int(q["count"][0])))
                    break
                except KeyError:
                    continue
            else:
                self.send_response(404)
                self.end_headers()
                return
            body = b"".join(chunks)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_DELETE(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def run(engine, rid, prompt, kv_transfer=None):
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(rid, prompt, sp, kv_transfer=kv_transfer)
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            last = o if o.request_id == rid else last
    return last


def tiny_points(lengths: list[int], rounds: int) -> list[dict]:
    mk = lambda replay: LLM(model="tiny", device="cpu", swa_bounded_replay=replay, max_num_batched_tokens=4096)  # noqa: E731
    engines = {"replay": (mk(True).engine, mk(True).engine), "exact": (mk(False).engine, mk(False).engine)}
    srv, url = serve_exports({m: p for m, (p, _) in engines.items()})
    rng = random.Random(0)
    out = []
    try:
        for n in lengths:
            for mode, (p, d) in engines.items():
                best = None
                for r in range(rounds):
                    prompt = [rng.randrange(3, 8190) for _ in range(n)]  # fresh: nothing cached on either side
                    hand = run(p, f"p{n}{mode}{r}", prompt, {"do_remote_decode": True}).kv_transfer_params
                    t0 = time.perf_counter()
                    o = run(d, f"d{n}{mode}{r}", prompt, dict(hand, remote_url=url))
                    total = time.perf_counter() - t0
                    st = dict(o.kv_transfer_stats, decode_first_token_s=total)
                    if best is None or st["transfer_s"] + st["replay_s"] < best["transfer_s"] + best["replay_s"]:
                        best = st
                lay = d.kv.layout
                out.append(
                    {
                        "model": "tiny",
                        "mode": mode,
                        "prompt_tokens": n,
                        "block_size": lay.block_size,
                        "bytes": best["bytes"],
                        "global_bytes": best["global_bytes"],
                        "with_window_ring_bytes": best["with_window_ring_bytes"],
                        "transfer_s": best["transfer_s"],
                        "replay_s": best["replay_s"],
                        "import_s": best.get("import_s", 0.0),
                        "loopback_megabytes_per_s": best["bytes"] / max(best["transfer_s"], 1e-9) / 1e6,
                    }
                )
                print(json.dumps(out[-1]))
    finally:
        srv.shutdown()
    return out


def release_points(lengths: list[int], link_gbps: float) -> list[dict]:
    cfg = preset("v41-flash")
    lay = KVLayout.build(cfg, None, "auto", torch.bfloat16)
    exact = KVLayout.build(cfg, None, "auto", torch.bfloat16, window_in_blocks=True)
    active = param_counts(cfg).active_decode  # a replayed row runs every layer (the decoder only the last W)
    out = []
    for n in lengths:
        hb = handoff_bytes(lay, n, cfg.head_dim, cfg.index_head_dim)
        he = handoff_bytes(exact, n, cfg.head_dim, cfg.index_head_dim)
        row = {
            "model": "v41-flash",
            "prompt_tokens": n,
            "block_size": lay.block_size,
            "global_bytes_per_token": lay.global_bytes_per_token(),
            "moved_bytes_replay_mode": hb.moved,
            "moved_bytes_exact_mode": he.moved,
            "with_window_rows_bytes": hb.with_window_rows,
            "with_window_ring_bytes": hb.with_window_ring,
            "fewer_bytes_than_window_rows_x": hb.with_window_rows / hb.moved,
            "fewer_bytes_than_window_ring_x": hb.with_window_ring / hb.moved,
            "replayed_rows": min(cfg.sliding_window, n) + (n - 1) % lay.block_size + 1,
        }
        row["replay_gflop_dense_upper"] = 2 * active * row["replayed_rows"] / 1e9  # weights only, no attention
        for k in ("moved_bytes_replay_mode", "with_window_ring_bytes", "with_window_rows_bytes"):
            row[k.replace("bytes", "ms_at_assumed_link")] = 1e3 * row[k] / (link_gbps * 1e9)
        out.append(row)
        print(json.dumps(row))
    return out


def plot(tiny: list[dict], release: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [r["prompt_tokens"] for r in release]
    w = 0.27
    for i, (k, label) in enumerate(
        (
            ("moved_bytes_replay_mode", "global KV only (replay)"),
            ("with_window_ring_bytes", "+ window rings (last W rows)"),
            ("with_window_rows_bytes", "+ every token's window rows (exact)"),
        )
    ):
        a.bar([j + (i - 1) * w for j in range(len(xs))], [r[k] / 2**20 for r in release], w, label=label)
    a.set_xticks(range(len(xs)), [f"{x // 1024}K" for x in xs])
    a.set_yscale("log")
    a.set_ylabel("MiB per hand-off")
    a.set_title("v41-flash release layout (accounting)")
    a.legend(fontsize=8)
    for mode, m in (("replay", "o-"), ("exact", "s--")):
        pts = [r for r in tiny if r["mode"] == mode]
        b.plot(
            [r["prompt_tokens"] for r in pts],
            [1e3 * (r["transfer_s"] + r["replay_s"]) for r in pts],
            m,
            label=f"{mode}: pull + first token",
        )
        b.plot(
            [r["prompt_tokens"] for r in pts], [1e3 * r["transfer_s"] for r in pts], m, alpha=0.4, label=f"{mode}: pull"
        )
    b.set_xscale("log", base=2)
    b.set_xlabel("prompt tokens")
    b.set_ylabel("ms (best of rounds)")
    b.set_title("tiny, CPU, loopback socket (measured)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048], help="tiny prompt lengths")
    ap.add_argument("--release-lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--link-gbps", type=float, default=25.0, help="assumed P->D link, GB/s, for release-layout times")
    ap.add_argument("--out", default=None, help="write result.json and pd_transfer.png here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    connector_mod.release_remote = lambda url, tid: None  # the small server drops nothing; the copies expire
    tiny = tiny_points(a.lengths, a.rounds)
    release = release_points(a.release_lengths, a.link_gbps)
    result = {"meta": run_meta(link_gigabytes_per_s_assumed=a.link_gbps), "tiny": tiny, "release": release}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        plot(tiny, release, os.path.join(a.out, "pd_transfer.png"))


if __name__ == "__main__":
    main()
