"""vLLM's launch flags and engine options, with its spellings: parsed, mapped, or refused with a clear reason."""

import json
import os

import pytest
from hf_cache import fake_hf_cache

from dsserve.cli import _build_parser, main
from dsserve.engine.args import EngineArgs, EngineArgsError
from dsserve.engine.generation_config import default_sampling
from dsserve.models.config import ConfigError
from dsserve.models.hub import resolve_model
from dsserve.models.presets import CHECKPOINTS
from dsserve.server.serve import serving_notes

RECIPE = (
    "serve deepseek-ai/DeepSeek-V4-Flash -tp 1 -dp 1 --enable-expert-parallel --trust-remote-code "
    "--tokenizer-mode deepseek_v4 --enable-auto-tool-choice --tool-call-parser deepseek_v4 "
    "--reasoning-parser deepseek_v4 --uvicorn-log-level info --disable-log-requests --max-model-len 2048 "
    "--block-size 16 --swap-space 8 --enforce-eager --kv-cache-dtype fp8_ds_mla --dtype half -q fp8 "
    "--served-model-name a b --api-key k1 k2 --generation-config vllm --max-num-seqs 8 --port 8001"
).split()


def parse(argv):
    return _build_parser(argv).parse_args(argv)


def test_a_vllm_deepseek_launch_line_parses_with_vllm_meanings():
    ns = parse(RECIPE)
    assert ns.served_model == "deepseek-ai/DeepSeek-V4-Flash"  # the positional is the model, not a served name
    assert ns.served_model_name == ["a", "b"] and ns.api_key == ["k1", "k2"]
    assert ns.uvicorn_log_level == "info" and ns.enable_log_requests is False
    assert ns.enable_auto_tool_choice and ns.tool_call_parser == ns.reasoning_parser == "deepseek_v4"
    args = EngineArgs.from_cli(ns)
    assert (args.tensor_parallel_size, args.data_parallel_size, args.max_model_len, args.block_size) == (1, 1, 2048, 16)
    assert args.enable_expert_parallel and args.trust_remote_code and args.enforce_eager
    assert (args.tokenizer_mode, args.swap_space, args.quantization) == ("deepseek_v4", 8.0, "fp8")
    assert args.kv_cache_dtype == "auto"  # fp8_ds_mla: the release's packed FP8 records
    assert args.torch_dtype_name("cpu") == "float16" and args.generation_config == "vllm"
    notes = " ".join(args.notes() + serving_notes(ns))
    for word in ("tokenizer_mode", "trust_remote_code", "enable_expert_parallel", "swap_space", "tool", "reasoning"):
        assert word in notes


def test_served_model_names_no_longer_swallow_the_model():
    ns = parse(["serve", "--served-model-name", "a", "b"])
    assert ns.served_model is None and ns.served_model_name == ["a", "b"]
    assert parse(["serve", "tiny", "--api-key", "k"]).api_key == ["k"]


def test_log_requests_spellings():
    assert parse(["serve", "--enable-log-requests"]).enable_log_requests is True
    assert parse(["serve", "--enable-log-requests", "--disable-log-requests"]).enable_log_requests is False
    assert parse(["serve"]).enable_log_requests is False and parse(["serve"]).default_max_tokens is None


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--dtype", "auto", ("float32", "bfloat16")),
        ("--dtype", "half", ("float16", "float16")),
        ("--dtype", "float16", ("float16", "float16")),
        ("--dtype", "bfloat16", ("bfloat16", "bfloat16")),
        ("--dtype", "float", ("float32", "float32")),
        ("--dtype", "float32", ("float32", "float32")),
    ],
)
def test_dtype_as_vllm_spells_it(flag, value, want):
    args = EngineArgs.from_cli(parse(["generate", flag, value]))
    assert (args.torch_dtype_name("cpu"), args.torch_dtype_name("cuda")) == want


def test_default_dtype_is_auto():
    assert EngineArgs().dtype == "auto" and EngineArgs().torch_dtype_name("cpu") == "float32"
    with pytest.raises(EngineArgsError, match="dtype must be one of.*'half'"):
        EngineArgs(dtype="fp7")


@pytest.mark.parametrize("value,want", [("fp8", "auto"), ("fp8_e4m3", "auto"), ("bfloat16", "bf16"), ("bf16", "bf16")])
def test_kv_cache_dtype_aliases(value, want):
    assert EngineArgs(kv_cache_dtype=value).kv_cache_dtype == want


def test_kv_cache_dtype_refused_names_the_choices():
    with pytest.raises(EngineArgsError, match="kv_cache_dtype must be one of.*fp8_ds_mla"):
        EngineArgs(kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("flag", ["-pp"])  # -tp and -dp run (tests/distributed)
def test_parallel_sizes_above_one_are_refused_not_ignored(flag, capsys):
    assert main(["generate", "--model", "tiny", flag, "2"]) == 2
    err = capsys.readouterr().err
    assert "not yet supported: parallel execution is issue 54" in err and "Traceback" not in err


def test_data_parallel_size_below_one_is_refused():
    with pytest.raises(EngineArgsError, match="data_parallel_size must be >= 1, got 0"):
        EngineArgs(data_parallel_size=0)


def test_speculative_config_parses_vllms_form_and_refuses_bad_values_clearly():
    ns = parse(["serve", "tiny", "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 4}'])
    spec = EngineArgs.from_cli(ns).speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("dspark", 4)
    assert EngineArgs(speculative_config={"method": "mtp", "num_speculative_tokens": 2}).speculative_config.method == (
        "dspark"
    )  # LLM(speculative_config={...}); vLLM's name for a model's own draft layers
    with pytest.raises(EngineArgsError, match="JSON object"):
        EngineArgs(speculative_config="{method")
    with pytest.raises(EngineArgsError, match="num_speculative_tokens must be an int in 1..5"):
        EngineArgs(speculative_config={"method": "dspark", "num_speculative_tokens": 6})
    with pytest.raises(EngineArgsError, match="num_speculative_tokens must be an int in 1..5"):
        EngineArgs(speculative_config={"method": "dspark"})
    with pytest.raises(EngineArgsError, match="use 'dspark'"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(EngineArgsError, match="unknown key"):
        EngineArgs(speculative_config={"method": "dspark", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    ada = EngineArgs(speculative_config={"num_speculative_tokens": 5, "confidence_threshold": 0.6}).speculative_config
    assert ada.confidence_threshold == 0.6
    with pytest.raises(EngineArgsError, match=r"confidence_threshold must be a number in \[0, 1\)"):
        EngineArgs(speculative_config={"num_speculative_tokens": 5, "confidence_threshold": 1.5})


def test_hugging_face_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    snap = fake_hf_cache(str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert os.path.samefile(resolve_model("deepseek-ai/tiny-trained"), snap)
    assert resolve_model("tiny") == "tiny" and resolve_model("tiny-trained") == "tiny-trained"
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        resolve_model("deepseek-ai/not-there")


def test_generation_config_gives_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 7, "do_sample": True, "bos_token_id": 0})
    )
    want = {"temperature": 0.6, "top_p": 0.95, "max_tokens": 7}
    assert default_sampling("auto", str(tmp_path)) == want
    assert default_sampling(str(tmp_path), None) == want  # a directory given
    assert default_sampling("vllm", str(tmp_path)) == {}
    assert default_sampling("auto", CHECKPOINTS["tiny-trained"]) == {}  # no file: none
    with pytest.raises(ConfigError, match="no generation_config.json"):
        default_sampling(str(tmp_path / "missing"), None)


def test_bench_latency_runs_without_prefix_caching(capsys):
    argv = "bench latency --model tiny --block-size 16 --input-len 40 --output-len 2 --batch-size 1 --num-iters 2"
    assert main(argv.split() + ["--num-iters-warmup", "0"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the second iteration repeats the prompt: with caching on it would reuse its two full 16-token blocks
    assert res["prefix_caching"] is False and res["cached_prompt_tokens"] == 0


def _bench_ns(**kw):
    ns = parse(["bench", "serve"])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_bench_serve_datasets(tmp_path):
    from dsserve.bench.serve import random_requests, sharegpt_requests
    from dsserve.models.tokenizer import Tokenizer

    tok = Tokenizer.load("tiny")
    ns = _bench_ns(num_prompts=50, random_input_len=20, random_output_len=10, random_range_ratio=0.5)
    reqs = random_requests(ns, tok, chat=False)
    assert len(reqs) == 50 and all(10 <= r.prompt_len <= 30 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len and min(r.prompt) > 2 for r in reqs)  # no BOS/EOS/pad ids
    assert len({r.prompt_len for r in reqs}) > 1 and random_requests(ns, tok, chat=False) == reqs  # seeded
    assert all(isinstance(r.prompt, str) for r in random_requests(ns, tok, chat=True))
    conv = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}  # noqa: E731
    data = [conv("tell me about the sea " * 3, "the sea is wide and deep " * 2), {"conversations": []}]
    data.append(conv("hi", "a reply that is long enough"))  # a prompt under 4 tokens: dropped, as vLLM does
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    (req,) = sharegpt_requests(_bench_ns(dataset_path=str(path), num_prompts=1), tok)
    assert req.prompt.startswith("tell me") and req.output_len == len(
        tok.encode("the sea is wide and deep " * 2, False)
    )
    with pytest.raises(ValueError, match="only 1 usable"):
        sharegpt_requests(_bench_ns(dataset_path=str(path), num_prompts=2), tok)


def test_bench_serve_metrics_add_up():
    from dsserve.bench.serve import RequestResult, summarize

    ok = [RequestResult(True, 10, 5, 0.1, 0.5, [0.1] * 4), RequestResult(True, 20, 3, 0.3, 0.7, [0.2, 0.2])]
    res = summarize(ok + [RequestResult(error="HTTP 500")], 2.0, [50.0, 99.0])
    assert (res["completed"], res["failed"], res["total_input_tokens"], res["total_output_tokens"]) == (2, 1, 30, 8)
    assert res["request_throughput"] == 1.0 and res["output_throughput"] == 4.0 and res["total_token_throughput"] == 19
    assert res["mean_ttft_ms"] == pytest.approx(200) and res["mean_e2el_ms"] == pytest.approx(600)
    assert res["mean_tpot_ms"] == pytest.approx((100 + 200) / 2)  # (0.5-0.1)/4 and (0.7-0.3)/2
    assert res["mean_itl_ms"] == pytest.approx(800 / 6) and res["p50_itl_ms"] == pytest.approx(100)


def test_bench_throughput_reports_spec_decode_counts(capsys):
    argv = "bench throughput --model tiny --num-prompts 2 --input-len 8 --output-len 6"
    spec = '{"method": "dspark", "num_speculative_tokens": 2}'
    assert main(argv.split() + ["--speculative-config", spec]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s = res["spec_decode"]
    assert s["num_speculative_tokens"] == 2 and s["num_drafts"] > 0 and s["num_draft_tokens"] <= 2 * s["num_drafts"]
    assert s["mean_acceptance_length"] == 1 + s["num_accepted_tokens"] / s["num_drafts"]
