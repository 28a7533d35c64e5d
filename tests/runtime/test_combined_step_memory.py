"""The activation meter under Megatron's combined 1F1B step (``--overlap-moe-expert-parallel-comm``): the step runs
the layers from the schedule plan's nodes, which never call a layer's forward, so a meter that counted inside the
layers' forward alone read 0 bytes there (the ``[vshape]`` line's 0.00 MiB). It counts the layers' parts now: one
microbatch's F through the combined step holds what the plain forward of the same microbatch holds, on the same
two ranks (a MoE GPT, 4 experts, top-2, alltoall, EP 2, as tests/runtime/test_combined_step_units.py)."""

from __future__ import annotations

import pytest

from megatron_vshape.testing.spawn import spawn


def meter_worker(rank, world_size):
    from _combined_setup import moe_gpt_on_two_ranks
    from megatron.core import parallel_state

    from megatron_vshape.runtime import combined_step
    from megatron_vshape.runtime.iteration_types import Chunk
    from megatron_vshape.runtime.memory import ActivationMeter
    from megatron_vshape.testing.recipe_workers import plan_forward_step

    gpt, config, _, (batch,) = moe_gpt_on_two_ranks(rank, 1)

    with ActivationMeter.for_models([gpt]) as meter:  # the plain forward: the layers' own forward runs
        held = gpt(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    plain = meter.peak_bytes
    del held

    chunk = Chunk(gpt, iter([batch]), 0, 0, None, True)
    step = dict(forward_step_func=plan_forward_step, config=config, num_microbatches=1, forward_data_store=[])
    with ActivationMeter.for_models([gpt]) as meter:  # the same microbatch's F through the combined step
        held = combined_step.combined_step(**step, f_chunk=chunk, current_microbatch=0)
    combined = meter.peak_bytes
    with ActivationMeter.for_models([gpt]) as meter:  # its B alone: nothing of a forward's
        combined_step.combined_step(**step, b_chunk=chunk, b_output=held[0])
    backward = meter.peak_bytes
    parallel_state.destroy_model_parallel()
    return {"plain": plain, "combined": combined, "backward": backward}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_meter_counts_the_layers_run_by_the_combined_step_as_their_plain_forward():
    for result in spawn(meter_worker, 2, (), timeout=100):
        assert result["plain"] > 0, result
        assert result["combined"] == pytest.approx(result["plain"], rel=0.1), result
        assert result["backward"] == 0, result
