"""The setup the combined-step unit tests share: a MoE GPT (4 experts, top-2, alltoall dispatcher) with EP 2 on
two CPU ranks, built as the recipe workers build it, with Megatron's combined 1F1B step on (its config)."""

from __future__ import annotations


def moe_gpt_on_two_ranks(rank: int, microbatches: int):
    """(model, config, spec, this rank's ``microbatches`` batches), after CPU mode and the parallel state are up."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.testing.recipe_workers import RecipeSpec, build, make_config
    from megatron_vshape.testing.tiny_gpt import _data

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    spec = RecipeSpec(("v-zb",), 1, num_experts=4, overlap_moe=True)
    config = make_config(spec, 1, None, 2)
    gpt = build(spec, config)
    return gpt, config, spec, _data(spec.model, range(microbatches * rank, microbatches * rank + microbatches))
