"""/metrics through the app, in process: every gauge from start-up, rejections by status, the HTTP and process
collectors, and --metrics-names vllm against the PromQL of vLLM's example Grafana dashboard."""

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.server.app import build_app
from dsserve.server.async_engine import AsyncEngine, EngineOverloaded
from dsserve.server.metrics import TTFT_BUCKETS, EngineMetrics

# The metric names in the PromQL of vLLM's examples/online_serving/prometheus_grafana/grafana.json (every panel's
# "expr", and the model_name variable's label_values({__name__=~"vllm:.*"}, model_name)).
GRAFANA_PROMQL_NAMES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# The rest of vLLM v1's PrometheusStatLogger for what dsserve has: (name, type)
VLLM_METRICS = [
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:gpu_cache_usage_perc", "gauge"),
    ("vllm:prefix_cache_queries", "counter"),
    ("vllm:prefix_cache_hits", "counter"),
    ("vllm:gpu_prefix_cache_queries", "counter"),
    ("vllm:gpu_prefix_cache_hits", "counter"),
    ("vllm:num_preemptions", "counter"),
    ("vllm:prompt_tokens", "counter"),
    ("vllm:generation_tokens", "counter"),
    ("vllm:request_success", "counter"),
    ("vllm:request_prompt_tokens", "histogram"),
    ("vllm:request_generation_tokens", "histogram"),
    ("vllm:iteration_tokens_total", "histogram"),
    ("vllm:request_max_num_generation_tokens", "histogram"),
    ("vllm:request_params_n", "histogram"),
    ("vllm:request_params_max_tokens", "histogram"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:time_per_output_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:request_time_per_output_token_seconds", "histogram"),
    ("vllm:time_per_prefill_token_request_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_queue_time_seconds", "histogram"),
    ("vllm:request_inference_time_seconds", "histogram"),
    ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"),
]


@pytest.fixture(scope="module")
def core():
    return EngineCore(EngineArgs(model="tiny", max_num_seqs=4, block_size=16))


@pytest.fixture
def serve(core):
    engines = []

    def make(names="dsserve", **kw):
        engine = AsyncEngine(core, max_waiting=8, metrics=EngineMetrics(model_name="tiny", names=names))
        engines.append(engine)
        return engine, TestClient(build_app(engine, "tiny", **kw))

    yield make
    for e in engines:
        e.shutdown(1.0)


def scrape(client):
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    samples = {}
    for f in fams.values():
        for s in f.samples:
            samples.setdefault(s.name, []).append(s)
    return fams, samples


def one(samples, name, **labels):
    got = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (name, labels, samples.get(name))
    return got[0]


def test_every_gauge_is_there_from_start_up(core, serve):
    _, c = serve()
    _, s = scrape(c)
    assert one(s, "dsserve:kv_cache_blocks", kind="global", state="total") == core.kv.blocks.num_blocks
    assert one(s, "dsserve:kv_cache_blocks", kind="window", state="total") == core.kv.slots.num_blocks
    assert one(s, "dsserve:kv_cache_usage_perc", kind="global") == 0
    assert one(s, "dsserve:num_requests_running") == 0 and one(s, "dsserve:num_requests_waiting") == 0
    for status in ("400", "401", "413", "503"):
        assert one(s, "dsserve:rejected_requests_total", status=status) == 0
    assert "process_resident_memory_bytes" in s and "python_info" in s  # prometheus_client's collectors
    assert not any(n.startswith("vllm:") for n in s)


def test_rejections_are_counted_by_status(serve, monkeypatch):
    engine, c = serve(api_key="k", max_body_bytes=2000)
    auth = {"Authorization": "Bearer k"}
    assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert c.post("/v1/completions", json={"prompt": "x" * 3000}, headers=auth).status_code == 413
    assert c.post("/v1/completions", json={"prompt": "x", "temprature": 1}, headers=auth).status_code == 400
    assert c.post("/v1/completions", json={"prompt": "x", "top_p": 9}, headers=auth).status_code == 400
    assert c.get("/v1/nothing", headers=auth).status_code == 404

    def full(*a, **k):
        raise EngineOverloaded("the waiting queue is full")

    monkeypatch.setattr(engine, "submit", full)
    assert c.post("/v1/completions", json={"prompt": "x"}, headers=auth).status_code == 503
    monkeypatch.undo()
    assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=auth).status_code == 200
    _, s = scrape(c)
    counts = {st: one(s, "dsserve:rejected_requests_total", status=st) for st in ("400", "401", "404", "413", "503")}
    assert counts == {"400": 2, "401": 1, "404": 1, "413": 1, "503": 1}
    assert one(s, "http_requests_total", method="POST", status="2xx", handler="/v1/completions") == 1
    assert one(s, "http_requests_total", method="POST", status="4xx", handler="/v1/completions") == 4
    assert one(s, "http_requests_total", method="GET", status="4xx", handler="none") == 1
    assert one(s, "http_request_duration_seconds_count", method="POST", handler="/v1/completions") == 6


def test_vllm_names_cover_the_grafana_dashboard_from_start_up(serve):
    _, c = serve(names="vllm")
    fams, s = scrape(c)
    for name in GRAFANA_PROMQL_NAMES:  # before any request: every panel has a series for $model_name
        assert name in s, name
        assert all(x.labels.get("model_name") == "tiny" for x in s[name])
    for name, kind in VLLM_METRICS:
        assert fams[name].type == kind, name
        assert {k for x in fams[name].samples for k in x.labels} - {"le", "finished_reason"} == {
            "model_name",
            "engine",
        }, name  # vLLM's labels only (no dsserve "kind")
    assert {x.labels["finished_reason"] for x in s["vllm:request_success_total"]} == {"stop", "length", "abort"}
    ttft = [x.labels["le"] for x in s["vllm:time_to_first_token_seconds_bucket"]]
    assert ttft == [str(float(b)) for b in TTFT_BUCKETS] + ["+Inf"]
    assert [x.labels["le"] for x in s["vllm:iteration_tokens_total_bucket"]][:3] == ["1.0", "8.0", "16.0"]
    # dsserve's own metrics stay dsserve:*, and vLLM's are not exported twice (the per-pool KV usage, with its
    # "kind" label, is dsserve's own)
    assert "dsserve:prefill_rows_total" in s and "dsserve:kv_cache_usage_perc" in s
    ours = {n for n in s if n.startswith("dsserve:")}
    assert ours & {n.replace("vllm:", "dsserve:") for n in s if n.startswith("vllm:")} == {
        "dsserve:kv_cache_usage_perc"
    }


def test_vllm_names_move_with_a_request(serve):
    _, c = serve(names="vllm")
    body = {"prompt": "count me in", "max_tokens": 4, "n": 2, "seed": 1, "ignore_eos": True}
    r = c.post("/v1/completions", json=body).json()
    c.post("/v1/completions", json={"prompt": [7] * 40, "max_tokens": 2, "ignore_eos": True}).raise_for_status()
    _, s = scrape(c)
    prompt = r["usage"]["prompt_tokens"]
    assert one(s, "vllm:generation_tokens_total") == 8 + 2
    assert one(s, "vllm:prompt_tokens_total") == 2 * prompt + 40
    assert one(s, "vllm:request_success_total", finished_reason="length") == 3
    # one sample per step with tokens, summing every prompt and generated token
    assert one(s, "vllm:iteration_tokens_total_sum") == 2 * prompt + 40 + 10
    assert one(s, "vllm:iteration_tokens_total_count") >= 4
    # per prompt (vLLM's parent request): n, the longest completion; max_tokens per request
    assert one(s, "vllm:request_params_n_count") == 2 and one(s, "vllm:request_params_n_sum") == 3
    assert one(s, "vllm:request_max_num_generation_tokens_count") == 2
    assert one(s, "vllm:request_max_num_generation_tokens_sum") == 4 + 2
    assert one(s, "vllm:request_params_max_tokens_count") == 3
    assert one(s, "vllm:request_params_max_tokens_sum") == 4 + 4 + 2
    assert one(s, "vllm:time_to_first_token_seconds_count") == 3
    assert one(s, "vllm:kv_cache_usage_perc") == 0 == one(s, "vllm:gpu_cache_usage_perc")
    assert one(s, "vllm:prefix_cache_queries_total") == one(s, "vllm:gpu_prefix_cache_queries_total") > 0


def test_cors_preflight_and_version(serve):
    import dsserve

    origins = ["http://ui.example"]
    cors = dict(allow_origins=origins, allow_methods=["*"], allow_headers=["*"], allow_credentials=True)
    _, c = serve(api_key="k", cors=cors)
    pre = c.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://ui.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200, pre.text  # not 405, not 401: the preflight carries no key
    assert pre.headers["access-control-allow-origin"] == "http://ui.example"
    assert pre.headers["access-control-allow-credentials"] == "true"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    # a browser can read a 401's body too; another origin gets no CORS headers
    r = c.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://ui.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ui.example"
    other = c.get("/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    v = c.get("/version")  # open, like /health
    assert v.status_code == 200 and v.json() == {"version": dsserve.__version__}


def test_serve_flags():
    import argparse

    from dsserve.server.serve import add_serve_args, cors_options

    p = argparse.ArgumentParser()
    add_serve_args(p)
    ns = p.parse_args([])
    assert ns.metrics_names == "dsserve"
    assert cors_options(ns) == dict(
        allow_origins=["*"], allow_methods=["*"], allow_headers=["*"], allow_credentials=False
    )
    ns = p.parse_args(
        [
            "--allowed-origins",
            '["http://a", "http://b"]',
            "--allowed-methods",
            "GET,POST",
            "--allow-credentials",
            "--metrics-names",
            "vllm",
        ]
    )
    assert ns.allowed_origins == ["http://a", "http://b"] and ns.allowed_methods == ["GET", "POST"]
    assert ns.allow_credentials and ns.metrics_names == "vllm"
    with pytest.raises(SystemExit):
        p.parse_args(["--metrics-names", "prometheus"])


def test_live_server_flags_reach_the_app():
    """`serve --metrics-names vllm --allowed-origins ...`: the dashboard's names from start-up, CORS, /version."""
    import os
    import sys

    import httpx

    import dsserve

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from live_server import SERVER_ARGS, live_server

    args = SERVER_ARGS + ["--metrics-names", "vllm", "--allowed-origins", "http://ui.example", "--api-key", "k"]
    with live_server(args=args) as base:
        text = httpx.get(base + "/metrics").text
        names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        assert set(GRAFANA_PROMQL_NAMES) <= names
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0' in text
        assert httpx.get(base + "/version").json() == {"version": dsserve.__version__}
        pre = httpx.options(
            base + "/v1/completions",
            headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"},
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
