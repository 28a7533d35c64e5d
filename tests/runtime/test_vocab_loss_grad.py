"""The loss gradient rides with the next H's broadcast where every other rank runs G(k) after that H (issue 42,
the authors' Algorithm 2; ``schedules/lowering/loss_grads.py``), CPU, gloo, spawned ranks.

The generators run each G(k) after H(k+1) on every rank but the last stage's (``vocab_passes.py``); the
moved order (``testing/g_after_next_h.py``) moves the last stage's rank's G too. Then, both ways:

* a training call posts one loss gradient's broadcast per call (the last H's) instead of one per microbatch
  on every rank's vocabulary queue, exactly the COLLECTIVE operations of the rank's lowered program (the NCCL
  model checks those); before the placement change the schedules as built posted m - 1 more;
* the losses, evaluation losses and every gradient match the single-process model (fp32, 1e-6), at PP 2 and
  PP 4.
"""

from __future__ import annotations

import pytest

from megatron_vshape.testing import RunSpec, run_check
from megatron_vshape.testing.g_after_next_h import GAfterNextHExecutor

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")


def posts_rank(rank: int, world_size: int, schedule: str, m: int):
    from megatron.core import parallel_state

    from megatron_vshape.schedules.lowering.exchange import OpKind
    from megatron_vshape.testing.tiny_gpt import (
        forward_step,
        microbatch,
        recorded_vocab_rank,
        train_call,
        vocab_pipeline,
    )

    out = {}
    with recorded_vocab_rank(world_size) as (model, posts):
        for moved in (False, True):
            func, ddp = vocab_pipeline(schedule, world_size, m, model, GAfterNextHExecutor if moved else None)
            data = [dict(microbatch(model, i), index=i) for i in range(m)]
            posts.clear()
            train_call(func, ddp, [iter(data) for _ in ddp], forward_step, m, model)
            program = func.program(world_size, m).ranks[parallel_state.get_pipeline_model_parallel_rank()].exchange
            out[moved] = {"posted": len(posts), "lowered": sum(op.kind is OpKind.COLLECTIVE for op in program),
                          "g": sum(op.kind is OpKind.COLLECTIVE and op.label.endswith("loss gradient")
                                   for op in program)}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["v-half", "1f1b"])
def test_a_training_call_posts_one_loss_gradient_broadcast_per_call_not_per_microbatch(schedule):
    from megatron_vshape.testing import spawn

    m = 6
    for rank, row in enumerate(spawn(posts_rank, 2, (schedule, m), timeout=240)):
        assert row[True]["posted"] == row[True]["lowered"], (rank, row)  # what the NCCL model checked
        assert row[False]["posted"] == row[False]["lowered"], (rank, row)
        assert row[False]["posted"] == row[True]["posted"], (rank, row)  # the schedule as built: as few
        assert row[False]["g"] == row[True]["g"] == 1, (rank, row)  # one g broadcast per call, not m


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pp", [2, 4])
def test_gradients_stay_exact_with_the_loss_gradient_in_the_next_broadcast(pp):
    schedules = ("v-half", "v-zb", "1f1b", "zb-1p") if pp == 2 else ("v-min", "v-zb")
    spec = RunSpec(schedules=schedules, pp=pp, microbatches=2 * pp, vocab_parallel=True, also_tied=pp == 2,
                   executor_type=GAfterNextHExecutor)
    results = run_check(spec, timeout=500)
    for name, row in results.items():
        assert row["num_losses"] == spec.microbatches, (name, row)
        assert row["num_eval_losses"] == spec.microbatches, (name, row)
        assert row["max_grad_rel_err"] <= 1e-6, (name, row)
        assert row["max_loss_abs_err"] <= 1e-6 and row["eval_loss_abs_err"] <= 1e-6, (name, row)
