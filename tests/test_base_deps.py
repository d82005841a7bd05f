"""Every module the package imports when it loads comes from a base dependency of pyproject.toml.

A module-level import that only a test extra provides breaks `pip install -e .` on a fresh machine (the README's
first command) while CI, which installs the extras, stays green. Imports inside functions, and module-level imports
guarded by `try: ... except ImportError`, are lazy or optional and are not counted.
"""

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _base_closure() -> set[str]:
    """The base dependencies and what they require without extras (declaring fastapi provides starlette)."""
    declared = md.requires("dsserve") or []  # as installed from pyproject.toml
    seen, todo = set(), [_name(d) for d in declared if "extra ==" not in d]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [_name(r) for r in md.requires(name) or [] if "extra ==" not in r]
        except md.PackageNotFoundError:
            pass
    return seen


def _module_level_imports(tree: ast.Module):
    """(top-level module, line) of each import that runs when the module loads, unguarded."""

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                yield from ((a.name.split(".")[0], node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield node.module.split(".")[0], node.lineno
            elif isinstance(node, ast.Try):
                caught = {getattr(h.type, "id", None) for h in node.handlers}
                if not caught & {"ImportError", "ModuleNotFoundError"}:
                    yield from visit(node.body)
            elif isinstance(node, ast.If):
                yield from visit(node.body)
                yield from visit(node.orelse)

    yield from visit(tree.body)


def unprovided_imports(package_dir: Path) -> list[str]:
    base = _base_closure()
    providers = md.packages_distributions()
    problems = []
    for path in sorted(package_dir.rglob("*.py")):
        for module, line in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if module in (package_dir.name, "__future__") or module in sys.stdlib_module_names:
                continue
            dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
            if not dists & base:
                where = ", ".join(sorted(dists)) or "nothing installed"
                name = path.relative_to(package_dir.parent)
                problems.append(f"{name}:{line}: {module!r} (from {where}) is not a base dependency")
    return problems


def test_every_module_level_import_is_a_base_dependency():
    assert unprovided_imports(ROOT / "dsserve") == []


def test_the_check_reports_a_module_level_import_from_a_test_extra(tmp_path):
    pkg = tmp_path / "probe"
    pkg.mkdir()
    (pkg / "eager.py").write_text("import pytest\nimport torch\nfrom probe import lazy\n")
    (pkg / "lazy.py").write_text("def f():\n    import pytest\n")
    (pkg / "guarded.py").write_text("try:\n    import pytest\nexcept ImportError:\n    pytest = None\n")
    (pkg / "branch.py").write_text("import os\nif os.name:\n    import hypothesis\n")
    problems = unprovided_imports(pkg)
    assert [p.split(" (")[0] for p in problems] == ["probe/branch.py:3: 'hypothesis'", "probe/eager.py:1: 'pytest'"]
