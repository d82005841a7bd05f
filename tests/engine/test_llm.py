"""The offline API end to end: LLM(...).generate against the per-sequence reference path."""

import random

import pytest

from dsserve import LLM, SamplingParams
from dsserve.engine.args import EngineArgsError
from dsserve.engine.core import RequestError
from dsserve.engine.greedy import greedy_generate
from dsserve.engine.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def llm():
    # fp64 so batched and per-sequence runs agree exactly, QAT rounding included
    return LLM(
        model="tiny",
        dtype="float64",
        device="cpu",
        max_num_seqs=16,
        max_num_batched_tokens=96,
        swa_bounded_replay=False,
    )


@pytest.fixture(scope="module")
def llm_replay():
    return LLM(model="tiny", dtype="float64", device="cpu", max_num_seqs=16, max_num_batched_tokens=96)


def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 8190) for _ in range(rng.choice([1, 4, 31, 33, 70, 100]))] for _ in range(n)]


@pytest.mark.parametrize("replay", [False, True])
def test_greedy_batch_equals_reference(llm, llm_replay, replay):
    engine = llm_replay if replay else llm
    ps = prompts(10, seed=replay)
    outs = engine.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    model = engine.engine.model
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == greedy_generate(model, p, 8, bounded_replay=replay)
        assert o.finished and o.outputs[0].finish_reason == "length"
    assert engine.engine.kv.blocks.num_free == engine.engine.kv.blocks.num_blocks


def test_text_prompts_n_and_seeds(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, n=3, max_tokens=6)
    a = llm.generate(["Hello world", "Another prompt"], sp, use_tqdm=False)
    b = llm.generate(["Another prompt"], sp, use_tqdm=False)
    assert [len(o.outputs) for o in a] == [3, 3] and [c.index for c in a[0].outputs] == [0, 1, 2]
    assert [c.token_ids for c in a[1].outputs] == [c.token_ids for c in b[0].outputs]  # batch-independent
    assert a[0].prompt == "Hello world" and a[0].prompt_token_ids[0] == llm.get_tokenizer().bos_id
    assert a[0].metrics.ttft is not None and a[0].metrics.ttft >= 0


def test_stop_strings_and_logprobs(llm):
    base = llm.generate(["Stop test"], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    stop = base.text[3:6]  # a string inside the greedy continuation
    o = llm.generate(
        ["Stop test"], SamplingParams(temperature=0, max_tokens=10, stop=[stop], logprobs=2), use_tqdm=False
    )[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == base.text[: base.text.index(stop)]
    assert len(o.logprobs) == len(o.token_ids) and all(len(d) >= 2 for d in o.logprobs)
    assert o.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(o.logprobs, o.token_ids)))


def test_invalid_input_is_rejected_before_entering(llm):
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(SamplingParamsError, match="unknown"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(RequestError, match=r"\[0, 8192\)"):
        llm.generate([[1, 2, 99999]], use_tqdm=False)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    # a bad prompt in a batch rejects the batch before any request runs; the engine keeps serving
    with pytest.raises(RequestError):
        llm.generate([[5, 6, 7], [1, -3]], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    with pytest.raises(EngineArgsError, match="unknown engine option"):
        LLM(model="tiny", max_num_seq=4)


def test_abort_midway_frees_everything(llm):
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"abort-{i}", [7] * (10 + i), SamplingParams(temperature=0, max_tokens=30))
    for _ in range(3):
        eng.step()
    assert eng.abort_request("abort-1").outputs[0].finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
        eng.scheduler.check()
    assert eng.kv.blocks.num_free == eng.kv.blocks.num_blocks and eng.kv.slots.num_free == eng.kv.slots.num_blocks
