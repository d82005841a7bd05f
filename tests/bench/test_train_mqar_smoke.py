"""benchmarks/train_mqar.py: its sequences ask each key once, after the filler, for the value it was given; a
two-step CPU run ends in its JSON line, with and without the probes (warm-in, ablations, quiet start); bad options are
named. Never timings or learning."""
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
        ids, asked = mqar.sequence(rng, pairs, filler, 90)
        assert len(ids) == len(asked) == 1 + 4 * pairs + filler and ids[0] == 0
        given = dict(zip(ids[1:2 * pairs:2], ids[2:2 * pairs + 1:2]))
        assert len(given) == pairs  # distinct keys
        questions = ids[1 + 2 * pairs + filler:]
        assert sorted(questions[0::2]) == sorted(given)
        assert all(given[k] == v for k, v in zip(questions[0::2], questions[1::2]))
        assert [i for i, a in enumerate(asked) if a] == list(range(2 + 2 * pairs + filler, len(ids), 2))
        assert not set(ids[1 + 2 * pairs:1 + 2 * pairs + filler]) & (set(given) | set(given.values()))


@pytest.mark.parametrize("probes", [[], ["--warm-in", "0,1", "--ablate", "mhc,ffn,qat", "--quiet-start"]])
def test_a_short_cpu_run_ends_in_its_json_line(probes):
    p = subprocess.run([sys.executable, "benchmarks/train_mqar.py", "--device", "cpu", "--batch", "2", "--steps", "2",
                        "--log-every", "1", "--pairs", "2", "--filler", "4", *probes],
                       cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["steps"] == 2 and [s for s, _ in last["curve"]] == [0, 1]
    assert all(math.isfinite(ce) for _, ce in last["curve"])
    assert last["unigram"] == math.log(90) and last["copy_any"] == math.log(2)


@pytest.mark.parametrize("bad,named", [(["--pairs", "0"], "pairs"), (["--ablate", "mlp"], "--ablate takes"),
                                       (["--warm-in", "5"], "--warm-in wants"), (["--warm-in", "5,2"], "--warm-in wants")])
def test_bad_options_are_named(bad, named):
    p = subprocess.run([sys.executable, "benchmarks/train_mqar.py", "--device", "cpu", *bad],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2 and named in p.stderr
