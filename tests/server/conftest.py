import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import live_server  # noqa: E402


@pytest.fixture(scope="session")
def server():
    """A live `dsserve serve tiny` on loopback; SIGTERM at the end must exit 0."""
    with live_server() as base:
        yield base
