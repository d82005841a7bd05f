"""`dsserve serve` under torchrun (`python -m torch.distributed.run --nproc-per-node 1 ...`): the node's place comes
from torchrun's variables (serve.take_torchrun_node), its own ports sit above the agent's MASTER_PORT, and two
torchrun launchers on 127.0.0.1 ("node 0" serving HTTP, "node 1" headless; DEP2, gloo, fp64, tiny) answer a
completion with a single engine's greedy tokens, then drain and stop on node 0's SIGTERM or SIGINT with no process
left."""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dsserve.distributed.dp_transport import rpc_address
from dsserve.engine.args import EngineArgs
from dsserve.engine.llm import LLM
from dsserve.engine.sampling_params import SamplingParams
from dsserve.server.serve import add_serve_args, take_torchrun_node

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import ROOT, SERVER_ARGS, free_port, wait_up  # noqa: E402
from test_dp_server import cmdline, descendants, running  # noqa: E402


def torchrun_env(group_rank: int, nnodes: int = 2, local: int = 1, port: int = 29500) -> dict:
    """What torchrun's agent gives its worker (LocalElasticAgent._start_workers), plus one unrelated variable."""
    return {
        "RANK": str(group_rank * local),
        "LOCAL_RANK": "0",
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(group_rank * local),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nnodes * local),
        "LOCAL_WORLD_SIZE": str(local),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_WORLD_SIZE": str(nnodes * local),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "PATH": "/usr/bin",
    }


def serve_ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["tiny", *argv])


def test_torchrun_variables_name_the_node_and_ports_above_the_agents():
    env = torchrun_env(1)
    ns = serve_ns("-dp", "4", "--enable-expert-parallel")
    assert take_torchrun_node(ns, env)
    args = EngineArgs.from_cli(ns)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (2, 1, "10.0.0.1", 29501)
    assert rpc_address(args) == ("10.0.0.1", 29502) and list(args.dp_ranks_of_node()) == [2, 3]
    assert env == {"PATH": "/usr/bin"}  # the ranks dsserve spawns see none of torchrun's world

    ns = serve_ns("-dp", "2")  # node 0: the front end (serves HTTP)
    take_torchrun_node(ns, torchrun_env(0))
    assert (ns.nnodes, ns.node_rank, ns.master_port) == (2, 0, 29501)

    flags = ("--nnodes", "4", "--node-rank", "3", "--master-addr", "h", "--master-port", "7000")
    ns = serve_ns("-dp", "4", *flags, "--data-parallel-rpc-port", "7100")
    take_torchrun_node(ns, torchrun_env(1))  # the flags win
    assert (ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port, ns.data_parallel_rpc_port) == (
        4,
        3,
        "h",
        7000,
        7100,
    )

    ns = serve_ns("-dp", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "2")
    take_torchrun_node(ns, torchrun_env(1))  # vLLM's form names the node itself
    args = EngineArgs.from_cli(ns)
    assert (args.nnodes, args.node_rank, args.master_port) == (2, 1, 29501)

    ns = serve_ns("-tp", "2")  # one node under torchrun: a free port as without it, and nothing left in the env
    env = torchrun_env(0, nnodes=1)
    assert take_torchrun_node(ns, env) and (ns.nnodes, ns.master_port) == (1, None) and "WORLD_SIZE" not in env

    ns, env = serve_ns(), {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1"}
    assert not take_torchrun_node(ns, env) and ns.nnodes == 1 and len(env) == 3  # not torchrun: nothing changes


def test_torchrun_with_several_processes_a_node_is_refused():
    env = torchrun_env(0, local=2)
    with pytest.raises(SystemExit, match="--nproc-per-node 2: run one dsserve per node"):
        take_torchrun_node(serve_ns("-dp", "2"), env)


def free_ports(n: int) -> int:
    """P with P .. P + n - 1 free on 127.0.0.1 (torchrun's agent takes P, dsserve P + 1 and P + 2)."""
    import socket

    for _ in range(100):
        p = free_port()
        try:
            socks = [socket.create_server(("127.0.0.1", p + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return p
    raise RuntimeError("no free port run")


def launcher(node_rank: int, agent_port: int, http_port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    argv += ["--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(agent_port)]
    argv += ["-m", "dsserve", "serve", "tiny", *SERVER_ARGS, "--device", "cpu", "-dp", "2", "--enable-expert-parallel"]
    argv += ["--port", str(http_port), "--shutdown-timeout", "20"]  # below the agent's 30 s before its SIGKILL
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two "nodes" share this host's cores: one thread a rank
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.lines = []
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True)
    proc.reader.start()
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_two_torchrun_launchers_serve_a_single_engines_tokens(sig):
    """Node 0's launcher gets the SIGTERM a scheduler or the SIGINT Ctrl-C gives it; a request in flight on node 1's
    rank must still finish, so dsserve's ranks on node 0 were not killed by the agent's signal to the worker's group."""
    prompt, params = [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM("tiny", dtype="float64", device="cpu", block_size=16, seed=0, max_num_seqs=16)
    try:
        want = one.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    finally:
        one.engine.close()
    agent, http = free_ports(3), free_port()
    nodes = [launcher(0, agent, http), launcher(1, agent, http)]
    tree: set[int] = set()
    try:
        base = f"http://127.0.0.1:{http}"
        wait_up(nodes[0], base)
        for n in nodes:
            tree.update(descendants(n.pid))  # the agents' workers (dsserve) and their DP ranks
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text and r.json()["usage"]["completion_tokens"] == 8
        assert sum("multiprocessing" in cmdline(p) for p in tree) >= 2  # DP rank 0 on node 0, DP rank 1 on node 1
        reply = {}

        def long_request():  # pinned to node 1's rank
            body = {"model": "tiny", "prompt": "a long one", "max_tokens": 40, "ignore_eos": True}
            r = httpx.post(base + "/v1/completions", json=body, headers={"X-data-parallel-rank": "1"}, timeout=120)
            reply.update(status=r.status_code, body=r.json(), at=time.monotonic())

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        stopped = time.monotonic()
        nodes[0].send_signal(sig)  # the agent passes it to node 0's dsserve and its process group
        t.join(120)
        assert reply["status"] == 200 and reply["body"]["usage"]["completion_tokens"] == 40, reply
        assert reply["at"] > stopped  # it was in flight when the signal came (else this test proves nothing)
        codes = [n.wait(120) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait(10)
    out = ["".join(n.lines) for n in nodes if n.reader.join(10) is None]
    # node 0: dsserve drained and closed its ranks (no SIGKILL from the agent); torchrun's launcher itself exits 1 on
    # a SIGTERM (its SignalException), whatever its worker did. Node 1 saw its front end close: 0, not a broken world.
    assert "shutting down" in out[0] and "forcefully exiting" not in out[0], out[0]
    assert codes[0] in (0, 1) and codes[1] == 0, out[1]
    deadline = time.monotonic() + 10
    while any(running(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if running(p)]
