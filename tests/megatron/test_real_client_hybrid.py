"""NVIDIA Megatron-LM's own ``pretrain_hybrid.py`` (HybridModel, tag core_v0.19.0, unmodified), on CPU with gloo.

``--cpu`` builds HybridModel from megatron-core's torch layers (``megatron_vshape.megatron.hybrid_spec``);
every schedule must print Megatron's own 1F1B losses (to 1e-5), in training and in the evaluations.

The matrix: each launch costs 30-40 CPU-seconds (mostly start-up), so the required coverage is folded
into 6 launches (7 two-rank equivalents) instead of 2 patterns x 5 schedules x 2 sizes:

* One pattern holds both families the issue names, ``*-`` x 4 and ``*E`` x 4 (MoE: 4 experts, top-2),
  interleaved: ``*-*E*-*E*-*E*-*E``. At PP 2 the 4 V stages hold ``*-*E`` each; at PP 4 the 8 stages hold
  one ``*-`` or one ``*E`` each, so every rank runs dense and MoE layers.
* PP 2 from scratch: Megatron's 1F1B (the reference; it saves a checkpoint at iteration 2), zb-1p and
  v-zb: 3 iterations and the three evaluations each.
* PP 4 (4 ranks): v-min resumes the PP 2 1F1B checkpoint at iteration 2: V at PP 4, and "a HybridModel
  checkpoint saved under one schedule resumes under another" (and another PP); iteration 3 and the
  evaluations must equal 1F1B's.
* v-half, with the GPTModel-to-HybridModel translation: Megatron-LM's ``pretrain_gpt.py`` (1F1B, 4 layers)
  saves at iteration 2; ``pretrain_hybrid.py`` with ``*-*-*-*-`` under v-half loads it (Megatron maps GPT
  layer i to hybrid layers 2i and 2i+1 at load time): iteration 3 and the evaluations must equal GPT's.
  Dropout is off in this pair: the invariant dropout streams are per layer number, and a GPT layer is two
  hybrid layers.

MoE runs with ``--disable-bias-linear``: megatron-core 0.19.2's SequentialMLP adds the expert bias in
place on a view (autograd refuses it, under every schedule); the GPT MoE runs of this project do the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from glue_support import LOSS, assert_runs_the_checkouts_megatron, launch_ranks
from test_real_client import EVAL_LOSS, assert_same_losses, client_dir, main_env  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

PATTERN = "*-*E*-*E*-*E*-*E"
MOE = "--num-experts 4 --moe-router-topk 2 --disable-bias-linear".split()
COMMON = ("--cpu --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
          "--micro-batch-size 2 --global-batch-size 16 --train-iters 3 --lr 1e-3 --mock-data "
          "--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-interval 3 --eval-iters 1").split()
NO_DROPOUT = "--hidden-dropout 0 --attention-dropout 0".split()
EVALUATIONS = ["eval 3", "eval 3 on test set", "eval 3 on validation set"]
RUN_TIMEOUT = 300
SCHEDULES_PP2 = ("zb-1p", "v-zb")


def train(python: str, script: Path, schedule: str, pp: int, flags: list[str], iterations: list[int],
          env: dict[str, str] | None = None) -> dict:
    """Launch ``pp`` ranks; return {iteration: lm loss, evaluation: lm loss} (a crash or hang fails the test)."""
    result = launch_ranks(python, pp, ["-m", "megatron_vshape.run", str(script)],
                          ["--pipeline-schedule", schedule, "--pipeline-model-parallel-size", str(pp), *COMMON, *flags],
                          timeout=RUN_TIMEOUT, env=env)
    assert result.returncode == 0, f"{schedule} PP {pp} exited {result.returncode}:\n{result.stdout[-5000:]}"
    found = {int(i): float(v) for i, v in LOSS.findall(result.stdout)}
    assert sorted(found) == iterations, result.stdout[-3000:]
    evaluations = {f"eval {i}{where}": float(v) for i, where, v in EVAL_LOSS.findall(result.stdout)}
    assert sorted(evaluations) == EVALUATIONS, result.stdout[-3000:]
    return {**found, **evaluations, "stdout": result.stdout}


def hybrid(client: Path) -> Path:
    return client / "pretrain_hybrid.py"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid-checkpoints")


@pytest.fixture(scope="module")
def megatron_1f1b(mc19_python, client_dir, checkpoints) -> dict:  # noqa: F811 (client_dir: the fixture above)
    """Megatron's own 1F1B on the unmodified script, PP 2; saves at iteration 2 for the resume below."""
    losses = train(mc19_python, hybrid(client_dir), "1f1b", 2,
                   ["--hybrid-layer-pattern", PATTERN, *MOE, "--save", str(checkpoints / "hybrid"), "--save-interval", "2"],
                   [1, 2, 3])
    assert losses[3] < losses[1], "training must make progress"
    assert (checkpoints / "hybrid" / "iter_0000002").is_dir()
    return losses


def _losses(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "stdout"}


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("schedule", SCHEDULES_PP2)  # all in the default tier, which runs megatron_1f1b anyway
def test_every_schedule_trains_hybrid_model_like_megatron_1f1b(mc19_python, client_dir, megatron_1f1b,  # noqa: F811
                                                               schedule):
    losses = train(mc19_python, hybrid(client_dir), schedule, 2, ["--hybrid-layer-pattern", PATTERN, *MOE], [1, 2, 3])
    assert_same_losses(_losses(megatron_1f1b), _losses(losses))
    if schedule.startswith("v-"):  # the V placement of the pattern's stages, as the start-up line says
        assert " [vshape] hybrid pattern stages: *-*E | *-*E | *-*E | *-*E (V: device i holds stages i and 2d-1-i)" \
            in losses["stdout"]


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_pp4_v_min_resumes_the_1f1b_checkpoint(mc19_python, client_dir, megatron_1f1b, checkpoints):  # noqa: F811
    """Saved by 1F1B at PP 2, resumed by V-Min at PP 4 (8 V stages of one block each): iteration 3 and the
    evaluations are 1F1B's."""
    losses = train(mc19_python, hybrid(client_dir), "v-min", 4,
                   ["--hybrid-layer-pattern", PATTERN, *MOE, "--load", str(checkpoints / "hybrid"), "--ckpt-step", "2"],
                   [3])
    assert "successfully loaded checkpoint" in losses["stdout"]
    assert re.search(r"hybrid pattern stages: \*- \| \*E \| \*- \| \*E \| \*- \| \*E \| \*- \| \*E", losses["stdout"])
    assert_same_losses(_after_iteration_2(megatron_1f1b), _losses(losses))


@pytest.mark.extended  # two launches (a GPT run that saves, a hybrid run that loads): -m extended
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_gpt_checkpoint_resumes_as_hybrid_model_under_v_half(mc19_python, client_dir, checkpoints):  # noqa: F811
    """Megatron's load-time GPT -> HybridModel translation under a V schedule: the first step's loss and the
    evaluations are GPTModel's under 1F1B."""
    gpt = train(mc19_python, client_dir / "pretrain_gpt.py", "1f1b", 2,
                ["--num-layers", "4", *NO_DROPOUT, "--save", str(checkpoints / "gpt"), "--save-interval", "2"], [1, 2, 3])
    resumed = train(mc19_python, hybrid(client_dir), "v-half", 2,
                    ["--hybrid-layer-pattern", "*-*-*-*-", *NO_DROPOUT, "--load", str(checkpoints / "gpt"),
                     "--ckpt-step", "2"], [3])
    assert "loading a GPT checkpoint into the hybrid model: 4 GPT layers feed 4 attention and 4 MLP" in resumed["stdout"]
    assert " [vshape] hybrid pattern stages: *- | *- | *- | *- (V: device i holds stages i and 2d-1-i)" \
        in resumed["stdout"]
    assert_same_losses(_after_iteration_2(gpt), _losses(resumed))


def _after_iteration_2(row: dict) -> dict:
    return {k: v for k, v in _losses(row).items() if k not in (1, 2)}


# --- Megatron-LM main (0.20.0 at d98e8a64): its own pretrain_hybrid.py on its own megatron (-m extended) ---

@pytest.fixture(scope="module")
def main_hybrid_1f1b(mc19_python, megatron_main, main_env) -> dict:  # noqa: F811 (the imported fixture)
    """Megatron's own 1F1B through main's pretrain_hybrid.py (its script does not run on 0.19.2: it passes
    set_startup_timestamps a keyword 0.19.2 lacks)."""
    losses = train(mc19_python, hybrid(megatron_main), "1f1b", 2, ["--hybrid-layer-pattern", PATTERN, *MOE], [1, 2, 3],
                   env=main_env)
    assert_runs_the_checkouts_megatron(losses["stdout"], megatron_main)
    assert losses[3] < losses[1], "training must make progress"
    return losses


@pytest.mark.extended
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("schedule", ["v-half", "v-zb"])
def test_v_schedules_train_hybrid_model_on_megatron_main(mc19_python, megatron_main, main_env,  # noqa: F811
                                                         main_hybrid_1f1b, schedule):
    losses = train(mc19_python, hybrid(megatron_main), schedule, 2, ["--hybrid-layer-pattern", PATTERN, *MOE], [1, 2, 3],
                   env=main_env)
    assert_runs_the_checkouts_megatron(losses["stdout"], megatron_main)
    assert_same_losses(_losses(main_hybrid_1f1b), _losses(losses))


# --- --pipeline-vocab-parallel on HybridModel: its embedding, output layer and loss are GPTModel's -----------
VOCAB_FLAG = "--pipeline-vocab-parallel"


@pytest.fixture(scope="module")
def v_zb_vocab(mc19_python, client_dir, checkpoints) -> dict:  # noqa: F811
    """V-ZB with the flag from scratch, PP 2; saves at iteration 2 (vocabulary shards in Megatron's layout)."""
    return train(mc19_python, hybrid(client_dir), "v-zb", 2,
                 ["--hybrid-layer-pattern", PATTERN, *MOE, VOCAB_FLAG, "--save", str(checkpoints / "hybrid-vocab"),
                  "--save-interval", "2"], [1, 2, 3])


@pytest.mark.timeout(3 * RUN_TIMEOUT + 60)
def test_vocab_parallel_trains_hybrid_model_like_megatron_1f1b(megatron_1f1b, v_zb_vocab, checkpoints):
    """The embedding, LM head and loss sharded over both pipeline ranks and run as V-ZB's H and G passes:
    Megatron's own 1F1B losses (without the flag) in training and in the evaluations."""
    assert "vocabulary passes MiB per pipeline rank, held from H to G" in v_zb_vocab["stdout"]
    assert_same_losses(_losses(megatron_1f1b), _losses(v_zb_vocab))
    assert (checkpoints / "hybrid-vocab" / "iter_0000002").is_dir()


# In the default tier, beside its two fixtures' launches (in the extended tier alone it ran them again for its two)
@pytest.mark.timeout(3 * RUN_TIMEOUT + 60)
def test_hybrid_checkpoints_resume_across_the_vocab_flag_both_ways(mc19_python, client_dir, megatron_1f1b,  # noqa: F811
                                                                    v_zb_vocab, checkpoints):
    """V-Half without the flag resumes the flag's checkpoint, and V-Min with the flag resumes Megatron's own
    1F1B checkpoint: iteration 3 and the evaluations are 1F1B's."""
    without = train(mc19_python, hybrid(client_dir), "v-half", 2,
                    ["--hybrid-layer-pattern", PATTERN, *MOE, "--load", str(checkpoints / "hybrid-vocab"),
                     "--ckpt-step", "2"], [3])
    with_flag = train(mc19_python, hybrid(client_dir), "v-min", 2,
                      ["--hybrid-layer-pattern", PATTERN, *MOE, VOCAB_FLAG, "--load", str(checkpoints / "hybrid"),
                       "--ckpt-step", "2"], [3])
    for resumed in (without, with_flag):
        assert "successfully loaded checkpoint" in resumed["stdout"]
        assert_same_losses(_after_iteration_2(megatron_1f1b), _losses(resumed))
