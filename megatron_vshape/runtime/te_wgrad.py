"""Transformer Engine and the B/W split: what a split schedule refuses, and why.

The split (``runtime/wgrad.py``) defers the weight gradient of megatron-core's own linear layers.
Transformer Engine's linears (``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``, TE's
grouped linears...) run their own autograd functions, which that hook never sees: with them, B would
compute every weight gradient and W would be empty. TE's own deferral (``delay_wgrad_compute`` and
``backward_dw()``, TE >= 2.3) exists, but megatron-core ties it to its MoE overlap schedule (its
TransformerConfig refuses the flag without ``overlap_moe_expert_parallel_comm``) and TE keeps the
deferred work in one first-in first-out queue per layer, not per microbatch.

So split schedules do not use TE's linears at all. On GPU they get the **split layer spec**
(:mod:`megatron_vshape.megatron.layer_spec`): megatron-core's splittable linear layers with TE's
fused/flash attention and TE's norms. This module is the run-time safety net: a model chunk handed to
a split schedule that still contains TE linear layers (a custom ``--spec``, or a model built outside
the glue) is refused before anything runs, with one line that names the alternative. TE cannot be
installed on the development machines, so nothing here imports it: TE layers are recognised by the
module their classes come from.
"""

from __future__ import annotations

import torch

from .wgrad import WgradError


def is_te_module(module: torch.nn.Module) -> bool:
    """A Transformer Engine layer, or one of megatron's TE wrappers (which subclass them)."""
    return any(cls.__module__.startswith("transformer_engine") for cls in type(module).__mro__)


def is_te_linear(module: torch.nn.Module) -> bool:
    """A TE layer that owns a weight matrix (a GEMM whose weight gradient TE computes itself).

    Norms own 1-D weights and attention owns none, so they are not linears.
    """
    return is_te_module(module) and any(p.dim() >= 2 for p in module.parameters(recurse=False))


def te_linear_names(models) -> list[str]:
    """Class names of the TE linear layers in ``models`` (sorted, each once)."""
    return sorted({type(m).__name__ for model in models for m in model.modules() if is_te_linear(m)})


def check_te_split(models, schedule_name: str) -> None:
    """Refuse model chunks whose TE linear layers would compute their weight gradient in B."""
    names = te_linear_names(models)
    if names:
        raise WgradError(
            f"--pipeline-schedule {schedule_name} splits B and W, which Transformer Engine linear layers "
            f"({', '.join(names)}) do not: build the model with the split layer spec (the default for split "
            "schedules: drop --spec) or use --transformer-impl local"
        )
