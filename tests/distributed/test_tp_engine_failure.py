"""A TP2 server whose worker is killed mid-run: the requests in flight end with a 503 (a stream with its error
event) within seconds, /health turns unhealthy, the server exits non-zero, and no process of it is left. And the
other way round: a rank process whose parent is killed exits on its own (the death pipe)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from dsserve.distributed.launch import free_port

# Generous bounds (a shared 2-core host): the failure itself takes milliseconds (gloo sees the dead peer's socket close)
FAIL_WITHIN_S = 10.0
EXIT_WITHIN_S = 30.0


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = dict(os.environ, DSSERVE_DIST_TIMEOUT_S="20")
    cmd = [sys.executable, "-m", "dsserve", "serve", "--model", "tiny", "--device", "cpu", "-tp", "2"]
    cmd += ["--port", str(port), "--max-num-seqs", "4"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"the TP2 server did not come up: {proc.stderr.read()[-3000:]}")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_killed_worker_fails_requests_with_503_and_the_server_exits_nonzero(server):
    proc, url = server
    workers = [p for p in _children(proc.pid) if "spawn_main" in _cmdline(p) and "resource_tracker" not in _cmdline(p)]
    assert len(workers) == 1, [_cmdline(p) for p in _children(proc.pid)]
    family = [proc.pid, *_children(proc.pid)]  # the worker and anything else the server started
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    started, results = threading.Event(), {}

    def stream():
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    started.set()
        results["stream"] = (events, time.monotonic())

    def plain():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        results["plain"] = (r.status_code, r.text, time.monotonic())

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    assert started.wait(60), "no token streamed"
    time.sleep(0.3)
    killed_at = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    health = None
    while time.monotonic() - killed_at < FAIL_WITHIN_S:
        try:
            health = httpx.get(f"{url}/health", timeout=2).status_code
        except httpx.HTTPError:  # already gone
            health = "closed"
        if health != 200:
            break
        time.sleep(0.05)
    assert health in (503, "closed"), health
    for t in threads:
        t.join(FAIL_WITHIN_S + 30)
    events, ended = results["stream"]
    assert ended - killed_at < FAIL_WITHIN_S
    assert any("error" in e and "engine stopped" in e for e in events), events[-3:]
    status, text, ended = results["plain"]
    assert status == 503 and "TP worker rank 1" in text and ended - killed_at < FAIL_WITHIN_S
    code = proc.wait(EXIT_WITHIN_S)
    assert code != 0
    print(
        f"after the kill: 503s within {max(ended, results['stream'][1]) - killed_at:.2f} s, exit {code} after "
        f"{time.monotonic() - killed_at:.2f} s"
    )
    time.sleep(0.5)
    assert [p for p in family if _alive(p)] == []


PARENT = textwrap.dedent(
    """
    import sys, time
    from dsserve.distributed.launch import RankProcesses, Rendezvous

    def rank_main(rank):
        time.sleep(600)

    if __name__ == "__main__":
        procs = RankProcesses.spawn(rank_main, [1, 2], 3, Rendezvous(master_port=1))
        print(" ".join(str(p) for p in procs.pids.values()), flush=True)
        time.sleep(600)
    """
)


def test_rank_processes_exit_when_their_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        parent.kill()


STARTING = textwrap.dedent(
    """
    import os, signal, sys
    from dsserve.distributed import launch

    spawn = launch.RankProcesses.spawn.__func__

    def spawn_then_kill(cls, *a, **k):  # the worker dies before it reaches the rendezvous
        procs = spawn(cls, *a, **k)
        for p in procs.procs.values():
            os.kill(p.pid, signal.SIGKILL)
        return procs

    if __name__ == "__main__":
        launch.RankProcesses.spawn = classmethod(spawn_then_kill)
        from dsserve.engine.args import EngineArgs
        from dsserve.engine.core import EngineCore

        EngineCore(EngineArgs(model="tiny", device="cpu", tensor_parallel_size=2))
        print("started", flush=True)
    """
)


def test_a_worker_dead_before_the_rendezvous_stops_the_engine_at_once(tmp_path):
    """Rank 0 would wait out the rendezvous timeout (minutes) for a worker that never comes: the start-up watchdog
    ends it with status 1 and the reason instead."""
    script = tmp_path / "starting.py"
    script.write_text(STARTING)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=EXIT_WITHIN_S + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the engine kept waiting for a dead TP worker")
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    assert "TP worker rank 1" in err and "while the engine was starting" in err, err[-2000:]
    assert "started" not in out
    print(f"stopped {time.monotonic() - t0:.1f} s after the start (process start and imports included)")


RANK0_FAILS = textwrap.dedent(
    """
    import os, sys, time
    from dsserve.distributed import launch
    from dsserve.engine import core

    spawned = []
    spawn = launch.RankProcesses.spawn.__func__

    def spawn_and_note(cls, *a, **k):
        procs = spawn(cls, *a, **k)
        spawned.extend(procs.pids.values())
        return procs

    def fails(*a, **k):  # rank 0's own start fails after its workers are up (its GPU out of memory, say)
        raise RuntimeError("rank 0 alone cannot start")

    if __name__ == "__main__":
        launch.RankProcesses.spawn = classmethod(spawn_and_note)
        core.choose_forms = fails  # in this process only: the spawned workers import their own
        from dsserve.engine.args import EngineArgs

        try:
            core.EngineCore(EngineArgs(model="tiny", device="cpu", tensor_parallel_size=2))
        except RuntimeError as e:
            print("caught:", e, flush=True)
        print("workers", *spawned, flush=True)
        time.sleep(60)  # the caller goes on: its workers must not wait for it
    """
)


def test_a_rank_0_that_fails_its_own_start_takes_its_workers_down_and_lives_on(tmp_path):
    script = tmp_path / "rank0_fails.py"
    script.write_text(RANK0_FAILS)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("caught: rank 0 alone cannot start")
        workers = [int(p) for p in proc.stdout.readline().split()[1:]]
        assert len(workers) == 1
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in workers), "the worker still waits for a rank 0 that gave up"
        assert proc.poll() is None  # the caller is not ended for it
    finally:
        proc.kill()
        proc.wait()
