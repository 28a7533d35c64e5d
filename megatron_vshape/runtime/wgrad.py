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

What stays in B (not deferred): bias gradients (a cheap reduction; RowParallelLinear and
skip-bias-add layers add their bias outside the function anyway), norms, embeddings, attention
softmax, activations, and layers Megatron already defers itself (the output layer under
``defer_embedding_wgrad_compute``, whose weight gradient Megatron computes in finalize_model_grads).

Memory and communication: a task keeps the layer's *local* input (not all-gathered) and its output
gradient until W. Under sequence parallelism W all-gathers the input again; Megatron's own backward
does that all-gather for the weight gradient only, so the split moves it from B to W and adds no
communication. Tensor-parallel peers run the same program, so they reach the same W together.

Gradient accumulation: a W task adds into ``weight.main_grad`` when the weight has one (megatron
DDP; the fused CUDA kernel when ``gradient_accumulation_fusion`` is on), else into ``weight.grad``.
Megatron DDP's per-parameter hook still fires in B, with a ``None`` gradient: harmless when
``overlap_grad_reduce`` is off, wrong when on (it would start the bucket's reduction before W), so
:func:`check_ddp_config` rejects that combination. A weight used twice in one backward (tied
weights) gets two additions instead of one addition of a sum: equal up to rounding only.

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .process_slot import ExclusiveSlot

Key = Hashable  # the executor uses (chunk, microbatch)


class WgradError(RuntimeError):
    """A misuse of the B/W split (unknown key, nesting, unsupported Megatron feature...)."""


@dataclass(frozen=True)
class _Capture:
    store: WeightGradStore
    key: Key


# The capture in force: one per process, readable from every thread (see the module docstring).
_ACTIVE: ExclusiveSlot[_Capture] = ExclusiveSlot(lambda new, held: WgradError(
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
                self._deferred -= len(self._tasks.pop(key))
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
        self._push(capture.key, task)

    def _push(self, key: Key, task: Callable[[], None]) -> None:
        self._tasks[key].append(task)
        self._deferred += 1

    def run(self, key: Key) -> None:
        """The W pass of ``key``: run exactly the work its B pass deferred, in B's order."""
        try:
            tasks = self._tasks.pop(key)
        except KeyError:
            raise WgradError(f"run({key!r}): nothing captured under this key; pending keys: {self.pending()}") from None
        for task in tasks:
            task()
            self._run += 1

    def pending(self) -> list[Key]:
        """Keys captured and not run yet, in capture order."""
        return list(self._tasks)

    def clear(self) -> None:
        """Drop all deferred work (e.g. after an aborted iteration); frees the tensors it holds."""
        self._tasks.clear()


# --- the W task -------------------------------------------------------------------------------


@dataclass
class _LinearWeightGrad:
    """The weight-gradient GEMM of one linear layer for one microbatch, as Megatron would run it."""

    weight: torch.nn.Parameter
    input: torch.Tensor  # local input: under sequence parallelism, the not-yet-gathered shard
    grad_output: torch.Tensor
    sequence_parallel: bool
    tp_group: Any
    fused_main_grad: torch.Tensor | None  # set when gradient_accumulation_fusion is on
    autocast: tuple[bool, torch.dtype | None]
    versions: tuple[int, int] = field(init=False)  # of input and grad_output when B deferred them

    def __post_init__(self) -> None:
        self.versions = (self.input._version, self.grad_output._version)

    def __call__(self) -> None:
        if (self.input._version, self.grad_output._version) != self.versions:
            # Autograd checks saved tensors only at B; W would silently use the changed values.
            raise WgradError(
                f"a linear layer's input or output gradient (shape {tuple(self.input.shape)}) was modified "
                "in place between its B and its W: keep it intact until W (no in-place ops on it)"
            )
        with torch.no_grad(), _autocast_as_in_forward(*self.autocast):
            grad_output, total_input = _layers_utils().prepare_input_tensors_for_wgrad_compute(
                self.grad_output, self._total_input()
            )
            if self.fused_main_grad is not None:
                _accumulate_fused(self.weight, self.fused_main_grad, total_input, grad_output)
            else:
                _accumulate(self.weight, grad_output.t().matmul(total_input))

    def _total_input(self) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.input
        size = list(self.input.size())
        size[0] *= self.tp_group.size()
        gathered = torch.empty(size, dtype=self.input.dtype, device=self.input.device)
        _layers().dist_all_gather_func(gathered, self.input, group=self.tp_group)
        return gathered


def _autocast_as_in_forward(enabled: bool, dtype: torch.dtype | None):
    # Megatron's backward runs under the forward's autocast state (custom_bwd); so does W.
    return torch.autocast("cuda", enabled=True, dtype=dtype) if enabled else contextlib.nullcontext()


def _accumulate(weight: torch.nn.Parameter, grad_weight: torch.Tensor) -> None:
    """Add as autograd + megatron DDP's hook would: main_grad.add_(grad), or into weight.grad."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(grad_weight)
        return
    if not isinstance(weight, torch.nn.Parameter):
        # Under saved_tensors_hooks (e.g. activation offloading) autograd hands backward a copy of
        # the saved weight: a gradient written into the copy's .grad would be lost silently.
        raise WgradError(
            "deferred weight gradient has no parameter to land in (saved-tensor hooks such as "
            "activation offloading are active); turn them off or use a schedule without B/W split"
        )
    if weight.grad is None:
        weight.grad = grad_weight
    else:
        weight.grad.add_(grad_weight)


def _accumulate_fused(weight, main_grad, total_input, grad_output) -> None:
    """Megatron's gradient-accumulation fusion: the CUDA kernel adds straight into main_grad."""
    weight.main_grad = main_grad  # as Megatron's backward does (a layer may be reused, e.g. MTP)
    kernel = getattr(_layers(), "fused_weight_gradient_mlp_cuda", None)
    if kernel is None:  # no apex kernel (CPU): same sum, unfused
        main_grad.add_(grad_output.t().matmul(total_input))
    elif main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernel.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise WgradError(f"gradient_accumulation_fusion: unsupported main_grad dtype {main_grad.dtype}")


# --- the B pass ------------------------------------------------------------------------------


def _backward_input_only(ctx, grad_output: torch.Tensor, capture: _Capture) -> tuple:
    """Megatron's input-gradient path (GEMM + TP all-reduce / SP reduce-scatter); weight grad deferred."""
    input, weight = ctx.saved_tensors
    _check_splittable(ctx, weight)
    tp_group = ctx.tp_group
    grad_input = grad_output.matmul(weight)
    handle = None
    if ctx.allreduce_dgrad:
        handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
    if ctx.sequence_parallel:
        full_grad_input = grad_input
        grad_input = torch.empty(input.size(), dtype=input.dtype, device=input.device, requires_grad=False)
        handle = _layers().dist_reduce_scatter_func(grad_input, full_grad_input, group=tp_group, async_op=True)
    # Megatron makes grad_output contiguous once, for its weight GEMM and the bias sum; keep that one
    # copy for both (no copy at all in the usual contiguous case).
    grad_output = grad_output.contiguous()
    # Queue W while the collective is in flight, as Megatron overlaps its weight GEMM with it.
    capture.store._push(
        capture.key,
        _LinearWeightGrad(
            weight=weight,
            input=input,
            grad_output=grad_output,
            sequence_parallel=ctx.sequence_parallel,
            tp_group=tp_group,
            fused_main_grad=ctx.main_grad if ctx.gradient_accumulation_fusion else None,
            autocast=(ctx._fwd_used_autocast, ctx._dtype),
        ),
    )
    grad_bias = _grad_bias(grad_output) if ctx.use_bias else None
    if handle is not None:
        handle.wait()
    # One gradient per forward argument: 9 in megatron-core 0.16, 10 in 0.19.
    return (grad_input, None, grad_bias) + (None,) * (len(ctx.needs_input_grad) - 3)


def _grad_bias(grad_output: torch.Tensor) -> torch.Tensor:
    # Megatron sums over the 2-D [s*b, h] view made for its weight GEMM; summing the 3-D tensor
    # over dim 0 and letting autograd reduce the batch dim would round differently.
    if grad_output.dim() == 3:
        grad_output = grad_output.view(-1, grad_output.shape[2])
    return grad_output.sum(dim=0)


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


def _check_splittable(ctx, weight) -> None:
    if getattr(ctx, "gtp_remat_size", 1) > 1:
        raise WgradError("split schedules do not support GTP weight rematerialisation (gtp_remat_size > 1)")
    if hasattr(weight, "__fsdp_param__"):
        raise WgradError("split schedules do not support Megatron-FSDP: use megatron DDP")


def _defers_itself(ctx) -> bool:
    """Megatron's defer_embedding_wgrad_compute already moves this layer's W (to finalize)."""
    return ctx.grad_output_buffer is not None


# --- the patch -------------------------------------------------------------------------------


def _layers():
    from megatron.core.tensor_parallel import layers

    return layers


def _layers_utils():
    from megatron.core import utils

    return utils


def _make_dispatching_backward(megatron_backward: Callable) -> Callable:
    split = _layers().custom_bwd(_backward_input_only)

    def backward(ctx, grad_output):
        capture = _current_capture()
        if capture is None:
            return megatron_backward(ctx, grad_output)
        check_context(ctx)
        if _defers_itself(ctx):
            return megatron_backward(ctx, grad_output)
        return split(ctx, grad_output, capture)

    backward.megatron_backward = megatron_backward  # lets disable_wgrad_split() restore it
    return backward


def _linear_function():
    return _layers().LinearWithGradAccumulationAndAsyncCommunication


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


def has_splittable_linears(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a megatron linear layer whose weight gradient a captured B defers."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for layer in module.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            weight = getattr(layer, "weight", None)  # None: a tied output layer, weight given at forward
            if weight is None or weight.requires_grad:
                return True
    return False


def check_deferred(store: WeightGradStore, key: Key, chunk: torch.nn.Module, schedule_name: str) -> None:
    """After a captured B: refuse a B that deferred nothing although ``chunk`` has linear layers.

    That is the signature of a capture the backward did not see (a backward run on a thread or path
    that bypasses it): every W would be empty and the schedule would silently lose its split.
    """
    if store.deferred_in(key) == 0 and has_splittable_linears(chunk):
        raise WgradError(
            f"--pipeline-schedule {schedule_name}: the B pass of {key!r} deferred no weight gradient although "
            "its model chunk has megatron linear layers, so the B/W split is not happening; this is a bug "
            "(please report it) - use a schedule without B/W split (1f1b, interleaved-1f1b) meanwhile"
        )


def check_ddp_config(ddp_config, schedule_name: str = "this schedule") -> None:
    """Reject megatron DDP settings that cannot work with deferred weight gradients."""
    if getattr(ddp_config, "overlap_grad_reduce", False):
        raise WgradError(
            f"--pipeline-schedule {schedule_name} splits B and W, which --overlap-grad-reduce does not support "
            "(DDP would reduce a bucket before W adds to it): drop --overlap-grad-reduce"
        )
