"""Vocabulary parallelism through the executor stays gradient-exact (CPU, gloo, spawned ranks).

The vocabulary layers are sharded over the pipeline ranks (``runtime/vocab_model.py``) and run as the
schedules' H and G passes with their collectives (``runtime/vocab_iteration.py``): every schedule, at PP 2
and 4, TP 1 and TP 2 x PP 2, tied and untied embeddings, each against the single-process model with
Megatron's own output layer and loss (same weights by global parameter name; a shard's rows of the
embedding and output layer). Losses, evaluation losses and every parameter's gradient, including each
rank's rows of the embedding and the output layer, within 1e-6.
"""

from __future__ import annotations

import pytest

from megatron_vshape.schedules.generators.registry import SCHEDULES
from megatron_vshape.testing import RunSpec, run_check

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

TOLERANCE = 1e-6
ALL = tuple(name for name in SCHEDULES if name != "interleaved-1f1b")  # interleaved: m a multiple of d, below


def _check(spec: RunSpec) -> None:
    results = run_check(spec, timeout=500)
    expected = {*spec.schedules, *(f"{n}+tied" for n in spec.schedules)} if spec.also_tied else set(spec.schedules)
    assert set(results) == expected
    for name, row in results.items():
        assert row["num_losses"] == spec.microbatches * spec.dp * spec.tp, (name, row)  # every TP rank reports
        assert row["num_eval_losses"] == spec.microbatches * spec.dp * spec.tp, (name, row)
        assert row["max_grad_rel_err"] <= TOLERANCE, (name, row)
        assert row["max_loss_abs_err"] <= TOLERANCE, (name, row)
        assert row["eval_loss_abs_err"] <= TOLERANCE, (name, row)


@pytest.mark.timeout(600)
def test_every_schedule_pp2_tied_and_untied():
    _check(RunSpec(schedules=(*ALL, "interleaved-1f1b"), pp=2, microbatches=4, also_tied=True, vocab_parallel=True))


@pytest.mark.timeout(600)
def test_pp4_uneven_shards_of_split_and_fused_schedules():
    # vocabulary 64 over 4 pipeline ranks: 16 rows each (the model pads nothing at this size)
    _check(RunSpec(schedules=("1f1b", "v-half", "v-zb", "zb-1p"), pp=4, microbatches=4, also_tied=True,
                   vocab_parallel=True))


@pytest.mark.timeout(600)
def test_tp2_pp2():
    _check(RunSpec(schedules=("1f1b", "v-zb"), pp=2, tp=2, microbatches=4, also_tied=True, vocab_parallel=True))


@pytest.mark.timeout(600)
def test_tp2_pp2_sequence_parallel():
    # the last stage's [s/tp, b, h] is gathered over TP for H, and its gradient kept per rank on the way back
    _check(RunSpec(schedules=("v-zb",), pp=2, tp=2, microbatches=4, sequence_parallel=True, vocab_parallel=True))


@pytest.mark.timeout(600)
def test_dp2_pp2_distributed_optimizer_with_overlapped_grad_reduce():
    # the shards' gradients (G passes, and the embedding's in the epilogue) land before the chunk's buckets launch
    _check(RunSpec(schedules=("1f1b", "v-zb"), pp=2, dp=2, microbatches=4, distributed_optimizer=True,
                   overlap_grad_reduce=True, vocab_parallel=True))
