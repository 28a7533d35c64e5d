"""Transformer Engine and the B/W split: TE's own deferred weight gradient, and what is refused.

Two routes (chosen from the flags by ``megatron.feature_checks.split_route``):

* **TE deferral** (TE >= 2.3): the layers are megatron's TE wrappers built with
  ``delay_wgrad_compute=True`` (``megatron/layer_spec.py``'s TE split spec). Their backward queues the
  weight-gradient work in a first-in first-out queue per module, and ``backward_dw()`` pops the
  oldest. After a captured B, :func:`defer_te_wgrads` puts one task per deferring module into the
  executor's weight-gradient store under that B's key, so the W of (chunk, microbatch) calls the
  chunk's ``backward_dw()`` once per module. The FIFO cannot be told which microbatch to pop: that
  is right only if every stage runs its W passes in its B passes' order (the validator's
  ``w_order_breaks``; every registry schedule keeps it). This module mirrors each queue with the keys
  pushed and refuses a W that would pop another microbatch's entry, instead of a silently wrong
  gradient.
  Every B of such a model is captured (:func:`defers_every_w`), also one whose W follows
  directly; a backward outside the executor (a reference run) calls :func:`run_te_wgrads_now`.
* **split layer spec** (TE older or missing): megatron's splittable linears with TE attention and
  norms; TE linears are then refused by :func:`check_te_split` (they would compute W in B).

After ``backward_dw()`` without fused accumulation TE leaves the gradient in ``weight.grad``; when no
hook was registered to take it (megatron DDP registers them only with its own
``delay_wgrad_compute``), :func:`_to_main_grad` adds it into ``main_grad`` as DDP's own hook does.

TE cannot be installed on the development machines: TE layers are recognised by the module their
classes (or any base class: megatron's wrappers live in ``megatron.core.extensions``) come from,
and the CPU tests run against ``megatron_vshape/testing/te_standin``.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Hashable

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


def defers_wgrad(module: torch.nn.Module) -> bool:
    """A TE linear built with ``delay_wgrad_compute=True`` (its W waits for ``backward_dw()``)."""
    store = getattr(module, "wgrad_store", None)
    return is_te_linear(module) and store is not None and bool(store.delay_wgrad_compute())


def deferring_te_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The deferring TE linears of ``model``, in module order (the order their W tasks run in)."""
    return [m for m in model.modules() if defers_wgrad(m)]


def te_linear_names(models) -> list[str]:
    """Class names of the TE linear layers in ``models`` that do not defer W (sorted, each once)."""
    return sorted({type(m).__name__ for model in models for m in model.modules()
                   if is_te_linear(m) and not defers_wgrad(m)})


def check_te_split(models, schedule_name: str) -> None:
    """Refuse model chunks whose TE linear layers would compute their weight gradient in B."""
    names = te_linear_names(models)
    if names:
        raise WgradError(
            f"--pipeline-schedule {schedule_name} splits B and W, which Transformer Engine linear layers "
            f"({', '.join(names)}) do not without delay_wgrad_compute: build the model with the layer spec the "
            "glue picks for split schedules (drop --spec) or use --transformer-impl local"
        )


# Each deferring module's queue, mirrored: the key of every entry its backward put in, oldest first.
_PUSHED: weakref.WeakKeyDictionary[torch.nn.Module, collections.deque] = weakref.WeakKeyDictionary()


class _TEWeightGrad:
    """The W of one deferring TE module for one (chunk, microbatch): pop TE's oldest entry, which must be it."""

    def __init__(self, module: torch.nn.Module, key: Hashable):
        self.module, self.key = module, key
        weight = getattr(module, "weight", None)  # the store's gradient-ready tracking reads ``task.weight``
        self.weight = weight if isinstance(weight, torch.nn.Parameter) else None

    def __call__(self) -> None:
        pushed = _PUSHED.get(self.module)
        oldest = pushed[0] if pushed else None
        if oldest != self.key:
            raise WgradError(
                f"W of {self.key!r} would pop {oldest!r}'s weight gradient from {type(self.module).__name__}'s "
                "first-in first-out queue (Transformer Engine's deferral): the schedule runs this stage's W passes "
                "out of B order; use a schedule that keeps it (vshape simulate reports 'W order')")
        pushed.popleft()
        _backward_dw(self.module)


def _backward_dw(module: torch.nn.Module) -> None:
    """TE's ``backward_dw()`` (megatron's wrapper method is a no-op without its config flag: call TE's)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformer_engine") and "backward_dw" in vars(cls):
            cls.backward_dw(module)
            break
    else:
        module.backward_dw()
    _to_main_grad(module)


def _to_main_grad(module: torch.nn.Module) -> None:
    """Move a weight gradient TE left in ``.grad`` into megatron DDP's ``main_grad`` (what DDP's hook does)."""
    if getattr(module, "wgrad_accumulation_and_reduce_hooks", None):
        return  # megatron DDP registered its hooks with TE: TE's backward_dw ran them
    for param in module.parameters(recurse=False):
        main_grad = getattr(param, "main_grad", None)
        if main_grad is None or param.grad is None or not getattr(param, "skip_backward_post_hook", False):
            continue
        if not getattr(param, "grad_added_to_main_grad", False):
            main_grad.add_(param.grad.data)
        param.grad = None


def defer_te_wgrads(store, key: Hashable, model: torch.nn.Module) -> int:
    """After the captured B of ``key``: one W task per deferring TE module of ``model``; returns how many."""
    modules = deferring_te_modules(model)
    for module in modules:
        _PUSHED.setdefault(module, collections.deque()).append(key)
        store.defer(_TEWeightGrad(module, key))
    return len(modules)


def defers_every_w(models) -> bool:
    """Whether ``models`` hold deferring TE linears: then every B must be captured and every W must pop
    what TE queued, also a B whose W follows directly (the lowering chain's ``defer_every_w``).

    TE queues the weight gradient in every backward of such a layer.
    """
    return any(deferring_te_modules(model) for model in models)


def run_te_wgrads_now(model: torch.nn.Module) -> int:
    """A B run as one backward with its W (fused): pop what TE just queued, now. Returns how many ran."""
    modules = deferring_te_modules(model)
    for module in modules:
        pushed = _PUSHED.get(module)
        if pushed:
            raise WgradError(f"{type(module).__name__}: a fused backward while {list(pushed)!r} still wait for W "
                             "in Transformer Engine's queue (the schedule runs W out of B order)")
        _backward_dw(module)
    return len(modules)
