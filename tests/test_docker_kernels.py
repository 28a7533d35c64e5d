"""docker/check_kernels.py (run by the Dockerfile) fails the build when a kernel of the GPU spec is missing.

Docker, TE and apex are not available here: the kernels are stood in for by empty modules on PYTHONPATH,
so the test proves which imports the check requires and that any one missing fails it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "docker" / "check_kernels.py"
DOCKERFILE = ROOT / "docker" / "Dockerfile"

# module -> attributes it must define (what the GPU spec's code imports from it)
FAKE_KERNELS = {
    "transformer_engine": [],
    "transformer_engine.pytorch": ["DotProductAttention"],
    "transformer_engine.pytorch.optimizers": ["FusedAdam", "multi_tensor_applier"],
    "transformer_engine_torch": ["get_fused_attn_backend"],
    "fused_layer_norm_cuda": [],
    "apex": [],
    "apex.normalization": [],
    "apex.normalization.fused_layer_norm": ["FusedLayerNormAffineFunction"],
    "fused_weight_gradient_mlp_cuda": [],
    "amp_C": [],
    "apex.optimizers": ["FusedAdam"],
    "flash_attn": ["flash_attn_func"],
    "flash_attn_2_cuda": [],
}


def fake_site(root: Path, skip: str | None = None, without_attr: tuple[str, str] | None = None) -> Path:
    for module, attrs in FAKE_KERNELS.items():
        if skip is not None and (module == skip or module.startswith(skip + ".")):
            continue
        parts = module.split(".")
        package = root.joinpath(*parts)
        package.mkdir(parents=True, exist_ok=True)
        body = "".join(f"{a} = object()\n" for a in attrs if (module, a) != without_attr)
        (package / "__init__.py").write_text(body)
    return root


def check(site: Path | None, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site) if site else "")
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, env=env, timeout=60)


def test_passes_when_every_kernel_imports(tmp_path):
    site = fake_site(tmp_path)
    for backend in ("fused", "flash"):
        result = check(site, "--attention-backend", backend)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("ok ") == len(result.stdout.splitlines())


@pytest.mark.parametrize("missing", ["transformer_engine_torch", "fused_layer_norm_cuda", "fused_weight_gradient_mlp_cuda",
                                     "amp_C", "transformer_engine"])
def test_fails_when_one_kernel_is_missing(tmp_path, missing):
    result = check(fake_site(tmp_path, skip=missing))
    assert result.returncode == 1
    assert missing in result.stderr and "kernels missing" in result.stderr


def test_flash_backend_needs_flash_attn_and_names_the_alternative(tmp_path):
    site = fake_site(tmp_path, skip="flash_attn")
    assert check(site, "--attention-backend", "fused").returncode == 0
    result = check(site, "--attention-backend", "flash")
    assert result.returncode == 1 and "flash_attn" in result.stderr and "ATTENTION_BACKEND=fused" in result.stderr


def test_a_te_build_without_fused_attention_fails(tmp_path):
    site = fake_site(tmp_path, without_attr=("transformer_engine_torch", "get_fused_attn_backend"))
    result = check(site, "--attention-backend", "fused")
    assert result.returncode == 1 and "get_fused_attn_backend" in result.stderr


def test_this_machine_has_none_of_them():
    """No TE or apex here: the real check must fail (a check that always passes would pass too)."""
    assert check(None).returncode == 1


def test_dockerfile_runs_the_check_with_the_slurm_scripts_attention():
    text = DOCKERFILE.read_text()
    default = re.search(r"^ARG ATTENTION_BACKEND=(\w+)$", text, re.M).group(1)
    slurm = (ROOT / "scripts" / "slurm" / "generate.py").read_text()
    assert f'ATTENTION_BACKEND = "{default}"' in slurm
    assert re.search(r'^RUN python docker/check_kernels.py --attention-backend "\$\{ATTENTION_BACKEND\}"', text, re.M)
    assert "COPY docker/check_kernels.py" in text
    # The check runs after the install (it needs megatron-core's image, and the split spec import needs it).
    assert text.index("pip install --no-cache-dir --no-deps -e .") < text.index("docker/check_kernels.py --attention")
