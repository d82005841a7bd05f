"""benchmarks/check_results.py: every stored result carries its provenance, or a sidecar says what was recovered and
what cannot be."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import check_results as C  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
FULL = {"command": "python x.py", "commit": "abc1234", "device": "NVIDIA H200", "date": "2026-12-05"}


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_every_stored_result_has_its_provenance():
    problems, status = C.check(C.Path(RESULTS))
    assert status, "no results found"
    assert problems == []


def test_a_complete_result_passes_and_a_rate_needs_its_ceilings(tmp_path):
    _write(tmp_path / "a" / "ok.json", {"meta": FULL, "rows": [{"ms": 1.0}]})
    _write(tmp_path / "a" / "rate.json", {"meta": FULL, "rows": [{"copy_GBps": 4000.0}]})
    problems, status = C.check(tmp_path)
    assert status[str(tmp_path / "a" / "ok.json")] == dict.fromkeys(C.REQUIRED, "own")
    assert problems == [f"{tmp_path / 'a' / 'rate.json'}: no ceilings (neither in the JSON nor in a PROVENANCE.json)"]
    _write(tmp_path / "a" / "rate.json", {"meta": FULL, "ceilings": {"copy_GBps": 4225}, "rows": [{"copy_GBps": 1}]})
    assert C.check(tmp_path)[0] == []


def test_missing_fields_fail_unless_a_sidecar_recovers_or_explains_them(tmp_path):
    _write(tmp_path / "old" / "r.json", {"meta": {"command": "python x.py"}})
    assert len(C.check(tmp_path)[0]) == 3  # commit, device, date
    car = {
        "files": {
            "*.json": {
                "recovered": {
                    "device": {"value": "NVIDIA H200", "from": "README.md"},
                    "date": {"value": "2026-11-30", "from": "README.md"},
                },
                "unrecoverable": {"commit": "ran on an uncommitted tree"},
            }
        }
    }
    _write(tmp_path / "old" / "PROVENANCE.json", car)
    problems, status = C.check(tmp_path)
    assert problems == []
    assert status[str(tmp_path / "old" / "r.json")] == {
        "command": "own",
        "commit": "unrecoverable",
        "device": "recovered",
        "date": "recovered",
    }


@pytest.mark.parametrize(
    "entry",
    [
        {"recovered": {"commit": {"value": "abc1234"}}},  # no source
        {"unrecoverable": {"commit": "  "}},  # no reason
    ],
)
def test_a_recovered_value_needs_its_source_and_an_unrecoverable_one_a_reason(tmp_path, entry):
    _write(tmp_path / "r.json", {k: v for k, v in FULL.items() if k != "commit"})
    _write(tmp_path / "PROVENANCE.json", {"files": {"r.json": entry}})
    problems = C.check(tmp_path)[0]
    assert any("PROVENANCE.json" in p for p in problems) and any("no commit" in p for p in problems)


def test_a_stale_sidecar_entry_is_an_error(tmp_path):
    _write(tmp_path / "r.json", FULL)
    _write(tmp_path / "PROVENANCE.json", {"files": {"gone/*.json": {"unrecoverable": {"commit": "x"}}}})
    assert C.check(tmp_path)[0] == [f"{tmp_path / 'PROVENANCE.json'}: 'gone/*.json' matches no results JSON"]


def test_the_script_exits_nonzero_on_a_problem(tmp_path, capsys):
    _write(tmp_path / "r.json", {"rows": []})
    assert C.main(["--root", str(tmp_path)]) == 1
    _write(tmp_path / "r.json", FULL)
    assert C.main(["--root", str(tmp_path)]) == 0
    assert "1 results: 1 complete in themselves" in capsys.readouterr().out
