"""What every stored benchmark result records about its own run: the command line, the commit and whether the tree
differed from it, the device, the library versions and the date. Scripts put ``run_meta()`` under the result's
``"meta"`` key; rates add the ceilings they were measured against (top-level ``"ceilings"``, or ``ceilings=``).
``benchmarks/check_results.py`` fails on a result without them.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time

REQUIRED = ("command", "commit", "device", "date")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=_repo_root())
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_state() -> tuple[str | None, bool | None]:
    """(HEAD's full hash, whether tracked files differ from it); (DSSERVE_COMMIT, None) outside a checkout."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return os.environ.get("DSSERVE_COMMIT") or None, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head.strip(), None if status is None else bool(status.strip())


def device_name() -> str:
    """The GPU's name when torch sees one, else the host's processor."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: `python <script relative to the repo> args...`, or the console script's name."""
    argv = list(sys.argv if argv is None else argv)
    head = argv[0] if argv else ""
    if head.endswith(".py"):
        try:
            head = os.path.relpath(os.path.abspath(head), _repo_root())
        except ValueError:
            pass
        return shlex.join(["python", head, *argv[1:]])
    return shlex.join([os.path.basename(head) or "python", *argv[1:]])


def run_meta(ceilings: dict | None = None, argv: list[str] | None = None, **extra) -> dict:
    """The provenance block of one run; `extra` keys (model, smoke, ...) are kept beside it."""
    import torch

    commit, dirty = git_state()
    meta = {
        "command": command_line(argv),
        "commit": commit,
        "dirty": dirty,
        "device": device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if ceilings is not None:
        meta["ceilings"] = ceilings
    meta.update(extra)
    return meta
