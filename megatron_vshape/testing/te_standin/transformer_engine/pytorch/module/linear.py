"""Linear: y = x W^T (+ b), the weight gradient deferrable (base.py)."""

import torch

from .base import TransformerEngineBaseModule


class Linear(TransformerEngineBaseModule):
    def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 return_bias=False, params_dtype=None, parallel_mode=None, device="cpu",
                 delay_wgrad_compute=False, ub_bulk_wgrad=False, **te_kwargs):
        super().__init__(delay_wgrad_compute, fuse_wgrad_accumulation, tp_size, ub_bulk_wgrad, **te_kwargs)
        self._init_gemm(in_features, out_features, params_dtype or torch.float32, init_method, bias, parallel_mode,
                        sequence_parallel, return_bias, tp_group)

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, **kwargs):
        return self._output(inp)
