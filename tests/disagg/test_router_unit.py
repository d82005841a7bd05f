"""The router's pieces without servers: the CLI on a base install, session affinity, the unavailable side."""

import asyncio
import subprocess
import sys

import pytest

from dsserve.disagg.router import Instance, Pool, Router, RouterError, rendezvous


def test_router_help_imports_no_torch():
    code = (
        "import sys\nfrom dsserve.cli import main\n"
        "try:\n    main(['router', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--prefill" in out.stdout and "--decode" in out.stdout


def test_affinity_is_stable_and_only_a_dead_instances_sessions_move():
    pool = Pool([f"http://p{i}" for i in range(4)], "prefill")
    keys = [f"session-{i}" for i in range(200)]
    before = {k: pool.pick(k, set()).url for k in keys}
    assert len(set(before.values())) == 4  # spread over every instance
    pool.instances[1].healthy = False
    after = {k: pool.pick(k, set()).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "http://p1" for k in moved)
    assert rendezvous("x", pool.instances) is rendezvous("x", list(reversed(pool.instances)))


def test_without_a_session_the_least_loaded_instance_is_picked():
    pool = Pool(["http://a", "http://b"], "decode")
    pool.instances[0].in_flight = 3
    assert pool.pick(None, set()).url == "http://b"
    assert pool.pick(None, {"http://b"}).url == "http://a"


def test_a_side_with_no_healthy_instance_is_a_503_after_the_wait():
    r = Router(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], unavailable_wait=0.3)
    r.decode.instances[0].healthy = False

    async def pick():
        async def no_check():
            pass

        r.check_health = no_check
        return await r._pick(r.decode, "s", set())

    with pytest.raises(RouterError) as e:
        asyncio.run(pick())
    assert e.value.status == 503 and "no decode instance is available" in e.value.message


def test_the_router_needs_both_sides():
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        Router([], ["http://d"])
    assert Instance("u", "prefill").healthy
