"""Overlapped F&B pairs run through Megatron's own combined 1F1B step, gradient-exact (issue 43, item 2).

With ``overlap_moe`` every training F and B goes through ``combined_1f1b.combined_forward_backward_step`` and
each pair of the schedule is one call of it (``runtime/combined_step.py``): MoE with EP 2 inside DP 2, PP 2, 4
experts, top-2, alltoall, aux loss, DP overlap (--overlap-grad-reduce, small buckets), two iterations on the
same weights and data. Every gradient (experts and
router included) and every loss must equal a one-process run's, and the B/W split must still defer W. The flag's
bf16 rule is Megatron's, about its GPU kernels: here the flag is set on an fp32 config after its checks, so the
combined path is held to the fp32 tolerance of every other exactness run (the bf16 runs through Megatron-LM's
``pretrain_gpt.py`` are ``tests/megatron/test_moe_overlap_train.py``'s launches).

V-ZB runs with every backward on a new thread, as CUDA's autograd runs the combined step's backward on its
device thread (``RecipeSpec.backward_on_new_threads``); the other schedules on the calling thread, as on CPU.
"""

from __future__ import annotations

import pytest

from megatron_vshape.testing.recipe_workers import RecipeSpec, run_recipe_check

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")
TOLERANCE = 1e-6


def _check(schedules: tuple[str, ...], backward_on_new_threads: bool = False) -> dict:
    # DP overlap with every bucket reduction completing at its launch: a bucket launched before the last W of one
    # of its weights (a pair's deferred W included) would leave that W's part un-reduced, deterministically.
    spec = RecipeSpec(schedules=schedules, pp=2, dp=2, ep=2, num_experts=4, iterations=2, overlap_moe=True,
                      overlap_grad_reduce=True, sync_bucket_launch=True,
                      backward_on_new_threads=backward_on_new_threads)
    results = run_recipe_check(spec, timeout=400)
    assert sorted(results) == sorted(schedules)
    for name, row in results.items():
        assert row["pairs"] > 0, (name, row)  # the schedule has pairs, each run as one combined call
        assert row["num_losses"] == 4 * spec.dp, (name, row)
        assert row["max_grad_rel_err"] <= TOLERANCE, (name, row)
        assert row["max_loss_abs_err"] <= TOLERANCE, (name, row)
        assert row["wgrad_deferred"] > 0, (name, row)  # the pair's W is still split off and deferred
        assert row["late_launches"] == [0, 0] and row["early_launches"] == [row["buckets"]] * 2, (name, row)
        assert (row["backward_threads"] > 0) == backward_on_new_threads, (name, row)
    return results


@pytest.mark.timeout(500)
def test_v_zb_pairs_through_megatrons_combined_step_are_gradient_exact_with_backward_on_worker_threads():
    _check(("v-zb",), backward_on_new_threads=True)


@pytest.mark.extended
@pytest.mark.timeout(900)
def test_every_pairing_schedule_through_megatrons_combined_step_is_gradient_exact():
    _check(("v-half", "v-min", "v-auto"))
