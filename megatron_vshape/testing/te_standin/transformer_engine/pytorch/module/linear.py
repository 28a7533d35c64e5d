"""Linear: y = x W^T (+ b), the weight gradient deferrable (base.py)."""

import torch

from .base import TransformerEngineBaseModule


class Linear(TransformerEngineBaseModule):
    def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 return_bias=False, params_dtype=None, parallel_mode=None, device="cpu",
                 delay_wgrad_compute=False, ub_bulk_wgrad=False, **te_kwargs):
        super().__init__(delay_wgrad_compute, fuse_wgrad_accumulation, tp_size, ub_bulk_wgrad, **te_kwargs)
        dtype = params_dtype or torch.float32
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.sequence_parallel, self.return_bias = parallel_mode, sequence_parallel, return_bias
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device="cpu"))
        if init_method is not None:
            init_method(self.weight)
        self.use_bias = bias
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self._mark_deferring_weights()

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, **kwargs):
        out = self._linear(inp)
        if self.return_bias:
            return out, self.bias
        return out + self.bias if self.bias is not None else out
