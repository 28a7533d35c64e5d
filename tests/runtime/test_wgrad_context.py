"""The B/W split reads fields of the context Megatron's linear forward fills; a missing one stops it loudly.

Before, the split read them through ``getattr`` defaults: a Megatron that renamed ``_fwd_used_autocast``
would have run every W outside the forward's autocast, and a renamed ``grad_output_buffer`` would have
split layers that Megatron already defers itself, with no word.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vshape.runtime.wgrad import CONTEXT_FIELDS, WeightGradStore, WgradError


def _linear(x, weight):
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    return linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False)


def _forward_that_loses(monkeypatch, field: str) -> None:
    """Megatron's forward, then the context loses ``field`` (as if Megatron had renamed it)."""
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Fn

    megatron_forward = Fn.forward

    def forward(ctx, *args, **kwargs):
        out = megatron_forward(ctx, *args, **kwargs)
        delattr(ctx, field)
        return out

    monkeypatch.setattr(Fn, "forward", staticmethod(forward))


@pytest.mark.parametrize("field", ["_fwd_used_autocast", "grad_output_buffer", "sequence_parallel"])
def test_a_context_field_megatron_no_longer_sets_stops_the_captured_backward(split, monkeypatch, field):
    assert field in CONTEXT_FIELDS
    _forward_that_loses(monkeypatch, field)
    weight = torch.nn.Parameter(torch.randn(6, 5))
    x = torch.randn(4, 3, 5, requires_grad=True)
    store = WeightGradStore()
    with pytest.raises(WgradError, match=f"autograd context has no {field};.*without B/W split"):
        with store.capture((0, 0)):
            torch.autograd.backward(_linear(x, weight), torch.randn(4, 3, 6))

