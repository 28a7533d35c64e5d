"""Fixtures for the Megatron glue tests."""

import os

import pytest
from glue_support import mc19_python_or_none


@pytest.fixture(scope="session")
def mc19_python() -> str:
    python = mc19_python_or_none()
    if python is None:
        if os.environ.get("CI") == "true":  # CI must run these: .ci/run builds the 0.19 interpreter
            pytest.fail("CI: no megatron-core 0.19 interpreter; .ci/run should export VSHAPE_MC19_PYTHON")
        pytest.skip("needs megatron-core 0.19.x (megatron.training); set VSHAPE_MC19_PYTHON to its interpreter")
    return python
