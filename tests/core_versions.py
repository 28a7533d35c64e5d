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
import shutil
import sys
from pathlib import Path

import pytest

INTERPRETER_VARIABLE = {"0.16": "VSHAPE_MC16_PYTHON", "0.19": "VSHAPE_MC19_PYTHON"}

# Megatron-LM main (0.20.0 at d98e8a64) is tested as users run it: a checkout whose own megatron/ runs,
# next to its scripts, in the interpreter that has megatron-core 0.19.2 installed too.
MAIN_CHECKOUT_VARIABLE = "MEGATRON_LM_MAIN_DIR"
MAIN_CHECKOUT = Path(__file__).resolve().parents[2] / "shared" / "clients" / "megatron-lm-main-d98e8a64"
MAIN_VERSION = "0.20.0"


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
    missing(reason)


def missing(reason: str) -> None:
    """Skip a test whose prerequisite is missing, saying how to get it; fail instead under CI (.ci/run
    provides every prerequisite: CI must run every version's tests)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI: {reason}")
    pytest.skip(reason)


def other_minor() -> str:
    """The supported version this interpreter does not have (0.19 when none is installed)."""
    return "0.16" if installed_minor() == "0.19" else "0.19"


def main_checkout_source() -> Path:
    """The Megatron-LM main checkout to test (never written to), or skip (fail under CI) saying how to get one."""
    path = Path(os.environ.get(MAIN_CHECKOUT_VARIABLE) or MAIN_CHECKOUT)
    if (path / "megatron" / "core" / "package_info.py").is_file() and (path / "pretrain_gpt.py").is_file():
        return path
    reason = (f"no Megatron-LM main checkout at {path} (needs megatron/ and pretrain_gpt.py); "
              f"set {MAIN_CHECKOUT_VARIABLE}=/path/to/Megatron-LM (main at d98e8a64)")
    missing(reason)


def copy_main_checkout(destination: Path) -> Path:
    """A writable copy of the main checkout (Megatron writes its compiled dataset helpers into it), without
    compiled helpers, caches or git metadata: the run must build the helpers for the Python that runs it."""
    shutil.copytree(main_checkout_source(), destination,
                    ignore=shutil.ignore_patterns(".git", "__pycache__", "helpers_cpp*.so"))
    return destination


def checkout_env(checkout: Path, root: Path) -> dict[str, str]:
    """An environment whose Python imports megatron from ``checkout`` first (then the project at ``root``)."""
    path = os.pathsep.join(filter(None, [str(checkout), str(root), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
