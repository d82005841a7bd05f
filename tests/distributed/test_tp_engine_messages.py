"""The TP step message without processes: a worker's mirror, fed only the messages, runs exactly the engine's steps
(prefix hits, bounded replay, preemption and readmission, an id used again); and the options and rendezvous that
start a TP engine, refused clearly where they cannot work."""

import copy
import pickle

import pytest
import torch

from dsserve.distributed.launch import Rendezvous
from dsserve.distributed.tp_worker import Mirror
from dsserve.engine.args import EngineArgs, EngineArgsError
from dsserve.engine.core import EngineCore
from dsserve.engine.executor import StepMessage, step_message
from dsserve.engine.runner import ModelRunner
from dsserve.engine.sampling_params import SamplingParams
from dsserve.kv.paged import PagedKVCache


def test_a_mirror_fed_only_messages_runs_the_engines_steps_exactly():
    args = EngineArgs(
        model="tiny",
        device="cpu",
        dtype="float64",
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=12,
        kv_cache_memory_bytes=9 * 1696 + 4 * 25344,  # 9 blocks of 16 tokens: preemptions
    )
    core = EngineCore(args)
    kv = core.kv
    twin = PagedKVCache(kv.layout, kv.blocks.num_blocks, kv.slots.num_blocks, kv.dtype, device="cpu")
    mirror, runner = Mirror(twin), ModelRunner(copy.deepcopy(core.model), args.replay_form)
    sent, execute, steps, sizes = {}, core.executor.execute, [], []

    def both(plan):
        data = pickle.dumps(step_message(plan, sent))
        sizes.append(len(data))
        theirs = runner.execute(mirror.apply(pickle.loads(data)))
        ours = execute(plan)
        assert [r.request_id for r in theirs[0]] == [r.request_id for r in ours[0]]
        assert torch.equal(theirs[1], ours[1])
        steps.append(len(plan.chunks))
        return ours

    core.executor.execute = both
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, 8000, (35,), generator=g).tolist()
    prompts = [head + torch.randint(3, 8000, (2 + 5 * i,), generator=g).tolist() for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=4)
    reqs = [core.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while core.has_unfinished_requests():
        core.step()
    again = core.add_request("r0", prompts[0], params)  # an id used again: a new request to the mirror
    while core.has_unfinished_requests():
        core.step()
    assert sum(r.num_preemptions for r in reqs) > 0 and again.num_cached_tokens > 0
    assert len(again.output_token_ids) == 4 and set(mirror.requests) <= {"r0"} | {r.request_id for r in reqs}
    assert max(sizes) < 2048 and len(steps) > 10


def test_tensor_parallel_options_are_taken_and_the_others_refused():
    assert EngineArgs(tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(EngineArgsError, match="only 'mp'"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(EngineArgsError, match="issue 54"):
        EngineArgs(pipeline_parallel_size=2)
    tpdp = dict(tensor_parallel_size=2, data_parallel_size=2)
    assert EngineArgs(**tpdp, enable_expert_parallel=True).tensor_parallel_size == 2  # TP inside DEP ranks
    for name in ("enable_eplb", "uniform_routing"):
        with pytest.raises(EngineArgsError, match=f"{name} with tensor_parallel_size=2 x data_parallel_size=2"):
            EngineArgs(**tpdp, enable_expert_parallel=True, **{name: True})
    with pytest.raises(EngineArgsError, match="node_rank"):
        EngineArgs(nnodes=2, node_rank=2)
    with pytest.raises(EngineArgsError, match="tensor parallel across nodes is not supported"):  # nothing spawned
        EngineArgs(tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=29999)


def test_the_rendezvous_takes_the_flags_else_torchruns_variables(monkeypatch):
    env = dict(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GROUP_RANK="1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert Rendezvous.from_env(None, None, 1, 0) == Rendezvous("10.0.0.1", 29500, 2, 1)
    assert Rendezvous.from_env("h", 1234, 4, 3) == Rendezvous("h", 1234, 4, 3)
    assert Rendezvous(master_port=4321).env(1, 2, 1) == dict(
        RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="4321"
    )
    with pytest.raises(ValueError, match="master-port"):
        Rendezvous(nnodes=2, node_rank=1)
    assert pickle.loads(pickle.dumps(StepMessage(stop=True))).stop
