"""Distributed-optimizer checkpoints through Megatron-LM's ``pretrain_gpt.py`` on CPU, across ``--pipeline-vocab-parallel``.

PP 2 x DP 2 (4 ranks), ``--use-distributed-optimizer --ckpt-format torch_dist``, 4 iterations, the checkpoint
of iteration 2 resumed: iterations 3 and 4 must be those of an uninterrupted run. Iteration 3 is computed
from the loaded weights, iteration 4 after the first step that uses the loaded Adam state (moments and
step): a run that resumes without it (``--no-load-optim``) prints another loss and grad norm there.

On CPU the optimizer is torch's Adam (no Apex, no Transformer Engine), a path on which megatron-core could
not resume such a checkpoint at all; ``cpu_mode._install_torch_adam_checkpoints`` bridges it.

* default tier: Megatron's own 1F1B without the flag trains 4 iterations and saves at 2 (the reference
  and the checkpoint); V-ZB with the flag resumes it (Megatron's layout -> vocabulary shards).
* default tier: V-Half with tied embeddings saves by name with Megatron's default fully parallel save and
  resumes (rank 0 holds the embedding and its tied copy under one key: :data:`TIED_V_SAVE`).
* ``-m extended``: Megatron's 1F1B resumes its own checkpoint in Megatron's default format (the
  reproduction of the issue: ``--exit-interval 2``, then ``--load``); V-ZB with the flag saves and V-Half
  without it resumes (shards -> Megatron's layout); V-Half without the flag saves and V-ZB with it
  resumes, untied and tied; tied V-Half resumes its checkpoint in Megatron's default format, which a run
  with the flag refuses in one line.

Across the flag the chunks hold other parameters, so Megatron's default optimizer format (its DP buckets'
flat layout, ``dp_reshardable``) cannot be loaded by the other layout (refused in one line:
``model_chunks._install_optimizer_format_check``); those runs save with ``--dist-ckpt-optim-fully-reshardable``
(every parameter's state by its name). The run that loads needs no flag for it: Megatron reads the format
from the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from glue_support import GRAD_NORM, LOSS, launch_ranks

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

TINY = ("--cpu --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
        "--train-iters 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 "
        "--log-interval 1 --eval-interval 100 --eval-iters 0 "
        "--use-distributed-optimizer --ckpt-format torch_dist").split()  # 4 ranks: DP 2
FLAG = "--pipeline-vocab-parallel"
BY_NAME = "--dist-ckpt-optim-fully-reshardable"  # the optimizer state by parameter name: loads across layouts
UNTIED = "--untie-embeddings-and-output-weights"
TIMEOUT = 240

# A V schedule without the flag puts the embedding (chunk 0) and its tied copy (chunk 1, the last stage's
# output layer) on rank 0 under one checkpoint key. Before model_chunks.install_checkpoint_fixes, Megatron's
# fully parallel save marked both as the main replica at DP > 1 ("Invalid sharding pattern validation ...
# embedding.word_embeddings.weight"), and --dist-ckpt-optim-fully-reshardable saved that key's optimizer
# state 64 elements off (megatron-core 0.19's bucket offsets: the embedding's bucket follows a padded one),
# so a resume trained from other weights (lm loss 6.882394 at iteration 3, not 6.875809).
TIED_V_SAVE = "V placement, tied embeddings"
EMBEDDING = "embedding.word_embeddings.weight"


def _train(python: str, script: Path, schedule: str, *extra: str) -> str:
    result = launch_ranks(python, 4, ["-m", "megatron_vshape.run", str(script)],
                          ["--pipeline-schedule", schedule, *TINY, *extra], timeout=TIMEOUT)
    assert result.returncode == 0, f"{schedule} {' '.join(extra)}:\n{result.stdout[-5000:]}"
    return result.stdout


def _save_at_2(directory: Path, *, stop: bool, by_name: bool) -> list[str]:
    """Save iteration 2's checkpoint; ``stop``: and exit there (else train on: the run is the reference)."""
    return ["--save", str(directory), "--save-interval", "2", *(["--exit-interval", "2"] if stop else []),
            *([BY_NAME] if by_name else [])]


def _load_2(directory: Path) -> list[str]:
    """Iteration 2's checkpoint (the saver's run went on); the format comes from the checkpoint."""
    return ["--load", str(directory), "--ckpt-step", "2"]


def _losses(output: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(output)}


def _close(expected: float, got: float) -> bool:
    return abs(got - expected) <= 1e-5 * abs(expected)


def _assert_resumes(reference: str, resumed: str) -> None:
    """Iterations 3 and 4 after loading iteration 2's checkpoint are the uninterrupted run's.

    Megatron resets its summed loss after every logged iteration but the first of a run, so the loss a run
    prints for its second iteration is the mean of its first two: the resumed run's line for iteration 4 is
    the mean of iterations 3 and 4, which the uninterrupted run (started at 1) prints one by one.
    """
    assert "loading distributed checkpoint" in resumed, resumed[-3000:]
    own, after = _losses(reference), _losses(resumed)
    assert sorted(own) == [1, 2, 3, 4], reference[-3000:]
    assert sorted(after) == [3, 4], resumed[-3000:]
    assert _close(own[3], after[3]), ("iteration 3", own[3], after[3])
    assert _close((own[3] + own[4]) / 2, after[4]), ("iteration 4 (mean of 3 and 4)", own[3], own[4], after[4])
    own_norms, resumed_norms = dict(GRAD_NORM.findall(reference)), dict(GRAD_NORM.findall(resumed))
    assert (resumed_norms["3"], resumed_norms["4"]) == (own_norms["3"], own_norms["4"]), (own_norms, resumed_norms)


def _assert_first_iterations(reference: str, saver: str) -> None:
    """A run that stopped at 2 to save printed the uninterrupted run's first two iterations."""
    own, got = _losses(reference), _losses(saver)
    assert sorted(got) == [1, 2], saver[-3000:]
    assert all(_close(own[i], got[i]) for i in (1, 2)), (own, got)


def _optimizer_state_keys(checkpoint: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(checkpoint / "iter_0000002")).read_metadata().state_dict_metadata)


def _saved_tensors(checkpoint: Path, *keys: str) -> dict:
    """The tensors saved under ``keys`` in iteration 2's checkpoint, read in this process."""
    import warnings

    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(str(checkpoint / "iter_0000002"))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {key: torch.empty(metadata[key].size) for key in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def _assert_embedding_state_is_the_embeddings(checkpoint: Path) -> None:
    """The fully reshardable optimizer state's fp32 "param" of the embedding is the saved embedding."""
    saved = _saved_tensors(checkpoint, EMBEDDING, f"optimizer.state.param.{EMBEDDING}")
    assert saved[EMBEDDING].equal(saved[f"optimizer.state.param.{EMBEDDING}"]), (
        (saved[EMBEDDING] - saved[f"optimizer.state.param.{EMBEDDING}"]).abs().max())


@pytest.fixture(scope="module")
def client_script(megatron_lm_019):
    return megatron_lm_019 / "pretrain_gpt.py"


@pytest.fixture(scope="module")
def plain(mc19_python, client_script, tmp_path_factory):
    """Megatron's own 1F1B without the flag: 4 iterations (the reference), saving iteration 2 by name."""
    checkpoint = tmp_path_factory.mktemp("plain")
    return checkpoint, _train(mc19_python, client_script, "1f1b", *_save_at_2(checkpoint, stop=False, by_name=True))


@pytest.mark.timeout(3 * TIMEOUT)
def test_megatrons_distributed_optimizer_checkpoint_resumes_with_the_flag(mc19_python, client_script, plain):
    checkpoint, reference = plain
    saved = _optimizer_state_keys(checkpoint)  # Adam's moments, by parameter name
    assert {f"optimizer.state.{moment}.{name}" for moment in ("exp_avg", "exp_avg_sq")
            for name in ("embedding.word_embeddings.weight", "decoder.layers.mlp.linear_fc1.weight")} <= saved
    resumed = _train(mc19_python, client_script, "v-zb", FLAG, *_load_2(checkpoint))
    assert "vocab_parallel.embedding_weight" in resumed  # the resumed run holds vocabulary shards
    _assert_resumes(reference, resumed)


@pytest.mark.timeout(3 * TIMEOUT)
def test_a_tied_v_half_checkpoint_resumes_from_a_fully_parallel_save(mc19_python, client_script, plain, tmp_path):
    """:data:`TIED_V_SAVE`: Megatron's default (fully parallel) save, the optimizer state by name; 1F1B's
    losses are V-Half's (the reference)."""
    _, reference = plain
    saver = _train(mc19_python, client_script, "v-half", *_save_at_2(tmp_path, stop=True, by_name=True))
    _assert_first_iterations(reference, saver)
    _assert_embedding_state_is_the_embeddings(tmp_path)
    _assert_resumes(reference, _train(mc19_python, client_script, "v-half", "--load", str(tmp_path)))


@pytest.mark.extended
@pytest.mark.timeout(3 * TIMEOUT)
def test_a_tied_v_half_checkpoint_in_megatrons_default_format_resumes(mc19_python, client_script, plain, tmp_path):
    """:data:`TIED_V_SAVE` in the optimizer's default format (``dp_reshardable``), fully parallel save; with the
    flag the same checkpoint is refused in one line on every rank (Megatron stopped each with a traceback)."""
    _, reference = plain
    saver = _train(mc19_python, client_script, "v-half", *_save_at_2(tmp_path, stop=True, by_name=False))
    _assert_first_iterations(reference, saver)
    assert any(key.endswith("bucket_idx_0.exp_avg") for key in _optimizer_state_keys(tmp_path))
    _assert_resumes(reference, _train(mc19_python, client_script, "v-half", "--load", str(tmp_path)))
    refused = launch_ranks(mc19_python, 4, ["-m", "megatron_vshape.run", str(client_script)],
                           ["--pipeline-schedule", "v-zb", FLAG, *TINY, "--load", str(tmp_path)], timeout=TIMEOUT)
    assert refused.returncode == 2 and "Traceback" not in refused.stdout, refused.stdout[-3000:]
    assert (f"megatron-vshape error: {FLAG}: the checkpoint was saved without the flag and this run uses it, "
            f"but its distributed-optimizer state is in the dp_reshardable format") in refused.stdout
    assert BY_NAME in refused.stdout


@pytest.mark.extended
@pytest.mark.timeout(3 * TIMEOUT)
def test_a_tied_v_half_checkpoint_resumes_with_the_flag(mc19_python, client_script, plain, tmp_path):
    """:data:`TIED_V_SAVE`, saved by name without the fully parallel save, resumed by V-ZB with the flag."""
    _, reference = plain
    saver = _train(mc19_python, client_script, "v-half", "--no-ckpt-fully-parallel-save",
                   *_save_at_2(tmp_path, stop=True, by_name=True))
    _assert_first_iterations(reference, saver)
    _assert_embedding_state_is_the_embeddings(tmp_path)
    resumed = _train(mc19_python, client_script, "v-zb", FLAG, "--load", str(tmp_path))
    assert "vocab_parallel.embedding_weight" in resumed
    _assert_resumes(reference, resumed)


@pytest.mark.extended
@pytest.mark.timeout(4 * TIMEOUT)
def test_megatrons_1f1b_resumes_its_distributed_optimizer_checkpoint(mc19_python, client_script, plain,
                                                                       tmp_path):
    """The issue's reproduction: Megatron's default optimizer format, ``--exit-interval 2``, then ``--load``."""
    _, reference = plain
    saver = _train(mc19_python, client_script, "1f1b", *_save_at_2(tmp_path, stop=True, by_name=False))
    _assert_first_iterations(reference, saver)
    assert any(key.endswith("bucket_idx_0.exp_avg") for key in _optimizer_state_keys(tmp_path))
    _assert_resumes(reference, _train(mc19_python, client_script, "1f1b", "--load", str(tmp_path)))


@pytest.mark.extended
@pytest.mark.timeout(4 * TIMEOUT)
def test_a_vocabulary_parallel_distributed_optimizer_checkpoint_resumes_without_the_flag(
        mc19_python, client_script, plain, tmp_path):
    _, reference = plain
    saver = _train(mc19_python, client_script, "v-zb", FLAG, *_save_at_2(tmp_path, stop=True, by_name=True))
    _assert_first_iterations(reference, saver)
    resumed = _train(mc19_python, client_script, "v-half", "--load", str(tmp_path))
    assert "vocab_parallel.embedding_weight" not in resumed  # the plain run holds no shards
    _assert_resumes(reference, resumed)


@pytest.mark.extended
@pytest.mark.timeout(5 * TIMEOUT)
def test_a_v_half_distributed_optimizer_checkpoint_resumes_with_the_flag(mc19_python, client_script, tmp_path):
    """Untied (tied: :func:`test_a_tied_v_half_checkpoint_resumes_with_the_flag`)."""
    reference = _train(mc19_python, client_script, "1f1b", UNTIED)
    saver = _train(mc19_python, client_script, "v-half", UNTIED, *_save_at_2(tmp_path, stop=True, by_name=True))
    _assert_first_iterations(reference, saver)
    resumed = _train(mc19_python, client_script, "v-zb", FLAG, UNTIED, "--load", str(tmp_path))
    assert "vocab_parallel.embedding_weight" in resumed
    _assert_resumes(reference, resumed)
