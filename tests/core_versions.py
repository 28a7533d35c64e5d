"""Which megatron-core versions the tests can reach: the installed one, and others through an interpreter.

megatron-core 0.16.x and 0.19.x cannot share one environment. Version-specific tests run in this
interpreter when it has the version they need, and otherwise with the interpreter a variable names
(``VSHAPE_MC16_PYTHON``, ``VSHAPE_MC19_PYTHON``). Without either they skip with a reason that says which
variable to set, except under ``CI=true``, where .ci/run builds both versions and a missing one fails.
(Imported by name from every test directory: keep this module name unique in tests/.)
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

INTERPRETER_VARIABLE = {"0.16": "VSHAPE_MC16_PYTHON", "0.19": "VSHAPE_MC19_PYTHON"}


def installed_minor() -> str | None:
    """``"0.19"`` for megatron-core 0.19.2 in this interpreter; None when it has no megatron-core."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    return ".".join(version.split(".")[:2])


def interpreter_or_none(minor: str) -> str | None:
    """An interpreter with megatron-core ``minor``: this one if it has it, else the one its variable names."""
    if installed_minor() == minor:
        return sys.executable
    named = os.environ.get(INTERPRETER_VARIABLE[minor])
    return named if named and Path(named).exists() else None


def require_interpreter(minor: str) -> str:
    """The interpreter for ``minor``, or skip (fail under CI) with the variable to set."""
    python = interpreter_or_none(minor)
    if python is not None:
        return python
    variable = INTERPRETER_VARIABLE[minor]
    reason = (f"needs megatron-core {minor}.x: this interpreter has {installed_minor() or 'none'}; "
              f"set {variable} to an interpreter that has it")
    if os.environ.get("CI") == "true":  # .ci/run builds both versions: CI must run every version's tests
        pytest.fail(f"CI: {reason}")
    pytest.skip(reason)


def other_minor() -> str:
    """The supported version this interpreter does not have (0.19 when none is installed)."""
    return "0.16" if installed_minor() == "0.19" else "0.19"
