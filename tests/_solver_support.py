"""The oracle tests' one rule for a missing OR-Tools: a failure in CI (setup.py's test extra installs
it, so a missing solver is a broken environment there), a skip with the install line elsewhere."""

from __future__ import annotations

import os

import pytest

from megatron_vshape.schedules.exact import solver_available


def need_solver() -> None:
    if solver_available():
        return
    if os.environ.get("CI"):
        pytest.fail("OR-Tools is missing in CI: pip install -e '.[test]' installs it")
    pytest.skip("OR-Tools not installed (pip install -e '.[solver]')")
