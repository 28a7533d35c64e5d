"""scripts/pretrain_gpt.py splits B and W on the backward path megatron.training takes on a GPU.

megatron.training backpropagates with ``custom_backward`` (``deallocate_pipeline_outputs``), and on CUDA
autograd runs the layers' backward on its own worker thread. ``threaded_backward_entry.py`` reproduces
that on CPU (every backward on a new thread). The issue's reproduction: V-ZB at PP=2 for 2 iterations
ran 0 deferred weight-gradient GEMMs that way, with unchanged losses and no error. Each iteration's
``[vshape]`` line now says how many weight gradients each pipeline rank deferred and ran.
"""

import re
from pathlib import Path

import pytest
from glue_support import LOSS, ROOT, launch_ranks

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

ARGS = ("--cpu --pipeline-schedule v-zb --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 "
        "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 "
        "--global-batch-size 16 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128 --log-interval 1").split()
W_COUNTS = re.compile(r"\[vshape\] schedule v-zb \|.*\| W deferred/run per pipeline rank: (\d+)/(\d+), (\d+)/(\d+)")


def _launch(python: str, entry: list[str]) -> str:
    result = launch_ranks(python, 2, entry, ARGS, timeout=240)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout


@pytest.mark.timeout(600)
def test_v_zb_defers_and_runs_weight_gradients_with_backwards_on_worker_threads(mc19_python):
    script = str(ROOT / "scripts" / "pretrain_gpt.py")
    plain = _launch(mc19_python, [script])
    threaded = _launch(mc19_python, [str(Path(__file__).with_name("threaded_backward_entry.py")), script])
    assert "[threaded-backward] 32 backwards ran on new threads" in threaded, threaded[-3000:]
    for output in (plain, threaded):
        counts = [tuple(map(int, row)) for row in W_COUNTS.findall(output)]
        assert len(counts) == 2, output[-3000:]  # one line per iteration
        for deferred0, run0, deferred1, run1 in counts:
            assert deferred0 == run0 > 0 and deferred1 == run1 > 0, counts
    assert W_COUNTS.findall(plain) == W_COUNTS.findall(threaded)
    assert LOSS.findall(plain) == LOSS.findall(threaded) and len(LOSS.findall(plain)) == 2
