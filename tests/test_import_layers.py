"""The package's layering, as import-linter contracts (``[tool.importlinter]`` in pyproject.toml).

The parts point one way (the face, testing, the megatron glue, planner | runtime, schedules with the
common helpers), ``schedules/`` is layered inside (exact, then generators | lowering | export, then
core), nothing there imports torch or megatron, and no package has an import circle among its modules,
counting in-function and ``TYPE_CHECKING`` imports (grimp reads every import statement).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _lint(config: Path) -> tuple[int, str]:
    from importlinter.cli import lint_imports

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = lint_imports(config_filename=str(config), no_cache=True, no_logo=True)
    return code, out.getvalue()


def test_the_contracts_hold():
    code, report = _lint(PYPROJECT)
    assert code == 0, report
    assert "4 kept, 0 broken" in report, report


@pytest.mark.slow
@pytest.mark.parametrize("where, line", [
    # an in-function import closing a circle inside schedules/core (simulator imports actions)
    ("megatron_vshape/schedules/core/actions.py", "\n\ndef _circle():\n    from .simulator import simulate  # noqa: F401\n"),
    # a TYPE_CHECKING import closing a circle inside runtime/ (wgrad_linear imports wgrad_checks)
    ("megatron_vshape/runtime/wgrad_checks.py",
     "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .wgrad_linear import backward_input_only  # noqa: F401\n"),
    # a generator reaching up into the lowering (a sideways import between independent layers)
    ("megatron_vshape/schedules/generators/baselines.py",
     "\n\ndef _sideways():\n    from ..lowering.messages import lower  # noqa: F401\n"),
    # the schedule core importing torch
    ("megatron_vshape/schedules/core/timing.py", "\n\ndef _torch():\n    import torch  # noqa: F401\n"),
], ids=["circle-in-function", "circle-type-checking", "sideways-layer", "torch-in-schedules"])
def test_a_new_circle_or_upward_import_breaks_a_contract(tmp_path, where, line):
    """The contracts on a copy of the package with one bad import added must fail (and name it)."""
    shutil.copytree(ROOT / "megatron_vshape", tmp_path / "megatron_vshape",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    with open(tmp_path / where, "a") as f:
        f.write(line)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                          "sys.exit(lint_imports_command())", "--no-cache", "--config", "pyproject.toml"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "BROKEN" in run.stdout, run.stdout + run.stderr
    # the copy, not the checkout, was analysed: the same contracts hold on the checkout
    assert _lint(PYPROJECT)[0] == 0
