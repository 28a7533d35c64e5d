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
