"""Schedule-invariant dropout and initialisation, checked on a real megatron GPTModel (one CPU process)."""

import json
import subprocess
import sys

import pytest
from glue_support import ROOT, cpu_env

from megatron_vshape.megatron.dropout_seed import mix_seed


def test_mix_seed_is_deterministic_and_separates_its_inputs():
    assert mix_seed(1, 2, 3, 4) == mix_seed(1, 2, 3, 4)
    seeds = {mix_seed(1, it, mb, layer) for it in range(4) for mb in range(4) for layer in range(4)}
    assert len(seeds) == 64
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("python", ["installed", "other"])
def test_masks_and_weights_depend_only_on_position(python, request):
    """On the megatron-core of this interpreter and on the other supported version."""
    exe = sys.executable if python == "installed" else request.getfixturevalue("other_core_python")
    result = subprocess.run([exe, str(ROOT / "tests" / "megatron" / "dropout_check.py")], capture_output=True,
                            text=True, timeout=110, env=cpu_env())
    assert result.returncode == 0, result.stderr[-4000:]
    checks = json.loads(result.stdout.strip().splitlines()[-1])
    failed = [name for name, ok in checks.items() if not ok]
    assert not failed and len(checks) == 9, checks
