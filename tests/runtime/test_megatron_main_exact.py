"""The executor is gradient-exact on Megatron-LM main (0.20.0 at d98e8a64), imported from its checkout.

The interpreter is the tests' own, with megatron-core 0.19.2 installed; the checkout goes first on
``PYTHONPATH``, as its own scripts would have it, and every rank (forked from a server that imports
megatron before forking) must report the checkout's megatron, or the check would test 0.19.2 again. Every
schedule whose backward is split into B and W runs at PP 2 against one process, as
``test_executor_exact.py`` does on the installed version (tied embeddings for V-Half and V-ZB too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from core_versions import MAIN_VERSION, checkout_env

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json
    import megatron.core
    from megatron_vshape.schedules import fuses_backward, schedule_names
    from megatron_vshape.testing import ModelSettings, RunSpec, run_check, spawn


    def megatron_of_rank(rank, world_size):
        import megatron.core
        return [megatron.core.__version__, megatron.core.__file__]


    if __name__ == "__main__":
        split = tuple(name for name in schedule_names() if not fuses_backward(name))
        out = {"ranks": spawn(megatron_of_rank, 2, timeout=120)}
        out["pp2"] = run_check(RunSpec(schedules=split, pp=2, microbatches=4), timeout=300)
        out["pp2_tied"] = run_check(RunSpec(schedules=("v-half", "v-zb"), pp=2, microbatches=4,
                                            model=ModelSettings(tied_embeddings=True)), timeout=300)
        out["ranks"] += spawn(megatron_of_rank, 2, timeout=120)  # the server the checks used
        print("RESULT" + json.dumps(out, default=str))
""")


@pytest.mark.timeout(600)
def test_split_schedules_are_exact_on_megatron_main(tmp_path, megatron_main):
    script = tmp_path / "check_megatron_main.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=560,
                          env=checkout_env(megatron_main, ROOT), cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT"):])
    for version, path in out["ranks"]:
        assert version.split("+")[0] == MAIN_VERSION and Path(path).is_relative_to(megatron_main), (version, path)
    assert len(out["pp2"]) >= 7 and {"zb-h1", "v-min", "v-half", "v-zb"} <= set(out["pp2"]), sorted(out["pp2"])
    for config in ("pp2", "pp2_tied"):
        for name, row in out[config].items():
            assert row["num_losses"] == 4, (config, name, row)
            assert row["max_grad_rel_err"] <= 1e-6, (config, name, row)
            assert row["max_loss_abs_err"] <= 1e-6, (config, name, row)
