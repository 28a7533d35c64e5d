"""B/W split of megatron-core's local linear layers, with a weight-gradient store.

Zero-bubble and V schedules split a layer's backward in two: **B** computes the input gradient (what
the previous stage waits for) and **W** computes the weight gradient later, to fill bubbles.

The hook is the narrowest one megatron-core offers: the ``backward`` of its autograd function
``LinearWithGradAccumulationAndAsyncCommunication``, which every ``ColumnParallelLinear`` and
``RowParallelLinear`` (local spec, output layer, SequentialMLP experts) goes through.
:func:`enable_wgrad_split` swaps that ``backward`` for a dispatcher:

* outside :meth:`WeightGradStore.capture` it calls Megatron's own backward, untouched, so runs
  without W actions give bitwise Megatron's gradients;
* inside a capture it computes the input gradient exactly as Megatron does (same GEMM, same
  asynchronous all-reduce, or reduce-scatter under sequence parallelism), returns ``None`` for the
  weight, and pushes a :class:`_LinearWeightGrad` task under the capture's key. ``store.run(key)``
  (the W action) runs those tasks.

Limits: weights computed outside this function keep their gradient in B (legacy GroupedMLP experts,
embeddings; Transformer Engine linears are refused by ``te_wgrad``: split schedules use the split layer
spec, ``megatron/layer_spec.py``); frozen weights have no W. Megatron
FSDP and 0.19's GTP weight rematerialisation are refused with a clear error.

Which thread sees the capture: on CUDA, autograd runs ``Function.backward`` on its own per-device
worker thread, which sees no ContextVar or thread-local of the thread that called ``backward()``;
``torch.autograd.backward`` stashes the caller's context for it, but Megatron's ``custom_backward``
(``Variable._execution_engine.run_backward``, used whenever ``deallocate_pipeline_outputs`` is on,
as megatron.training sets it) does not. So the capture in force is **one process-wide slot**, visible
from every thread: the executor is single-threaded and runs one B at a time, and the slot refuses a
second capture (nested, or another executor's on another thread) instead of letting two B passes
share it. Every linear backward that runs while the slot is held, on any thread, is deferred.
Counters (:meth:`WeightGradStore.counts`) say how many weight gradients were deferred and run, so
the executor can refuse a B that deferred nothing and the log can show the split really happened.

This module holds the store, the capture slot and the patch; what a captured B computes and the W
task it defers are in ``wgrad_linear``, the split's error and checks in ``wgrad_checks`` (their
public names stay importable from here).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .held_value import HeldValue
from .wgrad_checks import (
    CONTEXT_FIELDS,
    WgradError,
    check_context,
    check_ddp_config,
    check_deferred,
    defers_itself,
    has_splittable_linears,
)
from .wgrad_linear import _LinearWeightGrad as _LinearWeightGrad  # re-exported for the tests
from .wgrad_linear import accumulate_weight_grad as accumulate_weight_grad  # re-exported for the tests
from .wgrad_linear import backward_input_only, megatron_layers

__all__ = ["CONTEXT_FIELDS", "Key", "WeightGradStore", "WgradCounts", "WgradError", "check_context", "check_ddp_config",
           "check_deferred", "disable_wgrad_split", "enable_wgrad_split", "has_splittable_linears",
           "wgrad_split_enabled"]

Key = Hashable  # the executor uses (chunk, microbatch)


@dataclass(frozen=True)
class _Capture:
    store: WeightGradStore
    key: Key

    def defer(self, task: Callable[[], None]) -> None:
        """Add a weight gradient's work to the key being captured (what a split linear's B calls)."""
        self.store._push(self.key, task)


# The capture in force: one per process, readable from every thread (see the module docstring).
_ACTIVE: HeldValue[_Capture] = HeldValue(lambda new, held: WgradError(
    f"capture({new.key!r}) while capture({held.key!r}) is in force: captures do not nest, "
    "and one process runs one B at a time (two executors running at once?)"))


def _current_capture() -> _Capture | None:
    """The capture in force for the backward running now, on whichever thread runs it."""
    return _ACTIVE.get()


@dataclass(frozen=True)
class WgradCounts:
    """Weight gradients (one per linear layer and microbatch) deferred by B and run by W so far."""

    deferred: int = 0
    run: int = 0

    def __sub__(self, other: WgradCounts) -> WgradCounts:
        return WgradCounts(self.deferred - other.deferred, self.run - other.run)


class WeightGradStore:
    """Deferred weight-gradient work of one executor, keyed by (chunk, microbatch).

    ``capture(key)`` wraps the B pass of one (chunk, microbatch); ``run(key)`` is its W pass. Keys
    are run at most once per capture; a W action for a chunk without local linear layers is a
    no-op, not an error, because every capture registers its key even if nothing was deferred.
    """

    def __init__(self) -> None:
        self._tasks: dict[Key, list[Callable[[], None]]] = {}
        self._deferred = 0
        self._run = 0
        # Pending tasks per weight (by id): a weight's gradient is complete when none is left, which
        # is when the executor may launch its data-parallel bucket (runtime/grad_sync.py).
        self._holding: Counter[int] = Counter()

    @contextmanager
    def capture(self, key: Key) -> Iterator[None]:
        if not wgrad_split_enabled():
            raise WgradError("WeightGradStore.capture() needs the split hook: call enable_wgrad_split() first")
        if key in self._tasks:
            raise WgradError(f"capture({key!r}): this key's W has not run yet; run(key) before capturing it again")
        with _ACTIVE.hold(_Capture(self, key)):
            self._tasks[key] = []
            try:
                yield
            except BaseException:
                # A B pass that failed half-way leaves no W to run.
                tasks = self._tasks.pop(key)
                self._deferred -= len(tasks)
                self._release(tasks)
                raise

    def deferred_in(self, key: Key) -> int:
        """How many weight gradients the B of ``key`` deferred (0 until captured, or after its run)."""
        return len(self._tasks.get(key, ()))

    def counts(self) -> WgradCounts:
        """Totals since this store was made (the executor reports per-iteration differences)."""
        return WgradCounts(self._deferred, self._run)

    def defer(self, task: Callable[[], None]) -> None:
        """Add weight-gradient work to the key being captured (used by the TE path)."""
        capture = _current_capture()
        if capture is None or capture.store is not self:
            raise WgradError("WeightGradStore.defer() is only valid inside this store's capture(key) block")
        capture.defer(task)

    def _push(self, key: Key, task: Callable[[], None]) -> None:
        self._tasks[key].append(task)
        self._deferred += 1
        weight = getattr(task, "weight", None)
        if weight is not None:
            self._holding[id(weight)] += 1

    def run(self, key: Key, after_task: Callable[[Callable[[], None]], None] | None = None) -> None:
        """The W pass of ``key``: run exactly the work its B pass deferred, in B's order.

        ``after_task(task)`` is called after each task (the executor launches a gradient bucket as
        soon as the last task holding one of its weights has run)."""
        try:
            tasks = self._tasks.pop(key)
        except KeyError:
            raise WgradError(f"run({key!r}): nothing captured under this key; pending keys: {self.pending()}") from None
        for task in tasks:
            task()
            self._run += 1
            self._release([task])
            if after_task is not None:
                after_task(task)

    def holds(self, weight) -> int:
        """How many pending tasks will still add to ``weight``'s gradient."""
        return self._holding.get(id(weight), 0)

    def weights_owed(self, match: Callable[[Key], bool]) -> set[int] | None:
        """``id()`` of the weights pending tasks under keys ``match`` accepts still add to; None if
        one of those tasks does not name its weight (then nothing can be declared complete)."""
        owed: set[int] = set()
        for key, tasks in self._tasks.items():
            if not match(key):
                continue
            for task in tasks:
                weight = getattr(task, "weight", None)
                if weight is None:
                    return None
                owed.add(id(weight))
        return owed

    def _release(self, tasks) -> None:
        for task in tasks:
            weight = getattr(task, "weight", None)
            if weight is not None:
                self._holding[id(weight)] -= 1
                if self._holding[id(weight)] <= 0:
                    del self._holding[id(weight)]

    def pending(self) -> list[Key]:
        """Keys captured and not run yet, in capture order."""
        return list(self._tasks)

    def clear(self) -> None:
        """Drop all deferred work (e.g. after an aborted iteration); frees the tensors it holds."""
        self._tasks.clear()
        self._holding.clear()


# --- the patch -------------------------------------------------------------------------------


def _make_dispatching_backward(megatron_backward: Callable) -> Callable:
    split = megatron_layers().custom_bwd(backward_input_only)

    def backward(ctx, grad_output):
        capture = _current_capture()
        if capture is None:
            return megatron_backward(ctx, grad_output)
        check_context(ctx)
        if defers_itself(ctx):
            return megatron_backward(ctx, grad_output)
        return split(ctx, grad_output, capture.defer)

    backward.megatron_backward = megatron_backward  # lets disable_wgrad_split() restore it
    return backward


def _linear_function():
    return megatron_layers().LinearWithGradAccumulationAndAsyncCommunication


def wgrad_split_enabled() -> bool:
    return hasattr(_linear_function().backward, "megatron_backward")


def enable_wgrad_split() -> None:
    """Install the B/W dispatcher on megatron-core's linear autograd function (idempotent).

    Without an active capture the dispatcher calls Megatron's backward unchanged.
    """
    function = _linear_function()
    if not wgrad_split_enabled():
        # Autograd looks ``backward`` up on the class at call time, so existing graphs see it too.
        function.backward = staticmethod(_make_dispatching_backward(function.backward))


def disable_wgrad_split() -> None:
    """Restore Megatron's own backward (tests, or a run switching back to a fused schedule)."""
    function = _linear_function()
    if wgrad_split_enabled():
        function.backward = staticmethod(function.backward.megatron_backward)
