"""A live `dsserve serve` on a free loopback port, for tests that talk HTTP to a real server process."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_ARGS = [
    "--dtype",
    "float64",
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "256",
    "--block-size",
    "16",
    "--seed",
    "0",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    model: str = "tiny", args=SERVER_ARGS, env: dict | None = None, drain: bool = True
) -> tuple[subprocess.Popen, str]:
    """A `dsserve serve` process and its base URL, once /health answers 200. ``drain``: a thread reads the server's
    output into ``proc.lines`` as it comes (a full pipe would block a server that logs a traceback, and the test
    waiting on it would hang instead of failing); False leaves it on ``proc.stdout`` for the caller to read."""
    port = free_port()
    if "--device" not in args:  # the tests compare with fp64 oracles, which the GPU's kernels do not take
        args = [*args, "--device", "cpu"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsserve", "serve", model, "--port", str(port), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    base = f"http://127.0.0.1:{port}"
    if drain:
        proc.lines = []
        proc.reader = threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True)
        proc.reader.start()
    try:
        wait_up(proc, base)
    except BaseException:
        proc.kill()
        raise
    return proc, base


def wait_up(proc: subprocess.Popen, base: str, timeout: float = 600) -> None:
    """Until /health answers 200: a warm-up on a loaded machine can take minutes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("server died:\n" + output(proc))
        time.sleep(0.1)
    raise RuntimeError("server did not come up")


def output(proc: subprocess.Popen) -> str:
    """Everything the server wrote, once it has exited."""
    if hasattr(proc, "reader"):
        proc.reader.join(10)
        return "".join(proc.lines)
    return proc.stdout.read()


@contextmanager
def live_server(model: str = "tiny", args=SERVER_ARGS, log: list | None = None):
    """Yields the base URL; on exit sends SIGTERM, which must drain and exit 0. ``log``: the server's output is
    appended to it once the process has exited."""
    proc, base = spawn(model, [*args, "--shutdown-timeout", "5"])
    try:
        yield base
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out = output(proc)
    if code != 0:
        raise RuntimeError(f"server exited {code} after SIGTERM:\n" + out)
    if log is not None:
        log.append(out)
