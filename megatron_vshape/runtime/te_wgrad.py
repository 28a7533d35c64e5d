"""The Transformer Engine side of the B/W split, kept small and apart from the local path.

TE cannot be installed on the development machines, so this module never imports it: it only
recognises TE layers by their classes and drives the hook TE itself provides. With megatron's
``delay_wgrad_compute`` (TE >= 2.3), a TE linear's backward computes only the input gradient and
queues its weight-gradient work inside the layer; ``layer.backward_dw()`` runs the oldest queued
item. Each layer's queue is first-in first-out and not keyed by microbatch, so the W passes of one
chunk must run in the order of its B passes; :class:`TEWeightGrad` checks that instead of letting a
reordered schedule silently mix microbatches.

How the executor uses it (one per model chunk that has TE layers)::

    te = TEWeightGrad.for_chunk(model_chunk)      # None when the chunk has no TE layers
    with store.capture((chunk, microbatch)):
        backward(...)
        if te is not None:
            te.defer(store)                       # store.run(key) then calls backward_dw()

``delay_wgrad_compute`` defers unconditionally, so the Megatron glue must set it only for schedules
that have W actions. Megatron's TransformerConfig (0.16 and 0.19) asserts that the flag comes with
``overlap_moe_expert_parallel_comm`` (its only user so far), so the glue has to set it after that
validation. In 0.19, DDP with ``ddp_config.delay_wgrad_compute`` moves the TE weights' grad-ready
hooks into ``backward_dw()``. ``store.clear()`` does not empty TE's own queues. Not run here: no TE.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections import deque

import torch

from .wgrad import WeightGradStore, WgradError


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def is_te_module(module: torch.nn.Module) -> bool:
    """A Transformer Engine layer, or one of megatron's TE wrappers (which subclass them)."""
    return any(cls.__module__.startswith("transformer_engine") for cls in type(module).__mro__)


def te_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if is_te_module(module)]


def check_transformer_impl(transformer_impl: str, schedule_name: str, splits_backward: bool) -> None:
    """Before building the model: a split schedule with TE layers needs TE itself."""
    if splits_backward and transformer_impl == "transformer_engine" and not te_installed():
        raise WgradError(
            f"--pipeline-schedule {schedule_name} splits B and W, which with --transformer-impl "
            "transformer_engine needs Transformer Engine (not installed): use --transformer-impl local"
        )


def check_te_split(model_chunks, schedule_name: str, delay_wgrad_compute: bool) -> None:
    """After building the model: its TE layers must be able to defer W (TE >= 2.3, flag on)."""
    layers = [module for chunk in model_chunks for module in te_modules(chunk)]
    if not layers:
        return
    without_hook = sorted({type(m).__name__ for m in layers if not hasattr(m, "backward_dw")})
    if without_hook:
        raise WgradError(
            f"--pipeline-schedule {schedule_name} needs Transformer Engine's backward_dw(), missing on "
            f"{', '.join(without_hook)}: upgrade to TE >= 2.3 or use --transformer-impl local"
        )
    if not delay_wgrad_compute:
        raise WgradError(
            f"--pipeline-schedule {schedule_name} with Transformer Engine layers needs "
            "--delay-wgrad-compute (TE defers W only then): add the flag or use --transformer-impl local"
        )


class TEWeightGrad:
    """The W pass of one model chunk's TE layers, queued into a :class:`WeightGradStore`."""

    def __init__(self, modules) -> None:
        # Only layers with the hook; megatron's wrappers make it a no-op when the flag is off.
        self.modules = tuple(m for m in modules if hasattr(m, "backward_dw"))
        self._tickets = itertools.count()
        self._queued: deque[int] = deque()  # tickets of captured B passes, oldest first

    @classmethod
    def for_chunk(cls, chunk: torch.nn.Module) -> TEWeightGrad | None:
        modules = te_modules(chunk)
        return cls(modules) if modules else None

    def defer(self, store: WeightGradStore) -> None:
        """Inside ``store.capture(key)``, after the backward: run these layers' W at ``run(key)``."""
        ticket = next(self._tickets)
        store.defer(lambda: self._backward_dw(ticket))
        self._queued.append(ticket)

    def _backward_dw(self, ticket: int) -> None:
        if not self._queued or self._queued[0] != ticket:
            raise WgradError(
                "Transformer Engine queues deferred weight gradients first-in first-out: this schedule "
                "runs a chunk's W passes out of the order of its B passes, which TE layers cannot do"
            )
        self._queued.popleft()
        for module in self.modules:
            module.backward_dw()
