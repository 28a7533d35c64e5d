"""The vocabulary-parallel embedding of one call on one pipeline rank, per microbatch (runtime side).

Every rank looks up its rows of microbatch k's tokens; E(k) **reduces** the partial sums onto the first
stage's rank (after a TP all-reduce when TP > 1), which waits for it right before its F(0, k). After its
B(0, k) that rank **broadcasts** the embedding's gradient, D(k), and every rank adds its rows' weight
gradient straight into the fp32 ``main_grad`` (``EmbeddingGradTask``). Both are posted on the rank's
vocabulary queue at the slots ``schedules/lowering/vocab_embedding.py`` gives (the call's start, the start
of an H, the call's end: points every rank passes in one order), and a collective the rank does not need
at once is waited for at the next slot. No buffer holds all m microbatches: the first stage's rank holds
an embedding from its slot to its F, a gradient from its B to its slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_vshape.schedules.lowering.vocab_embedding import EmbeddingSlots

from .comm_queue import CommQueue, Pending


@dataclass
class EmbeddingPasses:
    """E and D of one call on one rank. ``tokens``: [m, b, s] on every rank; ``first``: this rank holds
    stage 0; ``first_rank``: the pipeline rank that does."""

    layers: object  # VocabShardLayers
    queue: CommQueue
    slots: EmbeddingSlots
    tokens: torch.Tensor
    first: bool
    first_rank: int
    dtype: torch.dtype
    lookups: dict[int, tuple[Pending, torch.Tensor]] = field(default_factory=dict)  # first: E(k) arriving
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # first: B(0, k)'s gradient, until D(k)
    unsettled: list[tuple[Pending, int | None, torch.Tensor | None]] = field(default_factory=list)
    next_slot: int = 0
    peak_bytes: int = 0  # the most this rank held at once: embeddings, gradients, collectives in flight

    def _root(self) -> int:
        return dist.get_global_rank(self.layers.pp_group, self.first_rank)

    def run_slot(self, slot: int) -> None:
        """Slot ``slot``'s collectives (after settling the earlier slots'): the D, then the E."""
        if slot != self.next_slot:
            raise RuntimeError(f"vocabulary embedding: slot {slot} runs before slot {self.next_slot}")
        self.next_slot += 1
        self.settle()
        for k in self.slots.grads[slot]:
            self._post_grad(k)
        for k in self.slots.lookups[slot]:
            self._post_lookup(k)
        self._count()

    def _post_lookup(self, k: int) -> None:
        partial = self.layers.embed(self.tokens[k]).to(self.dtype)
        tp = self.layers.tp_group
        if tp.size() > 1:  # the TP ranks of one stage run the same program: blocking is a rendezvous among peers
            dist.all_reduce(partial, group=tp)
        pp = self.layers.pp_group
        posted = self.queue.post(lambda: dist.reduce(partial, dst=self._root(), group=pp, async_op=True), (partial,))
        if self.first:
            self.lookups[k] = (posted, partial)
        else:
            self.unsettled.append((posted, None, partial))

    def _post_grad(self, k: int) -> None:
        if self.first:
            if k not in self.grads:
                raise RuntimeError(f"--pipeline-vocab-parallel: no embedding gradient for microbatch {k} at its slot")
            grad = self.grads.pop(k).to(self.dtype).contiguous()
            self.layers.embedding_weight_grad(self.tokens[k], grad)  # this rank's rows, from its own copy
        else:
            b, s = self.tokens.shape[1:]
            grad = torch.empty((b, s, self.layers.hidden_size), dtype=self.dtype, device=self.tokens.device)
        pp = self.layers.pp_group
        posted = self.queue.post(lambda: dist.broadcast(grad, src=self._root(), group=pp, async_op=True), (grad,))
        self.unsettled.append((posted, None if self.first else k, grad))

    def settle(self) -> None:
        """Wait for what earlier slots posted and this rank does not wait for elsewhere; add the received
        gradients' weight gradients."""
        for posted, k, tensor in self.unsettled:
            posted.wait()
            if k is not None:
                self.layers.embedding_weight_grad(self.tokens[k], tensor)
        self.unsettled.clear()

    def embedding(self, k: int) -> torch.Tensor:
        """First stage, before its F(0, k): the summed embedding of microbatch k."""
        posted, partial = self.lookups.pop(k)
        posted.wait()
        return partial

    def keep_grad(self, k: int, grad: torch.Tensor) -> None:
        """First stage, after its B(0, k): the gradient of the embedding it was handed, until D(k)'s slot."""
        self.grads[k] = grad
        self._count()

    def _count(self) -> None:
        held = sum(t.nbytes for _, t in self.lookups.values()) + sum(t.nbytes for t in self.grads.values())
        held += sum(t.nbytes for _, _, t in self.unsettled if t is not None)
        self.peak_bytes = max(self.peak_bytes, held)

    def finish(self) -> None:
        """The call's last slot, then everything settled."""
        self.run_slot(self.slots.num_slots - 1)
        self.settle()
        if self.lookups or self.grads:
            raise RuntimeError(f"--pipeline-vocab-parallel: embeddings {sorted(self.lookups)} or gradients "
                               f"{sorted(self.grads)} left at the end of the call")
