"""The same gradient-exactness checks on megatron-core 0.19.x (its own interpreter / venv).

megatron-core 0.19 cannot live next to 0.16 in one environment, so this test runs the checks with
the interpreter named by ``VSHAPE_MC19_PYTHON`` (default ``/opt/venv-mc19/bin/python``, where the
project is installed editable). Without that interpreter the test is skipped with the reason,
except under CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from megatron_vshape.schedules import schedule_names

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

PYTHON = os.environ.get("VSHAPE_MC19_PYTHON", "/opt/venv-mc19/bin/python")
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    import megatron.core
    from megatron_vshape.schedules import schedule_names
    from megatron_vshape.testing import ModelSettings, RunSpec, run_check

    if __name__ == "__main__":
        out = {"version": megatron.core.__version__}
        out["pp2"] = run_check(RunSpec(schedules=tuple(schedule_names()), pp=2, microbatches=4), timeout=300)
        out["tp2_sp_tied"] = run_check(RunSpec(schedules=("v-half", "v-zb"), pp=2, tp=2, microbatches=4,
                                               sequence_parallel=True,
                                               model=ModelSettings(tied_embeddings=True)), timeout=300)
        out["dp2_tied"] = run_check(RunSpec(schedules=("v-half", "v-zb"), pp=2, dp=2, microbatches=4,
                                            model=ModelSettings(tied_embeddings=True)), timeout=300)
        print("RESULT" + json.dumps(out, default=str))
""")


@pytest.mark.timeout(900)
def test_all_schedules_exact_on_megatron_core_019(tmp_path):
    if not Path(PYTHON).exists():
        if os.environ.get("CI") == "true":  # .ci/run builds the 0.19 interpreter: CI must run this
            pytest.fail(f"CI: no megatron-core 0.19 interpreter at {PYTHON}; export VSHAPE_MC19_PYTHON")
        pytest.skip(f"no megatron-core 0.19 interpreter at {PYTHON}; set VSHAPE_MC19_PYTHON")
    script = tmp_path / "check019.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=850, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT"):])
    assert out["version"].startswith("0.19"), out["version"]
    assert sorted(out["pp2"]) == sorted(schedule_names())  # every registered schedule, none skipped
    for config, losses in (("pp2", 4), ("tp2_sp_tied", 8), ("dp2_tied", 8)):
        for name, row in out[config].items():
            assert row["num_losses"] == losses, (config, name, row)
            assert row["max_grad_rel_err"] <= 1e-6, (config, name, row)
            assert row["max_loss_abs_err"] <= 1e-6, (config, name, row)
