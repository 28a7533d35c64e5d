"""``--pipeline-vocab-parallel`` in bf16: where its sums are taken, against an fp32 (fp64) reference.

Megatron adds each microbatch's embedding gradient into the fp32 ``main_grad``, and its unsharded output
layer sums the hidden state's gradient over the whole vocabulary inside one GEMM (fp32 accumulation, one
rounding). The vocabulary passes must not round more than that: the embedding's rows are summed in fp32
(a frequent token's row adds up thousands of values, which a bf16 sum rounds away), and the shards' parts
of the hidden state's gradient stay fp32 through their all-reduce and are cast once.

The token count is a realistic call's (64k tokens, as 8 microbatches of 2 x 4096), with token ids drawn
from a Zipf law, as real text repeats its frequent tokens.
"""

from __future__ import annotations

import pytest

TOKENS, HIDDEN, VOCAB = 65536, 16, 1024


def _zipf_tokens(generator, count: int, vocab: int):
    import torch

    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, count, replacement=True, generator=generator)


class _Group:
    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_the_embedding_gradient_is_summed_in_fp32_main_grad():
    """64k tokens into a bf16 shard whose main_grad is fp32 (Megatron's DDP), per microbatch as the W passes
    add them. A bf16 sum of each microbatch's rows (the old W) was off by 2.8e-3 of the largest row."""
    import torch

    from megatron_vshape.megatron.vocab_layers import VocabShardLayers

    gen = torch.Generator().manual_seed(3)
    tokens = _zipf_tokens(gen, TOKENS, VOCAB).view(8, 2, -1)  # 8 microbatches of [b 2, s 4096]
    grads = torch.randn(8, 2, TOKENS // 16, HIDDEN, generator=gen).to(torch.bfloat16)
    layers = VocabShardLayers(VOCAB, HIDDEN, tied=False, tp_group=_Group(), pp_group=_Group(), dp_cp_group=_Group(),
                              dtype=torch.bfloat16)
    layers.embedding_weight.main_grad = torch.zeros(VOCAB, HIDDEN, dtype=torch.float32)
    for k in range(8):
        layers.embedding_weight_grad(tokens[k], grads[k])
    want = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64).index_add_(
        0, tokens.reshape(-1), grads.reshape(-1, HIDDEN).double())
    got = layers.embedding_weight.main_grad.double()
    error = float((got - want).abs().max() / want.abs().max())
    assert error <= 1e-6, error
    assert layers.embedding_weight.grad is None  # straight into main_grad, as Megatron's hook leaves it


def _hidden_grad_rank(rank: int, world_size: int):
    import torch
    import torch.distributed as dist

    from megatron_vshape.runtime import vocab_parallel as vp

    rows = VOCAB // world_size
    gen = torch.Generator().manual_seed(11)
    # every rank draws the same full tensors and keeps its rows: the reference sums all of them
    probs = torch.rand(TOKENS // 16, VOCAB, generator=gen).to(torch.bfloat16)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    part = slice(rank * rows, (rank + 1) * rows)
    state = vp.OutputState(hidden=torch.zeros(TOKENS // 16, HIDDEN, dtype=torch.bfloat16),
                           probs=probs[:, part].float().contiguous(),
                           target_local=torch.full((TOKENS // 16,), -1, dtype=torch.long),
                           loss=torch.zeros(TOKENS // 16))
    grad, _task = vp.output_backward(state, weight[part].contiguous(), torch.ones(TOKENS // 16),
                                     (dist.group.WORLD,))
    want = (probs.double() @ weight.double()).to(torch.bfloat16)  # one rounding of the exact sum
    got = grad.to(torch.bfloat16)  # the caller's one cast
    return {"dtype": str(grad.dtype), "equal": float((got == want).float().mean())}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_hidden_gradient_is_summed_over_the_shards_in_fp32_and_cast_once():
    """Four shards' parts of the hidden state's gradient: the sum, cast once to bf16, equals the exact sum
    rounded once in (nearly) every element. Parts rounded to bf16 and summed in bf16 (the old T pass)
    matched in 52 % of the elements."""
    from megatron_vshape.testing.spawn import spawn

    for result in spawn(_hidden_grad_rank, 4, (), timeout=100):
        assert result["dtype"] == "torch.float32", result
        assert result["equal"] >= 0.999, result
