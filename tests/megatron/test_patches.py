"""The table of Megatron attributes megatron-vshape replaces matches the megatron-core it runs on, and a
changed signature stops start-up with one line naming the attribute and the tested versions."""

import subprocess
import textwrap

import pytest
from glue_support import ROOT, cpu_env

from megatron_vshape.megatron import patches
from megatron_vshape.megatron.patches import PATCHES, Group, PatchError, check, problem

CORE_ONLY = tuple(p for p in PATCHES if p.module.startswith("megatron.core"))  # 0.16.1 has no megatron.training


def _changed_first_stage(ignore_virtual=True, vp_stage=None, pp_group=None):
    return True


def test_table_matches_the_installed_megatron_core():
    import megatron.core

    assert megatron.core.__version__.startswith("0.16")
    assert len(CORE_ONLY) >= 8
    assert [(p.module, p.attribute, problem(p)) for p in CORE_ONLY] == [(p.module, p.attribute, None) for p in CORE_ONLY]


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
    sys.path.insert(0, "tests/megatron")
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
