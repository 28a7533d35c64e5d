"""The split backward of one megatron linear layer: the B pass and the W task it defers.

:func:`backward_input_only` is what a captured B runs instead of Megatron's backward: the input
gradient exactly as Megatron computes it, and a :class:`_LinearWeightGrad` task pushed under the
capture's key; ``WeightGradStore.run`` (the W action) calls the task.

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
``overlap_grad_reduce`` is off; when on, the executor runs that B with the hook's overlap path off and
launches the bucket itself after the weight's last W (``grad_sync.py``). A weight used twice in one backward (tied
weights) gets two additions instead of one addition of a sum: equal up to rounding only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .wgrad_checks import WgradError, check_splittable


def megatron_layers():
    """megatron.core.tensor_parallel.layers, imported on first use (this module loads without Megatron)."""
    from megatron.core.tensor_parallel import layers

    return layers


def _layers_utils():
    """megatron.core.utils, imported on first use."""
    from megatron.core import utils

    return utils


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
                accumulate_weight_grad(self.weight, grad_output.t().matmul(total_input))

    def _total_input(self) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.input
        size = list(self.input.size())
        size[0] *= self.tp_group.size()
        gathered = torch.empty(size, dtype=self.input.dtype, device=self.input.device)
        megatron_layers().dist_all_gather_func(gathered, self.input, group=self.tp_group)
        return gathered


def _autocast_as_in_forward(enabled: bool, dtype: torch.dtype | None):
    # Megatron's backward runs under the forward's autocast state (custom_bwd); so does W.
    return torch.autocast("cuda", enabled=True, dtype=dtype) if enabled else contextlib.nullcontext()


def accumulate_weight_grad(weight: torch.nn.Parameter, grad_weight: torch.Tensor) -> None:
    """Add as autograd + megatron DDP's hook would: main_grad.add_(grad), or into weight.grad (in the
    gradient's own dtype: a vocabulary shard's gradient may come in another one than its weight's)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(grad_weight.to(main_grad.dtype))
        return
    if not isinstance(weight, torch.nn.Parameter):
        # Under saved_tensors_hooks (e.g. activation offloading) autograd hands backward a copy of
        # the saved weight: a gradient written into the copy's .grad would be lost silently.
        raise WgradError(
            "deferred weight gradient has no parameter to land in (saved-tensor hooks such as "
            "activation offloading are active); turn them off or use a schedule without B/W split"
        )
    if weight.grad is None:
        weight.grad = grad_weight.to(weight.dtype)
    else:
        weight.grad.add_(grad_weight.to(weight.grad.dtype))


def _accumulate_fused(weight, main_grad, total_input, grad_output) -> None:
    """Megatron's gradient-accumulation fusion: the CUDA kernel adds straight into main_grad."""
    weight.main_grad = main_grad  # as Megatron's backward does (a layer may be reused, e.g. MTP)
    kernel = getattr(megatron_layers(), "fused_weight_gradient_mlp_cuda", None)
    if kernel is None:  # no apex kernel (CPU): same sum, unfused
        main_grad.add_(grad_output.t().matmul(total_input))
    elif main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernel.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise WgradError(f"gradient_accumulation_fusion: unsupported main_grad dtype {main_grad.dtype}")


# --- the B pass ------------------------------------------------------------------------------


def backward_input_only(ctx, grad_output: torch.Tensor, defer: Callable[[_LinearWeightGrad], None]) -> tuple:
    """Megatron's input-gradient path (GEMM + TP all-reduce / SP reduce-scatter); the weight gradient is
    handed to ``defer`` (the capture in force adds it to its store's key) for the W pass to run."""
    input, weight = ctx.saved_tensors
    check_splittable(ctx, weight)
    tp_group = ctx.tp_group
    grad_input = grad_output.matmul(weight)
    handle = None
    if ctx.allreduce_dgrad:
        handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
    if ctx.sequence_parallel:
        full_grad_input = grad_input
        grad_input = torch.empty(input.size(), dtype=input.dtype, device=input.device, requires_grad=False)
        handle = megatron_layers().dist_reduce_scatter_func(grad_input, full_grad_input, group=tp_group, async_op=True)
    # Megatron makes grad_output contiguous once, for its weight GEMM and the bias sum; keep that one
    # copy for both (no copy at all in the usual contiguous case).
    grad_output = grad_output.contiguous()
    # Queue W while the collective is in flight, as Megatron overlaps its weight GEMM with it.
    defer(
        _LinearWeightGrad(
            weight=weight,
            input=input,
            grad_output=grad_output,
            sequence_parallel=ctx.sequence_parallel,
            tp_group=tp_group,
            fused_main_grad=ctx.main_grad if ctx.gradient_accumulation_fusion else None,
            autocast=(ctx._fwd_used_autocast, ctx._dtype),
        )
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
