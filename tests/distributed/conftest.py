import pytest
from workers import Workers


@pytest.fixture(scope="module")
def workers(request):
    """The module's rank processes (its ``WORLD``, default 2), spawned once and shared by its tests."""
    w = Workers(getattr(request.module, "WORLD", 2))
    yield w
    w.close()
