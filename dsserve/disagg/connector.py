"""The KV connector between a prefill instance (P) and a decode instance (D), in the shape of vLLM's v1 connector.

Scheduler side (``Scheduler`` calls it): ``start_load(req)`` says whether a request's prompt KV is remote and starts
pulling the blocks D does not already hold in its prefix cache (vLLM's ``get_num_new_matched_tokens`` with
``load_async``); ``poll()`` says which loads have arrived or failed (vLLM's ``get_finished``); ``request_finished``
on P stages a finished request's blocks for D and returns the hand-off's parameters (vLLM's ``request_finished``
returning ``kv_transfer_params``). Worker side: ``BlockCodec`` reads blocks out of the paged pools and writes them
back in.

What moves: the prompt's full blocks of global KV (main and index entries of every source), never the sliding
windows or the compressors' carried rows, which D rebuilds by bounded replay of the last ``replay_window`` prompt
tokens, as after a prefix hit (it *is* a prefix hit: the arrived blocks join D's prefix cache, then the request is
admitted like any other). In exact mode (``--no-swa-bounded-replay``) the prefix cache's blocks carry every token's
window rows, so they move too and D resumes exactly; the blocks end on a multiple of every compress ratio, where no
compressor row is pending, so there is no compressor state to move.

Leases: P copies the blocks to host memory when the request finishes (so it holds no cache blocks for D) and keeps
the copy until D has pulled it or ``lease_s`` passed. D holds a reference on the blocks of a load (its own prefix
hits and the arrived ones) from the start of the load to the request's admission, and drops them on any failure, so
a failed hand-off leaves no block held on either side.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from ..kv.prefix_cache import block_hashes
from .accounting import handoff_bytes
from .transport import KVTransferError, fetch_blocks, release_remote

# fault injection for the tests: seconds P sleeps after sending each block (a transfer slow enough to kill P in)
SEND_DELAY_ENV = "DSSERVE_KV_SEND_DELAY_S"


class BlockCodec:
    """A block's bytes in the paged pools, in one fixed order: each KV source's main then index entries (sources
    ascending), then in exact mode each layer's window rows. ``block_bytes`` is ``layout.bytes_per_block``."""

    def __init__(self, kv):
        lay, self.kv = kv.layout, kv
        self.parts = [(kv.main[s], f"main{s}") for s in sorted(lay.sources)]
        self.parts += [(kv.index[s], f"index{s}") for s in sorted(kv.index)]
        if lay.window_in_blocks:
            self.parts += [(kv.window[i], f"window{i}") for i in lay.window_layers]
        self.block_bytes = sum(t[0].numel() for t, _ in self.parts)
        self.global_block_bytes = lay.global_bytes_per_block
        fmt = lay.index_fmt.name if lay.index_fmt else "none"
        self.fingerprint = (
            f"bs{lay.block_size}/main:{lay.main_fmt.name}:{lay.main_fmt.row_bytes}/index:{fmt}/"
            f"sources:{sorted(lay.sources.items())}/window_in_blocks:{int(lay.window_in_blocks)}/"
            f"layers:{len(lay.window_layers)}/block_bytes:{self.block_bytes}"
        )

    def read(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), block_bytes] uint8 on the host."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        return torch.cat([t[idx].flatten(1) for t, _ in self.parts], dim=1).cpu()

    def write(self, blocks: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        data, off = data.to(self.kv.device), 0
        for t, _ in self.parts:
            n = t[0].numel()
            t[idx] = data[:, off : off + n].view(len(blocks), *t.shape[1:])
            off += n


@dataclass
class _Export:
    data: torch.Tensor  # [blocks, block_bytes] uint8, host
    expires: float


@dataclass
class _Load:
    """A decode-side pull under way: ``held`` are the blocks the request holds a reference on until admission."""

    req: object
    hashes: list[bytes]
    held: list[int]
    first: int  # first block pulled (the ones before were local prefix hits)
    future: Future | None
    url: str | None = None
    transfer_id: str | None = None
    started: float = field(default_factory=time.perf_counter)


class KVConnector:
    """Both sides of the connector for one engine (a ``both`` instance can be either side of a hand-off)."""

    def __init__(self, kv, model_name: str, transfer_timeout: float = 30.0, lease_s: float = 120.0):
        self.kv, self.model_name = kv, model_name
        self.codec = BlockCodec(kv)
        self.transfer_timeout, self.lease_s = transfer_timeout, lease_s
        self._exports: dict[str, _Export] = {}
        self._lock = threading.Lock()  # exports: added on the engine thread, read and dropped on the HTTP side
        self._loads: dict[str, _Load] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsserve-kv-pull")
        self.failed: list[tuple[object, int, str]] = []  # (request, HTTP status, reason) the scheduler collects

    # ------------------------------------------------------------------ prefill side
    def request_finished(self, req) -> dict:
        """P: stage ``req``'s prompt blocks for a decode instance; returns the hand-off's ``kv_transfer_params``."""
        bs = self.kv.layout.block_size
        n = (req.num_prompt_tokens - 1) // bs  # what D's prefix lookup can use (it must run the last token)
        n = min(n, len(req.kv.block_table), req.kv.num_tokens // bs)
        tid = uuid.uuid4().hex
        data = self.codec.read(req.kv.block_table[:n]) if n else torch.empty(0, self.codec.block_bytes)
        hashes = (req.block_hashes or block_hashes(req.prompt_token_ids, bs, req.cache_salt))[:n]
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            if n:
                self._exports[tid] = _Export(data.contiguous(), now + self.lease_s)
        return {
            "transfer_id": tid,
            "num_blocks": n,
            "block_hashes": [h.hex() for h in hashes],
            "layout": self.codec.fingerprint,
            "model": self.model_name,
            "prompt_tokens": req.num_prompt_tokens,
        }

    def export_chunks(self, transfer_id: str, first: int, count: int):
        """P, HTTP side: an iterator of the bytes of blocks first..first+count-1 (one chunk a block), or a
        ``KeyError`` / ``ValueError`` naming what is wrong. The hand-off is dropped once fully sent."""
        with self._lock:
            self._expire(time.monotonic())
            ex = self._exports.get(transfer_id)
        if ex is None:
            raise KeyError(f"no KV hand-off {transfer_id!r} here (never made, already pulled, or its lease ran out)")
        if not (0 <= first and count >= 0 and first + count <= ex.data.shape[0]):
            raise ValueError(f"blocks {first}..{first + count - 1} are outside hand-off {transfer_id!r}")
        delay = float(os.environ.get(SEND_DELAY_ENV, "0") or 0)

        def chunks():
            for b in range(first, first + count):
                yield ex.data[b].numpy().tobytes()
                if delay:
                    time.sleep(delay)
            self.drop(transfer_id)

        return chunks()

    def drop(self, transfer_id: str) -> bool:
        with self._lock:
            return self._exports.pop(transfer_id, None) is not None

    def num_exports(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return len(self._exports)

    def _expire(self, now: float) -> None:
        for tid in [t for t, e in self._exports.items() if e.expires <= now]:
            del self._exports[tid]

    # ------------------------------------------------------------------ decode side
    def start_load(self, req) -> bool:
        """D: True if ``req`` waits for remote KV (its pull has started). Local prefix hits of the hand-off are not
        pulled again; they, like the arrived blocks, are held until ``admitted``. Raises ``KVTransferError`` for a
        hand-off this instance cannot take (another layout or model, another prompt)."""
        p = req.kv_transfer
        n, url, tid = int(p.get("num_blocks", 0)), p.get("remote_url"), p.get("transfer_id")
        if p.get("layout") != self.codec.fingerprint:
            raise KVTransferError(
                f"the KV hand-off's cache layout ({p.get('layout')}) is not this instance's "
                f"({self.codec.fingerprint}): prefill and decode must run the same model, dtype, block size, "
                "KV cache dtype and replay mode",
                400,
            )
        if p.get("model") not in (None, self.model_name):
            raise KVTransferError(
                f"the KV hand-off is of model {p.get('model')!r}, this instance serves {self.model_name!r}", 400
            )
        bs = self.kv.layout.block_size
        n = min(n, (req.num_prompt_tokens - 1) // bs)
        if n == 0:
            return False
        if not url or not tid:
            raise KVTransferError("kv_transfer_params need remote_url and transfer_id (the router sets them)", 400)
        hashes = block_hashes(req.prompt_token_ids, bs, req.cache_salt)[:n]
        if [h.hex() for h in hashes] != list(p.get("block_hashes", []))[:n]:
            raise KVTransferError(
                "the KV hand-off is of another prompt (its block hashes differ from this request's tokens: another "
                "chat template, tokenizer or cache_salt on the prefill instance?)",
                400,
            )
        local = self.kv.prefix.lookup(hashes)
        self.kv.blocks.touch(local)  # held: an eviction before admission would break the chain
        first = len(local)
        load = _Load(req, hashes, list(local), first, None, url, tid)
        if first < n:
            load.future = self._pool.submit(
                fetch_blocks, url, tid, first, n - first, (n - first) * self.codec.block_bytes, self.transfer_timeout
            )
        elif tid:
            self._pool.submit(release_remote, url, tid)  # nothing to pull: P may drop its copy now
        lay = self.kv.layout
        alt = handoff_bytes(lay, req.num_prompt_tokens, lay.main_fmt.channels, getattr(lay.index_fmt, "channels", 0))
        req.kv_transfer_stats = {
            "blocks_local": first,
            "blocks_pulled": n - first,
            "bytes": 0,
            "global_bytes": 0,
            "with_window_rows_bytes": alt.with_window_rows,
            "with_window_ring_bytes": alt.with_window_ring,
        }
        self._loads[req.request_id] = load
        return True

    def poll(self, wait_s: float = 0.0) -> list:
        """D, engine thread: the requests whose KV arrived since the last call, written into fresh blocks and joined
        to the prefix cache (a request whose blocks cannot be allocated yet waits for a later call). Failed pulls go
        to ``failed`` with their blocks released. ``wait_s``: block up to this long for a pull to end (an engine with
        nothing else to do)."""
        pending = [ld.future for ld in self._loads.values() if ld.future is not None and not ld.future.done()]
        if wait_s > 0 and pending and len(pending) == sum(1 for ld in self._loads.values() if ld.future is not None):
            wait(pending, timeout=wait_s, return_when="FIRST_COMPLETED")
        arrived = []
        for rid, ld in list(self._loads.items()):
            if ld.future is not None and not ld.future.done():
                continue
            if ld.future is not None:
                try:
                    data = ld.future.result()
                except KVTransferError as e:
                    self._fail(rid, e.status, str(e))
                    continue
                except Exception as e:  # noqa: BLE001 - a bug in the pull: fail this request, keep serving
                    self._fail(rid, 500, f"KV transfer failed: {type(e).__name__}: {e}")
                    continue
                if not self._import(ld, data):
                    continue  # no room yet: try again after a step has freed blocks
            del self._loads[rid]
            st = ld.req.kv_transfer_stats
            st["transfer_s"] = time.perf_counter() - ld.started
            ld.req.kv_held = ld.held
            arrived.append(ld.req)
        return arrived

    def _import(self, ld: _Load, data: bytes) -> bool:
        count = len(ld.hashes) - ld.first
        if self.kv.blocks.num_free < count:
            return False
        t0 = time.perf_counter()
        blocks = self.kv.blocks.allocate(count)
        arr = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(count, self.codec.block_bytes)
        self.codec.write(blocks, arr)
        for b, h in zip(blocks, ld.hashes[ld.first :]):
            self.kv.prefix.register(b, h)
        ld.held += blocks
        ld.future = None
        st = ld.req.kv_transfer_stats
        st["bytes"] = len(data)
        st["global_bytes"] = count * self.codec.global_block_bytes
        st["import_s"] = time.perf_counter() - t0
        return True

    def _fail(self, rid: str, status: int, reason: str) -> None:
        ld = self._loads.pop(rid)
        self.kv.blocks.free(ld.held)
        ld.held = []
        if ld.url and ld.transfer_id:  # P may drop its staged copy now rather than at its lease's end
            self._pool.submit(release_remote, ld.url, ld.transfer_id)
        self.failed.append((ld.req, status, reason))

    def has_arrivals(self) -> bool:
        return any(ld.future is None or ld.future.done() for ld in self._loads.values())

    def cancel(self, req) -> None:
        """D: ``req`` ended while loading (an abort): release what it holds; the pull's bytes are dropped on
        arrival."""
        ld = self._loads.pop(req.request_id, None)
        if ld is not None:
            if ld.future is not None:
                ld.future.cancel()
            self.kv.blocks.free(ld.held)
            if ld.url and ld.transfer_id:
                self._pool.submit(release_remote, ld.url, ld.transfer_id)

    def held_blocks(self) -> list[int]:
        """Blocks held by loads under way (for the cache's invariant check)."""
        return [b for ld in self._loads.values() for b in ld.held]

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
