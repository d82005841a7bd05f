"""A vLLM DeepSeek launch line with `vllm` replaced by `dsserve`: the built-in model, named by a Hugging Face id
found in the local cache, serves completions; then `dsserve bench serve` runs against it."""

import json
import os
import subprocess
import sys

import httpx
import pytest
from hf_cache import fake_hf_cache
from live_server import ROOT, live_server

MAX_MODEL_LEN = 48
LAUNCH = (  # after `dsserve serve deepseek-ai/tiny-trained` (live_server adds --port and --shutdown-timeout)
    "--trust-remote-code --kv-cache-dtype fp8_ds_mla --block-size 16 --enable-expert-parallel -tp 1 -dp 1 "
    "--tokenizer-mode deepseek_v4 --tool-call-parser deepseek_v4 --enable-auto-tool-choice "
    "--reasoning-parser deepseek_v4 --served-model-name deepseek-ai/DeepSeek-V4.1-Flash dsv4 --api-key k1 k2 "
    f"--max-model-len {MAX_MODEL_LEN} --dtype auto --uvicorn-log-level warning --enable-log-requests "
    "--swap-space 4 --enforce-eager --max-num-seqs 8 --seed 0"
).split()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf")
    fake_hf_cache(str(cache), extra={"generation_config.json": {"temperature": 0.0, "do_sample": False}})
    log = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        with live_server("deepseek-ai/tiny-trained", LAUNCH, log) as base:
            yield base
    assert "tokenizer_mode 'deepseek_v4': no effect" in log[0] and "tool calling (--tool-call-parser" in log[0]
    assert "prompt tokens, SamplingParams(" in log[0]  # --enable-log-requests


def post(base, body, key="k2", path="/v1/completions"):
    return httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_launch_line_serves_a_completion(vllm_server):
    r = post(vllm_server, {"model": "dsv4", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "deepseek-ai/DeepSeek-V4.1-Flash"  # the first served name is the one reported
    assert body["usage"]["completion_tokens"] == 4
    assert post(
        vllm_server, {"model": "deepseek-ai/DeepSeek-V4.1-Flash", "prompt": "Hi", "max_tokens": 1}, "k1"
    ).is_success
    assert post(vllm_server, {"prompt": "Hi", "max_tokens": 1}, key="k3").status_code == 401
    assert httpx.get(vllm_server + "/v1/models").status_code == 401  # /v1/* needs a key, as in vLLM
    models = httpx.get(vllm_server + "/v1/models", headers={"Authorization": "Bearer k2"}).json()["data"]
    assert [m["id"] for m in models] == ["deepseek-ai/DeepSeek-V4.1-Flash", "dsv4"]
    assert post(vllm_server, {"model": "deepseek-ai/tiny-trained", "prompt": "Hi", "max_tokens": 1}).status_code == 404


def test_omitted_max_tokens_is_the_rest_of_the_context_and_generation_config_sets_defaults(vllm_server):
    r = post(vllm_server, {"prompt": "Hello", "ignore_eos": True})  # no max_tokens, no temperature
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    # generation_config.json's temperature 0 is the default: the text is the explicit greedy one
    greedy = post(vllm_server, {"prompt": "Hello", "ignore_eos": True, "temperature": 0, "max_tokens": 10})
    assert r.json()["choices"][0]["text"].startswith(greedy.json()["choices"][0]["text"])
    # a request's own value wins over the generation config
    hot = [
        post(vllm_server, {"prompt": "Hello", "max_tokens": 10, "temperature": 1.0, "seed": s}).json() for s in (1, 2)
    ]
    assert hot[0]["choices"][0]["text"] != hot[1]["choices"][0]["text"]


def test_bench_serve_against_the_live_server(vllm_server, tmp_path):
    env = dict(os.environ, OPENAI_API_KEY="k1")
    cmd = [sys.executable, "-m", "dsserve", "bench", "serve", "--base-url", vllm_server, "--model", "dsv4"]
    cmd += ["--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4", "--num-prompts", "5"]
    cmd += ["--max-concurrency", "2", "--ignore-eos", "--seed", "1", "--save-result", "--result-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput"):
        assert key in res
    for key in ("output_throughput", "total_token_throughput", "max_concurrency", "num_prompts"):
        assert key in res
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{metric}_ms" in res
    assert res["completed"] == 5 and res["failed"] == 0 and res["total_output_tokens"] == 5 * 4
    assert res["total_input_tokens"] == sum(res["input_lens"]) and len(res["itls"]) == 5
    assert all(len(itl) <= 3 for itl in res["itls"])  # 4 tokens: at most 3 gaps (a chunk may carry two)
    assert 0 < res["mean_ttft_ms"] <= res["mean_e2el_ms"]
    saved = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    assert len(saved) == 1 and json.load(open(tmp_path / saved[0]))["completed"] == 5


def test_bench_serve_chat_backend(vllm_server):
    env = dict(os.environ, OPENAI_API_KEY="k2")
    cmd = [sys.executable, "-m", "dsserve", "bench", "serve", "--base-url", vllm_server, "--backend", "openai-chat"]
    cmd += ["--random-input-len", "6", "--random-output-len", "3", "--num-prompts", "2", "--request-rate", "50"]
    r = subprocess.run(cmd + ["--ignore-eos"], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["model_id"] == "deepseek-ai/DeepSeek-V4.1-Flash"  # no --model: the server's first
    assert (res["completed"], res["total_output_tokens"], res["request_rate"]) == (2, 6, 50.0)
    assert res["total_input_tokens"] > 2 * 6  # the chat format's tokens around each prompt, as the server counts
