"""engine.kernel_manifest: the list of compiled kernels round-trips and merges; entries that no longer match their
kernel fail one by one without stopping the start. (A successful preload needs a GPU: the server's GPU run.)"""

import json

import pytest

from dsserve.engine import jit_compiles as J
from dsserve.engine import kernel_manifest as M


@pytest.fixture
def compiled(monkeypatch):
    c = J.JitCompiles()
    monkeypatch.setattr(J, "COMPILES", c)
    return c


def test_save_merges_what_this_process_compiled(tmp_path, compiled):
    path = tmp_path / "sub" / "kernels.jsonl"
    assert M.load(path) == [] and M.save(path) == 0 and path.read_text() == ""
    compiled.specs[("dsserve.kernels.entry_rows:_entry_rows_kernel", '{"a": 1}')] = None
    assert M.save(path) == 1
    compiled.specs.clear()
    compiled.specs[("dsserve.kernels.rowwise:_rms_norm_kernel", '{"b": 2}')] = None
    compiled.specs[("dsserve.kernels.entry_rows:_entry_rows_kernel", '{"a": 1}')] = None  # listed already
    assert M.save(path) == 2  # the file's entry kept, the new one added, no duplicate
    assert M.load(path) == [
        ("dsserve.kernels.entry_rows:_entry_rows_kernel", '{"a": 1}'),
        ("dsserve.kernels.rowwise:_rms_norm_kernel", '{"b": 2}'),
    ]
    assert [json.loads(line)["kernel"] for line in path.read_text().splitlines()] == [
        "dsserve.kernels.entry_rows:_entry_rows_kernel",
        "dsserve.kernels.rowwise:_rms_norm_kernel",
    ]


def test_a_bad_line_is_named(tmp_path):
    path = tmp_path / "k.jsonl"
    path.write_text('{"kernel": "m:f", "data": "{}"}\nnot json\n')
    with pytest.raises(ValueError, match=r"k.jsonl:2: not a kernel manifest line"):
        M.load(path)


def test_stale_entries_fail_alone(tmp_path):
    path = tmp_path / "k.jsonl"
    lines = [
        {"kernel": "dsserve.kernels.entry_rows:_entry_rows_kernel", "data": '{"name": "other_kernel"}'},
        {"kernel": "dsserve.kernels.no_such_module:_k", "data": "{}"},
        {"kernel": "dsserve.kernels.entry_rows:no_such_kernel", "data": "{}"},
    ]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    report = M.precompile(path, workers=0)
    assert (report.entries, report.failed) == (3, 3)
    assert M.preload_one(("dsserve.kernels.no_such_module:_k", "{}")).startswith("dsserve.kernels.no_such_module")
    assert M.precompile(tmp_path / "missing.jsonl", workers=4) == M.PrecompileReport(0, 0, 0.0, 0)


def test_serve_names_a_bad_manifest_before_building_anything(tmp_path):
    from dsserve.cli import main

    bad = tmp_path / "k.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(SystemExit, match=r"--kernel-manifest .*k.jsonl:1: not a kernel manifest line"):
        main(["serve", "tiny", "--kernel-manifest", str(bad), "--precompile-workers", "0"])
    with pytest.raises(SystemExit, match="--precompile-workers must be >= 0"):
        main(["serve", "tiny", "--kernel-manifest", str(bad), "--precompile-workers", "-1"])
