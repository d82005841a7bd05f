"""Prefill, decode and router processes on loopback for the P/D tests."""

import os
import signal
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from live_server import SERVER_ARGS, free_port  # noqa: E402


def start(cmd: list[str], port: int, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsserve", *cmd, "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    return proc


def launch(role: str, extra=(), env=None, port=None) -> tuple[subprocess.Popen, str]:
    """A tiny `dsserve serve --kv-role ROLE` (fp64, block 16, no warm-up) starting; ``up`` waits for it."""
    port = port or free_port()
    args = ["serve", "tiny", *SERVER_ARGS, "--kv-role", role, "--no-warmup", "--shutdown-timeout", "2", *extra]
    return start(args, port, env), f"http://127.0.0.1:{port}"


def up(*servers: tuple[subprocess.Popen, str]) -> None:
    for proc, base in servers:
        _wait(proc, base)


def router(prefill: list[str], decode: list[str], extra=()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["router", "--prefill", *prefill, "--decode", *decode, "--health-interval", "0.5", *extra]
    proc = start(args, port)
    base = f"http://127.0.0.1:{port}"
    _wait(proc, base)
    return proc, base


def _wait(proc, base, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{base} died at start (exit {proc.returncode})")
        time.sleep(0.2)
    raise RuntimeError(f"{base} did not come up")


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
