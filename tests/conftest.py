import pytest

from _harness import run_fresh, run_ranks
from torch_budget.units import GiB, KiB, MiB  # noqa: F401  (sizes for the tests: 5 * MiB)


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh():
    """Runs a test body (a module-level function) in a fresh Python process (see _harness.run_fresh)."""
    return run_fresh


@pytest.fixture
def ranks():
    """Runs a test body as several ranks of a process group (see _harness.run_ranks)."""
    return run_ranks
