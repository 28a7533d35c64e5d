"""NVIDIA Megatron-LM's own ``pretrain_gpt.py`` (tag core_v0.19.0, unmodified), on CPU with gloo.

The files stand for a user's Megatron-LM checkout: ``../shared/clients/megatron-lm-core_v0.19.0`` next to
this project, or the checkout named by ``$MEGATRON_LM_DIR``. They are never edited: the patch route
applies ``patches/megatron-lm-pretrain_gpt.patch`` to a copy in a temporary directory.

Every schedule of the registry trains 5 iterations through ``python -m megatron_vshape.run`` at PP=2 and
must print the same lm loss as Megatron's own 1F1B on the same script (to 1e-5; dropout masks and initial
weights do not depend on the schedule), in training and in Megatron's evaluations (forward only: at
iteration 5, then on the validation and test sets). A launch takes about 9-12 s here, nearly all of it
start-up: 3 iterations instead of 5 measured no faster. The ranks are started directly with torchrun's
environment, except for the README's command (V-Half through the runner) and the patch route, which
run under ``torchrun`` as a user types them. On a V, pipeline rank 0 runs both the first and the last stage;
the script's ``get_batch`` asks ``mpu.is_pipeline_last_stage()`` without ``vp_stage`` to decide whether to
load labels and the loss mask, which crashed V schedules before the executor named the running stage.

Megatron-LM main (0.20.0 at d98e8a64) runs as its users run it: the runner on a writable copy of the
checkout, in the interpreter that has megatron-core 0.19.2 installed too; the checkout's own megatron/
must run (the start-up line names it) and build its C++ dataset helpers for this interpreter. With
``-m extended`` every schedule trains through its ``pretrain_gpt.py`` like Megatron's own 1F1B on it, which
gives the losses of 0.19.2's; the default tier's run on main is test_pretrain_cpu.py's V-ZB resume.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from glue_support import (
    LOSS,
    ROOT,
    assert_runs_the_checkouts_megatron,
    env_with_another_pythons_config,
    launch_ranks,
    torchrun,
)

from megatron_vshape.schedules.generators.registry import schedule_names

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

CLIENT_FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
PATCH = ROOT / "patches" / "megatron-lm-pretrain_gpt.patch"

TINY = ("--cpu --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
        "--train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--log-interval 1 --eval-interval 5 --eval-iters 1").split()
ITERATIONS = [1, 2, 3, 4, 5]
# Megatron's virtual pipeline needs its chunk count on the command line; every other schedule takes TINY as is.
EXTRA_FLAGS = {"interleaved-1f1b": ["--num-virtual-stages-per-pipeline-rank", "2"]}
# Megatron's evaluation lines: during training ("at iteration 5 |") and after it ("... on validation set |").
EVAL_LOSS = re.compile(r"validation loss at iteration (\d+)( on \w+ set)? \| lm loss value: ([0-9.E+-]+)")
RUN_TIMEOUT = 240


@pytest.fixture(scope="module")
def client_dir(megatron_lm_019) -> Path:
    """The Megatron-LM checkout to test against (conftest.py)."""
    return megatron_lm_019


def train(python: str, entry: list[str], schedule: str, cwd: Path = ROOT, launcher=launch_ranks,
          with_output: bool = False, **launch_options) -> dict:
    """Run 2 ranks; return {iteration: lm loss, evaluation name: lm loss} (fails the test on a crash or a hang),
    and with ``with_output`` the launch's output under "stdout"."""
    result = launcher(python, 2, entry, ["--pipeline-schedule", schedule, *TINY, *EXTRA_FLAGS.get(schedule, [])],
                      timeout=RUN_TIMEOUT, cwd=cwd, **launch_options)
    assert result.returncode == 0, f"{schedule} exited {result.returncode}:\n{result.stdout[-5000:]}"
    found = {int(i): float(v) for i, v in LOSS.findall(result.stdout)}
    assert sorted(found) == ITERATIONS, result.stdout[-3000:]
    evaluations = {f"eval {i}{where}": float(v) for i, where, v in EVAL_LOSS.findall(result.stdout)}
    assert sorted(evaluations) == ["eval 5", "eval 5 on test set", "eval 5 on validation set"], result.stdout[-3000:]
    return {**found, **evaluations, **({"stdout": result.stdout} if with_output else {})}


def assert_same_losses(reference: dict, other: dict) -> None:
    for i, loss in reference.items():
        if i != "stdout":
            assert abs(other[i] - loss) <= 1e-5 * abs(loss), (i, loss, other[i])


@pytest.fixture(scope="module")
def megatron_1f1b(mc19_python, client_dir) -> dict:
    """Megatron's own 1F1B function (the runner keeps it for ``1f1b``) on the unmodified script."""
    losses = train(mc19_python, ["-m", "megatron_vshape.run", str(client_dir / "pretrain_gpt.py")], "1f1b")
    assert losses[5] < losses[1], "training must make progress"
    return losses


# V-Half through torchrun (the README's command). Every schedule trains through this same script and runner in
# the pairwise feature matrix (test_feature_matrix.py), crossed with the other features.
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_runner_trains_v_half_on_the_unmodified_script_by_the_readmes_command(mc19_python, client_dir, megatron_1f1b):
    losses = train(mc19_python, ["-m", "megatron_vshape.run", str(client_dir / "pretrain_gpt.py")], "v-half",
                   launcher=torchrun)
    assert_same_losses(megatron_1f1b, losses)


@pytest.fixture(scope="module")
def patched_checkout(client_dir, tmp_path_factory) -> Path:
    """A copy of the checkout with the patch applied by ``git apply``, as the patch README says."""
    copy = tmp_path_factory.mktemp("megatron-lm")
    for name in CLIENT_FILES:
        shutil.copy(client_dir / name, copy / name)
    result = subprocess.run(["git", "apply", str(PATCH)], cwd=copy, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (copy / "pretrain_gpt.py").read_text() != (client_dir / "pretrain_gpt.py").read_text()
    return copy


def test_patch_applies_and_hooks_the_arguments_before_any_megatron_import(patched_checkout):
    """The patch (patches/README's ``git apply``) applies to Megatron-LM's pretrain_gpt.py and calls the
    plugin's argument hook before the script's first megatron import (on Python 3.11 the hook also brings
    the typing.override megatron-core 0.19 imports). Training the patched script is -m extended."""
    import megatron_vshape

    lines = (patched_checkout / "pretrain_gpt.py").read_text().splitlines()
    hook = lines.index("hook_arguments()")
    first_megatron = next(i for i, line in enumerate(lines)
                          if line.startswith(("from megatron.", "from megatron ", "import megatron")))
    assert "from megatron_vshape import hook_arguments" in lines[:hook] and hook < first_megatron
    assert callable(megatron_vshape.hook_arguments)


@pytest.mark.extended  # a 4-rank launch plus Megatron's 1F1B reference: about two minutes of a 2-core machine
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_patched_script_trains_a_v_schedule(mc19_python, patched_checkout, megatron_1f1b):
    """``torchrun pretrain_gpt.py`` on the patched copy (no runner), on this interpreter (3.11 included).
    One schedule: the patch only routes the flag to the same install the runner does, and the runner
    above trains every schedule."""
    losses = train(mc19_python, [str(patched_checkout / "pretrain_gpt.py")], "v-half", cwd=patched_checkout,
                   launcher=torchrun)
    assert_same_losses(megatron_1f1b, losses)


# --- Megatron-LM main (0.20.0 at d98e8a64), from a writable copy of its checkout ---------------------------

@pytest.fixture(scope="module")
def main_env(tmp_path_factory) -> dict[str, str]:
    """The main launches' environment: another Python's python3-config first on PATH."""
    return env_with_another_pythons_config(tmp_path_factory.mktemp("wrong-python-config"))


def train_main(python: str, checkout: Path, schedule: str, env: dict[str, str], script: str = "pretrain_gpt.py") -> dict:
    """``train`` through the runner on the main checkout's script (forked ranks: their preload imports the
    checkout's megatron, as each rank would); the output is kept."""
    return train(python, ["-m", "megatron_vshape.run", str(checkout / script)], schedule, with_output=True, env=env)


@pytest.fixture(scope="module")
def main_1f1b(mc19_python, megatron_main, main_env) -> dict:
    """Megatron's own 1F1B on main's checkout."""
    losses = train_main(mc19_python, megatron_main, "1f1b", main_env)
    assert_runs_the_checkouts_megatron(losses["stdout"], megatron_main)
    return losses


@pytest.mark.extended
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_megatron_1f1b_on_main_gives_the_losses_of_0_19(main_1f1b, megatron_1f1b):
    assert_same_losses(megatron_1f1b, main_1f1b)


# The default run on main is test_pretrain_cpu.py's V-ZB resume through main's pretrain_gpt.py.
@pytest.mark.extended
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("schedule", [name for name in schedule_names() if name != "1f1b"])
def test_runner_trains_every_schedule_on_megatron_main(mc19_python, megatron_main, main_env, main_1f1b, schedule):
    losses = train_main(mc19_python, megatron_main, schedule, main_env)
    assert_runs_the_checkouts_megatron(losses["stdout"], megatron_main)
    assert_same_losses(main_1f1b, losses)
