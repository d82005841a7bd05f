"""engine.jit_compiles: Triton's compile hooks count and time compiles, tell loads from its disk cache apart, chain
hooks installed before them, and never skip a compile; the engine's counters are those since its start (or its
warm-up)."""

import logging
from types import SimpleNamespace

import pytest

from dsserve.engine import jit_compiles as J


@pytest.fixture
def fresh_hooks(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hooks")
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(("cache", kw["key"])) or False)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(("post", kw["key"])))
    if hasattr(knobs, "compilation") and hasattr(knobs.compilation, "listener"):
        monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: calls.append(("listen", kw["cache_hit"])))
    monkeypatch.setattr(J, "COMPILES", J.JitCompiles())
    monkeypatch.setattr(J, "_installed", False)
    return knobs.runtime, calls


def _compile(rt, name, key, clock, monkeypatch, seconds, cache_hit=None):
    """What JITFunction._do_compile does around a compile, as Triton calls the hooks (keywords only); ``cache_hit``
    (None: no listener call, as in a Triton without one) is what triton.compile tells its listener inside."""
    fn = SimpleNamespace(
        name=name,
        module="dsserve.kernels.x",
        jit_function=SimpleNamespace(params=[SimpleNamespace(name=n) for n in "tK"]),
    )
    comp = {"constants": {(1,): 512}, "specialization_data": f'{{"name": "{name}", "key": "{key}"}}'}
    skip = rt.jit_cache_hook(
        key=key,
        repr=f"{name}[num_warps=4](t: i32)",
        fn=fn,
        compile=comp,
        is_manual_warmup=False,
        already_compiled=False,
    )
    clock[0] += seconds
    if cache_hit is not None:
        import triton

        triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=cache_hit)
    rt.jit_post_compile_hook(
        key=key,
        repr=f"{name}[num_warps=4](t: i32)",
        fn=fn,
        compile=comp,
        is_manual_warmup=False,
        already_compiled=False,
    )
    return skip


def test_hooks_count_time_and_chain(fresh_hooks, monkeypatch, caplog):
    rt, calls = fresh_hooks
    clock = [100.0]
    monkeypatch.setattr(J.time, "perf_counter", lambda: clock[0])
    assert J.watch() and J.watch()  # the second call installs nothing more
    with caplog.at_level(logging.INFO, logger="dsserve"):
        assert not _compile(rt, "_up_kernel", "k1", clock, monkeypatch, 2.0)  # a compile is never skipped
        assert not _compile(rt, "_topk", "k2", clock, monkeypatch, 0.1)
        assert not _compile(rt, "_up_kernel", "k3", clock, monkeypatch, 1.0)
    assert J.COMPILES.snapshot() == (3, pytest.approx(3.1), 0)
    assert J.COMPILES.by_kernel == {"_up_kernel": [2, pytest.approx(3.0)], "_topk": [1, pytest.approx(0.1)]}
    assert calls == [
        ("cache", "k1"),
        ("post", "k1"),
        ("cache", "k2"),
        ("post", "k2"),
        ("cache", "k3"),
        ("post", "k3"),
    ]  # the hooks installed before still run, in order
    slow = [r.getMessage() for r in caplog.records if "triton compiled" in r.getMessage()]
    assert len(slow) == 2 and "_up_kernel in 2.00 s" in slow[0]  # only those past 0.5 s
    assert "constexprs {K=512}" in slow[0] and "(t: i32)" in slow[0]  # the specialisation that was compiled
    # what engine.kernel_manifest saves: each compile's kernel and Triton's serialisation of it, once
    assert list(J.COMPILES.specs) == [
        (f"dsserve.kernels.x:{n}", f'{{"name": "{n}", "key": "{k}"}}')
        for n, k in (("_up_kernel", "k1"), ("_topk", "k2"), ("_up_kernel", "k3"))
    ]


def test_engine_counts_compiles_since_its_start_and_its_warm_up(fresh_hooks, monkeypatch):
    from dsserve.engine.args import EngineArgs
    from dsserve.engine.core import EngineCore

    rt, _ = fresh_hooks
    clock = [0.0]
    monkeypatch.setattr(J.time, "perf_counter", lambda: clock[0])
    _compile(rt, "before_the_engine", "k0", clock, monkeypatch, 1.0)  # not hooked yet: not counted anywhere
    core = EngineCore(
        EngineArgs(model="tiny", load_format="dummy", dtype="float32", max_model_len=256, enable_prefix_caching=False)
    )
    _compile(rt, "_mid_serving", "k1", clock, monkeypatch, 0.75)
    core._count_runs()
    assert (core.stats.triton_compiles, core.stats.triton_compile_seconds) == (1, pytest.approx(0.75))
    assert core.stats.as_dict()["triton_compiles"] == 1
    core.reset_counts()  # after the warm-up: from zero again
    assert (core.stats.triton_compiles, core.stats.triton_compile_seconds) == (0, 0.0)
    _compile(rt, "_later", "k2", clock, monkeypatch, 0.25)
    core._count_runs()
    assert (core.stats.triton_compiles, core.stats.triton_compile_seconds) == (1, pytest.approx(0.25))
    import triton

    if hasattr(getattr(triton.knobs, "compilation", None), "listener"):  # loads are counted apart
        _compile(rt, "_loaded", "k3", clock, monkeypatch, 0.01, cache_hit=True)
        core._count_runs()
        assert (core.stats.triton_compiles, core.stats.triton_cache_loads) == (1, 1)
        assert core.stats.as_dict()["triton_cache_loads"] == 1


def test_loads_from_the_disk_cache_are_told_apart(fresh_hooks, monkeypatch, caplog):
    import triton

    if not hasattr(getattr(triton.knobs, "compilation", None), "listener"):
        pytest.skip("this Triton has no compilation listener")
    rt, calls = fresh_hooks
    clock = [0.0]
    monkeypatch.setattr(J.time, "perf_counter", lambda: clock[0])
    assert J.watch()
    with caplog.at_level(logging.INFO, logger="dsserve"):
        _compile(rt, "_up_kernel", "k1", clock, monkeypatch, 0.6, cache_hit=True)  # slow for a load: not logged
        _compile(rt, "_up_kernel", "k2", clock, monkeypatch, 2.0, cache_hit=False)
        # a direct triton.compile (no JIT hooks) whose hit must not be taken for the next JIT compile's
        triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=True)
        _compile(rt, "_topk", "k3", clock, monkeypatch, 1.0)
    assert J.COMPILES.snapshot() == (2, pytest.approx(3.0), 1)
    assert J.COMPILES.load_seconds == pytest.approx(0.6)
    assert J.COMPILES.by_kernel == {"_up_kernel": [1, pytest.approx(2.0)], "_topk": [1, pytest.approx(1.0)]}
    assert [c for c in calls if c[0] == "listen"] == [("listen", True), ("listen", False), ("listen", True)]
    slow = [r.getMessage() for r in caplog.records if "triton compiled" in r.getMessage()]
    assert [m.split(" in ")[0] for m in slow] == ["triton compiled _up_kernel", "triton compiled _topk"]
    assert [k for k, _ in J.COMPILES.specs] == ["dsserve.kernels.x:_up_kernel"] * 2 + ["dsserve.kernels.x:_topk"]
