"""The B/W split's error and its checks: what it refuses, and what it needs from Megatron.

:class:`WgradError` is every misuse of the split. The checks run at three moments: on each captured
B (:func:`check_context`: the fields of Megatron's linear context the split reads;
:func:`check_splittable`: no FSDP, no GTP rematerialisation), after each captured B
(:func:`check_deferred`: a B with linear layers must defer something) and once per run
(:func:`check_ddp_config`). ``overlap_grad_reduce`` is supported: the executor launches each bucket
at its parameters' last W (``grad_sync.py``).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class WgradError(RuntimeError):
    """A misuse of the B/W split (unknown key, nesting, unsupported Megatron feature...)."""


# What the split reads from the context of Megatron's linear forward (megatron-core 0.16 and 0.19 set
# these; torch's custom_fwd sets the autocast pair). A field Megatron renames must stop the split with
# one line, not read as a default and change what B computes. ``gtp_remat_size`` exists from 0.19 on;
# its absence means no weight rematerialisation.
CONTEXT_FIELDS = ("allreduce_dgrad", "grad_output_buffer", "gradient_accumulation_fusion", "main_grad",
                  "sequence_parallel", "tp_group", "use_bias", "_fwd_used_autocast", "_dtype")


def check_context(ctx) -> None:
    """Raise WgradError naming the fields of Megatron's linear context the split needs but cannot find."""
    missing = [name for name in CONTEXT_FIELDS if not hasattr(ctx, name)]
    if missing:
        from .compat import megatron_core_version

        raise WgradError(
            f"megatron-core {megatron_core_version()}: the linear layer's autograd context has no {', '.join(missing)}; "
            "the B/W split was written for megatron-core 0.16-0.19 - use a schedule without B/W split "
            "(1f1b, interleaved-1f1b) on this version")


def check_splittable(ctx, weight) -> None:
    """Refuse the Megatron features whose weight gradient a deferred W would compute wrongly."""
    if getattr(ctx, "gtp_remat_size", 1) > 1:
        raise WgradError("split schedules do not support GTP weight rematerialisation (gtp_remat_size > 1)")
    if hasattr(weight, "__fsdp_param__"):
        raise WgradError("split schedules do not support Megatron-FSDP: use megatron DDP")


def defers_itself(ctx) -> bool:
    """Megatron's defer_embedding_wgrad_compute already moves this layer's W (to finalize)."""
    return ctx.grad_output_buffer is not None


def has_splittable_linears(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a megatron linear layer whose weight gradient a captured B defers."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for layer in module.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            weight = getattr(layer, "weight", None)  # None: a tied output layer, weight given at forward
            if weight is None or weight.requires_grad:
                return True
    return False


def check_deferred(deferred: int, key: Hashable, chunk: torch.nn.Module, schedule_name: str) -> None:
    """After a captured B: refuse a B that deferred nothing (``deferred``: how many weight gradients the B
    of ``key`` left to its W, the store's ``deferred_in(key)``) although ``chunk`` has linear layers.

    That is the signature of a capture the backward did not see (a backward run on a thread or path
    that bypasses it): every W would be empty and the schedule would silently lose its split.
    """
    if deferred == 0 and has_splittable_linears(chunk):
        raise WgradError(
            f"--pipeline-schedule {schedule_name}: the B pass of {key!r} deferred no weight gradient although "
            "its model chunk has megatron linear layers, so the B/W split is not happening; this is a bug "
            "(please report it) - use a schedule without B/W split (1f1b, interleaved-1f1b) meanwhile"
        )


def check_ddp_config(ddp_config, schedule_name: str = "this schedule") -> None:
    """Reject megatron DDP settings that cannot work with deferred weight gradients.

    Megatron-FSDP shards parameters and gradients in its own buffers, which a W task does not add to.
    """
    if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(ddp_config, "use_custom_fsdp", False):
        raise WgradError(
            f"--pipeline-schedule {schedule_name} splits B and W, which Megatron-FSDP does not support "
            "(its gradient buffers are not megatron DDP's main_grad): use megatron DDP or a schedule without B/W split"
        )
