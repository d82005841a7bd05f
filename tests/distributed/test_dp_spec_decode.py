"""DSpark speculative decoding under data parallel (two spawned DP ranks, no expert parallel; the built-in trained
model in fp64): each rank drafts and verifies its own requests, the greedy tokens equal one engine with drafts off,
and the front end's /metrics counts the ranks' drafts (summed over the ranks). With TP: test_tp_spec_decode.py; DEP:
test_dep_spec_decode.py."""

import pytest

from dsserve.distributed.dp_client import DPClient
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.server.metrics import EngineMetrics

ARGS = dict(model="tiny-trained", dtype="float64", device="cpu", max_num_seqs=4, max_model_len=256, seed=0)
SPEC = {"method": "dspark", "num_speculative_tokens": 3}
PARAMS = SamplingParams(temperature=0, max_tokens=12)


def run(engine, prompts: dict, observe=None) -> dict:
    for rid, text in prompts.items():
        engine.add_request(rid, engine.tokenizer.encode(text), PARAMS)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if observe is not None:
            observe(engine)
    return done


def test_dp2_with_drafts_gives_the_tokens_of_one_engine_without_them():
    prompts = {f"r{i}": p for i, p in enumerate(["12+7=", "Q: 3*4 A:", "abcabcabc", "Hello, how", "9-5=", "x y x y x"])}
    want = run(EngineCore(EngineArgs(**ARGS)), prompts)
    client = DPClient(EngineArgs(**ARGS, data_parallel_size=2, speculative_config=SPEC))
    try:
        metrics = EngineMetrics(model_name="tiny-trained")
        got = run(client, prompts, metrics.observe_step)
        assert got == want
        assert all(n > 0 for n in client.router.routed), client.router.routed  # both ranks served
        drafts = sum(x.counters["spec_num_drafts"] for x in client.rank_loads)
        accepted = sum(x.counters["spec_num_accepted_tokens"] for x in client.rank_loads)
        assert drafts > 0 and accepted > 0  # the trained drafter's blocks are mostly accepted
        text = metrics.render()[0].decode()
        assert f'dsserve:spec_decode_num_drafts_total{{model_name="tiny-trained"}} {float(drafts)}' in text, text
        mean = [line for line in text.splitlines() if line.startswith("dsserve:spec_decode_mean_acceptance_length")]
        assert mean and float(mean[0].split()[-1]) == pytest.approx(1 + accepted / drafts)
    finally:
        client.close()


def test_drafts_with_dep_tp_or_tp_x_dp_are_taken():  # test_dep_spec_decode.py, test_tp_spec_decode.py run them
    for extra in (
        dict(data_parallel_size=2, enable_expert_parallel=True),
        dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=2, data_parallel_size=2),
        dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True),
    ):
        assert EngineArgs(model="tiny", speculative_config=SPEC, **extra).speculative_config.num_speculative_tokens == 3
