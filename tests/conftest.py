"""Fixtures and settings shared by the tests of several directories."""

import os

import pytest
from hypothesis import HealthCheck, settings

# Property tests draw the same examples on every run (derandomized), so the suite's time and
# verdict do not change from run to run and a CI failure reproduces locally as is. Schedules take
# up to seconds to build, so no per-example deadline. HYPOTHESIS_PROFILE=explore draws new random
# examples each run (and keeps failing ones in .hypothesis/) when looking for new bugs.
settings.register_profile("repeatable", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def _wgrad_split_set_to(enabled: bool):
    """Install (or remove) the B/W split hook for one test; restore its previous state afterwards."""
    from megatron_vshape.runtime.wgrad import disable_wgrad_split, enable_wgrad_split, wgrad_split_enabled

    was_enabled = wgrad_split_enabled()
    (enable_wgrad_split if enabled else disable_wgrad_split)()
    yield
    (enable_wgrad_split if was_enabled else disable_wgrad_split)()


@pytest.fixture
def split():
    """The B/W split hook installed for one test."""
    yield from _wgrad_split_set_to(True)


@pytest.fixture
def no_split():
    """Megatron's own backward for one test."""
    yield from _wgrad_split_set_to(False)


def pytest_collection_modifyitems(session, config, items):
    """Files with the most multi-process (``slow``) tests run first, the pure-Python files last.

    CI runs the suite on two pytest-xdist workers, one file per work unit (``--dist loadfile``, so a
    module fixture that launches training runs once). Workers take files in collection order: the
    long files must start first, and the many short ones then fill whichever worker frees up, instead
    of one long file starting last and running alone. The order within a file is unchanged.
    """
    slow_per_file: dict[str, int] = {}
    for item in items:
        slow_per_file.setdefault(str(item.path), 0)
        slow_per_file[str(item.path)] += item.get_closest_marker("slow") is not None
    first_seen = {path: index for index, path in enumerate(slow_per_file)}
    items.sort(key=lambda item: (-slow_per_file[str(item.path)], first_seen[str(item.path)]))
