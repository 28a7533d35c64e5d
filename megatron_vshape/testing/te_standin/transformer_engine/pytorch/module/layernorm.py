"""LayerNorm and RMSNorm (torch maths); ``zero_centered_gamma`` as TE defines it (weight + 1)."""

import torch


def normalize(x, weight, bias, eps, normalization, zero_centered_gamma):
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    return torch.nn.functional.layer_norm(x, x.shape[-1:], gamma, bias, eps)


class LayerNorm(torch.nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, sequence_parallel=False, params_dtype=None, zero_centered_gamma=False,
                 device="cpu", **kwargs):
        super().__init__()
        dtype = params_dtype or torch.float32
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(normalized_shape, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(normalized_shape, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel

    def forward(self, x):
        return normalize(x, self.weight, self.bias, self.eps, "LayerNorm", self.zero_centered_gamma)


class RMSNorm(LayerNorm):
    def __init__(self, normalized_shape, eps=1e-5, sequence_parallel=False, params_dtype=None, zero_centered_gamma=False,
                 device="cpu", **kwargs):
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype, zero_centered_gamma, device)
        del self.bias
        self.bias = None

    def forward(self, x):
        return normalize(x, self.weight, None, self.eps, "RMSNorm", self.zero_centered_gamma)
