"""Multi-node DP on one host: "node 0" (the front end and DP rank 0) and "node 1" (`dsserve serve --headless
--node-rank 1`: DP rank 1, connected over a socket) are two processes on 127.0.0.1 with --nnodes 2 (DEP2, gloo,
fp64, tiny). The two nodes give the greedy tokens of a one-node DEP2 (two plain DP replicas too); killing node 1
mid-request fails the request with a 503 and node 0 exits non-zero within seconds; a node started for another world
is refused, both sides saying why; flags that cannot work across nodes are clear errors."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dsserve.cli import main
from dsserve.distributed.dp_rank import rank_args
from dsserve.distributed.dp_transport import RemoteRank
from dsserve.engine.args import EngineArgs, EngineArgsError
from dsserve.engine.executor import EngineDeadError
from dsserve.engine.llm import LLM
from dsserve.engine.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import ROOT, SERVER_ARGS, free_port, output, spawn  # noqa: E402
from test_dp_server import descendants, running  # noqa: E402

os.environ["OMP_NUM_THREADS"] = "1"  # two "nodes" share this host's cores: one thread a rank
OPTIONS = dict(dtype="float64", device="cpu", block_size=16, seed=0, max_num_seqs=16, max_num_batched_tokens=256)
OPTIONS.update(data_parallel_size=2, enable_expert_parallel=True)


def start_node1(master_port: int, rpc_port: int, dp: int = 2, ep: bool = True) -> subprocess.Popen:
    argv = [sys.executable, "-m", "dsserve", "serve", "tiny", *SERVER_ARGS, "--device", "cpu", "-dp", str(dp)]
    argv += ["--enable-expert-parallel"] * ep + ["--nnodes", "2", "--node-rank", "1", "--headless"]
    argv += ["--master-port", str(master_port), "--data-parallel-rpc-port", str(rpc_port)]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_two_nodes_give_the_tokens_of_one():
    prompts = [[5 + i, 6, 7, 8 + 2 * i, 9, 10 + i][: 3 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6)
    one = LLM("tiny", **OPTIONS)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.engine.close()
    for ep in (True, False):  # DEP2 (one torch world over both nodes), then two independent replicas
        master, rpc = free_port(), free_port()
        node1 = start_node1(master, rpc, ep=ep)
        try:
            opts = {**OPTIONS, "enable_expert_parallel": ep}
            two = LLM("tiny", **opts, nnodes=2, master_port=master, data_parallel_rpc_port=rpc)
            try:
                assert isinstance(two.engine.procs[1], RemoteRank) and two.engine.procs[1].node_rank == 1
                got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
                assert got == want
                assert two.engine.rank_loads[1].prefix_query_tokens > 0  # node 1's rank served some of them
            finally:
                two.engine.close()
            assert node1.wait(30) == 0  # node 1 leaves when node 0's front end closes
        finally:
            stop(node1)


def test_killing_node_1_fails_its_requests_and_stops_node_0():
    master, rpc = free_port(), free_port()
    node1 = start_node1(master, rpc)
    flags = ["-dp", "2", "--enable-expert-parallel", "--nnodes", "2", "--master-port", str(master)]
    node0, base = spawn("tiny", [*SERVER_ARGS, *flags, "--data-parallel-rpc-port", str(rpc)])
    try:
        ok = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200
        node1_ranks = descendants(node1.pid)
        reply = {}

        def long_request():  # pinned to node 1's rank
            body = {"model": "tiny", "prompt": "a long one", "max_tokens": 300, "ignore_eos": True}
            r = httpx.post(base + "/v1/completions", json=body, headers={"X-data-parallel-rank": "1"}, timeout=60)
            reply.update(status=r.status_code, body=r.json())

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)  # decoding on node 1
        killed = time.monotonic()
        node1.send_signal(signal.SIGKILL)
        t.join(30)
        assert reply["status"] == 503 and "node 1" in reply["body"]["error"]["message"]
        assert time.monotonic() - killed < 20  # bounded: the socket's end is seen at once, no collective timeout
        assert node0.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while any(running(p) for p in node1_ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in node1_ranks if running(p)]
    finally:
        stop(node0)
        stop(node1)
    assert "DP rank 1" in output(node0)


def test_a_node_started_for_another_world_is_refused():
    master, rpc = free_port(), free_port()
    node1 = start_node1(master, rpc, dp=4)
    try:
        with pytest.raises(EngineDeadError, match="data_parallel_size=4 there, 2 on node 0"):
            LLM("tiny", **OPTIONS, nnodes=2, master_port=master, data_parallel_rpc_port=rpc)
        assert node1.wait(30) == 2
        assert "data_parallel_size=4 there, 2 on node 0" in node1.stdout.read()
    finally:
        stop(node1)


def test_flags_that_cannot_span_nodes_are_clear_errors():
    with pytest.raises(EngineArgsError, match="tensor parallel across nodes is not supported"):
        LLM("tiny", tensor_parallel_size=2, nnodes=2, master_port=29500)
    with pytest.raises(EngineArgsError, match="must be a multiple of nnodes"):
        LLM("tiny", data_parallel_size=3, nnodes=2, master_port=29500)
    with pytest.raises(EngineArgsError, match="needs --master-port"):
        LLM("tiny", data_parallel_size=2, nnodes=2)
    with pytest.raises(EngineDeadError, match="node 0 runs the front end"):
        LLM("tiny", data_parallel_size=2, nnodes=2, node_rank=1, master_port=29500)
    with pytest.raises(SystemExit, match="needs --nnodes > 1 and --node-rank > 0"):
        main(["serve", "tiny", "--headless"])


def test_vllm_multi_node_flags_name_the_same_nodes():
    """vLLM's --data-parallel-size-local / --data-parallel-start-rank / --data-parallel-rpc-port lines."""
    vllm = dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2)
    a = EngineArgs(model="tiny", **vllm, data_parallel_rpc_port=13345)
    assert (a.nnodes, a.node_rank, a.master_port, list(a.dp_ranks_of_node())) == (2, 1, 13344, [2, 3])
    assert rank_args(a, True).nnodes == 1  # a rank's own engine is one device's
    with pytest.raises(EngineArgsError, match="the same number of DP ranks on every node"):
        EngineArgs(model="tiny", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=1)
    with pytest.raises(EngineArgsError, match="give one form"):
        EngineArgs(model="tiny", data_parallel_size=4, data_parallel_size_local=2, nnodes=4, master_port=29500)
