"""Every stored result says how it was made: fail on a results JSON without its provenance.

    python benchmarks/check_results.py [--root benchmarks/results] [--list]

A result JSON must carry `command`, `commit`, `device` and `date` (under "meta", "provenance" or at its top level:
what dsserve/bench/provenance.run_meta writes), and, when it states a rate against a ceiling (GB/s, TFLOP/s, a share
of the matmul rate, a ratio to a floor), the `ceilings` of its run. Results stored before the helper existed may
instead be covered by a sidecar `PROVENANCE.json` in their folder or a folder above it:

    {"files": {"<glob, relative to the sidecar's folder>": {
        "recovered": {"<field>": {"value": ..., "from": "<where it was recovered from>"}},
        "unrecoverable": {"<field>": "<why it cannot be recovered>"}}}}

A field is accepted from the JSON itself, or recovered (a value and its source), or listed unrecoverable with a
reason; nothing else. A sidecar glob that matches no file is an error too (a stale entry). Exit 1 on any problem.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

REQUIRED = ("command", "commit", "device", "date")
RATE_MARKS = ("gbps", "tbps", "tflop", "matmul_fraction", "over_floor", "floor_ms")
SIDECAR = "PROVENANCE.json"


def _keys(obj, depth: int = 0):
    if depth > 6:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k)
            yield from _keys(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj[:50]:
            yield from _keys(v, depth + 1)


def is_rate(result) -> bool:
    """Whether the result states a rate or a ratio that only means something beside its run's ceilings."""
    return any(m in k.lower() for k in _keys(result) for m in RATE_MARKS)


def own_fields(result) -> dict:
    """The provenance fields the JSON itself carries (empty values do not count)."""
    if not isinstance(result, dict):
        return {}
    found = {}
    for block in (result, result.get("meta"), result.get("provenance")):
        if isinstance(block, dict):
            for k in (*REQUIRED, "ceilings"):
                if block.get(k) not in (None, "", {}, []):
                    found.setdefault(k, block[k])
    return found


def _sidecars(path: Path, root: Path) -> list[Path]:
    out, d = [], path.parent
    while True:
        if (d / SIDECAR).is_file():
            out.append(d / SIDECAR)
        if d == root or root not in d.parents:
            return out
        d = d.parent


def sidecar_fields(path: Path, root: Path, problems: list[str]) -> dict:
    """field -> ("recovered", value, source) or ("unrecoverable", reason), from every sidecar entry matching path."""
    fields = {}
    for car in _sidecars(path, root):
        rel = path.relative_to(car.parent).as_posix()
        for pattern, entry in json.loads(car.read_text())["files"].items():
            if not fnmatch.fnmatch(rel, pattern):
                continue
            for k, v in entry.get("recovered", {}).items():
                if not (isinstance(v, dict) and v.get("value") not in (None, "") and v.get("from")):
                    problems.append(f"{car}: {pattern}: recovered {k} needs a value and where it came from")
                    continue
                fields.setdefault(k, ("recovered", v["value"], v["from"]))
            for k, why in entry.get("unrecoverable", {}).items():
                if not (isinstance(why, str) and why.strip()):
                    problems.append(f"{car}: {pattern}: unrecoverable {k} needs a reason")
                    continue
                fields.setdefault(k, ("unrecoverable", why))
    return fields


def check(root: Path) -> tuple[list[str], dict]:
    """(problems, per-file status) for every results JSON under root."""
    problems, status = [], {}
    for path in sorted(root.rglob("*.json")):
        if path.name == SIDECAR:
            continue
        try:
            result = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append(f"{path}: not JSON ({e})")
            continue
        need = REQUIRED + (("ceilings",) if is_rate(result) else ())
        own, car = own_fields(result), None
        st = {}
        for k in need:
            if k in own:
                st[k] = "own"
                continue
            car = car if car is not None else sidecar_fields(path, root, problems)
            if k in car:
                st[k] = car[k][0]
            else:
                st[k] = "missing"
                problems.append(f"{path}: no {k} (neither in the JSON nor in a {SIDECAR})")
        status[str(path)] = st
    for car in sorted(root.rglob(SIDECAR)):  # stale entries
        data = json.loads(car.read_text())
        for pattern in data.get("files", {}):
            if not any(
                fnmatch.fnmatch(p.relative_to(car.parent).as_posix(), pattern) for p in car.parent.rglob("*.json")
            ):
                problems.append(f"{car}: {pattern!r} matches no results JSON")
    return problems, status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--list", action="store_true", help="print each file's fields: own / recovered / unrecoverable")
    a = p.parse_args(argv)
    problems, status = check(Path(a.root))
    if a.list:
        for f, st in status.items():
            print(f, " ".join(f"{k}={v}" for k, v in st.items()))
    for line in problems:
        print(line)
    n_own = sum(all(v == "own" for v in st.values()) for st in status.values())
    n_rec = sum("recovered" in st.values() for st in status.values())
    n_unrec = sum("unrecoverable" in st.values() for st in status.values())
    print(
        f"{len(status)} results: {n_own} complete in themselves, {n_rec} with recovered fields, {n_unrec} with "
        f"fields listed unrecoverable; {len(problems)} problems"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
