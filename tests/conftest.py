import collections
import os
import zlib

import pytest

from _harness import run_fresh, run_ranks
from torch_budget import _native
from torch_budget.units import GiB, KiB, MiB  # noqa: F401  (sizes for the tests: 5 * MiB)

# CI sets TORCH_BUDGET_REQUIRE_BUILT=1: there a compiled part a test needs and that is not built
# fails the test, so a broken build cannot pass as a row of skips.
REQUIRE_BUILT = os.environ.get("TORCH_BUDGET_REQUIRE_BUILT") == "1"


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="K/N", default=None,
                     help="run only shard K of N (1-based): each test falls in one shard by its id, so N runs with "
                          "K = 1..N run every test once (a long run such as compute-sanitizer's, split over calls)")


def _shard(value):
    try:
        k, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes K/N with whole numbers, such as 2/5; got {value!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {value}: K must be within 1..N")
    return k, n


def pytest_configure(config):
    if config.getoption("--shard"):
        _shard(config.getoption("--shard"))  # a bad value stops the run before anything is collected


def pytest_collection_modifyitems(config, items):
    if config.getoption("--shard"):
        k, n = _shard(config.getoption("--shard"))
        keep, drop = [], []
        for item in items:
            (keep if zlib.crc32(item.nodeid.encode()) % n == k - 1 else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    """`@pytest.mark.built("_host_core")`: the test needs that compiled part."""
    if os.environ.get("TORCH_BUDGET_UNDER_SANITIZER") == "1" and item.get_closest_marker("graph_trees"):
        pytest.skip("under compute-sanitizer torch's CUDA graph trees refuse their own pool on the native "
                    "allocator too (tensors outlive their del): it says nothing of torch_budget there")
    for mark in item.iter_markers("built"):
        missing = [f"torch_budget.{part}" for part in mark.args if not _native.is_built(part)]
        if not missing:
            continue
        why = f"{', '.join(missing)} not built (tools/test.sh builds every part)"
        if REQUIRE_BUILT:
            pytest.fail(f"{why}, and TORCH_BUDGET_REQUIRE_BUILT=1 requires it", pytrace=False)
        pytest.skip(why)


def pytest_terminal_summary(terminalreporter):
    """Skips counted by reason (pytest's -rs lists each one)."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section(f"{sum(reasons.values())} skipped, by reason", sep="-")
        for reason, count in reasons.most_common():
            terminalreporter.line(f"{count:5d}  {reason}")


@pytest.fixture
def fresh():
    """Runs a test body (a module-level function) in a fresh Python process (see _harness.run_fresh)."""
    return run_fresh


@pytest.fixture
def ranks():
    """Runs a test body as several ranks of a process group (see _harness.run_ranks)."""
    return run_ranks


@pytest.fixture(autouse=True)
def _installs_only_in_fresh_processes():
    """A test that installs torch_budget in the pytest process itself leaves every later test of
    that worker running installed (they then fail far from the cause): it errors here, by name.
    Installs belong in `fresh` processes or in @isolated forks."""
    from torch_budget import _runtime

    before = _runtime._installed
    yield
    if _runtime._installed and not before:
        pytest.fail("this test installed torch_budget in the pytest process; every later test of this worker "
                    "would run installed: install in a `fresh` process or an @isolated fork", pytrace=False)
