"""Megatron's combined 1F1B step as the executor calls it (runtime/combined_step.py), without a pipeline: a MoE
GPT (4 experts, top-2, alltoall dispatcher) with EP 2 on two ranks (Megatron's combined step needs expert
parallelism: at EP 1 its dispatch frees the tokens the no-op all-to-all hands on), an F alone, an overlapped pair (F of microbatch 1 with B of
microbatch 0), a B alone, each B's weight gradients captured by the split hook and run later by its W.
The gradients must equal the plain forward and backward's of the same ranks (which the recipe checks hold
exact against one process), and before the Ws the linear weights must hold
none of them (the pair's W really is deferred)."""

from __future__ import annotations

import pytest

from megatron_vshape.testing.spawn import spawn


def combined_worker(rank, world_size):
    from _combined_setup import moe_gpt_on_two_ranks
    from megatron.core import parallel_state

    from megatron_vshape.runtime import combined_step
    from megatron_vshape.runtime.iteration_types import Chunk
    from megatron_vshape.runtime.wgrad_adapter import WeightGradAdapter
    from megatron_vshape.testing.recipe_workers import plan_forward_step

    gpt, config, _, batches = moe_gpt_on_two_ranks(rank, 2)

    # the reference: the plain forward and backward of each microbatch
    for batch in batches:
        output = gpt(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        output.float().mean().backward()
    want = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad(set_to_none=True)
    # the aux loss's backward scale: Megatron's loss step sets it (1 / microbatches = 1, the reference's)
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None

    chunk = Chunk(gpt, iter(batches), 0, 0, None, True)
    wgrad = WeightGradAdapter()
    store: list = []
    step = dict(forward_step_func=plan_forward_step, config=config, num_microbatches=1, forward_data_store=store)
    out0, tokens0, _ = combined_step.combined_step(**step, f_chunk=chunk, current_microbatch=0)
    with wgrad.capture((0, 0), gpt, "test"):
        out1, _, grad = combined_step.combined_step(**step, f_chunk=chunk, current_microbatch=1, b_chunk=chunk,
                                                    b_output=out0)
    with wgrad.capture((0, 1), gpt, "test"):
        combined_step.combined_step(**step, b_chunk=chunk, b_output=out1)
    linear = [n for n, p in gpt.named_parameters() if "linear_fc" in n or "linear_proj" in n or "linear_qkv" in n]
    held_before_w = [n for n in linear if dict(gpt.named_parameters())[n].grad is not None]
    deferred = wgrad.store.deferred_in((0, 0)) + wgrad.store.deferred_in((0, 1))
    wgrad.run((0, 0))
    wgrad.run((0, 1))
    worst = max(((p.grad - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)).item()
                for n, p in gpt.named_parameters())
    missing = [n for n, p in gpt.named_parameters() if p.grad is None]
    parallel_state.destroy_model_parallel()
    return {"worst": worst, "missing": missing, "deferred": deferred, "linear": len(linear),
            "held_before_w": held_before_w, "losses": len(store), "grad_is_none": grad is None}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_f_a_pair_and_a_b_through_the_combined_step_give_the_plain_gradients_with_w_deferred():
    for result in spawn(combined_worker, 2, (), timeout=100):
        assert result["losses"] == 2 and result["grad_is_none"]  # one stage: both losses, no input gradient
        assert result["missing"] == [], result
        assert result["linear"] > 0 and result["deferred"] >= result["linear"], result
        assert result["held_before_w"] == [], result  # the pair's and the lone B's weight gradients wait for W
        assert result["worst"] <= 1e-6, result
