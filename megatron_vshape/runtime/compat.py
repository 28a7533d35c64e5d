"""The few megatron-core API differences between the versions we support (0.16.x and 0.19.x).

Everything version-dependent goes through here so the executor reads the same on both.
"""

from __future__ import annotations

import inspect
from functools import cache

from megatron.core.pipeline_parallel import schedules as mschedules


@cache
def _backward_step_takes_model_type() -> bool:
    # 0.16: backward_step(input, output, output_grad, model_type, config); 0.19: model_type is gone.
    return "model_type" in inspect.signature(mschedules.backward_step).parameters


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """megatron's backward_step on either signature; returns the input gradient."""
    if _backward_step_takes_model_type():
        return mschedules.backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return mschedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def forward_step(**kwargs):
    """megatron's forward_step, called by keyword (the same parameters in 0.16 and 0.19).

    Nothing is filtered: a parameter Megatron renames fails the call (and, on the training path,
    start-up: megatron/patches.py lists the signature), instead of being dropped silently.
    """
    return mschedules.forward_step(**kwargs)


def forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data,
                           num_microbatches, forward_data_store, cp_group_size):
    """megatron's loss step of a last stage (the same parameters in 0.16, 0.19 and main), on a last stage."""
    return mschedules.forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data,
                                             num_microbatches, forward_data_store, cp_group_size, True)


def call_finalize(func, model, num_tokens, pg_collection, force_all_reduce) -> None:
    """Call ``config.finalize_model_grads_func`` exactly as Megatron's own schedules do (0.16 and 0.19)."""
    func(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def megatron_core_version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")
