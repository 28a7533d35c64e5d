"""Fixtures for the Megatron glue tests."""

import pytest
from glue_support import mc19_python_or_none


@pytest.fixture(scope="session")
def mc19_python() -> str:
    python = mc19_python_or_none()
    if python is None:
        pytest.skip("needs megatron-core 0.19.x (megatron.training); set VSHAPE_MC19_PYTHON to its interpreter")
    return python
