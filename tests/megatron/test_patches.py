"""The table of Megatron attributes megatron-vshape replaces matches the megatron-core it runs on, and a
changed signature stops start-up with one line naming the attribute and the tested versions."""

import json
import subprocess
import textwrap

import pytest
from core_versions import installed_minor
from glue_support import ROOT, cpu_env

from megatron_vshape.megatron import patches
from megatron_vshape.megatron.patches import (
    PATCHES,
    TESTED,
    TESTED_VERSIONS,
    Group,
    PatchError,
    check,
    problem,
    untested_warning,
)

# 0.16.1 has no megatron.training, and no HybridModel (megatron.core.models.hybrid; used through megatron.training).
CORE_ONLY = tuple(p for p in PATCHES if p.module.startswith("megatron.core") and p.group is not Group.HYBRID)

# The table's entries that apply to one interpreter's megatron-core (0.16.x has no megatron.training), and
# what the table says of each: None where the attribute matches.
TABLE_PROBLEMS = textwrap.dedent("""
    import importlib.util, json
    import megatron.core
    from megatron_vshape.megatron.patches import PATCHES, problem
    training = importlib.util.find_spec("megatron.training") is not None
    if training:
        from megatron_vshape.megatron.training_cpu import require_megatron_training
        require_megatron_training()  # its Python 3.11 bridge (typing.override) first, as every entry does
    from megatron_vshape.megatron.patches import tested_as
    rows = [p for p in PATCHES if training or p.module.startswith("megatron.core") and p.group.value != "hybrid"]
    tested = tested_as(megatron.core.__version__)
    print("RESULT" + json.dumps({"version": megatron.core.__version__, "training": training,
                                 "tested": None if tested is None else str(tested),
                                 "rows": [[p.module, p.attribute, problem(p)] for p in rows]}))
""")


def _table_problems(python: str) -> dict:
    result = subprocess.run([python, "-c", TABLE_PROBLEMS], capture_output=True, text=True, timeout=200, cwd=ROOT,
                            env=cpu_env())
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def _changed_first_stage(ignore_virtual=True, vp_stage=None, pp_group=None):
    return True


def test_table_matches_the_installed_megatron_core():
    import megatron.core

    assert patches.tested_as(megatron.core.__version__) is not None, megatron.core.__version__
    rows = CORE_ONLY  # 0.16.x has no megatron.training
    if installed_minor() == "0.19":
        from megatron_vshape.megatron.training_cpu import require_megatron_training

        require_megatron_training()  # its Python 3.11 bridge (typing.override) first, as every entry does
        rows = PATCHES
    assert len(rows) >= 8
    assert [(p.module, p.attribute, problem(p)) for p in rows] == [(p.module, p.attribute, None) for p in rows]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_table_matches_the_other_supported_megatron_core(other_core_python):
    """The same check on the tested version this interpreter does not have (VSHAPE_MC16_PYTHON or
    VSHAPE_MC19_PYTHON): every applicable entry matches there too."""
    table = _table_problems(other_core_python)
    assert table["tested"] in TESTED_VERSIONS and table["version"][:4] != installed_minor(), table["version"]
    assert table["training"] == table["version"].startswith("0.19")
    assert len(table["rows"]) >= 8 and all(problem is None for _, _, problem in table["rows"]), table["rows"]


# The table on Megatron-LM main, imported from its checkout by the runner: test_megatron_main.py.


def test_main_is_tested_by_its_files_not_by_its_version():
    """main at d98e8a64 already says 0.20.0: a 0.20.0 release (other files) is untested until CI tests it."""
    main = TESTED[-1]
    assert str(main) == "0.20.0 (main at d98e8a64)" and main.fingerprint is not None
    assert patches.tested_as("0.20.0", fingerprint=lambda: main.fingerprint) is main
    assert patches.tested_as("0.20.0+d98e8a6", fingerprint=lambda: main.fingerprint) is main  # a git checkout's version
    assert patches.tested_as("0.20.0", fingerprint=lambda: "0" * 64) is None
    assert patches.tested_as("0.19.2", fingerprint=lambda: "never read for a release") is TESTED[1]
    assert patches.tested_as("0.21.0") is None


def test_an_untested_version_that_fits_the_table_gets_one_warning_line_on_rank_0(monkeypatch, capsys):
    monkeypatch.setattr(patches, "PATCHES", CORE_ONLY)
    monkeypatch.setattr(patches, "_megatron_version", lambda: "0.21.0")
    patches._warn_if_untested.cache_clear()
    monkeypatch.setenv("RANK", "1")
    check(Group.GPU, Group.WGRAD)
    assert capsys.readouterr().err == ""  # other ranks stay quiet
    patches._warn_if_untested.cache_clear()
    monkeypatch.setenv("RANK", "0")
    check(Group.GPU, Group.WGRAD)
    check(Group.CPU)
    patches._warn_if_untested.cache_clear()
    assert capsys.readouterr().err.splitlines() == [
        "megatron-vshape warning: megatron-core 0.21.0 is untested (tested: 0.16.1, 0.19.2, 0.20.0 (main at "
        "d98e8a64)); every Megatron attribute megatron-vshape replaces matches it"]
    assert untested_warning("0.19.2") is None


def test_a_changed_megatron_signature_fails_with_one_line(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "is_pipeline_first_stage", _changed_first_stage)
    monkeypatch.setattr(patches, "PATCHES", CORE_ONLY)
    with pytest.raises(PatchError) as caught:
        check(Group.GPU, Group.WGRAD)
    message = str(caught.value)
    assert "\n" not in message
    assert "megatron.core.parallel_state.is_pipeline_first_stage takes (ignore_virtual, vp_stage, pp_group)" in message
    assert "tested with megatron-core 0.16.1, 0.19.2" in message


def test_a_missing_attribute_is_named(monkeypatch):
    from megatron.core.tensor_parallel import random

    monkeypatch.delattr(random, "_get_cuda_rng_state")
    with pytest.raises(PatchError, match=r"megatron\.core\.tensor_parallel\.random\._get_cuda_rng_state is missing"):
        check(Group.CPU)


MC19 = textwrap.dedent("""
    import json, sys
    sys.path[:0] = ["tests/megatron", "tests"]
    from megatron_vshape.megatron.training_cpu import require_megatron_training
    require_megatron_training()
    from megatron_vshape.megatron.patches import PATCHES, problem
    print("RESULT" + json.dumps([problem(p) for p in PATCHES]))
    if sys.argv[1] == "install":
        from megatron.core import parallel_state
        from test_arguments import megatron_like
        from test_patches import _changed_first_stage
        from megatron_vshape.megatron.arguments import exit_on_error
        from megatron_vshape.megatron.install import install
        parallel_state.is_pipeline_first_stage = _changed_first_stage
        exit_on_error(install, megatron_like())
        print("INSTALLED")
""")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_table_matches_megatron_core_019_and_install_refuses_a_changed_signature(mc19_python):
    result = subprocess.run([mc19_python, "-c", MC19, "install"], capture_output=True, text=True, timeout=200,
                            cwd=ROOT, env=cpu_env())
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, result.stderr[-3000:]
    assert lines[0] == "RESULT" + "[" + ", ".join(["null"] * len(PATCHES)) + "]", lines[0]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("megatron-vshape error:")]
    assert result.returncode == 2 and "INSTALLED" not in result.stdout, result.stderr[-3000:]
    assert len(errors) == 1 and "is_pipeline_first_stage takes (ignore_virtual, vp_stage, pp_group)" in errors[0]
    assert errors[0].startswith("megatron-vshape error: megatron-core 0.19.2"), errors[0]
