"""DSSERVE_CHECK_STEPS: every step checked after it ran (scheduled and launched-ahead ones), outputs unchanged, and a
step whose logits are not finite named in the file with the steps before it."""

import json

import pytest
import torch

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.engine.step_check import ENV, StepCheckError

PROMPTS = [[5 + (7 * i + 3 * j) % 900 for j in range(n)] for i, n in enumerate((40, 17, 70))]


def _core() -> EngineCore:
    return EngineCore(
        EngineArgs(
            model="tiny",
            dtype="float64",
            device="cpu",
            attention_backend="paged",
            max_num_seqs=4,
            max_num_batched_tokens=32,
            async_scheduling=True,
            kv_cache_memory=64 << 20,
            reference_ops="all",
        )
    )


def _generate(core: EngineCore) -> dict:
    for i, p in enumerate(PROMPTS):
        core.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    done = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_checked_steps_change_nothing(tmp_path, monkeypatch):
    plain = _generate(_core())
    monkeypatch.setenv(ENV, str(tmp_path / "steps.json"))
    core = _core()
    assert _generate(core) == plain
    check = core.step_check
    assert check.checked > 0 and not (tmp_path / "steps.json").exists()
    assert check.steps_with_bad_scores == 0  # every score of a visible entry is finite
    kinds = {s["step"] for s in check.steps}
    assert kinds == {"scheduled", "ahead"}  # chunked prefills and decode steps launched before the host read
    assert all(s["decode"] for s in check.steps if s["step"] == "ahead")


def test_non_finite_logits_name_the_step(tmp_path, monkeypatch):
    path = tmp_path / "steps.json"
    monkeypatch.setenv(ENV, str(path))
    core = _core()
    _poison(core)
    with pytest.raises(StepCheckError, match="non-finite logits"):
        _generate(core)
    report = json.loads(path.read_text())
    # the first step samples nothing (a 32-row chunk of the 40-token prompt); the second ends two prompts
    assert report["failed"] == "scheduled" and report["steps_checked"] == 1
    assert [s["seqs"] for s in report["last_steps"]] == [[[0, 32]], [[32, 8], [0, 17], [0, 7]]]


def test_non_finite_logits_are_counted_without_the_check():
    """Without DSSERVE_CHECK_STEPS the engine serves on, and counts every sampled row whose logits are not
    finite (scheduled and launched-ahead steps): the fault shows in the metrics."""
    plain = _core()
    _generate(plain)
    assert plain.stats.nonfinite_logit_rows == 0
    core = _core()
    _poison(core)
    done = _generate(core)
    assert sorted(done) == ["0", "1", "2"]
    assert core.stats.nonfinite_logit_rows == 3 * 8 == core.stats.as_dict()["nonfinite_logit_rows"]


def _poison(core: EngineCore) -> None:
    """NaN into the final norm's weight: every row's logits become NaN."""
    with torch.no_grad():
        core.model.norm.weight[0] = float("nan")


def test_non_finite_index_scores_are_counted_and_serving_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "steps.json"))
    core = _core()
    layer = next(i for i, b in enumerate(core.model.layers) if b.attn.indexer is not None)
    with torch.no_grad():  # one head's weight NaN: that indexer's scores of visible entries become NaN
        core.model.layers[layer].attn.indexer.weights_proj.weight[0] = float("nan")
    done = _generate(core)
    assert sorted(done) == ["0", "1", "2"] and all(len(t) == 8 for t in done.values())
    check = core.step_check
    assert check.steps_with_bad_scores > 0 and not (tmp_path / "steps.json").exists()
    seen = [s["bad_index_scores"] for s in check.steps if "bad_index_scores" in s]
    assert {s["step"] for s in check.steps if "bad_index_scores" in s} == {"scheduled", "ahead"}  # decode graphs too
    assert seen and all(set(b) == {layer} and b[layer]["nan"] > 0 and b[layer]["first_col"] == 0 for b in seen)
