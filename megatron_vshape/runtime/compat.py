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
    """megatron's forward_step, passing only the keyword arguments this version knows."""
    return mschedules.forward_step(**_accepted(mschedules.forward_step, kwargs))


def call_finalize(func, model, num_tokens, pg_collection, force_all_reduce) -> None:
    """Call ``config.finalize_model_grads_func`` with the arguments its signature accepts."""
    kwargs = _accepted(func, {"pg_collection": pg_collection, "force_all_reduce": force_all_reduce})
    func(model, num_tokens, **kwargs)


def _accepted(func, kwargs: dict) -> dict:
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def megatron_core_version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")
