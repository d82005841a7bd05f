"""AgentX metric math (dsserve.bench.metrics) on hand-computed examples; fast and deterministic."""

import csv
import json
import math

import numpy as np
import pytest

from dsserve.bench import metrics as M

S = 10**9  # ns per second


def rec(start_s, end_s, ttft, isl, osl, *, phase="profile", error=None, cached=None, hit=0, blocks=0, **kw):
    return {
        "phase": phase,
        "error": error,
        "start_ns": int(start_s * S),
        "end_ns": int(end_s * S),
        "ttft": ttft,
        "e2el": end_s - start_s,
        "isl": isl,
        "osl": osl,
        "cached": cached,
        "hit_blocks": hit,
        "total_blocks": blocks,
        **kw,
    }


def pt(x, y, **kw):
    return {"p90_intvty": x, "tput_per_gpu": y, **kw}


# ---------------------------------------------------------------- percentiles, ITL, inverted P90


def test_percentile_is_numpy_linear_between_closest_ranks():
    assert M.pct([4, 1, 3, 2], 90) == pytest.approx(3.7)  # k = 3*0.9 = 2.7 -> 3 + 0.7*(4-3)
    assert M.pct([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert M.pct([10, 20, 30, 40, 50], 75) == pytest.approx(40.0)  # k = 3 exactly
    assert M.pct([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)  # k = 3.6
    assert M.pct([7], 99) == 7.0 and M.pct([], 90) is None
    # differs from the other numpy methods on this sample, so the method really is "linear"
    for other in ("lower", "higher", "nearest", "midpoint", "weibull", "hazen"):
        assert np.percentile([1, 2, 3, 4], 90, method=other) != pytest.approx(3.7)


def test_request_itl_and_short_outputs():
    assert M.request_itl(0.5, 2.5, 11) == pytest.approx(0.2)  # (2.5 - 0.5) / 10
    assert M.request_itl(0.5, 0.6, 2) == pytest.approx(0.1)
    assert M.request_itl(0.5, 0.5, 1) is None and M.request_itl(0.5, 0.5, 0) is None


def test_stats_fields():
    s = M.stats([1.0, 2.0, 3.0, 4.0, None])
    assert s["mean"] == 2.5 and s["p50"] == 2.5 and s["p75"] == pytest.approx(3.25)
    assert s["p99"] == pytest.approx(3.97) and s["std"] == pytest.approx(math.sqrt(1.25))
    assert all(v is None for v in M.stats([]).values())


def test_p90_interactivity_is_inverted_p90_itl_not_p10_of_rates():
    itls = [0.01, 0.01, 0.01, 0.01, 0.1]  # one slow user
    iv = M.interactivity(itls)
    assert iv["p90"] == pytest.approx(1 / 0.064)  # P90(ITL): k = 3.6 -> 0.01 + 0.6*0.09 = 0.064 -> 15.625
    p10_of_rates = M.pct([1 / v for v in itls], 10)  # rates [10,100,100,100,100]: k = 0.4 -> 46
    assert p10_of_rates == pytest.approx(46.0) and iv["p90"] != pytest.approx(p10_of_rates)
    assert iv["mean"] == pytest.approx(1 / 0.028)  # 1/mean(ITL), not mean(1/ITL) = 82
    assert iv["p50"] == pytest.approx(100.0)
    assert M.interactivity([])["p90"] is None


# ---------------------------------------------------------------- throughput window, cache rates, qps


def window_records():
    return [
        rec(0, 10, 1.0, 1000, 100, cached=800, hit=12, blocks=16, max_tokens=100),  # ITL 9/99
        rec(2, 12, 2.0, 2000, 200, cached=1500, hit=30, blocks=32, max_tokens=200),  # ITL 8/199
        rec(-5, 1, 0.1, 9999, 1, phase="warmup", cached=0),  # warmup: never counted
        rec(1, 20, 0.1, 9999, 50, error="http 500"),  # errored: not counted, does not stretch D
        rec(5, 14, 3.0, 500, 1, cached=0, max_tokens=1),  # OSL 1: tokens count, no ITL
    ]


def test_throughput_window_and_per_gpu():
    ok = [r for r in window_records() if r["phase"] == "profile" and not r["error"]]
    tp = M.throughput(ok, num_gpus=2)
    assert tp["duration_seconds"] == pytest.approx(14.0)  # max end 14 - min start 0
    assert tp["total"] == pytest.approx((3500 + 301) / 14)
    assert tp["input"] == pytest.approx(3500 / 14) and tp["output"] == pytest.approx(301 / 14)
    assert tp["per_gpu"] == pytest.approx(3801 / 14 / 2)
    assert tp["input_per_gpu"] == pytest.approx(3500 / 28) and tp["output_per_gpu"] == pytest.approx(301 / 28)
    assert tp["cached_input"] == pytest.approx(2300 / 14) and tp["uncached_input"] == pytest.approx(1200 / 14)
    # no cached_tokens reported -> fallback input * server hit rate
    nc = [{**r, "cached": None} for r in ok]
    assert M.throughput(nc, 1, server_hit=0.5)["cached_input"] == pytest.approx(3500 / 14 * 0.5)
    assert M.throughput(nc, 1)["cached_input"] is None
    assert M.throughput([], 1)["total"] == 0.0


def test_cache_hit_rates():
    assert M.theoretical_hit_rate(
        [rec(0, 1, 0, 1, 1, hit=12, blocks=16), rec(0, 1, 0, 1, 1, hit=30, blocks=32)]
    ) == pytest.approx(42 / 48)
    assert M.theoretical_hit_rate([rec(0, 1, 0, 1, 1)]) is None
    before = {"dsserve:prefix_cache_hits_total": 100, "dsserve:prefix_cache_queries_total": 200}
    after = {"dsserve:prefix_cache_hits_total": 400, "dsserve:prefix_cache_queries_total": 600}
    assert M.server_hit_rate(before, after) == pytest.approx(0.75)
    assert (
        M.server_hit_rate(
            {"vllm:prefix_cache_hits": 0, "vllm:prefix_cache_queries": 0},
            {"vllm:prefix_cache_hits": 5, "vllm:prefix_cache_queries": 10},
        )
        == 0.5
    )
    assert M.server_hit_rate(before, before) is None and M.server_hit_rate({}, after) is None


def test_qps_one_second_buckets():
    rs = [rec(0, e, 0, 1, 1) for e in (0.5, 0.7, 1.2, 3.9)]
    q = M.qps(rs, 0, 4 * S)  # buckets [2, 1, 0, 1]
    assert q["mean"] == 1.0 and q["p50"] == 1.0 and q["p90"] == pytest.approx(1.7)


# ---------------------------------------------------------------- Pareto frontier


def test_pareto_frontier_dominated_points_and_ties():
    p1, p2, p3, p4 = pt(10, 1000, c=1), pt(20, 800, c=2), pt(15, 700, c=3), pt(30, 400, c=4)
    p5, p6, p7 = pt(30, 300, c=5), pt(5, 1000, c=6), pt(20, 800, c=7)  # tie-x, tie-y, duplicate of p2
    p8, p9, p10 = pt(None, 5000, c=8), pt(math.inf, 5000, c=9), pt(50, 100, c=10)
    front = M.pareto_frontier([p3, p6, p1, p5, p2, p4, p7, p8, p9, p10])
    assert [p["c"] for p in front] == [1, 2, 4, 10]  # sorted by x; p2 kept over its duplicate p7
    assert [p["p90_intvty"] for p in front] == [10, 20, 30, 50]
    ys = [p["tput_per_gpu"] for p in front]
    assert ys == sorted(ys, reverse=True)
    assert M.pareto_frontier([]) == []
    assert M.pareto_frontier([pt(1, 1), pt(1, 1, c=2)]) == [pt(1, 1)]


# ---------------------------------------------------------------- monotone cubic + tier reads

FX, FY = [20, 40, 80, 160], [4000, 3000, 1500, 500]


def test_steffen_slopes_hand_computed():
    # interior: sign sum * min(|s0|, |s1|, |p|/2); ends: (3 s - m_neighbour) / 2   (d3 curveMonotoneX)
    m = M.monotone_slopes(FX, FY)
    assert m == pytest.approx([-625 / 12, -550 / 12, -25.0, -6.25])
    f = M.monotone_cubic(FX, FY)
    assert f(30) == pytest.approx(3484.375)  # 3500 + 2.5*(-625/12) - 2.5*(-550/12)
    assert f(100) == pytest.approx(1085.9375)


def test_pchip_slopes_hand_computed():
    m = M.monotone_slopes([0, 1, 2], [0, 1, 4], "pchip")  # harmonic mean 1.5; ends 0 (sign flip) and 4
    assert m == pytest.approx([0.0, 1.5, 4.0])
    assert M.monotone_cubic([0, 1, 2], [0, 1, 4], "pchip")(0.5) == pytest.approx(0.3125)
    with pytest.raises(ValueError):
        M.monotone_cubic([0, 0, 1], [1, 2, 3])


@pytest.mark.parametrize("method", ["steffen", "pchip"])
@pytest.mark.parametrize(
    "xs,ys",
    [
        (FX, FY),
        ([0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 1, 10]),  # flat runs then a jump: classic overshoot trap
        ([0, 0.1, 5, 5.2, 30], [0, 10, 11, 50, 51]),
        ([1, 2], [3, 1]),
    ],
)
def test_monotone_and_exact_at_knots(method, xs, ys):
    f = M.monotone_cubic(xs, ys, method)
    assert f(np.array(xs, float)) == pytest.approx(ys, abs=1e-9)
    d = np.diff(f(np.linspace(xs[0], xs[-1], 5001)))
    sign = np.sign(ys[-1] - ys[0])
    assert np.all(d * sign >= -1e-9)
    for (x0, x1), (y0, y1) in zip(zip(xs, xs[1:]), zip(ys, ys[1:])):  # stays within each segment's range
        v = f(np.linspace(x0, x1, 201))
        assert v.min() >= min(y0, y1) - 1e-9 and v.max() <= max(y0, y1) + 1e-9
    assert f(xs[0] - 100) == pytest.approx(ys[0]) and f(xs[-1] + 100) == pytest.approx(ys[-1])


def test_monotone_random_seeded():
    rng = np.random.default_rng(0)
    for _ in range(50):
        xs = np.cumsum(rng.uniform(0.01, 10, 8))
        ys = -np.cumsum(rng.exponential(100, 8) * (rng.random(8) < 0.7))  # non-increasing, with flats
        for method in ("steffen", "pchip"):
            f = M.monotone_cubic(xs, ys, method)
            assert np.all(np.diff(f(np.linspace(xs[0], xs[-1], 2001))) <= 1e-7)
            assert f(xs) == pytest.approx(ys)


def test_tier_reads_unreachable_clamped_exact_estimated():
    front = [pt(x, y) for x, y in zip(FX, FY)]
    got = {r["tier"]: r for r in M.tier_reads(front, (10, 20, 30, 40, 100, 160, 200))}
    assert got[10] == {"tier": 10, "tput_per_gpu": 4000.0, "status": "clamped"}  # below min x: min-x knot
    assert got[20]["status"] == "exact" and got[20]["tput_per_gpu"] == 4000.0
    assert got[30]["status"] == "estimated" and got[30]["tput_per_gpu"] == pytest.approx(3484.375)
    assert got[40]["tput_per_gpu"] == 3000.0
    assert got[100]["tput_per_gpu"] == pytest.approx(1085.9375)
    assert got[160]["tput_per_gpu"] == 500.0
    assert got[200] == {"tier": 200, "tput_per_gpu": 0.0, "status": "unreachable"}  # above max x
    assert [r["tier"] for r in M.tier_reads(front)] == [30, 50, 75, 100, 150, 200]
    assert all(r["status"] == "unreachable" for r in M.tier_reads([]))
    one = M.tier_reads([pt(50, 900)], (30, 50, 75))
    assert [(r["status"], r["tput_per_gpu"]) for r in one] == [("clamped", 900), ("exact", 900), ("unreachable", 0)]
    # unsorted input is sorted by x first; pchip variant agrees at the knots
    assert M.tier_reads(front[::-1], (40,), method="pchip")[0]["tput_per_gpu"] == 3000.0


# ---------------------------------------------------------------- aggregate + writers


def make_agg(conc=4, config="tiny-tp1", scale=1.0, **kw):
    rs = [{**r, "end_ns": int(r["start_ns"] + (r["end_ns"] - r["start_ns"]) * scale)} for r in window_records()]
    for r in rs:
        r["e2el"] *= scale
    server = {
        "before": {
            "dsserve:prefix_cache_hits_total": 100,
            "dsserve:prefix_cache_queries_total": 200,
            "dsserve:external_prefix_cache_hits_total": 0,
            "dsserve:external_prefix_cache_queries_total": 0,
        },
        "after": {
            "dsserve:prefix_cache_hits_total": 400,
            "dsserve:prefix_cache_queries_total": 600,
            "dsserve:external_prefix_cache_hits_total": 40,
            "dsserve:external_prefix_cache_queries_total": 100,
        },
        "gpu_usage_pct": 55.0,
        "gpu_total_tokens": 123456,
    }
    return M.aggregate(
        rs,
        kw.pop("window", None),
        2,
        meta={"config": config, "conc": conc, "hw": "h200", "tp": 2},
        server=server,
        dataset={"generator": "agentx", "seed": 42},
        **kw,
    )


def test_aggregate_fields():
    agg = make_agg(window=(0, 20 * S), price_per_gpu_hr=1.41)
    rm = agg["request_metrics"]
    assert agg["num_requests_total"] == 4 and agg["num_requests_successful"] == 3
    assert agg["error_rate"] == pytest.approx(0.25)
    itls = [9 / 99, 8 / 199]
    assert rm["latency"]["itl"]["p90"] == pytest.approx(M.pct(itls, 90))
    assert agg["p90_intvty"] == pytest.approx(1 / M.pct(itls, 90))
    assert agg["median_intvty"] == pytest.approx(1 / np.median(itls))
    assert agg["mean_intvty"] == pytest.approx(1 / np.mean(itls))
    assert agg["p90_e2e_norm_intvty"] == pytest.approx(1 / M.pct([10 / 100, 10 / 200, 9 / 1], 90))
    assert agg["p90_ttft"] == pytest.approx(M.pct([1.0, 2.0, 3.0], 90))
    assert agg["p90_e2el"] == pytest.approx(M.pct([10, 10, 9], 90))
    assert agg["tput_per_gpu"] == pytest.approx(3801 / 14 / 2)
    assert rm["throughput"]["duration_seconds"] == pytest.approx(14.0)
    assert rm["tokens"] == {"input": 3500, "output_actual": 301, "output_expected": 301, "cached_input": 2300}
    assert rm["cache"]["theoretical_cache_hit_rate"] == pytest.approx(42 / 48)
    sc = agg["server_metrics"]["cache"]
    assert sc["gpu_hit_rate"] == pytest.approx(0.75) and sc["external_hit_rate"] == pytest.approx(0.4)
    assert sc["overall_hit_rate"] == pytest.approx(0.85) and sc["cpu_hit_rate"] is None
    assert agg["server_metrics"]["kv_cache"] == {"gpu_usage_pct": 55.0, "gpu_total_tokens": 123456}
    assert agg["cost_per_mtok"] == pytest.approx(1.41 * 1e6 / (3600 * 3801 / 28))
    assert agg["hw"] == "h200" and agg["conc"] == 4 and agg["dataset"]["seed"] == 42
    v = agg["validity"]
    assert v["coverage"] == pytest.approx(0.7) and not v["valid"] and not v["duration_ok"]
    assert rm["qps"]["mean"] == pytest.approx(3 / 20)


def test_writers_produce_parseable_files(tmp_path):
    aggs = [make_agg(c, scale=s) for c, s in ((1, 0.5), (4, 1.0), (8, 2.0))]
    aggs.append(make_agg(8, config="other", scale=1.5))
    for a, (x, y) in zip(aggs, ((60, 300), (40, 500), (20, 900), (30, 400))):  # a clean synthetic sweep
        a.update(p90_intvty=x, tput_per_gpu=y)
    paths = [M.write_agg(tmp_path, a) for a in aggs]
    assert paths[0].name == "agg_tiny-tp1_conc1.json"
    loaded = json.loads(paths[1].read_text())
    assert loaded["request_metrics"]["throughput"]["per_gpu"] == aggs[1]["request_metrics"]["throughput"]["per_gpu"]
    assert loaded["p90_intvty"] == 40

    rq = M.write_requests_jsonl(tmp_path / "requests.jsonl", window_records())
    rows = [json.loads(line) for line in rq.read_text().splitlines()]
    assert len(rows) == 5 and list(rows[0])[: len(M.REQUEST_FIELDS)] == list(M.REQUEST_FIELDS)
    assert rows[0]["itl"] == pytest.approx(9 / 99) and rows[4]["itl"] is None and rows[0]["max_tokens"] == 100

    pc = M.write_points_csv(tmp_path / "points.csv", aggs)
    with open(pc) as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(M.POINT_COLS) and len(table) == 4
    assert [float(r["p90_intvty"]) for r in table] == [60, 40, 20, 30]
    assert [r["on_frontier"] for r in table] == ["1", "1", "1", "1"]

    aggs.append(make_agg(16))  # dominated: same config, lower x and y than conc 8
    aggs[-1].update(p90_intvty=10, tput_per_gpu=800)
    with open(M.write_points_csv(tmp_path / "points2.csv", aggs)) as f:
        assert [r["on_frontier"] for r in csv.DictReader(f)] == ["1", "1", "1", "1", "0"]

    for x in ("p90_intvty", "p90_ttft"):
        png = M.plot_points(tmp_path / f"{x}.png", aggs, x)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# ---------------------------------------------------------------- the tier at a per-user speed


def test_tier_best_is_the_best_measured_point_at_or_above_the_tier():
    pts = [pt(200, 300, conc=1), pt(150, 700, conc=8), pt(149.9, 2000, conc=16), pt(40, 3000, conc=32)]
    assert M.tier_best(pts, 150)["conc"] == 8  # 149.9 does not reach 150; among the rest 700 is the most
    assert M.tier_best(pts, 201) is None and M.tier_best([], 150) is None
    assert M.tier_best(pts + [pt(None, 9000, conc=64)], 100)["conc"] == 16  # a point without a P90 never counts
    s = M.tier_summary(pts, 150)
    assert s == {
        "tier_tok_s_per_user": 150,
        "best_tput_per_gpu": 700,
        "best_conc": 8,
        "best_p90_intvty": 150,
        "front_tput_per_gpu": 700.0,
        "front_status": "exact",
    }
    s = M.tier_summary(pts, 250)
    assert s["best_tput_per_gpu"] is None and s["best_conc"] is None and s["front_status"] == "unreachable"
    assert M.tier_summary(pts, 100)["front_status"] == "estimated"


def test_agentx_summary_reads_agg_files_of_several_runs(tmp_path):
    from dsserve.bench import agentx_summary as S

    for cfg, pts in (("replay-on", ((1, 180, 400), (8, 120, 1500))), ("replay-off", ((1, 160, 350), (8, 90, 1700)))):
        (tmp_path / cfg).mkdir()
        for conc, x, y in pts:
            a = make_agg(conc, config=cfg)
            a.update(p90_intvty=x, tput_per_gpu=y)
            M.write_agg(tmp_path / cfg, a)
    out = tmp_path / "sum"
    assert (
        S.main(["--tier-tok-s", "150", "--out", str(out), str(tmp_path / "replay-on"), str(tmp_path / "replay-off")])
        == 0
    )
    res = json.loads((out / "agentx-summary.json").read_text())
    assert list(res["configs"]) == ["replay-on", "replay-off"] and res["tier_tok_s_per_user"] == 150
    on, off = res["configs"]["replay-on"], res["configs"]["replay-off"]
    assert [p["conc"] for p in on["points"]] == [1, 8] and on["points"][1]["tput_per_gpu"] == 1500
    assert on["tier"]["best_tput_per_gpu"] == 400 and on["tier"]["front_status"] == "estimated"
    assert off["tier"]["best_conc"] == 1 and off["tier"]["best_tput_per_gpu"] == 350
    assert (out / "agentx-frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert S.main(["--out", str(out), str(tmp_path / "nothing-here")]) == 1


def test_ttft_is_compared_at_matched_throughput_along_each_curve():
    """Issue 59.5: TTFT read at the same throughput on both curves (linear between points, never extrapolated), the
    reduction at the highest throughput both reach; a curve's falling tail names no operating point."""
    from dsserve.bench import agentx_summary as S

    def pts(*xy):
        return [{"conc": 2**i, "tput_per_gpu": x, "p90_ttft": y} for i, (x, y) in enumerate(xy)]

    configs = {
        "off": {"points": pts((100, 1.0), (300, 3.0), (500, 9.0))},
        "on": {"points": pts((200, 0.5), (400, 1.0), (800, 2.0), (700, 5.0))},  # 700 after 800: the tail is cut
    }
    assert S.rising_curve(configs["on"]["points"]) == [(200, 0.5), (400, 1.0), (800, 2.0)]
    assert S.ttft_at([(100, 1.0), (300, 3.0)], 200) == 2.0 and S.ttft_at([(100, 1.0), (300, 3.0)], 301) is None
    m = S.matched_ttft(configs, "off")["on"]
    assert [a["tput_per_gpu"] for a in m["at"]] == [200, 300, 400, 500]  # both curves' points in [200, 500]
    h = m["at_highest_common"]
    # off at 500: 9.0 s; on at 500: 1.0 + (2.0 - 1.0) * 100 / 400 = 1.25 s
    assert h["tput_per_gpu"] == 500 and h["baseline_p90_ttft"] == 9.0 and abs(h["p90_ttft"] - 1.25) < 1e-12
    assert abs(h["reduction"] - (1 - 1.25 / 9.0)) < 1e-12
    apart = {"a": {"points": pts((100, 1.0), (200, 2.0))}, "b": {"points": pts((300, 1.0), (400, 2.0))}}
    assert S.matched_ttft(apart, "a")["b"] == {"baseline": "a", "at": [], "at_highest_common": None}
