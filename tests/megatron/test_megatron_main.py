"""Megatron-LM main (0.20.0 at d98e8a64) from a writable copy of its checkout, as its users run it.

One interpreter, the tests' own (megatron-core 0.19.2 installed), runs the runner from an unrelated working
directory on a probe script inside the checkout, exactly as it would run the checkout's pretrain_gpt.py.
The probe reports which megatron it imported, the patch table on it, and the executor's gradient exactness
for every split schedule at PP 2 against one process (V-Half and V-ZB with tied embeddings too); the ranks
are forked from a server that imports megatron before forking, and each reports its own megatron, or the
check would test 0.19.2 again. One interpreter for the three checks: it imports megatron once.

Training through main's scripts: test_pretrain_cpu.py (V-ZB resume, default tier), test_real_client.py and
test_real_client_hybrid.py (every schedule, pretrain_hybrid.py; -m extended).
"""

import json
import subprocess

import pytest
from core_versions import MAIN_VERSION
from glue_support import cpu_env

from megatron_vshape.megatron.patches import PATCHES

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

# Run by the runner as the script's __main__; a spawned rank imports nothing of it (the runner names the
# main module "__main__"), so what the ranks run lives in a module next to it.
PROBE = """
import json, sys
import megatron.core, megatron.training
from megatron_vshape.megatron.patches import PATCHES, problem, tested_as
from megatron_vshape.schedules.generators.registry import fuses_backward, schedule_names
from megatron_vshape.testing import ModelSettings, RunSpec, run_check, spawn
from vshape_probe_ranks import megatron_of_rank

tested = tested_as(megatron.core.__version__)
out = {"core": megatron.core.__file__, "training": megatron.training.__file__, "path0": sys.path[0],
       "argv": sys.argv, "tested": None if tested is None else str(tested), "problems": [problem(p) for p in PATCHES]}
split = tuple(name for name in schedule_names() if not fuses_backward(name))
out["pp2"] = run_check(RunSpec(schedules=split, pp=2, microbatches=4), timeout=300)
out["pp2_tied"] = run_check(RunSpec(schedules=("v-half", "v-zb"), pp=2, microbatches=4,
                                    model=ModelSettings(tied_embeddings=True)), timeout=300)
out["ranks"] = spawn(megatron_of_rank, 2, timeout=120)  # from the fork server the checks used
print("PROBE" + json.dumps(out, default=str))
"""
RANKS = """
def megatron_of_rank(rank, world_size):
    import megatron.core
    return [megatron.core.__version__, megatron.core.__file__]
"""


@pytest.fixture(scope="module")
def probe(mc19_python, megatron_main, tmp_path_factory) -> dict:
    script = megatron_main / "probe_megatron.py"
    script.write_text(PROBE)
    (megatron_main / "vshape_probe_ranks.py").write_text(RANKS)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    # A megatron/ in the working directory must not count, in the runner nor in the fork server the checks use
    # (Python's fork server imports from the working directory: megatron_vshape/testing/forkserver_path.py).
    (elsewhere / "megatron" / "core").mkdir(parents=True)
    (elsewhere / "megatron" / "core" / "__init__.py").write_text("__version__ = 'the working directory'\n")
    result = subprocess.run([mc19_python, "-m", "megatron_vshape.run", str(script), "--flag"], capture_output=True,
                            text=True, timeout=560, cwd=elsewhere, env=cpu_env())
    assert result.returncode == 0, result.stderr[-4000:]
    found = [line for line in result.stdout.splitlines() if line.startswith("PROBE")]
    assert found, result.stdout[-3000:] + result.stderr[-3000:]
    return {**json.loads(found[-1][len("PROBE"):]), "stdout": result.stdout, "script": script,
            "checkout": megatron_main.resolve()}


@pytest.mark.timeout(600)
def test_runner_runs_the_scripts_own_megatron_from_any_working_directory(probe):
    """As ``python script.py`` would: the checkout next to the script is imported, not the installed
    megatron-core 0.19.2, launched from an unrelated directory; rank 0's start-up line says so."""
    checkout = probe["checkout"]
    assert probe["core"] == str(checkout / "megatron" / "core" / "__init__.py")
    assert probe["training"] == str(checkout / "megatron" / "training" / "__init__.py")
    assert probe["path0"] == str(checkout) and probe["argv"] == [str(probe["script"]), "--flag"]
    line = next(line for line in probe["stdout"].splitlines() if line.startswith(" [vshape] megatron "))
    assert line.startswith(f" [vshape] megatron {MAIN_VERSION} from {checkout}/megatron; the installed megatron-core "
                           "0.19.2 at ") and line.endswith(" is not used"), line


@pytest.mark.timeout(600)
def test_patch_table_matches_megatron_main_and_recognises_the_commit(probe):
    assert probe["tested"] == "0.20.0 (main at d98e8a64)"
    assert probe["problems"] == [None] * len(PATCHES), [(p.module, p.attribute, why)
                                                        for p, why in zip(PATCHES, probe["problems"]) if why]


@pytest.mark.timeout(600)
def test_split_schedules_are_exact_on_megatron_main(probe):
    for version, path in probe["ranks"]:
        assert version.split("+")[0] == MAIN_VERSION and path.startswith(str(probe["checkout"])), (version, path)
    assert len(probe["pp2"]) >= 7 and {"zb-h1", "v-min", "v-half", "v-zb"} <= set(probe["pp2"]), sorted(probe["pp2"])
    for config in ("pp2", "pp2_tied"):
        for name, row in probe[config].items():
            assert row["num_losses"] == 4, (config, name, row)
            assert row["max_grad_rel_err"] <= 1e-6, (config, name, row)
            assert row["max_loss_abs_err"] <= 1e-6, (config, name, row)
