"""LayerNormLinear: the norm fused in front of a Linear (its own parameters ``layer_norm_weight/bias``)."""

import torch

from .base import TransformerEngineBaseModule
from .layernorm import normalize


class LayerNormLinear(TransformerEngineBaseModule):
    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False, zero_centered_gamma=False,
                 device="cpu", delay_wgrad_compute=False, ub_bulk_wgrad=False, **te_kwargs):
        super().__init__(delay_wgrad_compute, fuse_wgrad_accumulation, tp_size, ub_bulk_wgrad, **te_kwargs)
        if return_layernorm_output:
            raise NotImplementedError("the TE stand-in does not return the layernorm output")
        dtype = params_dtype or torch.float32
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(in_features, dtype=dtype))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(in_features, dtype=dtype))
                                if normalization != "RMSNorm" else None)
        self._init_gemm(in_features, out_features, dtype, init_method, bias, parallel_mode, sequence_parallel,
                        return_bias, tp_group)

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, **kwargs):
        normed = normalize(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
                           self.zero_centered_gamma)
        return self._output(normed)
