"""vLLM's offline API on dsserve: LLM(...) keyword arguments, LLM.chat, apply_chat_template, prompt_logprobs
(against the reference forward) and detokenize=False."""

import random

import pytest
import torch

from dsserve import LLM, SamplingParams
from dsserve.engine.args import EngineArgsError
from dsserve.engine.core import RequestError
from dsserve.engine.sampling_params import SamplingParamsError

VLLM_KWARGS = dict(  # vLLM's common LLM(...) arguments, with vLLM's meanings
    tensor_parallel_size=1,
    dtype="float64",  # so that the engine and the reference forward agree to rounding
    max_model_len=512,
    trust_remote_code=True,
    seed=3,
    enforce_eager=True,
    enable_prefix_caching=True,
    max_num_seqs=8,
    max_num_batched_tokens=32,  # a 70-token prompt prefills in three chunks
    tokenizer="tiny",
    quantization=None,
    kv_cache_dtype="auto",
)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", device="cpu", block_size=16, **VLLM_KWARGS)


def test_vllm_keyword_arguments_are_taken_with_their_meaning(llm):
    a = llm.engine.args
    assert (a.max_model_len, a.max_num_seqs, a.seed, a.enforce_eager, a.tokenizer) == (512, 8, 3, True, "tiny")
    assert llm.engine.max_model_len == 512 and llm.engine.model.head.weight.dtype == torch.float64
    assert llm.engine.sampler.generator.initial_seed() == 3


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(pipeline_parallel_size=2), "issue 54"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(quantization="awq"), "quantization must be fp8, none or None"),
        (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype must be one of"),
        (dict(hf_overrides={}), "unknown engine option"),
    ],
)
def test_vllm_keyword_arguments_refused_clearly(kw, match):
    with pytest.raises(EngineArgsError, match=match):  # before any model is built: no TypeError, no cost
        LLM(model="tiny", **kw)


def test_engine_seed_drives_unseeded_sampling(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=6)
    runs = []
    for _ in range(2):
        llm.engine.sampler.generator.manual_seed(3)
        runs.append(llm.generate(["Seeded by the engine"], sp, use_tqdm=False)[0].outputs[0].token_ids)
    assert runs[0] == runs[1]


def prompt_of(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 8190) for _ in range(n)]


def test_prompt_logprobs_match_the_reference_forward(llm):
    prompt = prompt_of(70, 0)
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]  # cached blocks exist: not read
    assert out.num_cached_tokens == 0
    ref = llm.engine.model.reference_logits(torch.tensor(prompt)).double().log_softmax(-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        d, tok = plp[pos], prompt[pos]
        assert d[tok].logprob == pytest.approx(ref[pos - 1, tok].item(), abs=1e-6)
        assert d[tok].rank == int((ref[pos - 1] >= ref[pos - 1, tok]).sum())
        top = ref[pos - 1].topk(2)
        assert set(top.indices.tolist()) <= set(d) and len(d) <= 3
        assert d[tok].decoded_token == llm.get_tokenizer().decode([tok])
    # prompt_logprobs=0: only each prompt token's own entry
    zero = llm.generate([{"prompt_token_ids": prompt[:20]}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert all(list(d) == [t] for d, t in zip(zero.prompt_logprobs[1:], prompt[1:20]))


def test_detokenize_false_gives_ids_only(llm):
    sp = dict(temperature=0, max_tokens=5, logprobs=1, ignore_eos=True)
    a = llm.generate(["Some text"], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    b = llm.generate(["Some text"], SamplingParams(**sp, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert a.text and b.text == "" and b.token_ids == a.token_ids
    assert all(lp.decoded_token is None for d in b.logprobs for lp in d.values())
    with pytest.raises(SamplingParamsError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_apply_chat_template(llm):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hello there<｜Assistant｜>")
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True) == tok.encode(text, add_bos=False)
    assert not tok.apply_chat_template(MESSAGES, tokenize=False).endswith("</think>")  # HF's default: no prompt
    thinking = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, thinking=True)
    assert thinking.endswith("<｜Assistant｜><think>")
    assert "get_weather" in tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False)
    d = tok.apply_chat_template(MESSAGES, return_dict=True)
    assert len(d["input_ids"]) == len(d["attention_mask"])


def test_chat_equals_generate_on_the_encoded_prompt(llm):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tok = llm.get_tokenizer()
    kwargs = {"enable_thinking": True}
    outs = llm.chat([MESSAGES, MESSAGES[1:]], sp, use_tqdm=False, tools=TOOLS, chat_template_kwargs=kwargs)
    for conv, out in zip([MESSAGES, MESSAGES[1:]], outs):
        ids = tok.apply_chat_template(conv, tools=TOOLS, add_generation_prompt=True, thinking=True)
        assert out.prompt_token_ids == ids
        # another salt: a prefix hit under bounded replay is (by design) not bit-identical to the cold run
        ref = llm.generate([{"prompt_token_ids": ids, "cache_salt": "ref"}], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    single = llm.chat(MESSAGES, sp, use_tqdm=False)  # one conversation
    assert len(single) == 1 and single[0].prompt_token_ids == tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True
    )
    with pytest.raises(RequestError, match="unknown role"):
        llm.chat([{"role": "robot", "content": "x"}], sp)
    with pytest.raises(RequestError, match="chat_template"):
        llm.chat(MESSAGES, sp, chat_template="{{ messages }}")


def test_default_sampling_params_come_from_the_generation_config(llm, monkeypatch):
    assert llm.get_default_sampling_params() == SamplingParams()  # tiny has no generation_config.json
    monkeypatch.setattr(llm.engine, "default_sampling", {"temperature": 0.0, "max_tokens": 3})
    assert llm.get_default_sampling_params().max_tokens == 3
    out = llm.generate(["Defaults"], use_tqdm=False)[0]  # no sampling_params: the generation config's
    assert len(out.outputs[0].token_ids) <= 3
