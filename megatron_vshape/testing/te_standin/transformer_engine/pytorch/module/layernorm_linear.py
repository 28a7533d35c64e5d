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
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.normalization, self.zero_centered_gamma = normalization, zero_centered_gamma
        self.parallel_mode, self.sequence_parallel, self.return_bias = parallel_mode, sequence_parallel, return_bias
        self.tp_group = tp_group
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(in_features, dtype=dtype))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(in_features, dtype=dtype))
                                if normalization != "RMSNorm" else None)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        if init_method is not None:
            init_method(self.weight)
        self.use_bias = bias
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self._mark_deferring_weights()

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, **kwargs):
        normed = normalize(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
                           self.zero_centered_gamma)
        out = self._linear(normed)
        if self.return_bias:
            return out, self.bias
        return out + self.bias if self.bias is not None else out
