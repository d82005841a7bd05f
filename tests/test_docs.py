"""The docs that name files name files that exist: docs/request_path.md, a chat request's path in call order."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH_DOC = (ROOT / "docs" / "request_path.md").read_text()


def test_every_file_the_request_path_names_exists():
    named = set(re.findall(r"`((?:dsserve|tests|benchmarks)/[\w/.]+\.py)`", PATH_DOC))
    assert len(named) >= 12
    assert sorted(n for n in named if not (ROOT / n).is_file()) == []


def test_the_request_path_takes_at_most_twelve_files_before_the_kernels():
    inward = PATH_DOC.split("\n## In\n")[1].split("\n## ")[0]
    steps = re.findall(r"^\d+\. `([^`]+)`", inward, re.M)
    assert 0 < len(steps) <= 12 and len(set(steps)) == len(steps)
    assert [int(n) for n in re.findall(r"^(\d+)\. ", inward, re.M)] == list(range(1, len(steps) + 1))
    assert not any(s.startswith("dsserve/kernels/") and s != "dsserve/kernels/ops.py" for s in steps)
