"""The vocabulary-parallel embedding of one call on one pipeline rank, per microbatch (runtime side).

Every rank looks up its rows of microbatch k's tokens; E(k) **reduces** the partial sums onto the first
stage's rank (after a TP all-reduce when TP > 1), which waits for it right before its F(0, k). After its
B(0, k) that rank **broadcasts** the embedding's gradient, D(k), and every rank adds its rows' weight
gradient straight into the fp32 ``main_grad`` (``EmbeddingGradTask``). The tokens a lookup needs come from
the first stage's rank too, per microbatch: T(k), a broadcast posted one slot before E(k)'s (at slot 0 for
the first two slots' lookups), so that no rank waits for them where they are used. All of these are posted
on the rank's vocabulary queue at the slots ``schedules/core/vocab_embedding.py`` gives (the call's
start, the start of an H, the call's end: points every rank passes in one order), and a collective the rank
does not need at once is waited for at the next slot.

No buffer holds all m microbatches: the first stage's rank reads its data items one slot ahead of their
lookup (:class:`LookaheadIterator`; its F(0, k) then gets the same items, in order) and holds an embedding
from its slot to its F, a gradient from its B to its slot; every rank holds a microbatch's tokens from T(k)
to D(k) (to E(k) when evaluating). A number of microbatches the schedule bounds, not m.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_vshape.schedules.core.vocab_embedding import EmbeddingSlots, token_slots

from .comm_queue import CommQueue, Pending

NO_TOKENS = -1  # never a token id: the first stage sends it when it could not read the tokens


class LookaheadIterator:
    """The first stage's data iterator, read ahead on demand (:meth:`read`) by the tokens' broadcasts: the
    forward steps get the same items, in order. Holds only the items read but not yet taken."""

    def __init__(self, iterator):
        self.source = iterator
        self.items: deque = deque()
        self.peak = 0  # the most items held at once

    def read(self):
        item = next(self.source)
        self.items.append(item)
        self.peak = max(self.peak, len(self.items))
        return item

    def held_bytes(self) -> int:
        return sum(_item_bytes(item) for item in self.items)

    def __iter__(self):
        return self

    def __next__(self):
        if self.items:
            return self.items.popleft()
        return next(self.source)


def _item_bytes(item) -> int:
    values = item.values() if isinstance(item, dict) else (item,)
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))


@dataclass
class EmbeddingPasses:
    """T, E and D of one call on one rank. ``first``: this rank holds stage 0; ``first_rank``: the pipeline
    rank that does; ``source``: on the first stage's rank, its data iterator read ahead (None elsewhere, and
    on a TP rank that reads no data); ``shape``: [b, s] of a microbatch's tokens."""

    layers: object  # VocabShardLayers
    queue: CommQueue
    slots: EmbeddingSlots
    shape: tuple[int, int]
    first: bool
    first_rank: int
    dtype: torch.dtype
    source: LookaheadIterator | None = None
    training: bool = True
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)  # k -> [b, s], from T(k) to D(k) (E(k))
    arriving: dict[int, Pending] = field(default_factory=dict)  # T(k) posted, not yet waited
    lookups: dict[int, tuple[Pending, torch.Tensor]] = field(default_factory=dict)  # first: E(k) arriving
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # first: B(0, k)'s gradient, until D(k)
    unsettled: list[tuple[Pending, int | None, torch.Tensor | None]] = field(default_factory=list)
    next_slot: int = 0
    peak_bytes: int = 0  # the most this rank held at once: tokens, items read ahead, embeddings, gradients
    problem: str | None = None  # why the first stage could not read tokens (its rank's message)

    def __post_init__(self):
        self._tokens_at = token_slots(self.slots)

    def _root(self) -> int:
        return dist.get_global_rank(self.layers.pp_group, self.first_rank)

    def run_slot(self, slot: int) -> None:
        """Slot ``slot``'s collectives (after settling the earlier slots'): the D, then the E (their tokens
        waited for), then the next slot's tokens posted."""
        if slot != self.next_slot:
            raise RuntimeError(f"vocabulary embedding: slot {slot} runs before slot {self.next_slot}")
        self.next_slot += 1
        self.settle()
        if slot == 0:
            for k in self.slots.lookups[0]:
                self._post_tokens(k)
        for k in self.slots.grads[slot]:
            self._post_grad(k)
        for k in self.slots.lookups[slot]:
            self._post_lookup(k, self._wait_tokens(k, check=slot == 0 or not self._on_gpu()))
        for k in self._tokens_at[slot]:
            self._post_tokens(k)
        self._count()

    def _on_gpu(self) -> bool:
        return self.layers.embedding_weight.device.type == "cuda"

    # --- T(k): the tokens ------------------------------------------------------------------------------

    def _post_tokens(self, k: int) -> None:
        b, s = self.shape
        tokens = torch.empty((b, s), dtype=torch.long, device=self.layers.embedding_weight.device)
        tp = self.layers.tp_group
        if self.first:
            tokens.fill_(NO_TOKENS)  # what every rank receives when the first stage cannot read them
            if self.source is not None and (tp.size() == 1 or tp.rank() == 0):  # TP rank 0 reads (as Megatron's)
                self.problem = self.problem or _read_tokens(tokens, self.source)
            elif tp.size() == 1:
                self.problem = "the first stage has no data iterator to read the tokens of its microbatches from"
            if tp.size() > 1:  # Megatron's other TP ranks read no data; the TP ranks of a stage run one program
                dist.broadcast(tokens, src=dist.get_global_rank(tp, 0), group=tp)
        src, pp = self._root(), self.layers.pp_group
        self.tokens[k] = tokens
        self.arriving[k] = self.queue.post(lambda: dist.broadcast(tokens, src=src, group=pp, async_op=True), (tokens,))

    def _wait_tokens(self, k: int, check: bool) -> torch.Tensor:
        self.arriving.pop(k).wait()
        tokens = self.tokens[k]
        # On the CPU every time; on a GPU at the call's start only (reading a device tensor back is a host sync).
        if check and bool((tokens == NO_TOKENS).any()):  # every rank stops here, none waits in a collective
            raise RuntimeError("--pipeline-vocab-parallel: "
                               f"{self.problem or 'the first stage could not read the tokens'}")
        if not self.training:
            self.tokens.pop(k)  # no D(k) to come
        return tokens

    # --- E(k) and D(k) ---------------------------------------------------------------------------------

    def _post_lookup(self, k: int, tokens: torch.Tensor) -> None:
        partial = self.layers.embed(tokens).to(self.dtype)
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
            self.layers.embedding_weight_grad(self.tokens.pop(k), grad)  # this rank's rows, from its own copy
        else:
            b, s = self.shape
            grad = torch.empty((b, s, self.layers.hidden_size), dtype=self.dtype,
                               device=self.layers.embedding_weight.device)
        pp = self.layers.pp_group
        posted = self.queue.post(lambda: dist.broadcast(grad, src=self._root(), group=pp, async_op=True), (grad,))
        self.unsettled.append((posted, None if self.first else k, grad))

    def settle(self) -> None:
        """Wait for what earlier slots posted and this rank does not wait for elsewhere; add the received
        gradients' weight gradients (and let their tokens go)."""
        for posted, k, tensor in self.unsettled:
            posted.wait()
            if k is not None:
                self.layers.embedding_weight_grad(self.tokens.pop(k), tensor)
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

    def held_bytes(self) -> int:
        held = sum(t.nbytes for _, t in self.lookups.values()) + sum(t.nbytes for t in self.grads.values())
        held += sum(t.nbytes for _, _, t in self.unsettled if t is not None)
        held += sum(t.nbytes for t in self.tokens.values())
        return held + (self.source.held_bytes() if self.source is not None else 0)

    def _count(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def finish(self) -> None:
        """The call's last slot, then everything settled."""
        self.run_slot(self.slots.num_slots - 1)
        self.settle()
        if self.lookups or self.grads or self.tokens or self.arriving:
            raise RuntimeError(f"--pipeline-vocab-parallel: embeddings {sorted(self.lookups)}, gradients "
                               f"{sorted(self.grads)} or tokens {sorted(self.tokens)} left at the end of the call")


def _read_tokens(tokens: torch.Tensor, source: LookaheadIterator) -> str | None:
    """The next data item's tokens into ``tokens`` ([b, s]); a one-line problem when there are none."""
    try:
        item = source.read()
    except StopIteration:
        return "the first stage's data iterator ran out before the call's last microbatch"
    found = item.get("tokens") if isinstance(item, dict) else None
    if found is None:
        return ("the first stage's data items must be dicts with 'tokens' (as Megatron's GPT datasets give), to look "
                "the embedding up on every rank")
    tokens.copy_(found.reshape(tokens.shape))
    return None
