"""The gradient-exactness checks on the supported megatron-core version this interpreter does not have.

megatron-core 0.16 and 0.19 cannot live in one environment. ``test_executor_exact.py`` runs in this
interpreter, on its version; this test runs the same checks with the interpreter of the other version,
named by ``VSHAPE_MC16_PYTHON`` or ``VSHAPE_MC19_PYTHON`` (see ``tests/core_versions.py``). Without it the
test is skipped with the reason, except under CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from core_versions import installed_minor

from megatron_vshape.schedules.generators.registry import schedule_names

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    import megatron.core
    from megatron_vshape.schedules.generators.registry import schedule_names
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
def test_all_schedules_exact_on_the_other_megatron_core(tmp_path, other_core_python):
    script = tmp_path / "check_other_core.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([other_core_python, str(script)], capture_output=True, text=True, timeout=850, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT"):])
    assert out["version"][:4] in ("0.16", "0.19") and out["version"][:4] != installed_minor(), out["version"]
    assert sorted(out["pp2"]) == sorted(schedule_names())  # every registered schedule, none skipped
    for config, losses in (("pp2", 4), ("tp2_sp_tied", 8), ("dp2_tied", 8)):
        for name, row in out[config].items():
            assert row["num_losses"] == losses, (config, name, row)
            assert row["max_grad_rel_err"] <= 1e-6, (config, name, row)
            assert row["max_loss_abs_err"] <= 1e-6, (config, name, row)
