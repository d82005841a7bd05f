"""benchmarks/train_mqar.py: its sequences ask each key once, after the filler, for the value it was given; a
two-step CPU run ends in its JSON line, with and without the probes (warm-in, ablations, quiet start, the filler
curriculum); bad options are named. The far-lookup yardstick (benchmarks/train_far_reference.py) runs two steps in
either shape. Never timings or learning."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location("train_mqar", os.path.join(ROOT, "benchmarks", "train_mqar.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_key_is_asked_once_for_its_value_after_the_filler():
    mqar = _module()
    rng = random.Random(3)
    for pairs, filler in ((1, 0), (6, 64), (90, 5)):
        ids, asked, far = mqar.sequence(rng, pairs, filler, 90, window=32)
        assert len(ids) == len(asked) == 1 + 4 * pairs + filler and ids[0] == 0
        given = dict(zip(ids[1 : 2 * pairs : 2], ids[2 : 2 * pairs + 1 : 2]))
        assert len(given) == pairs  # distinct keys
        questions = ids[1 + 2 * pairs + filler :]
        assert sorted(questions[0::2]) == sorted(given)
        assert all(given[k] == v for k, v in zip(questions[0::2], questions[1::2]))
        assert [i for i, a in enumerate(asked) if a] == list(range(2 + 2 * pairs + filler, len(ids), 2))
        assert not set(ids[1 + 2 * pairs : 1 + 2 * pairs + filler]) & (set(given) | set(given.values()))
        # far: the asked value's pair is 32 or more rows back (out of a window of 32)
        value_at = {k: i + 1 for i, k in enumerate(ids[: 1 + 2 * pairs]) if k in given}
        assert far == [a and t - value_at[ids[t - 1]] >= 32 for t, a in enumerate(asked)]
        assert any(far) == (filler > 0)


@pytest.mark.parametrize(
    "probes", [[], ["--warm-in", "0,1", "--ablate", "mhc,ffn,qat", "--quiet-start"], ["--filler-ramp", "0,1"]]
)
def test_a_short_cpu_run_ends_in_its_json_line(probes):
    p = subprocess.run(
        [
            sys.executable,
            "benchmarks/train_mqar.py",
            "--device",
            "cpu",
            "--batch",
            "2",
            "--steps",
            "2",
            "--log-every",
            "1",
            "--pairs",
            "2",
            "--filler",
            "40",
            "--filler-min",
            "0",
            *probes,
        ],
        cwd=ROOT,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["steps"] == 2 and [s for s, *_ in last["curve"]] == [0, 1]
    assert all(math.isfinite(ce) for _, ce, _, _ in last["curve"])  # near / far: null in a step without one
    assert last["unigram"] == math.log(90) and last["copy_any"] == math.log(2)


@pytest.mark.parametrize(
    "bad,named",
    [
        (["--pairs", "0"], "pairs"),
        (["--ablate", "mlp"], "--ablate takes"),
        (["--warm-in", "5"], "--warm-in wants"),
        (["--warm-in", "5,2"], "--warm-in wants"),
        (["--filler", "4", "--filler-min", "9"], "filler-min"),
        (["--filler-ramp", "9,2"], "--filler-ramp wants"),
        (["--filler", "8", "--filler-ramp", "0,5"], "--filler-min below"),
    ],
)
def test_bad_options_are_named(bad, named):
    p = subprocess.run(
        [sys.executable, "benchmarks/train_mqar.py", "--device", "cpu", *bad],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 2 and named in p.stderr


@pytest.mark.parametrize("mode", ["full", "ced"])
def test_the_far_lookup_yardstick_runs_two_steps(mode):
    env = dict(
        os.environ,
        MODE=mode,
        FILL="40",
        FMIN="0",
        FRAMP="0,1",
        B="2",
        D="64",
        H="1",
        S="2",
        EVERY="1",
        OMP_NUM_THREADS="1",
    )
    p = subprocess.run(
        [sys.executable, "benchmarks/train_far_reference.py", "2", "1e-3", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["steps"] == 2 and last["mode"] == mode
    assert [b for _, _, b in last["far_curve"]] == [0, 40]  # the ramp's filler bound
    assert all(math.isfinite(ce) for _, ce in last["curve"])
