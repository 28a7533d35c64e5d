"""Activation-memory accounting: peak bytes of activations alive on this rank during an iteration.

On CUDA the meter reads the allocator (peak allocated minus the level at entry).

On CPU there is no allocator to ask, so :class:`ActivationMeter` plays one: a
``TorchDispatchMode`` sees every tensor an op creates and follows its *storage* (weak reference,
so it is counted exactly until the memory is really freed: after B for what only B needs, after W
for what a weight-gradient task holds, after the send for a stage output). With ``modules`` given,
only storages created while one of those modules runs its forward count, e.g. the transformer
layers: that is the activation memory the schedules trade (logits, loss and gradients excluded);
the peak is then sampled each time one of those forwards returns, so it leaves out the transient
workspace inside a layer and reads the level the schedule simulator models.

Megatron's combined 1F1B step (``--overlap-moe-expert-parallel-comm``, runtime/combined_step.py) runs a layer
from its schedule plan's nodes, which call the layer's parts (norms, attention, MLP or MoE) but never the
layer's own forward. So the parts count too (``parts``: each layer's submodules), outside a layer's
forward and outside autograd's backward (a part recomputed inside a B is the B's workspace, as a layer's
recompute is not counted there either); nested in the layer's forward they change nothing.

Why not ``saved_tensors_hooks``: with any such hook installed autograd hands a custom Function an
*alias* of a saved Parameter, not the Parameter itself, so attributes such as ``main_grad`` that
megatron and the weight-gradient store read from the saved weight would be lost. The dispatch
mode leaves autograd untouched.

Usage::

    with ActivationMeter.for_models(model_chunks) as meter:
        forward_backward(...)
    print(meter.peak_bytes)
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .placement import _unwrap


class _AllocationWatch(TorchDispatchMode):
    def __init__(self, meter: ActivationMeter):
        super().__init__()
        self._meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most ops: skip flattening
            self._meter._track(out)
        else:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._meter._track(leaf)
        return out


class ActivationMeter:
    """Peak live bytes of activation storages (``peak_bytes``) over the ``with`` block."""

    def __init__(self, modules=None, params=None, device: str | None = None, parts=()):
        self._modules = list(modules) if modules is not None else None
        self._parts = list(parts)
        # Per thread: how deep in counted forwards it is, whether each running part's forward counts (see
        # the module text), and its watch while it counts.
        self._thread = threading.local()
        self._excluded = {p.untyped_storage().data_ptr() for p in (params or ())}
        self._device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes
        self.current_bytes = 0
        self.peak_bytes = 0
        self._handles: list = []
        self._mode: _AllocationWatch | None = None  # the whole block's watch when every storage counts
        self._cuda_base = 0

    @classmethod
    def for_models(cls, models, layers_only: bool = True) -> ActivationMeter:
        """A meter over megatron model chunks (DDP-wrapped or not); ``layers_only``: transformer layers."""
        modules = [layer for m in models for layer in _unwrap(m).decoder.layers] if layers_only else None
        parts = [part for layer in modules or () for part in layer.modules() if part is not layer]
        return cls(modules=modules, params=[p for m in models for p in m.parameters()], parts=parts)

    def _here(self):
        state = self._thread
        if not hasattr(state, "depth"):
            state.depth, state.entered, state.watch = 0, [], None
        return state

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self._excluded:
            return
        with self._lock:
            if ptr in self._live:
                return
            self._live[ptr] = nbytes
            self.current_bytes += nbytes
            if self._modules is None:
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        # Storage Python objects are preserved for the storage's lifetime: this fires on the real free.
        weakref.finalize(storage, self._release, ptr)

    def _release(self, ptr: int) -> None:
        with self._lock:
            self.current_bytes -= self._live.pop(ptr, 0)

    def _enter_module(self, *args) -> None:
        # The watch is on only while a counted forward runs on this thread: a Python dispatch per op
        # costs about 9 % of a tiny CPU run, and most ops (backward, W, optimizer, loss) never count.
        here = self._here()
        here.depth += 1
        if here.depth == 1:
            here.watch = _AllocationWatch(self)
            here.watch.__enter__()

    def _exit_module(self, *args) -> None:
        # Sample the peak as a layer's forward returns: its temporaries are gone by then, what is
        # left is what the layer keeps for backward (the level the schedule simulator models).
        here = self._here()
        here.depth -= 1
        if here.depth == 0:
            self._stop_watch(here)
            with self._lock:
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    @staticmethod
    def _stop_watch(here) -> None:
        if here.watch is not None:
            here.watch.__exit__(None, None, None)
            here.watch = None

    def _enter_part(self, *args) -> None:
        counts = torch._C._current_autograd_node() is None  # not a part recomputed inside a backward
        self._here().entered.append(counts)
        if counts:
            self._enter_module()

    def _exit_part(self, *args) -> None:
        if self._here().entered.pop():
            self._exit_module()

    def __enter__(self) -> ActivationMeter:
        self.current_bytes = self.peak_bytes = 0
        if self._device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_base = torch.cuda.memory_allocated()
            return self
        for module in self._modules or ():
            self._handles.append(module.register_forward_pre_hook(self._enter_module))
            self._handles.append(module.register_forward_hook(self._exit_module))
        for part in self._parts:
            self._handles.append(part.register_forward_pre_hook(self._enter_part))
            self._handles.append(part.register_forward_hook(self._exit_part))
        if self._modules is None:
            self._mode = _AllocationWatch(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._device == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._cuda_base
            return
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        here = self._here()  # a forward that raised never ran its exit hook
        self._stop_watch(here)
        here.depth, here.entered = 0, []
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
