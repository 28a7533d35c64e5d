"""``--pipeline-vocab-parallel`` through the runner on Megatron-LM's unmodified ``pretrain_gpt.py`` (CPU, gloo).

The vocabulary layers are sharded over the pipeline ranks and run as the schedules' H and G passes; the
losses must be Megatron's own 1F1B's (without the flag, on the same script) to 1e-5, in training and in
its evaluations (forward only), and a torch_dist checkpoint must move across the flag both ways with the
same continuation:

* ``1f1b``: Megatron's own 1F1B, no flag, saving at iteration 3 (the reference);
* ``v-half+vp``: V-Half with the flag (rank 0 holds the first and the last stage), saving at iteration 3;
* ``v-zb-from-vp``: V-ZB without the flag resumes that checkpoint (vocabulary shards -> Megatron's layout);
* ``zb-1p-vp-from-plain``: ZB-1P with the flag resumes Megatron's own checkpoint (Megatron's layout ->
  shards), through Megatron-LM main's own pretrain_gpt.py on its own megatron (0.20.0 at d98e8a64).

Tied embeddings (pretrain_gpt's default). Every schedule with the flag, untied embeddings and the DP options
cross it in the pairwise feature matrix (test_feature_matrix.py). Each launch is 2 ranks, ~10-15 s here.
"""

from __future__ import annotations

import re

import pytest
from glue_support import GRAD_NORM, LOSS, assert_runs_the_checkouts_megatron, launch_ranks

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

TINY = ("--cpu --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
        "--train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--log-interval 1 --eval-interval 5 --eval-iters 1").split()
FLAG = "--pipeline-vocab-parallel"
REPLAN_AFTER_2 = ("--pipeline-costs", "auto", "--pipeline-costs-iters", "1")
REPLANNED = re.compile(r"\[vshape\] rank \d+: re-planned v-half after iteration 2 ")
TIMEOUT = 240
VOCAB_LINE = re.compile(r"vocabulary passes MiB per pipeline rank, held from H to G: ([0-9., ]+); "
                        r"the embedding's buffers \(embeddings and gradients on the first stage, tokens, data read "
                        r"ahead\): ([0-9., ]+)")
EVAL = r"validation loss at iteration 5 on (\w+) set \| lm loss value: ([0-9.E+-]+)"


def _train(python: str, script, schedule: str, *extra: str, env=None) -> str:
    result = launch_ranks(python, 2, ["-m", "megatron_vshape.run", str(script)],
                          ["--pipeline-schedule", schedule, *TINY, *extra], timeout=TIMEOUT, env=env)
    assert result.returncode == 0, f"{schedule} {' '.join(extra)}:\n{result.stdout[-5000:]}"
    return result.stdout


def _losses(output: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(output)}


def _evaluations(output: str) -> dict[str, float]:
    return {name: float(v) for name, v in re.findall(EVAL, output)}


def _assert_same(reference: str, other: str, iterations=(1, 2, 3, 4, 5)) -> None:
    own, got = _losses(reference), _losses(other)
    assert sorted(got) == list(iterations), other[-3000:]
    for i in iterations:
        assert abs(got[i] - own[i]) <= 1e-5 * abs(own[i]), (i, own[i], got[i])
    own_eval, got_eval = _evaluations(reference), _evaluations(other)
    assert sorted(got_eval) == ["test", "validation"], other[-3000:]
    for name, loss in own_eval.items():
        assert abs(got_eval[name] - loss) <= 1e-5 * abs(loss), (name, loss, got_eval[name])


def _assert_resumes(reference: str, resumed: str) -> None:
    """Iterations 4 and 5 after loading iteration 3's checkpoint, as the uninterrupted reference (Megatron's
    log after a resume averages the printed loss since the resume: iteration 5 is compared by its grad norm)."""
    assert "loading distributed checkpoint" in resumed
    own, after = _losses(reference), _losses(resumed)
    assert sorted(after) == [4, 5], resumed[-3000:]
    assert abs(after[4] - own[4]) <= 1e-5 * abs(own[4]), (own[4], after[4])
    own_norms, resumed_norms = dict(GRAD_NORM.findall(reference)), dict(GRAD_NORM.findall(resumed))
    assert resumed_norms["4"] == own_norms["4"] and resumed_norms["5"] == own_norms["5"]


@pytest.fixture(scope="module")
def client_script(megatron_lm_019):
    return megatron_lm_019 / "pretrain_gpt.py"


@pytest.fixture(scope="module")
def runs(mc19_python, client_script, megatron_main, tmp_path_factory):
    plain, sharded = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("sharded")
    save = ("--save-interval", "3")
    out = {"1f1b": _train(mc19_python, client_script, "1f1b", "--save", str(plain), *save)}
    # re-planned after iteration 2 from measured costs (iterations 3-5 run the rebuilt schedule): the rebuild keeps
    # the vocabulary passes (it once dropped them and stopped the run)
    out["v-half+vp"] = _train(mc19_python, client_script, "v-half", FLAG, "--save", str(sharded), *save,
                              *REPLAN_AFTER_2)
    out["v-zb-from-vp"] = _train(mc19_python, client_script, "v-zb", "--load", str(sharded), "--ckpt-step", "3")
    out["zb-1p-vp-from-plain"] = _train(mc19_python, megatron_main / "pretrain_gpt.py", "zb-1p", FLAG,
                                        "--load", str(plain), "--ckpt-step", "3")
    out["main"] = megatron_main
    return out


@pytest.mark.timeout(5 * TIMEOUT)
def test_v_half_with_the_flag_gives_megatrons_1f1b_losses(runs):
    _assert_same(runs["1f1b"], runs["v-half+vp"])
    assert _losses(runs["1f1b"])[5] < _losses(runs["1f1b"])[1], "training must make progress"
    assert len(REPLANNED.findall(runs["v-half+vp"])) == 2, runs["v-half+vp"][-3000:]  # both ranks, then 3 more
    # the shards are there: every rank's first chunk holds its rows (Megatron's DDP lists the parameter)
    assert runs["v-half+vp"].count("vocab_parallel.embedding_weight") == 2
    # the [vshape] line reports what the passes hold: from H to G on every rank, the embedding's buffers
    found = VOCAB_LINE.findall(runs["v-half+vp"])
    assert len(found) == 5, runs["v-half+vp"][-3000:]
    held, buffers = found[-1]
    assert len(held.split(", ")) == 2 and all(float(x) > 0 for x in held.split(", ")) and float(buffers.split(", ")[0]) > 0
    # per microbatch, not per call (issue 42): one microbatch's embedding is 2 x 32 x 64 fp32 = 16 KiB and the
    # call's 8 were 0.125 MiB (0.25 with their gradients); V-Half at PP 2 holds 3 at a time, plus sends in flight,
    # a few microbatches' tokens (512 bytes each) and the data items read one slot ahead
    assert len(buffers.split(", ")) == 2 and all(float(x) <= 0.07 for x in buffers.split(", ")), buffers


@pytest.mark.timeout(5 * TIMEOUT)
def test_a_vocabulary_parallel_checkpoint_resumes_without_the_flag(runs):
    _assert_resumes(runs["1f1b"], runs["v-zb-from-vp"])
    assert "vocab_parallel.embedding_weight" not in runs["v-zb-from-vp"]  # the plain run holds no shards


@pytest.mark.timeout(5 * TIMEOUT)
def test_megatrons_checkpoint_resumes_with_the_flag_on_megatron_main(runs):
    _assert_resumes(runs["1f1b"], runs["zb-1p-vp-from-plain"])
    assert_runs_the_checkouts_megatron(runs["zb-1p-vp-from-plain"], runs["main"])


# --- the flag with the data-parallel options of NVIDIA's recipes -------------------------------------------

DP_OVERLAP = ("--pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
              "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
              "--train-iters 4 --lr 1e-2 --mock-data --tokenizer-type NullTokenizer --vocab-size 4096 "
              "--log-interval 1 --eval-interval 100 --eval-iters 0 --cpu "
              "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather").split()


def _train_dp2(python: str, script, schedule: str, *extra: str, flags=DP_OVERLAP) -> dict[int, float]:
    result = launch_ranks(python, 4, ["-m", "megatron_vshape.run", str(script)],
                          ["--pipeline-schedule", schedule, *flags, *extra], timeout=TIMEOUT)
    assert result.returncode == 0, f"{schedule} {' '.join(extra)}:\n{result.stdout[-5000:]}"
    losses = _losses(result.stdout)
    assert sorted(losses) == [1, 2, 3, 4], result.stdout[-3000:]
    return losses


@pytest.fixture(scope="module")
def dp_overlap_1f1b(mc19_python, client_script):
    return _train_dp2(mc19_python, client_script, "1f1b")


@pytest.mark.timeout(3 * TIMEOUT)
def test_the_flag_with_the_distributed_optimizer_and_overlapped_param_gather(mc19_python, client_script,
                                                                           dp_overlap_1f1b, schedule="v-zb"):
    """PP 2 x DP 2 with Llama-3's DP flags: every shard's parameter all-gather is waited for before the
    passes first read it in an iteration (the shard layers run Megatron's forward pre-hook), else from
    iteration 2 the lookup and the logits use rows the gather has not brought yet (measured before the
    fix: 8.316859 against 8.314754 at iteration 2, v-zb). The other schedules: the feature matrix."""
    own, got = dp_overlap_1f1b, _train_dp2(mc19_python, client_script, schedule, FLAG)
    for i in (1, 2, 3, 4):
        assert abs(got[i] - own[i]) <= 1e-5 * abs(own[i]), (i, own[i], got[i])


TP2 = [*(f for f in DP_OVERLAP if not f.startswith("--use-distributed") and not f.startswith("--overlap")),
       "--tensor-model-parallel-size", "2", "--vocab-size", "1024"]


@pytest.mark.extended  # the default tier holds this through the feature matrix's rows with the flag at TP 2
@pytest.mark.timeout(3 * TIMEOUT)
def test_the_flag_at_tp_2_through_the_script(mc19_python, client_script):
    """TP 2 x PP 2: megatron-core 0.19's validation sets --tensor-parallel-num-weight-shards to the TP size,
    which the flag's check once took for weight sharding (every rank stopped at model construction). The
    default tier's matrix rows with the flag at TP 2 (HybridModel) stopped the same way."""
    own = _train_dp2(mc19_python, client_script, "1f1b", flags=TP2)
    got = _train_dp2(mc19_python, client_script, "v-zb", FLAG, flags=TP2)
    for i in (1, 2, 3, 4):
        assert abs(got[i] - own[i]) <= 1e-5 * abs(own[i]), (i, own[i], got[i])
