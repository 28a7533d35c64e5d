"""The base of the stand-in's linears: TE's deferred weight gradient (``delay_wgrad_compute``).

The contract (TE >= 2.3, as documented): a deferring module's backward computes the input gradient
and ``put``s the weight-gradient work in ``self.wgrad_store``, a FIFO per module; ``backward_dw()``
pops the oldest entry (it cannot be told which microbatch), writes the weight gradient (into
``main_grad`` under ``fuse_wgrad_accumulation``, else into ``.grad``) and runs the hooks given to
``register_wgrad_accumulation_and_reduce_hooks``. Deferring weights carry ``skip_backward_post_hook``.
"""

import queue

import torch

from ..fp8 import FP8GlobalStateManager


class WeightGradStore:
    """One module's deferred weight-gradient work, first in first out."""

    def __init__(self, delay_wgrad_compute: bool = False, ub_bulk_wgrad: bool = False):
        if delay_wgrad_compute and ub_bulk_wgrad:
            raise ValueError("ub_bulk_wgrad is not supported when enabling delay_wgrad_compute")
        self.enabled = bool(delay_wgrad_compute)
        self.context = queue.Queue() if self.enabled else None

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, tensor_list, func) -> None:
        self.context.put((tensor_list, func))

    def pop(self):
        tensor_list, func = self.context.get_nowait()
        return func(*tensor_list), tensor_list


class TransformerEngineBaseModule(torch.nn.Module):
    """What every stand-in linear shares: the deferral store, its hooks, the FP8 settings carried."""

    def __init__(self, delay_wgrad_compute: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_size: int = 1, ub_bulk_wgrad: bool = False, **te_kwargs):
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError("the TE stand-in runs one tensor-parallel rank (TE's TP comms are not modelled)")
        self.tp_size = tp_size
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.wgrad_store = WeightGradStore(delay_wgrad_compute, ub_bulk_wgrad)
        self.wgrad_accumulation_and_reduce_hooks = []
        self.te_kwargs = te_kwargs  # ub_*, rng_tracker_name, symmetric_ar_type...: carried, unused
        self.fp8_seen: list[bool] = []  # the FP8 state of each forward (what fp8_autocast set)
        self.primary_weights_in_fp8 = FP8GlobalStateManager.with_fp8_parameters()

    def _init_gemm(self, in_features, out_features, dtype, init_method, bias, parallel_mode, sequence_parallel,
                   return_bias, tp_group) -> None:
        """The GEMM's weight (and bias) and settings; deferring weights carry ``skip_backward_post_hook``."""
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.sequence_parallel, self.return_bias = parallel_mode, sequence_parallel, return_bias
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        if init_method is not None:
            init_method(self.weight)
        self.use_bias = bias
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        if self.wgrad_store.delay_wgrad_compute():
            self.weight.skip_backward_post_hook = True

    def _output(self, inp: torch.Tensor):
        """y = x W^T, with the bias added or returned (``return_bias``) as TE does."""
        out = self._linear(inp)
        if self.return_bias:
            return out, self.bias
        return out + self.bias if self.bias is not None else out

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        wgrad, _ = self.wgrad_store.pop()
        weight = self.weight
        if self.fuse_wgrad_accumulation:
            weight.main_grad.add_(wgrad.to(weight.main_grad.dtype))
            weight.grad_added_to_main_grad = True
        else:
            weight.grad = wgrad.to(weight.dtype)
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    def _linear(self, inp: torch.Tensor) -> torch.Tensor:
        self.fp8_seen.append(FP8GlobalStateManager.is_fp8_enabled())
        return _DeferrableLinear.apply(inp, self.weight, self)


def _wgrad(inp2d: torch.Tensor, grad2d: torch.Tensor) -> torch.Tensor:
    return grad2d.t().matmul(inp2d)


class _DeferrableLinear(torch.autograd.Function):
    """y = x W^T; the weight gradient now, or queued in the module's FIFO when it defers."""

    @staticmethod
    def forward(ctx, inp, weight, module):
        ctx.save_for_backward(inp, weight)
        ctx.module = module
        return inp.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad_out):
        inp, weight = ctx.saved_tensors
        module = ctx.module
        dgrad = grad_out.matmul(weight)
        inp2d, grad2d = inp.reshape(-1, inp.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        if module.wgrad_store.delay_wgrad_compute():
            module.wgrad_store.put([inp2d, grad2d], _wgrad)
            return dgrad, None, None
        wgrad = _wgrad(inp2d, grad2d)
        if module.fuse_wgrad_accumulation:
            weight.main_grad.add_(wgrad.to(weight.main_grad.dtype))
            weight.grad_added_to_main_grad = True
            return dgrad, torch.zeros_like(weight), None
        return dgrad, wgrad, None
