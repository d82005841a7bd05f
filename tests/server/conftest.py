import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_ARGS = ["--dtype", "float64", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
               "--block-size", "16", "--seed", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server():
    """A live `dsserve serve tiny` on loopback; SIGTERM at the end must exit 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dsserve", "serve", "tiny", "--port", str(port), *SERVER_ARGS,
                             "--shutdown-timeout", "5"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("server died:\n" + proc.stdout.read())
        time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("server did not come up")
    yield base
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert code == 0, proc.stdout.read()
