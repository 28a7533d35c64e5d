"""What the H pass keeps for G, against the planner's bytes (issue 42), CPU, gloo, two spawned ranks.

Two pipeline ranks run ``runtime/vocab_h.HPass`` on one vocabulary in bf16 (the pipeline dtype the planner
assumes), in the order the generators place the passes (every G(k) after H(k+1): g(k) rides in H(k+1)'s
broadcast): H0 H1 G0 H2 G1 G2. After each H, every tensor reachable from what the pass keeps for G (its
storages, each counted once) is summed per microbatch and over the rank, and compared with
``planner.memory``:

* one microbatch right after its H holds the planner's ``vocab_activation_bytes`` (the fp32 softmax, the bf16
  hidden state, the per-token tensors: the old count, bf16 logits' gradients and the hidden state, was half
  of it) plus, on the rank other than the last stage's, ``vocab_send_bytes`` (the reduce's fp32 send buffer);
* the send buffer is let go at the next H (the wait in G(k), after H(k+1), kept two alive on that rank), as
  ``schedules/core/vocab_embedding.send_events`` says for this program.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

SEQ, BATCH, HIDDEN, VOCAB, LAYERS, HEADS = 16, 2, 64, 2048, 2, 4
ORDER = (("H", 0), ("H", 1), ("G", 0), ("H", 2), ("G", 1), ("G", 2))
CARRIED = {0: 1, 1: 2}  # g(k) rides in H(k + 1)'s broadcast; H2's g has a broadcast of its own


def _storages(obj, out: dict) -> None:
    """Every tensor storage reachable from ``obj`` (dataclasses, tuples, a pending collective's tensors)."""
    import dataclasses

    import torch

    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _storages(item, out)
    elif dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            _storages(getattr(obj, field.name), out)
    elif hasattr(obj, "_tensors"):  # comm_queue.Pending
        _storages(obj._tensors, out)


def held_rank(rank: int, world_size: int):
    import torch
    import torch.distributed as dist

    from megatron_vshape.runtime import vocab_parallel as vp
    from megatron_vshape.runtime.comm_queue import CommQueue
    from megatron_vshape.runtime.vocab_h import HPass

    torch.manual_seed(3)  # the same weight, hidden state and labels on both ranks
    full = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
    hidden = torch.randn(SEQ, BATCH, HIDDEN).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))

    class OneRank:
        def size(self):
            return 1

    class Layers:
        pp_group, tp_group = dist.group.WORLD, OneRank()
        shard = vp.VocabShard.of(VOCAB, 1, 0, world_size, rank)
        output_weight = torch.nn.Parameter(full[shard.start:shard.end].clone())
        embedding_weight = output_weight
        hidden_size = HIDDEN

        def pass_weight(self):
            return self.output_weight.detach()

        def output_weight_grad_task(self, compute):
            return lambda: self.output_weight.main_grad.add_(compute())

    layers = Layers()
    layers.output_weight.main_grad = torch.zeros(layers.shard.rows, HIDDEN)
    last = world_size - 1
    h = HPass(layers, CommQueue("vocabulary", torch.device("cpu")), rank, last, torch.bfloat16, dict(CARRIED))
    holder = rank == last
    per_microbatch, totals = {}, []
    for kind, k in ORDER:
        if kind == "G":
            h.weight_grad(k)
            continue
        h.run(k, (SEQ, BATCH, HIDDEN), hidden if holder else None, labels if holder else None,
              (lambda per_token: torch.full_like(per_token, 1.0 / per_token.numel())) if holder else None, True)
        storages = {}
        _storages(h.held[k], storages)
        per_microbatch[k] = sum(storages.values())
        every = {}
        for held in h.held.values():
            _storages(held, every)
        totals.append(sum(every.values()))
    return {"per_microbatch": per_microbatch, "totals": totals}


@pytest.mark.timeout(300)
def test_the_planner_counts_what_h_keeps_for_g_and_the_send_buffer_goes_at_the_next_h():
    from megatron_vshape.planner.memory import vocab_activation_bytes, vocab_send_bytes
    from megatron_vshape.planner.model import GPTModel
    from megatron_vshape.planner.parallel_layout import ParallelLayout
    from megatron_vshape.schedules.core.actions import Action, VocabKind
    from megatron_vshape.schedules.core.vocab_embedding import send_events
    from megatron_vshape.testing import spawn

    model = GPTModel("tiny", LAYERS, HIDDEN, HEADS, SEQ, vocab=VOCAB)
    layout = ParallelLayout(1, 1, 2, BATCH, BATCH)
    held, _ = vocab_activation_bytes(model, layout)
    send = vocab_send_bytes(model, layout)
    tokens = SEQ * BATCH
    old = 2 * tokens * VOCAB // 2 + 2 * tokens * HIDDEN  # the former count: bf16 logits' gradients, hidden state
    assert held > 1.9 * old

    results = spawn(held_rank, 2, (), timeout=240)
    for rank, row in enumerate(results):
        own = send if rank == 0 else 0.0  # rank 1 holds the last stage: it receives the reduce
        for k, nbytes in row["per_microbatch"].items():
            # the per-token tensors: the planner counts their most (g riding in this H's buffer; H0 carries none)
            assert 0 <= held + own - nbytes <= 4 * tokens, (rank, k, nbytes, held + own)
        # After H1: microbatches 0 and 1 held, and only H1's send buffer (H0's went at H1); after H2: 1 and 2.
        expected = [held + own, 2 * held + own, 2 * held + own]
        assert all(0 <= want - got <= 8 * tokens for got, want in zip(row["totals"], expected)), (rank, row)

    program = [Action(VocabKind.H if kind == "H" else VocabKind.G, 0, k) for kind, k in ORDER]
    assert send_events([program, program], 1) == (((0, 1), (5, -1)), ())  # one buffer, H0 to G2
