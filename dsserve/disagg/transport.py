"""The KV transport: a decode instance pulls a hand-off's blocks from the prefill instance over HTTP on a TCP socket.

Why a socket and not torch.distributed point-to-point: P and D are separate ``dsserve serve`` processes that start,
die and restart on their own. A socket needs no rendezvous and no world fixed in advance, and a dead peer is a
connection error for the one request that was pulling from it; a gloo/NCCL pair would need a process group formed
before the first request, and a peer dying inside ``recv`` can block the survivor until the group's timeout. The
payload is the global KV only (a few hundred KiB for an 8K prompt of the release model), so a socket's bandwidth is
not the limit on the CPU; a GPU deployment would put an RDMA transport (NIXL) behind the same two calls.

The prefill side serves ``GET /kv_transfer/{transfer_id}?first=F&count=N`` (server/app.py): the raw bytes of the
hand-off's blocks F..F+N-1, one block after another (``accounting.BlockCodec``'s order).
"""

from __future__ import annotations

import threading
import time

_client = None
_client_lock = threading.Lock()


def _shared_client():
    """One keep-alive client for every pull of this process (httpx.Client is thread-safe): a pull then costs no
    connection set-up."""
    global _client
    import httpx

    with _client_lock:
        if _client is None:
            _client = httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))
        return _client


class KVTransferError(RuntimeError):
    """A hand-off's KV could not be pulled. ``status``: the HTTP status the decode side answers with (502: the
    prefill instance failed or went away; 504: the transfer ran past its timeout)."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


def fetch_blocks(url: str, transfer_id: str, first: int, count: int, expect_bytes: int, timeout: float) -> bytes:
    """The bytes of blocks ``first..first+count-1`` of hand-off ``transfer_id`` held by the prefill instance at
    ``url``; ``KVTransferError`` naming the cause if the instance cannot be reached, answers with an error, sends
    a wrong length, or the whole pull takes longer than ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    where = f"{url}/kv_transfer/{transfer_id}"
    buf = bytearray()
    try:
        with _shared_client().stream(
            "GET", where, params={"first": first, "count": count}, timeout=httpx.Timeout(timeout)
        ) as resp:
            if resp.status_code != 200:
                resp.read()
                raise KVTransferError(
                    f"the prefill instance {url} refused KV hand-off {transfer_id}: HTTP {resp.status_code} "
                    f"{resp.text[:300]}",
                    502,
                )
            for chunk in resp.iter_bytes():
                buf += chunk
                if time.monotonic() > deadline:
                    raise KVTransferError(
                        f"KV transfer {transfer_id} from {url} timed out after {timeout:g} s "
                        f"({len(buf):,} of {expect_bytes:,} bytes arrived; --kv-transfer-timeout)",
                        504,
                    )
    except httpx.TimeoutException as e:
        raise KVTransferError(
            f"KV transfer {transfer_id} from {url} timed out after {timeout:g} s ({len(buf):,} of "
            f"{expect_bytes:,} bytes arrived; --kv-transfer-timeout): {type(e).__name__}",
            504,
        ) from None
    except httpx.HTTPError as e:
        raise KVTransferError(
            f"KV transfer {transfer_id} from the prefill instance {url} failed after {len(buf):,} of "
            f"{expect_bytes:,} bytes: {type(e).__name__}: {e or 'connection lost'}",
            502,
        ) from None
    if len(buf) != expect_bytes:
        raise KVTransferError(
            f"KV transfer {transfer_id} from {url} ended after {len(buf):,} of {expect_bytes:,} bytes "
            "(the prefill instance went away mid-transfer?)",
            502,
        )
    return bytes(buf)


def release_remote(url: str, transfer_id: str) -> None:
    """Best effort: tell the prefill instance to drop a hand-off the decode side no longer wants (it would expire
    with its lease anyway)."""
    import httpx

    try:
        httpx.delete(f"{url}/kv_transfer/{transfer_id}", timeout=2.0)
    except httpx.HTTPError:
        pass
