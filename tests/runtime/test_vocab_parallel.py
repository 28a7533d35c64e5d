"""Vocabulary parallelism's passes (runtime/vocab_parallel.py) against one process, on gloo ranks.

The vocabulary is sharded over TP x PP ranks (each TP shard split again over the pipeline ranks, unevenly
when they do not divide it). The loss, the hidden state's gradient and every rank's weight gradients of
the output layer and the input embedding must equal a one-process computation on the full vocabulary.
"""

from __future__ import annotations

import pytest

from megatron_vshape.runtime.vocab_parallel import VocabShard, shard_rows

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

TOKENS, HIDDEN = 12, 8


def test_shards_are_contiguous_cover_the_rows_and_differ_by_at_most_one():
    for rows in (7, 8, 30, 128):
        for parts in (1, 2, 3, 4):
            bounds = [shard_rows(rows, parts, i) for i in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [end - start for start, end in bounds]
            assert max(sizes) - min(sizes) <= 1
    # pipeline rank s holds the s-th part of its TP shard's rows
    assert VocabShard.of(32, 2, 1, 2, 0) == VocabShard(16, 24)
    with pytest.raises(ValueError, match="divide by the TP size"):
        VocabShard.of(33, 2, 0, 2, 0)


def _reference(vocab: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, HIDDEN, generator=gen)
    embedding = torch.randn(vocab, HIDDEN, generator=gen)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    labels = torch.randint(0, vocab, (TOKENS,), generator=gen)
    tokens = torch.randint(0, vocab, (TOKENS,), generator=gen)
    grad_loss = torch.rand(TOKENS, generator=gen) * (torch.rand(TOKENS, generator=gen) > 0.2)  # a loss mask
    grad_embedded = torch.randn(TOKENS, HIDDEN, generator=gen)
    return weight, embedding, hidden, labels, tokens, grad_loss, grad_embedded


def vocab_rank(rank: int, world_size: int, tp: int, vocab: int):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    from megatron_vshape.runtime import vocab_parallel as vp

    pp = world_size // tp
    tp_rank, pp_rank = rank % tp, rank // tp
    tp_groups = [dist.new_group([p * tp + t for t in range(tp)]) for p in range(pp)]
    pp_groups = [dist.new_group([p * tp + t for p in range(pp)]) for t in range(tp)]
    groups = (tp_groups[pp_rank], pp_groups[tp_rank])
    shard = vp.VocabShard.of(vocab, tp, tp_rank, pp, pp_rank)
    weight, embedding, hidden, labels, tokens, grad_loss, grad_embedded = _reference(vocab, seed=7)

    # one process, the full vocabulary
    ref_w, ref_h = weight.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_h @ ref_w.t(), labels, reduction="none")
    ref_loss.backward(grad_loss)

    # this rank's passes
    rows = slice(shard.start, shard.end)
    state = vp.output_forward(hidden, weight[rows].contiguous(), labels, shard, groups)
    loss = state.loss.clone()
    grad_hidden, weight_task = vp.output_backward(state, weight[rows].contiguous(), grad_loss, groups)
    grad_weight = weight_task()
    embedded = vp.embedding_forward(tokens, embedding[rows].contiguous(), shard, groups)
    grad_embedding = vp.embedding_weight_grad(tokens, grad_embedded, shard)

    def err(got, want):
        return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))

    return {
        "rows": shard.rows,
        "loss": err(loss, ref_loss.detach()),
        "grad_hidden": err(grad_hidden, ref_h.grad),
        "grad_weight": err(grad_weight, ref_w.grad[rows]),
        "embedded": err(embedded, embedding[tokens]),
        "grad_embedding": err(grad_embedding, torch.zeros_like(embedding).index_add_(0, tokens, grad_embedded)[rows]),
    }


@pytest.mark.parametrize("world_size, tp, vocab", [(2, 1, 32), (4, 1, 30), (4, 2, 32)],
                         ids=["pp2", "pp4-uneven", "tp2-pp2"])
def test_loss_and_every_gradient_equal_one_process(world_size, tp, vocab):
    from megatron_vshape.testing.spawn import spawn

    results = spawn(vocab_rank, world_size, (tp, vocab), timeout=120)
    assert sum(r["rows"] for r in results) == vocab  # every row held once
    for rank, result in enumerate(results):
        for name in ("loss", "grad_hidden", "grad_weight", "embedded", "grad_embedding"):
            assert result[name] <= 1e-6, (rank, name, result)


def prologue_without_tokens(rank: int, world_size: int, items: list):
    """PP 2, TP 1: the first stage's data items have no tokens; every rank must get the one-line error."""
    import torch
    import torch.distributed as dist

    from megatron_vshape.runtime.vocab_iteration import VocabPasses
    from megatron_vshape.schedules.core.schedule import Placement

    class Layers:  # what VocabPasses reads of the shard layers before the error
        tp_group = dist.new_group([rank])
        pp_group = dist.group.WORLD
        embedding_weight = torch.zeros(1)
        hidden_size = HIDDEN

    passes = VocabPasses(Layers(), Placement.v_shape(world_size), rank, num_microbatches=2, micro_batch_size=1,
                         seq_length=3, dtype=torch.float32, forward_only=False)
    try:
        passes.prologue(iter(items) if rank == 0 else None)
    except RuntimeError as error:
        return str(error)
    return None


def test_a_first_stage_without_tokens_stops_every_rank_in_one_line():
    from megatron_vshape.testing import spawn

    items = [{"text": "no tokens"}, {"text": "no tokens"}]
    errors = spawn(prologue_without_tokens, 2, (items,), timeout=60)
    assert all(error is not None and "must be dicts with 'tokens'" in error for error in errors[:1]), errors
    assert errors[1] is not None and "--pipeline-vocab-parallel" in errors[1], errors  # not a hang in a collective
