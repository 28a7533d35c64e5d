"""The arithmetic of the one-rendezvous H pass (runtime/vocab_parallel.py, runtime/vocab_h.py), in one process.

The hidden state's gradient is taken as ``g * (sum_s scale_s * A_s - sum_s B_s)``: every shard's part per
unit loss gradient, summed (the runtime's reduce), then multiplied by the loss gradient g on the last
stage. Here three shards of one vocabulary run side by side and their sum is compared with autograd on the
full vocabulary; and no step reads a tensor back to the host (``torch.nonzero`` is a sync on a GPU).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megatron_vshape.runtime import vocab_parallel as vp  # noqa: E402

TOKENS, HIDDEN, VOCAB, SHARDS = 10, 6, 23, 3


def _problem():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 3  # large logits: the max matters
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    grad_loss = torch.rand(TOKENS, generator=gen) * (torch.rand(TOKENS, generator=gen) > 0.3)
    return weight, hidden, labels, grad_loss


def _shards():
    bounds = [vp.shard_rows(VOCAB, SHARDS, s) for s in range(SHARDS)]
    return [vp.VocabShard(start, end) for start, end in bounds]


def test_the_parts_per_unit_loss_gradient_sum_to_the_hidden_gradient_and_the_weight_gradients_match():
    weight, hidden, labels, grad_loss = _problem()
    ref_w, ref_h = weight.double().requires_grad_(), hidden.double().requires_grad_()  # fp64 reference
    ref_loss = torch.nn.functional.cross_entropy(ref_h @ ref_w.t(), labels, reduction="none")
    ref_loss.backward(grad_loss.double())

    shards = _shards()
    states = [vp.local_output(hidden, weight[s.start:s.end], labels, s) for s in shards]
    parts = [vp.unit_grad_parts(state, weight[s.start:s.end]) for state, s in zip(states, shards)]
    gathered = torch.stack([state.stats for state in states])  # the all-gather
    for state in states:
        vp.combine_statistics(state, gathered)
    summed = sum(vp.unit_hidden_grad(state, part) for state, part in zip(states, parts))  # the reduce
    grad_hidden = summed * grad_loss.unsqueeze(-1)  # on the last stage
    for state in states:
        assert torch.allclose(state.loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad_hidden.double(), ref_h.grad, rtol=1e-5, atol=1e-5)
    for state, s in zip(states, shards):
        grad_w = vp.logits_grad(state, grad_loss, torch.float32).t() @ state.hidden
        assert torch.allclose(grad_w.double(), ref_w.grad[s.start:s.end], rtol=1e-5, atol=1e-5)


def test_no_step_reads_a_tensor_back_to_the_host(monkeypatch):
    """The one-hot of the target went in through ``torch.nonzero`` (a host sync per microbatch on a GPU)."""
    weight, hidden, labels, grad_loss = _problem()
    shard = _shards()[1]
    rows = weight[shard.start:shard.end]

    def refuse(*args, **kwargs):
        raise AssertionError("a host sync (torch.nonzero) in the vocabulary passes")

    monkeypatch.setattr(torch, "nonzero", refuse)
    monkeypatch.setattr(torch.Tensor, "nonzero", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    single = vp.output_forward(hidden, rows, labels, shard, ())  # the blocking form, no groups
    vp.output_backward(single, rows, grad_loss, ())
    state = vp.local_output(hidden, rows, labels, shard)  # H's steps
    part = vp.unit_grad_parts(state, rows)
    vp.combine_statistics(state, state.stats.unsqueeze(0))
    vp.unit_hidden_grad(state, part)
    vp.logits_grad(state, grad_loss, torch.float32)


def test_in_bf16_the_shards_parts_sum_in_fp32_and_round_once():
    """bf16 weights, 4096 tokens, four shards: the parts per unit loss gradient (each an fp32 GEMM of bf16
    inputs) summed in fp32, as the reduce sums them, and cast once equal the exact sum rounded once in
    (nearly) every element; summed in bf16 they do not (as test_vocab_numerics shows for the blocking form)."""
    tokens, hidden, vocab, shards = 4096, 16, 1024, 4
    gen = torch.Generator().manual_seed(11)
    exp = torch.rand(tokens, vocab, generator=gen).to(torch.bfloat16)  # exp(logit - local max), bf16-exact
    weight = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16)
    rows = vocab // shards
    parts = []
    for s in range(shards):
        part = slice(s * rows, (s + 1) * rows)
        state = vp.OutputState(hidden=torch.zeros(tokens, hidden, dtype=torch.bfloat16),
                               probs=exp[:, part].float().contiguous(),
                               target_local=torch.full((tokens,), -1, dtype=torch.long),
                               scale=torch.ones(tokens))
        parts.append(vp.unit_hidden_grad(state, vp.unit_grad_parts(state, weight[part].contiguous())))
    assert all(p.dtype == torch.float32 for p in parts)
    want = (exp.double() @ weight.double()).to(torch.bfloat16)
    summed = sum(parts).to(torch.bfloat16)
    assert float((summed == want).float().mean()) >= 0.999
    in_bf16 = sum(p.to(torch.bfloat16) for p in parts)
    assert float((in_bf16 == want).float().mean()) < 0.9
