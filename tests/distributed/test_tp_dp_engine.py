"""TP2 x DP2 engine cores (4 gloo processes): two DP ranks, each an EngineCore that is TP rank 0 of its replica and
drives its own TP worker (``tp_worker.start_tensor_parallel``, the ``-tp`` engine's path), the routed experts spread
over the replicas (expert parallel within each TP index) and the replicas in lockstep. Each rank gives the greedy
tokens of a single-process engine fed its requests and logits within 1e-9 (fp64), over the DEP2 test's waves:
16 concurrent requests with chunked prefill, then prefix hits (bounded replay on V4.1), with preemption, then 3
requests on rank 0 while rank 1 (and its TP worker) joins idle, without a hang.

Both models run in one pair of DP-rank processes (one module-scoped spawn), each model in a fresh world of 4."""

import pickle
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import wait

import pytest
import torch
import torch.multiprocessing as mp
from test_dp_engine import engine_args, serve, waves

from dsserve.distributed.dp_rank import build_rank_core, rank_args
from dsserve.distributed.launch import RankProcesses, Rendezvous, free_port
from dsserve.distributed.tp_worker import start_tensor_parallel
from dsserve.engine.core import EngineCore

MODELS = ("tiny", "tiny-v4")
GROUP_TIMEOUT_S = 45.0  # a rank lost in a collective fails the run with its traceback, not a hang
RUN_TIMEOUT_S = 900.0  # both models, 4 processes on a shared 2-core host


@torch.no_grad()
def _dp_rank(dp_rank: int, ports: list[int], conn) -> None:
    """DP rank ``dp_rank``'s process: per model, its TP2 core (with its own worker) serves the waves, then the
    single-process reference serves them; the results go back pickled."""
    try:
        torch.set_num_threads(1)
        out = {}
        for name, port in zip(MODELS, ports):
            args = replace(engine_args(name), tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
            me = start_tensor_parallel(
                rank_args(args, True), dp_rank, 2, True, Rendezvous("127.0.0.1", port), GROUP_TIMEOUT_S
            )
            core = build_rank_core(args, dp_rank, 2, tp_rank=me)
            layout = me.groups.tp_rank, me.groups.tp_size, me.groups.dp_rank, me.groups.dp_size
            experts = tuple(core.model.layers[0].ffn.experts["w1"].shape)
            tp2dp2 = serve(core, waves(dp_rank, name))
            core.close()  # stops the worker, leaves the world: the next model meets at its own port
            alone = serve(EngineCore(rank_args(engine_args(name), expert_parallel=True)), waves(dp_rank, name))
            out[name] = {"tp2dp2": tp2dp2, "ref": alone, "layout": layout, "experts": experts}
        conn.send_bytes(pickle.dumps(out))
    except BaseException:
        conn.send_bytes(pickle.dumps(traceback.format_exc()))


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    ports = [free_port() for _ in MODELS]
    per_rank = [(ports, w) for _, w in pipes]
    procs = RankProcesses.spawn(_dp_rank, [0, 1], 2, Rendezvous().resolved(), per_rank, daemon=False)
    try:
        for _, w in pipes:
            w.close()
        results, deadline = {}, time.monotonic() + RUN_TIMEOUT_S
        while len(results) < 2:
            waiting = [r for r in range(2) if r not in results]
            ready = wait([pipes[r][0] for r in waiting] + [procs.procs[r].sentinel for r in waiting], 5.0)
            for r in waiting:
                if pipes[r][0] in ready or pipes[r][0].poll():
                    value = pickle.loads(pipes[r][0].recv_bytes())
                    if isinstance(value, str):
                        pytest.fail(f"DP rank {r} failed:\n{value}")
                    results[r] = value
                elif not procs.procs[r].is_alive():
                    pytest.fail(f"DP rank {r} exited with status {procs.procs[r].exitcode}")
            if time.monotonic() > deadline:
                pytest.fail(f"DP ranks {waiting} gave no result within {RUN_TIMEOUT_S:.0f} s (a hang)")
        return [results[0], results[1]]
    finally:
        procs.reap(10.0)


@pytest.mark.parametrize("name", MODELS)
def test_tp2_dp2_engine_equals_single_process(runs, name):
    from dsserve.models.presets import preset

    cfg = preset(name)
    for rank, o in enumerate(runs):
        got, ref = o[name]["tp2dp2"], o[name]["ref"]
        assert o[name]["layout"] == (0, 2, rank, 2)  # TP rank 0 of replica `rank`, in a 2 x 2 world
        # 1/2 of the routed experts (EP over the replicas), 1/2 of each one's intermediate (TP within the replica)
        assert o[name]["experts"] == (cfg.n_routed_experts // 2, cfg.moe_intermediate_size // 2, cfg.hidden_size)
        assert got["tokens"] == ref["tokens"] and len(got["tokens"]) == sum(len(w) for w in waves(rank, name))
        for rid, want in ref["logits"].items():
            assert got["logits"][rid].shape == want.shape
            assert (got["logits"][rid] - want).abs().max().item() < 1e-9, (rank, rid)
        assert (got["preempted"], got["hits"]) == (ref["preempted"], ref["hits"])
        assert got["hits"] > 0  # wave 2 extends wave 1's prompts on the same rank
    assert sum(o[name]["tp2dp2"]["preempted"] for o in runs) > 0  # the small cache preempted somewhere
    if cfg.is_v41:
        assert sum(o[name]["tp2dp2"]["replayed"] for o in runs) > 0  # the hits rebuilt their windows by replay
    assert runs[1][name]["tp2dp2"]["idle_steps"] > 0  # rank 1 and its TP worker joined wave 3 idle


def test_llm_with_tp2_dp2_replicas_gives_the_single_engines_tokens():
    """The offline ``LLM`` with ``tensor_parallel_size=2, data_parallel_size=2`` (no EP: two independent TP2
    replicas behind the front end, 4 processes): the single-process engine's greedy tokens, both ranks serving."""
    from dsserve.engine.llm import LLM
    from dsserve.engine.sampling_params import SamplingParams

    opts = dict(model="tiny", device="cpu", dtype="float64", max_num_seqs=4, block_size=16)
    batch = [{"prompt_token_ids": list(range(5 + i, 25 + 7 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=4)
    llm = LLM(tensor_parallel_size=2, data_parallel_size=2, **opts)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        routed = list(llm.engine.router.routed)
    finally:
        llm.engine.close()
    want = [o.outputs[0].token_ids for o in LLM(**opts).generate(batch, params, use_tqdm=False)]
    assert got == want
    assert min(routed) > 0, routed  # both replicas served
