"""--pipeline-layout in Megatron's training loop (scripts/pretrain_gpt.py, 4 gloo ranks, megatron.training 0.19).

Two launches of a tiny GPT whose vocabulary (1024) makes the LM head worth several layers:
V-Half with the uniform split saves a torch_dist checkpoint at iteration 3 (scripts/pretrain_gpt.py);
V-Half with ``--pipeline-layout balanced`` (the planner moves layers off device 0) loads it and
trains iterations 4-5 through the runner and Megatron-LM's own pretrain_gpt.py, whose config
container builds the model from a config made before any chunk (the path that once ignored the layout). The checkpoint crosses layouts (global layer numbers in its keys), and the uneven
run computes what the uniform run computes: the layout does not change the maths.
"""

import re

import pytest
from glue_support import GRAD_NORM, LOSS, ROOT, launch_each
from test_real_client import client_dir  # noqa: F401 (fixture: the Megatron-LM checkout, skipped without one)

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

TINY = ("--cpu --pipeline-schedule v-half --pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 "
        "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 "
        "--global-batch-size 16 --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 1024 --log-interval 1").split()
LAYOUT = re.compile(r"\[vshape\] pipeline layout: ([0-9,]+) transformer layers per stage")


@pytest.fixture(scope="module")
def runs(mc19_python, client_dir, tmp_path_factory):  # noqa: F811 (the imported fixture)
    ckpt = tmp_path_factory.mktemp("ckpt")
    launches = {
        "uniform": ([str(ROOT / "scripts" / "pretrain_gpt.py")], [*TINY, "--save", str(ckpt), "--save-interval", "3"]),
        "balanced": (["-m", "megatron_vshape.run", str(client_dir / "pretrain_gpt.py")],
                     [*TINY, "--pipeline-layout", "balanced", "--load", str(ckpt), "--ckpt-step", "3",
                      "--eval-interval", "5", "--eval-iters", "1"]),
    }
    return launch_each(mc19_python, 4, launches, timeout=240)


@pytest.mark.timeout(600)
def test_balanced_layout_is_uneven_and_logged(runs):
    found = LAYOUT.findall(runs["balanced"])
    assert len(found) == 1, runs["balanced"][-3000:]
    counts = [int(n) for n in found[0].split(",")]
    assert len(counts) == 8 and sum(counts) == 8 and len(set(counts)) > 1, counts
    assert not LAYOUT.search(runs["uniform"])  # uniform (the default) prints nothing new


@pytest.mark.timeout(600)
def test_checkpoint_crosses_layouts_and_training_continues_exactly(runs):
    assert "loading distributed checkpoint" in runs["balanced"]
    own = {int(i): float(v) for i, v in LOSS.findall(runs["uniform"])}
    after = {int(i): float(v) for i, v in LOSS.findall(runs["balanced"])}
    assert sorted(after) == [4, 5], runs["balanced"][-3000:]
    assert abs(after[4] - own[4]) <= 1e-5 * abs(own[4]), (own[4], after[4])
    # After a resume Megatron averages the printed loss since the resume: compare iteration 5 by grad norm.
    own_norms, after_norms = dict(GRAD_NORM.findall(runs["uniform"])), dict(GRAD_NORM.findall(runs["balanced"]))
    assert after_norms["4"] == own_norms["4"] and after_norms["5"] == own_norms["5"]
