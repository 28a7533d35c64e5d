"""Fixtures shared by the tests of several directories."""

import pytest


@pytest.fixture
def split():
    """The B/W split hook installed for one test; the hook's previous state restored afterwards."""
    from megatron_vshape.runtime.wgrad import disable_wgrad_split, enable_wgrad_split, wgrad_split_enabled

    was_enabled = wgrad_split_enabled()
    enable_wgrad_split()
    yield
    (enable_wgrad_split if was_enabled else disable_wgrad_split)()
