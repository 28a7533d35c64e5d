"""Fixtures and settings shared by the tests of several directories."""

import gc
import os
from pathlib import Path

import pytest
from core_versions import copy_main_checkout, missing, other_minor, require_interpreter
from hypothesis import HealthCheck, settings

from megatron_vshape.testing import feature_matrix

# Property tests draw the same examples on every run (derandomized), so the suite's time and
# verdict do not change from run to run and a CI failure reproduces locally as is. Schedules take
# up to seconds to build, so no per-example deadline. HYPOTHESIS_PROFILE=explore draws new random
# examples each run (and keeps failing ones in .hypothesis/) when looking for new bugs.
settings.register_profile("repeatable", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def _wgrad_split_set_to(enabled: bool):
    """Install (or remove) the B/W split hook for one test; restore its previous state afterwards."""
    from megatron_vshape.runtime.wgrad import disable_wgrad_split, enable_wgrad_split, wgrad_split_enabled

    was_enabled = wgrad_split_enabled()
    (enable_wgrad_split if enabled else disable_wgrad_split)()
    yield
    (enable_wgrad_split if was_enabled else disable_wgrad_split)()


@pytest.fixture
def split():
    """The B/W split hook installed for one test."""
    yield from _wgrad_split_set_to(True)


@pytest.fixture
def no_split():
    """Megatron's own backward for one test."""
    yield from _wgrad_split_set_to(False)


@pytest.fixture(scope="session")
def mc19_python() -> str:
    """An interpreter with megatron-core 0.19.x (megatron.training): this one, or $VSHAPE_MC19_PYTHON."""
    return require_interpreter("0.19")


@pytest.fixture(scope="session")
def other_core_python() -> str:
    """An interpreter with the supported megatron-core version this one lacks ($VSHAPE_MC16_PYTHON or
    $VSHAPE_MC19_PYTHON), for the checks that must hold on both."""
    return require_interpreter(other_minor())


MEGATRON_LM_ENV = "MEGATRON_LM_DIR"
MEGATRON_LM_019 = Path(__file__).resolve().parents[1].parent / "shared" / "clients" / "megatron-lm-core_v0.19.0"
MEGATRON_LM_FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")


@pytest.fixture(scope="session")
def megatron_lm_019() -> Path:
    """The Megatron-LM checkout (tag core_v0.19.0) the scripts run from: ``../shared/clients`` next to this
    project, or ``$MEGATRON_LM_DIR``. Never edited. Its absence fails under CI and skips elsewhere."""
    path = Path(os.environ.get(MEGATRON_LM_ENV) or MEGATRON_LM_019)
    if not all((path / name).is_file() for name in MEGATRON_LM_FILES):
        message = (f"no Megatron-LM checkout at {path} (needs {', '.join(MEGATRON_LM_FILES)}); "
                   f"set {MEGATRON_LM_ENV}=/path/to/Megatron-LM (tag core_v0.19.0) to run these tests")
        missing(message)
    return path


@pytest.fixture(scope="session")
def megatron_main(tmp_path_factory) -> Path:
    """A writable copy of the Megatron-LM main checkout (0.20.0 at d98e8a64), made once per test process."""
    return copy_main_checkout(tmp_path_factory.mktemp("megatron-lm-main") / "Megatron-LM")


# The longest files of a CI run (each 1.5-5 minutes of a 2-core machine: Megatron training launches,
# the full-size Slurm schedules), longest first. Only an ordering hint: a file not listed still runs.
LONGEST_FILES = (*(f"megatron/test_feature_matrix_rows_{i}.py" for i in range(feature_matrix.SHARDS)), "megatron/test_pretrain_cpu.py", "runtime/test_executor_exact.py",
                 "megatron/test_real_client_hybrid.py", "megatron/test_slurm.py", "megatron/test_real_client.py",
                 "megatron/test_recipes.py", "runtime/test_other_megatron_core.py")


def pytest_collection_modifyitems(session, config, items):
    """The longest files run first, then the files with the most multi-process (``slow``) tests, then the
    pure-Python files.

    CI runs the suite on two pytest-xdist workers, one file per work unit (``--dist loadfile``, so a
    module fixture that launches training runs once). With ``--no-loadscope-reorder`` workers take files
    in this collection order (without it, xdist orders files by test count, and this order only breaks
    ties): the long files start first, and the many short ones then fill whichever worker frees up,
    instead of one long file starting last and running alone. The order within a file is unchanged.
    """
    tests_dir = Path(__file__).parent
    slow_per_file: dict[Path, int] = {}
    for item in items:
        slow_per_file[item.path] = slow_per_file.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    first_seen = {path: index for index, path in enumerate(slow_per_file)}

    def rank(path: Path) -> tuple:
        name = path.relative_to(tests_dir).as_posix() if path.is_relative_to(tests_dir) else str(path)
        longest = LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)
        return longest, -slow_per_file[path], first_seen[path]

    items.sort(key=lambda item: rank(item.path))


def pytest_collection_finish(session):
    """Everything imported so far (torch, megatron-core, hypothesis, every test module) lives until the
    run ends: move it out of the garbage collector's reach, so that the full collections that schedule
    building triggers (10^5-10^6 tuples per large schedule) do not re-scan it each time."""
    gc.freeze()
