import pytest

from tests.harness import BACKENDS


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each multi-rank test runs once under Gloo and once under MPI."""
    return request.param
