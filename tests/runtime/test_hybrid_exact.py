"""HybridModel chunks on a V are gradient-exact against one process (CPU, gloo, PP 2; V-Half and V-ZB).

The pattern ``*-*E*-*E`` (attention, MLP, MoE with 4 experts top-2) is cut into the V's 4 stages; rank i
must hold stages i and 3-i, i.e. layers (1, 2) and (7, 8) on rank 0 and (3, 4) and (5, 6) on rank 1, and
every gradient and loss must equal the single-process HybridModel's. Without the V segment selection
(``hybrid_spec``) megatron's ``select_pipeline_segment`` cannot build chunk 1 at all (it asks
``torch.distributed`` for the rank of the chunk's pipeline view). Runs with the megatron-core 0.19
interpreter (HybridModel is not in 0.16): ``VSHAPE_MC19_PYTHON``, see ``tests/core_versions.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("v-half", "v-zb")
SCRIPT = textwrap.dedent(f"""
    import json
    from megatron_vshape.testing.tiny_hybrid import run_hybrid_check

    if __name__ == "__main__":
        print("RESULT" + json.dumps(run_hybrid_check({SCHEDULES!r}, pp=2, microbatches=4), default=str))
""")


@pytest.mark.timeout(600)
def test_hybrid_v_chunks_match_one_process(tmp_path, mc19_python):
    script = tmp_path / "check_hybrid.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    proc = subprocess.run([mc19_python, str(script)], capture_output=True, text=True, timeout=560, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT"):])
    assert sorted(out) == sorted(SCHEDULES)
    for name, ranks in out.items():
        by_rank = {row["pp_rank"]: row for row in ranks}
        assert by_rank[0]["layers"] == [[1, 2], [7, 8]] and by_rank[1]["layers"] == [[3, 4], [5, 6]], (name, ranks)
        assert sum(row["num_losses"] for row in ranks) == 4, (name, ranks)  # on rank 0, where the V ends
        for row in ranks:
            assert row["max_grad_rel_err"] <= 1e-6, (name, row)
            assert row["max_loss_abs_err"] <= 1e-6, (name, row)
            # B deferred weight gradients (every megatron linear of the chunks can) and W ran each one.
            assert row["wgrad_deferred"] == row["wgrad_run"] > 0, (name, row)
