"""GroupedLinear (MoE grouped GEMM) is not stood in: its wrappers import, building one raises."""

import torch


class GroupedLinear(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the TE stand-in has no GroupedLinear (use --moe-grouped-gemm on a GPU)")

    def backward_dw(self):
        raise NotImplementedError("the TE stand-in has no GroupedLinear")
